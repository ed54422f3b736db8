"""Turn a request's ``StructuredOutputsParams`` into an xgrammar ``Grammar`` (no tokenizer needed).

The front-end calls ``validate_structured_outputs`` on every constrained request, so a schema, regex or grammar
xgrammar cannot handle is a ``ValueError`` naming the field before the request reaches the engine; the engine
core compiles the same ``Grammar`` against the model's vocabulary (manager.py).

xgrammar is imported on first use: a server that never sees a constrained request never pays for it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.schema_support import check_json_schema

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
    rejects it (unbalanced regex, undefined rule...) or a JSON schema uses a keyword the grammar would not
    enforce (schema_support.py: the keyword and its JSON pointer are named)."""
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
            check_json_schema(schema)  # what xgrammar would silently not enforce is refused here
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
# format "email" allows a quoted local part ("a b"@x) whose quoted pairs xgrammar writes as a raw backslash and
# any printable character: in JSON text that is an escape, mostly invalid (\a). The quoted part keeps its
# plain characters only.
_EMAIL_QUOTED_PAIR = '("\\\\" [ -~]) | '


def _strict_json_strings(grammar: Any) -> Any:
    text = str(grammar)
    if not any(c in text for c in _STRING_CHARS) and _EMAIL_QUOTED_PAIR not in text:
        return grammar
    for c in _STRING_CHARS:
        text = text.replace(c, _STRICT_STRING_CHAR)
    text = text.replace(_EMAIL_QUOTED_PAIR, "")
    return _xgr().Grammar.from_ebnf(text)


# ---------------------------------------------------------------------------------------- in-string mask reuse
# Inside a JSON string with no length or pattern constraint, a token made only of characters the string takes as
# they are (no quote, no backslash, no control character, whole UTF-8 characters) leaves the request in the same
# string with the same continuations allowed, so its next mask is the one it had (manager.py reuses it). The
# string rules this holds for are recognised by their exact text in the compiled grammar; anything else (a
# pattern, a length bound, another xgrammar version's wording) is simply not recognised and always filled.


def _string_rule_pattern() -> re.Pattern:
    name = r"(?P<name>[A-Za-z_][A-Za-z0-9_]*)"
    body = (
        r'\(\("\\""\) \| \(' + re.escape(_STRICT_STRING_CHAR) + r" (?P=name)\) \| "
        r'\("\\\\" [A-Za-z_][A-Za-z0-9_]* (?P=name)\)\)'
    )
    return re.compile(rf"{name} ::= {body}(?: \(=\(.*\)\))?")


_STRING_RULE = _string_rule_pattern()


def string_loop_rules(compiled_grammar_text: str) -> frozenset[int]:
    """Ids (print order) of the rules of a compiled grammar's text that read exactly
    ``R ::= (("\\"") | ([<strict string char>] R) | ("\\\\" <escape> R))``, optionally with a lookahead: the
    body of a JSON string with no constraint, after ``_strict_json_strings``."""
    rules = compiled_grammar_text.splitlines()
    if any(not re.match(r"[A-Za-z_][A-Za-z0-9_]* ::= ", line) for line in rules):
        return frozenset()  # a line that is not one whole rule: numbering unknown, reuse nothing
    return frozenset(i for i, line in enumerate(rules) if _STRING_RULE.fullmatch(line))


def plain_string_tokens(decoded_vocab: list[bytes], vocab_size: int, special_ids: Sequence[int] = ()) -> bytes:
    """``vocab_size`` flags: 1 where the token's bytes are whole UTF-8 characters that a JSON string's strict
    character class takes one by one (not ``"``, ``\\``, U+0000-U+001F; surrogates cannot decode). Special
    tokens are never plain."""
    flags = bytearray(vocab_size)
    special = set(special_ids)
    for i, b in enumerate(decoded_vocab[:vocab_size]):
        if not b or i in special:
            continue
        try:
            text = b.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if all(c >= " " and c != '"' and c != "\\" for c in text):
            flags[i] = 1
    return bytes(flags)


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
