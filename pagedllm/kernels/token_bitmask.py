"""Structured outputs: set the logits of the tokens a row's grammar forbids to ``-inf``, in one pass.

Bit ``j`` of word ``w`` of a row's int32 bitmask allows token ``32 * w + j``. One program owns ``BLOCK`` tokens of
one row: it reads their words (``BLOCK / 32`` of them: 4.9 MB for 256 rows of a 152k vocabulary, against the
155 MB of the logits) and stores ``-inf`` only where a bit is clear, so it never reads the logits and writes only
the forbidden entries (a few thousand a row inside a JSON string). The PyTorch twin,
``pagedllm.sample.ops.apply_token_bitmask_ref_``, unpacks the words into a boolean mask and runs several passes
over ``[num_reqs, vocab_size]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096


@triton.jit
def _apply_token_bitmask_kernel(
    logits_ptr,  # [num_reqs, vocab_size] float32
    bitmask_ptr,  # [num_reqs, num_words] int32
    vocab_size,
    stride_logits,
    stride_bitmask,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] token ids
    in_vocab = offs < vocab_size
    words = tl.load(bitmask_ptr + row * stride_bitmask + offs // 32, mask=in_vocab, other=-1)
    forbidden = ((words >> (offs % 32)) & 1) == 0
    neg_inf = tl.full([BLOCK], float("-inf"), tl.float32)
    tl.store(logits_ptr + row * stride_logits + offs, neg_inf, mask=in_vocab & forbidden)


def apply_token_bitmask_triton_(
    logits: torch.Tensor,  # [num_reqs, vocab_size] float32, CUDA
    bitmask: torch.Tensor,  # [num_reqs, ceil(vocab_size / 32)] int32, same device
) -> torch.Tensor:
    num_reqs, vocab_size = logits.shape
    assert logits.dtype == torch.float32 and logits.stride(1) == 1, "float32 logits with contiguous rows"
    assert bitmask.dtype == torch.int32 and bitmask.stride(1) == 1 and bitmask.shape[0] == num_reqs
    assert bitmask.shape[1] * 32 >= vocab_size, f"bitmask of {bitmask.shape[1]} words for {vocab_size} tokens"
    if num_reqs:
        grid = (num_reqs, triton.cdiv(vocab_size, _BLOCK))
        _apply_token_bitmask_kernel[grid](
            logits, bitmask, vocab_size, logits.stride(0), bitmask.stride(0), BLOCK=_BLOCK, num_warps=8
        )
    return logits
