"""Tool-call parsers of the chat endpoint, by name (``--tool-call-parser``)."""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.base import (
    DeltaMessage,
    ExtractedToolCalls,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    lookup_parser,
)
from pagedllm.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagedllm.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from pagedllm.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from pagedllm.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser)
}


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as ``name``; ValueError naming the valid names otherwise."""
    return lookup_parser(TOOL_PARSERS, name, "tool call parser")


__all__ = [
    "TOOL_PARSERS",
    "DeltaMessage",
    "ExtractedToolCalls",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "PythonicToolParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "get_tool_parser",
]
