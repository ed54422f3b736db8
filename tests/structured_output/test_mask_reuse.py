"""The per-step bitmask work of constrained rows: the fill thread knob, and in-string mask reuse giving exactly
xgrammar's masks (random walks through several schemas, rollback, speculative drafts)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm import StructuredOutputsParams
from pagedllm.demo import default_model
from pagedllm.structured_output import manager as manager_mod
from pagedllm.structured_output.grammar import build_grammar, plain_string_tokens, string_loop_rules
from pagedllm.structured_output.manager import (
    FILL_THREADS_ENV,
    GrammarState,
    StructuredOutputManager,
    default_fill_threads,
    usable_cpus,
)

OBJECT = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "short": {"type": "string", "maxLength": 6},
        "n": {"type": "integer"},
    },
    "required": ["name", "tags", "short", "n"],
}
RECORDS = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "name": {"type": "string"}},
        "required": ["id", "name"],
    },
    "minItems": 50,
}


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model())


@pytest.fixture(scope="module")
def manager(tok) -> StructuredOutputManager:
    m = StructuredOutputManager(len(tok), lambda: tok, fill_threads=2, reuse_string_masks=True)
    yield m
    m.shutdown()


def _ready(manager: StructuredOutputManager, params: StructuredOutputsParams, tok, prefix: str = "") -> GrammarState:
    state = manager.new_state(params, [5], [tok.eos_token_id])
    state.wait(60)
    assert state.ready() and state.error is None
    for t in tok.encode(prefix, add_special_tokens=False):
        assert state.accept(t), prefix
    return state


def _xgrammar_masks(manager: StructuredOutputManager, states: list[GrammarState | None]) -> torch.Tensor:
    """Each matcher's own mask, filled one by one, with the manager's whitespace cap."""
    ref = torch.full((len(states), manager.num_words), -1, dtype=torch.int32)
    for i, state in enumerate(states):
        if state is not None and state.active:
            state.matcher.fill_next_token_bitmask(ref, i)
            if state.whitespace_capped:
                ref[i] &= manager._not_ws_mask
    return ref


def _allowed(row: torch.Tensor, vocab: int) -> np.ndarray:
    bits = np.unpackbits(row.numpy().view(np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(bits)


# ---------------------------------------------------------------------------------------------- thread knob


@pytest.mark.parametrize("bad", [0, -2, 1.5, "4", True])
def test_fill_threads_must_be_a_positive_integer(tok, bad) -> None:
    with pytest.raises(ValueError, match="fill_threads"):
        StructuredOutputManager(len(tok), lambda: tok, fill_threads=bad)
    m = StructuredOutputManager(len(tok), lambda: tok, fill_threads=3)
    assert m.fill_threads == 3
    with pytest.raises(ValueError, match="fill_threads"):
        m.fill_threads = bad
    m.fill_threads = 1
    assert m.fill_threads == 1


def test_fill_threads_default_and_environment(tok, monkeypatch) -> None:
    monkeypatch.delenv(FILL_THREADS_ENV, raising=False)
    assert default_fill_threads() == max(1, usable_cpus() // 2)
    assert StructuredOutputManager(len(tok), lambda: tok).fill_threads == max(1, usable_cpus() // 2)
    monkeypatch.setenv(FILL_THREADS_ENV, "7")
    assert StructuredOutputManager(len(tok), lambda: tok).fill_threads == 7
    for bad in ("0", "many", "-1"):
        monkeypatch.setenv(FILL_THREADS_ENV, bad)
        with pytest.raises(ValueError, match=FILL_THREADS_ENV):
            StructuredOutputManager(len(tok), lambda: tok)


def test_batch_fill_on_several_threads_equals_one_by_one(tok) -> None:
    """Enough rows for xgrammar's batch fill, in different places of different grammars, some inactive."""
    m = StructuredOutputManager(len(tok), lambda: tok, fill_threads=4, reuse_string_masks=False)
    prefixes = ['{"name": "ab', '{"name": "x", "tags": [', '{"name": "x", "tags": ["q"], "short": "ab', "", '{"n']
    states = [_ready(m, StructuredOutputsParams(json=OBJECT), tok, p) for p in prefixes * 3]
    states += [_ready(m, StructuredOutputsParams(regex="[a-z]+@[a-z]+"), tok, "ab"), None]
    bitmask = m.grammar_bitmask_async(states).result()
    assert bitmask.shape == (len(states), m.num_words)
    assert torch.equal(bitmask[:-1], _xgrammar_masks(m, states[:-1])) and (bitmask[-1] == -1).all()
    m.shutdown()


