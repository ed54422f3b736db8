"""A speculative-decoding verification step's sampling and collection (``ModelRunner.sample`` / ``collect`` hand
such a step here): rejection sampling of each request's drafts against the target's logits, then the emitted
tokens (accepted drafts plus one) written into the persistent batch. The batch learns a step's tokens before the
next launch: with async scheduling too, the engine core collects the step first (its drafts need them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedllm.core.sched_output import LogprobsLists, ModelRunnerOutput
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.sampler import LogprobsTensors, Sampler, compute_logprobs_topk
from pagedllm.spec_decode.rejection_sampler import (
    PLACEHOLDER_TOKEN_ID,
    greedy_verify,
    greedy_verify_flat,
    rejection_sample,
)
from pagedllm.worker.input_batch import InputBatch

if TYPE_CHECKING:
    from pagedllm.worker.model_runner import StepInFlight


def sample_spec(
    step: StepInFlight,
    grammar_bitmask: torch.Tensor | None,
    batch: InputBatch,
    sampler: Sampler,
    sampling_metadata: Callable[[np.ndarray], SamplingMetadata],
    dev: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, LogprobsTensors | None]:
    """Verify the drafts of ``step`` (rejection_sample) and sample the requests without drafts.
    ``grammar_bitmask``: one row per request, or one per logit row (a mask per draft position, from
    ``StructuredOutputManager.grammar_bitmask_spec``). ``sampling_metadata(rows)`` builds the metadata of those
    batch rows. Returns, on the device, the tokens ``[num_sampled, k + 1]`` (accepted drafts, one more, -1
    padding), the accepted drafts per request ``[num_sampled]`` and the logprobs wanted (or None); the runner
    holds them in ``step`` (``ModelRunner._hold_sampled``), and ``collect_spec`` writes them into the batch."""
    s_rows = step.sample_rows
    num_draft = step.spec_num_draft  # [num_sampled]
    num_sampled, k = step.spec_draft_ids.shape
    if (
        grammar_bitmask is None
        and batch.num_complex_rows == 0  # no masks, biases or penalties: greedy rows take the raw argmax
        and bool(batch.greedy_np[s_rows].all())
        and not bool((batch.num_logprobs_np[s_rows] >= 0).any())
    ):
        # The common case in a few launches: all greedy, nothing to edit or report.
        drafts = torch.from_numpy(step.spec_draft_ids).to(dev, non_blocking=True)  # [num_sampled, k]
        if bool((num_draft == k).all()):  # k drafts a request: the logit rows are [num_sampled, k + 1]
            output, num_accepted = greedy_verify(drafts, step.logits.view(num_sampled, k + 1, -1))
        else:  # (n-gram drafts 0..k a request)
            output, num_accepted = greedy_verify_flat(drafts, num_draft, step.logits)
        step.logits = None
        step.sample_gen = batch.row_gen[s_rows].copy()
        step.sample_num_logprobs = batch.num_logprobs_np[s_rows].copy()
        return output, num_accepted, None
    counts = num_draft + 1  # [num_sampled] logit rows per request
    starts = np.cumsum(counts) - counts  # [num_sampled] its first logit row
    # Every logit row samples with its request's settings (drafted requests have no history-dependent ones).
    meta = sampling_metadata(np.repeat(s_rows, counts))
    if grammar_bitmask is not None:
        if grammar_bitmask.shape[0] != int(counts.sum()):  # one row per request: the same for its positions
            grammar_bitmask = grammar_bitmask[torch.from_numpy(np.repeat(np.arange(num_sampled), counts))]
        meta.grammar_bitmask = grammar_bitmask.to(dev, non_blocking=True)
    processed = sampler.processed_logits(step.logits, meta)  # [num_logits, vocab_size] float32
    greedy = batch.greedy_np[s_rows]  # [num_sampled]
    temperature = torch.from_numpy(np.where(greedy, 0.0, 1.0).astype(np.float32))  # already applied
    gens = {int(j): batch.generators[s_rows[j]] for j in np.nonzero(batch.has_generator_np[s_rows])[0]}

    output = torch.full((num_sampled, k + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.long, device=dev)
    num_accepted = torch.zeros(num_sampled, dtype=torch.long, device=dev)
    for group in (np.nonzero(num_draft > 0)[0], np.nonzero(num_draft == 0)[0]):
        if len(group) == 0:
            continue
        width = k if num_draft[group[0]] > 0 else 0
        # [len(group), width + 1] logit rows; short rows repeat their last (ignored past num_draft + 1).
        idx = starts[group, None] + np.minimum(np.arange(width + 1)[None, :], num_draft[group, None])
        out, acc = rejection_sample(
            torch.from_numpy(step.spec_draft_ids[group, :width]).to(dev, non_blocking=True),
            torch.from_numpy(num_draft[group]),  # on the host: seeded rows read it there
            None,  # every proposer here drafts deterministically: q is one-hot
            processed[torch.from_numpy(idx).to(dev, non_blocking=True)],
            temperature[group],  # on the host: an all-greedy group takes the short path
            {g: gens[int(j)] for g, j in enumerate(group) if int(j) in gens},
        )
        group_dev = torch.from_numpy(group).to(dev, non_blocking=True)
        output[group_dev, : width + 1] = out
        num_accepted[group_dev] = acc
    logprobs = None
    if (batch.num_logprobs_np[s_rows] >= 0).any():
        # Raw logprobs of every logit row's emitted token (rows past a request's emitted ones are dropped).
        pos = np.arange(int(counts.sum())) - np.repeat(starts, counts)  # [num_logits]
        flat = output[
            torch.from_numpy(np.repeat(np.arange(num_sampled), counts)).to(dev),
            torch.from_numpy(pos).to(dev),
        ]
        logprobs = compute_logprobs_topk(
            step.logits, flat.clamp(min=0), int(batch.num_logprobs_np[s_rows].max())
        )
    step.logits = None
    step.sample_gen = batch.row_gen[s_rows].copy()
    step.sample_num_logprobs = batch.num_logprobs_np[s_rows].copy()
    return output, num_accepted, logprobs


def collect_spec(step: StepInFlight, out: ModelRunnerOutput, batch: InputBatch) -> None:
    """``collect`` for a verification step: each request gets its accepted drafts plus one token."""
    tokens = step.sampled_host.numpy()  # [num_sampled, k + 1]
    num_emitted = step.spec_num_accepted.numpy() + 1  # [num_sampled]
    lp = step.logprobs.tolists() if step.logprobs is not None else None
    start = 0  # first logit row of request j
    for j, req_id in enumerate(step.sample_req_ids):
        n = int(num_emitted[j])
        emitted = tokens[j, :n]
        out.sampled_token_ids[req_id] = emitted.tolist()
        row = step.sample_rows[j]
        if batch.row_gen[row] == step.sample_gen[j]:
            end = int(batch.num_tokens_np[row])
            batch.token_ids_np[row, end : end + n] = emitted
            batch.num_tokens_np[row] = end + n
        num_lp = int(step.sample_num_logprobs[j])
        if lp is not None and num_lp >= 0:
            rows = slice(start, start + n)
            out.logprobs[req_id] = LogprobsLists(
                [r[: num_lp + 1] for r in lp.token_ids[rows]],
                [r[: num_lp + 1] for r in lp.logprobs[rows]],
                lp.ranks[rows],
            )
        start += int(step.spec_num_draft[j]) + 1
