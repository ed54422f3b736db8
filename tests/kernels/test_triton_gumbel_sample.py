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
        return real(*args)

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
