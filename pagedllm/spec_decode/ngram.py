"""N-gram (prompt lookup) draft proposer with vLLM's ``method="ngram"`` semantics.

For ``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``, the last ``n`` tokens of a request's history
(prompt + output so far) form a pattern. The proposer looks for the *earliest* earlier occurrence of that pattern
(one that ends before the final position, so not the suffix itself; it may overlap the suffix) and proposes the
up to ``k`` tokens that followed it. The first ``n`` with an occurrence wins; no occurrence gives no draft.

Equivalently: among all end positions ``e <= len - 2``, let ``m(e)`` be how many tokens ending at ``e`` match
the history's suffix (capped at ``prompt_lookup_max``); the draft follows the earliest ``e`` with the largest
``m(e)``, provided that ``m(e) >= prompt_lookup_min``. That form is computed here with a handful of vectorized
numpy passes (one per pattern position), so one call on a 4k-token history takes tens of microseconds.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_EMPTY = np.empty(0, dtype=np.int64)


class NgramProposer:
    """Proposes up to ``num_speculative_tokens`` draft tokens per request by prompt lookup.

    Stateless: each call looks only at the history it is given, so one instance serves every request.
    """

    def __init__(
        self, num_speculative_tokens: int, prompt_lookup_min: int = 1, prompt_lookup_max: int = 4
    ) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if prompt_lookup_min < 1:
            raise ValueError(f"prompt_lookup_min must be >= 1, got {prompt_lookup_min}")
        if prompt_lookup_max < prompt_lookup_min:
            raise ValueError(
                f"prompt_lookup_max ({prompt_lookup_max}) must be >= prompt_lookup_min ({prompt_lookup_min})"
            )
        self.num_speculative_tokens = num_speculative_tokens
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max

    def propose(self, token_ids: np.ndarray | Sequence[int]) -> np.ndarray:
        """Draft tokens for one request.

        ``token_ids``: the request's prompt + output tokens so far, 1-D. Returns a new 1-D int64 array of
        0..``num_speculative_tokens`` tokens (fewer than ``k`` when the match sits near the end of the history).
        """
        tokens = np.asarray(token_ids, dtype=np.int64)  # [num_tokens]
        if tokens.ndim != 1:
            raise ValueError(f"token_ids must be 1-D, got shape {tokens.shape}")
        num_tokens = tokens.shape[0]
        # An occurrence of a length-n pattern must end at or before num_tokens - 2, so start at >= 0: n <= len - 1.
        max_n = min(self.prompt_lookup_max, num_tokens - 1)
        if max_n < self.prompt_lookup_min:
            return _EMPTY.copy()

        num_ends = num_tokens - 1  # candidate end positions e = 0 .. num_tokens - 2
        # match_len[e]: how many tokens ending at e equal the suffix's last tokens, in order, capped at max_n.
        match_len = np.zeros(num_ends, dtype=np.int64)  # [num_ends]
        alive = np.ones(num_ends, dtype=bool)  # [num_ends], still matching at every offset so far
        for t in range(max_n):
            # tokens[e - t] == tokens[num_tokens - 1 - t]; ends e < t have no token at e - t.
            alive[:t] = False
            alive[t:] &= tokens[: num_ends - t] == tokens[num_tokens - 1 - t]
            if not alive.any():
                break
            match_len += alive
        best = int(match_len.max())
        if best < self.prompt_lookup_min:
            return _EMPTY.copy()
        end = int(np.argmax(match_len == best))  # earliest occurrence of the longest matching pattern
        return tokens[end + 1 : end + 1 + self.num_speculative_tokens].copy()

    def propose_batch(self, token_ids: Sequence[np.ndarray | Sequence[int]]) -> list[np.ndarray]:
        """``propose`` for each request's history, in order."""
        return [self.propose(ids) for ids in token_ids]
