"""LLaVA-1.5 (``LlavaForConditionalGeneration``): a CLIP vision tower, a 2-layer MLP projector, a Llama text model.

An image's pixels go through the tower (``vision_feature_layer``: which hidden state(s) to take, concatenated when
a list; ``vision_feature_select_strategy`` "default" drops the CLS position), then the projector, giving one
embedding per placeholder token (``pagedllm/multimodal/processing.py`` expands the placeholders to match). The
text model is our Llama; the runner hands it ``inputs_embeds`` with the image embeddings written over the
placeholder rows for steps that compute placeholder tokens, and plain ``input_ids`` otherwise (decode steps stay
text-only, so their CUDA graphs are unchanged).

Checkpoints: transformers 5 names (``model.vision_tower.*``, ``model.multi_modal_projector.*``,
``model.language_model.*``, ``lm_head.*``) and the older llava-hf names (``vision_tower.vision_model.*``,
``language_model.model.*``, ``language_model.lm_head.*``) both load (``checkpoint_name``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.base import AttentionBackend, AttentionMetadata
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.multimodal.processing import select_best_resolution, sub_config


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


_ACTS = {
    "quick_gelu": _quick_gelu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


def vision_activation(name: str):
    if name not in _ACTS:
        raise ValueError(f"unsupported activation {name!r} in the vision tower / projector; supported: {sorted(_ACTS)}")
    return _ACTS[name]


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.patch_size = int(config.patch_size)
        dim = int(config.hidden_size)
        self.class_embedding = nn.Parameter(torch.empty(dim))
        self.patch_embedding = nn.Conv2d(
            int(getattr(config, "num_channels", 3)), dim, self.patch_size, self.patch_size, bias=False
        )
        self.num_positions = (int(config.image_size) // self.patch_size) ** 2 + 1
        self.position_embedding = nn.Embedding(self.num_positions, dim)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [N, 3, H, W] -> [N, P + 1, D]
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(weight.dtype))  # [N, D, H / p, W / p]
        patches = patches.flatten(2).transpose(1, 2)  # [N, P, D]
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)  # [N, 1, D]
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight  # [N, P + 1, D]


class CLIPAttention(nn.Module):
    """Bidirectional multi-head attention over one image's positions (q/k/v named so that the loader's fused
    q/k/v mapping of the text model does not apply to them)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        dim = int(config.hidden_size)
        self.num_heads = int(config.num_attention_heads)
        self.head_dim = dim // self.num_heads
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, S, D] -> [N, S, D]
        n, s, d = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # [N, S, D] -> [N, heads, S, head_dim]
            return t.view(n, s, self.num_heads, self.head_dim).transpose(1, 2)

        o = F.scaled_dot_product_attention(
            heads(self.query(x)), heads(self.key(x)), heads(self.value(x)), scale=1.0 / math.sqrt(self.head_dim)
        )  # [N, heads, S, head_dim]
        return self.out_proj(o.transpose(1, 2).reshape(n, s, d))


class CLIPMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.fc1 = nn.Linear(int(config.hidden_size), int(config.intermediate_size))
        self.fc2 = nn.Linear(int(config.intermediate_size), int(config.hidden_size))
        self.act = vision_activation(getattr(config, "hidden_act", "quick_gelu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        eps = float(getattr(config, "layer_norm_eps", 1e-5))
        self.layer_norm1 = nn.LayerNorm(int(config.hidden_size), eps=eps)
        self.self_attn = CLIPAttention(config)
        self.layer_norm2 = nn.LayerNorm(int(config.hidden_size), eps=eps)
        self.mlp = CLIPMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, S, D]
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(config) for _ in range(int(config.num_hidden_layers)))


