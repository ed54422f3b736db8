"""Mixture-of-experts MLP as two grouped GEMMs over tokens sorted by expert, with its PyTorch twin.

Each token picks ``top_k`` experts; every (token, choice) pair is an *assignment* ``a = token * top_k + k``.
Assignments are sorted by expert and each expert's run is padded to a multiple of ``BLOCK_M``
(:func:`moe_align`), so every ``BLOCK_M`` rows of the sorted list belong to one expert. The grouped GEMM runs one
program per (row block, N tile): it gathers its rows of the input, multiplies by that expert's weight and
scatters the result back to the assignments' rows (padding rows are skipped):

    1. ``h[a] = x[a // top_k] @ w13[e].T (+ b13[e])``            ``[A, 2 * inter]``  (gate | up)
    2. ``g[a] = act(h[a, :inter], h[a, inter:])``                ``[A, inter]``
    3. ``y[a] = weight[a] * (g[a] @ w2[e].T (+ b2[e]))``         ``[A, hidden]``
    4. ``out[t] = sum_k y[t * top_k + k]``                       ``[T, hidden]``

Options (both the kernel path and the twin): expert biases ``w13_bias: [E, 2 * inter]`` (gate | up) and
``w2_bias: [E, hidden]``, added to the float32 accumulator before rounding (and before the router weight); and
the activation ``act``:

* ``"silu"``: ``silu(gate) * up`` (Mixtral, Qwen-MoE);
* ``"swigluoai"`` (GPT-OSS's clamped SwiGLU, parameters ``alpha`` and ``limit``)::

      gate = min(gate, limit);  up = clamp(up, -limit, limit)
      act  = (up + 1) * gate * sigmoid(alpha * gate)

  (on the kernel path one Triton elementwise kernel in float32, rounded once; the twin in PyTorch ops).

Accumulation is float32, results are rounded to the input dtype after each GEMM (as the twin does).

CUDA-graph safe: the layout's buffers have a size fixed by ``(A, E, BLOCK_M)`` alone (:func:`moe_max_blocks`
row blocks), the number of blocks actually used stays on the device, and the GEMM's programs past it return at
once (so a decode step with ``A = top_k`` assignments reads at most ``A`` experts' weights, not all ``E``). No
step of the kernel path reads a device value on the host.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # CI has no Triton: the twin and moe_align still import
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where Triton is missing
    triton = None
    tl = None


def moe_max_blocks(num_assign: int, num_experts: int, block_m: int) -> int:
    """A bound on the row blocks :func:`moe_align` needs, fixed by the shapes alone.

    Expert e with ``c_e > 0`` assignments takes ``ceil(c_e / block_m) <= (c_e + block_m - 1) / block_m`` blocks
    and at most ``k = min(num_experts, num_assign)`` experts are non-empty, so the blocks number at most
    ``(A + k * (block_m - 1)) / block_m``, and, being an integer, at most its floor. With ``k = A`` (fewer
    assignments than experts: decode) this is exactly ``A``, one block per assignment. It is tight: reached when
    ``k`` experts are non-empty, each holding ``1 (mod block_m)`` assignments."""
    nonempty = min(num_experts, num_assign)
    return (num_assign + nonempty * (block_m - 1)) // block_m


def moe_align(
    topk_ids: torch.Tensor,  # [T, top_k] int
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The assignments sorted (stably) by expert, each expert's run padded to a multiple of ``block_m``.

    Returns ``(sorted_ids, block_expert, num_blocks)`` with ``A = T * top_k`` and ``M = moe_max_blocks(A,
    num_experts, block_m)``:

    * ``sorted_ids: [M * block_m]`` int32: assignment ids; padding (inside an expert's last block and every row
      past the used blocks) holds the invalid id ``A``;
    * ``block_expert: [M]`` int32: the expert of each ``block_m`` rows; experts with no assignment get no block;
      the blocks past the used ones repeat expert ``num_experts - 1`` (in range, never computed);
    * ``num_blocks: [1]`` int32: how many blocks are used, on ``topk_ids``' device.

    An id equal to ``num_experts`` marks an assignment to an expert another rank holds (expert parallelism): it
    gets no row and no block, so nothing computes it.

    Shapes depend on ``(A, num_experts, block_m)`` only and nothing is read on the host, so a CUDA graph can
    capture it (block -> expert by ``searchsorted``, not ``repeat_interleave``; counts by ``searchsorted`` over
    the sorted ids, not ``bincount``, which reads the largest id on the host on CUDA)::

        expert            0          1    2                      (E = 3, block_m = 4, A = 7)
        counts            2          0    5
        blocks            1          0    2                      used: 3 of M = (7 + 3 * 3) // 4 = 4
        sorted_ids        a a A A   |    a a a a   a A A A   |   A A A A
        block_expert      0              2         2             2 (clamped: past num_blocks)
    """
    flat = topk_ids.reshape(-1).to(torch.int64)  # [A]
    num_assign = flat.numel()
    device = topk_ids.device
    max_blocks = moe_max_blocks(num_assign, num_experts, block_m)
    order = torch.argsort(flat, stable=True)  # [A] assignment ids, grouped by expert
    expert_of_sorted = flat[order]  # [A] non-decreasing
    experts = torch.arange(num_experts + 1, device=device, dtype=torch.int64)  # [E + 1]
    bounds = torch.searchsorted(expert_of_sorted, experts)  # [E + 1]: expert e's run is bounds[e]:bounds[e+1]
    start, counts = bounds[:-1], bounds[1:] - bounds[:-1]  # [E] each
    blocks = (counts + block_m - 1) // block_m  # [E] blocks per expert
    block_end = torch.cumsum(blocks, 0)  # [E] one past each expert's last block
    padded_start = (block_end - blocks) * block_m  # [E] each expert's first row in sorted_ids
    # assignment order[i] (the i-th in expert order) goes to row i - start[e] + padded_start[e] of its expert e
    # assignments to remote experts (id E, sorted last) land past the returned rows: offset max_blocks * block_m
    size = max_blocks * block_m
    shift = torch.cat(
        [padded_start - start, torch.full((1,), size, dtype=torch.int64, device=device)]
    )  # [E + 1]
    dest = torch.arange(num_assign, device=device) + shift[expert_of_sorted]  # [A]
    rows = torch.full((size + num_assign,), num_assign, dtype=torch.int32, device=device)
    rows.scatter_(0, dest, order.to(torch.int32))
    sorted_ids = rows[:size]
    # block b belongs to the expert whose [block_end - blocks, block_end) holds b: the number of experts whose
    # blocks all end at or before b (empty experts add nothing); blocks past the used ones give E, clamped
    block_ids = torch.arange(max_blocks, device=device, dtype=torch.int64)  # [M]
    block_expert = torch.searchsorted(block_end, block_ids, right=True).clamp_(max=num_experts - 1)
    num_blocks = block_end[-1:].to(torch.int32)  # [1]
    return sorted_ids, block_expert.to(torch.int32), num_blocks


