"""Pythonic tool calls (Llama 3.2 / Llama 4 and others): the whole output is a Python list of calls

    [get_weather(city="SF", days=3), lookup(q='x', opts={"a": [1, 2]}, flag=True, none=None)]

optionally inside ``<|python_start|>`` ... ``<|python_end|>`` (Llama 4) and surrounding whitespace.

Rules: the list must hold at least one call; each call is ``name(keyword=literal, ...)`` with a plain
(ASCII identifier) name, keyword arguments only (each once), and Python literal values (``ast.literal_eval``)
that map to JSON: tuples become lists, True/False/None become true/false/null; sets, bytes, complex numbers,
NaN or infinities make the call malformed, and so the whole output plain content. A tool-call answer has no
content.

Streaming trade-off: an output that can still begin ``[name(`` is held back until the stream ends (or until
it cannot any more); any other output streams as content at once.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any, ClassVar

from pagedllm.entrypoints.openai.tool_parsers.base import ToolParser, arguments_json

_START, _END = "<|python_start|>", "<|python_end|>"
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_WHITESPACE = re.compile(r"\s*")


def _literal(node: ast.expr) -> Any:
    value = ast.literal_eval(node)
    # Round trip through JSON so that tuples become lists and anything that is not JSON fails here.
    return json.loads(json.dumps(value, ensure_ascii=False, allow_nan=False))


def _call(node: ast.expr) -> tuple[str, str] | None:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    names = [kw.arg for kw in node.keywords]
    if not _IDENTIFIER.fullmatch(node.func.id) or None in names or len(set(names)) < len(names):
        return None  # a non-ASCII name, **kwargs, or a repeated keyword
    arguments = arguments_json({kw.arg: _literal(kw.value) for kw in node.keywords})
    return None if arguments is None else (node.func.id, arguments)


class PythonicToolParser(ToolParser):
    name: ClassVar[str] = "pythonic"

    @staticmethod
    def _body(text: str) -> str:
        body = text.strip()
        if body.startswith(_START):
            body = body[len(_START) :].strip()
            if body.endswith(_END):
                body = body[: -len(_END)].strip()
        return body

    def _parse(self, model_output: str) -> list[tuple[str, str]] | None:
        body = self._body(model_output)
        if not self._may_start_call_list(body) or not body.endswith("]"):
            return None
        try:
            tree = ast.parse(body, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return None
            calls = [_call(node) for node in tree.elts]
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            return None
        return None if None in calls else calls  # type: ignore[return-value]

    @staticmethod
    def _may_start_call_list(body: str) -> bool:
        """Whether ``body`` (stripped on the left) starts ``[name(``, or could by growing."""
        if not body:
            return True
        if body[0] != "[":
            return False
        pos = _WHITESPACE.match(body, 1).end()
        name = _IDENTIFIER.match(body, pos)
        if pos == len(body) or name is None:
            return pos == len(body)
        pos = _WHITESPACE.match(body, name.end()).end()
        return pos == len(body) or body[pos] == "("

    def _settled_content(self, text: str) -> str:
        body = text.lstrip()
        if len(body) < len(_START) and _START.startswith(body):
            return ""  # maybe the start of <|python_start|>
        if body.startswith(_START):
            body = body[len(_START) :].lstrip()
        return "" if self._may_start_call_list(body) else text
