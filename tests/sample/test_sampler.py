"""Sampler tests: greedy = argmax, processing vs naive per-row references, seeds, frequencies, logprobs."""

from __future__ import annotations

import math
import random

import pytest
import torch

from pagedllm.sample.metadata import SamplingMetadata, build_sampling_metadata
from pagedllm.sample.ops import apply_min_p_, apply_top_k_only_, apply_top_k_top_p
from pagedllm.sample.sampler import Sampler, compute_logprobs_topk
from pagedllm.sampling_params import SamplingParams

CPU = torch.device("cpu")
NEG_INF = float("-inf")


def build(
    params: list[SamplingParams],
    vocab_size: int,
    outputs: list[list[int]] | None = None,
    prompts: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
    eos: list[int | None] | None = None,
) -> SamplingMetadata:
    n = len(params)
    return build_sampling_metadata(
        params,
        outputs if outputs is not None else [[] for _ in range(n)],
        prompts if prompts is not None else [[] for _ in range(n)],
        generators if generators is not None else [None] * n,
        eos if eos is not None else [None] * n,
        vocab_size,
        CPU,
    )


def sample(logits: torch.Tensor, params: list[SamplingParams], **kw) -> torch.Tensor:
    return Sampler()(logits, build(params, logits.shape[1], **kw)).sampled_token_ids


# ---------------------------------------------------------------- naive references (one row at a time)


def process_ref(
    logits: list[float], p: SamplingParams, output: list[int], prompt: list[int], eos: int | None
) -> list[float]:
    """Masks, bias and penalties for one row, token by token (what happens before greedy argmax)."""
    v = len(logits)
    out = list(logits)
    if p.allowed_token_ids is not None:
        out = [x if t in p.allowed_token_ids else NEG_INF for t, x in enumerate(out)]
    for word in p._bad_words_token_ids:
        prefix = word[:-1]
        if not prefix or (len(output) >= len(prefix) and output[-len(prefix) :] == prefix):
            out[word[-1]] = NEG_INF
    if len(output) < p.min_tokens:
        for t in p.stop_token_ids:
            out[t] = NEG_INF
        if eos is not None and not p.ignore_eos:
            out[eos] = NEG_INF
    for t, b in (p.logit_bias or {}).items():
        out[t] += b
    for t in range(v):
        if t in output or t in prompt:
            r = p.repetition_penalty
            out[t] = out[t] / r if out[t] > 0 else out[t] * r
        count = output.count(t)
        out[t] -= p.frequency_penalty * count
        out[t] -= p.presence_penalty * (count > 0)
    return out


def top_k_top_p_keep_ref(logits: list[float], top_k: int, top_p: float) -> list[bool]:
    """Which tokens survive top-k then top-p, by sorting and walking the row."""
    order = sorted(range(len(logits)), key=lambda t: -logits[t])
    if 0 < top_k < len(logits):
        order = order[:top_k]
    m = max(logits[t] for t in order)
    weights = [math.exp(logits[t] - m) for t in order]
    total = sum(weights)
    keep = [False] * len(logits)
    mass = 0.0
    for t, w in zip(order, weights, strict=True):
        if mass >= top_p:
            break
        keep[t] = True
        mass += w / total
    return keep


# ---------------------------------------------------------------- greedy and processing


