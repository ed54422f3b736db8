"""The one-pass Gumbel-max sampling kernel: its draws follow ``softmax(logits / T)`` (frequencies against the
twin's law), forbidden tokens never come, slices of a long row merge to the row's best, and the Sampler takes it
on CUDA only for unseeded temperature-only rows.

``*_interpret`` tests run in Triton's CPU interpreter (``PAGEDLLM_TRITON_INTERPRET=1``, see
test_triton_interpreter.py) with small blocks; ``gpu`` tests run the real shapes.
"""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

import pagedllm.kernels.gumbel_sample as gs  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="set TRITON_INTERPRET=1")
needs_cuda = pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs CUDA")


def check_frequencies(device: str, rows: int, dtype: torch.dtype) -> None:
    """Many rows of the same logits: each token's share of the draws is its probability (within 4.5 sigma)."""
    logits = torch.tensor([2.0, 0.5, float("-inf"), 1.0, -1.0, 0.0])
    temp = 0.7
    want = (logits / temp).softmax(-1)
    batch = logits.to(dtype).repeat(rows, 1).to(device)
    temperature = torch.full((rows,), temp, device=device)
    counts = torch.zeros(6)
    for seed in (1, 2):
        ids = gs.gumbel_sample(batch, temperature, seed).cpu()
        assert ids.dtype == torch.int64 and ids.shape == (rows,)
        counts += torch.bincount(ids, minlength=6).float()
    freq = counts / counts.sum()
    assert counts[2] == 0  # -inf: never drawn
    sigma = (want * (1 - want) / counts.sum()).sqrt()
    assert ((freq - want).abs() <= 4.5 * sigma + 1e-6).all(), (freq, want)


