"""Qwen2-VL (``Qwen2VLForConditionalGeneration``): a ViT over dynamic-resolution patches, a 2x2 patch merger, and a
Qwen2 text model with multimodal RoPE.

The image processor cuts each image into ``t x h x w`` patches of ``T x P x P`` pixels (a still image: t = 1, its
frame repeated T times) and flattens each; the tower attends within each image (2-D rotary positions over the
patch grid), and the merger turns every ``merge x merge`` block of patches into one embedding, so an image takes
``t * h * w / merge**2`` placeholder tokens. The text model rotates with 3-D positions (``MRotaryEmbedding``;
``pagedllm.multimodal.processing.mrope_positions``): the runner passes ``[3, T]`` positions for steps that hold
prompt tokens of a request with images, and plain ``[T]`` positions (shifted by the request's delta) otherwise,
so decode steps keep their CUDA graphs.

Checkpoints: transformers 5 names (``model.visual.*``, ``model.language_model.*``, ``lm_head.*``) and the
original ones (``visual.*``, ``model.*``, ``lm_head.*``) both load (``checkpoint_name``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.base import AttentionBackend, AttentionMetadata
from pagedllm.layers.rotary import MRotaryEmbedding, RotaryEmbedding, rope_config
from pagedllm.models.llama import LlamaForCausalLM, LlamaModel, Qwen2Attention, head_dim_of
from pagedllm.models.llava import vision_activation
from pagedllm.multimodal.processing import sub_config


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def segment_attention(
    q: torch.Tensor,  # [S, heads, head_dim]
    k: torch.Tensor,  # [S, heads, head_dim]
    v: torch.Tensor,  # [S, heads, head_dim]
    lengths: list[int],  # consecutive segments of S; attention stays within each
) -> torch.Tensor:  # [S, heads, head_dim]
    """Bidirectional attention within each segment; consecutive segments of one length run as one batch (windows of
    Qwen2.5-VL's tower are mostly of one size; images of one size too)."""
    out = []
    a = i = 0
    while i < len(lengths):
        n = lengths[i]
        j = i
        while j < len(lengths) and lengths[j] == n:
            j += 1
        b = a + n * (j - i)
        q_, k_, v_ = (t[a:b].view(j - i, n, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))  # [segs, heads, n, d]
        o = F.scaled_dot_product_attention(q_, k_, v_)  # [segs, heads, n, head_dim]
        out.append(o.transpose(1, 2).reshape(b - a, *q.shape[1:]))
        a, i = b, j
    return torch.cat(out) if len(out) > 1 else out[0]


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(
        self,
        x: torch.Tensor,  # [S, dim] the patches of every image, image after image
        cos: torch.Tensor,  # [S, head_dim]
        sin: torch.Tensor,  # [S, head_dim]
        lengths: list[int],  # patches per attention segment (an image's frame, or a window of it)
    ) -> torch.Tensor:  # [S, dim]
        s = x.shape[0]
        q, k, v = self.qkv(x).view(s, 3, self.num_heads, self.head_dim).unbind(1)  # [S, heads, head_dim] each
        cos, sin = cos.unsqueeze(1).float(), sin.unsqueeze(1).float()  # [S, 1, head_dim]
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(x.dtype)
        return self.proj(segment_attention(q, k, v, lengths).reshape(s, -1))


class VisionMlp(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = vision_activation(act)
        self.fc2 = nn.Linear(hidden_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp: nn.Module, norm: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.norm1 = norm(dim)
        self.norm2 = norm(dim)
        self.attn = VisionAttention(dim, num_heads)
        self.mlp = mlp

    def forward(self, x, cos, sin, lengths):
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, config: Any, embed_dim: int) -> None:
        super().__init__()
        self.in_channels = int(getattr(config, "in_channels", 3))
        self.temporal_patch_size = int(config.temporal_patch_size)
        self.patch_size = int(config.patch_size)
        self.embed_dim = embed_dim
        kernel = (self.temporal_patch_size, self.patch_size, self.patch_size)
        self.proj = nn.Conv3d(self.in_channels, self.embed_dim, kernel, stride=kernel, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [S, C * T * P * P] -> [S, embed_dim]
        x = x.view(-1, self.in_channels, self.temporal_patch_size, self.patch_size, self.patch_size)
        return self.proj(x.to(self.proj.weight.dtype)).view(-1, self.embed_dim)


class PatchMerger(nn.Module):
    def __init__(self, dim: int, context_dim: int, merge: int, norm: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.hidden = context_dim * merge * merge
        self.ln_q = norm(context_dim)
        self.mlp = nn.Sequential(nn.Linear(self.hidden, self.hidden), nn.GELU(), nn.Linear(self.hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [S, context_dim] -> [S / merge**2, dim]
        return self.mlp(self.ln_q(x).view(-1, self.hidden))


class Qwen2VisionTransformer(nn.Module):
    """Qwen2-VL's ViT. Qwen2.5-VL's (``pagedllm/models/qwen2_5_vl.py``) is this one with other widths' names, another
    norm and MLP (the ``*_of`` / ``make_*`` hooks) and window attention in ``forward``."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        width, out_dim = self.dims_of(config)
        num_heads = int(config.num_heads)
        self.merge = int(config.spatial_merge_size)
        self.patch_embed = PatchEmbed(config, width)
        head_dim = width // num_heads
        theta = float((getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
        spatial = head_dim // 2
        inv_freq = 1.0 / theta ** (torch.arange(0, spatial, 2, dtype=torch.float32) / spatial)  # [head_dim // 4]
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.blocks = nn.ModuleList(
            VisionBlock(width, num_heads, self.make_mlp(config, width), self.make_norm)
            for _ in range(int(config.depth))
        )
        self.merger = PatchMerger(out_dim, width, self.merge, self.make_norm)

    @staticmethod
    def dims_of(config: Any) -> tuple[int, int]:
        """(the tower's width, the width of the embeddings it hands the text model)."""
        return int(config.embed_dim), int(config.hidden_size)

    @staticmethod
    def make_norm(dim: int) -> nn.Module:
        return nn.LayerNorm(dim, eps=1e-6)

    @staticmethod
    def make_mlp(config: Any, width: int) -> nn.Module:
        return VisionMlp(width, int(width * config.mlp_ratio), getattr(config, "hidden_act", "quick_gelu"))

    def _rotary(self, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [S, head_dim] of each patch's (row, column), patches in merge-block order as the processor
        lays them out."""
        rows = []
        m = self.merge
        for t, h, w in grids:
            hpos, wpos = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            shape = (h // m, m, w // m, m)
            hpos = hpos.reshape(shape).transpose(1, 2).flatten()
            wpos = wpos.reshape(shape).transpose(1, 2).flatten()
            rows.append(torch.stack([hpos, wpos], dim=-1).repeat(t, 1))
        pos = torch.cat(rows).to(self.inv_freq.device)  # [S, 2]
        freqs = pos[..., None].float() * self.inv_freq  # [S, 2, head_dim // 4]
        freqs = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)  # [S, head_dim // 2]
        freqs = torch.cat([freqs, freqs], dim=-1)  # [S, head_dim]
        return freqs.cos(), freqs.sin()

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """[S, C * T * P * P] patches of the images in ``grids`` order -> [S / merge**2, out_dim]."""
        x = self.patch_embed(pixels)
        cos, sin = self._rotary(grids)
        lengths = [h * w for t, h, w in grids for _ in range(t)]  # attention within each frame
        for block in self.blocks:
            x = block(x, cos, sin, lengths)
        return self.merger(x)


class Qwen2VLTextModel(LlamaModel):
    @staticmethod
    def make_rotary(config: Any) -> RotaryEmbedding:
        theta, scaling = rope_config(config)
        params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        section = params.get("mrope_section")
        if scaling is not None or section is None:
            raise ValueError("Qwen2-VL: the text config must use default RoPE with an mrope_section")
        return MRotaryEmbedding(head_dim_of(config), config.max_position_embeddings, theta, list(section))


class Qwen2VLTextForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen2Attention
    model_cls = Qwen2VLTextModel


class Qwen2VLForConditionalGeneration(nn.Module):
    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping
    supports_multimodal = True
    uses_mrope = True
    vision_tower_cls: type[nn.Module] = Qwen2VisionTransformer

    def __init__(self, config: Any, attn_backend: AttentionBackend, tp: Any = None, pp: Any = None) -> None:
        super().__init__()
        if pp is not None:
            raise ValueError(f"{type(self).__name__}: pipeline_parallel_size > 1 is not supported yet")
        self.config = config
        vision_config = sub_config(config, "vision_config")
        text_config = sub_config(config, "text_config")
        tied = getattr(config, "tie_word_embeddings", None)
        if tied is not None:  # the outer config decides, as in transformers (its text config may not say)
            text_config.tie_word_embeddings = bool(tied)
        self.spatial_merge_size = int(vision_config.spatial_merge_size)
        self.visual = self.vision_tower_cls(vision_config)
        self.language_model = Qwen2VLTextForCausalLM(text_config, attn_backend, tp=tp)

    def checkpoint_name(self, name: str) -> str | None:
        """transformers 5 and original checkpoint names -> ours (module docstring)."""
        if name.startswith("model.visual."):
            return name[len("model.") :]
        if name.startswith("model.language_model."):
            return "language_model.model." + name[len("model.language_model.") :]
        if name.startswith("model."):
            return "language_model." + name
        if name.startswith("lm_head."):
            return "language_model." + name
        return name

    def embed_images(self, datas: list[dict[str, Any]]) -> list[torch.Tensor]:
        """Each image's embeddings [t * h * w / merge**2, hidden_size]; all images in one pass of the tower."""
        weight = self.visual.patch_embed.proj.weight
        pixels = torch.from_numpy(np.concatenate([d["pixel_values"] for d in datas])).to(weight.device, weight.dtype)
        grids = [tuple(int(x) for x in d["image_grid_thw"]) for d in datas]
        merged = self.visual(pixels, grids)  # [sum tokens, hidden_size]
        return list(merged.split([t * h * w // self.spatial_merge_size**2 for t, h, w in grids]))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden_size]
        return self.language_model.model.embed(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T], or [3, T] (M-RoPE) for steps with image-prompt tokens
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,  # [T, hidden_size]
    ) -> torch.Tensor:  # [T, hidden_size]
        return self.language_model.model(
            input_ids, positions, kv_caches, attn_metadata, inputs_embeds=inputs_embeds
        )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)
