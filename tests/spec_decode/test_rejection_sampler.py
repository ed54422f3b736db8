"""rejection_sample: exact greedy verification, statistical exactness of random rows, seeding, shapes."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from pagedllm.spec_decode import rejection_sample
from pagedllm.spec_decode.rejection_sampler import greedy_verify, greedy_verify_flat

NEG_INF = float("-inf")


@pytest.fixture(autouse=True)
def _seeded() -> Iterator[None]:
    """Deterministic default generator for each test, without leaking the seed into other tests."""
    with torch.random.fork_rng():
        torch.manual_seed(1234)
        yield


def onehot_logits(token_ids: list[list[int]], vocab: int) -> torch.Tensor:
    """[batch, positions, vocab] logits whose argmax at each position is the given token."""
    logits = torch.randn(len(token_ids), len(token_ids[0]), vocab) * 0.1
    for b, row in enumerate(token_ids):
        for i, t in enumerate(row):
            logits[b, i, t] = 5.0
    return logits


def assert_valid(
    out: torch.Tensor, num_acc: torch.Tensor, drafts: torch.Tensor, num_draft: torch.Tensor
) -> None:
    """Structural contract: accepted drafts, one emitted token, then -1."""
    batch, width = out.shape
    assert out.dtype == torch.int64 and num_acc.dtype == torch.int64
    assert num_acc.shape == (batch,) and width == drafts.shape[1] + 1
    assert bool((num_acc >= 0).all()) and bool((num_acc <= num_draft).all())
    for b in range(batch):
        a = int(num_acc[b])
        assert out[b, :a].tolist() == drafts[b, :a].tolist()
        assert out[b, a] >= 0
        assert bool((out[b, a + 1 :] == -1).all())


def test_greedy_rows_hand_computed() -> None:
    vocab, k = 6, 3
    argmax = [[3, 1, 2, 0], [3, 1, 4, 5], [2, 0, 0, 0], [3, 1, 4, 5], [5, 1, 2, 0]]
    drafts = torch.tensor([[3, 1, 2], [3, 4, 2], [-1, -1, -1], [3, 1, -1], [3, 1, 2]])
    num_draft = torch.tensor([3, 3, 0, 2, 3])
    out, num_acc = rejection_sample(drafts, num_draft, None, onehot_logits(argmax, vocab), torch.zeros(5))
    assert out.tolist() == [
        [3, 1, 2, 0],  # all accepted + bonus
        [3, 1, -1, -1],  # mismatch at 1: emit the target's argmax there
        [2, -1, -1, -1],  # no drafts: the bonus token only
        [3, 1, 4, -1],  # 2 of 2 accepted + bonus at position 2; the padding draft is ignored
        [5, -1, -1, -1],  # mismatch at 0
    ]
    assert num_acc.tolist() == [3, 1, 0, 2, 0]
    # draft_probs do not matter to greedy rows.
    probs = torch.softmax(torch.randn(5, k, vocab), dim=-1)
    out2, num_acc2 = rejection_sample(drafts, num_draft, probs, onehot_logits(argmax, vocab), torch.zeros(5))
    assert torch.equal(out, out2) and torch.equal(num_acc, num_acc2)


def test_all_greedy_short_path_equals_the_general_rule() -> None:
    """A batch whose rows are all greedy (temperature on the host) takes a short path; the same rows beside a random
    row take the general one: the greedy rows' outputs agree, on random logits with drafts that match for a while."""
    vocab, k, batch = 50, 4, 64
    logits = torch.randn(batch, k + 1, vocab)
    argmax = logits.argmax(dim=-1)
    drafts = argmax[:, :k].clone()
    cut = torch.randint(0, k + 1, (batch,))  # the first wrong draft (k: none)
    for b in range(batch):
        if cut[b] < k:
            drafts[b, cut[b]] = (argmax[b, cut[b]] + 1) % vocab
    num_draft = torch.randint(0, k + 1, (batch,))
    short = rejection_sample(drafts, num_draft, None, logits, torch.zeros(batch))
    temperature = torch.zeros(batch + 1)
    temperature[-1] = 1.0  # one random row: the general rule for everyone
    general = rejection_sample(
        torch.cat([drafts, drafts[:1]]), torch.cat([num_draft, num_draft[:1]]), None,
        torch.cat([logits, logits[:1]]), temperature,
    )  # fmt: skip
    assert torch.equal(short[0], general[0][:batch]) and torch.equal(short[1], general[1][:batch])
    assert short[1].tolist() == torch.minimum(cut, num_draft).tolist()
    assert_valid(*short, drafts, num_draft)
    # Every row with all k drafts: greedy_verify (the verification step's fast path, bf16 logits as the target
    # gives them) equals the general rule.
    full = torch.full((batch,), k)
    fast = greedy_verify(drafts, logits.bfloat16())
    want = rejection_sample(drafts, full, None, logits.bfloat16().float(), torch.zeros(batch))
    assert torch.equal(fast[0], want[0]) and torch.equal(fast[1], want[1])
    assert 0 < int(fast[1].sum()) < batch * k  # some drafts accepted, some rejected
    # Rows with 0..k drafts, their logit rows end to end as a verification step lays them out (n-gram):
    # greedy_verify_flat equals the general rule.
    counts = num_draft.numpy()
    flat = torch.cat([logits[i, : int(counts[i]) + 1] for i in range(batch)]).bfloat16()
    junk = torch.where(torch.arange(k)[None, :] < num_draft[:, None], drafts, 7)  # past a row's drafts: unread
    fast = greedy_verify_flat(junk, counts, flat)
    want = rejection_sample(drafts, num_draft, None, logits.bfloat16().float(), torch.zeros(batch))
    assert torch.equal(fast[0], want[0]) and torch.equal(fast[1], want[1])
    assert (counts == 0).any() and 0 < int(fast[1].sum()) < int(counts.sum())


