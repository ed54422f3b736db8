"""Llama 3.1 / 3.2 JSON tool calls: the whole output (after optional leading whitespace and an optional
``<|python_tag|>``) is one or more JSON objects separated by ``;``:

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "f", "parameters": {}}

``arguments`` is accepted in place of ``parameters``. Anything else, including text after the last object,
makes the output plain content. A tool-call answer has no content.

Streaming trade-off: an output that starts with ``{`` (or the tag) may be a call until its end, so it is held
back until the stream ends; any other output streams as content at once. ``<|python_tag|>`` is a special
token: the server must detokenize with ``skip_special_tokens=False`` for it to reach the parser.
"""

from __future__ import annotations

import json
import re
from typing import ClassVar

from pagedllm.entrypoints.openai.tool_parsers.base import ToolParser, call_from_object

_SEPARATOR = re.compile(r"\s*(?:;\s*)?")
_WHITESPACE = re.compile(r"\s*")


class Llama3JsonToolParser(ToolParser):
    name: ClassVar[str] = "llama3_json"
    bot_token: ClassVar[str] = "<|python_tag|>"

    def _body_start(self, text: str) -> int | None:
        """Where the JSON starts (after whitespace and the tag), or None when the output does not start so."""
        pos = _WHITESPACE.match(text).end()
        if text.startswith(self.bot_token, pos):
            pos = _WHITESPACE.match(text, pos + len(self.bot_token)).end()
        return pos if text.startswith("{", pos) else None

    def _parse(self, model_output: str) -> list[tuple[str, str]] | None:
        pos = self._body_start(model_output)
        if pos is None:
            return None
        decoder = json.JSONDecoder()
        calls = []
        while True:
            try:
                obj, pos = decoder.raw_decode(model_output, pos)
            except (ValueError, RecursionError):
                return None
            call = call_from_object(obj, ("parameters", "arguments"))
            if call is None:
                return None
            calls.append(call)
            sep = _SEPARATOR.match(model_output, pos)
            if ";" not in sep.group():
                return calls if sep.end() == len(model_output) else None
            pos = sep.end()

    def _settled_content(self, text: str) -> str:
        pos = _WHITESPACE.match(text).end()
        rest, tag = text[pos:], self.bot_token
        if len(rest) < len(tag) and tag.startswith(rest):
            return ""  # empty so far, or maybe the start of the tag
        if rest.startswith(tag):
            pos = _WHITESPACE.match(text, pos + len(tag)).end()
        if pos == len(text) or text[pos] == "{":
            return ""  # may be a tool-call answer: undecided until the end
        return text
