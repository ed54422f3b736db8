"""Reasoning parsers: split a model output into ``reasoning_content`` (inside ``<think>`` ... ``</think>``)
and ``content`` (after ``</think>``).

Shared rules: an optional ``<think>`` at the very start of the output is dropped (templates often put it in
the prompt, so the output usually starts inside the reasoning); the reasoning ends at the first
``</think>``; leading newlines of the content after ``</think>`` are dropped (models emit ``</think>\\n\\n``);
empty parts are None. What an output *without* ``</think>`` means is each model family's choice
(``reasoning_without_end``).

Streaming agrees with ``extract_reasoning`` under every split of the output: text that could still be the
start of ``<think>`` (at the start) or of ``</think>`` is held back until the next piece tells.
"""

from __future__ import annotations

from typing import ClassVar

from pagedllm.entrypoints.openai.tool_parsers.base import DeltaMessage, partial_marker_length

_START, _REASONING, _UNDECIDED, _CONTENT = "start", "reasoning", "undecided", "content"


class ReasoningParser:
    """Base class: one instance per request (it holds the streaming state)."""

    name: ClassVar[str]
    start_token: ClassVar[str] = "<think>"
    end_token: ClassVar[str] = "</think>"
    #: Whether an output that does not start with ``<think>`` and has no ``</think>`` is all reasoning
    #: (True) or all content (False).
    reasoning_without_end: ClassVar[bool] = True

    def __init__(self) -> None:
        self._phase = _START
        self._buf = ""  # received text not yet sent
        self._scan = 0  # where to look for end_token in _buf next (earlier positions hold none)
        self._content_started = False
        self._finished = False

    def is_reasoning_end(self, text: str) -> bool:
        """Whether ``text`` (the output so far) already closed the reasoning, i.e. holds ``</think>``."""
        return self.end_token in text

    def extract_reasoning(self, model_output: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole output."""
        explicit = model_output.startswith(self.start_token)
        text = model_output[len(self.start_token) :] if explicit else model_output
        end = text.find(self.end_token)
        if end < 0:
            if explicit or self.reasoning_without_end:
                return text or None, None
            return None, model_output or None
        return text[:end] or None, text[end + len(self.end_token) :].lstrip("\n") or None

    def extract_reasoning_streaming(self, delta_text: str) -> DeltaMessage | None:
        """Feed the next piece of output; returns what can be sent now, or None."""
        if self._finished:
            raise RuntimeError("extract_reasoning_streaming called after finish_streaming")
        if not delta_text:
            return None
        self._buf += delta_text
        return self._step(final=False)

    def finish_streaming(self) -> DeltaMessage | None:
        """End of output: send what is held back."""
        if self._finished:
            return None
        self._finished = True
        return self._step(final=True)

    def _step(self, final: bool) -> DeltaMessage | None:
        reasoning = content = ""
        if self._phase == _START:
            start = self.start_token
            if len(self._buf) < len(start) and start.startswith(self._buf) and not final:
                return None  # may still become <think>
            if self._buf.startswith(start):
                self._buf = self._buf[len(start) :]
                self._phase = _REASONING
            else:
                self._phase = _REASONING if self.reasoning_without_end else _UNDECIDED
        if self._phase in (_REASONING, _UNDECIDED):
            end = self._buf.find(self.end_token, self._scan)
            if end >= 0:
                reasoning = self._buf[:end]
                self._buf = self._buf[end + len(self.end_token) :]
                self._phase = _CONTENT
            elif final:  # no </think>: all reasoning, or (undecided) all content
                if self._phase == _REASONING:
                    reasoning = self._buf
                else:
                    content = self._buf
                self._buf = ""
            elif self._phase == _REASONING:  # send all but a possible partial </think>
                keep = partial_marker_length(self._buf, self.end_token)
                reasoning, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep :]
                self._scan = 0
            else:  # undecided: hold everything until </think> or the end
                self._scan = max(0, len(self._buf) - len(self.end_token) + 1)
        if self._phase == _CONTENT:
            piece, self._buf = self._buf, ""
            if not self._content_started:
                piece = piece.lstrip("\n")
                self._content_started = bool(piece)
            content += piece
        if not reasoning and not content:
            return None
        return DeltaMessage(content=content or None, reasoning_content=reasoning or None)