def test_greedy_is_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(8, 50)
    params = [SamplingParams(temperature=0.0) for _ in range(8)]
    meta = build(params, 50)
    assert meta.all_greedy and meta.no_penalties and not meta.needs_logits_edit
    out = Sampler()(logits, meta)
    assert out.logprobs is None
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    # bf16 logits are upcast; ties resolve to the lowest index like torch.argmax
    tied = torch.zeros(2, 7, dtype=torch.bfloat16)
    tied[1, 3] = tied[1, 5] = 1.0
    assert sample(tied, params[:2]).tolist() == [0, 3]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_with_penalties_and_masks_matches_reference(seed: int) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    n, v = 12, 40
    params, outputs, prompts, eos = [], [], [], []
    for _ in range(n):
        p = SamplingParams(
            temperature=0.0,
            repetition_penalty=rng.choice([1.0, 1.3, 0.7]),
            frequency_penalty=rng.choice([0.0, 0.5, -0.4]),
            presence_penalty=rng.choice([0.0, 1.0, -0.3]),
            logit_bias={rng.randrange(v): rng.uniform(-3, 3)} if rng.random() < 0.3 else None,
            min_tokens=rng.choice([0, 0, 5]),
            stop_token_ids=[rng.randrange(v)] if rng.random() < 0.5 else None,
        )
        if rng.random() < 0.3:
            p._bad_words_token_ids = [[rng.randrange(v)], [rng.randrange(v), rng.randrange(v)]]
        params.append(p)
        outputs.append([rng.randrange(v) for _ in range(rng.randrange(8))])
        prompts.append([rng.randrange(v) for _ in range(rng.randrange(1, 10))])
        eos.append(rng.choice([None, 0, 1]))
    logits = torch.randn(n, v) * 3
    original = logits.clone()
    got = sample(logits, params, outputs=outputs, prompts=prompts, eos=eos)
    assert torch.equal(logits, original), "the sampler must not modify its input"
    for i in range(n):
        ref = process_ref(logits[i].tolist(), params[i], outputs[i], prompts[i], eos[i])
        assert got[i].item() == max(range(v), key=lambda t: (ref[t], -t)), f"row {i}"


def test_repetition_penalty_counts_prompt_tokens() -> None:
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    positive = torch.tensor([[2.0, 1.9, -5.0]])
    assert sample(positive, [p]).item() == 0
    assert sample(positive, [p], prompts=[[0]]).item() == 1  # 2.0 / 2 < 1.9
    assert sample(positive, [p], outputs=[[0]]).item() == 1
    negative = torch.tensor([[-1.0, -1.05, -5.0]])
    assert sample(negative, [p], prompts=[[0]]).item() == 1  # -1.0 * 2 < -1.05
    q = SamplingParams(temperature=0.0, repetition_penalty=1.0, presence_penalty=1.0)
    assert sample(positive, [q], prompts=[[0]]).item() == 0  # presence counts the output only


def test_logit_bias_and_allowed_token_ids() -> None:
    logits = torch.zeros(2, 10)
    logits[:, 7] = 5.0
    params = [
        SamplingParams(temperature=0.0, logit_bias={2: 6.0}),
        SamplingParams(temperature=0.0, allowed_token_ids=[3, 4]),
    ]
    logits[1, 4] = 0.5
    assert sample(logits, params).tolist() == [2, 4]
    # random rows never leave the allowed set
    torch.manual_seed(0)
    many = torch.randn(200, 10)
    got = sample(many, [SamplingParams(allowed_token_ids=[1, 5, 8])] * 200)
    assert set(got.tolist()) == {1, 5, 8}


def test_bad_words() -> None:
    v = 10
    logits = torch.zeros(1, v)
    logits[0, 4] = 3.0
    logits[0, 6] = 2.0
    p = SamplingParams(temperature=0.0)
    p._bad_words_token_ids = [[4], [1, 2, 6]]
    assert sample(logits, [p], outputs=[[1, 2]]).item() == 0  # 4 always banned, 6 banned after [1, 2]
    assert sample(logits, [p], outputs=[[2, 1]]).item() == 6  # prefix not matched
    assert sample(logits, [p], outputs=[[2]]).item() == 6  # output shorter than the prefix


def test_min_tokens_bans_eos_and_stop_tokens() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]])
    eos = [0]
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1])
    assert sample(logits, [p], outputs=[[3]], eos=eos).item() == 2
    assert sample(logits, [p], outputs=[[3, 3]], eos=eos).item() == 0  # min_tokens reached
    q = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1], ignore_eos=True)
    assert sample(logits, [q], outputs=[[]], eos=eos).item() == 0  # eos allowed, stop token still banned
    assert sample(torch.tensor([[1.0, 4.0, 3.0, 0.0]]), [q], outputs=[[]], eos=eos).item() == 2


