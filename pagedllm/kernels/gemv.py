"""Single-row GEMV for batch-1 decode: ``[1, K] @ [N, K]^T (+ bias) -> [1, N]``, optionally with the gated
MLP's ``silu(x[:, :K]) * x[:, K:]`` fused into its input.

Why: batch-1 decode of a Llama-3.1-8B-shaped model (bf16, H100) spent 5.56 ms per token in cuBLAS GEMMs
streaming weights at only ~2.4-2.85 TB/s (qkv [6144, 4096] and o_proj [4096, 4096] ~2.4 TB/s, down
[4096, 14336] ~2.8, gate_up [28672, 4096] 2.87, lm_head [128256, 4096] 2.85; two of them also launch a
separate splitKreduce kernel), against a practical copy bandwidth of ~3.0 TB/s. One row of activations
makes the product pure weight streaming, so the kernel is built to keep the most weight bytes in flight.

Layout and work split::

    weight [N, K] row-major (nn.Linear)            grid = (cdiv(N, BLOCK_N), SPLIT_K)
    +---------------------------------------+
    | rows n0..n0+BLOCK_N  | k-range of s=0 | k-range of s=1 | ...     program (n-block, s) walks its
    +---------------------------------------+                          k-range BLOCK_K columns at a time
    |         ...                           |

Each loop iteration loads one ``[BLOCK_N, BLOCK_K]`` tile (BLOCK_N contiguous row segments) and the matching
``[BLOCK_K]`` slice of x, multiplies in fp32 into a ``[BLOCK_N, BLOCK_K]`` accumulator (cp.async-pipelined
when num_stages > 1), and reduces along K once at the end. Without split-K the program stores its BLOCK_N
outputs directly. With split-K each program writes its fp32 partial sums to ``partial [SPLIT_K, N]`` and
takes a ticket from a per-n-block counter; the last program to arrive sums the SPLIT_K partials in a fixed
order (deterministic), adds the bias, stores, and resets the counter to 0. So there is no zero-fill and no
second launch, and the whole call is CUDA-graph capturable. The counters live in one cached int32 buffer
per device: concurrent split-K calls on different streams must not share it (decode runs on one stream).
The first tile is peeled off the loop so that, with ``pdl=True`` (programmatic dependent launch), its
weight load is issued before waiting for the previous kernel.

Measured (H100 SXM, triton 3.6, weights rotated past L2, 20+ calls back-to-back in a CUDA graph; see
benchmarks/gemv_bench.py): 2.57-2.83 TB/s on qkv / o_proj / down (vs 2.1-2.6 for cuBLAS), 3.09-3.19 TB/s on
gate_up and lm_head (vs 2.82-2.87). Small weights carry a fixed ~2.5-3 µs per call (launch gap, DRAM
ramp-up and drain); ``pdl=True`` between back-to-back gemv calls hides part of it (o_proj 13.1 -> 11.9 µs).

Numerics: fp32 accumulation of bf16/fp16 products, bias added in fp32, one rounding to x's dtype, which
is F.linear's rounding up to summation order. With ``act="silu_and_mul"`` the input is computed as
:mod:`pagedllm.kernels.activation` does: silu(gate) rounded to x's dtype, times up, rounded again.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

_ACTS = (None, "silu_and_mul")


@dataclass(frozen=True)
class GemvConfig:
    """Launch parameters of :func:`gemv`. ``SPLIT_K`` = 1 means no split (one program per n-block)."""

    BLOCK_N: int = 8
    BLOCK_K: int = 512
    SPLIT_K: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("BLOCK_N", "BLOCK_K"):
            value = getattr(self, name)
            assert value >= 1 and value & (value - 1) == 0, f"{name} must be a power of two, got {value}"
        assert self.SPLIT_K >= 1 and self.num_warps >= 1 and self.num_stages >= 1, f"bad config {self}"


# Measured best configs keyed by (N, K): benchmarks/gemv_bench.py on an H100 SXM (triton 3.6.0), weights
# rotated past L2, calls back-to-back in a CUDA graph. Neighbouring configs are within ~1-2% and repeated
# sweeps pick different ones among them; the heuristic below reaches ~95-99% of these on the big shapes.
_TUNED: dict[tuple[int, int], GemvConfig] = {
    # Llama-3.1-8B: qkv, o_proj, gate_up, down (run with act="silu_and_mul"), lm_head
    (6144, 4096): GemvConfig(BLOCK_N=1, BLOCK_K=2048, SPLIT_K=1, num_warps=4, num_stages=1),
    (4096, 4096): GemvConfig(BLOCK_N=1, BLOCK_K=2048, SPLIT_K=1, num_warps=4, num_stages=3),
    (28672, 4096): GemvConfig(BLOCK_N=1, BLOCK_K=2048, SPLIT_K=1, num_warps=2, num_stages=1),
    (4096, 14336): GemvConfig(BLOCK_N=8, BLOCK_K=512, SPLIT_K=1, num_warps=2, num_stages=3),
    (128256, 4096): GemvConfig(BLOCK_N=2, BLOCK_K=2048, SPLIT_K=1, num_warps=8, num_stages=4),
    # Qwen3-0.6B: qkv, o_proj, gate_up, down (act), lm_head
    (4096, 1024): GemvConfig(BLOCK_N=2, BLOCK_K=1024, SPLIT_K=1, num_warps=2, num_stages=1),
    (1024, 2048): GemvConfig(BLOCK_N=2, BLOCK_K=2048, SPLIT_K=1, num_warps=4, num_stages=1),
    (6144, 1024): GemvConfig(BLOCK_N=2, BLOCK_K=1024, SPLIT_K=1, num_warps=2, num_stages=1),
    (1024, 3072): GemvConfig(BLOCK_N=2, BLOCK_K=1024, SPLIT_K=1, num_warps=4, num_stages=1),
    (151936, 1024): GemvConfig(BLOCK_N=4, BLOCK_K=1024, SPLIT_K=1, num_warps=4, num_stages=3),
}


def _num_sms() -> int:
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return 132  # H100 SXM; only the interpreter gets here


@cache
def pick_config(N: int, K: int) -> GemvConfig:
    """Launch config for a ``[N, K]`` weight: a tuned entry, else a heuristic.

    What the H100 sweeps showed: few rows per program (1-4) with long K tiles (1024-2048 columns, i.e.
    2-4 KB contiguous per row) win; occupancy (many small programs per SM) hides DRAM latency better than
    deep cp.async pipelines, so short loops run unpipelined (num_stages=1); split-K never won on the model
    shapes (N >= 1024), so it is used only when N alone leaves SMs idle.
    """
    tuned = _TUNED.get((N, K))
    if tuned is not None:
        return tuned
    num_sms = _num_sms()
    # Largest power-of-two tile in [128, 2048] that divides K (no column masks), else cover short K whole.
    block_k = next((bk for bk in (2048, 1024, 512, 256, 128) if K % bk == 0), 0)
    if block_k == 0:
        block_k = min(1024, max(128, triton.next_power_of_2(K)))
    block_n = 2
    while block_n > 1 and triton.cdiv(N, block_n) < 2 * num_sms:
        block_n //= 2
    num_k_blocks = triton.cdiv(K, block_k)
    split_k = 1
    while triton.cdiv(N, block_n) * split_k < num_sms and split_k * 2 <= min(8, num_k_blocks):
        split_k *= 2
    num_stages = 1 if num_k_blocks // split_k <= 2 else 3
    return GemvConfig(BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, num_warps=4, num_stages=num_stages)


@triton.jit
def _load_w(w_ptrs, cols, K, EVEN_K: tl.constexpr):  # -> [BLOCK_N, BLOCK_K], weight dtype
    if EVEN_K:
        w = tl.load(w_ptrs, eviction_policy="evict_first")
    else:
        w = tl.load(w_ptrs, mask=(cols < K)[None, :], other=0.0, eviction_policy="evict_first")
    return w


@triton.jit
def _load_x(x_ptrs, cols, K, EVEN_K: tl.constexpr, ACT: tl.constexpr):  # -> [BLOCK_K] fp32
    if EVEN_K:
        xv = tl.load(x_ptrs, eviction_policy="evict_last")
    else:
        xv = tl.load(x_ptrs, mask=cols < K, other=0.0, eviction_policy="evict_last")
    if ACT == 1:  # silu(gate) * up, rounded as pagedllm.kernels.activation does
        if EVEN_K:
            up = tl.load(x_ptrs + K, eviction_policy="evict_last")
        else:
            up = tl.load(x_ptrs + K, mask=cols < K, other=0.0, eviction_policy="evict_last")
        gate = xv.to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(xv.dtype).to(tl.float32)
        xf = (silu * up.to(tl.float32)).to(xv.dtype).to(tl.float32)
    else:
        xf = xv.to(tl.float32)
    return xf


@triton.jit
def _gemv_kernel(
    x_ptr,  # [1, K] (or [1, 2K] with ACT), last dim contiguous
    w_ptr,  # [N, K] row-major
    bias_ptr,  # [N] (read only when HAS_BIAS)
    out_ptr,  # [1, N]
    partial_ptr,  # [SPLIT_K, N] fp32 (used only when SPLIT_K > 1)
    counter_ptr,  # [cdiv(N, BLOCK_N)] int32, all zero between calls (used only when SPLIT_K > 1)
    N,
    K,
    K_PER_SPLIT,  # columns per split, a multiple of BLOCK_K
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    EVEN_N: tl.constexpr,  # N % BLOCK_N == 0: no row mask
    EVEN_K: tl.constexpr,  # K == SPLIT_K * K_PER_SPLIT: no column mask
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,  # 0: x as is, 1: silu(x[:K]) * x[K:]
    PDL: tl.constexpr,  # launched as a programmatic dependent launch: wait for the previous kernel
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    row_mask = rows < N
    if not EVEN_N:
        rows = tl.where(row_mask, rows, 0)  # clamp so that unmasked-column loads stay in bounds
    k_start = pid_k * K_PER_SPLIT
    cols = k_start + tl.arange(0, BLOCK_K)  # [BLOCK_K]
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + cols  # [BLOCK_K]
    if EVEN_K:
        num_iters = K_PER_SPLIT // BLOCK_K
    else:
        num_iters = tl.cdiv(tl.minimum(K - k_start, K_PER_SPLIT), BLOCK_K)  # >= 1 (see the launcher)
    # First tile peeled: the weight depends on no earlier kernel, so under PDL its load is in flight
    # while the previous kernel finishes; x (and every write) waits for that kernel.
    w = _load_w(w_ptrs, cols, K, EVEN_K)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()  # the next kernel may launch as our programs finish
    acc = w.to(tl.float32) * _load_x(x_ptrs, cols, K, EVEN_K, ACT)[None, :]  # [BLOCK_N, BLOCK_K] fp32
    for _ in tl.range(1, num_iters, num_stages=NUM_STAGES):
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        cols += BLOCK_K
        w = _load_w(w_ptrs, cols, K, EVEN_K)
        acc += w.to(tl.float32) * _load_x(x_ptrs, cols, K, EVEN_K, ACT)[None, :]
    dot = tl.sum(acc, axis=1)  # [BLOCK_N] fp32

    if SPLIT_K == 1:
        if HAS_BIAS:
            dot += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows, dot.to(out_ptr.dtype.element_ty), mask=row_mask)
    else:
        tl.store(partial_ptr + pid_k * N + rows, dot, mask=row_mask)
        tl.debug_barrier()  # every thread's partial is written before the (release) ticket below
        ticket = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:  # last to arrive: the other SPLIT_K - 1 partials are visible
            total = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):  # fixed order: deterministic
                total += tl.load(partial_ptr + s * N + rows, mask=row_mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
            tl.store(out_ptr + rows, total.to(out_ptr.dtype.element_ty), mask=row_mask)
            tl.atomic_xchg(counter_ptr + pid_n, 0)  # ready for the next call (or graph replay)


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """A zeroed int32 buffer of at least ``n`` counters, cached per device; kernels leave it zeroed."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


