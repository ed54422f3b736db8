"""One token-budget scheduler: continuous batching, chunked prefill, prefix caching, preemption by recompute.

Each step spends at most ``max_num_batched_tokens`` tokens. Running requests come first (in admission order),
each asking for ``num_tokens - num_computed_tokens`` tokens (1 for a decode, a chunk for a long prompt); then
waiting requests are admitted (FCFS, or by ``priority`` then arrival) while budget, sequence slots and KV blocks
last. Admission keeps free the blocks that the running requests' next ``admission_headroom_tokens`` tokens will
need (``_growth_blocks``): with vLLM's rule (admit while blocks last) a full cache admits prompts into the room the
decodes are about to grow into, and then preempts them. When a running request cannot get blocks, the
lowest-priority / latest-admitted running request is preempted: its blocks are freed and it goes back to the front
of the waiting queue to be recomputed.

Async scheduling (``config.async_scheduling``): the engine schedules step N+1 before it has read step N's sampled
tokens. Each request that will sample in a scheduled step gets an output placeholder (``num_output_placeholders``)
that counts as a known token, so step N+1 schedules its decode; the runner feeds it the sampled id on the device.
``update_from_output`` turns placeholders into tokens one step later. A request whose placeholders already reach
``max_tokens`` or ``max_model_len`` is not scheduled again (it is certain to finish), and one that finishes at step
N has whatever step N+1 computed for it dropped: it emits nothing after its last token.

Bursts (vLLM's knobs, ``SchedulerConfig``). ``long_prefill_token_threshold`` = T > 0 caps every request's chunk at
T tokens per step, running or newly admitted, as vLLM v1 does: a long prompt takes several steps and leaves budget
to the prompts behind it, which then get their first token sooner. ``max_num_partial_prefills`` = K > 1 (vLLM's V0
engine only; V1 accepts and ignores it) turns on two admission limits. A request is mid-prefill from the step that
computes part of the tokens it has left until the step that computes the rest of its prompt (or, after a
preemption, of its recompute), and long while more than T tokens are left. A waiting request that would end the
step mid-prefill is admitted only while fewer than K requests are, and a long one only while fewer than
``max_long_partial_prefills`` long ones are; one that may not go keeps its place in the queue while later requests
that may go are admitted (short prompts overtake long ones). The queue's head is offered each freed place first, so
no prompt waits forever. K = 1 (the default) leaves admission unlimited, as in vLLM. V0 also split the budget
evenly among the prefills of a step; here the chunk size is T's alone.

Speculative decoding: a decoding request with draft tokens (``Request.spec_token_ids``, set by the proposer after
the previous step) is scheduled its last token plus the drafts, with blocks for all of them. The runner verifies
them and returns the accepted drafts plus one token; ``update_from_output`` rolls ``num_computed_tokens`` back
over the rejected drafts, so their KV slots are simply rewritten later (the blocks stay the request's). Under async
scheduling the drafts are not known when the next step is scheduled: a decode whose previous step is in flight gets
reserved draft slots (``SchedulerOutput.spec_reserved``, counted in ``num_computed_tokens`` and in
``Request.num_reserved_drafts`` until processed), which the engine core fills, or drops, at the launch;
``update_from_output`` takes back each step's reserved slots less its accepted drafts.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched_output import (
    CachedRequestData,
    EngineCoreOutput,
    EngineCoreOutputs,
    LogprobsLists,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
)
from pagedllm.multimodal.encoder_cache import EncoderCacheManager
from pagedllm.worker.input_batch import needs_history

logger = logging.getLogger(__name__)


class WaitingQueue:
    """FCFS (a deque; preempted requests re-enter at the front) or priority (a heap on priority, arrival)."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._fcfs: deque[Request] = deque()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()
        self._removed: set[str] = set()
        self._len = 0

    def add(self, request: Request, front: bool = False) -> None:
        if self.policy == "priority":
            heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._counter), request))
        elif front:
            self._fcfs.appendleft(request)
        else:
            self._fcfs.append(request)
        self._len += 1

    def _skip_removed(self) -> None:
        if self.policy == "priority":
            while self._heap and self._heap[0][3].request_id in self._removed:
                self._removed.discard(heapq.heappop(self._heap)[3].request_id)
        else:
            while self._fcfs and self._fcfs[0].request_id in self._removed:
                self._removed.discard(self._fcfs.popleft().request_id)

    def peek(self) -> Request:
        self._skip_removed()
        return self._heap[0][3] if self.policy == "priority" else self._fcfs[0]

    def pop(self) -> Request:
        self._skip_removed()
        self._len -= 1
        return heapq.heappop(self._heap)[3] if self.policy == "priority" else self._fcfs.popleft()

    def remove(self, request: Request) -> None:
        """Lazy removal (O(1)): the entry is skipped when it reaches the front."""
        self._removed.add(request.request_id)
        self._len -= 1

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        max_loras: int = 0,
        connector: Any = None,
        encoder_cache_size: int = 0,
        keep_image_spans_whole: bool = False,
        num_spec_tokens: int = 0,
    ) -> None:
        """``max_loras``: most distinct LoRA adapters among running requests (0: LoRA is off). ``connector``: the
        scheduler side of a KV connector (pagedllm/kv_transfer/base.py), or None. ``encoder_cache_size``: a
        multimodal model's encoder cache, in embedding rows (at least its largest image; 0: text only), which is
        also each step's encoder budget (``_plan_encoder``). ``keep_image_spans_whole``: never end a chunk inside
        an image's placeholders (Gemma 3, whose image tokens attend to each other both ways); the token budget
        and chunk cap must then hold the largest image (checked by the engine core). ``num_spec_tokens``: the
        drafts per request to reserve room for under async scheduling (speculative decoding; 0: none)."""
        if config.max_num_seqs is None or config.max_num_batched_tokens is None:
            raise ValueError("the scheduler needs resolved batch limits: call SchedulerConfig.resolve_defaults")
        self.config = config
        self.max_loras = max_loras
        self.kv = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue(config.policy)
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()  # to tell the runner at the next step
        self.preempted_req_ids: set[str] = set()  # the subset of those that will be resumed
        self.num_preemptions = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self._runner_num_blocks: dict[str, int] = {}  # block ids the runner already holds, per request
        self.async_scheduling = config.async_scheduling
        # Async speculative decoding reserves draft slots ahead (see the module docstring); 0: it does not.
        self.num_spec_tokens = num_spec_tokens if config.async_scheduling else 0
        # Burst knobs: the largest chunk of one request per step (max_model_len when off: never binding), and the
        # mid-prefill limits (0 when max_num_partial_prefills is 1: no limit, no counting).
        self._chunk_cap = config.long_prefill_token_threshold or config.max_model_len
        self._max_partial = config.max_num_partial_prefills if config.max_num_partial_prefills > 1 else 0
        self._max_long_partial = config.max_long_partial_prefills
        # Outputs of requests finished outside a step (a grammar that failed to compile): sent with the next step.
        self.early_outputs: list[EngineCoreOutput] = []
        self.num_grammar_reqs = 0  # unfinished requests with a structured-output constraint
        self.spec_num_drafts = 0  # speculative decoding counters (see SchedulerStats)
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0
        self.spec_accepted_per_pos: list[int] = []
        # KV connector: requests whose blocks it is loading (WAITING_FOR_REMOTE_KVS) -> (device hit, tokens to
        # load); finished requests whose blocks it still saves.
        self.connector = connector
        self.loading: dict[str, tuple[Request, int, int]] = {}
        self.parked: set[str] = set()  # waiting requests back from a load, holding its blocks until admitted
        self.delayed_free: dict[str, Request] = {}
        self.external_prefix_cache_queries = 0
        self.external_prefix_cache_hits = 0
        if connector is not None:
            connector.bind_scheduler(kv_cache_manager, self.requests)
        self.encoder_cache = EncoderCacheManager(encoder_cache_size) if encoder_cache_size else None
        self.keep_image_spans_whole = keep_image_spans_whole

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.num_grammar_reqs += request.grammar is not None
        self.waiting.add(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Finish (e.g. abort) requests wherever they are; unknown or finished ids are ignored."""
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                del self.loading[req_id]  # its load was launched already: the blocks are not reused before it
            else:
                self.waiting.remove(request)
            request.status = status
            self._free(request)

    def _free(self, request: Request) -> dict[str, Any] | None:
        """Release a finished request; returns the connector's kv_transfer_params for its output (or None)."""
        if request.mm_features and self.encoder_cache is not None:
            self.encoder_cache.release_request(request.request_id, request.mm_features)
        delay, params = False, None
        if self.connector is not None:  # it may keep the blocks for its saves or a remote instance's pull
            delay, params = self.connector.request_finished(request, self.kv.get_block_ids(request.request_id))
        if delay and request.request_id in self.kv.req_to_blocks:
            self.delayed_free[request.request_id] = request
        else:
            self.kv.free(request)
            self.parked.discard(request.request_id)
        self.num_grammar_reqs -= request.grammar is not None
        self.finished_req_ids.add(request.request_id)
        self.preempted_req_ids.discard(request.request_id)
        del self.requests[request.request_id]
        return params

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or bool(self.waiting) or bool(self.loading) or bool(self.delayed_free)

    def get_num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting) + len(self.loading)

    # ------------------------------------------------------------------ KV connector

    def _start_load(
        self, request: Request, hit_blocks: Any, num_hit: int, num_external: int, reserve: int
    ) -> bool:
        """Give a waiting request blocks for its device hit and the ``num_external`` tokens the connector will
        load, and park it until the load is reported; False (nothing changed) when the pool is short."""
        if not self.kv.allocate_slots(request, num_external, hit_blocks, 0, reserve):
            return False
        self.waiting.pop()
        request.num_computed_tokens = num_hit
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.loading[request.request_id] = (request, num_hit, num_external)
        self.connector.update_state_after_alloc(request, self.kv.get_block_ids(request.request_id), num_external)
        return True

    def _release_parked(self) -> bool:
        """Free the blocks of the requests parked after their load (``parked``): a running request that must grow
        or a waiting one that must be admitted comes first, so nothing waits on blocks that wait themselves. Their
        loaded blocks stay in the device prefix cache, where their next admission finds them. Whether any were
        freed."""
        if not self.parked:
            return False
        for req_id in self.parked:
            request = self.requests[req_id]
            self.kv.free(request)
            request.num_computed_tokens = 0
        self.parked.clear()
        return True

    def _update_from_connector(self, output: Any) -> None:
        """Finished loads: each request is computed up to its first failed block and goes back to the front of
        the waiting queue (it recomputes the rest); finished saves release delayed blocks."""
        if output is None:
            return
        invalid = output.invalid_block_ids
        for req_id in output.finished_recving:
            entry = self.loading.pop(req_id, None)
            if entry is None:
                continue  # aborted while loading
            request, num_hit, num_external = entry
            num_valid = num_external
            if invalid:
                bs = self.block_size
                block_ids = self.kv.get_block_ids(req_id)
                for i in range(num_hit // bs, (num_hit + num_external) // bs):
                    if block_ids[i] in invalid:
                        num_valid = i * bs - num_hit
                        logger.warning(
                            "request %s: the KV connector failed to load %d of %d tokens; recomputing them",
                            req_id,
                            num_external - num_valid,
                            num_external,
                        )
                        self.connector.on_load_failed(request, num_hit + num_valid)
                        break
            self.external_prefix_cache_hits += num_valid
            request.num_computed_tokens = num_hit + num_valid
            self.kv.cache_blocks(request)  # loaded blocks serve later prefix hits on the device too
            request.status = RequestStatus.WAITING
            self.waiting.add(request, front=True)
            self.parked.add(req_id)
        for req_id in output.finished_sending:
            request = self.delayed_free.pop(req_id, None)
            if request is not None:
                self.kv.free(request)

    # ------------------------------------------------------------------ one step

    def _growth_blocks(self, request: Request) -> int:
        """Blocks ``request`` still needs for the rest of its prompt and its next ``admission_headroom_tokens``
        outputs (no more than its ``max_tokens`` leave, nor past ``max_model_len``), beyond the ones it holds."""
        headroom = self.config.admission_headroom_tokens
        if headroom == 0:
            return 0
        left = request.max_tokens - request.num_output_tokens - request.num_output_placeholders
        wanted = min(request.num_tokens_with_placeholders + max(0, min(headroom, left)), self.config.max_model_len)
        missing = wanted - self.kv.num_blocks_of(request.request_id) * self.block_size
        return -(-missing // self.block_size) if missing > 0 else 0

    def _count_partial_prefills(self, scheduled: dict[str, int]) -> tuple[int, int]:
        """Running requests that this step leaves mid-prefill, and how many of them are long (see the module
        docstring), given the tokens ``scheduled`` for each so far. Only called with max_num_partial_prefills > 1."""
        num_partial = num_long = 0
        threshold = self._chunk_cap
        for request in self.running:
            num_left = request.num_tokens_with_placeholders - request.num_computed_tokens
            if num_left > (scheduled.get(request.request_id) or 1):  # unscheduled with one left: a decode
                num_partial += 1
                num_long += num_left > threshold
        return num_partial, num_long

    def _preempt_one(self) -> Request:
        """Preempt the lowest-priority (then latest) running request and requeue it at the front."""
        if self.config.policy == "priority":
            victim = max(self.running, key=lambda r: (r.priority, r.arrival_time))
        else:
            victim = self.running[-1]
        self._requeue(victim)
        victim.num_preemptions += 1
        self.num_preemptions += 1
        return victim

    def _requeue(self, request: Request) -> None:
        """Free a running request's blocks and put it back at the front of the queue with nothing computed."""
        self.running.remove(request)
        self.kv.free(request)
        if request.mm_features and self.encoder_cache is not None:
            self.encoder_cache.release_request(request.request_id, request.mm_features)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_reserved_drafts = 0
        request.spec_token_ids = []
        self.waiting.add(request, front=True)
        self.finished_req_ids.add(request.request_id)  # the runner drops it; it comes back as a new request
        self.preempted_req_ids.add(request.request_id)

    def _start_rope_regime(self, request: Request) -> None:
        """LongRoPE models (``kv.longrope_original_max`` = O): a request starting from nothing computed rotates all
        its KV with the long frequencies iff it has more than O tokens, as transformers does for a sequence that
        long. Its block hashes move to that regime's hash space (``KVCacheManager``)."""
        switch = self.kv.longrope_original_max
        if switch is not None and not request.rope_long and request.num_tokens > switch:
            request.rope_long = True
            request.block_hashes = []  # hashed in the short regime's space

    def _outgrew_rope_regime(self, request: Request, num_total: int) -> bool:
        """Whether a running request of a LongRoPE model now has more than O tokens while its KV holds the short
        rotation. transformers' ``generate`` then drops its cache and recomputes the whole sequence with the long
        frequencies (Phi-3's ``prepare_inputs_for_generation``); the scheduler does the same by requeueing the
        request (its short blocks stay cached for other short requests) and starting it again in the long
        regime (not counted as a preemption). Once per request, at most O + 1 tokens recomputed."""
        switch = self.kv.longrope_original_max
        return switch is not None and not request.rope_long and num_total > switch

    def _plan_encoder(
        self, request: Request, num_computed: int, num_new: int, encoder_budget: int
    ) -> tuple[int, list[int], int]:
        """Which of ``request``'s images must be encoded for the chunk [num_computed, num_computed + num_new): those
        whose placeholders overlap it and whose embeddings the encoder cache does not hold. An image that does not
        fit this step's ``encoder_budget`` or the cache's free room cuts the chunk just before its placeholders
        (the rest waits for a later step; the chunk may become empty). Returns ``(num_new, image indices to
        encode, encoder rows they take)``; nothing is reserved until ``_commit_encoder``."""
        cache = self.encoder_cache
        to_encode: list[int] = []
        cost = 0
        end = num_computed + num_new
        if self.keep_image_spans_whole:  # a chunk that would end inside an image ends before it (or waits)
            for feature in request.mm_features:
                if feature.offset < end < feature.end:
                    end = max(num_computed, feature.offset)
                    num_new = end - num_computed
                    break
            if num_new <= 0:
                return 0, to_encode, cost
        for i, feature in enumerate(request.mm_features):
            if feature.offset >= end:
                break
            if feature.end <= num_computed or cache.lookup(feature.mm_hash):
                continue
            if any(request.mm_features[j].mm_hash == feature.mm_hash for j in to_encode):
                continue  # the same image twice in one prompt: encoded once
            if cost + feature.length > encoder_budget or cost + feature.length > cache.room():
                return max(0, feature.offset - num_computed), to_encode, cost
            to_encode.append(i)
            cost += feature.length
        return num_new, to_encode, cost

    def _commit_encoder(self, request: Request, num_computed: int, num_new: int) -> None:
        """``request`` holds the encoder cache entries of every image its scheduled chunk touches."""
        end = num_computed + num_new
        for feature in request.mm_features:
            if feature.offset >= end:
                break
            if feature.end > num_computed:
                self.encoder_cache.add_ref(request.request_id, feature)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        max_len = self.config.max_model_len
        scheduled: dict[str, int] = {}  # req_id -> num new tokens, in batch order
        spec_tokens: dict[str, list[int]] = {}  # req_id -> draft tokens scheduled for verification
        reserved: dict[str, int] = {}  # req_id -> draft slots reserved ahead (async speculative decoding)
        num_spec_tokens = self.num_spec_tokens
        preempted = False
        encoder_cache = self.encoder_cache
        encoder_inputs: dict[str, list[int]] = {}  # req_id -> its images to encode this step
        encoder_budget = encoder_cache.cache_size if encoder_cache is not None else 0

        # 1. Running requests, in admission order.
        allocate_slots, drafting = self.kv.allocate_slots, bool(self.config.num_lookahead_tokens)
        chunk_cap = self._chunk_cap
        visited: set[str] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            i += 1
            if request.request_id in visited:
                continue
            visited.add(request.request_id)
            num_total = request.num_tokens_with_placeholders
            if request.num_output_placeholders and (
                request.num_output_tokens + request.num_output_placeholders >= request.max_tokens
                or num_total >= max_len
            ):
                continue  # its in-flight token is its last: nothing more to compute
            if self._outgrew_rope_regime(request, num_total):
                self._requeue(request)  # restarted below, among the waiting requests, in the long regime
                i = 0  # the running list changed: rescan, skipping requests already visited
                continue
            # Certain progress: draft slots of a step still in flight may yet be rejected (async speculation).
            num_computed = request.num_computed_tokens - request.num_reserved_drafts
            # One call: what it has left, the budget, the chunk cap (max_len when off), room below max_model_len.
            num_new = min(num_total - num_computed, budget, chunk_cap, max_len - num_computed)
            if num_new <= 0:
                continue
            to_encode: list[int] = []
            if request.mm_features and encoder_cache is not None and num_computed < request.num_prompt_tokens:
                num_new, to_encode, cost = self._plan_encoder(request, num_computed, num_new, encoder_budget)
                if num_new <= 0:
                    continue  # its next image does not fit this step's encoder budget or the cache
            drafts = request.spec_token_ids
            if drafts:
                request.spec_token_ids = []
                if num_new == 1 and num_total == request.num_tokens:  # a decode with nothing in flight
                    # Room for every token it may emit: positions below max_len, tokens below max_tokens.
                    num_drafts = min(
                        len(drafts),
                        budget - 1,
                        chunk_cap - 1,
                        max_len - num_total - 1,
                        request.max_tokens - request.num_output_tokens - 1,
                    )
                    switch = self.kv.longrope_original_max
                    if switch is not None and not request.rope_long:  # LongRoPE: no short-regime query past O
                        num_drafts = min(num_drafts, switch - num_total)
                    if num_drafts > 0:
                        spec_tokens[request.request_id] = drafts[:num_drafts]
                        num_new += num_drafts
            num_reserve = 0
            if (
                num_spec_tokens
                and request.num_output_placeholders
                and num_new == 1
                and not needs_history(request.sampling_params)
            ):
                # Async speculation: a decode whose previous step is in flight. Its drafts are proposed at the
                # launch, once that step's tokens are known; reserve room for as many as the fewest tokens that
                # step may emit (one) would leave: the launch caps the drafts exactly as the synchronous scheduler.
                num_reserve = min(
                    num_spec_tokens,
                    budget - 1,
                    chunk_cap - 1,
                    max_len - num_total - 1,
                    request.max_tokens - request.num_output_tokens - request.num_output_placeholders - 1,
                )
                switch = self.kv.longrope_original_max
                if switch is not None and not request.rope_long:
                    num_reserve = min(num_reserve, switch - num_total)
                num_reserve = max(num_reserve, 0)
                num_new += num_reserve
            num_alloc = num_new
            if request.num_reserved_drafts or num_reserve:
                # Reserved slots count as computed until their step is processed: no block past max_model_len.
                num_alloc = max(0, min(num_new, max_len - request.num_computed_tokens))
            lookahead = self._lookahead(request.num_computed_tokens + num_new, num_total) if drafting else 0
            while (num_alloc or lookahead) and not allocate_slots(
                request, num_alloc, num_lookahead_tokens=lookahead
            ):
                if self.parked and self._release_parked():
                    continue
                preempted = True
                i = 0  # the running list changed: rescan, skipping requests already visited
                victim = self._preempt_one()
                budget += scheduled.pop(
                    victim.request_id, 0
                )  # a victim scheduled earlier gives its tokens back
                spec_tokens.pop(victim.request_id, None)
                reserved.pop(victim.request_id, None)
                encoder_inputs.pop(victim.request_id, None)  # (the runner encodes what a sharer then lacks)
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                spec_tokens.pop(request.request_id, None)
                continue
            scheduled[request.request_id] = num_new
            if num_reserve:
                reserved[request.request_id] = num_reserve
            budget -= num_new
            if request.mm_features and encoder_cache is not None and num_computed < request.num_prompt_tokens:
                self._commit_encoder(request, num_computed, num_new)
                if to_encode:
                    encoder_inputs[request.request_id] = to_encode
                    encoder_budget -= cost

        # 2. Waiting requests, unless this step already had to preempt (no room to grow).
        new_reqs: list[Request] = []
        set_aside: list[Request] = []  # skipped this step (grammar compiling, adapter over max_loras)
        # distinct adapters among running requests (kept <= max_loras; an empty set when LoRA is off)
        active_loras: set[int] = set()
        if self.max_loras and self.waiting:
            active_loras = {r.lora_int_id for r in self.running if r.lora_request is not None}
        reserve = -1  # blocks admission must leave free: computed at the first admission attempt
        max_partial = self._max_partial
        if max_partial and self.waiting and not preempted and budget > 0:
            num_partial, num_long_partial = self._count_partial_prefills(scheduled)
        while self.waiting and not preempted and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            if request.num_output_placeholders:
                break  # preempted with a token still in flight: resumable once that token is known
            if request.grammar is not None and not request.grammar.ready():
                set_aside.append(self.waiting.pop())  # still compiling: let the others go first
                continue
            if (
                self.max_loras
                and request.lora_request is not None
                and request.lora_int_id not in active_loras
                and len(active_loras) >= self.max_loras
            ):
                set_aside.append(self.waiting.pop())  # its adapter would exceed max_loras: others may go
                continue
            if request.grammar is not None and request.grammar.error is not None:
                self.waiting.pop()
                self._finish_early(request, f"its grammar failed to compile: {request.grammar.error}")
                continue
            if max_partial:
                # Long: more than the threshold left to compute (prefix hits not counted: looked up below).
                is_long = request.num_tokens - request.num_computed_tokens > chunk_cap
                if is_long and num_long_partial >= self._max_long_partial:
                    set_aside.append(self.waiting.pop())  # as many long prompts as allowed: shorter ones may go
                    continue
            hit_blocks, num_hit, num_external = None, 0, 0
            if request.num_computed_tokens == 0 and (
                self.connector is None or request.request_id not in self.parked  # (its load came back)
            ):
                self._start_rope_regime(request)
                hit_blocks, num_hit = self.kv.get_computed_blocks(request)
                if self.connector is not None:
                    num_external, _ = self.connector.get_num_new_matched_tokens(request, num_hit)
                    self.external_prefix_cache_queries += request.num_tokens - num_hit
            if num_external:
                if reserve < 0:
                    reserve = sum(self._growth_blocks(r) for r in self.running)
                if not self._start_load(request, hit_blocks, num_hit, num_external, reserve):
                    break
                continue
            num_left = request.num_tokens - request.num_computed_tokens - num_hit
            if not self.config.enable_chunked_prefill and num_left > budget:
                break
            num_new = min(num_left, budget, chunk_cap)
            to_encode, cost = [], 0
            if request.mm_features and encoder_cache is not None:
                num_new, to_encode, cost = self._plan_encoder(
                    request, request.num_computed_tokens + num_hit, num_new, encoder_budget
                )
                if num_new <= 0 or (not self.config.enable_chunked_prefill and num_new < num_left):
                    break  # its next image does not fit this step's encoder budget or the cache: it waits
            if max_partial and num_new < num_left:  # it would end this step mid-prefill
                if num_partial >= max_partial:
                    set_aside.append(self.waiting.pop())  # no mid-prefill place left: one that finishes may go
                    continue
            lookahead = self._lookahead(request.num_computed_tokens + num_hit + num_new, request.num_tokens)
            if reserve < 0:
                reserve = sum(self._growth_blocks(r) for r in self.running)
            if not self.kv.allocate_slots(request, num_new, hit_blocks, lookahead, reserve):
                self._release_parked()  # (with a connector) so that the next step can admit the queue's head
                break
            self.waiting.pop()
            if self.parked:
                self.parked.discard(request.request_id)
            if max_partial and num_new < num_left:
                num_partial += 1
                num_long_partial += is_long
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = request.num_computed_tokens + num_hit  # (+ a connector's load)
                request.queue_time = max(0.0, time.monotonic() - request.arrival_time)
                self.num_prompt_tokens += request.num_prompt_tokens
            request.num_computed_tokens += num_hit
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if request.mm_features and encoder_cache is not None:
                self._commit_encoder(request, request.num_computed_tokens, num_new)
                if to_encode:
                    encoder_inputs[request.request_id] = to_encode
                    encoder_budget -= cost
            if request.lora_request is not None:
                active_loras.add(request.lora_int_id)
            new_reqs.append(request)
            scheduled[request.request_id] = num_new
            budget -= num_new
            reserve += self._growth_blocks(request)  # its own next tokens, for the next admission

        for request in reversed(set_aside):
            self.waiting.add(request, front=True)

        # 3. Package: new (or resumed) requests in full, the others as diffs.
        new_ids = {r.request_id for r in new_reqs}
        new_data, cached_data = [], []
        num_computed_before: dict[str, int] = {}
        requests, runner_num_blocks, num_blocks_of = self.requests, self._runner_num_blocks, self.kv.num_blocks_of
        for req_id, num_new in scheduled.items():
            request = requests[req_id]
            if req_id in new_ids:
                block_ids = self.kv.get_all_block_ids(req_id)
                new_data.append(
                    NewRequestData(
                        req_id=req_id,
                        token_ids=list(request.all_token_ids),
                        num_prompt_tokens=request.num_prompt_tokens,
                        sampling_params=request.sampling_params,
                        block_ids=block_ids,
                        num_computed_tokens=request.num_computed_tokens,
                        eos_token_id=request.eos_token_id,
                        output_token_ids=list(request.output_token_ids),
                        lora_request=request.lora_request,
                        mm_features=request.mm_features or None,
                    )
                )
            num_blocks = num_blocks_of(req_id)
            if req_id not in new_ids:
                known = runner_num_blocks.get(req_id, 0)
                if num_blocks > known:  # most decode steps add no block: nothing to send
                    new_block_ids = self.kv.get_all_block_ids(req_id, known)
                    cached_data.append(CachedRequestData(req_id, new_block_ids, request.num_computed_tokens))
            runner_num_blocks[req_id] = num_blocks
            num_computed_before[req_id] = request.num_computed_tokens
            request.num_computed_tokens += num_new
            if reserved:
                request.num_reserved_drafts += reserved.get(req_id, 0)
            if (
                self.async_scheduling
                and request.num_computed_tokens - request.num_reserved_drafts == request.num_tokens_with_placeholders
            ):
                request.num_output_placeholders += 1  # this step samples a token the host learns later
        for req_id in self.finished_req_ids:
            if req_id not in scheduled:
                self._runner_num_blocks.pop(req_id, None)
        out = SchedulerOutput(
            scheduled_new_reqs=new_data,
            scheduled_cached_reqs=cached_data,
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=sum(scheduled.values()),
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=self.preempted_req_ids,
            num_computed_tokens=num_computed_before,
            scheduled_spec_decode_tokens=spec_tokens,
            spec_reserved=reserved,
        )
        if encoder_cache is not None:
            encoder_cache.end_step()
            out.scheduled_encoder_inputs = encoder_inputs
            out.free_encoder_mm_hashes = encoder_cache.take_freed()
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        self.finished_req_ids = set()
        self.preempted_req_ids = set()
        return out

    # ------------------------------------------------------------------ after the forward

    def update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> EngineCoreOutputs:
        """Append sampled tokens, check stop conditions, cache newly computed blocks, free finished requests."""
        outputs: list[EngineCoreOutput] = []
        # Looked up once: this loop runs for every scheduled request, every step.
        requests, sampled = self.requests, result.sampled_token_ids
        spec_tokens, reserved, prompt_logprobs, logprobs = (
            sched.scheduled_spec_decode_tokens, sched.spec_reserved, result.prompt_logprobs, result.logprobs
        )
        cache_blocks, async_scheduling, running = self.kv.cache_blocks, self.async_scheduling, RequestStatus.RUNNING
        if self.connector is not None:
            self._update_from_connector(result.kv_connector_output)
        for req_id in sched.num_scheduled_tokens:
            request = requests.get(req_id)
            if request is None:
                continue  # finished or aborted meanwhile: what this step computed for it is dropped
            new_token_ids = sampled.get(req_id)
            if new_token_ids is None:
                new_token_ids = []  # its own list: the output below may carry it
            is_running = request.status == running
            if spec_tokens or reserved:
                drafts = spec_tokens.get(req_id)
                # Verification emitted the accepted drafts plus one token: the KV computed for the rejected drafts
                # is dropped by counting them as not computed (their slots are rewritten next step).
                num_accepted = len(new_token_ids) - 1 if drafts and new_token_ids else 0
                num_slots = reserved.get(req_id) if reserved else None
                if num_slots is not None:
                    # Async: the step counted its reserved slots, of which the launch filled num_drafts or fewer.
                    if is_running:  # (a preempted request restarts from nothing computed)
                        request.num_computed_tokens -= num_slots - num_accepted
                        request.num_reserved_drafts -= num_slots
                elif drafts and new_token_ids:
                    request.num_computed_tokens -= len(drafts) - num_accepted
                if drafts and new_token_ids:
                    self._count_spec(len(drafts), num_accepted)
            if is_running:
                cache_blocks(request)  # and frees the blocks its sliding windows left behind
                if request.mm_features and self.encoder_cache is not None:
                    self.encoder_cache.release_computed(req_id, request.mm_features, request.num_computed_tokens)
            elif not new_token_ids:
                continue
            # else: preempted after this (async) step was scheduled; the token it sampled is still valid.
            if async_scheduling and new_token_ids:
                request.num_output_placeholders -= 1  # one per sampling step, however many tokens it emitted
            prompt_lp = prompt_logprobs.get(req_id) if prompt_logprobs else None
            if prompt_lp is not None:
                first_pos = sched.num_computed_tokens[req_id] + 1
                prompt_lp = self._new_prompt_logprob_rows(request, prompt_lp, first_pos)
            new_logprobs = logprobs.get(req_id) if logprobs else None
            for i, token_id in enumerate(new_token_ids):
                request.append_output_token(token_id)
                self.num_generation_tokens += 1
                if request.grammar is not None and not request.grammar.accept(token_id):
                    logger.error("request %s: its grammar rejected token %d; aborting it", req_id, token_id)
                    request.status = RequestStatus.FINISHED_ABORTED
                elif not self._check_stop(request, token_id):
                    continue
                if i + 1 < len(new_token_ids):  # several tokens (speculative decoding): none after the stop
                    new_token_ids = new_token_ids[: i + 1]
                    if new_logprobs is not None:
                        new_logprobs = LogprobsLists(
                            new_logprobs.token_ids[: i + 1],
                            new_logprobs.logprobs[: i + 1],
                            new_logprobs.ranks[: i + 1],
                        )
                break
            if not new_token_ids and prompt_lp is None:
                continue
            queue_time = None if request.queue_time_sent else request.queue_time
            request.queue_time_sent = True
            outputs.append(
                EngineCoreOutput(
                    request_id=req_id,
                    new_token_ids=new_token_ids,
                    new_logprobs=new_logprobs,
                    new_prompt_logprobs=prompt_lp,
                    finish_reason=request.status.finish_reason(),
                    stop_reason=request.stop_reason,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    queue_time=queue_time,
                )
            )
            if request.is_finished():
                if is_running:
                    self.running.remove(request)
                else:
                    self.waiting.remove(request)
                outputs[-1].kv_transfer_params = self._free(request)
        return EngineCoreOutputs(outputs=outputs, stats=self.make_stats(), timestamp=time.monotonic())

    def _lookahead(self, num_computed_after: int, num_tokens: int) -> int:
        """KV slots to reserve past a request's scheduled tokens: a draft model writes up to
        ``num_lookahead_tokens`` drafts there after the step (only when the step brings the request level)."""
        if not self.config.num_lookahead_tokens or num_computed_after < num_tokens:
            return 0
        return max(0, min(self.config.num_lookahead_tokens, self.config.max_model_len - num_computed_after))

    def _count_spec(self, num_drafts: int, num_accepted: int) -> None:
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += num_drafts
        self.spec_num_accepted_tokens += num_accepted
        per_pos = self.spec_accepted_per_pos
        if len(per_pos) < num_drafts:
            per_pos.extend([0] * (num_drafts - len(per_pos)))
        for i in range(num_accepted):
            per_pos[i] += 1

    def _finish_early(self, request: Request, why: str) -> None:
        """Abort a waiting request that can never run, and queue the output that tells its client."""
        logger.error("request %s aborted: %s", request.request_id, why)
        request.status = RequestStatus.FINISHED_ABORTED
        self._free(request)
        self.early_outputs.append(
            EngineCoreOutput(request_id=request.request_id, new_token_ids=[], finish_reason="abort")
        )

    def take_early_outputs(self) -> list[EngineCoreOutput]:
        outputs, self.early_outputs = self.early_outputs, []
        return outputs

    def requests_waiting_for_grammar(self) -> list[Request]:
        """Waiting requests whose grammar is still compiling."""
        return [r for r in self.requests.values() if r.grammar is not None and not r.grammar.ready()]

    @staticmethod
    def _new_prompt_logprob_rows(
        request: Request, rows: LogprobsLists, first_pos: int
    ) -> LogprobsLists | None:
        """Drop rows already returned before a preemption made the request recompute its prompt.

        ``rows`` covers prompt positions ``first_pos, first_pos + 1, ...`` (position 0 never has one).
        """
        start = request.num_prompt_logprobs_sent
        n = len(rows.token_ids)
        skip = max(0, start + 1 - first_pos)
        if skip >= n:
            return None
        if skip:
            rows.token_ids, rows.logprobs, rows.ranks = (
                rows.token_ids[skip:],
                rows.logprobs[skip:],
                rows.ranks[skip:],
            )
        request.num_prompt_logprobs_sent = first_pos + n - 1
        return rows

    def stops_within(self, request: Request, token_ids: Sequence[int]) -> bool:
        """Whether appending ``token_ids`` (a step's tokens, not processed yet) finishes ``request`` by a stop token,
        max_tokens or max_model_len, as ``update_from_output`` will find (a grammar's end aside); changes nothing."""
        params = request.sampling_params
        num_output, num_tokens = request.num_output_tokens, request.num_tokens
        for token_id in token_ids:
            num_output += 1
            num_tokens += 1
            if num_output >= params.min_tokens and (
                (not params.ignore_eos and token_id == request.eos_token_id) or token_id in params.stop_token_ids
            ):
                return True
            if num_output >= request.max_tokens or num_tokens >= self.config.max_model_len:
                return True
        return False

    def _check_stop(self, request: Request, token_id: int) -> bool:
        params = request.sampling_params
        status = None
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id == request.eos_token_id:
                status = RequestStatus.FINISHED_STOPPED
            elif token_id in params.stop_token_ids:
                status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token_id
        if status is None and request.grammar is not None and request.grammar.terminated:
            # The constraint is complete and admits nothing more: it wins over min_tokens and ignore_eos.
            status = RequestStatus.FINISHED_STOPPED
            if token_id != request.eos_token_id:
                request.stop_reason = token_id
        if status is None and (
            request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.config.max_model_len
        ):
            status = RequestStatus.FINISHED_LENGTH
        if status is None:
            return False
        request.status = status
        return True

    # ------------------------------------------------------------------ introspection

    def make_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv.usage(),
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            num_prompt_tokens=self.num_prompt_tokens,
            external_prefix_cache_queries=self.external_prefix_cache_queries,
            external_prefix_cache_hits=self.external_prefix_cache_hits,
            kv_connector_stats=self.connector.get_stats() if self.connector is not None else {},
            num_generation_tokens=self.num_generation_tokens,
            spec_num_drafts=self.spec_num_drafts,
            spec_num_draft_tokens=self.spec_num_draft_tokens,
            spec_num_accepted_tokens=self.spec_num_accepted_tokens,
            spec_accepted_per_pos=list(self.spec_accepted_per_pos),
            encoder_cache_queries=self.encoder_cache.num_queries if self.encoder_cache is not None else 0,
            encoder_cache_hits=self.encoder_cache.num_hits if self.encoder_cache is not None else 0,
        )

    def check_integrity(self, block_ids: range | None = None) -> None:
        """Assert block-pool invariants and that only live requests own blocks (callable any time).

        ``block_ids`` limits the per-block part of the check to those blocks (see ``BlockPool.check_integrity``).
        """
        self.kv.check_integrity(block_ids)
        live = {r.request_id for r in self.running}
        live.update(self.loading, self.delayed_free, self.parked)
        assert set(self.kv.req_to_blocks) <= live, "a request that is not running owns blocks"
        assert len(self.running) + len(self.waiting) + len(self.loading) == len(self.requests), (
            "request tables out of sync"
        )
        if not self.requests and not self.delayed_free:
            assert self.kv.num_free_blocks == self.kv.pool.num_blocks, "blocks leaked with no requests left"
        if self.encoder_cache is not None:
            self.encoder_cache.check_integrity({r.request_id for r in self.running})
