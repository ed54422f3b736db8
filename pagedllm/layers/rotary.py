"""Rotary position embeddings (NeoX / HF-Llama "rotate half" layout), with linear, llama3, YaRN and LongRoPE
scaling, over all of each head or its first ``rotary_dim`` features (``partial_rotary_factor``)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from pagedllm.platform import use_fused_kernels

if TYPE_CHECKING:
    from pagedllm.kernels.reshape_and_cache import KVCacheWrite


def _rope_params(hf_config: Any) -> dict[str, Any]:
    """The config's rope parameters: transformers >= 5 ``rope_parameters``, else the older ``rope_scaling``."""
    params = getattr(hf_config, "rope_parameters", None)
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
    return params


def partial_rotary_factor(hf_config: Any) -> float:
    """The fraction of each head that is rotated (1.0: all of it)."""
    params = _rope_params(hf_config)
    partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    return 1.0 if partial is None else float(partial)


def rotary_dim_of(hf_config: Any, head_dim: int) -> int:
    """How many leading features of each head are rotated: ``int(head_dim * partial_rotary_factor)``, truncated as
    transformers does (Phi-4-mini: 128 * 0.75 = 96)."""
    return int(head_dim * partial_rotary_factor(hf_config))


def rope_config(
    hf_config: Any, allow_partial: bool = False, allow_longrope: bool = False
) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` from an HF config; ``rope_scaling`` is None for plain RoPE.

    Reads transformers >= 5 ``rope_parameters`` and the older ``rope_theta`` + ``rope_scaling`` fields.
    ``allow_partial``: the caller rotates only ``rotary_dim_of(...)`` features of each head; other callers refuse
    a ``partial_rotary_factor`` below 1 rather than silently rotating whole heads. ``allow_longrope``: the model
    is one whose transformers ``generate`` recomputes its cache at LongRoPE's switch (Phi-3), which is what the
    engine reproduces (``longrope_positions``); other models refuse LongRoPE.
    """
    params = _rope_params(hf_config)
    partial = partial_rotary_factor(hf_config)
    if partial != 1.0 and not allow_partial:
        raise ValueError(
            f"partial_rotary_factor={partial} (rotary on part of each head) is not supported for this architecture"
        )
    theta = float(params.get("rope_theta") or getattr(hf_config, "rope_theta", None) or 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "su":  # the name early Phi-3 configs used
        rope_type = "longrope"
    if rope_type == "default":
        return theta, None
    if rope_type == "longrope" and not allow_longrope:
        raise ValueError("rope type 'longrope' is supported for Phi3ForCausalLM only")
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    scaling["rope_type"] = rope_type
    top_level_original = getattr(hf_config, "original_max_position_embeddings", None)
    if rope_type == "longrope" and top_level_original:
        # Phi-3 keeps the pretraining length at the top level, and transformers lets it win.
        scaling["original_max_position_embeddings"] = int(top_level_original)
    scaling.setdefault(
        "original_max_position_embeddings", getattr(hf_config, "max_position_embeddings", None)
    )
    return theta, scaling


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency scaling: keep high frequencies, divide low ones by ``factor``, blend in between."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq  # [rotary_dim // 2]
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, out)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 for ``scale <= 1``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_factor(scaling: dict[str, Any], max_position: int) -> float:
    factor = scaling.get("factor")
    if factor is None:  # transformers: the ratio of the context to the pretraining one
        factor = max_position / scaling["original_max_position_embeddings"]
    return float(factor)


def yarn_inv_freq(
    dim: int, base: float, scaling: dict[str, Any], max_position: int
) -> tuple[torch.Tensor, float]:  # ([dim // 2] float32, attention_factor)
    """YaRN frequencies (interpolated below the correction range, extrapolated above, a linear ramp between)
    and the factor cos/sin are multiplied by, as transformers' ``_compute_yarn_parameters``."""
    factor = yarn_factor(scaling, max_position)
    original = scaling["original_max_position_embeddings"]
    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singularity
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [dim // 2]
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)  # [dim // 2]
    extrapolation = 1 - ramp  # weight of the unscaled frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def longrope_inv_freq(
    dim: int, base: float, scaling: dict[str, Any], max_position: int
) -> tuple[torch.Tensor, torch.Tensor, float]:  # ([dim // 2] short, [dim // 2] long, attention_factor)
    """LongRoPE's two frequency sets ``1 / (ext_factor * base^(2i / dim))`` (``short_factor``, ``long_factor``) and
    the factor cos/sin are multiplied by (for both sets), as transformers' ``_compute_longrope_parameters``: the
    config's ``attention_factor``, else ``sqrt(1 + ln(factor) / ln(original_max_position_embeddings))`` with
    ``factor`` (default: ``max_position / original_max_position_embeddings``), 1 when ``factor <= 1``."""
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor")
    if factor is None:
        factor = max_position / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim  # [dim // 2]
    freqs = []
    for key in ("short_factor", "long_factor"):
        ext = torch.tensor(scaling[key], dtype=torch.float32)  # [dim // 2]
        if ext.shape != exponents.shape:
            raise ValueError(f"longrope {key} has {ext.numel()} entries; rotary_dim {dim} needs {dim // 2}")
        freqs.append(1.0 / (ext * base**exponents))
    return freqs[0], freqs[1], float(attention_factor)


def longrope_original_max(hf_config: Any) -> int | None:
    """``original_max_position_embeddings`` of a LongRoPE model (None for every other rope type): where it switches
    from its short to its long frequencies (see ``RotaryEmbedding`` and ``longrope_positions``)."""
    params = _rope_params(hf_config)
    if params.get("rope_type", params.get("type")) not in ("longrope", "su"):
        return None
    _, scaling = rope_config(hf_config, allow_partial=True, allow_longrope=True)
    return int(scaling["original_max_position_embeddings"])


def longrope_positions(
    positions: np.ndarray,  # [num_tokens] int64
    num_tokens: np.ndarray,  # [num_tokens] how many tokens each token's request has (placeholders included)
    original_max: int,
    max_position: int,
) -> np.ndarray:  # [num_tokens] int64: rows of a LongRoPE RotaryEmbedding's table
    """The table rows a LongRoPE model reads for a step's tokens (the model runner's one extra step for such
    models, on the host arrays before they are copied to the device).

    transformers picks the frequency set per forward pass, long when the pass's last position + 1 exceeds
    ``original_max`` (O), and under ``generate`` Phi-3 drops its KV cache and recomputes the whole sequence the
    first time it grows past O. So a sequence of at most O tokens is rotated with the short set everywhere and a
    longer one with the long set everywhere, old keys included. The scheduler keeps that invariant per request
    (``Request.rope_long``: a request that outgrows O while running is restarted and recomputed, once), so a
    step's token at position ``p`` uses the long set iff its request has more than O tokens.

    ``RotaryEmbedding`` serves positions ``p >= O`` (only ever computed in the long regime) with plain positions;
    only the tokens at ``p < O`` of requests longer than O need other rows, ``max_position + p``. Decode tokens of
    short requests and of long ones alike keep their plain positions (a long request decodes at ``p > O``), so
    decode CUDA graphs and every caller that passes plain positions for sequences of at most O tokens are exact.
    """
    shift = (positions < original_max) & (num_tokens > original_max)  # [num_tokens]
    return positions + max_position * shift


class RotaryEmbedding(nn.Module):
    """Rotates the first ``rotary_dim`` features of q and k by position (the rest pass through).

    The cos/sin table is a float32 buffer ``[num_rows, rotary_dim]`` (``[cos | sin]``, each half
    ``rotary_dim // 2`` wide) indexed by the ``positions`` handed to ``forward``; rotation runs in float32 and is
    cast back to the input dtype. For every rope type but LongRoPE row ``p`` is position ``p`` (``num_rows`` =
    ``max_position``). LongRoPE (``original_max`` = O, ``max_position`` = M) has two frequency sets::

        rows [0, O)       short factors, positions 0 .. O-1
        rows [O, M)       long factors,  positions O .. M-1
        rows [M, M + O)   long factors,  positions 0 .. O-1   (sequences of more than O tokens)

    so plain positions serve sequences of at most O tokens and positions past O, and ``longrope_positions`` maps
    the first O positions of longer sequences to the last rows. The fused kernels read the table by row too.
    """

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float = 10000.0,
        rope_scaling: dict[str, Any] | None = None,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim {self.rotary_dim} must be even and in (0, head_dim {head_dim}]")
        self.max_position = max_position
        self.original_max: int | None = None  # LongRoPE only: where the long frequencies start
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32) / self.rotary_dim
        inv_freq = 1.0 / (base**exponents)  # [rotary_dim // 2]
        rope_type = (rope_scaling or {}).get("rope_type", "default")
        attention_factor = 1.0
        t = torch.arange(max_position, dtype=torch.float32)  # [max_position]
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)
        elif rope_type == "linear":
            inv_freq = inv_freq / float(rope_scaling["factor"])
        elif rope_type == "yarn":  # transformers scales cos and sin, so the rotated q and k each carry the factor
            inv_freq, attention_factor = yarn_inv_freq(self.rotary_dim, base, rope_scaling, max_position)
        elif rope_type == "longrope":
            short, long, attention_factor = longrope_inv_freq(self.rotary_dim, base, rope_scaling, max_position)
            self.original_max = original = min(int(rope_scaling["original_max_position_embeddings"]), max_position)
            freqs = torch.cat(
                [
                    torch.outer(t[:original], short),  # [O, rotary_dim // 2]
                    torch.outer(t[original:], long),  # [M - O, rotary_dim // 2]
                    torch.outer(t[:original], long),  # [O, rotary_dim // 2]
                ]
            )  # [M + O, rotary_dim // 2]
        elif rope_type != "default":
            raise ValueError(
                f"unsupported rope type {rope_type!r}; supported: default, linear, llama3, yarn, longrope"
            )
        if rope_type != "longrope":
            freqs = torch.outer(t, inv_freq)  # [max_position, rotary_dim // 2]
        cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_factor  # [num_rows, rotary_dim]
        self.register_buffer("cos_sin_cache", cos_sin, persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, heads, head_dim]; cos, sin: [T, 1, rotary_dim], [cos | cos] and [-sin | sin]
        rot = x[..., : self.rotary_dim].float()
        x1, x2 = rot.chunk(2, dim=-1)  # [T, heads, rotary_dim // 2] each
        # [x1 cos - x2 sin | x2 cos + x1 sin] (bit for bit: adding -(x2 sin) is subtracting x2 sin), in 4 passes
        rotated = (rot * cos).add_(torch.cat([x2, x1], dim=-1).mul_(sin)).to(x.dtype)
        if self.rotary_dim == self.head_dim:
            return rotated
        return torch.cat([rotated, x[..., self.rotary_dim :]], dim=-1)

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        cache: KVCacheWrite | None = None,  # also write the rotated keys and the values there (fused kernels only)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if use_fused_kernels(query):
            from pagedllm.kernels.rotary import rotary_embedding

            half = self.rotary_dim // 2
            # Rotates in place; cos/sin are column views of the [cos | sin] table.
            rotary_embedding(
                positions, query, key, self.cos_sin_cache[:, :half], self.cos_sin_cache[:, half:], cache=cache
            )
            return query, key
        if cache is not None:
            raise ValueError("RotaryEmbedding writes the KV cache only through the fused kernels (a CUDA tensor)")
        cos_sin = self.cos_sin_cache[positions]  # [T, rotary_dim]
        cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)  # [T, 1, rotary_dim // 2] each
        cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)  # [T, 1, rotary_dim] each
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal RoPE (Qwen2-VL): positions are ``[3, T]`` (temporal, height, width); frequency pair i rotates by
    the stream its section names (``mrope_section``: pairs per stream, summing to ``rotary_dim // 2``). Text tokens
    have three equal positions, so ``[T]`` positions (every decode) take the plain path, fused kernels included."""

    def __init__(self, head_dim: int, max_position: int, base: float, mrope_section: list[int]) -> None:
        super().__init__(head_dim, max_position, base)
        half = self.rotary_dim // 2
        if sum(mrope_section) != half or len(mrope_section) != 3:
            raise ValueError(f"mrope_section {mrope_section} must be 3 numbers summing to rotary_dim / 2 = {half}")
        stream = torch.repeat_interleave(torch.arange(3), torch.tensor(mrope_section))  # [rotary_dim // 2]
        self.register_buffer("stream_of_pair", stream, persistent=False)

    def forward(
        self,
        positions: torch.Tensor,  # [T] or [3, T]
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        cache: KVCacheWrite | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().forward(positions, query, key, cache)
        if cache is not None:
            raise ValueError("MRotaryEmbedding with 3-D positions does not write the KV cache")
        half = self.rotary_dim // 2
        table = self.cos_sin_cache[positions]  # [3, T, rotary_dim]
        index = self.stream_of_pair.view(1, 1, half).expand(1, positions.shape[1], half)  # [1, T, half]
        cos = table[..., :half].gather(0, index).squeeze(0).unsqueeze(1)  # [T, 1, half]
        sin = table[..., half:].gather(0, index).squeeze(0).unsqueeze(1)  # [T, 1, half]
        cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)  # [T, 1, rotary_dim] each
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)


def get_rope(
    head_dim: int,
    max_position: int,
    base: float = 10000.0,
    rope_scaling: dict[str, Any] | None = None,
    rotary_dim: int | None = None,
) -> RotaryEmbedding:
    """The rotary embedding of ``head_dim``-wide heads, rotating their first ``rotary_dim`` (default: all)."""
    return RotaryEmbedding(head_dim, max_position, base, rope_scaling, rotary_dim)
