"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with the right HTTP status.

400 invalid_request_error (bad parameter, malformed JSON, prompt over the context), 401 invalid_api_key,
404 model_not_found / not_found, 503 engine_dead. ``param`` names the offending field the way the client wrote it
(``messages[0].role``, ``top_p``), or is null when no single field is to blame.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import ValidationError
from starlette.responses import JSONResponse


class OpenAIError(Exception):
    """Raised by request handlers; rendered by ``error_response``."""

    def __init__(
        self,
        message: str,
        *,
        status_code: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type
        self.param = param
        self.code = code

    def to_dict(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def error_response(err: OpenAIError) -> JSONResponse:
    return JSONResponse(err.to_dict(), status_code=err.status_code)


def error_json_bytes(err: OpenAIError) -> bytes:
    return json.dumps(err.to_dict()).encode()


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(message, status_code=400, param=param)


def engine_dead(message: str) -> OpenAIError:
    return OpenAIError(message, status_code=503, type="server_error", code="engine_dead")


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    """('messages', 0, 'role') -> 'messages[0].role'; pydantic's union-branch names are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str):
            # Union branches show up as 'str', 'list[int]', 'function-after[...]': not field names.
            if not re.fullmatch(r"[A-Za-z_]\w*", part) or part in (
                "str",
                "int",
                "float",
                "bool",
                "list",
                "dict",
            ):
                continue
            out += f".{part}" if out else part
    return out or None


def from_validation_error(err: ValidationError) -> OpenAIError:
    """The first problem pydantic found, with its field path as ``param``."""
    errors = err.errors(include_url=False)
    if not errors:
        return bad_request(str(err))
    first = errors[0]
    param = _loc_to_param(tuple(first.get("loc", ())))
    msg = first.get("msg", "invalid value")
    if first.get("type") == "missing":
        message = f"{param} is required" if param else "a required field is missing"
    else:
        message = f"{param}: {msg}" if param else msg
    more = len(errors) - 1
    if more:
        message += f" (and {more} more problem{'s' if more > 1 else ''})"
    return bad_request(message, param)


_LEADING_NAME = re.compile(r"^([A-Za-z_]\w*(?:\[\d+\])*(?:\.[A-Za-z_]\w*(?:\[\d+\])*)*)")


def from_value_error(err: ValueError, known: dict[str, str | None] | set[str] | None = None) -> OpenAIError:
    """A ValueError from the engine or ``SamplingParams`` (whose messages start with the field's name).

    ``known`` maps engine-side names to the request's field names (``{"prompt_token_ids": "prompt"}``); a set
    means the names are the same. A leading name not in ``known`` gives ``param`` null.
    """
    message = str(err)
    param = None
    m = _LEADING_NAME.match(message)
    if m and known is not None:
        name = m.group(1)
        root = re.split(r"[.\[]", name, maxsplit=1)[0]
        if isinstance(known, dict):
            if root in known:
                mapped = known[root]
                # Same name: keep the sub-path ("messages[0].role"); renamed: the request's field.
                param = name if mapped == root else mapped
        elif root in known:
            param = name
    return bad_request(message, param)
