"""/v1/responses through the official openai client against `pagedllm serve` (the session's tiny model): the same
answer as the chat completion of the same conversation, streaming events that add up to the final response,
previous_response_id from the bounded store, function tools, text.format json_schema, and 400s naming the field."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from pagedllm.entrypoints.openai.serving_responses import ResponseStore, assistant_turn, input_messages

UNIT = {
    "type": "object",
    "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "days": {"enum": [1, 2, 3]}},
    "required": ["unit", "days"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather forecast", "parameters": UNIT}


def chat_text(client, model, messages, max_tokens):
    out = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0)
    return out.choices[0].message.content, out.usage


def stream_events(client, **kw):
    return list(client.responses.create(stream=True, **kw))


def test_text_response_matches_chat(client, model):
    r = client.responses.create(
        model=model, input="Hello there", instructions="Be brief.", max_output_tokens=8, temperature=0
    )
    text, usage = chat_text(
        client,
        model,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
        8,
    )
    assert r.object == "response" and r.id.startswith("resp_")
    assert [item.type for item in r.output] == ["message"]
    assert r.output_text == text
    assert r.usage.input_tokens == usage.prompt_tokens and r.usage.output_tokens == usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if usage.completion_tokens == 8:
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed"
    assert r.instructions == "Be brief." and r.max_output_tokens == 8
    # Message items as input, with text parts, are the same conversation.
    r2 = client.responses.create(
        model=model,
        input=[
            {"role": "developer", "content": "Be brief."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello there"}]},
        ],
        max_output_tokens=8,
        temperature=0,
    )
    assert r2.output_text == text


def test_streaming_events_add_up_to_the_response(client, model):
    kw = dict(model=model, input="Tell me a story", max_output_tokens=10, temperature=0)
    full = client.responses.create(**kw)
    events = stream_events(client, **kw)
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert {"response.output_item.added", "response.content_part.added", "response.output_text.delta",
            "response.output_text.done", "response.content_part.done", "response.output_item.done"} <= set(types)  # fmt: skip
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    [done] = [e for e in events if e.type == "response.output_text.done"]
    final = events[-1].response
    assert deltas == done.text == final.output_text == full.output_text
    assert final.status == full.status and final.usage.output_tokens == full.usage.output_tokens
    assert final.usage.input_tokens == full.usage.input_tokens
    assert events[0].response.status == "in_progress" and events[0].response.output == []


def test_previous_response_id_continues_the_conversation(client, model):
    first = client.responses.create(model=model, input="My name is Ada.", max_output_tokens=5, temperature=0)
    second = client.responses.create(
        model=model,
        previous_response_id=first.id,
        input="What is my name?",
        max_output_tokens=5,
        temperature=0,
    )
    text, usage = chat_text(
        client,
        model,
        [
            {"role": "user", "content": "My name is Ada."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "What is my name?"},
        ],
        5,
    )
    assert second.previous_response_id == first.id
    assert second.output_text == text and second.usage.input_tokens == usage.prompt_tokens
    assert client.responses.retrieve(first.id).output_text == first.output_text
    # Streamed responses are stored too.
    events = stream_events(
        client, model=model, previous_response_id=second.id, input="Again", max_output_tokens=3
    )
    assert client.responses.retrieve(events[-1].response.id).id == events[-1].response.id

    unstored = client.responses.create(model=model, input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model, previous_response_id=unstored.id, input="y", max_output_tokens=2)
    assert e.value.param == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_function_tools(client, model):
    # One call (parallel_tool_calls false), so that the constrained list ends within the token limit.
    kw = dict(
        model=model,
        input="Weather?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=150,
    )
    r = client.responses.create(temperature=0, **kw)
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and r.status == "completed", r.output
    for call in calls:
        assert call.name == "get_weather" and call.call_id and call.id.startswith("fc_")
        jsonschema.validate(json.loads(call.arguments), UNIT)

    events = stream_events(client, temperature=0, **kw)
    final = events[-1].response
    streamed_calls = [item for item in final.output if item.type == "function_call"]
    assert [(c.name, c.arguments) for c in streamed_calls] == [(c.name, c.arguments) for c in calls]
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == "".join(c.arguments for c in calls)
    assert "response.function_call_arguments.done" in {e.type for e in events}

    # A named function: exactly that call.
    named = client.responses.create(
        temperature=0, **{**kw, "tool_choice": {"type": "function", "name": "get_weather"}}
    )
    [call] = [item for item in named.output if item.type == "function_call"]
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), UNIT)


def test_text_format_json_schema(client, model):
    """The constraint of chat's response_format: the same text as chat; JSON for the schema once complete."""
    for schema in (UNIT, {"enum": ["yes", "no"]}):
        r = client.responses.create(
            model=model,
            input="Forecast as JSON",
            text={"format": {"type": "json_schema", "name": "forecast", "schema": schema, "strict": True}},
            max_output_tokens=60,
            temperature=0,
        )
        chat = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Forecast as JSON"}],
            response_format={"type": "json_schema", "json_schema": {"name": "forecast", "schema": schema}},
            max_tokens=60,
            temperature=0,
        )
        assert r.output_text == chat.choices[0].message.content
        assert r.text.format.type == "json_schema"
        if r.status == "completed":
            jsonschema.validate(json.loads(r.output_text), schema)
    # The tiny random model pads JSON with whitespace; a bare enum leaves it none, so it completes.
    assert r.status == "completed"


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"input": 5}, "input"),
        ({"input": []}, "input"),
        ({"input": [{"role": "wizard", "content": "x"}]}, "input[0].role"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
    ],
)
def test_bad_fields_are_400s_naming_them(client, model, fields, param):
    body = {"model": model, "input": "hi", "max_output_tokens": 2, **fields}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**body)
    assert e.value.param == param, e.value.message


