"""One chat choice's text -> OpenAI message fields: reasoning_content, content and tool_calls.

Order: the reasoning parser (if the server has one) splits off ``reasoning_content``; what remains is content,
which the tool plan turns into calls:

- ``auto``: the server's tool-call parser finds calls in the text (or leaves it as content);
- ``named``: the whole content is the forced function's arguments (a JSON-schema constraint made it valid);
  streamed as it is generated, after a first delta with the call's id and name;
- ``required``: the content is a JSON list of ``{"name", "arguments"}`` (constrained too); sent when complete.
  The message has no content, only calls: when max_tokens cuts the list, the calls completed before the cut
  (maybe none) and ``finish_reason`` "length".

``finish_reason`` (as OpenAI and vLLM): "tool_calls" when ``auto`` or ``required`` calls end a choice that stopped;
"stop" for a named function (the caller chose the call); "length" whenever max_tokens cut the choice. With
``parallel_tool_calls`` false, ``auto`` keeps only the first call (``required`` has one by its constraint).
Streaming and non-streaming give the same message.
"""

from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.openai.constraints import (
    ToolPlan,
    calls_from_constrained_output,
    tool_call_dict,
)
from pagedllm.entrypoints.openai.reasoning_parsers.base import ReasoningParser
from pagedllm.entrypoints.openai.tool_parsers.base import ToolCall, ToolParser, random_tool_call_id


def _delta_call(index: int, call_id: str | None, name: str | None, arguments: str) -> dict[str, Any]:
    if call_id is None:
        return {"index": index, "function": {"arguments": arguments}}
    return {
        "index": index,
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


class ChatOutput:
    """Post-processing of one choice. Use ``final`` for a whole text, or ``delta`` per piece then ``finish``."""

    def __init__(
        self,
        plan: ToolPlan,
        reasoning_parser: type[ReasoningParser] | None,
        tool_parser: type[ToolParser] | None,
    ) -> None:
        self.plan = plan
        self._reasoning = reasoning_parser() if reasoning_parser is not None else None
        self._tools = tool_parser() if (tool_parser is not None and plan.mode == "auto") else None
        self._content = ""  # content so far (after reasoning), for the constrained modes
        self._named_id: str | None = None
        self.called = False

    # ------------------------------------------------------------------ whole text

    def final(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """Message fields (content, reasoning_content, tool_calls) and the choice's finish_reason."""
        reasoning = None
        content: str | None = text
        if self._reasoning is not None:
            reasoning, content = self._reasoning.extract_reasoning(text)
        calls: list[ToolCall] = []
        if self.plan.mode == "auto" and self._tools is not None and content:
            extracted = self._tools.extract_tool_calls(content)
            if extracted.tools_called:
                calls, content = extracted.tool_calls, extracted.content
            if not self.plan.parallel:
                calls = calls[:1]
        elif self.plan.mode in ("named", "required"):  # the constraint made the content calls, nothing else
            calls = calls_from_constrained_output(self.plan, content or "")
            content = None
        message = {
            "content": content,
            "reasoning_content": reasoning,
            "tool_calls": [tool_call_dict(c) for c in calls],
        }
        return message, self._finish_reason(bool(calls), finish_reason)

    def _finish_reason(self, called: bool, finish_reason: str | None) -> str | None:
        if called and finish_reason == "stop" and self.plan.mode != "named":
            return "tool_calls"
        return finish_reason

    # ------------------------------------------------------------------ streaming

    def delta(self, text: str) -> dict[str, Any]:
        """The chunk delta fields for one new piece of text ({} when nothing can be sent yet)."""
        out: dict[str, Any] = {}
        content = text
        if self._reasoning is not None:
            d = self._reasoning.extract_reasoning_streaming(text)
            content = ""
            if d is not None:
                if d.reasoning_content:
                    out["reasoning_content"] = d.reasoning_content
                content = d.content or ""
        self._add_content(content, out)
        return out

    def finish(self, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """Flush what was held back; the last delta's fields and the choice's finish_reason."""
        out: dict[str, Any] = {}
        content = ""
        if self._reasoning is not None:
            d = self._reasoning.finish_streaming()
            if d is not None:
                if d.reasoning_content:
                    out["reasoning_content"] = d.reasoning_content
                content = d.content or ""
        self._add_content(content, out)
        if self._tools is not None:
            d = self._tools.finish_streaming()
            if d is not None:
                self._merge(d, out)
        elif self.plan.mode == "required":
            calls = calls_from_constrained_output(self.plan, self._content)
            if calls:
                out["tool_calls"] = [
                    part
                    for i, c in enumerate(calls)
                    for part in (_delta_call(i, c.id, c.name, ""), _delta_call(i, None, None, c.arguments))
                ]
                self.called = True
        elif self.plan.mode == "named":
            if self._named_id is None:  # nothing generated: still one call, with empty arguments
                out.setdefault("tool_calls", []).append(
                    _delta_call(0, random_tool_call_id(), self.plan.named, "")
                )
            self.called = True
        return out, self._finish_reason(self.called, finish_reason)

    def _add_content(self, content: str, out: dict[str, Any]) -> None:
        if not content:
            return
        mode = self.plan.mode
        if self._tools is not None:
            d = self._tools.extract_tool_calls_streaming(content)
            if d is not None:
                self._merge(d, out)
        elif mode == "named":
            self._content += content
            calls = out.setdefault("tool_calls", [])
            if self._named_id is None:
                self._named_id = random_tool_call_id()
                calls.append(_delta_call(0, self._named_id, self.plan.named, ""))
            calls.append(_delta_call(0, None, None, content))
        elif mode == "required":
            self._content += content  # sent whole by finish(): a list of calls is only known at its end
        else:
            out["content"] = out.get("content", "") + content

    def _merge(self, d: Any, out: dict[str, Any]) -> None:
        if d.content:
            out["content"] = out.get("content", "") + d.content
        deltas = d.tool_calls if self.plan.parallel else [t for t in d.tool_calls if t.index == 0]
        if deltas:
            self.called = True
            calls = out.setdefault("tool_calls", [])
            for t in deltas:
                calls.append(_delta_call(t.index, t.id, t.name, t.arguments))
