"""Mistral tool calls, in both of Mistral's formats; text before the first ``[TOOL_CALLS]`` is the content:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "f", "arguments": {}}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]f[ARGS]{}        (v11+ tokenizers)

Decisions: each ``[TOOL_CALLS]`` is followed either by a JSON list of call objects (or a single object) or
by ``name[ARGS]{...}``; the two may even be mixed. After the last call only whitespace may follow; anything
else, like any malformed call, makes the whole output plain content. Call ids are 9 alphanumeric
characters, as Mistral's chat templates require. ``[TOOL_CALLS]`` and ``[ARGS]`` are special tokens: the
server must detokenize with ``skip_special_tokens=False`` for them to reach the parser.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import ClassVar

from pagedllm.entrypoints.openai.tool_parsers.base import (
    ToolParser,
    arguments_json,
    call_from_object,
    content_before_marker,
)

_ALPHANUMERIC = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
_FUNCTION_NAME = re.compile(r"\s*([A-Za-z0-9_.\-]+)\s*\[ARGS\]\s*")
_WHITESPACE = re.compile(r"\s*")


def mistral_tool_call_id() -> str:
    """9 random alphanumeric characters (from the low, random bits of a uuid4)."""
    n = uuid.uuid4().int
    chars = []
    for _ in range(9):
        n, r = divmod(n, len(_ALPHANUMERIC))
        chars.append(_ALPHANUMERIC[r])
    return "".join(chars)


class MistralToolParser(ToolParser):
    name: ClassVar[str] = "mistral"
    bot_token: ClassVar[str] = "[TOOL_CALLS]"

    def _new_id(self) -> str:
        return mistral_tool_call_id()

    def _parse(self, model_output: str) -> list[tuple[str, str]] | None:
        pos = model_output.find(self.bot_token)
        if pos < 0:
            return None
        decoder = json.JSONDecoder()
        calls: list[tuple[str, str]] = []
        while pos < len(model_output):
            if not model_output.startswith(self.bot_token, pos):
                return None
            pos = _WHITESPACE.match(model_output, pos + len(self.bot_token)).end()
            named = _FUNCTION_NAME.match(model_output, pos)
            try:
                value, pos = decoder.raw_decode(model_output, named.end() if named else pos)
            except (ValueError, RecursionError):
                return None
            if named:  # name[ARGS]{...}
                arguments = arguments_json(value) if isinstance(value, dict) else None
                found = [(named.group(1), arguments)] if arguments is not None else [None]
            else:  # a JSON list of calls, or one call
                found = [call_from_object(obj) for obj in (value if isinstance(value, list) else [value])]
            if not found or None in found:
                return None
            calls.extend(found)
            pos = _WHITESPACE.match(model_output, pos).end()
        return calls

    def _content_before_calls(self, model_output: str) -> str:
        return model_output[: model_output.find(self.bot_token)].rstrip()

    def _settled_content(self, text: str) -> str:
        return content_before_marker(text, self.bot_token)
