"""Exact speculative sampling (Leviathan et al. 2023; Chen et al. 2023): verify draft tokens against the target.

Per row, with ``d = num_draft_tokens`` drafts ``x_0 .. x_{d-1}``:

- greedy row (temperature < 1e-5, as ``SamplingParams`` counts it): draft ``x_i`` is accepted while it equals
  ``argmax(target_logits[i])``; the first mismatch emits that argmax instead and stops; if all ``d`` drafts are
  accepted the bonus token ``argmax(target_logits[d])`` follows.
- random row: ``p_i = softmax(target_logits[i] / T)`` and ``q_i`` the draft distribution (one-hot of ``x_i``
  for n-gram drafts, ``draft_probs is None``). ``x_i`` is accepted with probability ``min(1, p_i[x] / q_i[x])``;
  the first rejection emits a sample of ``norm(max(0, p_i - q_i))`` and stops; if all ``d`` drafts are accepted
  the bonus token is sampled from ``p_d``. Every emitted token is then distributed exactly as if sampled from
  the target model alone.

So a row emits its accepted drafts plus exactly one token (1..d+1 tokens). The logits are used as given: any
top-k / top-p / min-p filters, penalties or masks must already be applied to ``target_logits`` (and to the draft
model's distribution) by the caller; this module only applies the temperature.

Seeded rows (those in ``generators``) draw every random number from their own generator, so their output does
not depend on the other rows of the batch; the other rows share batched draws from the default generator.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.sample.ops import random_sample

_GREEDY_EPS = 1e-5  # temperature below this is greedy (matches SamplingParams)
PLACEHOLDER_TOKEN_ID = -1  # fills the output past each row's emitted tokens


def _check_shapes(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    temperature: torch.Tensor,
) -> None:
    if draft_token_ids.dim() != 2:
        raise ValueError(f"draft_token_ids must be [batch, k], got shape {tuple(draft_token_ids.shape)}")
    batch, k = draft_token_ids.shape
    if target_logits.dim() != 3 or target_logits.shape[:2] != (batch, k + 1):
        raise ValueError(
            f"target_logits must be [batch={batch}, k + 1={k + 1}, vocab], got shape {tuple(target_logits.shape)}"
        )
    vocab = target_logits.shape[2]
    if draft_probs is not None and tuple(draft_probs.shape) != (batch, k, vocab):
        raise ValueError(
            f"draft_probs must be [batch={batch}, k={k}, vocab={vocab}], got shape {tuple(draft_probs.shape)}"
        )
    if tuple(num_draft_tokens.shape) != (batch,):
        raise ValueError(
            f"num_draft_tokens must be [batch={batch}], got shape {tuple(num_draft_tokens.shape)}"
        )
    if tuple(temperature.shape) != (batch,):
        raise ValueError(f"temperature must be [batch={batch}], got shape {tuple(temperature.shape)}")


def rejection_sample(
    draft_token_ids: torch.Tensor,  # [batch, k] int64; entries at positions >= num_draft_tokens are ignored
    num_draft_tokens: torch.Tensor,  # [batch] int64, each in 0..k (pass a host tensor when rows are seeded)
    draft_probs: torch.Tensor | None,  # [batch, k, vocab] float32, or None: n-gram drafts (q = one-hot)
    target_logits: torch.Tensor,  # [batch, k + 1, vocab] float32: target logits at each draft position + bonus
    temperature: torch.Tensor,  # [batch] float32; < 1e-5: greedy row (on the host, all greedy: a short path)
    generators: dict[int, torch.Generator] | None = None,  # row -> its own generator (seeded rows)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify the drafts of every row; see the module docstring for the rule.

    Returns ``(output_token_ids, num_accepted)``: ``output_token_ids`` is ``[batch, k + 1]`` int64 holding, per
    row, its ``num_accepted`` accepted drafts, then one target token (correction or bonus), then ``-1`` padding;
    ``num_accepted`` is ``[batch]`` int64 in ``0..num_draft_tokens``. Raises ``ValueError`` on inconsistent
    shapes. Inputs are not modified.
    """
    _check_shapes(draft_token_ids, num_draft_tokens, draft_probs, target_logits, temperature)
    generators = generators or {}
    batch, k = draft_token_ids.shape
    device = target_logits.device
    positions = torch.arange(k + 1, device=device)  # [k + 1]
    num_draft = num_draft_tokens.to(device=device, dtype=torch.int64)  # [batch]
    is_draft = positions[:k] < num_draft.unsqueeze(1)  # [batch, k] bool: a real (non-padding) draft
    drafts = torch.where(is_draft, draft_token_ids.to(device), 0)  # [batch, k]; padding -> 0, a safe index
    if temperature.device.type == "cpu" and bool((temperature < _GREEDY_EPS).all()):
        return _greedy_verify(drafts, is_draft, target_logits, positions)

    greedy = temperature.to(device) < _GREEDY_EPS  # [batch] bool
    target_argmax = target_logits.argmax(dim=-1)  # [batch, k + 1]
    greedy_accept = drafts == target_argmax[:, :k]  # [batch, k] bool

    # Target distribution of the random rows (greedy rows get temperature 1: their probs are unused).
    temp = torch.where(greedy, 1.0, temperature.to(device=device, dtype=torch.float32))  # [batch]
    probs = torch.softmax(target_logits.float() / temp.view(batch, 1, 1), dim=-1)  # [batch, k + 1, vocab]
    p_draft = probs[:, :k].gather(2, drafts.unsqueeze(2)).squeeze(2)  # [batch, k]: p_i(x_i)
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)  # [batch, k]: an n-gram draft has probability 1 under the proposer
    else:
        q_draft = draft_probs.to(device).float().gather(2, drafts.unsqueeze(2)).squeeze(2)  # [batch, k]

    # Uniform draws u in [0, 1); accept iff u < p / q, i.e. u * q < p (also right when q is 0).
    uniform = torch.empty(batch, k, device=device)  # [batch, k]
    if len(generators) < batch:
        uniform.uniform_()
    if generators:
        # A seeded row draws one number per real draft, so its stream does not depend on the other rows' k.
        counts = num_draft_tokens.tolist()  # host values (a sync if they live on the device)
        for row, generator in generators.items():
            uniform[row, : counts[row]].uniform_(generator=generator)
    random_accept = uniform * q_draft < p_draft  # [batch, k] bool

    accept = torch.where(greedy.unsqueeze(1), greedy_accept, random_accept) & is_draft  # [batch, k]
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [batch]: leading accepted drafts, 0..d

    # The one emitted target token sits at position a = num_accepted: a correction if a < d, else the bonus.
    rows = torch.arange(batch, device=device)  # [batch]
    final_probs = probs[rows, num_accepted]  # [batch, vocab]: p_a (a copy; safe to modify)
    rejected = num_accepted < num_draft  # [batch] bool
    at = num_accepted.clamp(max=max(k - 1, 0))  # [batch]: a valid draft position for the gathers below
    if k > 0:
        if draft_probs is None:
            # Residual max(0, p - onehot(x)): x drops out; every other token keeps p.
            residual = final_probs.scatter(1, drafts[rows, at].unsqueeze(1), 0.0)  # [batch, vocab]
        else:
            draft_at = draft_probs.to(device).float()[rows, at]  # [batch, vocab]: q_a
            residual = (final_probs - draft_at).clamp_(min=0.0)  # [batch, vocab]
        # A residual of all zeros has probability 0 in exact arithmetic (p == q never rejects); fall back to p.
        usable = rejected & (residual.sum(dim=1) > 0)  # [batch]
        final_probs = torch.where(usable.unsqueeze(1), residual, final_probs)  # [batch, vocab]
    # random_sample draws by an exponential race, which needs no normalization; it overwrites its input.
    sampled = random_sample(final_probs, generators)  # [batch]
    final_token = torch.where(greedy, target_argmax[rows, num_accepted], sampled)  # [batch]

    accepted = positions[:k] < num_accepted.unsqueeze(1)  # [batch, k] bool
    output = torch.where(accepted, drafts, PLACEHOLDER_TOKEN_ID)  # [batch, k]
    output = torch.cat([output, output.new_full((batch, 1), PLACEHOLDER_TOKEN_ID)], dim=1)  # [batch, k + 1]
    output.scatter_(1, num_accepted.unsqueeze(1), final_token.unsqueeze(1))
    return output, num_accepted