def check_slices(device: str, vocab_size: int) -> None:
    """At a tiny temperature the draw is the argmax: the best of a row's slices is found whichever slice holds it."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, vocab_size, generator=gen) * 0.01
    peaks = torch.tensor([0, vocab_size - 1, vocab_size // 2, 7, vocab_size - 40])
    logits[torch.arange(5), peaks] = 50.0
    ids = gs.gumbel_sample(logits.to(device), torch.full((5,), 1e-3, device=device), 3).cpu()
    assert torch.equal(ids, peaks)
    ids = gs.gumbel_sample(logits.to(device), None, 4).cpu()  # T = 1: the peak still holds ~all the mass
    assert torch.equal(ids, peaks)


def check_bitmask(device: str, rows: int, vocab_size: int) -> None:
    """With a grammar bitmask every draw is an allowed token, and among the allowed ones the frequencies follow the
    softmax restricted to them (rows of all-allowed words, a word boundary, a single allowed token, bit 31)."""
    gen = torch.Generator().manual_seed(2)
    num_words = (vocab_size + 31) // 32 + 1  # a spare word, as a padded vocabulary gives
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, num_words), generator=gen, dtype=torch.int64).to(torch.int32)
    bitmask[0] = -1  # everything allowed
    bitmask[1] = 0
    bitmask[1, 1] = 1 << 0  # token 32 only
    bitmask[2] = 0
    bitmask[2, 0] = -(2**31)  # bit 31 of word 0: token 31 only
    logits = torch.randn(rows, vocab_size, generator=gen)
    ids = gs.gumbel_sample(logits.to(device), None, 5, bitmask.to(device)).cpu()
    bits = (bitmask[torch.arange(rows), ids // 32] >> (ids % 32)) & 1
    assert bits.all()  # never a forbidden token
    assert ids[1] == 32 and ids[2] == 31
    # Frequencies over three allowed tokens of one repeated row.
    row = torch.tensor([0.5, 2.0, -1.0, 1.0] + [3.0] * (vocab_size - 4))
    word = torch.zeros(num_words, dtype=torch.int32)
    word[0] = 0b1011  # tokens 0, 1 and 3
    reps = 1500 if device == "cpu" else min(50_000, 2**29 // vocab_size)  # at most 2 GiB of float32 logits
    draws = gs.gumbel_sample(row.repeat(reps, 1).to(device), None, 6, word.repeat(reps, 1).to(device)).cpu()
    freq = torch.bincount(draws, minlength=vocab_size).float() / reps
    want = torch.zeros(vocab_size)
    want[[0, 1, 3]] = row[[0, 1, 3]].softmax(-1)
    sigma = (want * (1 - want) / reps).sqrt()
    assert ((freq - want).abs() <= 4.5 * sigma + 1e-6).all(), (freq[:4], want[:4])


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(gs, "_BLOCK", 16)
    monkeypatch.setattr(gs, "_SLICE", 64)


@needs_interpreter
def test_gumbel_frequencies_interpret(small_blocks):
    check_frequencies("cpu", 1500, torch.float32)


@needs_interpreter
def test_gumbel_slices_interpret(small_blocks):
    check_slices("cpu", 300)  # five slices of 64


@needs_interpreter
def test_gumbel_bitmask_interpret(small_blocks):
    check_bitmask("cpu", 40, 150)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("vocab_size", [150, 151936])
def test_gumbel_bitmask_gpu(vocab_size):
    check_bitmask("cuda", 64, vocab_size)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gumbel_frequencies_gpu(dtype):
    check_frequencies("cuda", 50_000, dtype)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("vocab_size", [1000, 151936])
def test_gumbel_slices_gpu(vocab_size):
    check_slices("cuda", vocab_size)


@pytest.mark.gpu
@needs_cuda
def test_sampler_takes_the_kernel_for_temperature_rows(monkeypatch):
    """The Sampler draws unseeded temperature-only rows with the kernel (greedy rows keep their argmax), and keeps
    the PyTorch race for seeded rows."""
    from pagedllm.sample.metadata import SamplingMetadata
    from pagedllm.sample.sampler import Sampler

    calls = []
    real = gs.gumbel_sample

    def spy(*args):
        calls.append(args[0].dtype)
        masks.append(args[3] if len(args) > 3 else None)
        return real(*args)

    masks = []

    monkeypatch.setattr(gs, "gumbel_sample", spy)
    rows = 20_000
    logits = torch.tensor([1.0, 0.0, 2.0, float("-inf")]).repeat(rows, 1).to(torch.bfloat16).cuda()
    greedy = torch.zeros(rows, dtype=torch.bool, device="cuda")
    greedy[:10] = True
    temperature = torch.full((rows,), 1.5, device="cuda")
    temperature[:10] = 1.0
    meta = SamplingMetadata(all_greedy=False, all_random=False, greedy_mask=greedy, temperature=temperature)
    out = Sampler()(logits, meta).sampled_token_ids.cpu()
    assert calls == [torch.bfloat16]  # no float32 copy of the logits
    assert (out[:10] == 2).all()
    freq = torch.bincount(out[10:], minlength=4).float() / (rows - 10)
    want = (torch.tensor([1.0, 0.0, 2.0, float("-inf")]) / 1.5).softmax(-1)
    assert (freq - want).abs().max() < 0.02
    meta.generators = {11: torch.Generator(device="cuda").manual_seed(5)}
    Sampler()(logits, meta)
    assert len(calls) == 1  # a seeded row: the PyTorch path
    # A grammar bitmask as the only edit, every row random: the pass reads it (no float32 copy); with a greedy row
    # the bitmask is applied to a float32 copy first (the argmax needs it) and the pass gets no mask.
    bitmask = torch.full((rows, 1), 0b0011, dtype=torch.int32, device="cuda")  # tokens 0 and 1
    meta = SamplingMetadata(all_greedy=False, all_random=True, temperature=temperature, grammar_bitmask=bitmask)
    out = Sampler()(logits, meta).sampled_token_ids.cpu()
    assert calls[-1] == torch.bfloat16 and masks[-1] is bitmask
    assert set(out.tolist()) == {0, 1}
    meta = SamplingMetadata(
        all_greedy=False, all_random=False, greedy_mask=greedy, temperature=temperature, grammar_bitmask=bitmask
    )
    out = Sampler()(logits, meta).sampled_token_ids.cpu()
    assert calls[-1] == torch.float32 and masks[-1] is None
    assert (out[:10] == 0).all() and set(out[10:].tolist()) == {0, 1}


@pytest.mark.gpu
@needs_cuda
def test_gumbel_batch_past_int32_elements_gpu():
    """More than 2**31 logits in one call (14,200 rows of a 151,936-token vocabulary, bf16): row offsets and Philox
    counters must not wrap. The last rows allow one token each, which they must draw."""
    rows, vocab_size = 14_200, 151_936
    assert rows * vocab_size > 2**31
    logits = torch.zeros(rows, vocab_size, dtype=torch.bfloat16, device="cuda")
    num_words = (vocab_size + 31) // 32
    bitmask = torch.full((rows, num_words), -1, dtype=torch.int32, device="cuda")
    last = torch.arange(rows - 8, rows, device="cuda")
    allowed = vocab_size - 1 - (last - (rows - 8)) * 997  # one token per row, in the rows' last words
    bitmask[last] = 0
    bitmask[last, allowed // 32] = torch.where(allowed % 32 == 31, -(2**31), 1 << (allowed % 32)).to(torch.int32)
    ids = gs.gumbel_sample(logits, None, 11, bitmask)
    assert torch.equal(ids[last], allowed)
    assert ((ids >= 0) & (ids < vocab_size)).all()