class CLIPVisionTower(nn.Module):
    """CLIP's vision transformer; ``forward`` returns the hidden states LLaVA asks for (index 0: the embeddings
    after ``pre_layrnorm``, index i: layer i's output, as transformers' ``hidden_states``)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        eps = float(getattr(config, "layer_norm_eps", 1e-5))
        self.embeddings = CLIPVisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(int(config.hidden_size), eps=eps)
        self.encoder = CLIPEncoder(config)
        self.post_layernorm = nn.LayerNorm(int(config.hidden_size), eps=eps)  # pooled output only: unused here

    def forward(self, pixel_values: torch.Tensor, layers: list[int]) -> list[torch.Tensor]:
        """Hidden states ``layers`` (indices into [embeddings, layer 1, ..., layer L], negative from the end), each
        [N, P + 1, D]; only the layers up to the deepest one asked for run."""
        num_states = len(self.encoder.layers) + 1
        wanted = [i % num_states for i in layers]
        states = [self.pre_layrnorm(self.embeddings(pixel_values))]
        for layer in self.encoder.layers[: max(wanted)]:
            states.append(layer(states[-1]))
        return [states[i] for i in wanted]


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, config: Any, vision_dim: int, text_dim: int) -> None:
        super().__init__()
        bias = bool(getattr(config, "multimodal_projector_bias", True))
        self.linear_1 = nn.Linear(vision_dim, text_dim, bias=bias)
        self.act = vision_activation(getattr(config, "projector_hidden_act", "gelu"))
        self.linear_2 = nn.Linear(text_dim, text_dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(nn.Module):
    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping
    supports_multimodal = True

    def __init__(self, config: Any, attn_backend: AttentionBackend, tp: Any = None, pp: Any = None) -> None:
        super().__init__()
        if pp is not None:
            raise ValueError(f"{type(self).__name__}: pipeline_parallel_size > 1 is not supported yet")
        self.config = config
        vision_config = sub_config(config, "vision_config")
        text_config = sub_config(config, "text_config")
        layer = getattr(config, "vision_feature_layer", -2)
        self.feature_layers = [int(layer)] if isinstance(layer, int) else [int(i) for i in layer]
        self.select_strategy = getattr(config, "vision_feature_select_strategy", "default")
        if self.select_strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {self.select_strategy!r}: expected 'default' or 'full'")
        self.vision_tower = CLIPVisionTower(vision_config)
        self.multi_modal_projector = LlavaMultiModalProjector(
            config, int(vision_config.hidden_size) * len(self.feature_layers), int(text_config.hidden_size)
        )
        self.language_model = LlamaForCausalLM(text_config, attn_backend, tp=tp)

    def checkpoint_name(self, name: str) -> str | None:
        """transformers 5 and llava-hf checkpoint names -> ours (module docstring)."""
        if name.startswith("model."):
            name = name[len("model.") :]
            if name.startswith("language_model."):
                name = "language_model.model." + name[len("language_model.") :]
        elif name.startswith("lm_head."):
            name = "language_model." + name
        if name.startswith("vision_tower.vision_model."):
            name = "vision_tower." + name[len("vision_tower.vision_model.") :]
        if name.startswith("vision_tower."):
            if name.endswith("position_ids"):
                return None  # a buffer some checkpoints carry
            name = name.replace(".self_attn.q_proj.", ".self_attn.query.")
            name = name.replace(".self_attn.k_proj.", ".self_attn.key.")
            name = name.replace(".self_attn.v_proj.", ".self_attn.value.")
        return name

    def embed_multimodal(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, 3, H, W] images -> [N, num_image_tokens, hidden_size] embeddings (the text model's dtype)."""
        states = self.vision_tower(pixel_values, self.feature_layers)
        if self.select_strategy == "default":
            states = [s[:, 1:] for s in states]
        return self.multi_modal_projector(torch.cat(states, dim=-1))

    def embed_images(self, datas: list[dict[str, Any]]) -> list[torch.Tensor]:
        """Each image's embeddings [num_image_tokens, hidden_size] from its preprocessed inputs (one batch)."""
        param = self.multi_modal_projector.linear_1.weight
        pixels = torch.from_numpy(np.stack([d["pixel_values"] for d in datas])).to(param.device, param.dtype)
        return list(self.embed_multimodal(pixels))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden_size]
        return self.language_model.model.embed(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,  # [T, hidden_size]
    ) -> torch.Tensor:  # [T, hidden_size]
        return self.language_model.model(
            input_ids, positions, kv_caches, attn_metadata, inputs_embeds=inputs_embeds
        )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)


