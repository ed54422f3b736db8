"""``split_leading_decodes``: how the Triton backend cuts a mixed step into its leading decodes (decode tiles) and
the rest (prefill tiles). The kernels' agreement with the reference on such steps is tested in
tests/kernels/test_triton_paged_attention.py (interpreter and GPU)."""

from __future__ import annotations

import torch

from pagedllm.attention.base import AttentionMetadata, split_leading_decodes


def _metadata(q_lens: list[int], seq_lens: list[int]) -> AttentionMetadata:
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    table = torch.arange(len(q_lens) * 5, dtype=torch.int32).view(len(q_lens), 5)
    return AttentionMetadata(
        num_reqs=len(q_lens),
        num_tokens=int(qsl[-1]),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=qsl,
        seq_lens=seq,
        block_table=table,
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.long),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq,
    )


def test_leading_decodes_and_the_rest():
    meta = _metadata([1, 1, 1, 13, 1, 6], [40, 9, 70, 30, 5, 6])
    split = split_leading_decodes(meta)
    assert split is not None and split.d == 3
    assert split.decode_max_seq_len == 70 and split.rest_max_seq_len == 30
    assert split.rest_query_start_loc.tolist() == [0, 13, 14, 20]  # from token 3 on
    assert split.rest_seq_lens.tolist() == [30, 5, 6]
    assert torch.equal(split.rest_block_table, meta.block_table[3:])
    # Fresh tensors (aligned for Triton), not views into the step's.
    assert split.rest_block_table.data_ptr() != meta.block_table[3:].data_ptr()
    assert split.rest_seq_lens.data_ptr() != meta.seq_lens[3:].data_ptr()


def test_no_split_without_leading_decodes_or_without_a_rest():
    assert split_leading_decodes(_metadata([5, 1, 1], [5, 9, 9])) is None  # starts with a chunk
    assert split_leading_decodes(_metadata([1, 1, 1], [5, 9, 9])) is None  # all decodes: one decode launch
    assert split_leading_decodes(_metadata([1, 0, 0], [5, 0, 0])).d == 1  # padding requests (length 0) follow