def gemv(
    x: torch.Tensor,  # [1, K], or [1, 2K] with act="silu_and_mul"; last dim contiguous, any row stride
    weight: torch.Tensor,  # [N, K] row-major contiguous (nn.Linear layout)
    bias: torch.Tensor | None = None,  # [N]
    config: GemvConfig | None = None,
    act: str | None = None,  # None or "silu_and_mul"
    pdl: bool = False,
) -> torch.Tensor:  # [1, N], x.dtype
    """``F.linear(x, weight, bias)`` for one row, streaming the weight once; see the module docstring.

    ``pdl=True`` (Hopper and later, GPU only) launches as a programmatic dependent launch: the kernel may
    start before the previous kernel in the stream has finished, loads its first weight tile, then waits
    for it (``griddepcontrol.wait``) before reading x or writing anything; it also lets the next kernel
    launch early, which pays off when that one is PDL-launched too (e.g. back-to-back gemv calls).
    """
    assert act in _ACTS, f"act must be one of {_ACTS}, got {act!r}"
    assert x.dim() == 2 and x.shape[0] == 1, f"x must be [1, K], got {tuple(x.shape)}"
    assert weight.dim() == 2 and weight.is_contiguous(), "weight must be a contiguous [N, K] tensor"
    N, K = weight.shape
    x_cols = 2 * K if act == "silu_and_mul" else K
    assert x.shape[1] == x_cols, f"x {tuple(x.shape)} does not match weight {tuple(weight.shape)} (act={act})"
    assert x.stride(1) == 1 or x_cols == 1, "x's last dim must be contiguous"
    assert x.dtype in (torch.bfloat16, torch.float16, torch.float32), f"unsupported dtype {x.dtype}"
    assert weight.dtype == x.dtype, f"weight {weight.dtype} != x {x.dtype}"
    assert x.device == weight.device, "x and weight on different devices"
    if bias is not None:
        assert bias.shape == (N,) and bias.is_contiguous(), f"bias must be [N={N}], got {tuple(bias.shape)}"
    out = torch.empty((1, N), dtype=x.dtype, device=x.device)
    if N == 0:
        return out
    if K == 0:
        return out.zero_() if bias is None else out.copy_(bias.to(out.dtype)[None])
    cfg = config or pick_config(N, K)
    split_k = max(1, min(cfg.SPLIT_K, triton.cdiv(K, cfg.BLOCK_K)))  # every split gets >= 1 block
    k_per_split = triton.cdiv(triton.cdiv(K, split_k), cfg.BLOCK_K) * cfg.BLOCK_K
    split_k = triton.cdiv(K, k_per_split)  # drop splits left empty by rounding
    num_n_blocks = triton.cdiv(N, cfg.BLOCK_N)
    if split_k > 1:
        partial = torch.empty((split_k, N), dtype=torch.float32, device=x.device)
        counters = _counters(x.device, num_n_blocks)
    else:
        partial, counters = out, out  # unused
    _gemv_kernel[(num_n_blocks, split_k)](
        x, weight, bias if bias is not None else out, out, partial, counters, N, K, k_per_split,
        BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, SPLIT_K=split_k, NUM_STAGES=cfg.num_stages,
        EVEN_N=N % cfg.BLOCK_N == 0, EVEN_K=K == split_k * k_per_split, HAS_BIAS=bias is not None,
        ACT=1 if act == "silu_and_mul" else 0, PDL=pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip
    return out


def gemv_ref(
    x: torch.Tensor,  # [1, K], or [1, 2K] with act="silu_and_mul"
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    act: str | None = None,
) -> torch.Tensor:  # [1, N], x.dtype
    """PyTorch twin of :func:`gemv` (fp32 math, one rounding at the end)."""
    assert act in _ACTS, f"act must be one of {_ACTS}, got {act!r}"
    if act == "silu_and_mul":
        k = x.shape[-1] // 2
        x = F.silu(x[..., :k]) * x[..., k:]  # rounds like activation.silu_and_mul_ref
    out = x.float() @ weight.float().t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