class LlavaNextForConditionalGeneration(LlavaForConditionalGeneration):
    """LLaVA-NeXT (1.6): LLaVA-1.5's tower, projector and text model over "any resolution" crops.

    The image processor gives each image its crops: the whole image resized to the tower's input, then the tiles of
    the best of ``image_grid_pinpoints`` (the image scaled to fit it, letterboxed). Each crop goes through the tower
    and projector (``side x side`` embeddings, side = image_size / patch_size); the tiles' embeddings are laid out
    as one grid of their patches, the rows or columns of the letterbox cut off ("unpadding"), and
    ``image_newline`` appended to each row. An image's embeddings: the base crop's, then the grid row by row::

        base (side * side) | g00 g01 .. g0W nl | g10 .. g1W nl | ... | gH0 .. gHW nl

    ``pagedllm.multimodal.processing.llava_next_num_image_tokens`` counts them from the image's size.

    Checkpoints: LLaVA-1.5's names (``checkpoint_name``), and ``image_newline`` (``model.image_newline`` in
    transformers 5's names).
    """

    def __init__(self, config: Any, attn_backend: AttentionBackend, tp: Any = None, pp: Any = None) -> None:
        super().__init__(config, attn_backend, tp, pp)
        if self.select_strategy != "default":
            raise ValueError(
                "LlavaNextForConditionalGeneration: vision_feature_select_strategy must be 'default' (the tiles are "
                "laid out as a grid of patch embeddings, without CLS)"
            )
        vision_config = sub_config(config, "vision_config")
        self.tile_size = int(vision_config.image_size)
        self.side = self.tile_size // int(vision_config.patch_size)  # patch embeddings a crop side
        self.pinpoints = [(int(h), int(w)) for h, w in config.image_grid_pinpoints]
        self.image_newline = nn.Parameter(torch.empty(int(sub_config(config, "text_config").hidden_size)))

    def pack(self, crops: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """One image's crop embeddings [num_crops, side * side, D] and its size (height, width) -> its embeddings
        [num_tokens, D] (class docstring; transformers' ``pack_image_features``)."""
        base, tiles = crops[0], crops[1:]
        best_h, best_w = select_best_resolution(size, self.pinpoints)
        rows, cols = best_h // self.tile_size, best_w // self.tile_size
        d = crops.shape[-1]
        grid = tiles.view(rows, cols, self.side, self.side, d).permute(4, 0, 2, 1, 3)  # [D, rows, side, cols, side]
        grid = _unpad(grid.reshape(d, rows * self.side, cols * self.side), size)  # [D, h, w]
        newline = self.image_newline.to(grid.dtype)[:, None, None].expand(d, grid.shape[1], 1)  # [D, h, 1]
        grid = torch.cat([grid, newline], dim=-1).flatten(1, 2).transpose(0, 1)  # [h * (w + 1), D]
        return torch.cat([base, grid])

    def embed_images(self, datas: list[dict[str, Any]]) -> list[torch.Tensor]:
        """Each image's embeddings [num_tokens, hidden_size]; the crops of all images go through the tower in one
        batch."""
        param = self.multi_modal_projector.linear_1.weight
        pixels = torch.from_numpy(np.concatenate([d["pixel_values"] for d in datas])).to(param.device, param.dtype)
        crops = self.embed_multimodal(pixels)  # [sum num_crops, side * side, hidden_size]
        counts = [d["pixel_values"].shape[0] for d in datas]
        return [
            self.pack(c, tuple(int(x) for x in d["image_sizes"])) for c, d in zip(crops.split(counts), datas)
        ]


def _unpad(grid: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """[D, H, W] patch grid of a letterboxed image -> the rows (or columns) that hold the image of ``size`` (height,
    width) (transformers' ``unpad_image``)."""
    height, width = size
    cur_h, cur_w = grid.shape[1:]
    if width / height > cur_w / cur_h:
        pad = (cur_h - int(round(height * (cur_w / width), 7))) // 2
        return grid[:, pad : cur_h - pad]
    pad = (cur_w - int(round(width * (cur_h / height), 7))) // 2
    return grid[:, :, pad : cur_w - pad]
