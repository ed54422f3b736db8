"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged cache of latents.

What one layer caches per token is one row of ``kv_lora_rank + qk_rope_head_dim`` (L + R) values::

    kv_cache: [num_blocks, block_size, L + R]     row = [ c: kv_a_layernorm(latent), L | k_pe: rotated, R ]

instead of per-head keys and values (``2 * num_heads * head_dim``): 576 values instead of 2 * 16 * 192 = 6144 for
DeepSeek-V2-Lite. The model declares this shape (:meth:`MLAAttention.kv_cache_shape`) and the model runner
allocates it; block accounting is unchanged (a block is ``block_size`` such rows per layer).

Per head h, with ``kv_b_proj.weight`` viewed as ``[H, P + V, L]`` = ``[W_UK[h] (P rows) ; W_UV[h] (V rows)]``
(P = ``qk_nope_head_dim``, V = ``v_head_dim``), the attention transformers computes is::

    k[h, s] = [W_UK[h] @ c[s] | k_pe[s]]        v[h, s] = W_UV[h] @ c[s]        q[h] = [q_nope[h] | q_pe[h]]
    out[h]  = sum_s softmax_s(scale * q[h] . k[h, s]) v[h, s]

Two equal ways to compute it, picked per request by its query length:

* **expanded** (prefill chunks, query length > 1): up-project the request's cached latents to per-head
  ``k_nope`` and ``v`` (``kv_b_proj``) and run causal attention with keys ``[k_nope | k_pe]`` (the new tokens sit
  at the end of the context);
* **absorbed** (decodes, query length 1): ``q[h] . k[h, s] = (W_UK[h].T @ q_nope[h]) . c[s] + q_pe[h] . k_pe[s]``
  and ``out[h] = W_UV[h] @ sum_s p[h, s] c[s]``: attention runs in latent space over the cache rows as they are
  (:mod:`pagedllm.kernels.mla_decode`: Triton on CUDA with the Triton backend, its PyTorch twin elsewhere).

A pure-decode step (every request one token: the CUDA-graph case) reads no host-side lengths. Other steps split
decodes from prefill chunks on the host (``query_start_loc_cpu`` / ``seq_lens_cpu``), once a step
(:func:`plan_mla_step`, kept on the metadata for the other layers). All prefill chunks of a step are computed
together: one gather of every chunk's context rows (request after request), one ``kv_b_proj`` call on all their
latents, then :mod:`pagedllm.kernels.mla_prefill` (one Triton launch on CUDA with the Triton backend; elsewhere its
PyTorch twin, a padded SDPA call per group of similar lengths). :func:`mla_prefill_ref`, request by request, is
the oracle they are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.base import FP8_KV_DTYPE, AttentionBackend, AttentionMetadata
from pagedllm.platform import use_fused_kernels

if TYPE_CHECKING:
    from pagedllm.kernels.mla_prefill import PaddedGroup


def write_latent_cache(
    latent: torch.Tensor,  # [T, L], after kv_a_layernorm
    k_pe: torch.Tensor,  # [T, R], rotated
    kv_cache: torch.Tensor,  # [num_blocks, block_size, L + R], contiguous
    slot_mapping: torch.Tensor,  # [>= T] int64; slot = block_id * block_size + offset, -1 = skip
) -> None:
    """Write token t's ``[latent | k_pe]`` row into flat slot ``slot_mapping[t]``; slots of -1 are skipped.

    Without a host sync (so it can be captured in a CUDA graph): a skipped token writes the row of the first
    token that has a slot, to that token's slot (duplicate writes of identical rows, so the result does not depend
    on their order); when no token has a slot, slot 0 gets its own content back.
    """
    num_tokens = latent.shape[0]
    if num_tokens == 0:
        return
    flat = kv_cache.view(-1, kv_cache.shape[-1])  # [num_blocks * block_size, L + R]
    rows = torch.cat([latent, k_pe], dim=-1).to(flat.dtype)  # [T, L + R]
    slots = slot_mapping[:num_tokens]  # [T]
    valid = slots >= 0  # [T]
    # the first token with a slot (0 when none has one), as a [1] index: indexing with a 0-d device tensor would
    # read it on the host
    first = valid.to(torch.int32).argmax().view(1)
    target = torch.where(valid, slots, slots.index_select(0, first)).clamp(min=0)  # [T]
    fallback = torch.where(valid.index_select(0, first)[:, None], rows.index_select(0, first), flat[:1])  # [1, L+R]
    flat.index_copy_(0, target, torch.where(valid[:, None], rows, fallback))


