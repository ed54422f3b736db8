"""Qwen3 reasoning: like DeepSeek-R1, except that an output with no ``</think>`` at all is all content and no
reasoning (the request switched thinking off: ``enable_thinking=False`` puts an empty think block in the
prompt), unless it starts with ``<think>``, in which case it is all reasoning (cut before ``</think>``).

Streaming trade-off: an output that does not start with ``<think>`` may be reasoning (the template put
``<think>`` in the prompt: Qwen3 "thinking" models) or content (thinking off), and only a later ``</think>``
or the end of the stream tells. Until then nothing is sent: with thinking off the whole answer arrives in
the last chunk. (A server that knows from the request which case it is can skip the parser instead.)
"""

from __future__ import annotations

from typing import ClassVar

from pagedllm.entrypoints.openai.reasoning_parsers.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    name: ClassVar[str] = "qwen3"
    reasoning_without_end: ClassVar[bool] = False