if triton is not None:

    @triton.jit
    def _moe_gemm_kernel(
        a_ptr,  # [rows_a, K]: rows gathered by sorted_id // a_div
        w_ptr,  # [E, N, K]
        c_ptr,  # [A, N]: row = sorted_id
        sorted_ids_ptr,  # [max_blocks * BLOCK_M] int32
        block_expert_ptr,  # [max_blocks] int32
        num_blocks_ptr,  # [1] int32: row blocks in use; programs at or past it return at once
        scale_ptr,  # [A] float32 (router weights), read when MUL_SCALE
        bias_ptr,  # [E, N] (this GEMM's expert biases), read when HAS_BIAS
        num_assign,
        N,
        K,
        stride_am,
        stride_we,
        stride_wn,
        stride_cm,
        stride_be,
        A_DIV: tl.constexpr,  # top_k for the first GEMM (rows are tokens), 1 for the second
        MUL_SCALE: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        num_valid = tl.load(num_blocks_ptr)
        if pid_m >= num_valid:  # a block past the used ones: all padding, its expert's weights never read
            return
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        ids = tl.load(sorted_ids_ptr + offs_m)  # [BLOCK_M] assignment ids; num_assign marks padding
        valid = ids < num_assign
        a_rows = (tl.where(valid, ids, 0) // A_DIV).to(tl.int64)
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
        w_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = offs_k + k0 < K
            a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
            acc = tl.dot(a, w, acc, input_precision="ieee")
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if HAS_BIAS:
            bias = tl.load(bias_ptr + expert * stride_be + offs_n, mask=n_mask, other=0.0)
            acc += bias.to(tl.float32)[None, :]
        if MUL_SCALE:
            scale = tl.load(scale_ptr + tl.where(valid, ids, 0), mask=valid, other=0.0)
            # the twin rounds the GEMM to the output dtype before weighting it
            acc = acc.to(c_ptr.dtype.element_ty).to(tl.float32) * scale[:, None]
        c_ptrs = c_ptr + ids.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


def _moe_gemm(
    a: torch.Tensor,  # [rows, K]
    w: torch.Tensor,  # [E, N, K]
    sorted_ids: torch.Tensor,  # [max_blocks * block_m] int32
    block_expert: torch.Tensor,  # [max_blocks] int32
    num_blocks: torch.Tensor,  # [1] int32, on the device
    num_assign: int,
    a_div: int,
    scale: torch.Tensor | None,  # [A] float32
    block_m: int,
    bias: torch.Tensor | None = None,  # [E, N]
    config: tuple[int, int, int, int] | None = None,  # (BLOCK_N, BLOCK_K, num_warps, num_stages)
) -> torch.Tensor:  # [A, N]
    num_experts, n, k = w.shape
    assert a.dim() == 2 and a.shape[1] == k and a.stride(1) == 1, f"a {tuple(a.shape)} vs w {tuple(w.shape)}"
    assert w.stride(2) == 1, "expert weights must be contiguous along K"
    assert bias is None or (bias.shape == (num_experts, n) and bias.stride(1) == 1), (
        f"bias {tuple(bias.shape)} vs w {tuple(w.shape)}"
    )
    c = torch.empty((num_assign, n), dtype=a.dtype, device=a.device)
    max_blocks = block_expert.numel()  # a bound fixed by the shapes; the kernel reads the real count
    assert sorted_ids.numel() == max_blocks * block_m and num_blocks.numel() == 1
    if max_blocks == 0:
        return c
    if config is None:
        config = (
            max(16, min(64, triton.next_power_of_2(n))),
            max(16, min(64, triton.next_power_of_2(k))),
            4,
            3,
        )
    block_n, block_k, num_warps, num_stages = config
    grid = (max_blocks, triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](
        a,
        w,
        c,
        sorted_ids,
        block_expert,
        num_blocks,
        scale if scale is not None else c,
        bias if bias is not None else c,
        num_assign,
        n,
        k,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        c.stride(0),
        bias.stride(0) if bias is not None else 0,
        A_DIV=a_div,
        MUL_SCALE=scale is not None,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return c


MOE_ACTIVATIONS = ("silu", "swigluoai")

MoETiles = tuple[int, tuple[int, int, int, int], tuple[int, int, int, int]]


def moe_tile_config(num_assign: int, num_experts: int) -> MoETiles:
    """``(BLOCK_M, w13's (BLOCK_N, BLOCK_K, num_warps, num_stages), w2's)`` for ``num_assign`` assignments over
    ``num_experts`` experts, by the rows an expert gets on average. From a sweep on the H100 (benchmarks/moe_sweep.py,
    Qwen3-30B-A3B and DeepSeek-V2-Lite shapes, docs/benchmarks.md): decode-sized batches want 16-row blocks and
    long K tiles (≈10% over 64 x 64 tiles); prefill-sized ones 128-row blocks, which cut the GEMMs' time 2.6-2.8x
    at 4096-8192 tokens. A function of the shapes alone, so CUDA graphs capture the same choice they replay."""
    rows = num_assign / max(num_experts, 1)
    if rows < 8:
        return 16, (64, 128, 4, 3), (64, 128, 4, 3)
    if rows < 32:
        return 32, (128, 128, 4, 3), (128, 128, 4, 3)
    if rows < 64:
        return 64, (128, 64, 4, 3), (128, 64, 8, 3)
    return 128, (128, 64, 4, 3), (128, 64, 8, 3)


def fused_experts(
    x: torch.Tensor,  # [T, hidden]
    w13: torch.Tensor,  # [E, 2 * inter, hidden]
    w2: torch.Tensor,  # [E, hidden, inter]
    topk_weights: torch.Tensor,  # [T, top_k] float32
    topk_ids: torch.Tensor,  # [T, top_k] int
    tiles: MoETiles | None = None,  # default: moe_tile_config's
    w13_bias: torch.Tensor | None = None,  # [E, 2 * inter]
    w2_bias: torch.Tensor | None = None,  # [E, hidden]
    activation: str = "silu",
    swiglu_alpha: float = 1.702,  # "swigluoai" only
    swiglu_limit: float = 7.0,  # "swigluoai" only
    remote_experts: bool = False,
) -> torch.Tensor:  # [T, hidden]
    """The MoE MLP through the Triton grouped GEMM; see the module docstring for the biases and activations.

    ``remote_experts``: ``topk_ids`` may hold ``E`` (``w13.shape[0]``), an expert another rank holds (expert
    parallelism); those assignments are not computed and contribute zero."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    assert w13.shape[2] == hidden and w2.shape == (num_experts, hidden, two_inter // 2), (
        f"x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}"
    )
    assert activation in MOE_ACTIVATIONS, f"activation {activation!r} not in {MOE_ACTIVATIONS}"
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == num_tokens
    top_k = topk_ids.shape[1]
    if num_tokens == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    num_assign = num_tokens * top_k
    block_m, tiles13, tiles2 = tiles or moe_tile_config(num_assign, num_experts)
    sorted_ids, block_expert, num_blocks = moe_align(topk_ids, num_experts, block_m)
    layout = (sorted_ids, block_expert, num_blocks, num_assign)
    h = _moe_gemm(x, w13, *layout, top_k, None, block_m, w13_bias, tiles13)  # [A, 2 * inter]
    if activation == "swigluoai":
        g = swiglu_oai(h, swiglu_alpha, swiglu_limit)  # [A, inter]
    else:
        g = _silu_and_mul(h)  # [A, inter]
    scale = topk_weights.reshape(-1).to(torch.float32).contiguous()
    y = _moe_gemm(g, w2, *layout, 1, scale, block_m, w2_bias, tiles2)  # [A, hidden]
    if remote_experts:  # their rows were never written
        y = y.masked_fill((topk_ids.reshape(-1) >= num_experts)[:, None], 0.0)
    return y.view(num_tokens, top_k, hidden).sum(dim=1)


if triton is not None:

    @triton.jit
    def _swiglu_oai_kernel(
        h_ptr,  # [rows, 2 * inter]: gate | up
        out_ptr,  # [rows, inter]
        stride_h,
        stride_o,
        inter,
        alpha,
        limit,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        gate = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(h_ptr + row * stride_h + inter + cols, mask=mask, other=0.0).to(tl.float32)
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        glu = gate / (1.0 + tl.exp(-alpha * gate))  # gate * sigmoid(alpha * gate)
        tl.store(out_ptr + row * stride_o + cols, ((up + 1.0) * glu).to(out_ptr.dtype.element_ty), mask=mask)


def swiglu_oai(h: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:  # [rows, 2 * I] -> [rows, I]
    """GPT-OSS's clamped SwiGLU over ``[gate | up]`` rows (Triton; float32 inside, rounded once)."""
    assert h.dim() == 2 and h.shape[1] % 2 == 0 and h.stride(1) == 1, f"h {tuple(h.shape)}"
    rows, inter = h.shape[0], h.shape[1] // 2
    out = torch.empty((rows, inter), dtype=h.dtype, device=h.device)
    if rows == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _swiglu_oai_kernel[(rows, triton.cdiv(inter, block))](
        h, out, h.stride(0), out.stride(0), inter, float(alpha), float(limit), BLOCK=block, num_warps=4
    )
    return out


def swiglu_oai_ref(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """PyTorch twin of :func:`swiglu_oai` on split halves, op for op as transformers' ``GptOssExperts``."""
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _silu_and_mul(h: torch.Tensor) -> torch.Tensor:
    if h.is_cuda:
        from pagedllm.kernels.activation import silu_and_mul

        return silu_and_mul(h)
    inter = h.shape[-1] // 2  # the interpreter path (CPU tensors)
    return F.silu(h[:, :inter]) * h[:, inter:]


def fused_experts_ref(
    x: torch.Tensor,  # [T, hidden]
    w13: torch.Tensor,  # [E, 2 * inter, hidden]
    w2: torch.Tensor,  # [E, hidden, inter]
    topk_weights: torch.Tensor,  # [T, top_k] float32 or x.dtype
    topk_ids: torch.Tensor,  # [T, top_k] int
    w13_bias: torch.Tensor | None = None,  # [E, 2 * inter]
    w2_bias: torch.Tensor | None = None,  # [E, hidden]
    activation: str = "silu",
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
) -> torch.Tensor:  # [T, hidden]
    """PyTorch twin of :func:`fused_experts`: sort the assignments by expert, run each expert's gated MLP on
    its rows, weight them, sum each token's ``top_k`` rows. Ids equal to ``E`` (experts another rank holds)
    contribute zero."""
    if activation not in MOE_ACTIVATIONS:
        raise ValueError(f"unsupported MoE activation {activation!r}; supported: {MOE_ACTIVATIONS}")
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    inter = w13.shape[1] // 2
    flat = topk_ids.reshape(-1)  # [A]
    order = torch.argsort(flat, stable=True)
    num_experts = w13.shape[0]
    counts = torch.bincount(flat, minlength=num_experts).tolist()  # [E], or [E + 1] with remote experts
    scale = topk_weights.reshape(-1)  # [A]: float32, or the activations' dtype (promotion as in transformers)
    alloc = torch.zeros if len(counts) > num_experts else torch.empty  # remote experts' rows stay zero
    y = alloc((num_tokens * top_k, hidden), dtype=x.dtype, device=x.device)
    start = 0
    for expert, count in enumerate(counts[:num_experts]):
        if count == 0:
            continue
        ids = order[start : start + count]  # this expert's assignments
        start += count
        b13 = None if w13_bias is None else w13_bias[expert]
        b2 = None if w2_bias is None else w2_bias[expert]
        h = F.linear(x[ids // top_k], w13[expert], b13)  # [n, 2 * inter]
        if activation == "swigluoai":
            g = swiglu_oai_ref(h[:, :inter], h[:, inter:], swiglu_alpha, swiglu_limit)
        else:
            g = F.silu(h[:, :inter]) * h[:, inter:]
        y[ids] = (F.linear(g, w2[expert], b2) * scale[ids, None]).to(x.dtype)
    return y.view(num_tokens, top_k, hidden).sum(dim=1)
