"""Batched logits transforms used by the sampler: each acts on every row at once, with no host syncs.

All functions take float32 logits ``[num_reqs, vocab_size]``. Functions named ``*_`` modify their input in
place and return it; the others return a new tensor. A masked-out token holds ``-inf``.
"""

from __future__ import annotations

import torch

_NEG_INF = float("-inf")


def apply_penalties_(
    logits: torch.Tensor,  # [num_reqs, vocab_size] float32
    output_token_counts: torch.Tensor,  # [num_reqs, vocab_size] int32
    prompt_token_mask: torch.Tensor | None,  # [num_reqs, vocab_size] bool, or None (no repetition penalty)
    presence_penalties: torch.Tensor,  # [num_reqs] float32
    frequency_penalties: torch.Tensor,  # [num_reqs] float32
    repetition_penalties: torch.Tensor,  # [num_reqs] float32
) -> torch.Tensor:
    """vLLM/HF penalties, in this order:

    - repetition (over tokens seen in the prompt or the output): positive logits divided by the penalty,
      negative ones multiplied by it;
    - frequency: minus ``frequency_penalty * count`` over output tokens;
    - presence: minus ``presence_penalty`` for every token present in the output.
    """
    output_mask = output_token_counts > 0  # [num_reqs, vocab_size] bool
    if prompt_token_mask is not None:
        seen = output_mask | prompt_token_mask  # [num_reqs, vocab_size] bool
        factor = torch.where(seen, repetition_penalties.unsqueeze(1), 1.0)  # [num_reqs, vocab_size]
        logits.copy_(torch.where(logits > 0, logits / factor, logits * factor))
    logits.sub_(frequency_penalties.unsqueeze(1) * output_token_counts)
    logits.sub_(presence_penalties.unsqueeze(1) * output_mask)
    return logits


def apply_min_p_(
    logits: torch.Tensor,  # [num_reqs, vocab_size] float32, already divided by temperature
    min_p: torch.Tensor,  # [num_reqs] float32, 0 where disabled
) -> torch.Tensor:
    """Mask tokens whose probability is below ``min_p`` times the row's largest probability.

    Done in logit space, where no softmax is needed: ``p_i < min_p * p_max  <=>  l_i < l_max + log(min_p)``
    (``log(0) = -inf`` leaves a disabled row untouched).
    """
    max_logits = logits.amax(dim=-1, keepdim=True)  # [num_reqs, 1]
    threshold = max_logits + min_p.log().unsqueeze(1)  # [num_reqs, 1]
    return logits.masked_fill_(logits < threshold, _NEG_INF)


def apply_top_k_only_(
    logits: torch.Tensor,  # [num_reqs, vocab_size] float32
    top_k: torch.Tensor,  # [num_reqs] int64, vocab_size where disabled
    max_top_k: int,  # largest enabled top_k in the batch (host int, so no sync)
) -> torch.Tensor:
    """Top-k without a full sort: one ``torch.topk`` of width ``max_top_k``, then a per-row threshold.

    Tokens tied with the k-th largest logit are all kept.
    """
    vocab_size = logits.shape[1]
    top_values = logits.topk(max_top_k, dim=-1).values  # [num_reqs, max_top_k], descending
    k = top_k.clamp(max=max_top_k)  # [num_reqs]
    kth = top_values.gather(1, (k - 1).unsqueeze(1))  # [num_reqs, 1]
    kth.masked_fill_((top_k >= vocab_size).unsqueeze(1), _NEG_INF)  # disabled rows keep everything
    return logits.masked_fill_(logits < kth, _NEG_INF)


