"""DeepSeek-R1 reasoning: the chat template ends the prompt with ``<think>``, so the output starts inside the
reasoning (a leading ``<think>`` is dropped if the model repeats it). Everything before ``</think>`` is
reasoning, everything after is content; an output without ``</think>`` (say, cut by ``max_tokens``) is all
reasoning, so reasoning streams at once."""

from __future__ import annotations

from typing import ClassVar

from pagedllm.entrypoints.openai.reasoning_parsers.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    name: ClassVar[str] = "deepseek_r1"
    reasoning_without_end: ClassVar[bool] = True
