"""Tool-call parsers: each format's cases, and the streaming contract: under any split of an output (every
character, random splits, random outputs built from the format's pieces) the streamed deltas reassemble to
the non-streaming result."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    DeltaMessage,
    ExtractedToolCalls,
    ToolCall,
    get_tool_parser,
)

W = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
CASES: dict[str, list[tuple[str, str | None, list[tuple[str, dict]]]]] = {
    # (model output, content, calls). No calls: tools_called is False and the content is the whole output.
    "hermes": [
        ("Hello, world!", "Hello, world!", []),
        ("", None, []),
        (
            f"Let me check.\n\n<tool_call>\n{W}\n</tool_call>",
            "Let me check.",
            [("get_weather", {"city": "Paris"})],
        ),
        (
            f"<tool_call>\n{W}\n</tool_call>\n"
            '<tool_call>\n{"name": "f", "arguments": {"x": [1, {"y": null}]}}\n</tool_call>',
            None,
            [("get_weather", {"city": "Paris"}), ("f", {"x": [1, {"y": None}]})],
        ),
        ('<tool_call>{"name": "now"}</tool_call>', None, [("now", {})]),
        ('<tool_call>{"name": "f", "parameters": {"a": 1}}</tool_call>', None, [("f", {"a": 1})]),
        ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', None, [("f", {"a": 1})]),
        (
            '<tool_call>{"name": "f", "arguments": {"city": "Zürich"}}</tool_call>',
            None,
            [("f", {"city": "Zürich"})],
        ),
        (f"Sure <tool_call>\n{W}\n", "Sure", [("get_weather", {"city": "Paris"})]),  # unterminated, complete
        (f"<tool_call>{W}</tool_call>\nDone, thanks.", None, [("get_weather", {"city": "Paris"})]),
        ("\n  Sure:\n<tool_call>" + W + "</tool_call>", "\n  Sure:", [("get_weather", {"city": "Paris"})]),
        ("  \n<tool_call>" + W + "</tool_call>", None, [("get_weather", {"city": "Paris"})]),
        # malformed: the whole output is content
        ('Hi <tool_call>\n{"name": "get_weather", "arguments": {"ci', None, []),
        (f"<tool_call>{W}</tool_call><tool_call>{{bad json}}</tool_call>", None, []),
        ('<tool_call>{"name": 3, "arguments": {}}</tool_call>', None, []),
        ('<tool_call>{"name": "", "arguments": {}}</tool_call>', None, []),
        ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', None, []),
        ('<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>', None, []),
        ("<tool_call>[1, 2]</tool_call>", None, []),
        (f"<tool_call>{W}</tool_call><tool_call>", None, []),
        ("if a < b and <tool", None, []),
        ("closing </tool_call> only", None, []),
    ],
    "llama3_json": [
        (
            '{"name": "get_weather", "parameters": {"city": "Paris"}}',
            None,
            [("get_weather", {"city": "Paris"})],
        ),
        ('<|python_tag|>{"name": "f", "parameters": {"a": 1}}', None, [("f", {"a": 1})]),
        (
            '\n <|python_tag|> {"name": "f", "arguments": {"a": 1}}; {"name": "g", "parameters": {}} \n',
            None,
            [("f", {"a": 1}), ("g", {})],
        ),
        ('{"name": "f"};{"name": "g", "parameters": {"b": [true]}}', None, [("f", {}), ("g", {"b": [True]})]),
        ("The weather is nice.", None, []),
        ("   ", None, []),
        ("", None, []),
        ('{"name": "f", "parameters": {}} and more text', None, []),
        ('{"answer": 42}', None, []),
        ('{"name": "f", "parameters": {', None, []),
        ('{"name": "f", "parameters": {}};', None, []),
        ('{"name": "f", "parameters": {}}; hello', None, []),
        ('<|python_tag|>brave_search.call(query="x")', None, []),
        ("<|python", None, []),
        ('Answer: {"name": "f", "parameters": {}}', None, []),
    ],
    "mistral": [
        (f"[TOOL_CALLS][{W}]", None, [("get_weather", {"city": "Paris"})]),
        (
            'Sure.\n[TOOL_CALLS] [{"name": "a", "arguments": {}}, '
            '{"name": "b", "arguments": {"x": [1, 2]}}]\n',
            "Sure.",
            [("a", {}), ("b", {"x": [1, 2]})],
        ),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', None, [("get_weather", {"city": "Paris"})]),
        ('Ok [TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{}', "Ok", [("f", {"a": 1}), ("g", {})]),
        ('[TOOL_CALLS]f[ARGS]{"q": "[TOOL_CALLS]x"}', None, [("f", {"q": "[TOOL_CALLS]x"})]),
        ('[TOOL_CALLS]{"name": "f", "arguments": {}}', None, [("f", {})]),
        ("Just text, no tools.", None, []),
        ('[TOOL_CALLS][{"name": "f", "arguments": {', None, []),
        ('[TOOL_CALLS]f[ARGS]{"a": 1} trailing', None, []),
        ("[TOOL_CALLS]f[ARGS][1]", None, []),
        ("[TOOL_CALLS]", None, []),
        ("[TOOL_CALLS][]", None, []),
        ("text [TOOL_CAL", None, []),
    ],
    "pythonic": [
        (
            '[get_weather(city="SF", days=3), lookup(q=\'x\', opts={"a": [1, 2]}, flag=True, none=None)]',
            None,
            [
                ("get_weather", {"city": "SF", "days": 3}),
                ("lookup", {"q": "x", "opts": {"a": [1, 2]}, "flag": True, "none": None}),
            ],
        ),
        ("[f()]", None, [("f", {})]),
        ("<|python_start|>[f(a=(1, 2), b=-1.5)]<|python_end|>", None, [("f", {"a": [1, 2], "b": -1.5})]),
        ('  [f (x="é")]\n', None, [("f", {"x": "é"})]),
        ("Hello", None, []),
        ("", None, []),
        ("[link](http://x.org) is a link", None, []),
        ("[f(1)]", None, []),
        ("[f(a=x)]", None, []),
        ("[f(a={1, 2})]", None, []),
        ("[f(a=1e999)]", None, []),
        ("[f(a=1)] trailing", None, []),
        ("[]", None, []),
        ("[f(a=1), 3]", None, []),
        ("[f(**k)]", None, []),
        ("[obj.method(a=1)]", None, []),
        ("[f(a=1, a=2)]", None, []),
        ("[f(a=1)", None, []),
        ("<|python_st", None, []),
    ],
}
ALL_CASES = [(name, *case) for name, cases in CASES.items() for case in cases]

# Pieces that random outputs are built from: whole calls, markers and their prefixes, JSON and text.
FRAGMENTS = {
    "hermes": [
        f"<tool_call>\n{W}\n</tool_call>\n",
        "<tool_call>",
        "</tool_call>",
        "<tool",
        W,
        '{"name": "f"}',
        "{",
        "hi",
        " ",
        "\n",
    ],
    "llama3_json": [
        "<|python_tag|>",
        "<|py",
        W,
        '{"name": "f", "parameters": {}}',
        "; ",
        ";",
        "{",
        "x",
        " ",
        "\n",
    ],
    "mistral": [
        '[TOOL_CALLS]f[ARGS]{"a": 1}',
        f"[TOOL_CALLS][{W}]",
        "[TOOL_CALLS]",
        "[TOOL",
        "f[ARGS]",
        "[ARGS]",
        "{}",
        '{"a": 1}',
        f"[{W}]",
        W,
        "[",
        "x",
        " ",
    ],
    "pythonic": [
        "[f(a=1)]",
        "[f(a=1), g(b='x', c=(1, 2))]",
        "[",
        "]",
        "f(",
        "g (",
        ")",
        "a=1",
        ", ",
        "<|python_start|>",
        "<|python_end|>",
        "<|py",
        " ",
        "x",
    ],
}


def _call_tuples(calls: list[ToolCall]) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def _stream(parser_name: str, pieces: list[str]) -> tuple[str, list[ToolCall]]:
    """Feed ``pieces``; returns the streamed content and the calls reassembled per index."""
    parser = get_tool_parser(parser_name)()
    deltas = [parser.extract_tool_calls_streaming(p) for p in pieces] + [parser.finish_streaming()]
    assert parser.finish_streaming() is None
    content, calls = "", []
    for delta in deltas:
        if delta is None:
            continue
        assert isinstance(delta, DeltaMessage) and (delta.content or delta.tool_calls), "empty delta"
        assert delta.reasoning_content is None
        content += delta.content or ""
        for tc in delta.tool_calls:
            if tc.index == len(calls):  # a call's first delta: id and name, no arguments
                assert tc.id and tc.name and tc.arguments == ""
                calls.append(ToolCall(id=tc.id, name=tc.name, arguments=""))
            else:
                assert tc.index == len(calls) - 1 and tc.id is None and tc.name is None
                calls[tc.index].arguments += tc.arguments
    return content, calls


def _assert_stream_matches(parser_name: str, text: str, pieces: list[str]) -> None:
    assert "".join(pieces) == text
    expected = get_tool_parser(parser_name)().extract_tool_calls(text)
    content, calls = _stream(parser_name, pieces)
    assert content == (expected.content or "")
    assert _call_tuples(calls) == _call_tuples(expected.tool_calls)
    assert len({c.id for c in calls}) == len(calls)


def _split(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted({c % (len(text) + 1) for c in cuts}), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize(("parser_name", "text", "content", "calls"), ALL_CASES)
def test_extract_tool_calls(parser_name: str, text: str, content: str | None, calls: list) -> None:
    result = get_tool_parser(parser_name)().extract_tool_calls(text)
    assert isinstance(result, ExtractedToolCalls)
    assert result.tools_called == bool(calls)
    assert _call_tuples(result.tool_calls) == calls
    # A tool-call answer has the expected content; anything else is the whole output, unchanged.
    assert result.content == (content if calls else (text or None))
    for call in result.tool_calls:
        pattern = r"[A-Za-z0-9]{9}" if parser_name == "mistral" else r"chatcmpl-tool-[0-9a-f]{24}"
        assert re.fullmatch(pattern, call.id)
        assert call.arguments == json.dumps(json.loads(call.arguments), ensure_ascii=False)
    assert len({c.id for c in result.tool_calls}) == len(result.tool_calls)


@pytest.mark.parametrize(("parser_name", "text", "content", "calls"), ALL_CASES)
def test_streaming_every_character(parser_name: str, text: str, content: str | None, calls: list) -> None:
    _assert_stream_matches(parser_name, text, list(text))
    _assert_stream_matches(parser_name, text, [text])


@settings(max_examples=50, deadline=None)
@given(case=st.sampled_from(ALL_CASES), cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12))
def test_streaming_random_splits(case: tuple, cuts: list[int]) -> None:
    parser_name, text = case[0], case[1]
    _assert_stream_matches(parser_name, text, _split(text, cuts))


@pytest.mark.parametrize("parser_name", sorted(FRAGMENTS))
@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_streaming_random_outputs(parser_name: str, data: st.DataObject) -> None:
    text = "".join(
        data.draw(st.lists(st.sampled_from(FRAGMENTS[parser_name]), max_size=10), label="fragments")
    )
    cuts = data.draw(st.lists(st.integers(min_value=0, max_value=len(text)), max_size=10), label="cuts")
    _assert_stream_matches(parser_name, text, _split(text, cuts))


@pytest.mark.parametrize(
    ("parser_name", "text", "early"),
    [
        ("hermes", "Let me check the weather. <tool_c", "Let me check the weather."),
        ("hermes", "Plain answer, streamed as it comes", "Plain answer, streamed as it comes"),
        ("mistral", "Calling a tool \n[TOOL_CALLS]f[ARGS]{", "Calling a tool"),
        ("llama3_json", "Not a call, streamed at once", "Not a call, streamed at once"),
        ("llama3_json", '  {"name": "f", "parameters": {}}', ""),
        ("pythonic", "[link](http://x.org)", "[link](http://x.org)"),
        ("pythonic", "[get_weather(city=", ""),
    ],
)
def test_content_streams_before_the_end(parser_name: str, text: str, early: str) -> None:
    parser = get_tool_parser(parser_name)()
    sent = "".join((d.content or "") for d in map(parser.extract_tool_calls_streaming, text) if d is not None)
    assert sent == early


def test_calls_are_sent_at_the_end_with_fresh_ids() -> None:
    parser = get_tool_parser("hermes")()
    text = f"<tool_call>{W}</tool_call>\n<tool_call>{W}</tool_call>"
    assert parser.extract_tool_calls_streaming(text) is None  # a later call could still be malformed
    final = parser.finish_streaming()
    assert final is not None and final.content is None
    assert [(d.index, d.name, d.arguments) for d in final.tool_calls] == [
        (0, "get_weather", ""),
        (0, None, '{"city": "Paris"}'),
        (1, "get_weather", ""),
        (1, None, '{"city": "Paris"}'),
    ]
    assert final.tool_calls[0].id != final.tool_calls[2].id
    with pytest.raises(RuntimeError):
        parser.extract_tool_calls_streaming("more")


def test_empty_pieces_and_empty_output() -> None:
    for name in TOOL_PARSERS:
        parser = get_tool_parser(name)()
        assert parser.extract_tool_calls_streaming("") is None
        assert parser.finish_streaming() is None


def test_registry() -> None:
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral", "pythonic"}
    for name, cls in TOOL_PARSERS.items():
        assert get_tool_parser(name) is cls and cls.name == name
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral, pythonic"):
        get_tool_parser("nope")
