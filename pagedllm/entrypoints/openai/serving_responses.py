"""POST /v1/responses and GET /v1/responses/{id}: OpenAI's Responses API over the chat machinery.

A request becomes a chat conversation: ``instructions`` (a system turn, not carried to later responses), the turns
stored under ``previous_response_id`` (its input and output), then ``input`` (a string, or message,
``function_call`` and ``function_call_output`` items). Function ``tools``, ``tool_choice``, ``text.format`` and
the sampling fields map onto their chat counterparts, so tool calls are parsed and output constrained exactly as
in chat completions; a 400 names the Responses field (``input[0].content``, ``text.format``,
``max_output_tokens``).

The output is a list of items: a ``reasoning`` item when the server has a reasoning parser and the model reasoned,
a ``message`` with one ``output_text`` part when there is text, and one ``function_call`` per tool call. Status
``incomplete`` (``incomplete_details.reason`` "max_output_tokens") when the token limit cut the answer.

Streaming sends OpenAI's events, each ``event: <type>`` + ``data: {...}`` with a growing ``sequence_number``:
``response.created``, ``response.in_progress``, then per item ``response.output_item.added``, its deltas
(``response.content_part.added`` / ``response.output_text.delta`` / ``.done`` / ``response.content_part.done``,
``response.function_call_arguments.delta`` / ``.done``, ``response.reasoning_text.delta`` / ``.done``) and
``response.output_item.done``, and last ``response.completed`` (or ``response.incomplete``) with the whole
response, which equals the non-streamed one. An engine error mid-stream is an ``error`` event.

Responses with ``store`` (the default) are kept in memory, least recently used dropped first past
``--responses-store-size``; only they can be a ``previous_response_id`` or be retrieved.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedllm.engine.async_llm import RequestStream
from pagedllm.engine.output_processor import RequestTimeline
from pagedllm.entrypoints.openai.chat_output import ChatOutput
from pagedllm.entrypoints.openai.constraints import (
    ToolPlan,
    check_no_conflict,
    plan_tools,
    structured_outputs_from_request,
)
from pagedllm.entrypoints.openai.errors import OpenAIError, bad_request, from_validation_error
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ResponsesRequest,
)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_engine import (
    SSEResponse,
    mark_first_output,
    to_openai_error,
    wait_or_disconnect,
)
from pagedllm.sampling_params import RequestOutputKind

DEFAULT_RESPONSES_STORE_SIZE = 1000

# Chat field names (in the errors of the chat helpers) -> the Responses request's names.
_PARAM_NAMES = {
    "messages": "input",
    "response_format": "text.format",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseStore:
    """Stored responses by id, with the conversation each one continues: a bounded LRU (``max_size`` 0 keeps
    none). One per server; used from the event loop only."""

    def __init__(self, max_size: int = DEFAULT_RESPONSES_STORE_SIZE) -> None:
        if max_size < 0:
            raise ValueError(f"max_size must be >= 0, got {max_size}")
        self.max_size = max_size
        self._entries: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        """Keep ``response`` and ``conversation`` (chat messages: its context, input and output, without its
        instructions); the least recently used entry goes when the store is full."""
        if self.max_size == 0:
            return
        self._entries[response["id"]] = (response, conversation)
        self._entries.move_to_end(response["id"])
        while len(self._entries) > self.max_size:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry


def _rename_param(err: OpenAIError) -> OpenAIError:
    """A chat helper's 400 with the field named as the Responses request names it."""
    param = err.param
    if param is None:
        return err
    m = re.match(r"([A-Za-z_]\w*)(.*)", param)
    root, rest = (m.group(1), m.group(2)) if m else (param, "")
    if root == "messages":
        new = "input"  # the chat turns are built from instructions, history and input: no index carries over
    elif root in _PARAM_NAMES:
        new = _PARAM_NAMES[root] + rest
    elif root == "tools":
        new = param.replace(".function.", ".", 1)
    else:
        return err
    err.message = err.message.replace(param, new, 1) if param in err.message else err.message
    err.param = new
    return err


