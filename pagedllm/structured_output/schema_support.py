"""Which JSON Schema (2020-12) keywords a constraint may use: each is enforced, an annotation, or refused.

xgrammar builds a grammar from any schema but silently drops what it cannot express (``uniqueItems``,
``contains``, ``not``, ``if``, a ``$ref``'s siblings, ``pattern`` together with a length...), and the output then
breaks the schema. ``check_json_schema`` walks every subschema (``properties``, ``items``, ``$defs``, ``anyOf``
branches...) and checks every keyword against the tables below, which were measured on xgrammar 0.2.8 by
sampling its grammars and validating the samples with ``jsonschema``. Anything not known to be enforced is
refused with a ``ValueError`` that names the keyword and the JSON pointer of where it is.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

# Keywords that only describe: they constrain nothing, so any output satisfies them.
ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "$comment",
        "examples",
        "default",
        "deprecated",
        "readOnly",
        "writeOnly",
        "$schema",
        # Non-standard, common in generated schemas (OpenAPI, pydantic): meaningless to JSON Schema validation.
        "nullable",
        "discriminator",
    }
)

# Keywords enforced (alone or within the limits ``_check_keyword`` states), by the JSON type they apply to.
NUMBER_KEYWORDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"})
STRING_KEYWORDS = frozenset({"minLength", "maxLength", "pattern", "format"})
ARRAY_KEYWORDS = frozenset(
    {"items", "prefixItems", "minItems", "maxItems", "unevaluatedItems", "uniqueItems"}
)
OBJECT_KEYWORDS = frozenset(
    {
        "properties",
        "required",
        "additionalProperties",
        "patternProperties",
        "propertyNames",
        "minProperties",
        "maxProperties",
        "unevaluatedProperties",
    }
)
GENERAL_KEYWORDS = frozenset(
    {"type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions"}
)

# format values whose xgrammar grammar produced only valid strings; the others are refused (date, time and
# date-time admit a 60th second and 31 November, ipv4 leading zeros, hostname labels over 63 characters,
# json-pointer raw quotes; idn-*, iri* and regex are not constrained at all).
ENFORCED_FORMATS = frozenset({"email", "ipv6", "uuid", "uri", "uri-reference", "duration"})

# Refused keywords, with why (the message a request gets).
REFUSED = {
    "not": "negation is not enforced",
    "if": "conditionals are not enforced",
    "then": "conditionals are not enforced",
    "else": "conditionals are not enforced",
    "dependentRequired": "dependencies between properties are not enforced",
    "dependentSchemas": "dependencies between properties are not enforced",
    "dependencies": "dependencies between properties are not enforced",
    "contains": "contains is not enforced",
    "minContains": "contains is not enforced",
    "maxContains": "contains is not enforced",
    "additionalItems": "additionalItems (before 2020-12) is not supported; use prefixItems and items",
    "$anchor": "only $ref to '#' or '#/...' JSON pointers is supported",
    "$dynamicRef": "only $ref to '#' or '#/...' JSON pointers is supported",
    "$dynamicAnchor": "only $ref to '#' or '#/...' JSON pointers is supported",
    "$recursiveRef": "only $ref to '#' or '#/...' JSON pointers is supported",
    "$recursiveAnchor": "only $ref to '#' or '#/...' JSON pointers is supported",
    "$vocabulary": "custom vocabularies are not supported",
    "contentEncoding": "content encodings are not enforced",
    "contentMediaType": "content media types are not enforced",
    "contentSchema": "content media types are not enforced",
}

_TYPES = ("null", "boolean", "object", "array", "number", "integer", "string")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_VALUES = (
    "items",
    "additionalProperties",
    "propertyNames",
    "unevaluatedItems",
    "unevaluatedProperties",
)
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
_DEFS = frozenset({"$defs", "definitions"})


class UnsupportedSchemaError(ValueError):
    """A schema keyword constrained decoding cannot enforce; ``pointer`` is the JSON pointer of the keyword
    (relative to the schema checked), ``keyword`` its name, ``reason`` why."""

    def __init__(self, field: str, pointer: str, keyword: str, reason: str) -> None:
        self.field, self.pointer, self.keyword, self.reason = field, pointer, keyword, reason
        what = f"keyword {keyword!r} at {pointer or '/'}" if keyword else f"the schema at {pointer or '/'}"
        super().__init__(f"{field}: {what} cannot be enforced by constrained decoding: {reason}")


def check_json_schema(schema: Any, field: str = "structured_outputs.json") -> None:
    """Raise ``UnsupportedSchemaError`` (a ``ValueError`` naming ``field``, the keyword and its JSON pointer)
    if ``schema`` uses a keyword, or a combination of keywords, whose constraint the grammar would not
    enforce. Passing means every output xgrammar allows validates against ``schema``."""
    try:
        _Walker(schema, field).walk(schema, "", root=True)
    except RecursionError:
        raise UnsupportedSchemaError(field, "", "", "the schema is nested too deeply") from None


def _escape(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer()):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    return "array" if isinstance(v, list) else "object"


def _types_of(schema: dict[str, Any]) -> set[str] | None:
    """The JSON types ``schema`` declares (``number`` includes ``integer``), or None if it does not say."""
    t = schema.get("type")
    if isinstance(t, str):
        types = {t}
    elif isinstance(t, list):
        types = set(t)
    elif "const" in schema:
        types = {_json_type(schema["const"])}
    elif isinstance(schema.get("enum"), list):
        types = {_json_type(v) for v in schema["enum"]}
    else:
        return None
    if "number" in types:
        types.add("integer")
    return types


class _Walker:
    def __init__(self, root: Any, field: str) -> None:
        self.root = root
        self.field = field

    def refuse(self, pointer: str, keyword: str, reason: str) -> UnsupportedSchemaError:
        return UnsupportedSchemaError(self.field, pointer, keyword, reason)

    # ------------------------------------------------------------------------------------------ traversal

    def walk(self, schema: Any, ptr: str, root: bool = False, name_schema: bool = False) -> None:
        """Check ``schema`` (at JSON pointer ``ptr``) and every subschema in it. ``name_schema``: it describes
        property names (always strings)."""
        if isinstance(schema, bool):
            return
        if not isinstance(schema, dict):
            raise self.refuse(ptr, "", "a schema must be an object or a boolean")
        for key in schema:
            self.check_keyword(schema, key, ptr, root, name_schema)
        self.check_combinations(schema, ptr, name_schema)
        for key, sub, sub_ptr in self.subschemas(schema, ptr):
            self.walk(sub, sub_ptr, name_schema=key == "propertyNames")

    def subschemas(self, schema: dict[str, Any], ptr: str) -> Iterator[tuple[str, Any, str]]:
        for key in _SCHEMA_MAPS:
            value = schema.get(key)
            if value is None:
                continue
            if not isinstance(value, dict):
                raise self.refuse(f"{ptr}/{_escape(key)}", key, "must be an object of schemas")
            for name, sub in value.items():
                yield key, sub, f"{ptr}/{_escape(key)}/{_escape(name)}"
        for key in _SCHEMA_VALUES:
            if key in schema:
                yield key, schema[key], f"{ptr}/{key}"
        for key in _SCHEMA_LISTS:
            value = schema.get(key)
            if value is None:
                continue
            if not isinstance(value, list) or not value:
                raise self.refuse(f"{ptr}/{key}", key, "must be a non-empty array of schemas")
            for i, sub in enumerate(value):
                yield key, sub, f"{ptr}/{key}/{i}"

    # ------------------------------------------------------------------------------------------ one keyword

    def check_keyword(
        self, schema: dict[str, Any], key: str, ptr: str, root: bool, name_schema: bool
    ) -> None:
        at = f"{ptr}/{_escape(key)}"
        value = schema[key]
        if key in ANNOTATIONS or key.startswith("x-"):
            return
        if key == "$id":
            if not root:
                raise self.refuse(at, key, "$id is only supported on the root schema ($ref resolves from it)")
            return
        if key in REFUSED:
            raise self.refuse(at, key, REFUSED[key])
        if key not in GENERAL_KEYWORDS | NUMBER_KEYWORDS | STRING_KEYWORDS | ARRAY_KEYWORDS | OBJECT_KEYWORDS:
            raise self.refuse(at, key, "not a JSON Schema 2020-12 keyword this server knows how to enforce")
        if key == "type":
            types = [value] if isinstance(value, str) else value
            if not isinstance(types, list) or not types or any(t not in _TYPES for t in types):
                raise self.refuse(at, key, f"must be one of {', '.join(_TYPES)} or a non-empty array of them")
        elif key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            if not _is_number(value):
                raise self.refuse(at, key, "must be a number")
        elif key == "multipleOf":
            types = _types_of(schema) or set()
            if "number" in types:
                raise self.refuse(at, key, 'multipleOf is only enforced for "type": "integer"')
            if not _is_number(value) or value <= 0 or not float(value).is_integer():
                raise self.refuse(at, key, "only a positive whole multipleOf is enforced")
        elif key in ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties"):
            if not _is_number(value) or value < 0 or not float(value).is_integer():
                raise self.refuse(at, key, "must be a non-negative integer")
            if key == "minProperties":
                self.check_min_properties(schema, value, at)
        elif key == "pattern":
            self.check_pattern(value, at, key)
        elif key == "format":
            types = _types_of(schema)
            if value not in ENFORCED_FORMATS and (types is None or "string" in types):
                raise self.refuse(
                    at,
                    key,
                    f"format {value!r} is not enforced (enforced: {', '.join(sorted(ENFORCED_FORMATS))})",
                )
        elif key == "items" and isinstance(value, list):
            raise self.refuse(
                at, key, "an array of item schemas (before 2020-12) is not supported; use prefixItems"
            )
        elif key == "uniqueItems":
            if value is True and not (_is_number(schema.get("maxItems")) and schema["maxItems"] <= 1):
                raise self.refuse(at, key, "unique items are not enforced (only with maxItems <= 1)")
        elif key == "required":
            self.check_required(schema, value, at)
        elif key == "patternProperties" and isinstance(value, dict):
            for pattern in value:
                self.check_pattern(pattern, f"{at}/{_escape(pattern)}", key)
                clash = [n for n in schema.get("properties") or {} if re.search(pattern, n)]
                if clash:
                    raise self.refuse(
                        at, key, f"property {clash[0]!r} is in properties and matches pattern {pattern!r}"
                    )
        elif key == "propertyNames":
            if schema.get("properties") or schema.get("patternProperties"):
                raise self.refuse(at, key, "propertyNames is only enforced beside additionalProperties")
        elif key in ("enum", "const"):
            self.check_enum(schema, key, at)
        elif key == "$ref":
            self.check_ref(value, at)

    def check_min_properties(self, schema: dict[str, Any], value: float, at: str) -> None:
        required = schema.get("required") if isinstance(schema.get("required"), list) else []
        open_keys = any(
            schema.get(k) not in (None, False)
            for k in ("additionalProperties", "patternProperties", "unevaluatedProperties")
        )
        if open_keys and value > len(required):
            raise self.refuse(
                at,
                "minProperties",
                "with additional properties a repeated key could count twice; list them in required",
            )

    def check_required(self, schema: dict[str, Any], value: Any, at: str) -> None:
        if not isinstance(value, list) or any(not isinstance(n, str) for n in value):
            raise self.refuse(at, "required", "must be an array of property names")
        properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        missing = [n for n in value if n not in properties]
        if missing:
            raise self.refuse(
                at, "required", f"required property {missing[0]!r} must be listed in properties"
            )

    def check_enum(self, schema: dict[str, Any], key: str, at: str) -> None:
        values = [schema[key]] if key == "const" else schema[key]
        if not isinstance(values, list) or not values:
            raise self.refuse(at, key, "enum must be a non-empty array")
        others = [
            k
            for k in schema
            if k not in ANNOTATIONS and k not in ("enum", "const", "type", "$defs", "definitions")
        ]
        others = [k for k in others if not k.startswith("x-") and k != "$id"]
        if others:
            raise self.refuse(at, key, f"{others[0]} beside {key} is not enforced (only type is)")
        if "type" in schema:
            types = _types_of({"type": schema["type"]}) or set()
            wrong = [v for v in values if _json_type(v) not in types]
            if wrong:
                raise self.refuse(at, key, f"value {wrong[0]!r} does not have the schema's type")
        if key == "const" and "enum" in schema:
            raise self.refuse(at, key, "const beside enum is not enforced")

    def check_ref(self, ref: Any, at: str) -> None:
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise self.refuse(at, "$ref", f"only '#' or '#/...' JSON pointers are supported, got {ref!r}")
        if "~" in ref or "%" in ref:
            raise self.refuse(at, "$ref", "escaped pointer segments (~0, ~1, %xx) are not supported")
        node = self.root
        for part in ref[2:].split("/") if ref != "#" else []:
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise self.refuse(at, "$ref", f"{ref!r} does not point into this schema")
        if not isinstance(node, (dict, bool)):
            raise self.refuse(at, "$ref", f"{ref!r} does not point to a schema")

    def check_pattern(self, pattern: Any, at: str, key: str) -> None:
        if not isinstance(pattern, str):
            raise self.refuse(at, key, "a pattern must be a string")
        try:
            re.compile(pattern)
        except re.error as e:
            raise self.refuse(
                at, key, f"{pattern!r} is not a regular expression this server reads ({e})"
            ) from None
        reason = unsafe_pattern_reason(pattern)
        if reason:
            raise self.refuse(at, key, f"{pattern!r}: {reason}")

    # ------------------------------------------------------------------------------------- combinations

    def check_combinations(self, schema: dict[str, Any], ptr: str, name_schema: bool) -> None:
        keys = {k for k in schema if k not in ANNOTATIONS and not k.startswith("x-") and k not in _DEFS}
        keys.discard("$id")
        for combinator in ("$ref", "anyOf", "oneOf", "allOf"):
            if combinator in keys and len(keys) > 1:
                other = sorted(keys - {combinator})[0]
                raise self.refuse(
                    f"{ptr}/{_escape(other)}",
                    other,
                    f"keywords beside {combinator} are ignored by the grammar",
                )
        if "allOf" in keys and len(schema["allOf"]) > 1:
            raise self.refuse(f"{ptr}/allOf", "allOf", "only an allOf of one schema is enforced")
        if "oneOf" in keys:
            self.check_one_of(schema["oneOf"], f"{ptr}/oneOf")
        types = _types_of(schema)
        if types is not None and "string" not in types:
            keys -= STRING_KEYWORDS  # no-ops: they apply to strings only
        if "pattern" in keys and keys & {"minLength", "maxLength", "format"}:
            other = sorted(keys & {"minLength", "maxLength", "format"})[0]
            raise self.refuse(
                f"{ptr}/{other}", other, "pattern together with a length or format is not enforced"
            )
        if "format" in keys and keys & {"minLength", "maxLength"}:
            other = sorted(keys & {"minLength", "maxLength"})[0]
            raise self.refuse(f"{ptr}/{other}", other, "format together with a length is not enforced")
        if "type" in keys or keys & {"enum", "const"} or name_schema:
            return
        families = [
            (NUMBER_KEYWORDS, None),
            (STRING_KEYWORDS, None),
            (ARRAY_KEYWORDS, {"items", "prefixItems"}),
            (OBJECT_KEYWORDS, {"properties", "required"}),
        ]
        used = [(fam & keys, infer) for fam, infer in families if fam & keys]
        if len(used) > 1 or (used and not (used[0][1] and used[0][1] & used[0][0])):
            first = sorted(used[0][0])[0]
            raise self.refuse(
                f"{ptr}/{_escape(first)}", first, f'{first} is only enforced with a "type" beside it'
            )

    def resolve(self, schema: Any) -> Any:
        seen = 0
        while isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and seen < 32:
            node: Any = self.root
            ref = schema["$ref"]
            for part in ref[2:].split("/") if ref.startswith("#/") else []:
                node = node.get(part) if isinstance(node, dict) else None
            schema, seen = node, seen + 1
        if isinstance(schema, dict) and isinstance(schema.get("allOf"), list) and len(schema["allOf"]) == 1:
            return self.resolve(schema["allOf"][0])
        return schema

    def check_one_of(self, branches: list[Any], at: str) -> None:
        """oneOf is anyOf to the grammar: enforced only when no value can match two branches."""
        resolved = [self.resolve(b) for b in branches]
        for i in range(len(resolved)):
            for j in range(i + 1, len(resolved)):
                if not self.disjoint(resolved[i], resolved[j]):
                    raise self.refuse(
                        at,
                        "oneOf",
                        f"branches {i} and {j} may both match a value (only disjoint branches are enforced)",
                    )

    def disjoint(self, a: Any, b: Any) -> bool:
        if not isinstance(a, dict) or not isinstance(b, dict):
            return False
        ta, tb = _types_of(a), _types_of(b)
        if ta is not None and tb is not None and not ta & tb:
            return True
        pa, pb = a.get("properties"), b.get("properties")
        if not (isinstance(pa, dict) and isinstance(pb, dict)):
            return False
        common = set(a.get("required") or []) & set(b.get("required") or []) & set(pa) & set(pb)
        for name in common:
            va, vb = _values_of(self.resolve(pa[name])), _values_of(self.resolve(pb[name]))
            if va is not None and vb is not None and not any(x == y for x in va for y in vb):
                return True
        return False


def _values_of(schema: Any) -> list[Any] | None:
    if not isinstance(schema, dict):
        return None
    if "const" in schema:
        return [schema["const"]]
    return schema["enum"] if isinstance(schema.get("enum"), list) else None


# ------------------------------------------------------------------------------------------------- patterns
# xgrammar matches a pattern against the whole string (ECMA-262 searches; a full match is a search match, so the
# grammar is stricter, which is fine) and ignores what it cannot express. A pattern whose text is a literal
# loses the JSON escaping, so quotes, backslashes and control characters come out raw (invalid JSON).
_ESCAPES_REFUSED = {
    "b": "word boundaries are not enforced",
    "B": "word boundaries are not enforced",
    "D": r"\D, \S and \W are not enforced (they differ between regex dialects outside ASCII)",
    "S": r"\D, \S and \W are not enforced (they differ between regex dialects outside ASCII)",
    "W": r"\D, \S and \W are not enforced (they differ between regex dialects outside ASCII)",
    "k": "backreferences are not enforced",
    "p": "Unicode property classes are not enforced",
    "P": "Unicode property classes are not enforced",
}
_JSON_SPECIAL = (
    "quotes, backslashes and control characters in a pattern are not enforced (not escaped in JSON)"
)


def _char_is_special(code: int) -> bool:
    return code < 0x20 or code in (0x22, 0x5C) or 0xD800 <= code <= 0xDFFF


def unsafe_pattern_reason(pattern: str) -> str | None:
    """Why xgrammar would not enforce ``pattern`` inside a JSON string, or None when it does."""
    depth = 0
    in_class = False
    class_negated = False
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if ord(c) < 0x20 or c == '"':
            return _JSON_SPECIAL
        if c == "\\":
            if i + 1 >= n:
                return "a trailing backslash"
            e = pattern[i + 1]
            if e in _ESCAPES_REFUSED:
                return _ESCAPES_REFUSED[e]
            if e.isdigit() and e != "0":
                return "backreferences are not enforced"
            if e in 'nrtfv0c\\"':
                return _JSON_SPECIAL
            if in_class and class_negated and e in "dws":
                return r"negated classes with \d, \s or \w are not enforced"
            if e in "xu":
                digits = 2 if e == "x" else 4
                if e == "u" and pattern[i + 2 : i + 3] == "{":
                    return r"\u{...} escapes are not supported"
                hex_text = pattern[i + 2 : i + 2 + digits]
                if len(hex_text) != digits or not all(h in "0123456789abcdefABCDEF" for h in hex_text):
                    return f"a malformed \\{e} escape"
                if _char_is_special(int(hex_text, 16)):
                    return _JSON_SPECIAL
                i += 2 + digits
                continue
            i += 2
            continue
        if in_class:
            if c == "]":
                in_class = False
            i += 1
            continue
        if c == "[":
            in_class = True
            class_negated = pattern[i + 1 : i + 2] == "^"
            i += 2 if class_negated else 1
            if pattern[i : i + 1] == "]":  # a literal in Python, an empty class in ECMA-262
                return "a class starting with ] is read differently by regex dialects"
            continue
        if c == "(":
            if pattern[i + 1 : i + 2] == "?" and pattern[i + 2 : i + 3] != ":":
                return "lookarounds, named groups and inline flags are not enforced"
            depth += 1
        elif c == ")":
            depth -= 1
        elif c == "^":
            if not (i == 0 or (depth == 0 and pattern[i - 1] == "|" and not _escaped(pattern, i - 1))):
                return "^ is only enforced at the start of the pattern"
        elif c == "$":
            if not (i == n - 1 or (depth == 0 and pattern[i + 1] == "|")):
                return "$ is only enforced at the end of the pattern"
        i += 1
    return None


def _escaped(text: str, i: int) -> bool:
    """Whether ``text[i]`` is preceded by an odd number of backslashes."""
    count = 0
    while i - 1 - count >= 0 and text[i - 1 - count] == "\\":
        count += 1
    return count % 2 == 1
