"""Draft proposers behind one small interface, called by the engine core after each step.

``propose(requests)`` sets ``Request.spec_token_ids`` for the running requests that can speculate; the scheduler
sends them with the next step, the runner verifies them, and ``update_from_output`` rolls back what was rejected.
A request speculates only when its sampling does not read its own history position by position (penalties,
bad words, min_tokens): for those the target distribution of a draft position would depend on the drafts before
it, which the verification step does not model. They decode one token at a time, exactly. A request with a grammar
speculates while the grammar constrains it (not while a reasoning parser holds the grammar back): the structured
output manager fills one mask per draft position by walking the matcher through the drafts and rolling it back
(``StructuredOutputManager.grammar_bitmask_spec``), so a draft the grammar forbids has probability 0 and is
rejected.

Under async scheduling the next step is scheduled before this one's tokens are known: the scheduler reserves room
for drafts, and the engine core calls ``propose`` just before the launch, once the previous step's tokens are in,
with ``DraftView``s of the requests (the scheduler's ``Request`` objects learn those tokens only after the launch).
A request with a grammar speculates then too: its masks, one per draft position, are filled after the previous
step's tokens have advanced the grammar, before the step samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

from pagedllm.config import MTP_METHODS, EngineConfig, SpeculativeConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.spec_decode.ngram import NgramProposer
from pagedllm.worker.input_batch import needs_history


class DraftView:
    """A running request as a proposer sees it under async scheduling, between the previous step's sampling and
    the next step's launch: its tokens as the runner's persistent batch holds them (the previous step's included),
    and ``max_drafts``, the draft slots the scheduler reserved for it in the next step (0: it may not speculate)."""

    __slots__ = (
        "request_id",
        "all_token_ids",
        "num_prompt_tokens",
        "num_output_tokens",
        "max_tokens",
        "max_drafts",
        "spec_token_ids",
    )

    def __init__(self, request: Request, token_ids: np.ndarray, num_new: int, max_drafts: int) -> None:
        """``token_ids``: [num_tokens] the request's known tokens (a view of the batch row); ``num_new``: how many
        of them the scheduler has not appended yet."""
        self.request_id = request.request_id
        self.all_token_ids = token_ids
        self.num_prompt_tokens = request.num_prompt_tokens
        self.num_output_tokens = request.num_output_tokens + num_new
        self.max_tokens = request.max_tokens
        self.max_drafts = max_drafts
        self.spec_token_ids: list[int] = []

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def can_speculate(request: Request | DraftView) -> bool:
    """Whether ``request`` may get drafts: decoding (one token behind), no history-dependent sampling, and no
    grammar or one that constrains the next token now (a ``DraftView``: the scheduler reserved it slots)."""
    if isinstance(request, DraftView):
        return request.max_drafts > 0
    return (
        request.status == RequestStatus.RUNNING
        and request.num_computed_tokens == request.num_tokens - 1
        and (request.grammar is None or request.grammar.active)
        and not needs_history(request.sampling_params)
    )


def num_drafts_allowed(request: Request | DraftView, k: int, max_model_len: int) -> int:
    """How many of ``k`` drafts ``request`` may get: the verification step emits one token more than it accepts,
    and neither max_model_len nor max_tokens may be passed, nor a ``DraftView``'s reserved slots (<= 0: none)."""
    n = min(k, max_model_len - request.num_tokens - 1, request.max_tokens - request.num_output_tokens - 1)
    return min(n, request.max_drafts) if isinstance(request, DraftView) else n


def kept_positions(req_id: str, sched: SchedulerOutput, result: ModelRunnerOutput) -> tuple[int, int]:
    """``(first position, count)`` of ``req_id``'s positions the step just run computed and kept: its scheduled
    tokens less the drafts that were rejected."""
    count = sched.num_scheduled_tokens[req_id]
    drafts = sched.scheduled_spec_decode_tokens.get(req_id)
    if drafts:
        count -= len(drafts) + 1 - len(result.sampled_token_ids.get(req_id, ()))
    return sched.num_computed_tokens[req_id], count


def block_table(kv: KVCacheManager, req_ids: Sequence[str], num_blocks: int) -> np.ndarray:
    """``[len(req_ids), num_blocks]`` int32: each request's first ``num_blocks`` block ids in ``kv`` (the target's
    tables, which draft KV caches share), zeros past its own."""
    table = np.zeros((len(req_ids), num_blocks), dtype=np.int32)
    for i, req_id in enumerate(req_ids):
        ids = kv.get_block_ids(req_id)[:num_blocks]
        table[i, : len(ids)] = ids
    return table


class DeviceDrafts:
    """Drafts a proposer queued on the device right after a verification step (``ModelRunner.after_spec_sample``),
    on their way to the host: one pinned buffer and one CUDA event, reused, since a proposal's drafts are read
    (``take``) before the next one is queued. ``queue`` hangs them on the step; ``take`` hands them out."""

    def __init__(self, device: Any, max_rows: int, k: int) -> None:
        self.k = k
        self.cuda = device.type == "cuda"
        # (on the CPU the drafts are read where they are)
        self.host = torch.empty(max_rows, k, dtype=torch.long, pin_memory=True) if self.cuda else None
        self.ready = torch.cuda.Event() if self.cuda else None

    def queue(self, step: Any, drafts: torch.Tensor, capacity: np.ndarray | None = None) -> None:
        """``drafts`` ``[n, k]`` on the device, one row per request of ``step`` (its ``req_ids`` order);
        ``capacity`` ``[n]``: positions from which a request's blocks at that step had no slot (None: no limit)."""
        host = drafts
        if self.cuda:
            host = self.host[: drafts.shape[0]]
            host.copy_(drafts, non_blocking=True)
            self.ready.record()
        step.device_drafts = (host, capacity, drafts)  # (the device tensor: a launch ahead reads it there)

    def take(self, requests: Sequence[Request | DraftView], step: Any, max_model_len: int) -> None:
        """Set ``spec_token_ids`` of each request of ``requests`` that was in ``step`` and can speculate: its
        drafts cut as the host path cuts them, to ``num_drafts_allowed`` and (drafts 2.. run the head at positions
        num_tokens - 1 ..) its capacity."""
        host, capacity, _ = step.device_drafts
        step.device_drafts = None
        if self.cuda:
            self.ready.synchronize()
        index = {req_id: i for i, req_id in enumerate(step.req_ids)}
        drafts = None
        for request in requests:
            i = index.get(request.request_id)
            if i is None or not can_speculate(request):
                continue
            k = num_drafts_allowed(request, self.k, max_model_len)
            if capacity is not None:
                k = min(k, int(capacity[i]) - request.num_tokens + 2)
            if k > 0:
                if drafts is None:
                    drafts = host.tolist()
                request.spec_token_ids = drafts[i][:k]


class Proposer(Protocol):
    # Whether ``propose`` must see every step (an EAGLE or MTP head catches its KV cache up over each step's
    # tokens); otherwise async scheduling calls it only when a request may get drafts.
    reads_every_step: bool

    def kv_block_bytes(self) -> int:
        """Bytes the proposer's own KV cache needs per block of the target's (0: it has none)."""

    def init_kv_cache(self, num_blocks: int, kv: KVCacheManager) -> None:
        """Called once the target's cache has ``num_blocks`` blocks; ``kv`` holds the target's block tables."""

    def propose(
        self,
        requests: Sequence[Request | DraftView],
        sched: SchedulerOutput | None = None,
        step: Any = None,
        result: ModelRunnerOutput | None = None,
    ) -> None:
        """Set ``spec_token_ids`` of each request in ``requests`` that can speculate (called after every step
        with the running requests; a request missing from ``requests`` is finished or preempted; under async
        scheduling, ``DraftView``s before the next launch). ``sched``, ``step`` (the runner's ``StepInFlight``)
        and ``result`` describe the step just finished."""


class NgramSpecProposer:
    """vLLM's ``method="ngram"``: prompt lookup over each request's own tokens (host, numpy)."""

    reads_every_step = False

    def __init__(self, config: SpeculativeConfig) -> None:
        self.ngram = NgramProposer(
            config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
        )

    def propose(self, requests: Sequence[Request | DraftView], *step_info: Any) -> None:
        for request in requests:
            if can_speculate(request):
                request.spec_token_ids = self.ngram.propose(np.asarray(request.all_token_ids)).tolist()

    def kv_block_bytes(self) -> int:
        return 0

    def init_kv_cache(self, num_blocks: int, kv: KVCacheManager) -> None:
        pass


def make_proposer(config: EngineConfig, runner: Any) -> Proposer:
    """The proposer ``config.speculative_config`` names; ``runner`` is the target's ``ModelRunner``."""
    spec = config.speculative_config
    if spec.method == "ngram":
        return NgramSpecProposer(spec)
    if spec.method == "draft_model":
        from pagedllm.spec_decode.draft_model import DraftModelProposer

        return DraftModelProposer(config, runner)
    if spec.method == "medusa":
        from pagedllm.spec_decode.medusa import MedusaProposer

        return MedusaProposer(config, runner)
    if spec.method in MTP_METHODS:
        from pagedllm.spec_decode.mtp import MTPProposer

        return MTPProposer(config, runner)
    from pagedllm.spec_decode.eagle import EagleProposer

    return EagleProposer(config, runner)