# ------------------------------------------------------------------------------------ without a server


def test_store_keeps_the_most_recently_used():
    store = ResponseStore(max_size=2)
    for name in ("a", "b"):
        store.put({"id": name}, [])
    assert store.get("a") is not None  # a is now the most recently used
    store.put({"id": "c"}, [])
    assert len(store) == 2 and store.get("b") is None and store.get("a") and store.get("c")
    none = ResponseStore(max_size=0)
    none.put({"id": "a"}, [])
    assert none.get("a") is None


def test_input_items_become_chat_turns():
    messages = input_messages(
        [
            {"role": "user", "content": "weather?"},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        ]
    )
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["c1", "c2"]
    turn = assistant_turn(
        [
            {"type": "message", "content": [{"type": "output_text", "text": "hi"}]},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        ]
    )
    assert turn["content"] == "hi" and turn["tool_calls"][0]["function"]["name"] == "f"


TOOL_TEXT = 'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize("piece", [1, 3, 1000])
@pytest.mark.parametrize(
    "text, reasoning_parser, types",
    [
        (TOOL_TEXT, None, ["message", "function_call"]),
        (
            "<think>Paris is in France.</think>" + TOOL_TEXT,
            "deepseek_r1",
            ["reasoning", "message", "function_call"],
        ),
        ("<think>Short.</think>Answer.", "deepseek_r1", ["reasoning", "message"]),
    ],
)
def test_streamed_items_equal_the_whole_text_items(piece, text, reasoning_parser, types):
    """Reasoning, text and a Hermes tool call, streamed in pieces of ``piece`` characters: the events open and
    close each item in order, and the finished items equal those of the whole text."""
    from pagedllm.entrypoints.openai.chat_output import ChatOutput
    from pagedllm.entrypoints.openai.constraints import ToolPlan
    from pagedllm.entrypoints.openai.reasoning_parsers import get_reasoning_parser
    from pagedllm.entrypoints.openai.serving_responses import _EventWriter, output_items
    from pagedllm.entrypoints.openai.tool_parsers import get_tool_parser

    plan = ToolPlan(mode="auto", tools=[WEATHER], parameters={"get_weather": UNIT})
    tools = get_tool_parser("hermes")
    reasoning = get_reasoning_parser(reasoning_parser) if reasoning_parser else None
    message, _ = ChatOutput(plan, reasoning, tools).final(text, "stop")
    whole = output_items(message, "completed")

    streaming = ChatOutput(plan, reasoning, tools)
    writer = _EventWriter("resp_x")
    chunks = []
    for i in range(0, len(text), piece):
        chunks += writer.delta(streaming.delta(text[i : i + piece]))
    last, _ = streaming.finish("stop")
    chunks += writer.delta(last)
    chunks += writer.close_all("completed")
    events = [json.loads(c.split("data: ", 1)[1]) for c in chunks]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert added == [d["type"] for d in done] == [item["type"] for item in whole] == types

    def strip_ids(items):
        return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]

    assert strip_ids(writer.output) == strip_ids(done) == strip_ids(whole)
    if "function_call" in types:
        assert json.loads(whole[-1]["arguments"]) == {"city": "Paris"}
    if reasoning_parser:
        deltas = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
        assert deltas == whole[0]["content"][0]["text"] == message["reasoning_content"]
