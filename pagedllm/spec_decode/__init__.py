"""Speculative decoding building blocks (vLLM-compatible, exact).

- ``NgramProposer``: prompt-lookup drafts (vLLM's ``method="ngram"``), on the host with numpy.
- ``rejection_sample``: verifies drafts against the target model's logits so that every emitted token is
  distributed exactly as if sampled from the target alone (greedy rows: exact argmax agreement).
"""

from pagedllm.spec_decode.ngram import NgramProposer
from pagedllm.spec_decode.rejection_sampler import PLACEHOLDER_TOKEN_ID, rejection_sample

__all__ = ["PLACEHOLDER_TOKEN_ID", "NgramProposer", "rejection_sample"]