def mla_prefill_ref(
    q_nope: torch.Tensor,  # [T, H, P]
    q_pe: torch.Tensor,  # [T, H, R]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, L + R], this step's rows already written
    kv_b_proj: nn.Module,  # [..., L] -> [..., H * (P + V)]
    block_table: torch.Tensor,  # [num_reqs, max_blocks] int
    seq_lens: list[int],  # [num_reqs] context length after this step
    query_start_loc: list[int],  # [num_reqs + 1]
    reqs: list[int],  # the requests to compute (their query rows of ``out`` are written)
    scale: float,
    out: torch.Tensor,  # [T, H, V]
) -> None:
    """The expanded form, request by request: each request's cached latents up-projected to per-head keys and
    values, then causal attention (query i of a request with query length n and context S sits at position
    ``S - n + i`` and sees keys ``0..S - n + i``). Computed in float32 (float64 for float64) on CPU, in the
    input dtype on CUDA (SDPA accumulates in float32 there)."""
    num_heads, nope_dim = q_nope.shape[1], q_nope.shape[2]
    kv_lora_rank = kv_cache.shape[-1] - q_pe.shape[-1]
    block_size = kv_cache.shape[1]
    dtype = q_nope.dtype if q_nope.is_cuda else torch.promote_types(q_nope.dtype, torch.float32)
    for r in reqs:
        q_start, q_end = query_start_loc[r], query_start_loc[r + 1]
        query_len, seq_len = q_end - q_start, seq_lens[r]
        if query_len == 0:
            continue
        if query_len > seq_len:
            raise ValueError(f"request {r}: query_len {query_len} > seq_len {seq_len}")
        num_blocks = (seq_len + block_size - 1) // block_size
        ctx = kv_cache[block_table[r, :num_blocks].long()].flatten(0, 1)[:seq_len]  # [S, L + R]
        kv = kv_b_proj(ctx[:, :kv_lora_rank]).view(seq_len, num_heads, -1)  # [S, H, P + V]
        k_pe = ctx[:, None, kv_lora_rank:].expand(seq_len, num_heads, -1)  # [S, H, R]
        k = torch.cat([kv[..., :nope_dim], k_pe], dim=-1).to(dtype).transpose(0, 1)  # [H, S, P + R]
        v = kv[..., nope_dim:].to(dtype).transpose(0, 1)  # [H, S, V]
        q = torch.cat([q_nope[q_start:q_end], q_pe[q_start:q_end]], dim=-1).to(dtype).transpose(0, 1)
        q_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)  # [n]
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]  # [n, S], True = attend
        o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=scale)[
            0
        ]  # [H, n, V]
        out[q_start:q_end] = o.transpose(0, 1).to(out.dtype)


@dataclass
class MLADecodes:
    """A step's one-token requests (absorbed form) in a mixed step."""

    tokens: torch.Tensor  # [D] int64, their query rows
    block_table: torch.Tensor  # [D, max_blocks_per_req] int32, their rows of the block table
    seq_lens: torch.Tensor  # [D] int32, on device
    max_seq_len: int


@dataclass
class MLAPrefills:
    """A step's requests with more than one query token (expanded form), laid out for :func:`mla_prefill`:
    queries and context rows request after request."""

    rows: slice | torch.Tensor  # their query rows among the step's: a slice when contiguous, else [Tq] int64
    ctx_slots: torch.Tensor  # [N] int64, flat cache slots of each request's positions 0..S-1, in order
    cu_seqlens_q: torch.Tensor  # [B + 1] int32, cumulative query lengths
    cu_seqlens_k: torch.Tensor  # [B + 1] int32, cumulative context lengths (N = cu_seqlens_k[-1])
    query_lens: np.ndarray  # [B] int64, host
    seq_lens: np.ndarray  # [B] int64, host
    groups: list[PaddedGroup] | None = None  # the PyTorch path's (plan_padded_groups), built at first use


@dataclass
class MLAStepPlan:
    """One step's split of its requests (:func:`plan_mla_step`)."""

    decodes: MLADecodes | None  # None: no decode this step
    prefills: list[MLAPrefills]  # consecutive batches of the prefill chunks (usually one); empty: none


