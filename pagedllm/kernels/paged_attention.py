"""Causal paged attention over a ragged batch (prefill chunks with cached context, and decodes) in one kernel.

Layout (see ``pagedllm/attention/base.py``): query ``[num_tokens, num_heads, head_dim]``, one layer's cache
``[2, num_blocks, block_size, num_kv_heads, head_dim]``. Request r owns query rows
``query_start_loc[r] .. query_start_loc[r + 1]``; its context is ``seq_lens[r]`` tokens, the last
``q_len`` of them being this step's queries, so query i of r sits at position ``seq_lens[r] - q_len + i``.

Work split. One program owns one *q tile* of one KV head: ``BLOCK_Q`` consecutive query tokens of one
request times all ``group = num_heads // num_kv_heads`` query heads that share the KV head, i.e. a
``[BLOCK_M, head_dim]`` tile with row ``m`` = (token ``m // G_PAD``, head ``kv_head * group + m % G_PAD``).
Each K/V tile is loaded once per KV head and used by the whole group through ``tl.dot``. The program walks
the keys its last query may see, ``TILE_N`` at a time, gathering each key's block through the block table,
with an online softmax in fp32 (base 2, the scale folded into the scores).

Grid ``(num_kv_heads, num_q_tiles, num_splits)`` (prefill tiles in reverse order: longest first):

* mixed / prefill batches: ``num_q_tiles = num_tokens // BLOCK_Q + num_reqs``, an upper bound on the
  tiles of all requests (request r's tiles start at ``query_start_loc[r] // BLOCK_Q + r``; each program
  finds its request by binary search over ``query_start_loc``; surplus programs exit at once);
* pure decode (``max_query_len == 1``): ``num_q_tiles = num_reqs``, program r is request r, no search.

Split-K (flash-decoding): when the grid is too small to fill the GPU and contexts are long, each q tile's
key range is cut into ``num_splits`` equal runs of tiles (computed in the kernel from the real
``seq_lens``, so any split count is correct for any length). Each split writes an unnormalized partial
output with its running max and sum to fp32 scratch, then takes a ticket from its q tile's counter; the last
split to arrive merges all the tile's partials in split order (deterministic) and writes the output, so there is
no second launch (a separate merge kernel cost ~2 µs plus a launch per layer in batch-1 decode). See
:func:`num_kv_splits` for the rule and :func:`split_counters` for the counters.

Sliding window and soft-cap (per layer, see ``pagedllm/attention/base.py``). With a window W, the query at
position p sees keys ``p - W < k <= p``. A q tile whose queries sit at positions ``p0 .. p1`` then walks key
tiles from the one holding ``p0 - W + 1`` only: tiles wholly behind the window are never loaded (that is the
speed-up: a decode reads about W keys, not ``seq_len``). Key tiles come in up to three runs: a masked run
partly behind the window of some row, a mask-free run every row sees whole (keys ``>= p1 - W + 1`` and
``<= p0``), and a masked run over the causal diagonal and ``kv_end``. Without a window the first run is empty and
the kernel is the plain causal one. Split-K divides the walked tiles only. The soft-cap turns the scaled score
``s`` into ``cap * tanh(s / cap)`` on every tile (masked or not), before the mask. Blocks behind the window are
still allocated and listed in the block table; the kernel just does not read them.

Attention sinks (per layer, ``[num_heads]``; see ``pagedllm/attention/base.py``). The sink is a key every row sees,
with logit ``sinks[h]`` and a zero value, so it only adds ``exp(sinks[h])`` to the softmax denominator. The kernel
starts each row's online softmax from it instead of from nothing: running max ``sinks[h] * log2(e)`` and running
sum 1 (``acc`` stays 0). Split-K: only split 0 starts from the sink (the others from -1e30 and 0), so the merge
counts it once, unchanged. Prefill, chunked prefill and decode tiles all go through that one initialisation.

Head sizes. ``head_dim`` is a power of two >= 16, or a multiple of 16 up to 256 (Phi-3's 96, Phi-2's 80): the
tiles are ``HEAD_PAD = next_power_of_2(head_dim)`` wide, and every load and store of q, k, v, the output and the
split-K partials is masked to ``d < head_dim``, the lanes past it read as 0 (so the dot products and the output are
those of the unpadded head). These masks exist only where ``HEAD_PAD != HEAD_DIM`` (constexpr branches): a
power-of-two head compiles to the code it had without them.

FP8 KV cache (``float8_e4m3fn``, per-tensor ``k_scale`` / ``v_scale``; see ``pagedllm/attention/base.py``). Each
K/V tile is loaded as fp8 (half the bytes of bf16) and converted in registers to the query's dtype (exact: every
e4m3 value is a bf16/fp16/fp32 value); the scales never touch the tiles: ``k_scale`` is folded into the score
scale (``q . (k * ks) = (q . k) * ks``) and ``v_scale`` multiplies the fp32 accumulator once at the end.

CUDA graphs. The launcher reads only Python ints and never syncs. The attention grid is
``(num_kv_heads, num_q_tiles, num_splits)`` with ``num_q_tiles`` as above (``BLOCK_Q`` from
:func:`tile_config`, a function of ``max_query_len``, the group, head_dim and dtype) and
``num_splits = num_kv_splits(num_q_tiles, num_kv_heads, max_seq_len, num_SMs)``; with ``num_splits > 1``
fp32 scratch is taken with ``torch.empty`` (from the graph's pool while capturing) and the ticket counters must
already exist (an eager launch of that size first, as the engine's warm-up does). To capture pure decode for a
padded batch size B, call with
``num_reqs=B``, ``max_query_len=1`` and a fixed ``max_seq_len`` (say max_model_len): the grid is then fixed,
and replays are correct for any ``seq_lens`` the block table covers, since the kernel reads lengths from
device memory. Padding requests may have ``seq_lens == 0`` (their rows come out 0) or a query length of 0.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pagedllm.kernels.pdl import pdl_launch_options, pdl_prologue
from pagedllm.platform import use_pdl

# Split-K rule constants (see num_kv_splits).
_SPLIT_MIN_KEYS = 256  # fewest keys one split should walk
_MAX_SPLITS = 32
_PROGRAMS_PER_SM = 4  # aim for this many programs per SM before splitting stops paying
_LOG2E = 1.4426950408889634


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # Triton's CPU interpreter: any small number exercises the split path


@functools.lru_cache(maxsize=1024)
def num_kv_splits(num_q_tiles: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """How many programs share one q tile's keys: a power of two in [1, 32].

    Split only while the grid ``num_q_tiles * num_kv_heads`` is under ``4 * num_sms`` programs, and never
    below 256 keys per split (for ``max_seq_len``). Depends only on these four integers.
    """
    base = num_q_tiles * num_kv_heads
    target = _PROGRAMS_PER_SM * num_sms
    if base >= target or max_seq_len < 2 * _SPLIT_MIN_KEYS:
        return 1
    splits = min(triton.cdiv(target, base), max_seq_len // _SPLIT_MIN_KEYS, _MAX_SPLITS)
    return 1 << (splits.bit_length() - 1)  # round down to a power of two


_SPLIT_COUNTERS: dict[torch.device, torch.Tensor] = {}


def split_counters(device: torch.device, n: int) -> torch.Tensor:
    """At least ``n`` zeroed int32 ticket counters on ``device`` for the split-K merge, cached per device.

    Each launch leaves them zeroed again, so one buffer serves every launch on the device's stream (launches
    on several streams of one device at once must not share it). The first one is made outside a CUDA graph
    capture: a buffer made while capturing would be filled only at the graph's first replay. The engine's
    graphs run the model once eagerly before capturing, which makes it.
    """
    buf = _SPLIT_COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"paged_attention: no split-K counters for {n} q tiles on {device} yet; run one launch of this "
                "size before capturing a CUDA graph"
            )
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _SPLIT_COUNTERS[device] = buf
    return buf


@triton.jit
def _tanh(x):
    """tanh in fp32 from exp2 (portable: no libdevice, runs in the interpreter). A short odd series near 0,
    where ``(1 - e) / (1 + e)`` would lose digits to cancellation."""
    ax = tl.abs(x)
    e = tl.math.exp2(ax * -2.8853900817779268)  # exp(-2|x|)
    big = (1.0 - e) / (1.0 + e)
    x2 = x * x
    small = ax * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * -0.05396825396825397)))
    t = tl.where(ax < 0.125, small, big)
    return tl.where(x < 0.0, -t, t)


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc, t, q_pos, kv_end, qk_scale, cap_log2, window, block_table_row, kv_cache_ptr, v_cache_ptr,
    kv_head_off, stride_cb, stride_cs, offs_d,
    TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr, MASKED: tl.constexpr,
    SLIDING: tl.constexpr, SOFT_CAP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
):  # fmt: skip
    """One key tile of the online softmax. MASKED: the tile may hold keys past ``kv_end``, after a row's own
    position (the causal diagonal) or, with SLIDING, at or behind a row's ``q_pos - window``; otherwise every
    key is visible to every row and no mask is built. SOFT_CAP: scores are ``cap_log2 * tanh(dot * qk_scale)``
    (``qk_scale`` = scale / cap), else ``dot * qk_scale`` (``qk_scale`` = scale * log2(e)). ``offs_d`` spans
    ``HEAD_PAD``; with ``HEAD_PAD != HEAD_DIM`` the k and v lanes ``d >= HEAD_DIM`` are not read (they are 0)."""
    offs_n = t * TILE_N + tl.arange(0, TILE_N)
    if MASKED:
        n_valid = offs_n < kv_end
        block = tl.load(block_table_row + offs_n // BLOCK_SIZE, mask=n_valid, other=0).to(tl.int64)
    else:
        block = tl.load(block_table_row + offs_n // BLOCK_SIZE).to(tl.int64)
    slot_off = block * stride_cb + (offs_n % BLOCK_SIZE) * stride_cs + kv_head_off  # [TILE_N]
    if HEAD_PAD != HEAD_DIM:
        k_ok = offs_d[:, None] < HEAD_DIM  # [HEAD_PAD, 1]
        if MASKED:
            k_ok = k_ok & n_valid[None, :]
        k = tl.load(kv_cache_ptr + slot_off[None, :] + offs_d[:, None], mask=k_ok, other=0.0)
    elif MASKED:
        k = tl.load(kv_cache_ptr + slot_off[None, :] + offs_d[:, None], mask=n_valid[None, :], other=0.0)
    else:
        k = tl.load(kv_cache_ptr + slot_off[None, :] + offs_d[:, None])  # [HEAD_PAD, TILE_N]
    k = k.to(q.dtype)  # fp8 cache: exact widening in registers (no-op otherwise)
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, TILE_N], log2 units
    if SOFT_CAP:
        s = cap_log2 * _tanh(s)
    if MASKED:
        visible = n_valid[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if SLIDING:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if HEAD_PAD != HEAD_DIM:
        v_ok = offs_d[None, :] < HEAD_DIM  # [1, HEAD_PAD]
        if MASKED:
            v_ok = v_ok & n_valid[:, None]
        v = tl.load(v_cache_ptr + slot_off[:, None] + offs_d[None, :], mask=v_ok, other=0.0)
    elif MASKED:
        v = tl.load(v_cache_ptr + slot_off[:, None] + offs_d[None, :], mask=n_valid[:, None], other=0.0)
    else:
        v = tl.load(v_cache_ptr + slot_off[:, None] + offs_d[None, :])  # [TILE_N, HEAD_PAD]
    v = v.to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


# Integer arguments that change from step to step are not specialized on (by default Triton compiles a variant for
# values equal to 1 and for multiples of 16): each variant is a JIT compile of seconds in the middle of a run.
@triton.jit(do_not_specialize=["num_reqs", "part_ml_stride"])
def _paged_attention_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    kv_cache_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_dim]: keys at 0, values at stride_kv
    out_ptr,  # [num_tokens, num_heads, head_dim]
    part_acc_ptr,  # [num_tokens, num_heads, NUM_SPLITS, head_dim] fp32 (only when NUM_SPLITS > 1)
    part_ml_ptr,  # [2, num_tokens, num_heads, NUM_SPLITS] fp32: running max (log2 units), running sum
    counter_ptr,  # [num_kv_heads * num_q_tiles] int32, zero between launches (only when NUM_SPLITS > 1)
    block_table_ptr,  # [num_reqs, max_blocks_per_req] int32
    seq_lens_ptr,  # [num_reqs] int32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    sinks_ptr,  # [num_heads] with SINKS (any float dtype; else unused)
    num_reqs,
    part_ml_stride,  # num_tokens * num_heads * NUM_SPLITS
    qk_scale,  # softmax scale * log2(e); with SOFT_CAP: softmax scale / cap (times k_scale with KV_FP8)
    v_scale,  # with KV_FP8: the values' per-tensor scale (else unused)
    cap_log2,  # with SOFT_CAP: cap * log2(e) (else unused)
    window,  # with SLIDING: the window W (else unused)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kv,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # num_heads // num_kv_heads
    G_PAD: tl.constexpr,  # next power of two >= GROUP
    BLOCK_Q: tl.constexpr,  # query tokens per tile (BLOCK_Q * G_PAD <= BLOCK_M)
    BLOCK_M: tl.constexpr,  # tile rows, >= 16 for tl.dot
    TILE_N: tl.constexpr,  # keys per inner step
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # next power of two >= HEAD_DIM: the tiles' width (lanes past HEAD_DIM masked)
    BLOCK_SIZE: tl.constexpr,  # KV cache block size
    NUM_SPLITS: tl.constexpr,
    PURE_DECODE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs, else "tf32" (ignored for 16-bit inputs)
    SLIDING: tl.constexpr,  # keys at or behind q_pos - window are invisible
    SOFT_CAP: tl.constexpr,  # tanh soft-cap on the scores
    KV_FP8: tl.constexpr,  # float8_e4m3fn cache: scale the accumulator by v_scale
    SINKS: tl.constexpr,  # one extra logit per head in the softmax denominator (no value)
    PDL: tl.constexpr,  # launched as a programmatic dependent launch (pagedllm/kernels/pdl.py)
):
    pdl_prologue(PDL)
    kv_head = tl.program_id(0)
    tile_id = tl.program_id(1)
    split = tl.program_id(2)
    if not PURE_DECODE:
        # Programs start in grid order: give the first ones the last (longest, causal) tiles, so the short
        # ones fill in behind them instead of a long tile starting last.
        tile_id = tl.num_programs(1) - 1 - tile_id

    # Find the request and the first query token of this tile.
    if PURE_DECODE:
        req = tile_id
        q_tok0 = 0
    else:
        lo = 0
        hi = num_reqs - 1
        while lo < hi:  # largest r with query_start_loc[r] // BLOCK_Q + r <= tile_id
            mid = (lo + hi + 1) // 2
            first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
            go_right = first_tile <= tile_id
            lo = tl.where(go_right, mid, lo)
            hi = tl.where(go_right, hi, mid - 1)
        req = lo
        q_tok0 = (tile_id - (tl.load(query_start_loc_ptr + req) // BLOCK_Q + req)) * BLOCK_Q
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if q_tok0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = seq_len - q_len  # keys already cached before this step's queries

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    tok = offs_m // G_PAD
    g = offs_m % G_PAD
    q_tok = q_tok0 + tok
    row_valid = (tok < BLOCK_Q) & (g < GROUP) & (q_tok < q_len)
    head = kv_head * GROUP + g
    q_row = (q_start + q_tok).to(tl.int64)
    q_pos = ctx_len + q_tok  # absolute position of each row's query
    if HEAD_PAD != HEAD_DIM:  # the rows and lanes of q, the output and the partials that exist
        io_mask = row_valid[:, None] & (offs_d[None, :] < HEAD_DIM)  # [BLOCK_M, HEAD_PAD]
    else:
        io_mask = row_valid[:, None]

    q = tl.load(
        q_ptr + q_row[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=io_mask,
        other=0.0,
    )

    # Keys [0, kv_end) are visible to the last query of this tile (at position kv_end - 1), and with a window
    # keys from q_first - window + 1 on to the first one (at position q_first).
    kv_end = tl.minimum(seq_len, ctx_len + tl.minimum(q_tok0 + BLOCK_Q, q_len))
    q_first = ctx_len + q_tok0
    num_tiles = tl.cdiv(kv_end, TILE_N)
    if SLIDING:
        tile_start = tl.maximum(q_first - window + 1, 0) // TILE_N  # first tile any row sees
        full_lo = tl.cdiv(tl.maximum(kv_end - window, 0), TILE_N)  # first tile inside every row's window
    else:
        tile_start = 0
        full_lo = 0
    if NUM_SPLITS > 1:
        tiles_per_split = tl.cdiv(num_tiles - tile_start, NUM_SPLITS)
        tile_lo = tile_start + split * tiles_per_split
        tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)
    else:
        tile_lo = tile_start
        tile_hi = num_tiles

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: keeps fully masked rows NaN-free
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if SINKS:  # the sink as the first key seen: max = its logit (log2 units), sum = exp2(0); split 0 only
        sink = tl.load(sinks_ptr + head, mask=row_valid, other=0.0).to(tl.float32) * 1.4426950408889634
        m_i = tl.where(split == 0, sink, m_i)
        l_i = tl.where(split == 0, 1.0, l_i)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    block_table_row = block_table_ptr + req.to(tl.int64) * stride_bt
    kv_head_off = kv_head * stride_ch
    v_cache_ptr = kv_cache_ptr + stride_kv

    # Tiles [f_lo, f_hi) hold only keys every row of the tile may see: no causal, window or length mask
    # there. Below n_full every key is at or before the first row's position; from full_lo on every key is
    # inside the last row's window. Tiles [tile_start, f_lo) (window edge) and [f_hi, num_tiles) (diagonal) are
    # masked.
    n_full = (q_first + 1) // TILE_N
    f_lo = tl.maximum(tile_start, full_lo)
    f_hi = tl.maximum(f_lo, n_full)
    if SLIDING:
        for t in range(tile_lo, tl.minimum(tile_hi, f_lo)):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, t, q_pos, kv_end, qk_scale, cap_log2, window, block_table_row, kv_cache_ptr,
                v_cache_ptr, kv_head_off, stride_cb, stride_cs, offs_d, TILE_N, BLOCK_SIZE, DOT_PRECISION,
                True, SLIDING, SOFT_CAP, HEAD_DIM, HEAD_PAD,
            )  # fmt: skip
    for t in range(tl.maximum(tile_lo, f_lo), tl.minimum(tile_hi, f_hi)):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, t, q_pos, kv_end, qk_scale, cap_log2, window, block_table_row, kv_cache_ptr,
            v_cache_ptr, kv_head_off, stride_cb, stride_cs, offs_d, TILE_N, BLOCK_SIZE, DOT_PRECISION,
            False, SLIDING, SOFT_CAP, HEAD_DIM, HEAD_PAD,
        )  # fmt: skip
    for t in range(tl.maximum(tile_lo, f_hi), tile_hi):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, t, q_pos, kv_end, qk_scale, cap_log2, window, block_table_row, kv_cache_ptr,
            v_cache_ptr, kv_head_off, stride_cb, stride_cs, offs_d, TILE_N, BLOCK_SIZE, DOT_PRECISION,
            True, SLIDING, SOFT_CAP, HEAD_DIM, HEAD_PAD,
        )  # fmt: skip

    if KV_FP8:
        acc = acc * v_scale
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + q_row[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=io_mask,
        )
    else:
        row0 = (q_row * NUM_HEADS + head) * NUM_SPLITS  # [BLOCK_M]: each row's split 0
        tl.store(part_acc_ptr + (row0 + split)[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=io_mask)
        tl.store(part_ml_ptr + row0 + split, m_i, mask=row_valid)
        tl.store(part_ml_ptr + part_ml_stride + row0 + split, l_i, mask=row_valid)
        # The last of this q tile's splits to finish merges them all, in split order (deterministic).
        tl.debug_barrier()  # every thread's partials are written before the (release) ticket below
        counter = counter_ptr + kv_head * tl.num_programs(1) + tile_id
        ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if ticket == NUM_SPLITS - 1:  # the other splits' partials are visible
            m_max = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
            for s in range(NUM_SPLITS):
                m_s = tl.load(part_ml_ptr + row0 + s, mask=row_valid, other=-1.0e30, cache_modifier=".cg")
                m_max = tl.maximum(m_max, m_s)
            denom = tl.zeros([BLOCK_M], dtype=tl.float32)
            out = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
            for s in range(NUM_SPLITS):
                m_s = tl.load(part_ml_ptr + row0 + s, mask=row_valid, other=-1.0e30, cache_modifier=".cg")
                l_s = tl.load(
                    part_ml_ptr + part_ml_stride + row0 + s, mask=row_valid, other=0.0, cache_modifier=".cg"
                )
                w = tl.math.exp2(m_s - m_max)  # [BLOCK_M]
                denom += w * l_s
                acc_s = tl.load(
                    part_acc_ptr + (row0 + s)[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=io_mask,
                    other=0.0,
                    cache_modifier=".cg",
                )
                out += acc_s * w[:, None]
            out = out / tl.where(denom > 0.0, denom, 1.0)[:, None]
            tl.store(
                out_ptr + q_row[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=io_mask,
            )
            tl.atomic_xchg(counter, 0)  # ready for the next launch (or graph replay)


@functools.lru_cache(maxsize=256)
def tile_config(
    max_query_len: int, group: int, head_dim: int, dtype: torch.dtype
) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_Q, TILE_N, num_warps, num_stages) for a batch's longest query, GQA group and dtype.

    Chosen from sm_90 compiles (triton 3.6 and 3.9) to stay clear of register spills: 16-bit prefill tiles
    of 64 rows use wgmma (~176 registers at head_dim 128), decode tiles of 16 rows use mma.sync (~90).
    fp32 runs exact (non-tf32) FMA dots, which need small tiles and 8 warps.
    """
    g_pad = triton.next_power_of_2(group)
    if dtype == torch.float32:
        tile_n = 32 if head_dim <= 128 and max_query_len <= 1 else 16
        rows_cap, num_warps = 32, 8
    else:
        tile_n = 64 if head_dim <= 128 else 32
        rows_cap, num_warps = 64, (4 if head_dim <= 128 else 8)
    if max_query_len <= 1:
        return max(16, g_pad), 1, tile_n, (num_warps if dtype == torch.float32 else 4), 2
    block_m = max(16, min(triton.next_power_of_2(max_query_len) * g_pad, rows_cap), g_pad)
    if block_m < 64 and dtype != torch.float32:
        num_warps = 4
    return block_m, max(1, block_m // g_pad), tile_n, num_warps, 2


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    scale: float,
    num_reqs: int,
    max_query_len: int,
    max_seq_len: int,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    num_splits: int | None = None,  # override the split-K rule (tests); a power of two
    config: tuple[int, int, int, int, int] | None = None,  # override tile_config (benchmark sweeps)
    sliding_window: int | None = None,  # W: query at p sees keys p - W < k <= p; None = full causal
    logits_soft_cap: float | None = None,  # c: scores -> c * tanh(scores / c) before the softmax
    k_scale: float = 1.0,  # float8_e4m3fn cache only: keys read as k_fp8 * k_scale
    v_scale: float = 1.0,  # float8_e4m3fn cache only: values read as v_fp8 * v_scale
    sinks: torch.Tensor | None = None,  # [num_heads]: per-head logit added to the softmax denominator
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of ``query`` over the paged cache (this step's keys must already be written).

    Rows past ``query_start_loc[num_reqs]`` (padding) are left unwritten. No host sync: the grid comes
    from ``query.shape[0]``, ``num_reqs``, ``max_query_len``, ``max_seq_len`` and ``sliding_window`` (see module
    docstring).
    """
    num_tokens, num_heads, head_dim = query.shape
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, f"bad kv_cache shape {tuple(kv_cache.shape)}"
    _, _, block_size, num_kv_heads, cache_head_dim = kv_cache.shape
    assert cache_head_dim == head_dim, f"head_dim {head_dim} != cache head_dim {cache_head_dim}"
    assert num_heads % num_kv_heads == 0, f"num_heads {num_heads} not a multiple of {num_kv_heads}"
    assert head_dim >= 16 and (head_dim & (head_dim - 1) == 0 or (head_dim % 16 == 0 and head_dim <= 256)), (
        f"head_dim {head_dim}: need a power of two >= 16, or a multiple of 16 <= 256"
    )
    kv_fp8 = kv_cache.dtype == torch.float8_e4m3fn
    assert kv_fp8 or query.dtype == kv_cache.dtype, f"query {query.dtype} != kv_cache {kv_cache.dtype}"
    assert query.stride(2) == 1 and kv_cache.stride(4) == 1, "head_dim must be contiguous"
    assert block_table.dtype == seq_lens.dtype == query_start_loc.dtype == torch.int32
    assert block_table.stride(1) == 1
    assert sliding_window is None or sliding_window >= 1, f"sliding_window {sliding_window}"
    assert logits_soft_cap is None or logits_soft_cap > 0, f"logits_soft_cap {logits_soft_cap}"
    if sinks is not None:
        assert sinks.shape == (num_heads,) and sinks.stride(0) == 1, f"sinks {tuple(sinks.shape)}"
        assert sinks.device == query.device and sinks.is_floating_point(), f"sinks {sinks.dtype}"
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0 or num_reqs == 0:
        return out
    group = num_heads // num_kv_heads
    block_m, block_q, tile_n, num_warps, num_stages = config or tile_config(
        max_query_len, group, head_dim, query.dtype
    )
    pure_decode = max_query_len <= 1
    num_q_tiles = num_reqs if pure_decode else num_tokens // block_q + num_reqs
    if num_splits is None:
        # A q tile walks at most window + BLOCK_Q - 1 keys: split for that, not for the whole context.
        keys = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window + block_q - 1)
        num_splits = num_kv_splits(num_q_tiles, num_kv_heads, keys, _num_sms(query.device))
    assert num_splits >= 1 and num_splits & (num_splits - 1) == 0, f"num_splits {num_splits}"

    if num_splits > 1:
        part_acc = torch.empty(
            (num_tokens, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device
        )
        part_ml = torch.empty(
            (2, num_tokens, num_heads, num_splits), dtype=torch.float32, device=query.device
        )
        counters = split_counters(query.device, num_kv_heads * num_q_tiles)
    else:
        part_acc = part_ml = counters = out  # unused
    part_ml_stride = num_tokens * num_heads * num_splits
    qk_scale = scale / logits_soft_cap if logits_soft_cap else scale * _LOG2E
    if kv_fp8:
        qk_scale *= float(k_scale)  # q . (k_fp8 * k_scale) = (q . k_fp8) * k_scale
    assert num_q_tiles < 65536, f"{num_q_tiles} query tiles: over the grid's y limit"
    pdl = use_pdl(query)
    _paged_attention_kernel[(num_kv_heads, num_q_tiles, num_splits)](
        query,
        kv_cache,
        out,
        part_acc,
        part_ml,
        counters,
        block_table,
        seq_lens,
        query_start_loc,
        sinks if sinks is not None else out,  # unused without SINKS
        num_reqs,
        part_ml_stride,
        qk_scale,
        float(v_scale) if kv_fp8 else 1.0,
        logits_soft_cap * _LOG2E if logits_soft_cap else 0.0,
        sliding_window or 0,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_table.stride(0),
        NUM_HEADS=num_heads,
        GROUP=group,
        G_PAD=triton.next_power_of_2(group),
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        TILE_N=tile_n,
        HEAD_DIM=head_dim,
        HEAD_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        NUM_SPLITS=num_splits,
        PURE_DECODE=pure_decode,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        SLIDING=sliding_window is not None,
        SOFT_CAP=logits_soft_cap is not None,
        KV_FP8=kv_fp8,
        SINKS=sinks is not None,
        PDL=pdl,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_launch_options(pdl),
    )
    return out


def paged_attention_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """PyTorch twin of :func:`paged_attention`: the reference in ``pagedllm.attention.torch_ref``."""
    from pagedllm.attention.torch_ref import paged_attention_ref as ref

    return ref(
        query, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale, sliding_window,
        logits_soft_cap, k_scale, v_scale, sinks,
    )  # fmt: skip
