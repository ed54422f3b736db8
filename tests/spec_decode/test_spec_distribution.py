"""Distribution exactness of speculative sampling as the runner does it: the sampler's processed logits
(temperature, top-k, top-p, min-p) verified by ``rejection_sample`` against n-gram-style drafts must emit tokens
distributed exactly as the target's own sampling distribution, computed here independently.

Fixed seeds and 40,000 rows per case; each token's frequency must lie within 5 standard errors of its target
probability, and a token the filters remove must never appear.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.sample.metadata import build_plain_sampling_metadata
from pagedllm.sample.sampler import Sampler
from pagedllm.spec_decode import rejection_sample

VOCAB = 8
K = 3
N = 40_000


def target_probs(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float
) -> np.ndarray:
    """The sampling distribution by the textbook definitions: softmax(logits / T), then min-p (relative to the
    top probability), top-k, top-p (the smallest most-likely set whose mass reaches p), renormalised."""
    p = torch.softmax(logits.double() / temperature, dim=-1).numpy()
    keep = np.ones(VOCAB, dtype=bool)
    if min_p > 0:
        keep &= p >= min_p * p.max()
    order = np.argsort(-p)
    if top_k > 0:
        keep[order[top_k:]] = False
    if top_p < 1:
        q = np.where(keep, p, 0) / np.where(keep, p, 0).sum()
        cum = np.cumsum(q[order])
        cut = int(np.searchsorted(cum, top_p)) + 1  # tokens up to and including the one reaching p
        keep[order[cut:]] = False
    out = np.where(keep, p, 0.0)
    return out / out.sum()


def assert_distributed_as(tokens: np.ndarray, probs: np.ndarray) -> None:
    n = len(tokens)
    assert n > 2000, "too few samples for the test to mean anything"
    freq = np.bincount(tokens, minlength=VOCAB) / n
    assert freq[probs == 0].sum() == 0, f"filtered tokens were emitted: {freq} vs {probs}"
    bound = 5 * np.sqrt(probs * (1 - probs) / n) + 1e-12
    assert (np.abs(freq - probs) <= bound).all(), f"frequencies {freq.round(4)} vs target {probs.round(4)}"


@pytest.mark.parametrize(
    "temperature, top_k, top_p, min_p",
    [
        (1.0, 0, 1.0, 0.0),
        (0.6, 0, 1.0, 0.0),
        (1.3, 3, 1.0, 0.0),
        (0.9, 0, 0.7, 0.0),
        (0.8, 5, 0.85, 0.0),
        (1.0, 0, 1.0, 0.2),
    ],
)
def test_emitted_tokens_follow_the_processed_target(temperature, top_k, top_p, min_p):
    gen = torch.Generator().manual_seed(0)
    # Distinct logits per position (no ties, so top-k / top-p sets are unambiguous).
    pos_logits = torch.randn(K + 1, VOCAB, generator=gen) * 1.5  # [k + 1, vocab]
    logits = pos_logits.repeat(N, 1)  # [N * (k + 1), vocab]: each row's k + 1 positions, row after row
    rows = N * (K + 1)
    meta = build_plain_sampling_metadata(
        greedy=np.zeros(rows, dtype=bool),
        temperature=np.full(rows, temperature, dtype=np.float32),
        top_k=np.full(rows, top_k, dtype=np.int64),
        top_p=np.full(rows, top_p, dtype=np.float32),
        min_p=np.full(rows, min_p, dtype=np.float32),
        num_logprobs=np.full(rows, -1, dtype=np.int64),
        generators={},
        vocab_size=VOCAB,
        device=torch.device("cpu"),
    )
    processed = Sampler().processed_logits(logits, meta).view(N, K + 1, VOCAB)
    drafts = torch.randint(0, VOCAB, (N, K), generator=gen)  # uniform guesses: filtered tokens included
    num_draft = torch.full((N,), K, dtype=torch.long)
    with torch.random.fork_rng():
        torch.manual_seed(1)
        out, num_acc = rejection_sample(drafts, num_draft, None, processed, torch.ones(N))
    out, num_acc = out.numpy(), num_acc.numpy()
    want = [target_probs(pos_logits[i], temperature, top_k, top_p, min_p) for i in range(K + 1)]
    assert_distributed_as(out[:, 0], want[0])
    # Given the first draft was accepted, the second emitted token follows position 1's distribution.
    assert_distributed_as(out[num_acc >= 1, 1], want[1])
    # Both outcomes occur, so the test exercises acceptance and the residual resampling.
    assert 0.05 < (num_acc >= 1).mean() < 0.95


def test_greedy_rows_verify_against_the_edited_argmax():
    """Greedy rows (temperature 0 in the verification) accept a draft iff it is the argmax after masks."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]] * 2)  # two positions; argmax 1
    meta = build_plain_sampling_metadata(
        greedy=np.ones(2, dtype=bool),
        temperature=np.ones(2, dtype=np.float32),
        top_k=np.zeros(2, dtype=np.int64),
        top_p=np.ones(2, dtype=np.float32),
        min_p=np.zeros(2, dtype=np.float32),
        num_logprobs=np.full(2, -1, dtype=np.int64),
        generators={},
        vocab_size=4,
        device=torch.device("cpu"),
    )
    processed = Sampler().processed_logits(logits, meta).view(1, 2, 4)
    out, acc = rejection_sample(torch.tensor([[1]]), torch.tensor([1]), None, processed, torch.zeros(1))
    assert out.tolist() == [[1, 1]] and acc.tolist() == [1]
    out, acc = rejection_sample(torch.tensor([[3]]), torch.tensor([1]), None, processed, torch.zeros(1))
    assert out.tolist() == [[1, -1]] and acc.tolist() == [0]
