"""Gemma 3 with images (``Gemma3ForConditionalGeneration``): a SigLIP vision tower, Gemma 3's projector, the Gemma 3
text model of ``gemma.py``.

An image (the processor's square ``image_size`` input) goes through the tower: patch embeddings plus learned
position embeddings (no CLS position), the encoder layers, ``post_layernorm``. The projector average-pools the
``side x side`` patch grid to ``mm_tokens_per_image`` embeddings (a square grid), normalizes them with Gemma's
``(1 + weight)`` RMSNorm and multiplies by ``mm_input_projection_weight`` ``[vision_hidden, text_hidden]``. The
prompt holds each image as ``<start_of_image>`` + ``mm_tokens_per_image`` image tokens + ``<end_of_image>``
(``pagedllm/multimodal/processing.py``); the image tokens' rows take the embeddings.

Attention: the tokens of one image see each other both ways (transformers' ``token_type_ids`` block mask, on top
of the causal mask and, in local layers, the sliding window); everything else is causal. The runner marks steps
that compute image tokens (``AttentionMetadata.bidirectional_spans``, ``bidirectional_image_attention`` below) and
the scheduler never splits an image's tokens over two steps, so each image's block is whole within one step.

Checkpoints: transformers 5 names (``model.vision_tower.vision_model.*``, ``model.multi_modal_projector.*``,
``model.language_model.*``, ``lm_head.*``) and the older ones (``vision_tower.vision_model.*``,
``language_model.model.*``) both load (``LlavaForConditionalGeneration.checkpoint_name``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from pagedllm.attention.base import AttentionBackend
from pagedllm.models.gemma import Gemma3ForCausalLM, GemmaRMSNorm
from pagedllm.models.llava import CLIPEncoderLayer, LlavaForConditionalGeneration
from pagedllm.multimodal.processing import sub_config


class SiglipVisionEmbeddings(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.patch_size = int(config.patch_size)
        dim = int(config.hidden_size)
        self.patch_embedding = nn.Conv2d(
            int(getattr(config, "num_channels", 3)), dim, self.patch_size, self.patch_size
        )
        self.num_positions = (int(config.image_size) // self.patch_size) ** 2
        self.position_embedding = nn.Embedding(self.num_positions, dim)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [N, 3, H, W] -> [N, P, D]
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(weight.dtype)).flatten(2).transpose(1, 2)  # [N, P, D]
        return patches + self.position_embedding.weight


class SiglipEncoder(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(config) for _ in range(int(config.num_hidden_layers)))


class SiglipVisionTower(nn.Module):
    """SigLIP's vision transformer without its pooling head: the last hidden state after ``post_layernorm``."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.embeddings = SiglipVisionEmbeddings(config)
        self.encoder = SiglipEncoder(config)
        self.post_layernorm = nn.LayerNorm(
            int(config.hidden_size), eps=float(getattr(config, "layer_norm_eps", 1e-6))
        )

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [N, 3, H, W] -> [N, P, D]
        x = self.embeddings(pixel_values)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class Gemma3MultiModalProjector(nn.Module):
    def __init__(self, config: Any, vision_config: Any, text_dim: int) -> None:
        super().__init__()
        vision_dim = int(vision_config.hidden_size)
        self.mm_input_projection_weight = nn.Parameter(torch.empty(vision_dim, text_dim))
        self.mm_soft_emb_norm = GemmaRMSNorm(
            vision_dim, float(getattr(vision_config, "layer_norm_eps", 1e-6))
        )
        self.side = int(vision_config.image_size) // int(vision_config.patch_size)  # patches a side
        tokens_side = int(round(int(config.mm_tokens_per_image) ** 0.5))
        if tokens_side * tokens_side != int(config.mm_tokens_per_image) or self.side % tokens_side:
            raise ValueError(
                f"Gemma3ForConditionalGeneration: mm_tokens_per_image ({config.mm_tokens_per_image}) must be a square "
                f"whose side divides the {self.side}x{self.side} patch grid"
            )
        self.kernel = self.side // tokens_side

    def forward(
        self, x: torch.Tensor
    ) -> torch.Tensor:  # [N, P, D_vision] -> [N, mm_tokens_per_image, D_text]
        n, _, d = x.shape
        grid = x.transpose(1, 2).reshape(n, d, self.side, self.side)  # [N, D, side, side]
        pooled = (
            nn.functional.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        )  # [N, M, D]
        return (self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight).to(x.dtype)


class Gemma3ForConditionalGeneration(LlavaForConditionalGeneration):
    packed_modules_mapping = Gemma3ForCausalLM.packed_modules_mapping
    supports_multimodal = True
    bidirectional_image_attention = (
        True  # one image's tokens attend to each other both ways (module docstring)
    )

    def __init__(self, config: Any, attn_backend: AttentionBackend, tp: Any = None, pp: Any = None) -> None:
        nn.Module.__init__(self)
        if pp is not None:
            raise ValueError(f"{type(self).__name__}: pipeline_parallel_size > 1 is not supported yet")
        self.config = config
        vision_config = sub_config(config, "vision_config")
        text_config = sub_config(config, "text_config")
        if getattr(vision_config, "vision_use_head", False):
            raise ValueError(
                "Gemma3ForConditionalGeneration: a SigLIP tower with vision_use_head is not supported"
            )
        self.vision_tower = SiglipVisionTower(vision_config)
        self.multi_modal_projector = Gemma3MultiModalProjector(
            config, vision_config, int(text_config.hidden_size)
        )
        self.language_model = Gemma3ForCausalLM(text_config, attn_backend, tp=tp)

    def checkpoint_name(self, name: str) -> str | None:
        if ".head." in name and "vision_tower" in name:
            return None  # a SigLIP pooling head some towers carry (unused: vision_use_head is off)
        return super().checkpoint_name(name)

    def embed_multimodal(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, 3, H, W] images -> [N, mm_tokens_per_image, hidden_size] embeddings."""
        return self.multi_modal_projector(self.vision_tower(pixel_values))

    def embed_images(self, datas: list[dict[str, Any]]) -> list[torch.Tensor]:
        param = self.multi_modal_projector.mm_input_projection_weight
        pixels = torch.from_numpy(np.stack([d["pixel_values"] for d in datas])).to(param.device, param.dtype)
        return list(self.embed_multimodal(pixels))
