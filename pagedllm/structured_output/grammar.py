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

MAX_JSON_WHITESPACE = 12  # longest run of whitespace allowed between JSON tokens


def _xgr() -> Any:
    try:
        import xgrammar
    except ImportError as e:  # pragma: no cover - xgrammar is a dependency; this names it if it is missing
        raise ValueError(
            "structured outputs need the xgrammar package (pip install xgrammar), which is not installed"
        ) from e
    return xgrammar


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices`` (JSON string escapes are EBNF string escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def build_grammar(params: StructuredOutputsParams) -> Any:
    """The xgrammar ``Grammar`` of ``params``; ``ValueError`` naming ``structured_outputs.<field>`` if xgrammar
    rejects it (unsupported schema keyword, unbalanced regex, undefined rule...)."""
    xgr = _xgr()
    kind = params.kind
    any_whitespace = not params.disable_any_whitespace
    # JSON may hold whitespace between tokens, but at most this much in a row: valid JSON still, and a model
    # cannot spend its whole budget on newlines (small models do).
    ws = {
        "any_whitespace": any_whitespace,
        "max_whitespace_cnt": MAX_JSON_WHITESPACE if any_whitespace else None,
    }
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
            return _fix_length_limited_strings(xgr.Grammar.from_json_schema(schema, **ws))
        if kind == "json_object":
            return xgr.Grammar.from_json_schema({"type": "object"}, strict_mode=False, **ws)
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


# xgrammar (0.2.8) writes a string with minLength/maxLength as repetitions of [^"\\\r\n], which admits raw
# control characters: invalid JSON (small models do emit them). Its plain strings exclude \0-\x1f; give the
# length-limited ones the same class (without escapes: still valid JSON, the length counts characters).
_LOOSE_STRING_CHAR = '[^\\"\\\\\\r\\n]'
_STRICT_STRING_CHAR = '[^\\0-\\x1f\\"\\\\]'


def _fix_length_limited_strings(grammar: Any) -> Any:
    text = str(grammar)
    if _LOOSE_STRING_CHAR not in text:
        return grammar
    return _xgr().Grammar.from_ebnf(text.replace(_LOOSE_STRING_CHAR, _STRICT_STRING_CHAR))


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
