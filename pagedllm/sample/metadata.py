"""Per-step sampling tensors for a batch of rows, built once on the host and copied to the device.

Row i of the batch is one request that needs a token this step. Every feature is optional: its tensors are
``None`` and its flag says so when no row uses it, and the sampler then skips that work entirely.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pagedllm.sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    # --- which kinds of rows the batch holds
    all_greedy: bool  # every row is greedy (temperature 0): the sampler only takes an argmax
    all_random: bool  # no row is greedy
    greedy_mask: torch.Tensor | None = (
        None  # [num_reqs] bool, True for greedy rows; None if all greedy/random
    )
    temperature: torch.Tensor | None = None  # [num_reqs] float32, 1.0 on greedy rows; None: no scaling needed
    generators: dict[int, torch.Generator] = field(
        default_factory=dict
    )  # row -> generator, seeded random rows

    # --- filters applied after temperature (random rows only; greedy rows hold the "disabled" value)
    no_top_k: bool = True
    no_top_p: bool = True
    no_min_p: bool = True
    top_k: torch.Tensor | None = None  # [num_reqs] int64, vocab_size where disabled; None when no_top_k
    max_top_k: int = 0  # largest enabled top_k (host int, sizes torch.topk); 0 when no_top_k
    top_p: torch.Tensor | None = None  # [num_reqs] float32, 1.0 where disabled; None when no_top_p
    min_p: torch.Tensor | None = None  # [num_reqs] float32, 0.0 where disabled; None when no_min_p

    # --- penalties (applied before temperature, to greedy rows too)
    no_penalties: bool = True
    presence_penalties: torch.Tensor | None = None  # [num_reqs] float32
    frequency_penalties: torch.Tensor | None = None  # [num_reqs] float32
    repetition_penalties: torch.Tensor | None = None  # [num_reqs] float32
    output_token_counts: torch.Tensor | None = None  # [num_reqs, vocab_size] int32, occurrences in the output
    prompt_token_mask: torch.Tensor | None = (
        None  # [num_reqs, vocab_size] bool; None unless a rep. penalty != 1
    )

    # --- masks and biases (applied before penalties, to greedy rows too)
    allowed_token_mask: torch.Tensor | None = None  # [num_reqs, vocab_size] bool, True = not allowed
    banned_token_index: torch.Tensor | None = None  # [2, num_banned] int64 (row, token) set to -inf: bad words
    # [2, num_held] int64 (row, token): eos / stop tokens held back until min_tokens, set to -inf unless that
    # leaves the row nothing to sample (a grammar that only lets it stop): then the constraint wins, they stay
    min_tokens_index: torch.Tensor | None = None
    logit_bias_index: torch.Tensor | None = None  # [2, num_bias] int64 (row, token)
    logit_bias_values: torch.Tensor | None = None  # [num_bias] float32, added at logit_bias_index

    # --- structured outputs (applied first, to greedy rows too)
    grammar_bitmask: torch.Tensor | None = None  # [num_reqs, ceil(vocab_size / 32)] int32, bit set = allowed

    # --- logprobs
    max_num_logprobs: int | None = None  # largest params.logprobs over rows; None when no row wants logprobs

    @property
    def needs_logits_edit(self) -> bool:
        """Whether anything changes the logits before the greedy argmax (masks, bias, penalties)."""
        return not self.no_penalties or any(
            t is not None
            for t in (
                self.grammar_bitmask,
                self.allowed_token_mask,
                self.banned_token_index,
                self.min_tokens_index,
                self.logit_bias_index,
            )
        )


def _bad_word_bans(bad_words_token_ids: list[list[int]], output_token_ids: list[int]) -> list[int]:
    """Tokens to ban next: a one-token bad word always; a longer one when the output ends with its prefix."""
    banned = []
    for word in bad_words_token_ids:
        if not word:
            continue
        prefix = word[:-1]
        if len(prefix) <= len(output_token_ids) and (
            not prefix or output_token_ids[len(output_token_ids) - len(prefix) :] == prefix
        ):
            banned.append(word[-1])
    return banned


def _pad(rows: list[list[int]], pad: int) -> list[list[int]]:
    width = max(1, max((len(r) for r in rows), default=0))
    return [r + [pad] * (width - len(r)) for r in rows]


def _token_presence(
    rows: list[list[int]], vocab_size: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:  # [num_reqs, vocab_size]
    """Per-row token counts (int32) or presence (bool), built on the device from one padded copy."""
    padded = torch.tensor(_pad(rows, vocab_size), dtype=torch.int64, device=device)  # [num_reqs, max_len]
    out = torch.zeros(len(rows), vocab_size + 1, dtype=dtype, device=device)  # [num_reqs, vocab_size + 1]
    if dtype == torch.bool:
        out.scatter_(1, padded, True)
    else:
        out.scatter_add_(1, padded, torch.ones_like(padded, dtype=dtype))
    return out[:, :vocab_size]  # the pad column absorbed the padding


def build_sampling_metadata(
    params: list[SamplingParams],
    output_token_ids: list[list[int]],
    prompt_token_ids: list[list[int]],
    generators: list[torch.Generator | None],
    eos_token_ids: list[int | None],
    vocab_size: int,
    device: torch.device,
) -> SamplingMetadata:
    """Gather row i's ``params[i]`` and token history into batched device tensors.

    ``generators[i]`` is row i's generator (on ``device``) when the request is seeded; it is only used when
    row i samples randomly. Host-side work is O(num_reqs) plus the token lists of rows using the feature
    that needs them (penalties, bad words).
    """
    num_reqs = len(params)
    if not (
        len(output_token_ids) == len(prompt_token_ids) == len(generators) == len(eos_token_ids) == num_reqs
    ):
        raise ValueError("build_sampling_metadata: all per-row lists must have one entry per row")

    def per_row(values: list, dtype: torch.dtype) -> torch.Tensor:  # [num_reqs]
        # Built on the host, copied without blocking: a plain torch.tensor(..., device=cuda) would wait for the GPU.
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    greedy = [p.sampling_type_greedy for p in params]
    all_greedy = all(greedy)
    all_random = not any(greedy)
    meta = SamplingMetadata(all_greedy=all_greedy, all_random=all_random)
    if not all_greedy and not all_random:
        meta.greedy_mask = per_row(greedy, torch.bool)

    if not all_greedy:
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
        if any(t != 1.0 for t in temps):
            meta.temperature = per_row(temps, torch.float32)
        meta.generators = {
            i: gen
            for i, (gen, g) in enumerate(zip(generators, greedy, strict=True))
            if gen is not None and not g
        }
        top_ks = [
            vocab_size if g or p.top_k <= 0 else min(p.top_k, vocab_size)
            for p, g in zip(params, greedy, strict=True)
        ]
        enabled_ks = [k for k in top_ks if k < vocab_size]
        if enabled_ks:
            meta.no_top_k = False
            meta.top_k = per_row(top_ks, torch.int64)
            meta.max_top_k = max(enabled_ks)
        top_ps = [1.0 if g else p.top_p for p, g in zip(params, greedy, strict=True)]
        if any(p < 1.0 for p in top_ps):
            meta.no_top_p = False
            meta.top_p = per_row(top_ps, torch.float32)
        min_ps = [0.0 if g else p.min_p for p, g in zip(params, greedy, strict=True)]
        if any(p > 0.0 for p in min_ps):
            meta.no_min_p = False
            meta.min_p = per_row(min_ps, torch.float32)

    use_rep = any(p.repetition_penalty != 1.0 for p in params)
    if use_rep or any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
        meta.no_penalties = False
        meta.presence_penalties = per_row([p.presence_penalty for p in params], torch.float32)
        meta.frequency_penalties = per_row([p.frequency_penalty for p in params], torch.float32)
        meta.repetition_penalties = per_row([p.repetition_penalty for p in params], torch.float32)
        meta.output_token_counts = _token_presence(output_token_ids, vocab_size, torch.int32, device)
        if use_rep:
            # Only rows with a repetition penalty need their prompt; the others get an empty row.
            prompts = [
                pr if p.repetition_penalty != 1.0 else []
                for p, pr in zip(params, prompt_token_ids, strict=True)
            ]
            meta.prompt_token_mask = _token_presence(prompts, vocab_size, torch.bool, device)

    allowed_rows: list[int] = []
    allowed_cols: list[int] = []
    banned_rows: list[int] = []
    banned_cols: list[int] = []
    held_rows: list[int] = []
    held_cols: list[int] = []
    bias_rows: list[int] = []
    bias_cols: list[int] = []
    bias_values: list[float] = []
    for i, p in enumerate(params):
        if p.allowed_token_ids is not None:
            allowed_rows += [i] * len(p.allowed_token_ids)
            allowed_cols += p.allowed_token_ids
        banned: list[int] = []
        if p._bad_words_token_ids:
            banned += _bad_word_bans(p._bad_words_token_ids, output_token_ids[i])
        banned_rows += [i] * len(banned)
        banned_cols += banned
        if len(output_token_ids[i]) < p.min_tokens:
            held = list(p.stop_token_ids or [])
            if eos_token_ids[i] is not None and not p.ignore_eos:
                held.append(eos_token_ids[i])
            held_rows += [i] * len(held)
            held_cols += held
        if p.logit_bias:
            bias_rows += [i] * len(p.logit_bias)
            bias_cols += list(p.logit_bias.keys())
            bias_values += list(p.logit_bias.values())
    if allowed_rows:
        mask = torch.zeros(num_reqs, vocab_size, dtype=torch.bool, device=device)  # [num_reqs, vocab_size]
        rows = sorted(set(allowed_rows))
        mask[per_row(rows, torch.int64)] = True
        mask[per_row(allowed_rows, torch.int64), per_row(allowed_cols, torch.int64)] = False
        meta.allowed_token_mask = mask
    if banned_rows:
        meta.banned_token_index = per_row([banned_rows, banned_cols], torch.int64)
    if held_rows:
        meta.min_tokens_index = per_row([held_rows, held_cols], torch.int64)
    if bias_rows:
        meta.logit_bias_index = per_row([bias_rows, bias_cols], torch.int64)
        meta.logit_bias_values = per_row(bias_values, torch.float32)

    wanted = [p.logprobs for p in params if p.logprobs is not None]
    meta.max_num_logprobs = max(wanted) if wanted else None
    return meta


def build_plain_sampling_metadata(
    greedy: np.ndarray,  # [num_reqs] bool
    temperature: np.ndarray,  # [num_reqs] float32, 1.0 on greedy rows
    top_k: np.ndarray,  # [num_reqs] int64, 0 = disabled
    top_p: np.ndarray,  # [num_reqs] float32, 1.0 = disabled
    min_p: np.ndarray,  # [num_reqs] float32, 0.0 = disabled
    num_logprobs: np.ndarray,  # [num_reqs] int64, -1 = no logprobs
    generators: dict[int, torch.Generator],  # row -> generator, seeded random rows only
    vocab_size: int,
    device: torch.device,
) -> SamplingMetadata:
    """The same metadata as ``build_sampling_metadata`` for rows with no masks, biases or penalties, from
    per-row arrays gathered out of the persistent batch: array operations only, no loop over rows."""

    def to_dev(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device, non_blocking=True)

    all_greedy = bool(greedy.all())
    all_random = not bool(greedy.any())
    meta = SamplingMetadata(all_greedy=all_greedy, all_random=all_random)
    if not all_greedy and not all_random:
        meta.greedy_mask = to_dev(greedy)
    if not all_greedy:
        if (temperature != 1.0).any():
            meta.temperature = to_dev(temperature)
        meta.generators = generators
        enabled = (top_k > 0) & (top_k < vocab_size)
        if enabled.any():
            meta.no_top_k = False
            meta.top_k = to_dev(np.where(enabled, top_k, vocab_size))
            meta.max_top_k = int(top_k[enabled].max())
        if (top_p < 1.0).any():
            meta.no_top_p = False
            meta.top_p = to_dev(top_p)
        if (min_p > 0.0).any():
            meta.no_min_p = False
            meta.min_p = to_dev(min_p)
    if (num_logprobs >= 0).any():
        meta.max_num_logprobs = int(num_logprobs.max())
    return meta
