"""Multi-head latent attention (MLA) over prefill chunks, in the expanded form, for a ragged batch in one launch.

The caller (:class:`pagedllm.attention.mla.MLAAttention`) gathers every prefill request's context rows out of the
paged latent cache, request after request, and up-projects the latents once (``kv_b_proj``). What this op gets
is then contiguous and varlen, with separate widths for the query/key parts and the values (P = qk_nope, R =
qk_rope, V = v_head_dim)::

    q_nope [Tq, H, P]   q_pe [Tq, H, R]        request b's queries: rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1]
    k_nope [N, H, P]    k_pe [N, R]            request b's keys:    rows cu_seqlens_k[b] .. cu_seqlens_k[b + 1]
    v      [N, H, V]                           (k_pe is shared by all heads, as MLA's rope key is)

    score[h, i, j] = scale * (q_nope[i, h] . k_nope[j, h] + q_pe[i, h] . k_pe[j])

Causal alignment is bottom-right: with ``n`` queries and ``S`` keys, query i sits at position ``S - n + i`` and
sees keys ``0 .. S - n + i`` (the queries are the last ``n`` tokens of the context). ``k_nope`` and ``v`` may be
strided views of one ``[N, H, P + V]`` tensor (``kv_b_proj``'s output) and the queries views of the model's
``[T, H, P + R]`` projection: nothing is concatenated, padded or expanded per head. (The paged kernel,
:mod:`pagedllm.kernels.paged_attention`, would need that: one power-of-two width for q, k and v, so DeepSeek's
128 + 64 and 128 padded to 256 each, written out per head as a temporary cache.)

Triton kernel (:func:`mla_prefill_attention`): one program per (head, tile of ``BLOCK_M`` queries of one
request), grid ``(H, Tq // BLOCK_M + num_reqs)`` (an upper bound on the tiles; request b's tiles start at
``cu_seqlens_q[b] // BLOCK_M + b``, each program finds its request by binary search, surplus programs exit; the
tiles run longest first). A program walks its request's keys ``BLOCK_N`` at a time: two ``tl.dot`` for the
scores (no-position and rope parts), one for the output, an online softmax in fp32 (base 2, the scale folded
in). Key tiles every row of the q tile sees whole skip the causal mask. No split-K: a few queries over a very long
context run on few programs. The launcher reads only Python ints (no host sync).

PyTorch twin (:func:`mla_prefill_attention_ref`, also the CPU path): requests grouped by length
(:func:`plan_padded_groups`), each group padded and masked, one SDPA call per group.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

try:  # CI may have no Triton: the twin (the CPU path) still imports
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where Triton is missing
    triton = None
    tl = None

_LOG2E = 1.4426950408889634


if triton is not None:

    @triton.jit
    def _attend_tile(
        q_nope, q_pe, m_i, l_i, acc, t, h, k_start, q_pos, kv_end, qk_scale, k_nope_ptr, k_pe_ptr, v_ptr,
        stride_knt, stride_knh, stride_kpt, stride_vt, stride_vh, offs_p, offs_r, offs_v,
        NOPE: tl.constexpr, ROPE: tl.constexpr, V_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
        DOT_PRECISION: tl.constexpr, MASKED: tl.constexpr,
    ):  # fmt: skip
        """One key tile of the online softmax. MASKED: the tile may hold keys at or past ``kv_end`` or after a
        row's own position; otherwise every key is visible to every row and no mask is built."""
        offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        k_row = (k_start + offs_n).to(tl.int64)  # [BLOCK_N] rows of k_nope / k_pe / v
        p_mask = offs_p < NOPE
        r_mask = offs_r < ROPE
        v_mask = offs_v < V_DIM
        if MASKED:
            n_valid = offs_n < kv_end
            kn = tl.load(
                k_nope_ptr + k_row[None, :] * stride_knt + h * stride_knh + offs_p[:, None],
                mask=p_mask[:, None] & n_valid[None, :],
                other=0.0,
            )  # [BLOCK_P, BLOCK_N]
            kr = tl.load(
                k_pe_ptr + k_row[None, :] * stride_kpt + offs_r[:, None],
                mask=r_mask[:, None] & n_valid[None, :],
                other=0.0,
            )  # [BLOCK_R, BLOCK_N]
        else:
            kn = tl.load(
                k_nope_ptr + k_row[None, :] * stride_knt + h * stride_knh + offs_p[:, None],
                mask=p_mask[:, None],
                other=0.0,
            )
            kr = tl.load(
                k_pe_ptr + k_row[None, :] * stride_kpt + offs_r[:, None], mask=r_mask[:, None], other=0.0
            )
        s = tl.dot(q_nope, kn.to(q_nope.dtype), input_precision=DOT_PRECISION)
        s += tl.dot(q_pe, kr.to(q_pe.dtype), input_precision=DOT_PRECISION)
        s = s * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        if MASKED:
            visible = n_valid[None, :] & (offs_n[None, :] <= q_pos[:, None])
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(
                v_ptr + k_row[:, None] * stride_vt + h * stride_vh + offs_v[None, :],
                mask=n_valid[:, None] & v_mask[None, :],
                other=0.0,
            )  # [BLOCK_N, BLOCK_V]
        else:
            v = tl.load(
                v_ptr + k_row[:, None] * stride_vt + h * stride_vh + offs_v[None, :],
                mask=v_mask[None, :],
                other=0.0,
            )
        v = v.to(q_nope.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        return m_new, l_i, acc

    @triton.jit
    def _mla_prefill_kernel(
        q_nope_ptr,  # [Tq, H, P]
        q_pe_ptr,  # [Tq, H, R]
        k_nope_ptr,  # [N, H, P]
        k_pe_ptr,  # [N, R]
        v_ptr,  # [N, H, V]
        out_ptr,  # [Tq, H, V]
        cu_q_ptr,  # [num_reqs + 1] int32
        cu_k_ptr,  # [num_reqs + 1] int32
        num_reqs,
        qk_scale,  # softmax scale * log2(e)
        stride_qnt, stride_qnh, stride_qpt, stride_qph, stride_knt, stride_knh, stride_kpt, stride_vt, stride_vh,
        stride_ot, stride_oh,
        NOPE: tl.constexpr,
        ROPE: tl.constexpr,
        V_DIM: tl.constexpr,
        BLOCK_P: tl.constexpr,  # next power of two >= max(NOPE, 16); likewise BLOCK_R, BLOCK_V
        BLOCK_R: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_M: tl.constexpr,  # query tokens per program
        BLOCK_N: tl.constexpr,  # keys per inner step
        DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs, else "tf32" (ignored for 16-bit inputs)
    ):  # fmt: skip
        h = tl.program_id(0)
        # Programs start in grid order: the last (longest, causal) tiles go first, short ones fill in behind.
        tile_id = tl.num_programs(1) - 1 - tl.program_id(1)
        lo = 0
        hi = num_reqs - 1
        while lo < hi:  # largest b with cu_q[b] // BLOCK_M + b <= tile_id
            mid = (lo + hi + 1) // 2
            first_tile = tl.load(cu_q_ptr + mid) // BLOCK_M + mid
            go_right = first_tile <= tile_id
            lo = tl.where(go_right, mid, lo)
            hi = tl.where(go_right, hi, mid - 1)
        req = lo
        q_start = tl.load(cu_q_ptr + req)
        q_tok0 = (tile_id - (q_start // BLOCK_M + req)) * BLOCK_M
        q_len = tl.load(cu_q_ptr + req + 1) - q_start
        if q_tok0 >= q_len:
            return
        k_start = tl.load(cu_k_ptr + req)
        seq_len = tl.load(cu_k_ptr + req + 1) - k_start
        ctx_len = seq_len - q_len  # keys before this request's first query

        offs_m = tl.arange(0, BLOCK_M)
        offs_p = tl.arange(0, BLOCK_P)
        offs_r = tl.arange(0, BLOCK_R)
        offs_v = tl.arange(0, BLOCK_V)
        q_tok = q_tok0 + offs_m
        row_valid = q_tok < q_len
        q_pos = ctx_len + q_tok  # [BLOCK_M] each row's position among its request's keys
        q_row = (q_start + q_tok).to(tl.int64)
        q_nope = tl.load(
            q_nope_ptr + q_row[:, None] * stride_qnt + h * stride_qnh + offs_p[None, :],
            mask=row_valid[:, None] & (offs_p < NOPE)[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_P]
        q_pe = tl.load(
            q_pe_ptr + q_row[:, None] * stride_qpt + h * stride_qph + offs_r[None, :],
            mask=row_valid[:, None] & (offs_r < ROPE)[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_R]

        # Keys [0, kv_end) are visible to the tile's last query; keys [0, q_first] to all of its rows, so the
        # first n_full tiles need no mask.
        kv_end = ctx_len + tl.minimum(q_tok0 + BLOCK_M, q_len)
        n_full = (ctx_len + q_tok0 + 1) // BLOCK_N
        num_tiles = tl.cdiv(kv_end, BLOCK_N)
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: no -inf - -inf
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)
        for t in range(0, n_full):
            m_i, l_i, acc = _attend_tile(
                q_nope, q_pe, m_i, l_i, acc, t, h, k_start, q_pos, kv_end, qk_scale, k_nope_ptr, k_pe_ptr, v_ptr,
                stride_knt, stride_knh, stride_kpt, stride_vt, stride_vh, offs_p, offs_r, offs_v,
                NOPE, ROPE, V_DIM, BLOCK_N, DOT_PRECISION, False,
            )  # fmt: skip
        for t in range(n_full, num_tiles):
            m_i, l_i, acc = _attend_tile(
                q_nope, q_pe, m_i, l_i, acc, t, h, k_start, q_pos, kv_end, qk_scale, k_nope_ptr, k_pe_ptr, v_ptr,
                stride_knt, stride_knh, stride_kpt, stride_vt, stride_vh, offs_p, offs_r, offs_v,
                NOPE, ROPE, V_DIM, BLOCK_N, DOT_PRECISION, True,
            )  # fmt: skip
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # every valid row sees key 0, so l_i > 0 there
        tl.store(
            out_ptr + q_row[:, None] * stride_ot + h * stride_oh + offs_v[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & (offs_v < V_DIM)[None, :],
        )


@functools.lru_cache(maxsize=64)
def tile_config(
    max_query_len: int, qk_width: int, v_width: int, dtype: torch.dtype
) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` for the longest query and the padded widths ``qk_width`` =
    BLOCK_P + BLOCK_R and ``v_width`` = BLOCK_V. Untuned guesses after the paged kernel's sm_90 choices (its
    ``tile_config``): 64-row 16-bit tiles (fewer rows and 4 warps for short queries), narrower key tiles and more
    warps for wide heads (DeepSeek: 128 + 64 and 128), small tiles and 8 warps for exact fp32 dots."""
    if dtype == torch.float32:
        block_m, block_n, num_warps = 32, 16, 8
    else:
        wide = qk_width > 128 or v_width > 128
        block_m, block_n, num_warps = 64, (32 if wide else 64), (8 if wide else 4)
    block_m = max(16, min(block_m, triton.next_power_of_2(max(max_query_len, 1))))
    if block_m < 64 and dtype != torch.float32:  # short chunks (speculative verification, chunk tails)
        num_warps = 4
    return block_m, block_n, num_warps, 2


def _check_shapes(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
) -> None:
    num_q, num_heads, nope = q_nope.shape
    num_k = k_nope.shape[0]
    rope, v_dim = q_pe.shape[2], v.shape[2]
    assert q_pe.shape == (num_q, num_heads, rope), f"q_pe {tuple(q_pe.shape)} vs q_nope {tuple(q_nope.shape)}"
    assert k_nope.shape == (num_k, num_heads, nope), f"k_nope {tuple(k_nope.shape)}"
    assert k_pe.shape == (num_k, rope), f"k_pe {tuple(k_pe.shape)}, want [{num_k}, {rope}]"
    assert v.shape == (num_k, num_heads, v_dim), f"v {tuple(v.shape)}"
    assert cu_seqlens_q.dim() == 1 and cu_seqlens_q.shape == cu_seqlens_k.shape, (
        f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} vs cu_seqlens_k {tuple(cu_seqlens_k.shape)}"
    )


def mla_prefill_attention(
    q_nope: torch.Tensor,  # [Tq, H, P]
    q_pe: torch.Tensor,  # [Tq, H, R], rotated
    k_nope: torch.Tensor,  # [N, H, P]
    k_pe: torch.Tensor,  # [N, R], rotated, shared by the heads
    v: torch.Tensor,  # [N, H, V]
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32, cumulative query lengths
    cu_seqlens_k: torch.Tensor,  # [B + 1] int32, cumulative key (context) lengths; each >= its query length
    scale: float,
    max_query_len: int,  # an upper bound of the query lengths (sizes the tiles only)
    out: torch.Tensor | None = None,  # [Tq, H, V], may be a strided view
    config: tuple[int, int, int, int] | None = None,  # override tile_config (tests, benchmark sweeps)
) -> torch.Tensor:  # [Tq, H, V], q_nope's dtype
    """Causal attention of each request's queries over its keys (bottom-right aligned; see the module docstring).
    Rows past ``cu_seqlens_q[-1]`` are left unwritten. Every last dim must be contiguous; the rest may stride."""
    _check_shapes(q_nope, q_pe, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k)
    num_q, num_heads, nope = q_nope.shape
    rope, v_dim = q_pe.shape[2], v.shape[2]
    assert q_nope.dtype == q_pe.dtype == k_nope.dtype == k_pe.dtype == v.dtype, (
        f"dtypes differ: q {q_nope.dtype}, q_pe {q_pe.dtype}, k {k_nope.dtype}, k_pe {k_pe.dtype}, v {v.dtype}"
    )
    for name, x in (("q_nope", q_nope), ("q_pe", q_pe), ("k_nope", k_nope), ("k_pe", k_pe), ("v", v)):
        assert x.stride(-1) == 1, f"{name}: last dim must be contiguous"
    assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32, "cu_seqlens must be int32"
    if out is None:
        out = torch.empty(num_q, num_heads, v_dim, dtype=q_nope.dtype, device=q_nope.device)
    assert out.shape == (num_q, num_heads, v_dim) and out.stride(2) == 1, f"out {tuple(out.shape)}"
    num_reqs = cu_seqlens_q.shape[0] - 1
    if num_q == 0 or num_reqs == 0 or num_heads == 0:
        return out
    block_p, block_r, block_v = (max(16, triton.next_power_of_2(d)) for d in (nope, rope, v_dim))
    block_m, block_n, num_warps, num_stages = config or tile_config(
        max_query_len, block_p + block_r, block_v, q_nope.dtype
    )
    num_q_tiles = num_q // block_m + num_reqs
    assert num_q_tiles < 65536, f"{num_q_tiles} query tiles: over the grid's y limit"
    _mla_prefill_kernel[(num_heads, num_q_tiles)](
        q_nope, q_pe, k_nope, k_pe, v, out, cu_seqlens_q, cu_seqlens_k, num_reqs, float(scale) * _LOG2E,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), k_nope.stride(0), k_nope.stride(1),
        k_pe.stride(0), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        NOPE=nope, ROPE=rope, V_DIM=v_dim, BLOCK_P=block_p, BLOCK_R=block_r, BLOCK_V=block_v,
        BLOCK_M=block_m, BLOCK_N=block_n, DOT_PRECISION="ieee" if q_nope.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


# ------------------------------------------------------------------------------------------------ PyTorch twin


@dataclass
class PaddedGroup:
    """Requests of similar lengths attended in one SDPA call, padded to ``n_max`` queries and ``s_max`` keys.

    A padding query row reads query 0 of the batch and is dropped; a padding key reads its request's first key
    (finite) and is masked out. ``mask`` lets query i of request b (``n`` queries, ``S`` keys) see keys
    ``<= min(S - n + i, S - 1)``: exactly the causal keys for real rows, and a finite row for padding ones.
    """

    num_reqs: int  # G
    n_max: int
    s_max: int
    # [G * n_max] int64 query rows, laid out [G, n_max]; None: all of them, in order
    q_index: torch.Tensor | None
    # [G * s_max] int64 key rows, laid out [G, s_max]; None: all of them, in order
    k_index: torch.Tensor | None
    # [G, 1, n_max, s_max] bool, True = attend; None: plain causal (no padding, every n == S)
    mask: torch.Tensor | None
    take: torch.Tensor | None  # [num_rows] int64 real rows of the padded [G * n_max] output; None: all
    dst: torch.Tensor | None  # [num_rows] int64 their rows among the Tq queries; None: 0..num_rows-1


# Requests sorted by context length join a group while its padded area (G * n_max * s_max) stays within this
# factor of the real one (sum of n * S): no group does more than twice the work it needs.
_MAX_PADDING = 2.0


def plan_padded_groups(
    query_lens: np.ndarray,  # [B] int, each >= 1
    seq_lens: np.ndarray,  # [B] int, each >= its query length
    device: torch.device | str,
) -> list[PaddedGroup]:
    """Group a ragged batch for :func:`mla_prefill_attention_ref` (host-side work, once a step): requests in
    order of decreasing context length, a new group each time padding would pass ``_MAX_PADDING``."""
    query_lens = np.asarray(query_lens, dtype=np.int64)
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    num_reqs = len(query_lens)
    if num_reqs == 0:
        return []
    cu_q = np.concatenate([[0], np.cumsum(query_lens)])  # [B + 1]
    cu_k = np.concatenate([[0], np.cumsum(seq_lens)])  # [B + 1]
    order = np.argsort(-seq_lens, kind="stable")
    members: list[list[int]] = [[]]
    n_max = real = 0
    for b in order.tolist():  # over requests, not tokens
        n, s = int(query_lens[b]), int(seq_lens[b])
        group = members[-1]
        if group:
            s_max = int(seq_lens[group[0]])  # the group's first is its longest
            padded = (len(group) + 1) * max(n_max, n) * s_max
            if padded > _MAX_PADDING * (real + n * s):
                group = []
                members.append(group)
                n_max = real = 0
        group.append(b)
        n_max, real = max(n_max, n), real + n * s

    def to_device(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device, non_blocking=True)

    groups = []
    for group in members:
        reqs = np.asarray(group, dtype=np.int64)  # [G]
        n, s = query_lens[reqs], seq_lens[reqs]  # [G] each
        n_max, s_max = int(n.max()), int(s.max())
        i = np.arange(n_max)
        j = np.arange(s_max)
        q_valid = i[None, :] < n[:, None]  # [G, n_max]
        q_index = np.where(q_valid, cu_q[reqs][:, None] + i[None, :], 0).reshape(-1)  # [G * n_max]
        k_index = np.where(j[None, :] < s[:, None], cu_k[reqs][:, None] + j[None, :], cu_k[reqs][:, None])
        unpadded = bool((n == n_max).all() and (s == s_max).all())
        in_order = unpadded and len(reqs) == num_reqs and bool((reqs == np.arange(num_reqs)).all())
        if unpadded and n_max == s_max:  # fresh prompts of one length: plain causal, no mask
            mask = None
        else:
            last = np.minimum(s[:, None] - n[:, None] + i[None, :], s[:, None] - 1)  # [G, n_max] last key seen
            mask = to_device((j[None, None, :] <= last[:, :, None])[:, None])  # [G, 1, n_max, s_max]
        take = None if unpadded else np.flatnonzero(q_valid.reshape(-1))  # [rows]
        groups.append(
            PaddedGroup(
                len(reqs), n_max, s_max,
                None if in_order else to_device(q_index),
                None if in_order else to_device(k_index.reshape(-1)),
                mask,
                None if take is None else to_device(take),
                None if in_order else to_device(q_index if take is None else q_index[take]),
            )
        )  # fmt: skip
    return groups


def mla_prefill_attention_ref(
    q_nope: torch.Tensor,  # [Tq, H, P]
    q_pe: torch.Tensor,  # [Tq, H, R]
    k_nope: torch.Tensor,  # [N, H, P]
    k_pe: torch.Tensor,  # [N, R]
    v: torch.Tensor,  # [N, H, V]
    cu_seqlens_q: torch.Tensor,  # [B + 1] int
    cu_seqlens_k: torch.Tensor,  # [B + 1] int
    scale: float,
    max_query_len: int | None = None,  # unused (the kernel's signature)
    out: torch.Tensor | None = None,  # [Tq, H, V]
    groups: list[PaddedGroup] | None = None,  # plan_padded_groups of the lengths; None: built here (host sync)
) -> torch.Tensor:  # [Tq, H, V], q_nope's dtype
    """PyTorch twin of :func:`mla_prefill_attention` (and the CPU path): one padded, masked SDPA call per group of
    similar lengths. Computed in float32 (float64 for float64) on CPU, in the input dtype on CUDA (SDPA
    accumulates in float32 there), as :func:`pagedllm.attention.mla.mla_prefill_ref`."""
    _check_shapes(q_nope, q_pe, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k)
    num_q, num_heads, _ = q_nope.shape
    num_k, v_dim = k_nope.shape[0], v.shape[2]
    if out is None:
        out = torch.empty(num_q, num_heads, v_dim, dtype=q_nope.dtype, device=q_nope.device)
    if groups is None:
        cu_q, cu_k = cu_seqlens_q.cpu().numpy(), cu_seqlens_k.cpu().numpy()
        groups = plan_padded_groups(np.diff(cu_q), np.diff(cu_k), q_nope.device)
    dtype = q_nope.dtype if q_nope.is_cuda else torch.promote_types(q_nope.dtype, torch.float32)
    # One width D for queries, keys and values, the narrower zero-padded (no score or output column changes): SDPA's
    # fused kernels need equal widths; without them it materializes the scores (1.6x slower, seen on CPU).
    qk_dim = q_nope.shape[2] + q_pe.shape[2]
    width = max(qk_dim, v_dim)

    def padded(parts: list[torch.Tensor]) -> torch.Tensor:  # [rows, H, D]: the parts side by side, then zeros
        rows, pad = parts[0].shape[0], width - sum(x.shape[2] for x in parts)
        zeros = [parts[0].new_zeros(()).expand(rows, num_heads, pad)] if pad else []
        return torch.cat(parts + zeros, dim=-1).to(dtype)

    q = padded([q_nope, q_pe])  # [Tq, H, D]
    k = padded([k_nope, k_pe[:, None, :].expand(num_k, num_heads, -1)])  # [N, H, D]
    v = padded([v]) if v_dim < width else v.to(dtype)  # [N, H, D]
    for g in groups:
        qg = q if g.q_index is None else q.index_select(0, g.q_index)  # [G * n_max, H, D]
        kg = k if g.k_index is None else k.index_select(0, g.k_index)  # [G * s_max, H, D]
        vg = v if g.k_index is None else v.index_select(0, g.k_index)  # [G * s_max, H, D]
        qg, kg, vg = (x.view(g.num_reqs, -1, num_heads, width).transpose(1, 2) for x in (qg, kg, vg))
        causal = g.mask is None
        o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, is_causal=causal, scale=scale)
        o = o.transpose(1, 2)[..., :v_dim].reshape(-1, num_heads, v_dim)  # [G * n_max, H, V]
        if g.take is not None:
            o = o.index_select(0, g.take)  # [rows, H, V]
        if g.dst is None:
            out[: o.shape[0]] = o.to(out.dtype)
        else:
            out.index_copy_(0, g.dst, o.to(out.dtype))
    return out