# ---------------------------------------------------------------------------------------------- mask reuse


def test_string_loop_rules_recognise_only_unconstrained_json_strings(tok) -> None:
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok)))

    def rules(**kw) -> list[str]:
        text = str(compiler.compile_grammar(build_grammar(StructuredOutputsParams(**kw))).grammar)
        lines = text.splitlines()
        return [lines[i].split(" ::= ")[0] for i in sorted(string_loop_rules(text))]

    assert rules(json=OBJECT) == ["basic_string_sub"]
    assert rules(json_object=True) == ["basic_string_sub"]
    assert rules(json={"type": "object", "properties": {"s": {"type": "string", "maxLength": 3}}}) == []
    assert rules(regex='"[a-z]*"') == [] and rules(choice=["a", "b"]) == []
    klass = r'[^\0-\x1f\"\\\ud800-\udfff]'
    good = f'root ::= "\\"" s\ns ::= (("\\"") | ({klass} s) | ("\\\\" e s))\ne ::= [n]'
    not_tail = f'root ::= "\\"" s\ns ::= (("\\"") | ({klass} s "x") | ("\\\\" e s))\ne ::= [n]'
    other_class = 'root ::= "\\"" s\ns ::= (("\\"") | ([a-z] s) | ("\\\\" e s))\ne ::= [n]'
    assert rules(grammar=good) == ["s"]
    assert rules(grammar=not_tail) == [] and rules(grammar=other_class) == []


def test_plain_string_tokens() -> None:
    vocab = [b"abc", b'a"', b"\\n", b"a\nb", b"\xc3", "é€😀".encode(), b"", b"\x7f ok", b"<eos>", b" "]
    flags = plain_string_tokens(vocab, len(vocab) + 2, special_ids=[8])
    assert list(flags) == [1, 0, 0, 0, 0, 1, 0, 1, 0, 1, 0, 0]


