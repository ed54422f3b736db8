"""Where a constraint meets the stop rules. A grammar that has completed admits only a stop token, and the
constraint wins: over ``min_tokens`` (which holds stop tokens back) and over ``ignore_eos`` (which would go on
past the end), the request finishes with "stop" as soon as the grammar ends, its text valid for the constraint,
never an abort and no block leaked; with async scheduling and speculative decoding too. A grammar that can go
on still honours ``min_tokens``."""

from __future__ import annotations

import json
import re

import pytest
import torch

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.demo import default_model
from pagedllm.sample.metadata import build_sampling_metadata
from pagedllm.sample.sampler import Sampler

OBJECT = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}
# Constraints that end after a few tokens (the JSON one with free whitespace: the per-token whitespace cap too).
SHORT = [
    StructuredOutputsParams(choice=["yes", "no"]),
    StructuredOutputsParams(json={"type": "boolean"}),
    StructuredOutputsParams(json=OBJECT),
    StructuredOutputsParams(regex="[0-9]{2}"),
]


def valid(so: StructuredOutputsParams, text: str) -> bool:
    if so.choice is not None:
        return text in so.choice
    if so.regex is not None:
        return re.fullmatch(so.regex, text) is not None
    value = json.loads(text)
    return isinstance(value, bool) if so.json == {"type": "boolean"} else value in ({"ok": True}, {"ok": False})


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(request) -> LLM:
    return LLM(default_model(), dtype="float32", device="cpu", async_scheduling=request.param)


def generate(llm: LLM, params: list[SamplingParams], prompts: list[str] | None = None) -> list:
    prompts = prompts or [f"Answer {i}:" for i in range(len(params))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.llm_engine.check_integrity()
    assert llm.llm_engine.engine_core.scheduler.kv.usage() == 0.0  # no block leaked
    return [o.outputs[0] for o in outs]


def test_a_completed_grammar_wins_over_min_tokens(llm: LLM) -> None:
    """The grammar allows only EOS and min_tokens would ban it: EOS stays, the request stops (vLLM does too)."""
    params = [
        SamplingParams(temperature=t, seed=3, max_tokens=40, min_tokens=30, structured_outputs=so)
        for so in SHORT
        for t in (0.0, 0.9)
    ]
    for p, out in zip(params, generate(llm, params), strict=True):
        so = p.structured_outputs
        assert out.finish_reason == "stop", (so.key(), out.text, out.finish_reason)
        assert out.stop_reason is None and len(out.token_ids) < p.min_tokens
        assert valid(so, out.text), (so.key(), out.text)


def test_ignore_eos_ends_with_the_grammar(llm: LLM) -> None:
    """ignore_eos would go on after the grammar's EOS, unconstrained: the request stops there instead."""
    eos = llm.get_tokenizer().eos_token_id
    params = [
        SamplingParams(temperature=t, seed=5, max_tokens=40, ignore_eos=True, structured_outputs=so)
        for so in SHORT
        for t in (0.0, 0.9)
    ]
    for p, out in zip(params, generate(llm, params), strict=True):
        so = p.structured_outputs
        assert out.finish_reason == "stop", (so.key(), out.text, out.finish_reason)
        assert out.token_ids[-1] == eos and eos not in out.token_ids[:-1]
        assert valid(so, out.text), (so.key(), out.text)


def test_a_stop_token_that_ends_the_grammar_is_the_stop_reason(llm: LLM) -> None:
    """The grammar may end with one of the request's stop_token_ids: that id is the stop_reason, under
    min_tokens too (where the id is held back like EOS)."""
    tok = llm.get_tokenizer()
    stop_id = tok.convert_tokens_to_ids(tok.tokenize("!"))[0]
    so = StructuredOutputsParams(choice=["yes", "no"])
    bias = {tok.eos_token_id: -100.0}  # so the grammar ends with the stop token, not EOS
    params = [
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop_id], logit_bias=bias, **kw,
                       structured_outputs=so)
        for kw in ({"min_tokens": 20}, {"ignore_eos": True})
    ]  # fmt: skip
    for out in generate(llm, params):
        assert (out.text, out.finish_reason, out.stop_reason) in (("yes", "stop", stop_id), ("no", "stop", stop_id))


