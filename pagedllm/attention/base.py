"""The attention-backend interface: metadata built once per step, ``forward`` called once per layer.

Token / block layout for one step (three requests, block_size 4)::

    flattened tokens:  | r0: 3 new | r1: 1 new (decode) | r2: 5 new (prefill chunk) |
    query_start_loc:   [0, 3, 4, 9]
    seq_lens:          [3, 10, 5]     # context after this step = computed before + new
    block_table[r]:    block ids holding r's context, in order; entry j covers positions [4j, 4j+4)
    slot_mapping[t]:   block_table[r][pos // 4] * 4 + pos % 4 for the token's position pos

The KV cache of one layer is one tensor ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (index 0 keys,
index 1 values). A query token of request r at position p attends to r's keys at positions 0..p (causal),
which are the first p+1 slots along r's block table once this step's keys have been written.

Per-layer options of ``AttentionBackend.forward`` (fixed when the model is built, not per step):

* ``sliding_window`` W: the query at position p sees only keys at positions k with ``p - W < k <= p`` (W keys,
  itself included), as transformers' ``sliding_window_causal_mask_function`` does. Only the attention is
  windowed here. The block table lists a block for every position; the KV cache manager gives a sliding layer's
  blocks wholly behind the window back to the pool (``core/kv_cache_manager.py``: such layers have a KV cache
  group, and so a block table, of their own), and their entries may then name blocks other requests or groups
  own: backends must never read (or write) a slot behind a query's window (the Triton kernel skips those tiles;
  the PyTorch path gathers only the keys from the request's first visible position on, and masks the rest).
* ``logits_soft_cap`` c: the scaled scores ``s`` become ``c * tanh(s / c)`` before masking and the softmax
  (Gemma 2).
* ``sinks`` (``[num_heads]`` tensor, this rank's heads; GPT-OSS): one learned logit ``s_h`` per query head that
  joins that head's softmax denominator and carries no value: ``out = sum_k exp(l_k) v_k / (exp(s_h) +
  sum_k exp(l_k))`` over the visible keys' scaled (and soft-capped) scores ``l_k``. The sink itself is neither
  scaled, capped nor masked, so every query row gives it weight, whatever the window; the row's attention
  weights then sum to less than one. Read in float32 whatever its dtype; the layer that owns it (a weight from
  the checkpoint) passes the same tensor every call.
* ``k_scale`` / ``v_scale`` (FP8 KV cache, ``kv_cache_dtype="fp8"``): when ``kv_cache`` is ``float8_e4m3fn``
  the backend writes ``e4m3(clamp(k / k_scale, -448, 448))`` (values likewise) and reads ``k_fp8 * k_scale``;
  per-tensor, one pair per layer, from the checkpoint when it has them (else 1.0, vLLM's default). Ignored for
  caches in the model dtype.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, TypeVar

import torch

T = TypeVar("T")


@dataclass
class AttentionMetadata:
    num_reqs: int
    num_tokens: int  # real tokens this step (the flattened batch may be padded past it)
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, on device: cumulative query lengths
    seq_lens: torch.Tensor  # [num_reqs] int32, on device: context length after this step
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req] int32, on device; unused entries arbitrary
    slot_mapping: torch.Tensor  # [num_tokens(+pad)] int64, on device; -1 means "do not write" (padding)
    query_start_loc_cpu: torch.Tensor  # [num_reqs + 1] int32, host twin
    seq_lens_cpu: torch.Tensor  # [num_reqs] int32, host twin
    is_pure_decode: bool = False  # every request has exactly one query token
    # Hybrid models (KV cache groups, core/kv_cache_manager.py): (block_table, slot_mapping) of groups 1, 2, ..., laid
    # out as the two fields above, which are group 0's. Empty with one group. A layer reads for_kv_group(its group).
    kv_group_tables: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
    # (request index, start, end): positions [start, end) of that request see each other both ways (one image's
    # tokens in Gemma 3), on top of the causal mask and inside any sliding window. Each span lies within the
    # request's context after this step, and every one of its positions at or past the request's first query is a
    # query of this step. Steps with spans run through the PyTorch reference attention. Empty: causal only.
    bidirectional_spans: tuple[tuple[int, int, int], ...] = ()
    _group_views: dict[int, AttentionMetadata] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _derived: dict[Hashable, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def derived(self, key: Hashable, build: Callable[[], T]) -> T:
        """``build()``, computed at the first call with ``key`` and returned as is by later ones: what every layer
        would otherwise derive again from this step's fields (e.g. MLA's split of decodes from prefill chunks,
        pagedllm/attention/mla.py). Valid because metadata is built once a step and not changed after; a view from
        :meth:`for_kv_group` has its own."""
        if key not in self._derived:
            self._derived[key] = build()
        return self._derived[key]

    def for_kv_group(self, group: int) -> AttentionMetadata:
        """This step's metadata with KV cache group ``group``'s block table and slot mapping (built once a step)."""
        if group == 0:
            return self
        view = self._group_views.get(group)
        if view is None:
            block_table, slot_mapping = self.kv_group_tables[group - 1]
            view = dataclasses.replace(
                self, block_table=block_table, slot_mapping=slot_mapping, kv_group_tables=()
            )
            self._group_views[group] = view
        return view


class AttentionBackend(Protocol):
    """Writes this step's keys/values into the paged cache, then computes causal attention over it."""

    name: str

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,  # see the module docstring; None = full causal attention
        logits_soft_cap: float | None = None,  # see the module docstring; None = no capping
        k_scale: float = 1.0,  # FP8 cache only: stored key = key / k_scale (see the module docstring)
        v_scale: float = 1.0,  # FP8 cache only: stored value = value / v_scale
        sinks: torch.Tensor | None = None,  # [num_heads]; see the module docstring; None = no sinks
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...


FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_KV_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def is_fp8_kv_cache(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype == FP8_KV_DTYPE


def get_attention_backend(device: torch.device | str, name: str | None = None) -> AttentionBackend:
    """Pick the backend: Triton on CUDA (when importable), the PyTorch reference elsewhere.

    ``name`` ("torch" or "triton") forces one.
    """
    device = torch.device(device)
    if name is None:
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton":
        try:
            from pagedllm.attention.triton_backend import TritonAttentionBackend
        except ImportError:
            name = "torch"
        else:
            return TritonAttentionBackend()
    if name == "torch":
        from pagedllm.attention.torch_ref import TorchAttentionBackend

        return TorchAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose 'torch' or 'triton'")


class LeadingDecodes(NamedTuple):
    """A mixed step's leading decodes (requests ..d) and the rest (requests d..), attended by separate launches."""

    d: int
    decode_max_seq_len: int
    rest_block_table: torch.Tensor  # [num_reqs - d, max_blocks] int32
    rest_seq_lens: torch.Tensor  # [num_reqs - d] int32
    rest_query_start_loc: torch.Tensor  # [num_reqs - d + 1] int32, relative to token d
    rest_max_seq_len: int


def split_leading_decodes(metadata: AttentionMetadata) -> LeadingDecodes | None:
    """How a mixed step that starts with decodes splits (the Triton backend attends to each part in its own launch).
    None for a step without leading decodes or without anything after them, and while a CUDA graph is being
    captured (its replays may see other query lengths)."""
    if metadata.query_start_loc.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    q_lens = (
        metadata.query_start_loc_cpu[1 : metadata.num_reqs + 1]
        - metadata.query_start_loc_cpu[: metadata.num_reqs]
    )
    not_decode = torch.nonzero(q_lens != 1)
    if len(not_decode) == 0:
        return None
    d = int(not_decode[0])
    if d == 0:
        return None
    seq_lens = metadata.seq_lens_cpu[: metadata.num_reqs]
    # Fresh tensors, not views at an offset: an offset that is not 16-byte aligned makes Triton compile another
    # variant of the kernel (seconds, mid-run).
    return LeadingDecodes(
        d,
        int(seq_lens[:d].max()),
        metadata.block_table[d:].clone(),
        metadata.seq_lens[d:].clone(),
        metadata.query_start_loc[d:] - d,
        int(seq_lens[d:].max()),
    )
