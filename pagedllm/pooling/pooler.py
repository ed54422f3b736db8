"""Poolers: one vector per request from a step's flattened hidden states, then the task's post-processing.

A step's hidden states are ``[num_tokens, hidden_size]``, request i's tokens at rows ``cu[i]:cu[i + 1]``
(``cu``: ``[num_reqs + 1]`` cumulative prompt lengths). Every request runs its whole prompt in one step, so
CLS is row ``cu[i]``, LAST row ``cu[i + 1] - 1`` and MEAN the average over the request's rows.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.pooling.config import PoolerConfig
from pagedllm.pooling.params import PoolingParams


def pool_hidden(
    hidden: torch.Tensor,
    cu: np.ndarray,
    pooling_type: str,
    index: torch.Tensor | None = None,
    owner: torch.Tensor | None = None,
) -> torch.Tensor:
    """``hidden`` [num_tokens, H], ``cu`` [num_reqs + 1] -> [num_reqs, H] (the hidden dtype). ``index``: the rows
    CLS / LAST read (``cu[:-1]`` / ``cu[1:] - 1``), ``owner``: each token's request for MEAN, both already on the
    device (else made here from ``cu``)."""
    if pooling_type in ("CLS", "LAST"):
        if index is None:
            rows = cu[:-1] if pooling_type == "CLS" else cu[1:] - 1
            index = torch.from_numpy(rows.astype(np.int64)).to(hidden.device)
        return hidden[index]
    if pooling_type == "MEAN":
        lens = np.diff(cu).astype(np.int64)  # [num_reqs]
        num_tokens = int(cu[-1])
        if owner is None:
            owner = torch.from_numpy(np.repeat(np.arange(len(lens)), lens)).to(hidden.device)  # [num_tokens]
        sums = torch.zeros(len(lens), hidden.shape[1], dtype=torch.float32, device=hidden.device)
        sums.index_add_(0, owner, hidden[:num_tokens].float())
        counts = sums.new_zeros(len(lens)).index_add_(0, owner, sums.new_ones(num_tokens))  # [num_reqs]
        return (sums / counts[:, None]).to(hidden.dtype)
    raise ValueError(f"unknown pooling type {pooling_type!r}")


def check_params(params: PoolingParams, config: PoolerConfig) -> None:
    """``ValueError`` naming the field when ``params`` cannot run on this model."""
    task = params.task
    if config.is_classifier and task == "embed":
        raise ValueError("this model is a classifier: use classify or score, not embed (task 'embed')")
    if not config.is_classifier and task == "classify":
        raise ValueError("this model has no classification head: use embed, not classify (task 'classify')")
    if params.dimensions is not None:
        if not config.is_matryoshka:
            raise ValueError(
                "dimensions: this model does not support Matryoshka representation (its config.json sets no "
                "is_matryoshka / matryoshka_dimensions), so its embeddings cannot be shortened"
            )
        allowed = config.matryoshka_dimensions
        if allowed is not None and params.dimensions not in allowed:
            raise ValueError(f"dimensions must be one of {allowed} for this model, got {params.dimensions}")


def finish_pooled_groups(
    pooled: torch.Tensor, params: list[PoolingParams], config: PoolerConfig
) -> list[tuple[list[int], torch.Tensor]]:
    """A step's pooled vectors (``[num_reqs, H]``, on the device) -> ``(request indices, [n, D] float32 results)``
    per group of requests that ask the same (task, dimensions, normalize, activation): ``finish_pooled`` once per
    group, left on the device (the caller copies each group to the host in one transfer)."""
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault((p.task, p.dimensions, p.normalize, p.activation), []).append(i)
    out = []
    for indices in groups.values():
        rows = pooled if len(indices) == len(params) else pooled[indices]
        out.append((indices, finish_pooled(rows, params[indices[0]], config, to_host=False)))
    return out


def finish_pooled(
    pooled: torch.Tensor, params: PoolingParams, config: PoolerConfig, to_host: bool = True
) -> torch.Tensor:
    """A request's pooled vector ([H], or [num_labels] logits for a classifier; or ``[n, ...]`` rows of requests
    with the same params) -> what its task returns, float32 (on the host unless ``to_host`` is False): an
    embedding (cut to ``dimensions``, normalized), class probabilities, or as is."""
    out = pooled.float()
    task = params.task
    if task == "embed":
        if params.dimensions is not None:
            out = out[..., : params.dimensions]
        normalize = config.normalize if params.normalize is None else params.normalize
        if normalize:
            out = torch.nn.functional.normalize(out, dim=-1)
    elif task in ("classify", "score") and config.is_classifier:
        if params.activation is not False:
            out = torch.sigmoid(out) if out.shape[-1] == 1 else torch.softmax(out, dim=-1)
    elif params.normalize:  # "encode": raw unless asked
        out = torch.nn.functional.normalize(out, dim=-1)
    return out.cpu() if to_host else out
