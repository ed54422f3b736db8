"""Tool-call parsing shared by every format: the result dataclasses and the ``ToolParser`` base class.

Semantics (all formats): a model output either *is* a tool-call answer, and then every call in it must be
well formed, or it is plain text. One malformed call (JSON that does not parse, not an object, no string
name, arguments that are not an object) turns the whole output into plain content, as vLLM does.

Streaming is exact: for any split of an output into pieces, the streamed content concatenates to the
non-streaming ``content`` and the streamed calls reassemble to the non-streaming ``tool_calls``. The base
class gets this by construction: a subclass names, for the text received so far, the content that is
certain whatever follows (``_settled_content``); everything else is held back, and ``finish_streaming``
parses the whole text once and sends what is left. Because one later malformed call would turn earlier
calls back into content, no call is certain before the end of the output, so calls are sent by
``finish_streaming``. Models emit tool calls at the end of their output, so this costs about one token.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass
class ToolCall:
    """One complete call; ``arguments`` is the JSON text of the arguments object ("{}" when none)."""

    id: str
    name: str
    arguments: str


@dataclass
class ExtractedToolCalls:
    """Result of parsing a whole output. ``content``: text before the first call (None when empty)."""

    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None


@dataclass
class ToolCallDelta:
    """One streamed piece of call number ``index``: the first carries id and name (arguments ""),
    later ones argument fragments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class DeltaMessage:
    """One streamed step. ``tool_calls`` may hold several deltas (of one or more calls), in order."""

    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


def lookup_parser(registry: dict[str, Any], name: str, what: str) -> Any:
    """``registry[name]``; ValueError naming the valid names otherwise (``what``: "tool call parser"...)."""
    try:
        return registry[name]
    except KeyError:
        valid = ", ".join(sorted(registry))
        raise ValueError(f"unknown {what} {name!r}; valid names: {valid}") from None


def random_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"


def arguments_json(arguments: Any) -> str | None:
    """JSON text of a call's arguments, or None when they are not a valid arguments object.

    Missing (None) arguments give "{}"; a JSON string that holds an object is accepted (some models
    double-encode); NaN and infinities are refused, as they are not JSON.
    """
    if arguments is None:
        return "{}"
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    try:
        return json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):
        return None


def call_from_object(
    obj: Any, argument_keys: tuple[str, ...] = ("arguments", "parameters")
) -> tuple[str, str] | None:
    """(name, arguments JSON) of a decoded ``{"name": ..., "arguments": {...}}`` object, or None if malformed.

    The arguments come from the first of ``argument_keys`` present in the object.
    """
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((k for k in argument_keys if k in obj), None)
    arguments = arguments_json(obj[key] if key is not None else None)
    return None if arguments is None else (obj["name"], arguments)


def partial_marker_length(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker`` (0 if none)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def content_before_marker(text: str, marker: str) -> str:
    """Settled content of a format whose calls start at ``marker``: the text before it (or before a
    partial marker at the end), less trailing whitespace, which is stripped if a call follows."""
    pos = text.find(marker)
    if pos < 0:
        pos = len(text) - partial_marker_length(text, marker)
    return text[:pos].rstrip()


class ToolParser:
    """Base class: one instance per request (it holds the streaming state).

    Subclasses implement ``_parse`` (whole output -> list of (name, arguments JSON), or None when the output
    is not a valid tool-call answer), ``_content_before_calls`` and ``_settled_content``.
    """

    name: ClassVar[str]

    def __init__(self) -> None:
        self._text = ""
        self._sent = ""  # content already streamed
        self._finished = False

    # ------------------------------------------------------------------------------- to implement

    def _parse(self, model_output: str) -> list[tuple[str, str]] | None:
        raise NotImplementedError

    def _content_before_calls(self, model_output: str) -> str:
        """Content of a valid tool-call answer (only called when ``_parse`` succeeded)."""
        return ""

    def _settled_content(self, text: str) -> str:
        """Prefix of the final content that no continuation of ``text`` can change."""
        raise NotImplementedError

    def _new_id(self) -> str:
        return random_tool_call_id()

    # ------------------------------------------------------------------------------------ public

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        calls = self._parse(model_output)
        if not calls:
            return ExtractedToolCalls(tools_called=False, tool_calls=[], content=model_output or None)
        tool_calls = [ToolCall(id=self._new_id(), name=name, arguments=args) for name, args in calls]
        return ExtractedToolCalls(True, tool_calls, self._content_before_calls(model_output) or None)

    def extract_tool_calls_streaming(self, delta_text: str) -> DeltaMessage | None:
        """Feed the next piece of output; returns what can be sent now, or None."""
        if self._finished:
            raise RuntimeError("extract_tool_calls_streaming called after finish_streaming")
        if not delta_text:
            return None
        self._text += delta_text
        return self._content_delta(self._settled_content(self._text))

    def finish_streaming(self) -> DeltaMessage | None:
        """End of output: send the held-back content and the tool calls."""
        if self._finished:
            return None
        self._finished = True
        result = self.extract_tool_calls(self._text)
        delta = self._content_delta(result.content or "") or DeltaMessage()
        for index, call in enumerate(result.tool_calls):
            delta.tool_calls.append(ToolCallDelta(index=index, id=call.id, name=call.name, arguments=""))
            delta.tool_calls.append(ToolCallDelta(index=index, arguments=call.arguments))
        return delta if delta.content or delta.tool_calls else None

    # ---------------------------------------------------------------------------------- helpers

    def _content_delta(self, content: str) -> DeltaMessage | None:
        # The settled content only grows; a mismatch would be a bug in a subclass's _settled_content.
        if not content.startswith(self._sent):
            raise AssertionError(f"{type(self).__name__}: streamed content is not a prefix of the content")
        piece = content[len(self._sent) :]
        self._sent = content
        return DeltaMessage(content=piece) if piece else None
