"""The inputs of a verification step launched ahead of the host (async speculation, worker/spec_step.py
``SpecAhead``), corrected on the device in one launch.

The host filled the step's static inputs as if the step in flight had accepted every draft the scheduler counted.
Program ``i`` (one per request of the step) reads that step's accepted count for its row ``j``, and rewrites the
request's tokens ``query_start[i] .. query_start[i + 1]``: the first is the token the step in flight emitted last,
the others the drafts its proposer queued for row ``j``; every position moves back over the rejected drafts
(``counted - accepted``), and so does the context length; the slot of each position is looked up again in the
request's block table. The drafts also go to ``drafts_out`` (``[n, width]``, zeros past a request's own), which the
verification reads. ``DeviceFix.apply_reference`` (worker/spec_step.py) is the PyTorch twin.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _spec_ahead_fix_kernel(
    meta_ptr,  # int64 [3n + 1]: prev rows j, counted slots, query_start
    n,
    prev_tokens_ptr,  # int64 [m, k + 1]
    stride_pt,
    stride_pt1,
    prev_accepted_ptr,  # int64 [m]
    prev_drafts_ptr,  # int64 [m, kd] (any strides: Medusa's are a transposed view)
    stride_pd,
    stride_pd1,
    input_ids_ptr,  # int64 [num_tokens]
    positions_ptr,  # int64 [num_tokens]
    slot_mapping_ptr,  # int64 [num_tokens]
    seq_lens_ptr,  # int32 [n]
    block_table_ptr,  # int32 [n, max_blocks] (row stride stride_bt)
    stride_bt,
    drafts_out_ptr,  # int64 [n, width]
    width,
    BLOCK_SIZE: tl.constexpr,
    Q_PAD: tl.constexpr,
):
    i = tl.program_id(0)
    j = tl.load(meta_ptr + i)
    counted = tl.load(meta_ptr + n + i)
    start = tl.load(meta_ptr + 2 * n + i)
    count = tl.load(meta_ptr + 2 * n + i + 1) - start
    accepted = tl.load(prev_accepted_ptr + j)
    rejected = counted - accepted
    offs = tl.arange(0, Q_PAD)
    mask = offs < count
    is_draft = mask & (offs > 0)
    last = tl.load(prev_tokens_ptr + j * stride_pt + accepted * stride_pt1)
    draft = tl.load(prev_drafts_ptr + j * stride_pd + (offs - 1) * stride_pd1, mask=is_draft, other=0)
    tl.store(input_ids_ptr + start + offs, tl.where(offs == 0, last, draft), mask=mask)
    pos = tl.load(positions_ptr + start + offs, mask=mask, other=0) - rejected
    tl.store(positions_ptr + start + offs, pos, mask=mask)
    block = tl.load(block_table_ptr + i * stride_bt + pos // BLOCK_SIZE, mask=mask, other=0).to(tl.int64)
    tl.store(slot_mapping_ptr + start + offs, block * BLOCK_SIZE + pos % BLOCK_SIZE, mask=mask)
    seq_len = tl.load(seq_lens_ptr + i)
    tl.store(seq_lens_ptr + i, seq_len - rejected.to(tl.int32))
    in_row = (offs > 0) & (offs <= width)
    tl.store(drafts_out_ptr + i * width + offs - 1, tl.where(is_draft, draft, 0), mask=in_row)


def spec_ahead_fix(
    meta: torch.Tensor,  # [3n + 1] int64
    prev_tokens: torch.Tensor,  # [m, k + 1] int64
    prev_accepted: torch.Tensor,  # [m] int64
    prev_drafts: torch.Tensor,  # [m, kd] int64
    input_ids: torch.Tensor,  # [num_tokens] int64
    positions: torch.Tensor,  # [num_tokens] int64
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    seq_lens: torch.Tensor,  # [n] int32
    block_table: torch.Tensor,  # [n, max_blocks] int32, unit column stride
    drafts_out: torch.Tensor,  # [n, width] int64 (a request computes at most width + 1 tokens)
    block_size: int,
) -> None:
    n, width = drafts_out.shape
    assert block_table.stride(1) == 1
    assert drafts_out.is_contiguous() and input_ids.stride(0) == positions.stride(0) == slot_mapping.stride(0) == 1
    _spec_ahead_fix_kernel[(n,)](
        meta, n, prev_tokens, *prev_tokens.stride(), prev_accepted, prev_drafts, *prev_drafts.stride(),
        input_ids, positions, slot_mapping, seq_lens, block_table, block_table.stride(0), drafts_out,
        width, BLOCK_SIZE=block_size, Q_PAD=triton.next_power_of_2(max(width + 1, 2)),
    )