def _interesting(tok) -> np.ndarray:
    """Token ids whose text holds a quote, a backslash or a non-ASCII byte: where strings start, end, escape and
    split characters."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    return np.array([i for i, b in enumerate(info.decoded_vocab) if b'"' in b or b"\\" in b or max(b, default=0) > 127])


@pytest.mark.parametrize(
    "params",
    [
        StructuredOutputsParams(json=OBJECT),
        StructuredOutputsParams(json=RECORDS),
        StructuredOutputsParams(json_object=True),
        StructuredOutputsParams(json=OBJECT, disable_any_whitespace=True),
    ],
    ids=["object", "records", "json_object", "compact"],
)
def test_reused_masks_are_xgrammars_on_random_walks(manager, tok, params) -> None:
    """Rows walk their grammar with tokens drawn from their own masks (often a quote, a backslash or a split
    character); at every step the manager's masks (many reused) equal xgrammar's, row for row."""
    rng = np.random.default_rng(0)
    special = _interesting(tok)
    states = [_ready(manager, params, tok) for _ in range(12)]
    reused = 0
    for _ in range(70):
        live = [s if s.active else None for s in states]
        reused += sum(s is not None and s._mask_valid for s in live)
        bitmask = manager.grammar_bitmask_async(live).result()
        assert torch.equal(bitmask, _xgrammar_masks(manager, live))
        for i, state in enumerate(live):
            if state is None:
                continue
            allowed = _allowed(bitmask[i], len(tok))
            if len(allowed) > 1:  # keep walking rather than stop
                allowed = allowed[allowed != tok.eos_token_id]
            odd = np.intersect1d(allowed, special)
            pick = odd if len(odd) and rng.random() < 0.3 else allowed
            assert state.accept(int(pick[rng.integers(len(pick))]))
    assert reused > 50  # rows inside strings were not filled again


@pytest.mark.parametrize("schema", [OBJECT, RECORDS], ids=["object", "records"])
def test_skipped_plain_tokens_leave_the_matcher_where_xgrammar_would_be(manager, tok, schema) -> None:
    """Rows whose in-string plain tokens the matcher never sees (accept skips them at a known string boundary) give,
    step after step, the masks and accept results of twin xgrammar matchers that saw every token, through string
    ends, escapes and random rollbacks of 1-3 tokens."""
    import xgrammar as xgr

    rng = np.random.default_rng(1)
    special = _interesting(tok)
    params = StructuredOutputsParams(json=schema)
    states = [_ready(manager, params, tok) for _ in range(10)]
    compiled = states[0]._future.result()[0]
    twins = [xgr.GrammarMatcher(compiled, override_stop_tokens=[tok.eos_token_id]) for _ in states]
    skipped = 0
    for step in range(80):
        live = [s if s.active else None for s in states]
        bitmask = manager.grammar_bitmask_async(live).result()
        ref = torch.full_like(bitmask, -1)
        for i, (state, twin) in enumerate(zip(live, twins, strict=True)):
            if state is not None:
                twin.fill_next_token_bitmask(ref, i)
                if state.whitespace_capped:
                    ref[i] &= manager._not_ws_mask
        assert torch.equal(bitmask, ref), step
        for i, state in enumerate(live):
            if state is None:
                continue
            if step % 9 == 8 and state.num_accepted > 3:  # speculative decoding's rejected drafts
                n = int(rng.integers(1, 4))
                state.rollback(n)
                twins[i].rollback(n)
                continue
            allowed = _allowed(bitmask[i], len(tok))
            if len(allowed) > 1:
                allowed = allowed[allowed != tok.eos_token_id]
            odd = np.intersect1d(allowed, special)
            pick = odd if len(odd) and rng.random() < 0.15 else allowed
            token = int(pick[rng.integers(len(pick))])
            assert state.accept(token) == twins[i].accept_token(token)
            skipped += bool(state._skipped[-1]) if len(state._skipped) else 0
    assert skipped > 30  # many in-string tokens never reached the matcher


def test_reuse_ends_with_a_non_plain_token_and_with_rollback(manager, tok) -> None:
    state = _ready(manager, StructuredOutputsParams(json=OBJECT), tok, '{"name": "')
    word = tok.encode("hello", add_special_tokens=False)
    quote = tok.encode('"', add_special_tokens=False)
    assert len(quote) == 1
    for t in word:  # two fills at the string's character boundary with plain tokens between: learned
        manager.grammar_bitmask([state])
        assert state.accept(t)
    first = manager.grammar_bitmask([state]).clone()
    assert state._mask_valid
    assert state.accept(word[0]) and state._mask_valid
    assert torch.equal(manager.grammar_bitmask([state]), first)
    state.rollback(1)  # a token the matcher skipped: still at the boundary, the mask still known
    assert state._mask_valid
    assert torch.equal(manager.grammar_bitmask([state]), first) and state._mask_valid
    assert state.accept(quote[0]) and not state._mask_valid  # the string ended: filled again
    assert torch.equal(manager.grammar_bitmask([state]), _xgrammar_masks(manager, [state]))
    assert not torch.equal(manager.grammar_bitmask([state]), first)


def test_speculative_drafts_in_a_string_roll_back_to_the_same_mask(manager, tok) -> None:
    state = _ready(manager, StructuredOutputsParams(json=OBJECT), tok, '{"name": "')
    word = tok.encode("hello world", add_special_tokens=False)
    for t in word[:2]:
        manager.grammar_bitmask([state])
        assert state.accept(t)
    now = manager.grammar_bitmask([state]).clone()
    masks = manager.grammar_bitmask_spec([state], [word[2:] + tok.encode('"}', add_special_tokens=False)])
    assert torch.equal(masks[0], now[0])
    assert torch.equal(manager.grammar_bitmask([state]), now) and torch.equal(
        manager.grammar_bitmask([state]), _xgrammar_masks(manager, [state])
    )


def test_reuse_can_be_turned_off(tok, monkeypatch) -> None:
    monkeypatch.setenv(manager_mod.MASK_REUSE_ENV, "0")
    m = StructuredOutputManager(len(tok), lambda: tok)
    state = _ready(m, StructuredOutputsParams(json=OBJECT), tok, '{"name": "')
    for t in tok.encode("hello world", add_special_tokens=False):
        m.grammar_bitmask([state])
        assert state.accept(t) and not state._mask_valid
    m.shutdown()