# ---------------------------------------------------------------- filters vs naive versions


@pytest.mark.parametrize("seed", [0, 1])
def test_top_k_top_p_masks_match_naive(seed: int) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    n, v = 24, 64
    logits = torch.randn(n, v) * 2
    top_k = [rng.choice([0, 1, 2, 5, 20, v]) for _ in range(n)]
    top_p = [rng.choice([1.0, 0.1, 0.5, 0.9, 0.99]) for _ in range(n)]
    k_tensor = torch.tensor([k if k > 0 else v for k in top_k])
    got = apply_top_k_top_p(logits, k_tensor, torch.tensor(top_p)).isfinite()
    for i in range(n):
        assert got[i].tolist() == top_k_top_p_keep_ref(logits[i].tolist(), top_k[i], top_p[i]), f"row {i}"
    # top-k alone: the torch.topk path and the sort path agree with the reference
    only_k = apply_top_k_only_(logits.clone(), k_tensor, max(k for k in top_k if 0 < k < v)).isfinite()
    sort_k = apply_top_k_top_p(logits, k_tensor, None).isfinite()
    for i in range(n):
        ref = top_k_top_p_keep_ref(logits[i].tolist(), top_k[i], 1.0)
        assert only_k[i].tolist() == ref and sort_k[i].tolist() == ref, f"row {i}"


def test_min_p_matches_naive() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 30) * 2
    min_p = [0.0, 0.05, 0.1, 0.3, 0.9, 1.0]
    got = apply_min_p_(logits.clone(), torch.tensor(min_p)).isfinite()
    probs = logits.softmax(dim=-1)
    for i, mp in enumerate(min_p):
        top = probs[i].max().item()
        ref = [probs[i, t].item() >= mp * top for t in range(30)]
        assert got[i].tolist() == ref, f"row {i}"


# ---------------------------------------------------------------- seeds and frequencies


def test_seeded_row_same_alone_or_batched() -> None:
    v, steps = 500, 4
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=1234)
    other_seeded = SamplingParams(temperature=1.2, top_k=50, seed=7)
    torch.manual_seed(0)
    step_logits = [torch.randn(v) for _ in range(steps)]

    def run(layout: list[str]) -> list[int]:
        """Sample ``steps`` tokens; ``layout`` says what sits in each row; returns the "me" row's tokens."""
        gen_me = torch.Generator().manual_seed(1234)
        gen_other = torch.Generator().manual_seed(7)
        mine: list[int] = []
        for s in range(steps):
            rows, params, gens = [], [], []
            for kind in layout:
                if kind == "me":
                    rows.append(step_logits[s])
                    params.append(seeded)
                    gens.append(gen_me)
                else:
                    rows.append(torch.randn(v))
                    params.append(
                        {"free": SamplingParams(), "greedy": SamplingParams(temperature=0.0)}.get(
                            kind, other_seeded
                        )
                    )
                    gens.append(gen_other if kind == "seeded" else None)
            out = sample(torch.stack(rows), params, generators=gens)
            mine.append(out[layout.index("me")].item())
        return mine

    alone = run(["me"])
    assert run(["me"]) == alone  # repeats exactly
    assert run(["free", "me", "greedy"]) == alone
    assert run(["seeded", "free", "free", "me"]) == alone
    assert len(set(alone)) > 1  # it really samples


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a filtered-out token"
    return (((counts - expected) ** 2)[support] / expected[support]).sum().item()


# chi-square critical values at p = 0.001 by degrees of freedom
_CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47}