def _text_of(content: Any, param: str) -> str:
    """A message item's content (a string or text parts) as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{param} must be a string or a list of text parts", param)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(
                f"{param}[{j}]: only text parts (input_text, output_text) are supported, got {kind!r}",
                f"{param}[{j}].type",
            )
        if not isinstance(part.get("text"), str):
            raise bad_request(f"{param}[{j}].text must be a string", f"{param}[{j}].text")
        texts.append(part["text"])
    return "".join(texts)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``input`` as chat messages; a 400 names the first item that cannot be one (``input[2].role``)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise bad_request("input must not be empty", "input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        param = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(
                    f"{param}.role must be user, system, developer or assistant, got {role!r}",
                    f"{param}.role",
                )
            if "content" not in item:
                raise bad_request(f"{param}.content is required", f"{param}.content")
            text = _text_of(item["content"], f"{param}.content")
            messages.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise bad_request(f"{param}.{key} must be a string", f"{param}.{key}")
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)  # consecutive calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"{param}.call_id must be a string", f"{param}.call_id")
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, f"{param}.output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        elif kind == "reasoning":
            continue  # earlier reasoning is not sent back to the model, as chat templates drop it
        else:
            raise bad_request(
                f"{param}.type must be message, function_call or function_call_output, got {kind!r}",
                f"{param}.type",
            )
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools (flat: type, name, parameters) as chat tools (nested under ``function``)."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise bad_request(
                f"tools[{i}].type: only function tools are supported, got {kind!r}", f"tools[{i}].type"
            )
        function = {
            k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None
        }
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise bad_request(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}',
            "tool_choice",
        )
    return {"type": "function", "function": {"name": choice["name"]}}


def chat_response_format(req: ResponsesRequest) -> dict[str, Any] | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.json_schema is None:
        raise bad_request('text.format of type "json_schema" needs a schema', "text.format.schema")
    return {
        "type": "json_schema",
        "json_schema": {"name": fmt.name, "schema": fmt.json_schema, "strict": fmt.strict},
    }


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_items(message: dict[str, Any], status: str) -> list[dict[str, Any]]:
    """A chat message's fields (``ChatOutput.final``) as Responses output items."""
    items = []
    if message.get("reasoning_content"):
        items.append(_reasoning_item(_new_id("rs"), message["reasoning_content"]))
    calls = message.get("tool_calls") or []
    content = message.get("content")
    if content or not calls:
        items.append(_message_item(_new_id("msg"), content or "", status))
    for call in calls:
        fn = call["function"]
        items.append(_call_item(_new_id("fc"), call["id"], fn["name"], fn["arguments"], status))
    return items


