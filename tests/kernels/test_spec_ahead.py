"""The launch-ahead correction of a verification step's inputs (kernels/spec_ahead.py): the PyTorch twin against
the positions, slots, tokens and drafts worked out by hand (always, on CPU), and the Triton kernel against the twin
in Triton's CPU interpreter (``TRITON_INTERPRET=1 pytest tests/kernels/test_spec_ahead.py``; skipped otherwise)
and on the GPU (``gpu``)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from pagedllm.worker.spec_step import SpecAhead

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_cuda = pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs CUDA")
needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="set TRITON_INTERPRET=1")
BLOCK = 4


def _case(seed: int, device: str):
    """A step of n requests (rows of the step in flight in shuffled order), each with 1..k + 1 tokens, its inputs
    filled as the host fills them (every counted draft accepted), and what they must become."""
    g = np.random.default_rng(seed)
    k, m = 3, 6
    n = 4
    prev_index = g.permutation(m)[:n]
    counted = g.integers(0, k + 1, n)  # slots the scheduler counted for each in the step in flight
    accepted_all = np.array([g.integers(0, c + 1) for c in g.integers(0, k + 1, m)])
    accepted_all[prev_index] = [g.integers(0, c + 1) for c in counted]
    prev_tokens = g.integers(5, 1000, (m, k + 1))
    prev_drafts = g.integers(5, 1000, (m, k))
    num_draft = g.integers(1, k + 1, n)
    counts = 1 + num_draft
    qs = np.concatenate([[0], np.cumsum(counts)])
    start = g.integers(8, 40, n)  # each request's true first position
    rejected = counted - accepted_all[prev_index]
    blocks = g.permutation(200)[: n * 16].reshape(n, 16).astype(np.int32)  # [n, max_blocks]
    positions, want_pos, want_ids, want_slots = [], [], [], []
    for i in range(n):
        j = prev_index[i]
        for o in range(counts[i]):
            p = start[i] + o
            positions.append(p + rejected[i])  # the host's guess
            want_pos.append(p)
            want_ids.append(prev_tokens[j, accepted_all[j]] if o == 0 else prev_drafts[j, o - 1])
            want_slots.append(blocks[i, p // BLOCK] * BLOCK + p % BLOCK)
    seq_lens = (start + counts + rejected).astype(np.int32)
    want_drafts = np.zeros((n, int(num_draft.max())), dtype=np.int64)
    for i in range(n):
        want_drafts[i, : num_draft[i]] = prev_drafts[prev_index[i], : num_draft[i]]

    def t(a, dtype=torch.long):
        return torch.tensor(np.asarray(a), dtype=dtype, device=device)

    # the drafts as a transposed view, as Medusa's heads leave them
    drafts_view = t(prev_drafts.T.copy()).T
    ahead = SpecAhead(
        t(prev_tokens), t(accepted_all), drafts_view, [str(i) for i in range(n)], prev_index, counted, num_draft
    )
    fix = ahead.device_fix(qs, BLOCK, torch.device(device))
    nt = int(qs[-1])
    inputs = (
        torch.zeros(nt + 3, dtype=torch.long, device=device)[:nt],
        t(positions),
        torch.full((nt,), -7, dtype=torch.long, device=device),
        t(seq_lens, torch.int32),
        t(blocks, torch.int32),
    )
    want = (want_ids, want_pos, want_slots, start + counts, want_drafts)
    return fix, inputs, want


@pytest.mark.parametrize("seed", range(4))
def test_reference_moves_inputs_back_over_rejected_drafts(seed):
    fix, inputs, want = _case(seed, "cpu")
    fix.apply_reference(*inputs)
    ids, pos, slots, seq_lens, _ = inputs
    assert ids.tolist() == [int(x) for x in want[0]]
    assert pos.tolist() == [int(x) for x in want[1]]
    assert slots.tolist() == [int(x) for x in want[2]]
    assert seq_lens.tolist() == want[3].tolist()
    assert fix.drafts.tolist() == want[4].tolist()


def _kernel_equals_reference(device: str, seed: int) -> None:
    fix, inputs, _ = _case(seed, device)
    ref_fix, ref_inputs, _ = _case(seed, device)
    ref_fix.apply_reference(*ref_inputs)
    from pagedllm.kernels.spec_ahead import spec_ahead_fix

    spec_ahead_fix(
        fix.meta, fix.prev_tokens, fix.prev_accepted, fix.prev_drafts, *inputs, fix.drafts,
        fix.block_size,
    )
    for got, ref in zip(inputs, ref_inputs):
        assert torch.equal(got, ref)
    assert torch.equal(fix.drafts, ref_fix.drafts)


@needs_interpreter
@pytest.mark.parametrize("seed", range(4))
def test_kernel_equals_reference_in_interpreter(seed):
    _kernel_equals_reference("cpu", seed)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("seed", range(4))
def test_kernel_equals_reference_on_gpu(seed):
    _kernel_equals_reference("cuda", seed)
