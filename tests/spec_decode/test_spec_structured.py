"""Speculative decoding with structured outputs: constrained requests get drafts, one grammar mask per draft
position, and the output is token for token what decoding without speculation gives (greedy), obeying the
constraint; the matchers are rolled back after each fill (else the next mask would be wrong)."""

from __future__ import annotations

import json
import re

import pytest

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from tests.spec_decode.test_spec_engine import assert_no_leaks, make_llm, spec_config, stats

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["name", "tags", "n"],
}
REGEX = r"(ab|cd)+[0-9]{2,6}"
PROMPTS = ['{"name": "aa", "tags": ["red", "red"], "n": 1} {"name": "aa", "tags": ["red", "red"]', "abababab12 abab"]


def constrained(max_tokens: int = 120) -> list[SamplingParams]:
    so = [
        StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
        StructuredOutputsParams(regex=REGEX),
        StructuredOutputsParams(json=SCHEMA),  # free whitespace: the per-token cap walks through drafts too
        StructuredOutputsParams(choice=["red green blue", "red red red"]),
    ]
    return [SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=s) for s in so]


def check(params: SamplingParams, text: str) -> None:
    s = params.structured_outputs
    if s.json is not None:
        import jsonschema

        jsonschema.validate(json.loads(text), SCHEMA)
    elif s.regex is not None:
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in s.choice, text


@pytest.mark.parametrize("method", ["ngram", "draft_self", "draft_other", "medusa"])
def test_constrained_requests_speculate_exactly(tiny_model_dirs, tiny_llama, method) -> None:
    params = constrained() * 2
    prompts = [PROMPTS[i % 2] for i in range(len(params))]
    plain = LLM(tiny_llama, dtype="float32", device="cpu", block_size=4)
    want = plain.generate(prompts, params, use_tqdm=False)
    spec = make_llm(tiny_llama, spec_config(method, tiny_llama, tiny_model_dirs))
    got = spec.generate(prompts, params, use_tqdm=False)
    for p, w, g in zip(params, want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids, (method, p.structured_outputs.kind)
        assert g.outputs[0].finish_reason == "stop", g.outputs[0].text
        check(p, g.outputs[0].text)
    s = stats(spec)
    assert s.spec_num_drafts > 0 and s.spec_num_draft_tokens > 0  # every request was constrained
    if method != "ngram":  # drafts the grammar forbids were proposed and rejected
        assert s.spec_num_accepted_tokens < s.spec_num_draft_tokens
    assert_no_leaks(spec)


def test_draft_masks_walk_and_roll_back_the_matcher(tiny_llama) -> None:
    """grammar_bitmask_spec: row 0 is the mask now, row i+1 the mask after drafts 0..i; a draft the grammar
    rejects leaves the rest of its rows open; the matcher ends where it started."""
    from transformers import AutoTokenizer

    from pagedllm.structured_output.manager import StructuredOutputManager

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    manager = StructuredOutputManager(len(tok), lambda: tok)
    state = manager.new_state(StructuredOutputsParams(regex="abc[0-9]"), [5], [tok.eos_token_id])
    state.wait(30)
    assert state.ready() and state.active
    ids = [tok.convert_tokens_to_ids(c) for c in "abc"]
    assert all(isinstance(i, int) and i != tok.unk_token_id for i in ids)

    def allowed(row) -> set[int]:
        return {i for i in range(len(tok)) if (int(row[i // 32]) >> (i % 32)) & 1}

    masks = manager.grammar_bitmask_spec([state, None], [[ids[0], ids[1], ids[0]], [3]])
    assert masks.shape == (4 + 2, (len(tok) + 31) // 32)
    assert ids[0] in allowed(masks[0]) and ids[1] not in allowed(masks[0])
    assert allowed(masks[1]) == {ids[1]} and allowed(masks[2]) == {ids[2]}
    assert (masks[3] == -1).all()  # after the rejected third draft ("a" where "c" must come): never used
    assert (masks[4:] == -1).all()  # the unconstrained request
    assert state.num_accepted == 0 and allowed(manager.grammar_bitmask([state])[0]) == allowed(masks[0])
