"""Random sampling at a temperature, in one pass over the logits: the Gumbel-max trick.

``argmax_v(logits[v] / T + G_v)`` with ``G_v = -log(-log(U_v))`` i.i.d. Gumbel(0, 1) picks token v with probability
``softmax(logits / T)[v]``: the same law as the PyTorch path's exponential race ``argmax(probs / E)`` (``E = -log U``
is Exp(1), and ``log probs - log E`` differs from ``logits / T + G`` by the row's constant ``log Z``). That path
makes five fp32 passes over ``[num_reqs, vocab_size]`` (temperature, softmax, the draws, the division, the argmax)
plus the upcast; here each program reads its slice of one row once, in the logits' own dtype, draws its uniforms
with Philox (keyed by a per-call seed; the counter is the token's index and the row's, so no batch is too large for
32-bit counters) and keeps a running best. A second,
tiny step takes the best of each row's slices.

Structured outputs: with ``bitmask`` (``[num_reqs, ceil(vocab_size / 32)]`` int32, bit ``j`` of word ``w`` allows
token ``32 * w + j``) the pass reads each slice's words too and draws only allowed tokens, as if the forbidden
logits were ``-inf`` (``pagedllm.sample.ops.apply_token_bitmask_``), without that edit's float32 copy of the logits.

For rows without top-k, top-p or min-p, unseeded (a seeded row's draws come from its own ``torch.Generator``, so
its token does not depend on the batch: that stays on the PyTorch path). Forbidden tokens (``-inf`` logits) are
never drawn. Exactness is a matter of law, not of bits: the PyTorch twin is ``pagedllm.sample.ops.random_sample``
on ``softmax(logits / T)``, and the tests compare frequencies.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 2048
_SLICE = 16 * _BLOCK  # tokens per program: 10 programs a row for a 152k vocabulary


@triton.jit(do_not_specialize=["seed"])  # a new seed every call: no variant per seed % 16 == 0
def _gumbel_argmax_kernel(
    logits_ptr,  # [num_reqs, vocab_size], any float dtype
    inv_temp_ptr,  # [num_reqs] float32: 1 / T
    best_val_ptr,  # [num_reqs, num_slices] float32
    best_idx_ptr,  # [num_reqs, num_slices] int32
    bitmask_ptr,  # [num_reqs, num_words] int32 with MASKED (else unused)
    seed,
    vocab_size,
    stride_logits,
    stride_bitmask,
    num_slices,
    BLOCK: tl.constexpr,
    SLICE: tl.constexpr,
    MASKED: tl.constexpr,
):
    row = tl.program_id(0)
    part = tl.program_id(1)
    inv_temp = tl.load(inv_temp_ptr + row)
    row_logits = logits_ptr + row.to(tl.int64) * stride_logits
    row_bitmask = bitmask_ptr + row.to(tl.int64) * stride_bitmask
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_at = tl.zeros([BLOCK], tl.int32)
    base = part * SLICE
    for start in range(0, SLICE, BLOCK):
        offs = base + start + tl.arange(0, BLOCK)  # [BLOCK] token ids
        ok = offs < vocab_size
        x = tl.load(row_logits + offs, mask=ok, other=float("-inf")).to(tl.float32)
        zero = tl.zeros_like(offs).to(tl.uint32)
        bits, _, _, _ = tl.philox(seed, offs.to(tl.uint32), zero + row.to(tl.uint32), zero, zero)
        u = tl.uint_to_uniform_float(bits)  # [BLOCK] uniform in [0, 1)
        score = x * inv_temp - tl.log(-tl.log(u))  # u == 0 gives -inf: never drawn
        if MASKED:
            words = tl.load(row_bitmask + offs // 32, mask=ok, other=0)
            score = tl.where(((words >> (offs % 32)) & 1) != 0, score, float("-inf"))
        better = score > best
        best = tl.where(better, score, best)
        best_at = tl.where(better, offs, best_at)
    val, i = tl.max(best, axis=0, return_indices=True)
    at = tl.sum(tl.where(tl.arange(0, BLOCK) == i, best_at, 0), axis=0)
    tl.store(best_val_ptr + row * num_slices + part, val)
    tl.store(best_idx_ptr + row * num_slices + part, at)


def gumbel_sample(
    logits: torch.Tensor,  # [num_reqs, vocab_size], float dtype, contiguous rows
    temperature: torch.Tensor | None,  # [num_reqs] float32 > 0, or None for 1.0
    seed: int,  # Philox key of this call's draws (0 <= seed < 2**31)
    bitmask: torch.Tensor | None = None,  # [num_reqs, ceil(vocab_size / 32)] int32: allowed tokens (module docstring)
) -> torch.Tensor:  # [num_reqs] int64
    """One token per row from ``softmax(logits / temperature)`` (over the tokens ``bitmask`` allows). No host sync."""
    num_reqs, vocab_size = logits.shape
    assert logits.stride(1) == 1, "contiguous rows"
    if bitmask is not None:
        assert bitmask.dtype == torch.int32 and bitmask.stride(1) == 1 and bitmask.shape[0] == num_reqs
        assert bitmask.shape[1] * 32 >= vocab_size, f"bitmask of {bitmask.shape[1]} words for {vocab_size} tokens"
    num_slices = triton.cdiv(vocab_size, _SLICE)
    dev = logits.device
    if temperature is None:
        inv_temp = torch.ones(num_reqs, dtype=torch.float32, device=dev)
    else:
        inv_temp = temperature.to(torch.float32).reciprocal()
    best_val = torch.empty(num_reqs, num_slices, dtype=torch.float32, device=dev)
    best_idx = torch.empty(num_reqs, num_slices, dtype=torch.int32, device=dev)
    if num_reqs:
        _gumbel_argmax_kernel[(num_reqs, num_slices)](
            logits,
            inv_temp,
            best_val,
            best_idx,
            bitmask if bitmask is not None else best_idx,
            seed,
            vocab_size,
            logits.stride(0),
            bitmask.stride(0) if bitmask is not None else 0,
            num_slices,
            BLOCK=_BLOCK,
            SLICE=_SLICE,
            MASKED=bitmask is not None,
            num_warps=8,
        )
    pick = best_val.argmax(dim=1, keepdim=True)  # [num_reqs, 1]
    return best_idx.gather(1, pick).squeeze(1).to(torch.int64)