def greedy_verify(
    draft_token_ids: torch.Tensor,  # [batch, k] int64, every draft real, on the logits' device
    target_logits: torch.Tensor,  # [batch, k + 1, vocab] any float dtype (argmax only)
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rejection_sample`` of all-greedy rows with ``k`` drafts each, on logits nothing edits: the same
    ``(output_token_ids, num_accepted)`` without shape checks or host tensors."""
    k = draft_token_ids.shape[1]
    positions = torch.arange(k + 1, device=target_logits.device)
    return _greedy_verify(draft_token_ids, True, target_logits, positions)


def greedy_verify_flat(
    draft_token_ids: torch.Tensor,  # [batch, k] int64 (past a row's num_draft: any value)
    num_draft: np.ndarray,  # [batch] drafts per row, 0..k (host)
    flat_logits: torch.Tensor,  # [sum(num_draft + 1), vocab] each row's num_draft + 1 logit rows in turn
) -> tuple[torch.Tensor, torch.Tensor]:
    """``greedy_verify`` of rows with any number of drafts (0..k), on their logit rows laid end to end as a
    verification step computes them: the argmax of every row first, then each request's ``k + 1`` positions
    gathered from it (short requests repeat their last, which no draft reaches), so no vocabulary row is copied."""
    batch, k = draft_token_ids.shape
    dev = flat_logits.device
    counts = num_draft + 1
    starts = np.cumsum(counts) - counts  # [batch] each row's first logit row
    idx = starts[:, None] + np.minimum(np.arange(k + 1)[None, :], num_draft[:, None])  # [batch, k + 1]
    is_draft = torch.from_numpy(np.arange(k)[None, :] < num_draft[:, None]).to(dev, non_blocking=True)
    rows = torch.from_numpy(idx).to(dev, non_blocking=True)
    target_argmax = flat_logits.argmax(dim=-1)[rows]  # [batch, k + 1]
    positions = torch.arange(k + 1, device=dev)
    return _verify_argmax(draft_token_ids, is_draft, target_argmax, positions)


def _greedy_verify(
    drafts: torch.Tensor, is_draft: torch.Tensor | bool, target_logits: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rejection_sample`` when every row is greedy (known on the host): the same result in a few launches. The
    accepted drafts equal the target's argmax where they stand, so a row's output is the argmax up to and including
    position ``num_accepted`` (the correction or the bonus), then padding."""
    return _verify_argmax(drafts, is_draft, target_logits.argmax(dim=-1), positions)


def _verify_argmax(
    drafts: torch.Tensor,  # [batch, k]
    is_draft: torch.Tensor | bool,  # [batch, k] (True: every position holds a draft)
    target_argmax: torch.Tensor,  # [batch, k + 1]
    positions: torch.Tensor,  # [k + 1] 0..k
) -> tuple[torch.Tensor, torch.Tensor]:
    k = drafts.shape[1]
    accept = (drafts == target_argmax[:, :k]) & is_draft  # [batch, k]
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [batch]
    keep = positions.unsqueeze(0) <= num_accepted.unsqueeze(1)  # [batch, k + 1]
    return torch.where(keep, target_argmax, PLACEHOLDER_TOKEN_ID), num_accepted
