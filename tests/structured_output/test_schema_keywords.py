"""JSON Schema keywords in structured outputs: each one the grammar takes is enforced (a tiny random-weight model
sampled at temperature 1.0 only ever finishes with outputs that validate), and each it would silently drop is
refused with a ValueError naming structured_outputs.json, the keyword and where it is."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.structured_output.schema_support import check_json_schema, unsafe_pattern_reason

INT = {"type": "integer", "minimum": 0, "maximum": 9}
SHORT = {"type": "string", "maxLength": 3}

# One schema per enforced keyword (and combination), several nested: bounded so a random model finishes them.
ENFORCED = {
    "type list": {"type": ["integer", "string", "null"], "minimum": -3, "maximum": 3, "maxLength": 2},
    "enum of any type": {"enum": [{"a": 1}, [1, "x"], None, True, 1.5, "s"]},
    "const": {"type": "object", "properties": {"k": {"const": "v"}, "n": {"type": "integer", "enum": [1, 2]}},
              "required": ["k", "n"]},
    "integer bounds": {"type": "integer", "exclusiveMinimum": -5, "maximum": 20},
    "integer exclusive": {"type": "integer", "minimum": -20, "exclusiveMaximum": -10},
    "number bounds": {"type": "number", "minimum": 0.5, "exclusiveMaximum": 1.5},
    "number exclusive": {"type": "number", "exclusiveMinimum": -1, "maximum": 0},
    "multipleOf": {"type": "array", "items": {"type": "integer", "multipleOf": 7, "minimum": -50, "maximum": 50},
                   "minItems": 1, "maxItems": 3},
    "string lengths": {"type": "string", "minLength": 2, "maxLength": 4},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[a-c]{1,3}-\\d$"}},
                "required": ["code"]},
    "format email": {"type": "string", "format": "email"},
    "format ipv6": {"type": "string", "format": "ipv6"},
    "format uuid": {"type": "string", "format": "uuid"},
    "format uri": {"type": "string", "format": "uri"},
    "format uri-reference": {"type": "string", "format": "uri-reference"},
    "format duration": {"type": "string", "format": "duration"},
    "items, minItems, maxItems": {"type": "array", "items": SHORT, "minItems": 2, "maxItems": 3},
    "prefixItems, items false": {"type": "array", "prefixItems": [{"type": "boolean"}, {"enum": ["x", "y"]}],
                                 "items": False},
    "prefixItems, items": {"type": "array", "prefixItems": [{"type": "null"}], "items": INT, "maxItems": 3},
    "unevaluatedItems": {"type": "array", "prefixItems": [INT], "unevaluatedItems": {"type": "boolean"},
                         "maxItems": 3},
    "uniqueItems": {"type": "object", "properties": {"a": {"type": "array", "items": INT, "uniqueItems": False,
                    "maxItems": 3}, "b": {"type": "array", "items": INT, "uniqueItems": True, "maxItems": 1}},
                    "required": ["a", "b"]},
    "properties, required": {"type": "object", "properties": {"a": INT, "b": SHORT, "c": {"type": "boolean"}},
                             "required": ["a", "c"], "additionalProperties": False},
    "additionalProperties": {"type": "object", "properties": {"a": INT}, "required": ["a"],
                             "additionalProperties": SHORT, "maxProperties": 2},
    "patternProperties": {"type": "object", "patternProperties": {"^x[0-9]$": INT}, "maxProperties": 2},
    "propertyNames": {"type": "object", "propertyNames": {"pattern": "^[a-c]{1,2}$"},
                      "additionalProperties": INT, "maxProperties": 2},
    "min/maxProperties": {"type": "object", "properties": {"a": INT, "b": INT, "c": INT},
                          "minProperties": 2, "maxProperties": 2},
    "unevaluatedProperties": {"type": "object", "properties": {"a": INT}, "unevaluatedProperties": SHORT,
                              "maxProperties": 2},
    "anyOf": {"type": "array", "items": {"anyOf": [INT, SHORT, {"type": "null"}]}, "maxItems": 3},
    "oneOf (disjoint)": {"oneOf": [
        {"type": "object", "properties": {"k": {"const": "a"}, "v": INT}, "required": ["k", "v"]},
        {"type": "object", "properties": {"k": {"const": "b"}, "v": SHORT}, "required": ["k", "v"]},
    ], "discriminator": {"propertyName": "k"}},
    "$ref, $defs, allOf of one": {
        "$defs": {"P": {"type": "object", "properties": {"x": INT}, "required": ["x"]}},
        "type": "object",
        "properties": {"p": {"$ref": "#/$defs/P", "description": "a P"},
                       "q": {"allOf": [{"$ref": "#/$defs/P"}], "title": "Q"}},
        "required": ["p", "q"],
    },
    "definitions": {"definitions": {"d": SHORT}, "$ref": "#/definitions/d"},
    "type inferred from properties": {"type": "object", "properties": {"p": {"properties": {"q": INT},
                                      "required": ["q"]}}, "required": ["p"]},
    "annotations": {
        "$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "https://example.com/x.json",
        "title": "T", "description": "D", "$comment": "C", "examples": [{"a": 1}], "default": {"a": 0},
        "type": "object", "properties": {"a": {**INT, "deprecated": True, "readOnly": True, "writeOnly": False,
                                               "x-unit": "m"}},
        "required": ["a"],
    },
}  # fmt: skip

# A schema per refused keyword (or combination): (schema, keyword named, JSON pointer named).
REFUSED = {
    "uniqueItems": ({"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 2, "uniqueItems": True},
                    "uniqueItems", "/uniqueItems"),
    "contains": ({"type": "array", "items": INT, "contains": {"const": 7}}, "contains", "/contains"),
    "minContains": ({"type": "array", "items": INT, "minContains": 2}, "minContains", "/minContains"),
    "maxContains": ({"type": "array", "items": INT, "maxContains": 2}, "maxContains", "/maxContains"),
    "pattern with maxLength": ({"type": "string", "pattern": "^[a-z]{1,10}$", "maxLength": 3}, "maxLength",
                               "/maxLength"),
    "format with maxLength": ({"type": "string", "format": "email", "maxLength": 8}, "maxLength", "/maxLength"),
    "allOf beside type": ({"type": "integer", "allOf": [{"minimum": 3}]}, "type", "/type"),
    "allOf of two": ({"allOf": [{"type": "integer"}, {"maximum": 3}]}, "allOf", "/allOf"),
    "anyOf beside type": ({"type": "integer", "anyOf": [{"maximum": 3}, {"minimum": 9}]}, "type", "/type"),
    "oneOf overlapping": ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf", "/oneOf"),
    "$ref with maximum": ({"$defs": {"a": INT}, "$ref": "#/$defs/a", "maximum": 5}, "maximum", "/maximum"),
    "not": ({"type": "object", "properties": {"s": {**INT, "not": {"const": 3}}}}, "not", "/properties/s/not"),
    "if/then/else": ({**INT, "if": {"minimum": 5}, "then": {"const": 7}}, "if", "/if"),
    "then": ({**INT, "then": {"const": 7}}, "then", "/then"),
    "else": ({**INT, "else": {"const": 7}}, "else", "/else"),
    "dependentRequired": ({"type": "object", "properties": {"a": INT, "b": INT},
                           "dependentRequired": {"a": ["b"]}}, "dependentRequired", "/dependentRequired"),
    "dependentSchemas": ({"type": "object", "properties": {"a": INT}, "dependentSchemas": {"a": {}}},
                         "dependentSchemas", "/dependentSchemas"),
    "dependencies": ({"type": "object", "dependencies": {"a": ["b"]}}, "dependencies", "/dependencies"),
    "multipleOf on number": ({"type": "number", "multipleOf": 0.5}, "multipleOf", "/multipleOf"),
    "multipleOf not whole": ({"type": "integer", "multipleOf": 1.5}, "multipleOf", "/multipleOf"),
    "format date-time": ({"type": "string", "format": "date-time"}, "format", "/format"),
    "format unknown": ({"type": "string", "format": "color"}, "format", "/format"),
    "pattern lookahead": ({"type": "string", "pattern": "^(?=a)[a-c]$"}, "pattern", "/pattern"),
    "pattern quote": ({"type": "string", "pattern": '^a"$'}, "pattern", "/pattern"),
    "enum with sibling": ({"enum": ["abc", "x"], "maxLength": 2}, "enum", "/enum"),
    "enum with wrong type": ({"type": "integer", "enum": [1, "a"]}, "enum", "/enum"),
    "required not in properties": ({"type": "object", "required": ["z"]}, "required", "/required"),
    "minProperties over required": ({"type": "object", "additionalProperties": INT, "minProperties": 1},
                                    "minProperties", "/minProperties"),
    "patternProperties clash": ({"type": "object", "properties": {"x1": SHORT},
                                 "patternProperties": {"^x": INT}}, "patternProperties", "/patternProperties"),
    "propertyNames beside properties": ({"type": "object", "properties": {"abc": INT},
                                         "propertyNames": {"maxLength": 2}}, "propertyNames", "/propertyNames"),
    "untyped bound": ({"type": "object", "properties": {"v": {"maximum": 5}}}, "maximum",
                      "/properties/v/maximum"),
    "items array": ({"type": "array", "items": [INT]}, "items", "/items"),
    "additionalItems": ({"type": "array", "items": INT, "additionalItems": False}, "additionalItems",
                        "/additionalItems"),
    "$anchor": ({"$defs": {"a": {**INT, "$anchor": "a"}}, "$ref": "#/$defs/a"}, "$anchor", "/$defs/a/$anchor"),
    "$ref to an anchor": ({"$defs": {"a": INT}, "$ref": "#a"}, "$ref", "/$ref"),
    "$ref elsewhere": ({"$ref": "https://example.com/s.json"}, "$ref", "/$ref"),
    "$dynamicRef": ({"$defs": {"a": INT}, "$dynamicRef": "#/$defs/a"}, "$dynamicRef", "/$dynamicRef"),
    "$dynamicAnchor": ({**INT, "$dynamicAnchor": "a"}, "$dynamicAnchor", "/$dynamicAnchor"),
    "$id nested": ({"type": "array", "items": {**INT, "$id": "i.json"}}, "$id", "/items/$id"),
    "$vocabulary": ({**INT, "$vocabulary": {}}, "$vocabulary", "/$vocabulary"),
    "contentEncoding": ({"type": "string", "contentEncoding": "base64"}, "contentEncoding", "/contentEncoding"),
    "contentMediaType": ({"type": "string", "contentMediaType": "application/json"}, "contentMediaType",
                         "/contentMediaType"),
    "contentSchema": ({"type": "string", "contentSchema": {}}, "contentSchema", "/contentSchema"),
    "unknown keyword": ({"type": "string", "maxlength": 3}, "maxlength", "/maxlength"),
    "deep in $defs": ({"$defs": {"a": {"type": "array", "items": {"anyOf": [{"type": "array",
                       "uniqueItems": True}]}}}, "$ref": "#/$defs/a"}, "uniqueItems",
                      "/$defs/a/items/anyOf/0/uniqueItems"),
}  # fmt: skip

NUM_SAMPLES = 8
PROMPT = "Write JSON:"


def _format_ok(fmt: str, value: str) -> bool:
    """Checks for the formats jsonschema cannot check without extra packages (RFC 3986 and RFC 3339 shapes)."""
    unreserved = r"[A-Za-z0-9\-._~!$&'()*+,;=:@/?#%\[\]]*"
    if fmt == "uri":
        return re.fullmatch(r"[A-Za-z][A-Za-z0-9+.\-]*:" + unreserved, value) is not None
    if fmt == "uri-reference":
        return re.fullmatch(unreserved, value) is not None
    if fmt == "duration":
        dur_time = r"T(\d+H(\d+M(\d+S)?)?|\d+M(\d+S)?|\d+S)"
        dur_date = r"(\d+D|\d+M(\d+D)?|\d+Y(\d+M(\d+D)?)?)"
        return re.fullmatch(rf"P({dur_date}({dur_time})?|{dur_time}|\d+W)", value) is not None
    return True


def _validate(value, schema) -> None:
    jsonschema.validate(value, schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    fmt = schema.get("format")
    assert fmt is None or _format_ok(fmt, value), (fmt, value)


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(tiny_llama, dtype="float32", device="cpu")


def _params(schema, seed: int, **kw) -> SamplingParams:
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=kw.pop("max_tokens", 160), structured_outputs=so)


def test_enforced_keywords_give_valid_outputs(llm: LLM) -> None:
    cases = [(name, schema) for name, schema in ENFORCED.items() for _ in range(NUM_SAMPLES)]
    # Formats have no length bound: a random model's email or URI can take a few hundred tokens.
    params = [
        _params(schema, seed, max_tokens=440 if name.startswith("format") else 160)
        for seed, (name, schema) in enumerate(cases)
    ]
    outs = llm.generate([PROMPT] * len(cases), params, use_tqdm=False)
    stopped: dict[str, int] = {}
    for (name, schema), out in zip(cases, outs, strict=True):
        o = out.outputs[0]
        if o.finish_reason != "stop":
            continue
        stopped[name] = stopped.get(name, 0) + 1
        value = json.loads(o.text)
        try:
            _validate(value, schema)
        except (jsonschema.ValidationError, AssertionError) as e:
            raise AssertionError(f"{name}: {o.text!r} breaks the schema: {e}") from None
    # Not vacuous: most samples of every schema finished (a cut output is not checked).
    few = {name: stopped.get(name, 0) for name in ENFORCED if stopped.get(name, 0) < NUM_SAMPLES // 2}
    assert not few, few


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_keywords_name_the_field_keyword_and_pointer(name: str) -> None:
    schema, keyword, pointer = REFUSED[name]
    with pytest.raises(ValueError) as e:
        check_json_schema(schema)
    msg = str(e.value)
    assert msg.startswith("structured_outputs.json: ") and f"keyword {keyword!r} at {pointer} " in msg, msg


def test_refusal_reaches_llm_generate(llm: LLM) -> None:
    """Through the public path (SamplingParams -> LLM.generate): ValueError, nothing left running; the schemas
    that were silently broken before are among them."""
    for name in ("uniqueItems", "contains", "pattern with maxLength", "not", "$ref with maximum", "if/then/else"):
        schema, keyword, _ = REFUSED[name]
        with pytest.raises(ValueError, match=rf"structured_outputs\.json: keyword '{re.escape(keyword)}'"):
            llm.generate([PROMPT], _params(schema, 0), use_tqdm=False)
        # As a JSON string too.
        with pytest.raises(ValueError, match=re.escape(keyword)):
            llm.generate([PROMPT], _params(json.dumps(schema), 0), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate([PROMPT], _params(INT, 0), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and 0 <= json.loads(out.text) <= 9


def test_enforced_schemas_pass_the_check_and_no_op_keywords_are_accepted() -> None:
    for schema in ENFORCED.values():
        check_json_schema(schema)
    check_json_schema({"type": "array", "uniqueItems": False, "items": True})
    check_json_schema({"type": "object", "additionalProperties": True, "properties": {"a": True}})
    check_json_schema({"type": "integer", "format": "int64", "maxLength": 3})  # string keywords on an integer


@pytest.mark.parametrize(
    "pattern, ok",
    [
        ("^[a-z]+$", True),
        ("^ab|cd$", True),
        ("(?:ab)+\\.c", True),
        ("^\\u00e9\\d\\w\\s$", True),
        ("a^b", False),
        ("a$b", False),
        ("(^a)", False),
        ("\\bword", False),
        ("\\W", False),
        ("[^\\d]", False),
        ("(a)\\1", False),
        ("(?i)abc", False),
        ("(?<n>a)", False),
        ("a\\\\b", False),
        ("\\n", False),
        ("\\x22", False),
        ("\\u005c", False),
        ("[]a]", False),
    ],
)
def test_patterns_outside_what_the_grammar_enforces_are_named(pattern: str, ok: bool) -> None:
    assert (unsafe_pattern_reason(pattern) is None) == ok
