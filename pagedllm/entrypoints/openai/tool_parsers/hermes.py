"""Hermes-style tool calls (Qwen2.5, Qwen3, Hermes 2/3):

    Some text.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_time", "arguments": {}}
    </tool_call>

Decisions: ``arguments`` may be missing (-> "{}"), ``parameters`` is accepted in its place. A final
``<tool_call>`` block without ``</tool_call>`` counts when the rest of the output is exactly one complete call
(models sometimes stop at EOS first); if it is not, the output is malformed. A block ends at the first
``</tool_call>``, even one inside a JSON string. Text between and after the blocks is dropped, as vLLM does;
the content is the text before the first block, less trailing whitespace.
"""

from __future__ import annotations

import json
from typing import ClassVar

from pagedllm.entrypoints.openai.tool_parsers.base import ToolParser, call_from_object, content_before_marker


class HermesToolParser(ToolParser):
    name: ClassVar[str] = "hermes"
    start_marker: ClassVar[str] = "<tool_call>"
    end_marker: ClassVar[str] = "</tool_call>"

    def _parse(self, model_output: str) -> list[tuple[str, str]] | None:
        start, end = self.start_marker, self.end_marker
        pos = model_output.find(start)
        if pos < 0:
            return None
        calls = []
        while pos >= 0:
            body_start = pos + len(start)
            close = model_output.find(end, body_start)
            body = model_output[body_start : close if close >= 0 else len(model_output)]
            try:
                call = call_from_object(json.loads(body))
            except (ValueError, RecursionError):
                return None
            if call is None:
                return None
            calls.append(call)
            if close < 0:
                break
            pos = model_output.find(start, close + len(end))
        return calls

    def _content_before_calls(self, model_output: str) -> str:
        return model_output[: model_output.find(self.start_marker)].rstrip()

    def _settled_content(self, text: str) -> str:
        return content_before_marker(text, self.start_marker)