# The expanded form holds every context row of a batch of prefill chunks at once, up-projected ([N, H, P + V]:
# about 9 KB a row for DeepSeek-V2-Lite's 16 heads in bf16, so 300 MB for this many rows). Chunks whose contexts
# add up to more go in several batches (a single longer context makes a batch of its own, as the loop over requests
# did), so the peak stays bounded however long the contexts behind a step's chunks are. (The memory profile runs
# max_num_batched_tokens fresh tokens: that many rows.)
MAX_PREFILL_CONTEXT_ROWS = 32768


def plan_mla_step(
    block_table: torch.Tensor,  # [num_reqs, max_blocks_per_req] int, on the cache's device
    seq_lens: torch.Tensor,  # [num_reqs] int32, on the cache's device
    seq_lens_cpu: torch.Tensor,  # [num_reqs] int, host: context length after this step
    query_start_loc_cpu: torch.Tensor,  # [num_reqs + 1] int, host
    block_size: int,
    max_context_rows: int = MAX_PREFILL_CONTEXT_ROWS,
) -> MLAStepPlan:
    """Split a step's requests into decodes (query length 1) and prefill chunks (longer; length 0: neither) and
    compute their index tensors: array ops on the host over requests, one small copy to the device per tensor,
    the cache slots from the block table on its device (no read back). Prefill chunks go in batches of at most
    ``max_context_rows`` context rows (see ``MAX_PREFILL_CONTEXT_ROWS``)."""
    device = block_table.device
    starts = query_start_loc_cpu.numpy().astype(np.int64)  # [num_reqs + 1]
    lens = seq_lens_cpu.numpy().astype(np.int64)  # [num_reqs]
    query_lens = np.diff(starts)  # [num_reqs]
    too_long = np.flatnonzero(query_lens > lens)
    if len(too_long):
        r = int(too_long[0])
        raise ValueError(f"request {r}: query_len {query_lens[r]} > seq_len {lens[r]}")

    def to_device(a: np.ndarray) -> torch.Tensor:  # no wait for the device: the copy is staged at once
        return torch.from_numpy(np.ascontiguousarray(a)).to(device, non_blocking=True)

    decodes = None
    dec = np.flatnonzero(query_lens == 1)  # [D]
    if len(dec):
        tokens, reqs = to_device(np.stack([starts[dec], dec]))  # [D] each
        decodes = MLADecodes(
            tokens, block_table.index_select(0, reqs), seq_lens.index_select(0, reqs), int(lens[dec].max())
        )
    batches: list[list[int]] = []  # the requests with a prefill chunk, in order, cut at the row cap
    rows_in_batch = 0
    for r in np.flatnonzero(query_lens > 1).tolist():  # over the step's prefill chunks (a few), not tokens
        if not batches or rows_in_batch + lens[r] > max_context_rows:
            batches.append([])
            rows_in_batch = 0
        batches[-1].append(r)
        rows_in_batch += int(lens[r])
    prefills = []
    for batch in map(np.array, batches):
        n, s = query_lens[batch], lens[batch]  # [B] each
        cu_q = np.concatenate([[0], np.cumsum(n)])  # [B + 1]
        cu_k = np.concatenate([[0], np.cumsum(s)])  # [B + 1]
        first, end = int(starts[batch[0]]), int(starts[batch[-1] + 1])
        if end - first == cu_q[-1]:  # no decode between them: one run of rows
            rows: slice | torch.Tensor = slice(first, end)
        else:  # row i of the chunks: its request's first row + its offset within the request
            rows = to_device(np.arange(cu_q[-1]) - np.repeat(cu_q[:-1] - starts[batch], n))  # [Tq]
        # context position pos of request r -> block_table[r, pos // block_size], offset pos % block_size
        req_of, pos = to_device(np.stack([np.repeat(batch, s), np.arange(cu_k[-1]) - np.repeat(cu_k[:-1], s)]))
        ctx_slots = block_table[req_of, pos // block_size].long() * block_size + pos % block_size  # [N]
        cu = to_device(np.stack([cu_q, cu_k]).astype(np.int32))  # [2, B + 1]
        prefills.append(MLAPrefills(rows, ctx_slots, cu[0], cu[1], n, s))
    return MLAStepPlan(decodes, prefills)


def mla_prefill(
    q_nope: torch.Tensor,  # [T, H, P]
    q_pe: torch.Tensor,  # [T, H, R]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, L + R], this step's rows already written
    kv_b_proj: nn.Module,  # [..., L] -> [..., H * (P + V)]
    plan: MLAPrefills,
    scale: float,
    out: torch.Tensor,  # [T, H, V]; the prefill rows are written
    use_triton: bool,
) -> None:
    """The expanded form for all of a step's prefill chunks at once (same result as :func:`mla_prefill_ref`):
    gather their context rows, up-project the latents in one ``kv_b_proj`` call, then
    :func:`~pagedllm.kernels.mla_prefill.mla_prefill_attention` (``use_triton``: the Triton kernel; else its
    PyTorch twin). Per-head keys are never concatenated: ``k_nope`` and ``v`` are views of the projection."""
    num_heads, nope_dim = q_nope.shape[1], q_nope.shape[2]
    kv_lora_rank = kv_cache.shape[-1] - q_pe.shape[-1]
    rows = kv_cache.view(-1, kv_cache.shape[-1])  # [num_blocks * block_size, L + R]
    latent = rows[:, :kv_lora_rank].index_select(0, plan.ctx_slots)  # [N, L], contiguous
    k_pe = rows[:, kv_lora_rank:].index_select(0, plan.ctx_slots).to(q_nope.dtype)  # [N, R]
    kv = kv_b_proj(latent).view(latent.shape[0], num_heads, -1)  # [N, H, P + V]
    k_nope, v = kv[..., :nope_dim], kv[..., nope_dim:]  # [N, H, P], [N, H, V]
    contiguous = isinstance(plan.rows, slice)
    q_n = q_nope[plan.rows] if contiguous else q_nope.index_select(0, plan.rows)  # [Tq, H, P]
    q_p = (q_pe[plan.rows] if contiguous else q_pe.index_select(0, plan.rows)).to(q_nope.dtype)  # [Tq, H, R]
    o = out[plan.rows] if contiguous else None  # [Tq, H, V]: written in place when a view
    if use_triton:
        from pagedllm.kernels.mla_prefill import mla_prefill_attention

        max_query_len = int(plan.query_lens.max())
        o = mla_prefill_attention(
            q_n, q_p, k_nope, k_pe, v, plan.cu_seqlens_q, plan.cu_seqlens_k, scale, max_query_len, out=o
        )
    else:
        from pagedllm.kernels.mla_prefill import mla_prefill_attention_ref, plan_padded_groups

        if plan.groups is None:
            plan.groups = plan_padded_groups(plan.query_lens, plan.seq_lens, q_nope.device)
        o = mla_prefill_attention_ref(
            q_n, q_p, k_nope, k_pe, v, plan.cu_seqlens_q, plan.cu_seqlens_k, scale, out=o, groups=plan.groups
        )
    if not contiguous:
        out.index_copy_(0, plan.rows, o.to(out.dtype))


class MLAAttention(nn.Module):
    """Paged multi-head latent attention over already-projected, already-rotated inputs; holds no weights.

    ``forward`` writes this step's ``[latent | k_pe]`` rows into ``kv_cache`` at ``metadata.slot_mapping`` and
    returns per-head outputs ``[T, H, V]`` (before ``o_proj``). ``kv_b_proj`` (the layer's up-projection, a float
    ``[H * (P + V), L]`` weight) is passed in each call: the expanded form calls it, the absorbed form reads its
    weight. ``scale`` is the softmax scale (DeepSeek: ``(P + R) ** -0.5``, times yarn's mscale squared).
    """

    def __init__(
        self,
        num_heads: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        kv_lora_rank: int,
        scale: float,
        attn_backend: AttentionBackend,
        layer_idx: int,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.kv_lora_rank = kv_lora_rank
        self.scale = scale
        self.attn_backend = attn_backend
        self.layer_idx = layer_idx

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """This layer's cache: ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``."""
        return (num_blocks, block_size, self.kv_lora_rank + self.qk_rope_head_dim)

    def _absorbed_weights(self, kv_b_proj: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """``(W_UK, W_UV)``: views ``[H, P, L]`` and ``[H, V, L]`` of ``kv_b_proj.weight``."""
        weight = kv_b_proj._parameters.get("weight")
        if weight is None or weight.dim() != 2 or not weight.is_floating_point() or weight.element_size() < 2:
            raise NotImplementedError(
                "MLA decode needs kv_b_proj as a float weight (quantized kv_b_proj: not yet)"
            )
        w = weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim :]

    def _decode(
        self,
        q_nope: torch.Tensor,  # [B, H, P]
        q_pe: torch.Tensor,  # [B, H, R]
        kv_cache: torch.Tensor,  # [num_blocks, block_size, L + R]
        block_table: torch.Tensor,  # [>= B, max_blocks] int32
        seq_lens: torch.Tensor,  # [>= B] int32, on device
        max_seq_len: int,
        kv_b_proj: nn.Module,
    ) -> torch.Tensor:  # [B, H, V]
        """The absorbed form for one query per row."""
        w_uk, w_uv = self._absorbed_weights(kv_b_proj)
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [B, H, L]
        q_pe = q_pe.to(q_latent.dtype)
        if self.attn_backend.name == "triton" and use_fused_kernels(q_latent):
            from pagedllm.kernels.mla_decode import mla_decode

            o_latent = mla_decode(q_latent, q_pe, kv_cache, block_table, seq_lens, self.scale, max_seq_len)
        else:
            from pagedllm.kernels.mla_decode import mla_decode_ref

            o_latent = mla_decode_ref(
                q_latent, q_pe, kv_cache, block_table, seq_lens, self.scale, max_seq_len
            )
        return torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [B, H, V]

    def forward(
        self,
        q_nope: torch.Tensor,  # [T, H, P]
        q_pe: torch.Tensor,  # [T, H, R], rotated
        latent: torch.Tensor,  # [T, L], after kv_a_layernorm
        k_pe: torch.Tensor,  # [T, R], rotated
        kv_cache: torch.Tensor,  # [num_blocks, block_size, L + R]
        attn_metadata: AttentionMetadata,
        kv_b_proj: nn.Module,
    ) -> torch.Tensor:  # [T, H, V]; rows of tokens past the step's real ones are zero
        if kv_cache.dtype == FP8_KV_DTYPE:
            raise ValueError(
                "kv_cache_dtype='fp8' is not supported for multi-head latent attention (MLA) yet"
            )
        meta = attn_metadata
        write_latent_cache(latent, k_pe, kv_cache, meta.slot_mapping)
        num_tokens = q_nope.shape[0]
        if meta.is_pure_decode:  # row r is request r's only token; nothing read on the host
            out = torch.zeros(
                num_tokens, self.num_heads, self.v_head_dim, dtype=q_nope.dtype, device=q_nope.device
            )
            n = meta.num_reqs
            out[:n] = self._decode(
                q_nope[:n], q_pe[:n], kv_cache, meta.block_table, meta.seq_lens, meta.max_seq_len, kv_b_proj
            )
            return out
        out = torch.zeros(
            num_tokens, self.num_heads, self.v_head_dim, dtype=q_nope.dtype, device=q_nope.device
        )
        block_size = kv_cache.shape[1]
        plan = meta.derived(
            ("mla", block_size),
            lambda: plan_mla_step(
                meta.block_table, meta.seq_lens, meta.seq_lens_cpu, meta.query_start_loc_cpu, block_size
            ),
        )
        if plan.decodes is not None:
            d = plan.decodes
            o = self._decode(
                q_nope.index_select(0, d.tokens), q_pe.index_select(0, d.tokens), kv_cache, d.block_table,
                d.seq_lens, d.max_seq_len, kv_b_proj,
            )  # fmt: skip
            out.index_copy_(0, d.tokens, o.to(out.dtype))
        use_triton = self.attn_backend.name == "triton" and use_fused_kernels(q_nope)
        for prefills in plan.prefills:
            mla_prefill(q_nope, q_pe, kv_cache, kv_b_proj, prefills, self.scale, out, use_triton)
        return out

    def extra_repr(self) -> str:
        return (
            f"layer={self.layer_idx}, heads={self.num_heads}, kv_lora_rank={self.kv_lora_rank}, "
            f"qk_nope={self.qk_nope_head_dim}, qk_rope={self.qk_rope_head_dim}, v={self.v_head_dim}, "
            f"backend={self.attn_backend.name}"
        )
