"""ChatOutput: streaming a choice piece by piece gives the message the whole text gives, in every tool mode and
with a reasoning parser; finish_reason becomes "tool_calls" when "auto" or "required" calls were made, stays "stop"
for a named function and "length" when max_tokens cut the choice."""

from __future__ import annotations

import json

import pytest

from pagedllm.entrypoints.openai.chat_output import ChatOutput
from pagedllm.entrypoints.openai.constraints import ToolPlan, required_schema
from pagedllm.entrypoints.openai.reasoning_parsers import get_reasoning_parser
from pagedllm.entrypoints.openai.tool_parsers import get_tool_parser

PARAMS = {"f": {"type": "object"}, "g": {"type": "object"}}


def _stream(out: ChatOutput, text: str, finish: str, size: int) -> tuple[dict, str]:
    content, reasoning, calls = "", "", {}
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    deltas = [out.delta(p) for p in pieces]
    last, reason = out.finish(finish)
    for d in [*deltas, last]:
        content += d.get("content", "")
        reasoning += d.get("reasoning_content", "")
        for t in d.get("tool_calls", []):
            call = calls.setdefault(t["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in t:
                call["id"], call["name"] = t["id"], t["function"]["name"]
            call["arguments"] += t["function"]["arguments"]
    message = {
        "content": content or None,
        "reasoning_content": reasoning or None,
        "calls": [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())],
    }
    return message, reason


def _final(out: ChatOutput, text: str, finish: str) -> tuple[dict, str]:
    message, reason = out.final(text, finish)
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]
    return {
        "content": message["content"],
        "reasoning_content": message["reasoning_content"],
        "calls": calls,
    }, reason


CASES = [
    # (plan, reasoning parser, tool parser, text, finish, expected finish, number of calls)
    (ToolPlan(), None, None, "plain answer", "stop", "stop", 0),
    (ToolPlan(mode="named", named="f"), None, None, '{"x": [1, 2]}', "stop", "stop", 1),
    (
        ToolPlan(mode="required", parameters=PARAMS),
        None,
        None,
        '[{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"a": 1}}]',
        "stop",
        "tool_calls",
        2,
    ),
    (ToolPlan(mode="required", parameters=PARAMS), None, None, '[{"name": "f", "argu', "length", "length", 0),
    (
        ToolPlan(mode="required", parameters=PARAMS),
        None,
        None,
        '[{"name": "f", "arguments": {"a": [1]}}, {"name": "g", "arguments": {"b"',
        "length",
        "length",
        1,
    ),
    (
        ToolPlan(mode="auto", parallel=False),
        None,
        "hermes",
        '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "g", "arguments": {}}\n'
        "</tool_call>",
        "stop",
        "tool_calls",
        1,
    ),
    (
        ToolPlan(mode="auto"),
        None,
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"q": "x"}}\n</tool_call>',
        "stop",
        "tool_calls",
        1,
    ),
    (ToolPlan(mode="auto"), None, "hermes", "<tool_call>\n{not json}\n</tool_call>", "stop", "stop", 0),
    (ToolPlan(), "deepseek_r1", None, "thinking hard</think>\n\nthe answer", "stop", "stop", 0),
    (
        ToolPlan(mode="auto"),
        "qwen3",
        "hermes",
        '<think>use f</think>\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
        "stop",
        "tool_calls",
        1,
    ),
    (
        ToolPlan(mode="named", named="g"),
        "qwen3",
        None,
        '<think>hm</think>{"k": true}',
        "stop",
        "stop",
        1,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
@pytest.mark.parametrize("size", [1, 3, 1000])
def test_streaming_gives_the_final_message(case, size: int) -> None:
    plan, reasoning, tools, text, finish, want_finish, num_calls = case
    r_cls = get_reasoning_parser(reasoning) if reasoning else None
    t_cls = get_tool_parser(tools) if tools else None
    final, final_reason = _final(ChatOutput(plan, r_cls, t_cls), text, finish)
    streamed, stream_reason = _stream(ChatOutput(plan, r_cls, t_cls), text, finish, size)
    assert streamed == final
    assert final_reason == stream_reason == want_finish
    assert len(final["calls"]) == num_calls
    if plan.mode in ("named", "required"):
        assert final["content"] is None  # the constrained text is calls, never content


def test_required_schema_lists_one_variant_per_tool() -> None:
    schema = required_schema(PARAMS, parallel=False)
    assert schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [v["properties"]["name"]["enum"] for v in schema["items"]["anyOf"]] == [["f"], ["g"]]
    assert "maxItems" not in required_schema({"f": {"type": "object"}}, parallel=True)
