"""A speculative-decoding verification step's sampling and collection (``ModelRunner.sample`` / ``collect`` hand
such a step here): rejection sampling of each request's drafts against the target's logits, then the emitted
tokens (accepted drafts plus one) written into the persistent batch. The batch learns a step's tokens before the
next launch: with async scheduling too, the engine core collects the step first (its drafts need them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
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


@dataclass
class SpecAhead:
    """Async speculation without the host between steps: a verification step launched before the host has read
    the step in flight, whose proposer queued the next drafts on the device right after sampling
    (``DeviceDrafts.queue``). Every request of the new step sampled in that step and verifies ``num_draft`` of
    those drafts. The scheduler counted each request's draft slots in the step in flight as computed
    (``counted``); the device takes back the ones that step rejected (``DeviceFix``), and the engine core corrects
    the host's ``num_computed_tokens`` once it has read the step. Arrays are in the new step's request order."""

    prev_tokens: torch.Tensor  # [m, k + 1] the step in flight's sampled tokens (its m sampled requests)
    prev_accepted: torch.Tensor  # [m] its accepted drafts per request
    prev_drafts: torch.Tensor  # [m, k] the drafts its proposer queued for the next step
    req_ids: list[str]
    prev_index: np.ndarray  # [n] each request's row among the m
    counted: np.ndarray  # [n] draft slots the scheduler counted as computed for it in the step in flight
    num_draft: np.ndarray  # [n] drafts it verifies now (1..k)

    def device_fix(self, query_start: np.ndarray, block_size: int, dev: torch.device) -> DeviceFix:
        """The corrections of a step whose requests' tokens start at ``query_start`` ([n + 1])."""
        n = len(self.req_ids)
        meta = np.concatenate([self.prev_index, self.counted, query_start]).astype(np.int64)  # [3n + 1]
        width = int(self.num_draft.max())
        return DeviceFix(
            meta=torch.from_numpy(meta).to(dev, non_blocking=True),
            prev_tokens=self.prev_tokens,
            prev_accepted=self.prev_accepted,
            prev_drafts=self.prev_drafts,
            drafts=torch.empty(n, width, dtype=torch.long, device=dev),
            block_size=block_size,
        )


@dataclass
class DeviceFix:
    """A launch-ahead step's input corrections (kernels/spec_ahead.py says what they are): the host filled the
    inputs as if the step in flight had accepted every draft the scheduler counted. ``apply`` also fills
    ``drafts``, the ones this step verifies."""

    meta: torch.Tensor  # [3n + 1] int64 on the device: each request's row in the step in flight, counted slots,
    # and the step's query_start
    prev_tokens: torch.Tensor  # [m, k + 1] the step in flight's emitted tokens
    prev_accepted: torch.Tensor  # [m] its accepted drafts
    prev_drafts: torch.Tensor  # [m, kd] the drafts queued after it
    drafts: torch.Tensor  # [n, width] filled by apply: each request's drafts, zeros past its own
    block_size: int

    def apply(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        slot_mapping: torch.Tensor,  # [num_tokens] int64
        seq_lens: torch.Tensor,  # [n] int32
        block_table: torch.Tensor,  # [n, max_blocks] int32
    ) -> None:
        """Correct the step's inputs in place (one kernel on CUDA; the PyTorch twin elsewhere)."""
        args = (input_ids, positions, slot_mapping, seq_lens, block_table)
        if not input_ids.is_cuda:
            self.apply_reference(*args)
            return
        from pagedllm.kernels.spec_ahead import spec_ahead_fix

        spec_ahead_fix(
            self.meta, self.prev_tokens, self.prev_accepted, self.prev_drafts, *args,
            self.drafts, self.block_size,
        )

    def apply_reference(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
    ) -> None:
        """``apply`` in PyTorch operations (reads the step's layout back from the device: for CPUs and tests)."""
        n = self.drafts.shape[0]
        j, counted, query_start = self.meta[:n], self.meta[n : 2 * n], self.meta[2 * n :]
        counts = query_start[1:] - query_start[:-1]  # [n]
        req_of = torch.repeat_interleave(torch.arange(n, device=counts.device), counts)  # [num_tokens]
        offset = torch.arange(len(req_of), device=counts.device) - query_start[:-1][req_of]  # 0: the last token
        accepted = self.prev_accepted[j]
        rejected = counted - accepted  # [n]
        drafts = self.prev_drafts[j]  # [n, kd]
        col = (offset - 1).clamp(min=0)
        input_ids.copy_(torch.where(offset == 0, self.prev_tokens[j, accepted][req_of], drafts[req_of, col]))
        positions.sub_(rejected[req_of])
        seq_lens.sub_(rejected.to(seq_lens.dtype))
        b = self.block_size
        blocks = block_table[req_of, torch.div(positions, b, rounding_mode="floor")].long()
        torch.add(blocks * b, positions % b, out=slot_mapping)
        width = self.drafts.shape[1]
        own = torch.arange(width, device=counts.device)[None, :] < (counts - 1)[:, None]  # [n, width]
        self.drafts.copy_(torch.where(own, drafts[:, :width], 0))


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
        drafts = _drafts(step, dev)  # [num_sampled, k]
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
            _drafts(step, dev)[torch.from_numpy(group).to(dev, non_blocking=True), :width],
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


def _drafts(step: StepInFlight, dev: torch.device) -> torch.Tensor:
    """``[num_sampled, k]`` the step's drafts on the device (where they already are, after a launch ahead)."""
    if step.spec_draft_dev is not None:
        return step.spec_draft_dev
    return torch.from_numpy(step.spec_draft_ids).to(dev, non_blocking=True)


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