def test_min_tokens_holds_while_the_grammar_can_go_on(llm: LLM) -> None:
    """Only an empty row gets its stop tokens back: a grammar that may stop but can also go on still waits for
    min_tokens, even with EOS pushed up to be the model's first choice."""
    eos = llm.get_tokenizer().eos_token_id
    so = StructuredOutputsParams(regex="[a-z]+( [a-z]+)*")
    params = [
        SamplingParams(temperature=0.0, max_tokens=30, min_tokens=m, logit_bias={eos: 100.0}, structured_outputs=so)
        for m in (0, 12)
    ]
    free, held = generate(llm, params, ["Answer:", "Answer:"])
    assert (len(free.token_ids), free.finish_reason) == (2, "stop")  # one word token (EOS cannot open), EOS
    assert (len(held.token_ids), held.finish_reason) == (13, "stop")
    assert held.token_ids[-1] == eos and re.fullmatch("[a-z]+( [a-z]+)*", held.text)


def test_the_sampler_gives_stop_tokens_back_only_to_rows_left_empty() -> None:
    """min_tokens: the EOS / stop tokens of a row with nothing else allowed stay (greedy and random rows);
    every other row loses them."""
    eos, stop, v = 3, 2, 6
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]]).repeat(4, 1)
    params = [
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop], allowed_token_ids=[eos, stop]),
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop], allowed_token_ids=[eos, stop, 4]),
        SamplingParams(temperature=1.0, seed=1, min_tokens=3, stop_token_ids=[stop], allowed_token_ids=[stop]),
        SamplingParams(temperature=1.0, seed=1, min_tokens=3, allowed_token_ids=[eos, 5]),
    ]
    meta = build_sampling_metadata(
        params, [[]] * 4, [[]] * 4, [None] * 4, [eos] * 4, v, torch.device("cpu")
    )
    for _ in range(20):
        assert Sampler()(logits, meta).sampled_token_ids.tolist() == [eos, 4, stop, 5]


def test_speculative_decoding_stops_at_the_grammars_end(tiny_model_dirs, tiny_llama) -> None:
    """Drafts past the grammar's EOS (accepted where the mask no longer constrains) are dropped with the rest
    of the step: the output is exactly what decoding without speculation gives, ending at EOS."""
    from tests.spec_decode.test_spec_engine import assert_no_leaks, make_llm, spec_config

    prompts = ['yes no yes no yes no', 'true {"ok":true} true {"ok":true} true {"ok":', "12 12 12 12 12 1"]
    compact = StructuredOutputsParams(json=OBJECT, disable_any_whitespace=True)  # random weights: no ws runs
    constraints = [*SHORT[:2], compact, SHORT[3]]
    params = [
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, structured_outputs=so) for so in constraints
    ] + [SamplingParams(temperature=0.0, max_tokens=30, min_tokens=20, structured_outputs=SHORT[0])]
    prompts = [prompts[i % len(prompts)] for i in range(len(params))]
    plain = LLM(tiny_llama, dtype="float32", device="cpu", block_size=4)
    want = plain.generate(prompts, params, use_tqdm=False)
    for method in ("ngram", "draft_self"):
        spec = make_llm(tiny_llama, spec_config(method, tiny_llama, tiny_model_dirs))
        got = spec.generate(prompts, params, use_tqdm=False)
        for p, w, g in zip(params, want, got, strict=True):
            w, g = w.outputs[0], g.outputs[0]
            assert (g.token_ids, g.finish_reason) == (w.token_ids, "stop"), (method, p.structured_outputs.key())
            assert valid(p.structured_outputs, g.text), g.text
        assert spec.llm_engine.get_stats().spec_num_drafts > 0
        assert_no_leaks(spec)