def assistant_turn(output: list[dict[str, Any]]) -> dict[str, Any]:
    """The output items as one assistant chat message (what a later ``previous_response_id`` continues)."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [
        {
            "id": it["call_id"],
            "type": "function",
            "function": {"name": it["name"], "arguments": it["arguments"]},
        }
        for it in output
        if it["type"] == "function_call"
    ]
    turn: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        turn["tool_calls"] = calls
    return turn


class OpenAIServingResponses:
    """The Responses endpoints, on top of the server's chat handler (template, tool parsing, constraints)."""

    def __init__(self, chat: OpenAIServingChat, store: ResponseStore | None = None) -> None:
        self.chat = chat
        self.store = store if store is not None else ResponseStore()

    def retrieve(self, response_id: str) -> dict[str, Any]:
        entry = self.store.get(response_id)
        if entry is None:
            raise OpenAIError(
                f"Response with id {response_id!r} not found.", status_code=404, type="invalid_request_error"
            )
        return entry[0]

    # ------------------------------------------------------------------ request -> chat

    def _conversation(self, req: ResponsesRequest) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """(the messages the model sees, the same without ``instructions``: what a stored response keeps)."""
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            entry = self.store.get(req.previous_response_id)
            if entry is None:
                raise bad_request(
                    f"Previous response with id {req.previous_response_id!r} not found (responses are kept only "
                    "with store true, and at most --responses-store-size of them)",
                    "previous_response_id",
                )
            history = [dict(m) for m in entry[1]]
        conversation = history + input_messages(req.input)
        prefix = [{"role": "system", "content": req.instructions}] if req.instructions else []
        return prefix + conversation, conversation

    def _chat_request(self, req: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
        body: dict[str, Any] = {
            "model": req.model,
            "messages": messages,
            "max_completion_tokens": req.max_output_tokens,
            "tools": chat_tools(req.tools),
            "tool_choice": chat_tool_choice(req.tool_choice),
            "parallel_tool_calls": req.parallel_tool_calls,
            "response_format": chat_response_format(req),
        }
        for name in (
            "temperature", "top_p", "seed", "top_k", "min_p", "presence_penalty", "frequency_penalty",
            "repetition_penalty",
        ):  # fmt: skip
            body[name] = getattr(req, name)
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            raise from_validation_error(e) from None

    # ------------------------------------------------------------------ the endpoint

    async def create_response(
        self, req: ResponsesRequest, raw_request: Request, arrival_time: float | None = None
    ) -> Response:
        if arrival_time is None:
            arrival_time = time.monotonic()
        chat = self.chat
        try:
            lora_request = chat.check_model(req.model)
            chat.check_engine()
            messages, conversation = self._conversation(req)
            chat_req = self._chat_request(req, messages)
            plan = plan_tools(chat_req, chat.enable_auto_tool_choice, chat.tool_call_parser)
            structured = structured_outputs_from_request(chat_req)
            check_no_conflict(plan, structured)
            prompt_text, token_ids = chat.render_prompt(chat_req.messages, True, tools=plan.tools)
            timeline = RequestTimeline(arrival_time, tokenized_time=time.monotonic())
            max_tokens = chat.resolve_max_tokens(
                len(token_ids),
                req.max_output_tokens,
                prompt_param="input",
                max_tokens_param="max_output_tokens",
            )
            streaming = bool(req.stream)
            params = chat.sampling_params(
                chat_req,
                max_tokens=max_tokens,
                logprobs=None,
                output_kind=RequestOutputKind.DELTA if streaming else RequestOutputKind.FINAL_ONLY,
                structured_outputs=plan.constraint or structured,
            )
        except OpenAIError as e:
            raise _rename_param(e) from None
        response_id = _new_id("resp")
        stream = chat.add_request(
            response_id,
            {"prompt_token_ids": token_ids, "prompt": prompt_text},
            params,
            lora_request,
            timeline,
        )
        base = self._response_base(req, response_id)
        if streaming:
            return SSEResponse(self._stream(base, len(token_ids), stream, plan, conversation), [stream])
        try:
            result = await wait_or_disconnect(raw_request, self._collect(stream, plan))
        except Exception as e:  # noqa: BLE001 - mapped to the OpenAI error shape
            raise to_openai_error(e, chat.field_map) from None
        finally:
            stream.close()
        if result is None:
            return Response(status_code=499)
        mark_first_output(stream)
        chat.log_timelines([stream], streaming=False)
        output, finish_reason, num_output_tokens, num_cached = result
        response = self._finish(base, output, finish_reason, len(token_ids), num_output_tokens, num_cached)
        self._keep(response, conversation)
        return JSONResponse(response)

    def _response_base(self, req: ResponsesRequest, response_id: str) -> dict[str, Any]:
        """The response object as ``response.created`` shows it (status in_progress, no output yet)."""
        fmt = (
            req.text.format.model_dump(by_alias=True, exclude_none=True)
            if req.text and req.text.format
            else None
        )
        return {
            "id": response_id,
            "object": "response",
            "created_at": int(time.time()),
            "status": "in_progress",
            "model": self.chat.response_model_name(req.model),
            "instructions": req.instructions,
            "output": [],
            "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "tools": req.tools or [],
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "text": {"format": fmt or {"type": "text"}},
            "previous_response_id": req.previous_response_id,
            "store": req.store is not False,
            "metadata": req.metadata or {},
            "user": req.user,
            "truncation": "disabled",
            "error": None,
            "incomplete_details": None,
            "usage": None,
        }

    def _finish(
        self,
        base: dict[str, Any],
        output: list[dict[str, Any]],
        finish_reason: str | None,
        num_input_tokens: int,
        num_output_tokens: int,
        num_cached_tokens: int,
    ) -> dict[str, Any]:
        incomplete = finish_reason == "length"
        return {
            **base,
            "status": "incomplete" if incomplete else "completed",
            "output": output,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "usage": {
                "input_tokens": num_input_tokens,
                "input_tokens_details": {"cached_tokens": num_cached_tokens},
                "output_tokens": num_output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": num_input_tokens + num_output_tokens,
            },
        }

    def _keep(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        """Store a finished response (unless its request said ``store: false``) with the conversation it ends."""
        if response["store"]:
            self.store.put(response, conversation + [assistant_turn(response["output"])])

    def _chat_output(self, plan: ToolPlan) -> ChatOutput:
        return ChatOutput(plan, self.chat.reasoning_parser_cls, self.chat.tool_parser_cls)

    async def _collect(
        self, stream: RequestStream, plan: ToolPlan
    ) -> tuple[list[dict[str, Any]], str | None, int, int]:
        final = None
        async for out in stream:
            final = out
        assert final is not None
        [c] = final.outputs
        message, finish_reason = self._chat_output(plan).final(c.text, c.finish_reason)
        status = "incomplete" if c.finish_reason == "length" else "completed"
        return output_items(message, status), c.finish_reason, len(c.token_ids), final.num_cached_tokens

    async def _stream(
        self,
        base: dict[str, Any],
        num_input_tokens: int,
        stream: RequestStream,
        plan: ToolPlan,
        conversation: list[dict[str, Any]],
    ) -> AsyncIterator[str]:
        events = _EventWriter(base["id"])
        yield events.send("response.created", response=base)
        yield events.send("response.in_progress", response=base)
        chat_output = self._chat_output(plan)
        num_output_tokens = 0
        num_cached = 0
        finish_reason = None
        try:
            async for out in stream:
                num_cached = out.num_cached_tokens
                for c in out.outputs:
                    num_output_tokens += len(c.token_ids)
                    delta = chat_output.delta(c.text) if c.text else {}
                    if c.finish_reason is not None:
                        finish_reason = c.finish_reason
                        last, _ = chat_output.finish(c.finish_reason)
                        for key, value in last.items():
                            delta[key] = delta.get(key, [] if key == "tool_calls" else "") + value
                    for chunk in events.delta(delta):
                        mark_first_output(stream)
                        yield chunk
            status = "incomplete" if finish_reason == "length" else "completed"
            for chunk in events.close_all(status):
                yield chunk
            response = self._finish(
                base, events.output, finish_reason, num_input_tokens, num_output_tokens, num_cached
            )
            self._keep(response, conversation)
            self.chat.log_timelines([stream], streaming=True)
            kind = "response.incomplete" if status == "incomplete" else "response.completed"
            yield events.send(kind, response=response)
        except Exception as e:  # noqa: BLE001 - the status line is sent already: report in the stream
            err = to_openai_error(e, self.chat.field_map)
            yield events.send("error", code=err.code, message=err.message, param=err.param)
        finally:
            stream.close()


class _EventWriter:
    """Turns chat deltas (content, reasoning_content, tool_calls) into Responses stream events, opening and
    closing output items in order; ``output`` holds the finished items."""

    def __init__(self, response_id: str) -> None:
        self.response_id = response_id
        self.sequence_number = 0
        self.output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item being streamed
        self._calls: dict[int, dict[str, Any]] = {}  # tool-call index -> its item

    def send(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"

    def delta(self, delta: dict[str, Any]) -> list[str]:
        out: list[str] = []
        if delta.get("reasoning_content"):
            item = self._ensure_open("reasoning", out)
            item["content"][0]["text"] += delta["reasoning_content"]
            out.append(
                self._item_event("response.reasoning_text.delta", item, delta=delta["reasoning_content"])
            )
        if delta.get("content"):
            item = self._ensure_open("message", out)
            item["content"][0]["text"] += delta["content"]
            out.append(
                self._item_event(
                    "response.output_text.delta", item, content_index=0, delta=delta["content"], logprobs=[]
                )
            )
        for call in delta.get("tool_calls") or []:
            fn = call.get("function", {})
            if call.get("id") is not None:
                out.extend(self._close())
                item = _call_item(_new_id("fc"), call["id"], fn.get("name") or "", "", "in_progress")
                self._start(item, out)
                self._calls[call["index"]] = item
            item = self._calls.get(call["index"])
            arguments = fn.get("arguments") or ""
            if item is not None and arguments:
                item["arguments"] += arguments
                out.append(self._item_event("response.function_call_arguments.delta", item, delta=arguments))
        return out

    def close_all(self, status: str) -> list[str]:
        """Close the open item; the finished items take ``status``. An answer with neither text nor calls still
        gets its (empty) message."""
        out = self._close(status)
        if not any(item["type"] in ("message", "function_call") for item in self.output):
            self._ensure_open("message", out)
            out.extend(self._close(status))
        for item in self.output:
            if "status" in item:
                item["status"] = status
        return out

    def _item_event(self, kind: str, item: dict[str, Any], **fields: Any) -> str:
        return self.send(kind, item_id=item["id"], output_index=item["_index"], **fields)

    def _start(self, item: dict[str, Any], out: list[str]) -> None:
        item["_index"] = len(self.output)
        self.output.append(item)
        self._open = item
        out.append(self.send("response.output_item.added", output_index=item["_index"], item=_public(item)))

    def _ensure_open(self, kind: str, out: list[str]) -> dict[str, Any]:
        if self._open is not None and self._open["type"] == kind:
            return self._open
        out.extend(self._close())
        if kind == "message":
            item = _message_item(_new_id("msg"), "", "in_progress")
            self._start(item, out)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out.append(self._item_event("response.content_part.added", item, content_index=0, part=part))
        else:
            item = _reasoning_item(_new_id("rs"), "")
            self._start(item, out)
        return item

    def _close(self, status: str = "completed") -> list[str]:
        item, self._open = self._open, None
        if item is None:
            return []
        out = []
        if "status" in item:
            item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            out.append(
                self._item_event(
                    "response.output_text.done", item, content_index=0, text=part["text"], logprobs=[]
                )
            )
            out.append(self._item_event("response.content_part.done", item, content_index=0, part=part))
        elif item["type"] == "reasoning":
            text = item["content"][0]["text"]
            out.append(self._item_event("response.reasoning_text.done", item, content_index=0, text=text))
        else:
            out.append(
                self._item_event(
                    "response.function_call_arguments.done",
                    item,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        out.append(
            self.send("response.output_item.done", output_index=item.pop("_index"), item=_public(item))
        )
        return out


def _public(item: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in item.items() if not k.startswith("_")}
