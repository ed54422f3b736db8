"""From an OpenAI request body to a structured-output constraint and a tool-calling plan.

Constraint sources (at most one per request; each error is a 400 naming the field it came from):
``response_format`` (OpenAI: json_schema, json_object), ``structured_outputs`` (vLLM's extra body), and vLLM's
older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``.

Tool calling (chat): ``tool_choice="none"`` generates text; ``"auto"`` lets the model decide and parses its text
with the server's ``--tool-call-parser``; ``"required"`` and a named function are enforced by a JSON-schema
constraint, so the output is always valid calls, whatever the model. ``parallel_tool_calls: false`` bounds a
"required" list to one call in that constraint, and keeps only the first call ``"auto"`` parses (as vLLM does).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from pagedllm.entrypoints.openai.errors import OpenAIError, bad_request
from pagedllm.entrypoints.openai.tool_parsers.base import ToolCall, random_tool_call_id
from pagedllm.sampling_params import StructuredOutputsParams

_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def _validated(
    params: StructuredOutputsParams, param: str, plan: ToolPlan | None = None
) -> StructuredOutputsParams:
    """``params`` if it compiles, else a 400 naming ``param``; for a tool plan's constraint, the 400 names the
    first tool whose parameters cannot be a constraint (``tools[i].function.parameters``)."""
    from pagedllm.structured_output.grammar import validate_structured_outputs

    try:
        validate_structured_outputs(params)
    except ValueError as e:
        if plan is not None:
            raise _tool_parameters_error(plan) or bad_request(str(e), param) from None
        raise bad_request(str(e), param) from None
    return params


def _tool_parameters_error(plan: ToolPlan) -> OpenAIError | None:
    """The 400 for the first tool of ``plan``'s constraint whose parameters schema is refused on its own."""
    from pagedllm.structured_output.grammar import validate_structured_outputs

    names = list(plan.parameters)  # in the order of the request's tools (names are unique)
    for name in [plan.named] if plan.mode == "named" else names:
        field_name = f"tools[{names.index(name)}].function.parameters"
        try:
            validate_structured_outputs(StructuredOutputsParams(json=plan.parameters[name]))
        except ValueError as e:
            return bad_request(str(e).replace("structured_outputs.json", field_name, 1), field_name)
    return None


def structured_outputs_from_request(req: Any) -> StructuredOutputsParams | None:
    """The request's output constraint, checked (xgrammar must accept it), or None."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            found.append(("response_format", StructuredOutputsParams(json_object=True)))
        else:
            if rf.json_schema is None or rf.json_schema.json_schema is None:
                raise bad_request(
                    'response_format of type "json_schema" needs json_schema.schema', "response_format"
                )
            found.append(("response_format", StructuredOutputsParams(json=rf.json_schema.json_schema)))
    so = getattr(req, "structured_outputs", None)
    if so is not None:
        if not isinstance(so, dict):
            raise bad_request("structured_outputs must be an object", "structured_outputs")
        known = {f.name for f in dataclasses.fields(StructuredOutputsParams)}
        unknown = sorted(set(so) - known)
        if unknown:
            raise bad_request(f"structured_outputs: unsupported keys {unknown}", "structured_outputs")
        try:
            found.append(("structured_outputs", StructuredOutputsParams(**so)))
        except ValueError as e:
            raise bad_request(str(e), "structured_outputs") from None
    for name, kind in _GUIDED.items():
        value = getattr(req, name, None)
        if value is not None:
            try:
                found.append((name, StructuredOutputsParams(**{kind: value})))
            except ValueError as e:
                raise bad_request(f"{name}: {e}", name) from None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise bad_request(f"give at most one output constraint; got {names}", found[1][0])
    if not found:
        return None
    param, params = found[0]
    return _validated(params, param)


# ---------------------------------------------------------------------------------------------- tools


@dataclass
class ToolPlan:
    """What a chat request's ``tools`` / ``tool_choice`` mean for this request."""

    mode: str = "none"  # "none" | "auto" | "required" | "named"
    tools: list[dict[str, Any]] | None = None  # what the chat template receives
    named: str | None = None  # the forced function's name ("named")
    constraint: StructuredOutputsParams | None = None  # "required" and "named"
    parameters: dict[str, dict[str, Any]] = field(default_factory=dict)  # function name -> parameters schema
    parallel: bool = True  # False: at most one call (the request's parallel_tool_calls is false)


