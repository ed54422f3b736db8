"""The Triton grammar-bitmask kernel against its PyTorch twin (GPU), and the twin against a per-token loop (CPU)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.sample.ops import apply_token_bitmask_, apply_token_bitmask_ref_


def _case(num_reqs: int, vocab_size: int, device: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    num_words = (vocab_size + 31) // 32 + 1  # one spare word, as a padded vocabulary gives
    bitmask = torch.randint(-(2**31), 2**31 - 1, (num_reqs, num_words), generator=gen, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    bitmask[0] = -1  # an unconstrained row
    if num_reqs > 2:
        bitmask[2] = 0  # a row that allows nothing
        bitmask[1, ::3] = -1  # whole words allowed
    logits = torch.randn(num_reqs, vocab_size, generator=gen)
    return logits.to(device), bitmask.to(device)


def test_ref_matches_a_per_token_loop():
    logits, bitmask = _case(4, 100, "cpu", 0)
    want = logits.clone()
    for r in range(4):
        for t in range(100):
            if not (int(bitmask[r, t // 32]) >> (t % 32)) & 1:
                want[r, t] = float("-inf")
    assert torch.equal(apply_token_bitmask_ref_(logits.clone(), bitmask), want)
    assert torch.equal(apply_token_bitmask_(logits.clone(), bitmask), want)  # CPU: the twin


@pytest.mark.gpu
@pytest.mark.parametrize("num_reqs, vocab_size", [(1, 32), (3, 1000), (7, 4097), (256, 151936), (5, 151643)])
def test_triton_kernel_matches_twin(num_reqs, vocab_size):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from pagedllm.kernels.token_bitmask import apply_token_bitmask_triton_

    logits, bitmask = _case(num_reqs, vocab_size, "cuda", vocab_size)
    want = apply_token_bitmask_ref_(logits.clone(), bitmask)
    got = apply_token_bitmask_triton_(logits.clone(), bitmask)
    assert torch.equal(got, want)
    # A view of the rows that sample (a row stride other than the vocabulary) is masked in place too.
    wide = torch.randn(num_reqs, vocab_size + 64, device="cuda")
    view = wide[:, :vocab_size]
    expect = apply_token_bitmask_ref_(view.clone(), bitmask)
    apply_token_bitmask_triton_(view, bitmask)
    assert torch.equal(view, expect)