def apply_top_k_top_p(
    logits: torch.Tensor,  # [num_reqs, vocab_size] float32
    top_k: torch.Tensor | None,  # [num_reqs] int64, vocab_size where disabled; None: no top-k
    top_p: torch.Tensor | None,  # [num_reqs] float32, 1.0 where disabled; None: no top-p
) -> torch.Tensor:  # [num_reqs, vocab_size], a new tensor
    """Top-k then nucleus (top-p) filtering with one ascending sort per row.

    Top-p keeps the smallest set of most likely tokens whose probability (after top-k) sums to at least
    ``top_p``; the most likely token is always kept.
    """
    vocab_size = logits.shape[1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=False)  # [num_reqs, vocab_size] each
    if top_k is not None:
        kth_pos = (vocab_size - top_k.clamp(min=1, max=vocab_size)).unsqueeze(1)  # [num_reqs, 1]
        kth = sorted_logits.gather(1, kth_pos)  # [num_reqs, 1]
        sorted_logits.masked_fill_(sorted_logits < kth, _NEG_INF)
    if top_p is not None:
        sorted_probs = sorted_logits.softmax(dim=-1)  # [num_reqs, vocab_size]
        # cum[j] = mass of token j and every less likely one; drop j when the tokens above it reach top_p.
        cum = sorted_probs.cumsum(dim=-1)  # [num_reqs, vocab_size]
        drop = cum <= (1.0 - top_p).unsqueeze(1)  # [num_reqs, vocab_size] bool
        drop[:, -1] = False  # keep the most likely token
        sorted_logits.masked_fill_(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def _exponential_(q: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Fill ``q`` with i.i.d. Exp(1) draws. On CPU as ``-log(U)``, U uniform in [0, 1): ``exponential_`` is a
    scalar loop there, about 5x slower than ``uniform_`` and ``log_`` (4-5 ms of a 48-row decode step)."""
    if q.device.type == "cpu":
        return q.uniform_(generator=generator).log_().neg_()
    return q.exponential_(generator=generator)


def random_sample(
    probs: torch.Tensor,  # [num_reqs, vocab_size] float32, rows sum to 1; overwritten
    generators: dict[int, torch.Generator],  # row -> its own generator (seeded rows)
) -> torch.Tensor:  # [num_reqs] int64
    """Draw one token per row by an exponential race: ``argmax(probs / q)`` with ``q ~ Exp(1)`` i.i.d.

    This picks token i with probability ``probs[i]``. Unseeded rows share one batched draw from the default
    generator; each seeded row draws its whole row of ``q`` from its own generator, so its token does not
    depend on which other rows share the batch.
    """
    q = torch.empty_like(probs)  # [num_reqs, vocab_size]
    if len(generators) < probs.shape[0]:
        _exponential_(q)
    for row, generator in generators.items():
        _exponential_(q[row], generator)
    # A draw may be exactly 0 (exponential_ can return it); 0/0 would be NaN and could win the argmax.
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return probs.div_(q).argmax(dim=-1)


def apply_token_bitmask_(
    logits: torch.Tensor,  # [num_reqs, vocab_size] float32
    bitmask: torch.Tensor,  # [num_reqs, ceil(vocab_size / 32)] int32; bit j of word w allows token 32 * w + j
) -> torch.Tensor:
    """Structured outputs: set every token the row's grammar does not allow to ``-inf`` (rows whose words are all
    ``-1`` are unchanged). Bits past ``vocab_size`` are ignored. On CUDA a Triton kernel does it in one pass
    (``pagedllm/kernels/token_bitmask.py``); this function's body elsewhere is its twin."""
    from pagedllm.platform import use_fused_kernels

    if use_fused_kernels(logits):
        from pagedllm.kernels.token_bitmask import apply_token_bitmask_triton_

        return apply_token_bitmask_triton_(logits, bitmask)
    return apply_token_bitmask_ref_(logits, bitmask)


def apply_token_bitmask_ref_(
    logits: torch.Tensor,  # [num_reqs, vocab_size] float32
    bitmask: torch.Tensor,  # [num_reqs, ceil(vocab_size / 32)] int32
) -> torch.Tensor:
    """The PyTorch twin of the Triton bitmask kernel (and the CPU path)."""
    num_reqs, vocab_size = logits.shape
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # [32]
    allowed = (bitmask.unsqueeze(-1) >> shifts) & 1  # [num_reqs, num_words, 32]; >> of int32 keeps the bit
    allowed = allowed.view(num_reqs, -1)[:, :vocab_size].bool()  # [num_reqs, vocab_size]
    return logits.masked_fill_(~allowed, _NEG_INF)
