"""Turn a request's ``StructuredOutputsParams`` into an xgrammar ``Grammar`` (no tokenizer needed).

The front-end calls ``validate_structured_outputs`` on every constrained request, so a schema, regex or grammar
xgrammar cannot handle is a ``ValueError`` naming the field before the request reaches the engine; the engine
core compiles the same ``Grammar`` against the model's vocabulary (manager.py).

xgrammar is imported on first use: a server that never sees a constrained request never pays for it.
"""

from __future__ import annotations

import json
from typing import Any

from pagedllm.sampling_params import StructuredOutputsParams

# Free-whitespace JSON (the default, as in vLLM) lets a weak model emit whitespace without end. xgrammar's own
# cap (max_whitespace_cnt) makes every mask inside a string 3-4x slower to fill on a 152k vocabulary (measured:
# 560 vs 154 us per row), so the cap is applied per token instead (manager.py): after this many consecutive
# tokens that are only whitespace, such tokens are masked out until another token comes. Valid JSON either way.
MAX_JSON_WHITESPACE_TOKENS = 8


def _xgr() -> Any:
    try:
        import xgrammar
    except ImportError as e:  # pragma: no cover - xgrammar is a dependency; this names it if it is missing
        raise ValueError(
            "structured outputs need the xgrammar package (pip install xgrammar), which is not installed"
        ) from e
    return xgrammar


def caps_whitespace(params: StructuredOutputsParams) -> bool:
    """Whether ``params`` is JSON with free whitespace, whose whitespace runs the manager caps by token."""
    return params.kind in ("json", "json_object") and not params.disable_any_whitespace


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices`` (JSON string escapes are EBNF string escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def build_grammar(params: StructuredOutputsParams) -> Any:
    """The xgrammar ``Grammar`` of ``params``; ``ValueError`` naming ``structured_outputs.<field>`` if xgrammar
    rejects it (unsupported schema keyword, unbalanced regex, undefined rule...)."""
    xgr = _xgr()
    kind = params.kind
    ws = {"any_whitespace": not params.disable_any_whitespace}
    try:
        if kind == "json":
            schema = params.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise ValueError("structured_outputs.json must be a JSON schema object")
            return _strict_json_strings(xgr.Grammar.from_json_schema(schema, **ws))
        if kind == "json_object":
            return _strict_json_strings(xgr.Grammar.from_json_schema({"type": "object"}, strict_mode=False, **ws))
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(params.choice))
        return xgr.Grammar.from_ebnf(params.grammar)
    except ValueError:
        raise
    except Exception as e:  # xgrammar reports bad input as RuntimeError with its C++ location in front
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        msg = msg.split("] ", 1)[-1]  # drop "[time] file.cc:line: "
        msg = msg.split(": ", 1)[-1] if ".cc:" in msg else msg
        raise ValueError(
            f"structured_outputs.{kind} cannot be used for constrained decoding: {msg}"
        ) from None


# JSON string characters, as xgrammar (0.2.8) writes them: plain strings exclude \0-\x1f; strings with
# minLength/maxLength use [^"\\\r\n], which admits raw control characters (invalid JSON: small models emit them).
# Neither excludes U+D800-U+DFFF, and xgrammar accepts a surrogate's three UTF-8 bytes (\xed\xba\x9a): invalid
# UTF-8, which a JSON parser reads as three U+FFFD, so a maxLength check fails too. Every string character gets
# the strict class (no escapes needed in it: still valid JSON, the length counts characters).
_STRING_CHARS = ('[^\\"\\\\\\r\\n]', '[^\\0-\\x1f\\"\\\\\\r\\n]')
_STRICT_STRING_CHAR = '[^\\0-\\x1f\\"\\\\\\ud800-\\udfff]'


def _strict_json_strings(grammar: Any) -> Any:
    text = str(grammar)
    if not any(c in text for c in _STRING_CHARS):
        return grammar
    for c in _STRING_CHARS:
        text = text.replace(c, _STRICT_STRING_CHAR)
    return _xgr().Grammar.from_ebnf(text)


_VALIDATED: dict[tuple, bool] = {}  # keys of constraints that built, so a repeated schema is checked once
_VALIDATED_MAX = 1024


def validate_structured_outputs(params: StructuredOutputsParams) -> None:
    """Raise ``ValueError`` naming the field if ``params`` cannot be compiled (remembered for good ones)."""
    key = params.key()
    if key in _VALIDATED:
        return
    build_grammar(params)
    if len(_VALIDATED) >= _VALIDATED_MAX:
        _VALIDATED.clear()
    _VALIDATED[key] = True