@pytest.mark.parametrize(
    "params, keep",
    [
        (SamplingParams(), [0, 1, 2, 3, 4]),
        (SamplingParams(temperature=0.5), [0, 1, 2, 3, 4]),
        (SamplingParams(temperature=1.5, top_k=3), [1, 2, 4]),
        (SamplingParams(top_p=0.7), [2, 4]),  # sorted probs .64 .23 .09 ...: .64 < .7, then .87 >= .7
        (SamplingParams(min_p=0.1), [1, 2, 4]),
    ],
)
def test_sampled_frequencies_match_probabilities(params: SamplingParams, keep: list[int]) -> None:
    logits = torch.tensor([-1.0, 0.0, 1.0, -2.0, 2.0])
    n = 20000
    probs = torch.full((5,), NEG_INF)
    probs[keep] = logits[keep] / max(params.temperature, 1e-5)
    probs = probs.softmax(dim=-1)
    torch.manual_seed(0)
    got = sample(logits.expand(n, 5).contiguous(), [params] * n)
    counts = torch.bincount(got, minlength=5).float()
    assert _chi_square(counts, probs) < _CHI2_999[len(keep) - 1]
    assert (counts / n - probs).abs().max() < 0.02


def test_seeded_rows_frequencies() -> None:
    logits = torch.tensor([-1.0, 0.0, 1.0, -2.0, 2.0])
    n = 4000
    gens = [torch.Generator().manual_seed(1000 + i) for i in range(n)]
    got = sample(logits.expand(n, 5).contiguous(), [SamplingParams(seed=1)] * n, generators=gens)
    counts = torch.bincount(got, minlength=5).float()
    assert _chi_square(counts, logits.softmax(dim=-1)) < _CHI2_999[4]


def test_mixed_greedy_and_random_rows() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 20)
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1), SamplingParams(temperature=0.0)] * 2
    meta = build(params, 20)
    assert not meta.all_greedy and not meta.all_random and meta.no_top_p and not meta.no_top_k
    original = logits.clone()
    got = Sampler()(logits, meta).sampled_token_ids
    assert torch.equal(got, logits.argmax(dim=-1))  # top_k=1 is argmax too
    assert torch.equal(logits, original)  # top-k works in place, but on a copy
    sample(logits, [SamplingParams(min_p=0.5)] * 6)
    assert torch.equal(logits, original)


# ---------------------------------------------------------------- logprobs


def test_logprobs_and_ranks_from_raw_logits() -> None:
    torch.manual_seed(0)
    n, v = 5, 30
    logits = torch.randn(n, v) * 2
    params = [
        SamplingParams(logprobs=3, temperature=0.7, repetition_penalty=1.5),
        SamplingParams(logprobs=0),
        SamplingParams(temperature=0.0, logit_bias={5: 10.0}),
        SamplingParams(logprobs=1, top_k=4),
        SamplingParams(),
    ]
    out = Sampler()(logits, build(params, v, prompts=[[1, 2, 3]] * n))
    lp = out.logprobs
    assert lp is not None and lp.token_ids.shape == (n, 4) and lp.logprobs.shape == (n, 4)
    assert out.sampled_token_ids[2].item() == 5
    raw = torch.log_softmax(logits, dim=-1)
    for i in range(n):
        tok = out.sampled_token_ids[i].item()
        row = raw[i].tolist()
        assert lp.token_ids[i, 0].item() == tok
        assert lp.logprobs[i, 0].item() == pytest.approx(row[tok], abs=1e-6)
        assert lp.ranks[i].item() == 1 + sum(x > row[tok] for x in row)
        top = sorted(range(v), key=lambda t: -row[t])[:3]
        assert lp.token_ids[i, 1:].tolist() == top
        assert lp.logprobs[i, 1:].tolist() == pytest.approx([row[t] for t in top], abs=1e-6)
    lists = lp.tolists()
    assert lists.ranks == lp.ranks.tolist() and len(lists.token_ids[0]) == 4


def test_compute_logprobs_topk_zero_k() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0], [3.0, 3.0, 0.0]], dtype=torch.bfloat16)
    lp = compute_logprobs_topk(logits, torch.tensor([0, 1]), 0)
    assert lp.token_ids.tolist() == [[0], [1]]
    assert lp.ranks.tolist() == [3, 1]  # tie with token 0 does not count: strictly greater only
    assert lp.logprobs.dtype == torch.float32
    assert torch.allclose(lp.logprobs[:, 0], torch.log_softmax(logits.float(), -1)[[0, 1], [0, 1]])
