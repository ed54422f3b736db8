"""Incremental detokenization and stop-string search.

Decoding a growing token list from scratch every step costs O(length) per step. ``IncrementalDetokenizer``
instead decodes a small window of token ids around the new ones (vLLM's prefix/read offsets):

    ids:     ... | p p p | r r r r | n
                 ^prefix  ^read      ^new token
    prefix_text = decode(ids[prefix:read])      text already emitted, decoded again only as context
    window_text = decode(ids[prefix:])          the same context plus the new token(s)
    delta       = window_text[len(prefix_text):]

Decoding with context keeps leading spaces right (SentencePiece drops the space of a text's first piece) and
keeps multi-byte characters whole: byte-level BPE may split one UTF-8 character over several tokens, and
while its bytes are incomplete the window decodes to text ending in U+FFFD. Then nothing is emitted and the
offsets stay put, so the next token is decoded together with the pending ones. Once the delta is emitted,
``prefix`` moves to the old ``read`` and ``read`` to the end; ids before ``prefix`` are dropped, so the
window (and the work per token) stays a few tokens long.
"""

from __future__ import annotations

from pagedllm.tokenizer import AnyTokenizer, make_decode_fn

# Prompt tokens kept as left context for the first generated token (vLLM uses 5 as well).
PROMPT_CONTEXT_TOKENS = 5

_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one sequence's generated token ids into text, a few tokens at a time.

    ``output_text`` holds only generated text (the prompt is context, never part of it). ``add_tokens`` returns
    what it appended. Text whose last character is still incomplete is held back until a later token completes
    it, or until ``flush()`` (call it when the sequence finishes) emits it as decoded, U+FFFD included.
    """

    def __init__(
        self,
        tokenizer: AnyTokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self._decode = make_decode_fn(tokenizer, skip_special_tokens, spaces_between_special_tokens)
        # The window: ids[prefix_offset:] is all that is ever decoded again; earlier ids are dropped.
        self._ids: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text: str | None = None  # decode(ids[prefix:read]), cached until the offsets move
        self.output_text = ""
        self.num_tokens = 0  # generated tokens fed in so far

    def add_tokens(self, new_token_ids: list[int]) -> str:
        """Append ``new_token_ids`` and return the text they completed (possibly "")."""
        pieces = []
        for token_id in new_token_ids:
            self._ids.append(token_id)
            piece = self._decode_window(final=False)
            if piece:
                pieces.append(piece)
        self.num_tokens += len(new_token_ids)
        delta = "".join(pieces)
        self.output_text += delta
        return delta

    def flush(self) -> str:
        """Emit any held-back text (an incomplete character decodes to U+FFFD) and return it."""
        delta = self._decode_window(final=True) if len(self._ids) > self._read_offset else ""
        self.output_text += delta
        return delta

    def truncate(self, length: int) -> None:
        """Cut ``output_text`` to ``length`` characters (after a stop string); the window is left alone."""
        self.output_text = self.output_text[:length]

    def _decode_window(self, final: bool) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        prefix_text = self._prefix_text
        window_text = self._decode(self._ids[self._prefix_offset :])
        if len(window_text) <= len(prefix_text) or (not final and window_text.endswith(_REPLACEMENT_CHAR)):
            # Nothing new yet (a skipped special token) or an incomplete character: hold the token(s).
            return ""
        # Advance: the old read offset becomes the prefix start; drop ids before it.
        del self._ids[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = None
        return window_text[len(prefix_text) :]


def check_stop_strings(
    output_text: str, new_char_count: int, stop: list[str], include_stop_str_in_output: bool
) -> tuple[str, int] | None:
    """Find a stop string that ends in the last ``new_char_count`` characters of ``output_text``.

    Earlier text was searched on earlier calls, so only the tail that can hold a new match is searched (per
    stop string ``s``: the last ``new_char_count + len(s) - 1`` characters); matches that span token boundaries
    are found. Returns ``(stop_str, truncate_to)``, where ``output_text[:truncate_to]`` is the text to keep
    (ending just before the stop string, or just after it when ``include_stop_str_in_output``), or None.
    The earliest match wins; at the same position, the first stop string in ``stop``.
    """
    if new_char_count <= 0 or not stop:
        return None
    text_len = len(output_text)
    found: tuple[str, int] | None = None
    for stop_str in stop:
        start = max(0, text_len - new_char_count - len(stop_str) + 1)
        index = output_text.find(stop_str, start)
        if index != -1 and (found is None or index < found[1]):
            found = (stop_str, index)
    if found is None:
        return None
    stop_str, index = found
    return stop_str, index + len(stop_str) if include_stop_str_in_output else index
