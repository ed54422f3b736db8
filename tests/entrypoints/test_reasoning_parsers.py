"""Reasoning parsers: each model family's cases, and streaming agreeing with the whole-output split under
any split of the output (every character, random splits, random outputs built from markers and text)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.entrypoints.openai.reasoning_parsers import REASONING_PARSERS, get_reasoning_parser
from pagedllm.entrypoints.openai.tool_parsers import DeltaMessage

# (model output, reasoning_content, content) where both parsers agree
COMMON = [
    ("I think.</think>\n\nAnswer.", "I think.", "Answer."),
    ("<think>\nI think.\n</think>\n\nAnswer.", "\nI think.\n", "Answer."),
    ("<think>still", "still", None),
    ("</think>Answer", None, "Answer"),
    ("", None, None),
    ("<think>", None, None),
    ("<think></think>\n\n", None, None),
    ("reason</think>", "reason", None),
    ("a</think>b</think>c", "a", "b</think>c"),
    ("x <think> y</think>z", "x <think> y", "z"),
    ("r</think>\n \nx\n", "r", " \nx\n"),
    ("<think>a</thin</think>b", "a</thin", "b"),
    ("<<think>a</think>b", "<<think>a", "b"),
]
CASES = {
    "deepseek_r1": COMMON
    + [
        ("still thinking", "still thinking", None),
        ("\n\nstill thinking", "\n\nstill thinking", None),
        ("<thi", "<thi", None),
        ("r</thi", "r</thi", None),
    ],
    "qwen3": COMMON
    + [
        ("Hello", None, "Hello"),
        ("\n\nHello", None, "\n\nHello"),
        ("<thi", None, "<thi"),
        ("a </thin", None, "a </thin"),
        ("<think>\nhmm </thi", "\nhmm </thi", None),
    ],
}
ALL_CASES = [(name, *case) for name, cases in CASES.items() for case in cases]
FRAGMENTS = ["<think>", "</think>", "<th", "</thi", "<", ">", "/", "think", "a", " ", "\n"]


def _stream(parser_name: str, pieces: list[str]) -> tuple[str, str]:
    parser = get_reasoning_parser(parser_name)()
    deltas = [parser.extract_reasoning_streaming(p) for p in pieces] + [parser.finish_streaming()]
    assert parser.finish_streaming() is None
    reasoning = content = ""
    for delta in deltas:
        if delta is None:
            continue
        assert isinstance(delta, DeltaMessage) and (delta.content or delta.reasoning_content), "empty delta"
        assert not delta.tool_calls
        reasoning += delta.reasoning_content or ""
        content += delta.content or ""
    return reasoning, content


def _assert_stream_matches(parser_name: str, text: str, pieces: list[str]) -> None:
    assert "".join(pieces) == text
    reasoning, content = get_reasoning_parser(parser_name)().extract_reasoning(text)
    assert _stream(parser_name, pieces) == (reasoning or "", content or "")


def _split(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted({c % (len(text) + 1) for c in cuts}), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize(("parser_name", "text", "reasoning", "content"), ALL_CASES)
def test_extract_reasoning(parser_name: str, text: str, reasoning: str | None, content: str | None) -> None:
    assert get_reasoning_parser(parser_name)().extract_reasoning(text) == (reasoning, content)


@pytest.mark.parametrize(("parser_name", "text", "reasoning", "content"), ALL_CASES)
def test_streaming_every_character(
    parser_name: str, text: str, reasoning: str | None, content: str | None
) -> None:
    _assert_stream_matches(parser_name, text, list(text))
    _assert_stream_matches(parser_name, text, [text])


@settings(max_examples=50, deadline=None)
@given(case=st.sampled_from(ALL_CASES), cuts=st.lists(st.integers(min_value=0, max_value=100), max_size=10))
def test_streaming_random_splits(case: tuple, cuts: list[int]) -> None:
    _assert_stream_matches(case[0], case[1], _split(case[1], cuts))


@pytest.mark.parametrize("parser_name", sorted(CASES))
@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_streaming_random_outputs(parser_name: str, data: st.DataObject) -> None:
    text = "".join(data.draw(st.lists(st.sampled_from(FRAGMENTS), max_size=12), label="fragments"))
    cuts = data.draw(st.lists(st.integers(min_value=0, max_value=len(text)), max_size=10), label="cuts")
    _assert_stream_matches(parser_name, text, _split(text, cuts))


def _sent(parser_name: str, pieces: list[str]) -> list[tuple[str | None, str | None]]:
    parser = get_reasoning_parser(parser_name)()
    deltas = [parser.extract_reasoning_streaming(p) for p in pieces]
    return [(d.reasoning_content, d.content) for d in deltas if d is not None]


def test_deepseek_r1_streams_reasoning_at_once() -> None:
    pieces = ["<think>", "\nLet", " me", " think", ".</", "think", ">\n\n", "Hi", "!"]
    assert _sent("deepseek_r1", pieces) == [
        ("\nLet", None),
        (" me", None),
        (" think", None),
        (".", None),
        (None, "Hi"),
        (None, "!"),
    ]


def test_qwen3_holds_text_without_think_until_it_can_tell() -> None:
    # The output may be reasoning (the template opened <think>) or content (thinking off): held until told.
    assert _sent("qwen3", ["Let", " me", " think", "</think>", "\n\nHi", "!"]) == [
        ("Let me think", None),
        (None, "Hi"),
        (None, "!"),
    ]
    parser = get_reasoning_parser("qwen3")()
    assert parser.extract_reasoning_streaming("Hello") is None
    final = parser.finish_streaming()
    assert final is not None and (final.reasoning_content, final.content) == (None, "Hello")
    # With an explicit <think> it is reasoning from the start.
    assert _sent("qwen3", ["<think>", "Let", " me"]) == [("Let", None), (" me", None)]


@pytest.mark.parametrize("parser_name", sorted(REASONING_PARSERS))
def test_is_reasoning_end(parser_name: str) -> None:
    parser = get_reasoning_parser(parser_name)()
    assert not parser.is_reasoning_end("<think>still thinking </thin")
    assert parser.is_reasoning_end("<think>done</think>")
    assert parser.is_reasoning_end("done</think>\n\nThe answer")


def test_misuse_and_registry() -> None:
    parser = get_reasoning_parser("deepseek_r1")()
    assert parser.extract_reasoning_streaming("") is None
    assert parser.finish_streaming() is None
    with pytest.raises(RuntimeError):
        parser.extract_reasoning_streaming("x")
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3"}
    for name, cls in REASONING_PARSERS.items():
        assert get_reasoning_parser(name) is cls and cls.name == name
    assert (cls.start_token, cls.end_token) == ("<think>", "</think>")
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        get_reasoning_parser("nope")
