"""The Attention layer: hands q/k/v, this layer's KV cache and the step's metadata to the backend."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagedllm.attention.base import AttentionBackend, AttentionMetadata
from pagedllm.platform import use_fused_kernels

if TYPE_CHECKING:
    from pagedllm.kernels.reshape_and_cache import KVCacheWrite


# Set while a piecewise CUDA graph capture runs (worker/piecewise_graphs.py): Attention.forward hands its inputs to
# its split() instead of attending.
_splitter: Any = None


@contextlib.contextmanager
def split_at_attention(splitter: Any) -> Iterator[None]:
    """Within this block every ``Attention.forward`` returns ``splitter.split(layer, query, key, value, kv_cache,
    kv_written)`` (a static output buffer) instead of attending: the piecewise graphs' capture ends a piece there."""
    global _splitter
    _splitter = splitter
    try:
        yield
    finally:
        _splitter = None


class Attention(nn.Module):
    """Paged causal self-attention over already-projected, already-rotated q/k/v.

    Holds no weights of its own. The backend writes k/v into ``kv_cache`` at ``metadata.slot_mapping`` and
    attends. ``sliding_window`` (this layer's window W, or None), ``logits_soft_cap`` (or None) and ``sinks``
    (``[num_heads]``, or None) are fixed per layer and handed to the backend each call; see
    ``pagedllm/attention/base.py`` for their exact meaning. ``sinks`` is a weight of the model's attention block
    (``self_attn.sinks`` in GPT-OSS checkpoints): that block registers the parameter, this layer keeps a reference
    to it (so it is listed under both names, one parameter, as tied embeddings are) and reads it at every call.

    ``kv_group``: the KV cache group the layer belongs to (core/kv_cache_manager.py; set by the model runner), whose
    block table and slot mapping it reads (``AttentionMetadata.for_kv_group``); 0 unless the model is hybrid.

    FP8 KV cache: ``k_scale`` / ``v_scale`` (plain floats, per tensor) divide what is written to a
    ``float8_e4m3fn`` cache and multiply what is read back. The loader sets them from a checkpoint's
    ``self_attn.k_scale`` / ``v_scale`` (or ``kv_scale``) through :meth:`set_kv_scales`; otherwise they stay 1.0,
    vLLM's default (fine for activations well inside +-448). Unused for a cache in the model dtype.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int,
        attn_backend: AttentionBackend,
        layer_idx: int,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        sinks: torch.Tensor | None = None,  # [num_heads]
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window!r}")
        if logits_soft_cap is not None and logits_soft_cap <= 0:
            raise ValueError(f"logits_soft_cap must be > 0 or None, got {logits_soft_cap!r}")
        if sinks is not None and tuple(sinks.shape) != (num_heads,):
            raise ValueError(f"sinks must be [num_heads] = [{num_heads}], got {tuple(sinks.shape)}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.layer_idx = layer_idx
        self.attn_backend = attn_backend
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.sinks = sinks
        self.kv_group = 0
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.kv_scales_from_checkpoint = False

    def set_kv_scales(self, k_scale: float | None = None, v_scale: float | None = None) -> None:
        """Set this layer's FP8 KV scales (a None one is left as it is); ``ValueError`` unless finite and > 0."""
        for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
            if value is None:
                continue
            value = float(value)
            if not (value > 0.0 and value != float("inf")):
                raise ValueError(f"{name} must be finite and > 0, got {value!r}")
            setattr(self, name, value)
        self.kv_scales_from_checkpoint = True

    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        attn_metadata: AttentionMetadata,
        kv_written: bool = False,  # the caller wrote key/value into kv_cache already (through kv_write())
        out: torch.Tensor | None = None,  # [T, num_heads, head_dim]: write the result here (piecewise graphs)
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        if _splitter is not None:
            return _splitter.split(self, query, key, value, kv_cache, kv_written)
        # sinks, kv_written and out only when set: a backend that does not know them still serves every other model
        options = {} if self.sinks is None else {"sinks": self.sinks}
        backend = self.attn_backend
        if attn_metadata.bidirectional_spans and backend.name != "torch":
            # Spans seen both ways (Gemma 3's images): the PyTorch reference takes them; it writes the cache itself
            # (again, with the same values, where the caller already did).
            backend, kv_written = _torch_backend(), False
        if kv_written:
            options["kv_written"] = True
        if out is not None:
            options["out"] = out
        return backend.forward(
            query,
            key,
            value,
            kv_cache,
            attn_metadata.for_kv_group(self.kv_group),
            self.scale,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
            **options,
        )

    def kv_write(
        self,
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        attn_metadata: AttentionMetadata,
    ) -> KVCacheWrite | None:
        """Where the kernel that makes this step's keys (RoPE) may also write them and ``value`` into this layer's
        cache, exactly as the backend would: the backend's slot mapping for this layer's KV group and its FP8
        scales. None where the backend writes the cache itself (not the Triton one, off the fused kernels, a
        head size that is not a power of two, or ``PAGEDLLM_ROPE_WRITES_KV=0``); otherwise the caller must pass ``kv_written=True`` to :meth:`forward` once
        the keys are written."""
        if not getattr(self.attn_backend, "accepts_written_kv", False) or not use_fused_kernels(value):
            return None
        if os.environ.get("PAGEDLLM_ROPE_WRITES_KV", "1") == "0":  # a switch for A/B runs
            return None
        if self.head_dim & (self.head_dim - 1):  # e.g. Phi-3's 96: the RoPE kernels' write covers 2^k heads only
            return None
        from pagedllm.kernels.reshape_and_cache import KVCacheWrite

        slot_mapping = attn_metadata.for_kv_group(self.kv_group).slot_mapping
        return KVCacheWrite(value, kv_cache, slot_mapping, self.k_scale, self.v_scale)

    def extra_repr(self) -> str:
        return (
            f"layer={self.layer_idx}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, backend={self.attn_backend.name}"
            + (f", sliding_window={self.sliding_window}" if self.sliding_window else "")
            + (f", kv_group={self.kv_group}" if self.kv_group else "")
            + (f", logits_soft_cap={self.logits_soft_cap}" if self.logits_soft_cap else "")
            + (", sinks" if self.sinks is not None else "")
            + (f", k_scale={self.k_scale}, v_scale={self.v_scale}" if self.kv_scales_from_checkpoint else "")
        )


def _torch_backend() -> AttentionBackend:
    from pagedllm.attention.torch_ref import TorchAttentionBackend

    return TorchAttentionBackend()


def kv_scales_summary(model: nn.Module, kv_cache_dtype: torch.dtype) -> str:
    """For the start-up log: where an FP8 cache's k/v scales came from ("" for a cache in the model dtype)."""
    if kv_cache_dtype != torch.float8_e4m3fn:
        return ""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    loaded = sum(m.kv_scales_from_checkpoint for m in layers)
    if loaded == 0:
        return "; no k_scale/v_scale in the checkpoint: scales 1.0 (vLLM's default)"
    return f"; k_scale/v_scale from the checkpoint for {loaded} of {len(layers)} attention layers (else 1.0)"
