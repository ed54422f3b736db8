"""Sampler: one token per row from a batch of logits, with vLLM's semantics.

Order of operations (each step skipped when no row uses it)::

    raw logits ──────────────────────────────────────────────────────────────► logprobs (log_softmax, fp32)
        │ grammar bitmask (structured outputs), allowed_token_ids, bad words, min_tokens (-inf); logit_bias (+)
        │   (min_tokens never empties a row: when only eos / stop tokens are left, a grammar that must end, they stay)
        │ penalties: repetition (prompt + output), frequency, presence
        ├─► argmax ──► greedy rows
        │ / temperature; min-p; top-k; top-p
        └─► softmax ──► exponential race (per-row generator for seeded rows) ──► random rows

On CUDA, a batch whose random rows are all unseeded and use no top-k, top-p or min-p (temperature only) samples
them in one pass instead (Gumbel-max, ``pagedllm/kernels/gumbel_sample.py``): same law, no fp32 copies of the
logits unless an edit above needs one. That pass also reads a grammar bitmask when it is the only edit and every row
is random.

Logprobs are "raw": computed from the model's logits before any of the processing above.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.core.sched_output import LogprobsLists
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.ops import (
    apply_min_p_,
    apply_penalties_,
    apply_token_bitmask_,
    apply_top_k_only_,
    apply_top_k_top_p,
    random_sample,
)


def _fused_random(logits: torch.Tensor, metadata: SamplingMetadata) -> bool:
    """Whether the random rows take the one-pass Gumbel-max kernel (module docstring)."""
    from pagedllm.platform import use_fused_kernels

    return (
        not metadata.all_greedy
        and not metadata.generators
        and metadata.no_top_k
        and metadata.no_top_p
        and metadata.no_min_p
        and logits.stride(-1) == 1
        and use_fused_kernels(logits)
    )


def _only_grammar_edit(metadata: SamplingMetadata) -> bool:
    """Whether a grammar bitmask is the only edit of the logits (no other mask, ban, bias or penalty)."""
    return (
        metadata.grammar_bitmask is not None
        and metadata.no_penalties
        and metadata.allowed_token_mask is None
        and metadata.banned_token_index is None
        and metadata.min_tokens_index is None
        and metadata.logit_bias_index is None
    )


@dataclass
class LogprobsTensors:
    """Logprobs of one token per row plus the row's top-k. Column 0 is the row's own (sampled or prompt)
    token, columns 1..k the k most likely tokens in descending order."""

    token_ids: torch.Tensor  # [num_rows, k + 1] int64
    logprobs: torch.Tensor  # [num_rows, k + 1] float32
    ranks: torch.Tensor  # [num_rows] int64, 1-based rank of column 0 (1 + count of strictly likelier tokens)

    def to_host_async(self) -> LogprobsTensors:
        """Pinned host copies, filled by non-blocking copies (read them after the stream passes this point)."""

        def host(t: torch.Tensor) -> torch.Tensor:
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return out.copy_(t, non_blocking=True)

        return LogprobsTensors(host(self.token_ids), host(self.logprobs), host(self.ranks))

    def tolists(self) -> LogprobsLists:
        """Copy to plain lists (one host sync) so the result can cross a process boundary."""
        return LogprobsLists(
            token_ids=self.token_ids.tolist(), logprobs=self.logprobs.tolist(), ranks=self.ranks.tolist()
        )


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [num_reqs] int64, on the logits' device
    logprobs: LogprobsTensors | None  # None unless some row asked for logprobs


def compute_logprobs_topk(
    logits: torch.Tensor,  # [num_rows, vocab_size], any float dtype
    token_ids: torch.Tensor,  # [num_rows] int64
    k: int,
) -> LogprobsTensors:
    """Log-softmax (in float32) of ``logits``; the logprob and rank of ``token_ids`` and the top ``k`` tokens."""
    logprobs = logits.float().log_softmax(dim=-1)  # [num_rows, vocab_size]
    token_ids = token_ids.unsqueeze(1)  # [num_rows, 1]
    token_logprobs = logprobs.gather(1, token_ids)  # [num_rows, 1]
    ranks = (logprobs > token_logprobs).sum(dim=-1) + 1  # [num_rows]
    if k > 0:
        top_logprobs, top_ids = logprobs.topk(k, dim=-1)  # [num_rows, k] each
        token_ids = torch.cat([token_ids, top_ids], dim=1)  # [num_rows, k + 1]
        token_logprobs = torch.cat([token_logprobs, top_logprobs], dim=1)  # [num_rows, k + 1]
    return LogprobsTensors(token_ids=token_ids, logprobs=token_logprobs, ranks=ranks)


class Sampler(nn.Module):
    """Samples one token per row. Never modifies the caller's logits; no host syncs in ``forward``."""

    def forward(
        self,
        logits: torch.Tensor,  # [num_reqs, vocab_size], float32 (other float dtypes are upcast)
        metadata: SamplingMetadata,
    ) -> SamplerOutput:
        raw_logits = logits
        fused = _fused_random(logits, metadata)
        # A grammar bitmask, when it is the only edit and no row takes the argmax, is read by the fused pass itself.
        fold_mask = fused and metadata.all_random and _only_grammar_edit(metadata)
        edit = metadata.needs_logits_edit and not fold_mask
        if edit or not fused:  # (the fused path reads any float dtype)
            logits = logits.float()  # [num_reqs, vocab_size]; aliases the input when it is already float32
        if edit:
            if logits is raw_logits:
                logits = logits.clone()
            self._edit_logits_(logits, metadata)

        greedy_ids = None if metadata.all_random else logits.argmax(dim=-1)  # [num_reqs]
        if metadata.all_greedy:
            sampled = greedy_ids
        else:
            if fused:
                from pagedllm.kernels.gumbel_sample import gumbel_sample

                seed = int(torch.randint(2**31 - 1, (1,)))  # the default CPU generator: seeded runs repeat
                mask = metadata.grammar_bitmask if fold_mask else None
                random_ids = gumbel_sample(logits, metadata.temperature, seed, mask)  # [num_reqs]
            else:
                random_ids = self._sample_random(logits, metadata, owned=logits is not raw_logits)  # [num_reqs]
            if greedy_ids is None:
                sampled = random_ids
            else:
                sampled = torch.where(metadata.greedy_mask, greedy_ids, random_ids)

        logprobs = None
        if metadata.max_num_logprobs is not None:
            logprobs = compute_logprobs_topk(raw_logits, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    @staticmethod
    def _edit_logits_(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
        """Masks, bias and penalties, in place: everything that can change the greedy choice."""
        neg_inf = float("-inf")
        if metadata.grammar_bitmask is not None:
            apply_token_bitmask_(logits, metadata.grammar_bitmask)
        if metadata.allowed_token_mask is not None:
            logits.masked_fill_(metadata.allowed_token_mask, neg_inf)
        if metadata.banned_token_index is not None:
            rows, cols = metadata.banned_token_index  # [num_banned] each
            logits[rows, cols] = neg_inf
        if metadata.min_tokens_index is not None:
            # Held back until min_tokens, unless nothing else is left: a grammar that has completed allows only
            # the stop tokens, and the constraint wins over min_tokens (the request then stops; vLLM does the same).
            rows, cols = metadata.min_tokens_index  # [num_held] each
            held = logits[rows, cols]  # [num_held]
            logits[rows, cols] = neg_inf
            empty = logits.amax(dim=-1) == neg_inf  # [num_reqs]
            logits[rows, cols] = torch.where(empty[rows], held, neg_inf)
        if metadata.logit_bias_index is not None:
            rows, cols = metadata.logit_bias_index  # [num_bias] each
            logits.index_put_((rows, cols), metadata.logit_bias_values, accumulate=True)
        if not metadata.no_penalties:
            apply_penalties_(
                logits,
                metadata.output_token_counts,
                metadata.prompt_token_mask,
                metadata.presence_penalties,
                metadata.frequency_penalties,
                metadata.repetition_penalties,
            )

    def processed_logits(
        self,
        logits: torch.Tensor,  # [num_rows, vocab_size], any float dtype
        metadata: SamplingMetadata,
    ) -> torch.Tensor:  # [num_rows, vocab_size] float32, a new tensor
        """The logits every row samples from: greedy rows get masks, bias and penalties (their argmax is the greedy
        token); random rows also temperature, min-p, top-k and top-p (their softmax is the sampling distribution).
        Speculative decoding verifies drafts against these."""
        processed = logits.float()
        if processed is logits:
            processed = processed.clone()
        if metadata.needs_logits_edit:
            self._edit_logits_(processed, metadata)
        if metadata.all_greedy:
            return processed
        return self._filter_random(processed, metadata, owned=True)

    @classmethod
    def _sample_random(
        cls,
        logits: torch.Tensor,  # [num_reqs, vocab_size] float32
        metadata: SamplingMetadata,
        owned: bool,  # whether ``logits`` may be modified in place
    ) -> torch.Tensor:  # [num_reqs] int64
        probs = cls._filter_random(logits, metadata, owned).softmax(dim=-1)  # [num_reqs, vocab_size]
        return random_sample(probs, metadata.generators)

    @staticmethod
    def _filter_random(
        logits: torch.Tensor,  # [num_reqs, vocab_size] float32
        metadata: SamplingMetadata,
        owned: bool,  # whether ``logits`` may be modified in place
    ) -> torch.Tensor:  # [num_reqs, vocab_size] float32: temperature applied, filtered tokens at -inf
        # min-p and top-k-only work in place; top-p (sort path) and temperature make a new tensor.
        in_place = not metadata.no_min_p or (metadata.no_top_p and not metadata.no_top_k)
        if metadata.temperature is not None:
            logits = logits / metadata.temperature.unsqueeze(1)  # [num_reqs, vocab_size], new tensor
        elif in_place and not owned:
            logits = logits.clone()
        if not metadata.no_min_p:
            apply_min_p_(logits, metadata.min_p)
        if not metadata.no_top_p:
            logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
        elif not metadata.no_top_k:
            apply_top_k_only_(logits, metadata.top_k, metadata.max_top_k)
        return logits