def _parameters(tool: Any) -> dict[str, Any]:
    schema = tool.function.parameters
    return schema if schema is not None else {"type": "object", "properties": {}}


def plan_tools(req: Any, enable_auto_tool_choice: bool, tool_parser: str | None) -> ToolPlan:
    """Check ``tools`` and ``tool_choice`` (400s naming them) and build the request's plan."""
    tools = req.tools or []
    choice = req.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice is set but no tools were given", "tool_choice")
        return ToolPlan()
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools: function names must be unique", "tools")
    plan = ToolPlan(
        tools=[t.model_dump(exclude_none=True) for t in tools],
        parameters={t.function.name: _parameters(t) for t in tools},
        parallel=getattr(req, "parallel_tool_calls", None) is not False,
    )
    if choice is None:
        choice = "auto"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise bad_request(
                f'tool_choice must be "none", "auto", "required" or a named function, got {choice!r}',
                "tool_choice",
            )
        plan.mode = choice
    else:
        name = choice.function.name if choice.function is not None else None
        if name not in plan.parameters:
            raise bad_request(
                f"tool_choice names function {name!r}, which is not among the tools ({', '.join(names)})",
                "tool_choice",
            )
        plan.mode, plan.named = "named", name
    if plan.mode == "auto" and not (enable_auto_tool_choice and tool_parser):
        raise bad_request(
            '"auto" tool choice needs the server to run with --enable-auto-tool-choice and --tool-call-parser '
            '(or send tool_choice "none", "required" or a named function)',
            "tool_choice",
        )
    # Calls are read by programs, not people: compact JSON (no free whitespace) costs the fewest tokens.
    if plan.mode == "required":
        plan.constraint = StructuredOutputsParams(
            json=required_schema(plan.parameters, plan.parallel), disable_any_whitespace=True
        )
    elif plan.mode == "named":
        plan.constraint = StructuredOutputsParams(
            json=plan.parameters[plan.named], disable_any_whitespace=True
        )
    if plan.constraint is not None:
        _validated(plan.constraint, "tools", plan)
    return plan


def required_schema(parameters: dict[str, dict[str, Any]], parallel: bool | None) -> dict[str, Any]:
    """JSON schema of a non-empty list of calls ``[{"name": ..., "arguments": {...}}, ...]``: exactly one call
    when ``parallel`` is False (``maxItems`` 1), any number otherwise (None is the API's default, true)."""
    variants = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [name]}, "arguments": schema},
            "required": ["name", "arguments"],
        }
        for name, schema in parameters.items()
    ]
    items = variants[0] if len(variants) == 1 else {"anyOf": variants}
    schema: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
    if parallel is False:
        schema["maxItems"] = 1
    return schema


def calls_from_constrained_output(plan: ToolPlan, text: str) -> list[ToolCall]:
    """The calls in a "required" / "named" output. A named call's arguments are the text as generated (what
    streaming sends piece by piece). A "required" list gives its complete calls, in order: all of them when the
    constraint completed it, those before the cut when max_tokens cut it short (each one the grammar finished is
    a valid call; the unfinished one is left out)."""
    if plan.mode == "named":
        return [ToolCall(random_tool_call_id(), plan.named, text)]
    calls = []
    for value in _complete_list_items(text):
        if not (isinstance(value, dict) and isinstance(value.get("name"), str) and "arguments" in value):
            break
        arguments = json.dumps(value["arguments"], ensure_ascii=False)
        calls.append(ToolCall(random_tool_call_id(), value["name"], arguments))
    return calls


def _complete_list_items(text: str) -> list[Any]:
    """The items of a JSON list that are complete in ``text`` (a whole list, or one cut anywhere)."""
    decoder = json.JSONDecoder()
    pos = _skip_space(text, 0)
    if not text.startswith("[", pos):
        return []
    items: list[Any] = []
    pos = _skip_space(text, pos + 1)
    while pos < len(text) and text[pos] != "]":
        try:
            value, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break  # cut inside this item
        items.append(value)
        pos = _skip_space(text, pos)
        if text.startswith(",", pos):
            pos = _skip_space(text, pos + 1)
        elif not text.startswith("]", pos):
            break
    return items


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def tool_call_dict(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def check_no_conflict(plan: ToolPlan, constraint: StructuredOutputsParams | None) -> None:
    if plan.constraint is not None and constraint is not None:
        raise bad_request(
            'tool_choice "required" or a named function cannot be combined with another output constraint',
            "tool_choice",
        )