def test_k_zero() -> None:
    logits = onehot_logits([[4], [1]], 5)
    out, num_acc = rejection_sample(
        torch.empty(2, 0, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), None, logits, torch.zeros(2)
    )
    assert out.tolist() == [[4], [1]] and num_acc.tolist() == [0, 0]


def check_distribution(samples: torch.Tensor, probs: torch.Tensor) -> None:
    """Empirical frequencies of ``samples`` within 5 sigma of ``probs``, per token (zero-probability exact)."""
    n = samples.numel()
    freq = torch.bincount(samples, minlength=probs.numel()).double() / n
    for t, (f, p) in enumerate(zip(freq.tolist(), probs.double().tolist())):
        bound = 5 * math.sqrt(p * (1 - p) / n)
        assert abs(f - p) <= bound, (
            f"token {t}: frequency {f:.4f} vs target {p:.4f} (n={n}, bound {bound:.4f})"
        )


def make_case(vocab: int, k: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Target logits [k + 1, vocab] with one impossible token, draft probs [k, vocab] with one unproposed token."""
    logits = torch.randn(k + 1, vocab)
    logits[:, 0] = NEG_INF  # target never emits token 0; drafts often propose it
    draft = torch.softmax(torch.randn(k, vocab), dim=-1)
    draft[:, 0] += 0.3
    draft[:, vocab - 1] = 0.0  # the draft never proposes the last token, which the target can emit
    return logits, draft / draft.sum(dim=-1, keepdim=True), 0.7


@pytest.mark.parametrize("use_draft_probs", [True, False], ids=["draft_probs", "ngram"])
@pytest.mark.parametrize("k", [1, 3])
def test_exact_distribution(use_draft_probs: bool, k: int) -> None:
    vocab, batch = 5, 40_000
    logits, q, temp = make_case(vocab, k)
    target = torch.softmax(logits / temp, dim=-1)  # [k + 1, vocab]
    # Drafts drawn from q. For n-gram drafts (q = one-hot) any draft distribution must give the target's, but a
    # uniform one would hide a wrong residual by symmetry, so the skewed q serves there too.
    drafts = torch.stack([torch.multinomial(q[i], batch, replacement=True) for i in range(k)], dim=1)
    draft_probs = q.expand(batch, k, vocab) if use_draft_probs else None
    num_draft = torch.full((batch,), k)
    out, num_acc = rejection_sample(
        drafts, num_draft, draft_probs, logits.expand(batch, k + 1, vocab), torch.full((batch,), temp)
    )
    assert out.shape == (batch, k + 1)
    assert bool((out >= 0).sum(dim=1).eq(num_acc + 1).all())
    # The token emitted at position j (given the row got that far) follows the target's p_j.
    for j in range(k + 1):
        reached = num_acc >= j
        if int(reached.sum()) < 1000:
            break
        check_distribution(out[reached, j], target[j])


def test_no_drafts_samples_bonus() -> None:
    vocab, batch, k = 6, 30_000, 2
    logits = torch.randn(k + 1, vocab)
    drafts = torch.randint(0, vocab, (batch, k))
    out, num_acc = rejection_sample(
        drafts,
        torch.zeros(batch, dtype=torch.int64),
        None,
        logits.expand(batch, k + 1, vocab),
        torch.ones(batch),
    )
    assert bool((num_acc == 0).all()) and bool((out[:, 1:] == -1).all())
    check_distribution(out[:, 0], torch.softmax(logits[0], dim=-1))


def test_mixed_batch() -> None:
    vocab, k = 8, 3
    logits = torch.randn(6, k + 1, vocab)
    drafts = torch.randint(0, vocab, (6, k))
    argmax = logits.argmax(dim=-1)
    drafts[0] = argmax[0, :k]  # greedy, all match
    drafts[2, :2] = argmax[2, :2]  # greedy, d = 2, both match
    drafts[4] = argmax[4, :k]
    drafts[4, 1] = (argmax[4, 1] + 1) % vocab  # greedy, mismatch at 1
    logits[3, :, 0] = NEG_INF  # random row whose draft at 0 is impossible under the target: always rejected
    drafts[3, 0] = 0
    num_draft = torch.tensor([3, 1, 2, 2, 3, 0])
    temperature = torch.tensor([0.0, 1.0, 0.0, 0.5, 0.0, 2.0])
    draft_probs = torch.softmax(torch.randn(6, k, vocab), dim=-1)
    inputs = (drafts.clone(), num_draft.clone(), draft_probs.clone(), logits.clone(), temperature.clone())
    out, num_acc = rejection_sample(drafts, num_draft, draft_probs, logits, temperature)
    for before, after in zip(inputs, (drafts, num_draft, draft_probs, logits, temperature)):
        assert torch.equal(before, after)  # inputs untouched
    assert_valid(out, num_acc, drafts, num_draft)
    assert out[0].tolist() == argmax[0].tolist() and num_acc[0] == 3
    assert out[2].tolist() == [*argmax[2, :3].tolist(), -1] and num_acc[2] == 2
    assert out[4].tolist() == [*argmax[4, :2].tolist(), -1, -1] and num_acc[4] == 1
    assert num_acc[3] == 0 and out[3, 0] != 0
    assert num_acc[5] == 0


def test_seeded_rows_reproducible() -> None:
    vocab, k = 7, 4
    logits = torch.randn(k + 1, vocab)
    draft = torch.randint(0, vocab, (k,))
    probs = torch.softmax(torch.randn(k, vocab), dim=-1)

    def run_row(seed: int, row: int, batch: int) -> tuple[list[int], int]:
        out, num_acc = rejection_sample(
            draft.expand(batch, k),
            torch.full((batch,), k),
            probs.expand(batch, k, vocab),
            logits.expand(batch, k + 1, vocab),
            torch.ones(batch),
            generators={row: torch.Generator().manual_seed(seed)},
        )
        return out[row].tolist(), int(num_acc[row])

    results = {seed: run_row(seed, 0, 1) for seed in range(20)}
    for seed in range(20):  # same seed, other position, other batch neighbours, other default-RNG state
        torch.manual_seed(seed + 100)
        assert run_row(seed, 2, 5) == results[seed]
    assert len({tuple(r[0]) for r in results.values()}) > 1  # the seed does matter


@pytest.mark.parametrize(
    ("drafts", "num_draft", "draft_probs", "logits", "temperature", "match"),
    [
        ((2, 3, 1), (2,), None, (2, 4, 5), (2,), "draft_token_ids"),
        ((2, 3), (2,), None, (2, 3, 5), (2,), "target_logits"),
        ((2, 3), (2,), None, (3, 4, 5), (2,), "target_logits"),
        ((2, 3), (2,), (2, 3, 6), (2, 4, 5), (2,), "draft_probs"),
        ((2, 3), (3,), None, (2, 4, 5), (2,), "num_draft_tokens"),
        ((2, 3), (2,), None, (2, 4, 5), (1,), "temperature"),
    ],
)
def test_inconsistent_shapes(
    drafts: tuple[int, ...],
    num_draft: tuple[int, ...],
    draft_probs: tuple[int, ...] | None,
    logits: tuple[int, ...],
    temperature: tuple[int, ...],
    match: str,
) -> None:
    with pytest.raises(ValueError, match=match):
        rejection_sample(
            torch.zeros(drafts, dtype=torch.int64),
            torch.zeros(num_draft, dtype=torch.int64),
            None if draft_probs is None else torch.full(draft_probs, 0.2),
            torch.zeros(logits),
            torch.ones(temperature),
        )
