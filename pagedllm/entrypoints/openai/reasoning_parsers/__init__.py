"""Reasoning parsers of the chat endpoint, by name (``--reasoning-parser``)."""

from __future__ import annotations

from pagedllm.entrypoints.openai.reasoning_parsers.base import ReasoningParser
from pagedllm.entrypoints.openai.reasoning_parsers.deepseek_r1 import DeepSeekR1ReasoningParser
from pagedllm.entrypoints.openai.reasoning_parsers.qwen3 import Qwen3ReasoningParser
from pagedllm.entrypoints.openai.tool_parsers.base import lookup_parser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class registered as ``name``; ValueError naming the valid names otherwise."""
    return lookup_parser(REASONING_PARSERS, name, "reasoning parser")


__all__ = [
    "REASONING_PARSERS",
    "DeepSeekR1ReasoningParser",
    "Qwen3ReasoningParser",
    "ReasoningParser",
    "get_reasoning_parser",
]
