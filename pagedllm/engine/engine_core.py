"""EngineCore: scheduler + model runner. Token ids in, token ids out; no text, no threads.

The sync ``LLMEngine`` drives one in-process; the server runs one in its own process (core_process.py).
"""

from __future__ import annotations

import gc
import logging
import os
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch

from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_manager import KVCacheManager, blocks_per_sequence, cdiv, plan_kv_cache_layout
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched_output import EngineCoreOutputs, EngineCoreRequest, SchedulerOutput, SchedulerStats
from pagedllm.core.scheduler import Scheduler
from pagedllm.kernels import compile_watch
from pagedllm.layers.rotary import longrope_original_max
from pagedllm.spec_decode.proposer import DraftView, num_drafts_allowed
from pagedllm.structured_output.manager import StructuredOutputManager
from pagedllm.worker.cpu_threads import CpuThreadGovernor, apply_user_thread_setting
from pagedllm.worker.model_runner import ModelRunner, StepInFlight
from pagedllm.worker.spec_step import SpecAhead

logger = logging.getLogger(__name__)

# The idle-time integrity check walks every block up to this pool size (under ~10 ms in CPython); a larger pool
# gets this many blocks per idle transition, in a window that rotates through the pool, plus the O(1) counters.
IDLE_CHECK_MAX_BLOCKS = 32768
# A step that scheduled nothing while a KV connector's transfers are pending waits this long before the next one.
CONNECTOR_IDLE_WAIT_S = 0.001


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


class EngineCore:
    def __init__(self, config: EngineConfig, tokenizer: Any = None) -> None:
        """``tokenizer``: the front-end's, when it shares the process (structured outputs need one; without it
        the core loads its own at the first constrained request)."""
        self.config = config
        self._tokenizer = tokenizer
        self.structured: StructuredOutputManager | None = None  # created at the first constrained request
        self.proposer = None
        self._worker = None  # rank 0's Worker in a one-rank engine (collective_rpc), made at first use
        self._in_flight: tuple[SchedulerOutput, StepInFlight] | None = None  # launched, not yet collected
        self._pending_sample: tuple[StepInFlight, Any] | None = None  # launched; its bitmask is being filled
        self._shut_down = False
        # One CPU engine in this process: its op thread count follows the cores other processes leave free
        # (tensor-parallel CPU workers keep their fixed share).
        self._cpu_threads: CpuThreadGovernor | None = None
        if config.device_config.device.type == "cpu" and config.parallel_config.world_size == 1:
            apply_user_thread_setting()
            self._cpu_threads = CpuThreadGovernor()
        t0 = time.perf_counter()
        # Batch limits the user left unset: the device's defaults (before any rank reads them).
        config.scheduler_config.resolve_defaults(config.device_config.device)
        if config.parallel_config.world_size > 1:
            from pagedllm.distributed.executor import MultiprocRunner

            self.runner = MultiprocRunner(config)  # rank 0 here, the other ranks in worker processes
        else:
            self.runner = ModelRunner(config)
        self._asleep: set[str] = set()  # sleep mode: the parts ("weights", "kv_cache") now released
        if config.device_config.device.type == "cuda":
            _LIVE_CUDA_CORES.add(self)
        try:
            self._start(t0)
        except BaseException:  # workers, process groups and device memory must not outlive a failed start
            try:
                self.shutdown()
            except Exception:  # noqa: BLE001 - the start-up error is the one to raise
                logger.exception("releasing the engine core after a failed start failed")
            raise

    def _start(self, t0: float) -> None:
        """Everything after the runner: the proposer, the memory profile, the KV cache, CUDA graphs, the
        scheduler."""
        config = self.config
        if config.speculative_config is not None:
            from pagedllm.spec_decode.proposer import make_proposer

            # A draft model loads here, before the memory profile.
            self.proposer = make_proposer(config, self.runner)
        t_load = time.perf_counter()
        extra_block_bytes = self.proposer.kv_block_bytes() if self.proposer is not None else 0
        with compile_watch.start_up():
            num_blocks = self.runner.determine_num_blocks(extra_block_bytes)
        t_profile = time.perf_counter()
        block_size = config.cache_config.block_size
        max_model_len = config.model_config.max_model_len
        # The runner's KV cache groups (core/kv_cache_manager.py): sliding-window layers free the blocks behind their
        # window, so one sequence holds there its window, a block of margin and at most one step's new tokens.
        layout = self.runner.kv_layout
        step_tokens = config.scheduler_config.max_num_batched_tokens
        blocks_per_seq = sum(
            blocks_per_sequence(layout.group_windows, block_size, max_model_len, step_tokens)
        )
        if num_blocks < blocks_per_seq:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks ({num_blocks * block_size} tokens) but one sequence of "
                f"max_model_len={max_model_len} needs {blocks_per_seq} blocks: lower max_model_len, or give the "
                "cache more memory (gpu_memory_utilization, kv_cache_memory_bytes, num_gpu_blocks_override)"
            )
        self.runner.init_kv_cache(num_blocks)
        t_kv = time.perf_counter()
        with compile_watch.start_up():
            self.runner.maybe_capture_cuda_graphs()
        t_graphs = time.perf_counter()
        # One line `pagedllm bench startup` reads back.
        logger.info(
            "start-up phases: load %.2f s, profile %.2f s, kv cache %.2f s, cuda graphs %.2f s, engine %.2f s",
            t_load - t0,
            t_profile - t_load,
            t_kv - t_profile,
            t_graphs - t_kv,
            t_graphs - t0,
        )
        self.kv_cache_manager = KVCacheManager(
            num_blocks,
            block_size,
            config.cache_config.enable_prefix_caching,
            layout.group_windows,
            longrope_original_max=longrope_original_max(config.model_config.hf_config),
        )
        lora_config = config.lora_config
        self.scheduler = Scheduler(
            config.scheduler_config,
            self.kv_cache_manager,
            max_loras=lora_config.max_loras if lora_config is not None else 0,
            connector=self._make_kv_connectors(),
            encoder_cache_size=self._encoder_cache_size(),
            keep_image_spans_whole=self._keep_image_spans_whole(),
            num_spec_tokens=0 if self.proposer is None else config.speculative_config.num_speculative_tokens,
        )
        self._lora_paths: dict[int, str] = {}  # lora_int_id -> path, for good: ids key prefix-cache hashes
        self.async_scheduling = config.scheduler_config.async_scheduling
        # Async speculation launches a verification step without waiting for the step in flight where it can
        # (_plan_ahead); PAGEDLLM_SPEC_AHEAD=0 makes every launch wait (A/B runs).
        self.spec_ahead = os.environ.get("PAGEDLLM_SPEC_AHEAD", "1") != "0"
        self.num_spec_launches = 0  # verification launches under async scheduling ...
        self.num_spec_launches_ahead = 0  # ... of which did not wait for the step in flight
        if self.proposer is not None:
            self.proposer.init_kv_cache(num_blocks, self.kv_cache_manager)
        self.vocab_size = config.model_config.vocab_size
        self.check_integrity_on_idle = config.check_integrity_on_idle
        self._idle_check_due = False  # work arrived since the last idle check
        self._idle_check_start = 0  # first block of the next window (pools over IDLE_CHECK_MAX_BLOCKS)
        self.num_integrity_failures = 0
        self.last_integrity_error: str | None = None
        self.kv_cache_info = self._log_kv_cache(num_blocks)

    def _encoder_cache_size(self) -> int:
        """A multimodal model's encoder cache and per-step encoder budget, in embedding rows: the step's token
        budget, and never less than one image (vLLM's rule); 0 for a text-only model."""
        mm_config = getattr(self.config.model_config, "mm_hf_config", None)
        if mm_config is None:
            return 0
        from pagedllm.multimodal.processing import max_tokens_per_image

        largest = max_tokens_per_image(mm_config, self.config.model_config.model_path)
        return max(self.config.scheduler_config.max_num_batched_tokens, largest)

    def _keep_image_spans_whole(self) -> bool:
        """Whether chunks must not split an image's placeholders (Gemma 3); ``ValueError`` when one step's token
        budget or chunk cap cannot hold an image then."""
        mm_config = getattr(self.config.model_config, "mm_hf_config", None)
        if mm_config is None:
            return False
        from pagedllm.multimodal.processing import keeps_image_spans_whole, max_tokens_per_image

        if not keeps_image_spans_whole(mm_config.architectures[0]):
            return False
        largest = max_tokens_per_image(mm_config, self.config.model_config.model_path)
        sched = self.config.scheduler_config
        for name, value in (
            ("max_num_batched_tokens", sched.max_num_batched_tokens),
            ("long_prefill_token_threshold", sched.long_prefill_token_threshold),
        ):
            if value and value < largest:
                raise ValueError(
                    f"{name} ({value}) must be at least an image's {largest} tokens for "
                    f"{mm_config.architectures[0]}: an image's tokens attend to each other, so they are computed "
                    "in one step"
                )
        return True

    def _make_kv_connectors(self) -> Any:
        """The KV connector's two sides (``kv_transfer_config``): the worker side goes to the runner, the scheduler
        side is returned (None without a connector). ``ValueError`` naming the field for a layout it cannot serve."""
        transfer = self.config.kv_transfer_config
        if transfer is None:
            return None
        from pagedllm.kv_transfer.base import KVConnectorRole
        from pagedllm.kv_transfer.factory import create_connector

        if self.runner.kv_layout.group_windows != (None,):
            raise ValueError(
                "kv_transfer_config: KV connectors need one full-attention KV cache group; this model has "
                f"{self.runner.kv_layout.describe()} (sliding-window layers are not supported yet)"
            )
        block_bytes = self.runner.kv_block_bytes()
        self.runner.register_kv_connector(create_connector(self.config, KVConnectorRole.WORKER, block_bytes))
        connector = create_connector(self.config, KVConnectorRole.SCHEDULER, block_bytes)
        logger.info("KV connector %s (%s)", transfer.kv_connector, transfer.kv_role)
        return connector

    def _log_kv_cache(self, num_blocks: int) -> dict[str, Any]:
        """Log the KV cache's size and capacity; return ``kv_cache_info``. For a model with sliding-window layers,
        also what one ``max_model_len`` sequence's KV takes with the windowed cache and without it (every layer
        keeping every block), whichever is on."""
        config = self.config
        block_size = config.cache_config.block_size
        max_model_len = config.model_config.max_model_len
        layout = self.runner.kv_layout
        per_group = blocks_per_sequence(layout.group_windows, block_size, max_model_len)  # while decoding
        info = {
            "num_blocks": num_blocks,
            "block_size": block_size,
            "num_tokens": num_blocks * block_size,
            "kv_cache_bytes": num_blocks * self.runner.kv_block_bytes(),
            "max_concurrency": num_blocks / sum(per_group),
            "group_windows": list(layout.group_windows),
        }
        groups = "" if layout.num_groups == 1 else f" in {layout.num_groups} groups: {layout.describe()}"
        logger.info(
            "KV cache (%s): %d blocks of %d tokens (%d tokens, %.1f MiB)%s; maximum concurrency for %d-token "
            "requests: %.2fx",
            config.cache_config.cache_dtype,
            num_blocks,
            block_size,
            num_blocks * block_size,
            info["kv_cache_bytes"] / 2**20,
            groups,
            max_model_len,
            info["max_concurrency"],
        )
        # What a sequence costs (this rank's layers) with the windowed cache, every window freed behind, and
        # without it, one group keeping every block.
        windows = self.runner.layer_windows()
        windowed = plan_kv_cache_layout(windows, max_model_len)
        if windowed.group_windows == (None,):
            return info  # no layer has a window to free behind
        seq_blocks = blocks_per_sequence(windowed.group_windows, block_size, max_model_len)
        info["seq_kv_bytes_windowed"] = sum(seq_blocks) * self.runner.kv_block_bytes(windowed)
        full = plan_kv_cache_layout([None] * len(windows), max_model_len)
        info["seq_kv_bytes_full"] = cdiv(max_model_len, block_size) * self.runner.kv_block_bytes(full)
        logger.info(
            "KV cache per %d-token sequence: %s with the windowed cache (blocks per group %s), %s without it "
            "(%.2fx as much); windowed cache %s",
            max_model_len,
            _bytes(info["seq_kv_bytes_windowed"]),
            "/".join(map(str, seq_blocks)),
            _bytes(info["seq_kv_bytes_full"]),
            info["seq_kv_bytes_full"] / info["seq_kv_bytes_windowed"],
            "on" if layout == windowed else "off (disable_hybrid_kv_cache_manager, spec decoding or PP)",
        )
        return info

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a tokenized request; ``ValueError`` if it can never run (the front-end checks this first)."""
        self.check_awake()
        max_len = self.config.model_config.max_model_len
        ids = request.prompt_token_ids
        if not ids:
            raise ValueError("prompt_token_ids must not be empty")
        if len(ids) >= max_len:
            raise ValueError(
                f"the prompt ({len(ids)} tokens) is longer than the maximum model length of {max_len} "
                "(one position is needed for the first generated token)"
            )
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise ValueError(
                f"prompt_token_ids must be in [0, {self.vocab_size}): token ids out of vocabulary"
            )
        if request.mm_features:
            self._check_mm_features(request)
        if request.lora_request is not None:
            self.add_lora(request.lora_request)  # ValueError naming lora_request, with nothing queued
        req = Request.from_engine_core_request(request)
        so = request.sampling_params.structured_outputs
        if so is not None:
            stop = [] if request.eos_token_id is None else [request.eos_token_id]
            stop += request.sampling_params.stop_token_ids or []
            req.grammar = self._structured().new_state(so, req.prompt_token_ids, stop)
        self.scheduler.add_request(req)
        self._idle_check_due = True

    def _check_mm_features(self, request: EngineCoreRequest) -> None:
        """Images only for a multimodal model, each span inside the prompt, in order, not overlapping."""
        if self.scheduler.encoder_cache is None:
            raise ValueError(
                f"multi_modal_data: {self.config.model_config.model} is a text-only model; it takes no images"
            )
        prev_end = 0
        for i, f in enumerate(request.mm_features):
            if f.offset < prev_end or f.end > len(request.prompt_token_ids) or f.length < 1:
                raise ValueError(f"multi_modal_data: image {i}'s placeholder span is out of order or out of the prompt")
            if f.length > self.scheduler.encoder_cache.cache_size:
                raise ValueError(
                    f"multi_modal_data: image {i} takes {f.length} tokens, more than the encoder cache holds "
                    f"({self.scheduler.encoder_cache.cache_size}); send a smaller image or raise max_num_batched_tokens"
                )
            prev_end = f.end

    def _structured(self) -> StructuredOutputManager:
        if self.structured is None:
            mc = self.config.model_config

            def load_tokenizer() -> Any:
                if self._tokenizer is None:
                    from pagedllm.tokenizer import get_tokenizer

                    self._tokenizer = get_tokenizer(mc.tokenizer, trust_remote_code=mc.trust_remote_code)
                return self._tokenizer

            markers = None
            if self.config.reasoning_parser is not None:
                from pagedllm.entrypoints.openai.reasoning_parsers import get_reasoning_parser

                parser = get_reasoning_parser(self.config.reasoning_parser)
                markers = (parser.start_token, parser.end_token)
            self.structured = StructuredOutputManager(
                mc.vocab_size, load_tokenizer, markers, pin_memory=self.runner.device.type == "cuda"
            )
        return self.structured

    def _grammar_states(self, step: StepInFlight) -> list | None:
        if self.structured is None or not step.sample_req_ids or not self.scheduler.num_grammar_reqs:
            return None
        requests = self.scheduler.requests
        return [getattr(requests.get(r), "grammar", None) for r in step.sample_req_ids]

    def _grammar_bitmask(self, step: StepInFlight):
        """The step's bitmask (host tensor), or None when none of its sampling rows is constrained."""
        states = self._grammar_states(step)
        if states is None:
            return None
        num_draft = getattr(step, "spec_num_draft", None)
        if num_draft is not None and num_draft.any():  # one row per draft position (speculative decoding)
            drafts = [step.spec_draft_ids[i, :n].tolist() for i, n in enumerate(num_draft)]
            return self.structured.grammar_bitmask_spec(states, drafts)
        return self.structured.grammar_bitmask(states)

    def _complete_sample(self) -> None:
        """Sample the launched step whose bitmask was being filled in the background (async scheduling)."""
        if self._pending_sample is not None:
            self.runner.sample(*self._await_bitmask())

    def _await_bitmask(self) -> tuple[StepInFlight, Any]:
        """The pending step and its bitmask, once the background fill is done (the engine thread waits here)."""
        step, future = self._pending_sample
        self._pending_sample = None
        return step, future.result()

    def _wait_when_idle(self) -> None:
        """Nothing could be scheduled: if requests wait for their grammar, block briefly on the first of them
        instead of spinning; if only a KV connector's transfers are pending (loads, or blocks kept for another
        instance to pull), pause a moment so that the loop does not spin (or flood the front-end with stats)."""
        waiting = self.scheduler.requests_waiting_for_grammar()
        if waiting:
            waiting[0].grammar.wait(0.05)
        elif self.scheduler.loading or self.scheduler.delayed_free:
            time.sleep(CONNECTOR_IDLE_WAIT_S)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        self._drain_if_idle()

    def _drain_if_idle(self) -> None:
        """With no request left, the step in flight computes only for finished requests: nothing of it reaches
        anyone. Wait for it now, so the engine is idle (and the runner's batch consistent) at once."""
        if self._in_flight is not None and not self.scheduler.has_unfinished_requests():
            self._complete_sample()
            self.runner.collect(self._in_flight[1])
            self._in_flight = None

    def step(self) -> EngineCoreOutputs:
        """Run one step. With async scheduling, launch step N+1, then return step N's outputs: the scheduler
        plans and the host bookkeeps while the device computes."""
        if self._cpu_threads is not None:
            self._cpu_threads.maybe_update()
        if self.async_scheduling:
            return self._step_async()
        if not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs(stats=self.get_stats(), timestamp=time.monotonic())
        sched = self.scheduler.schedule()
        if sched.total_num_scheduled_tokens == 0:
            self._wait_when_idle()
        step = self.runner.launch(sched)
        self.runner.sample(step, self._grammar_bitmask(step))
        result = self.runner.collect(step)
        outputs = self.scheduler.update_from_output(sched, result)
        if self.proposer is not None:
            self.proposer.propose(self.scheduler.running, sched, step, result)
        return self._finish_outputs(outputs)

    def _step_async(self) -> EngineCoreOutputs:
        """Launch step N+1's forward, then finish step N. A step with constrained rows samples after step N's
        tokens have advanced the grammars (its forward runs on the device meanwhile); others sample at once."""
        launched = None
        sample_later = False
        if self.scheduler.has_unfinished_requests():
            sched = self.scheduler.schedule()  # overlaps the previous step's bitmask fill, if one is running
            self._complete_sample()
            if sched.total_num_scheduled_tokens == 0:
                self._wait_when_idle()
            if self.proposer is not None:
                self._propose_ahead(sched)
            step = self.runner.launch(sched)
            sample_later = self.scheduler.num_grammar_reqs > 0 and bool(step.sample_req_ids)
            if not sample_later:
                self.runner.sample(step)
            launched = (sched, step)
        self._complete_sample()
        prev, self._in_flight = self._in_flight, launched
        if prev is None:
            outputs = EngineCoreOutputs(stats=self.get_stats(), timestamp=time.monotonic())
        else:
            result = self.runner.collect(prev[1])
            if launched is not None and launched[0].spec_ahead is not None:
                self._settle_ahead(launched[0], result)
            outputs = self.scheduler.update_from_output(prev[0], result)
        if sample_later:
            # The matchers now know the previous step's tokens: fill this step's bitmask in the background while
            # the outputs go out and the next step is scheduled; the next step() samples before it launches.
            states = self._grammar_states(launched[1])
            num_draft = getattr(launched[1], "spec_num_draft", None)
            if states is None:
                self.runner.sample(launched[1])
            elif num_draft is not None and num_draft.any():
                # Drafts to verify: a mask for each draft position, walked through the drafts here (on this
                # thread: the matchers go back to where they were before the next step is scheduled).
                self.runner.sample(launched[1], self._grammar_bitmask(launched[1]))
            else:
                self._pending_sample = (launched[1], self.structured.grammar_bitmask_async(states))
        self._drain_if_idle()
        return self._finish_outputs(outputs)

    def _propose_ahead(self, sched: SchedulerOutput) -> None:
        """Async speculative decoding, just before ``sched`` launches: wait for the tokens of the step in flight
        (the loop's one wait), move each of ``sched``'s requests back over the drafts that step rejected, run the
        proposer over that step as the synchronous loop does after it, and put the drafts into the slots the
        scheduler reserved (no more than the synchronous scheduler would send; unused slots are dropped)."""
        if self._in_flight is None:
            return
        prev_sched, prev_step = self._in_flight
        if sched.spec_reserved or sched.scheduled_spec_decode_tokens:
            self.num_spec_launches += 1
        ahead = self._plan_ahead(sched, prev_sched, prev_step)
        if ahead is not None:
            sched.spec_ahead = ahead
            spec = sched.scheduled_spec_decode_tokens
            for req_id, num_draft in zip(ahead.req_ids, ahead.num_draft.tolist()):
                spec[req_id] = [0] * num_draft  # (their ids are on the device; the scheduler counts them)
            prev_step.device_drafts = None  # taken
            self.num_spec_launches_ahead += 1
            return
        if (
            not (sched.spec_reserved or prev_sched.spec_reserved or self.proposer.reads_every_step)
            and isinstance(self.runner, ModelRunner)  # (tensor-parallel workers get the tokens with the launch)
        ):
            return  # nothing to move or fill: the launch need not wait (as without speculation)
        result = self.runner.collect(prev_step)
        scheduler = self.scheduler
        batch = self.runner.input_batch
        sampled = result.sampled_token_ids
        reserved = sched.spec_reserved
        num_computed, num_sched = sched.num_computed_tokens, sched.num_scheduled_tokens
        views: dict[str, DraftView] = {}
        for req_id in prev_step.req_ids:
            request = scheduler.requests.get(req_id)
            row = batch.req_id_to_row.get(req_id)
            if request is None or row is None or request.status != RequestStatus.RUNNING:
                continue  # finished, aborted or preempted: as absent from the synchronous loop's running list
            emitted = sampled.get(req_id)
            if emitted and scheduler.stops_within(request, emitted):
                # It finishes with that step's output (the synchronous loop would not schedule it again): nothing
                # to compute or propose for it (and a row at max_model_len has no room for another token).
                if req_id in num_sched:
                    sched.total_num_scheduled_tokens -= num_sched.pop(req_id)
                    del num_computed[req_id]
                    reserved.pop(req_id, None)
                continue
            tokens = batch.token_ids_np[row, : batch.num_tokens_np[row]]
            views[req_id] = DraftView(request, tokens, len(tokens) - request.num_tokens, reserved.get(req_id, 0))
        for req_id, num_slots in prev_sched.spec_reserved.items():
            if req_id in num_sched:  # counted with all its slots kept: the rejected drafts are not computed
                emitted = sampled.get(req_id)
                num_computed[req_id] -= num_slots - (len(emitted) - 1 if emitted else 0)
        self.proposer.propose(list(views.values()), prev_sched, prev_step, result)
        if not reserved:
            return
        k = self.config.speculative_config.num_speculative_tokens
        max_len = self.config.model_config.max_model_len
        switch = self.kv_cache_manager.longrope_original_max
        spec = sched.scheduled_spec_decode_tokens
        for req_id, num_slots in reserved.items():
            view = views.get(req_id)
            drafts = [] if view is None else view.spec_token_ids
            if drafts:
                n = num_drafts_allowed(view, k, max_len)
                if switch is not None and not scheduler.requests[req_id].rope_long:  # no short-regime query past it
                    n = min(n, switch - view.num_tokens)
                drafts = list(drafts[: max(n, 0)])
            if drafts:
                spec[req_id] = drafts
            num_sched[req_id] = 1 + len(drafts)
            sched.total_num_scheduled_tokens -= num_slots - len(drafts)

    def _plan_ahead(
        self, sched: SchedulerOutput, prev_sched: SchedulerOutput, prev_step: StepInFlight
    ) -> SpecAhead | None:
        """A launch of ``sched`` that need not wait for the step in flight (worker/spec_step.py ``SpecAhead``): when
        that step's proposer queued drafts on the device for every request it verified (EAGLE, EAGLE-3, MTP and
        Medusa do, after a verification step on the target's graph), ``sched`` holds only those requests, each a
        decode with reserved draft slots, all of which it fills, and ``sched`` runs on the verification graph.
        The scheduler counted the step in flight's drafts as accepted; the device takes back the rejected ones.
        A request that finishes with the step in flight gets one step computed for nothing (dropped, as under
        async scheduling without speculation). None otherwise: the launch waits, as ``_propose_ahead`` says."""
        queued = prev_step.device_drafts
        runner = self.runner
        if queued is None or not self.spec_ahead or type(runner) is not ModelRunner:
            return None
        graphs = runner.graph_runner
        reserved, num_sched = sched.spec_reserved, sched.num_scheduled_tokens
        if (
            graphs is None
            or not reserved
            or sched.scheduled_new_reqs
            or len(reserved) != len(num_sched)
            or self.scheduler.num_grammar_reqs  # (masks per draft position are walked through the drafts)
            or runner.longrope is not None  # (positions are rotary rows there)
            or runner.encoder_runner is not None
            or runner.kv_connector is not None
            or runner.kv_layout.num_groups != 1
            or prev_step.sampled is None
            or prev_step.spec_accepted_dev is None
        ):
            return None
        drafts = queued[2]  # [m, k] on the device, a row per request of prev_step (all of them sampled)
        index = {req_id: j for j, req_id in enumerate(prev_step.sample_req_ids)}
        max_len = self.config.model_config.max_model_len
        prev_reserved, prev_spec = prev_sched.spec_reserved, prev_sched.scheduled_spec_decode_tokens
        n = len(num_sched)
        prev_index, counted, num_draft = (np.empty(n, dtype=np.int64) for _ in range(3))
        for i, (req_id, num) in enumerate(num_sched.items()):
            j, slots = index.get(req_id), reserved.get(req_id)
            # (positions are the scheduler's upper bound until the device moves them back: below max_model_len)
            if j is None or not slots or num != 1 + slots or sched.num_computed_tokens[req_id] + num > max_len:
                return None
            prev_index[i], num_draft[i] = j, slots
            c = prev_reserved.get(req_id)
            counted[i] = c if c is not None else len(prev_spec.get(req_id, ()))
        if int(num_draft.max()) > drafts.shape[1] or not graphs.can_run(
            n, sched.total_num_scheduled_tokens, int(num_draft.max()) + 1
        ):
            return None
        return SpecAhead(
            prev_step.sampled, prev_step.spec_accepted_dev, drafts, list(num_sched), prev_index, counted, num_draft
        )

    def _settle_ahead(self, sched: SchedulerOutput, result: Any) -> None:
        """``sched`` was launched ahead of the host (``_plan_ahead``); now that the step before it is read, its
        ``num_computed_tokens`` drop the drafts that step rejected, as the device's positions did."""
        ahead, sched.spec_ahead = sched.spec_ahead, None
        sampled, num_computed = result.sampled_token_ids, sched.num_computed_tokens
        for req_id, counted in zip(ahead.req_ids, ahead.counted.tolist()):
            emitted = sampled.get(req_id)
            num_computed[req_id] -= counted - (len(emitted) - 1 if emitted else 0)

    def _finish_outputs(self, outputs: EngineCoreOutputs) -> EngineCoreOutputs:
        if self.scheduler.early_outputs:
            outputs.outputs.extend(self.scheduler.take_early_outputs())
        if outputs.stats is not None:
            outputs.stats.num_integrity_failures = self.num_integrity_failures
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self._in_flight is not None or self.scheduler.has_unfinished_requests()

    def get_stats(self) -> SchedulerStats:
        stats = self.scheduler.make_stats()
        stats.num_integrity_failures = self.num_integrity_failures
        return stats

    def check_integrity(self) -> None:
        """Raise AssertionError on leaked blocks or inconsistent ref counts (all blocks; callable any time)."""
        self.scheduler.check_integrity()

    def on_idle(self) -> bool:
        """The idle-time integrity check: the loop driving this core calls it when there is no work left.

        It runs once per transition to idle (repeated calls, and calls while requests are unfinished, return at
        once), and only with ``check_integrity_on_idle``. Pools up to ``IDLE_CHECK_MAX_BLOCKS`` blocks are
        checked whole; larger ones a rotating window at a time. A failure does not stop the engine: it is logged
        as an error, counted in ``SchedulerStats.num_integrity_failures`` and kept in ``last_integrity_error``.
        Returns False when the check ran and failed.
        """
        if not self._idle_check_due or self.has_unfinished_requests():
            return True
        self._idle_check_due = False
        if not self.check_integrity_on_idle:
            return True
        num_blocks = self.kv_cache_manager.pool.num_blocks
        block_ids = None
        if num_blocks > IDLE_CHECK_MAX_BLOCKS:
            start = self._idle_check_start
            block_ids = range(start, min(start + IDLE_CHECK_MAX_BLOCKS, num_blocks))
            self._idle_check_start = 0 if block_ids.stop == num_blocks else block_ids.stop
        try:
            self.scheduler.check_integrity(block_ids)
        except Exception as e:  # noqa: BLE001 - AssertionError, or worse: either way report it and go on
            self.num_integrity_failures += 1
            self.last_integrity_error = f"{type(e).__name__}: {e}"
            logger.error(
                "KV CACHE INTEGRITY CHECK FAILED when the engine went idle (failure %d): %s. This is a bug in "
                "pagedllm: blocks may be leaked or shared by mistake, so outputs may be wrong; please report it.",
                self.num_integrity_failures,
                self.last_integrity_error,
                exc_info=True,
            )
            return False
        return True

    def debug_state(self) -> dict:
        """Request-table sizes, block counts and integrity-check results (the server's /debug/integrity)."""
        sched = self.scheduler
        kv = self.kv_cache_manager
        return {
            "num_requests": len(sched.requests),
            "num_running": len(sched.running),
            "num_waiting": len(sched.waiting),
            "num_requests_holding_blocks": len(kv.req_to_blocks),
            "num_loading_kv": len(sched.loading),
            "num_blocks": kv.pool.num_blocks,
            "num_free_blocks": kv.num_free_blocks,
            "num_preemptions": sched.num_preemptions,
            "num_integrity_failures": self.num_integrity_failures,
            "last_integrity_error": self.last_integrity_error,
        }

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, the KV connector's store too (prefix caching spans both); False, changing
        nothing, while a block is in use."""
        if not self.kv_cache_manager.reset_prefix_cache():
            return False
        connector = self.scheduler.connector
        return connector is None or connector.reset_cache()

    # ------------------------------------------------------------------ rollout-engine hooks (RL frameworks)

    def collective_rpc(
        self, method: str | Callable[..., Any], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """Run ``method`` on every rank's ``Worker`` (pagedllm/worker/worker.py); one result per rank, in rank
        order. Runs between steps: nothing is in flight here when the engine is idle."""
        kwargs = dict(kwargs or {})
        if isinstance(self.runner, ModelRunner):
            from pagedllm.worker.worker import make_worker, run_rpc

            if self._worker is None:
                self._worker = make_worker(self.runner, 0)
            return [run_rpc(self._worker, method, tuple(args), kwargs)]
        return self.runner.collective_rpc(method, tuple(args), kwargs)

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Write ``(HF checkpoint name, full tensor)`` pairs on every rank (each takes its shard), then reset the
        prefix cache (its blocks hold the old weights' keys and values). Every rank checks every pair before any
        rank writes: ``ValueError`` naming the tensor leaves the model unchanged. Returns how many tensors rank 0
        took."""
        from pagedllm.worker.weight_update import check_pairs

        weights = check_pairs(weights)
        if "weights" in self._asleep:
            raise RuntimeError("the weights are asleep: wake_up(tags=['weights']) before updating them")
        if self.has_unfinished_requests():
            raise RuntimeError("cannot update weights while requests are unfinished")
        specs = [(name, t.dtype, tuple(t.shape)) for name, t in weights]
        self.collective_rpc("check_weights", (specs,))
        if not isinstance(self.runner, ModelRunner):  # pickled to the other ranks: host tensors
            weights = [(name, t.detach().cpu()) for name, t in weights]
        num_loaded = self.collective_rpc("apply_weights", (weights,))[0]
        self.reset_prefix_cache()
        return num_loaded

    def sleep(self, level: int = 1) -> None:
        """Release the weights (``level`` 1: kept in host memory; 2: discarded) and the KV cache on every rank
        (pagedllm/worker/sleep_mode.py), after resetting the prefix cache. Needs ``enable_sleep_mode``
        (``ValueError`` naming it) and an idle engine."""
        if not self.config.enable_sleep_mode:
            raise ValueError("enable_sleep_mode: sleep mode is off; start the engine with enable_sleep_mode=True")
        if level not in (1, 2):
            raise ValueError(f"level: sleep level must be 1 or 2, got {level!r}")
        if self.has_unfinished_requests():
            raise RuntimeError("cannot sleep while requests are unfinished")
        self.reset_prefix_cache()
        try:
            self.collective_rpc("sleep", (level,))
        finally:  # even when a rank failed part way: wake_up brings back whatever each rank released
            self._asleep = {"weights", "kv_cache"}

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Bring back ``tags`` ("weights", "kv_cache"; None: both) on every rank. Once both are back, CUDA graphs
        are captured again (the memory came back at new addresses). After ``sleep(level=2)`` the weights hold
        garbage until written (``update_weights``, or ``collective_rpc("reload_weights")``)."""
        from pagedllm.worker.sleep_mode import TAGS

        if not self.config.enable_sleep_mode:
            raise ValueError("enable_sleep_mode: sleep mode is off; start the engine with enable_sleep_mode=True")
        if tags is None:
            tags = list(TAGS)
        if isinstance(tags, str) or any(t not in TAGS for t in tags):
            raise ValueError(f"tags: expected a list of {list(TAGS)} (or None for all), got {tags!r}")
        to_wake = [t for t in tags if t in self._asleep]
        if not to_wake:
            return
        self.collective_rpc("wake_up", (to_wake,))
        self._asleep -= set(to_wake)
        if not self._asleep:
            with compile_watch.start_up():
                self.runner.maybe_capture_cuda_graphs()

    def is_sleeping(self) -> bool:
        """Whether any part (weights, KV cache) is released."""
        return bool(self._asleep)

    def check_awake(self) -> None:
        """``RuntimeError`` while the engine sleeps: it cannot run requests."""
        if self._asleep:
            from pagedllm.engine.core_process import EngineSleepingError

            raise EngineSleepingError(
                f"the engine is sleeping ({', '.join(sorted(self._asleep))} released): call wake_up() first"
            )

    # ------------------------------------------------------------------ LoRA adapters

    def add_lora(self, lora_request: Any) -> bool:
        """Load (and validate) an adapter into the host cache, once per ``lora_int_id``; False when it was
        there already.

        ``ValueError`` naming ``lora_request`` when LoRA is off, the id is taken by another path (ids key the
        prefix cache, so an id never changes meaning), or the adapter cannot be served (load_peft_adapter).
        """
        from pagedllm.lora.request import LoRARequest

        manager = self.runner.lora_manager
        if manager is None:
            raise ValueError(
                "lora_request: LoRA is not enabled; start the engine with enable_lora=True (--enable-lora)"
            )
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        lora_id = lora_request.lora_int_id
        known = self._lora_paths.get(lora_id)
        if known is not None and known != lora_request.lora_path:
            raise ValueError(
                f"lora_request: lora_int_id {lora_id} already names the adapter at {known!r}, not "
                f"{lora_request.lora_path!r}"
            )
        if known is not None and lora_id in manager.list_loras():
            return False
        try:
            added = manager.add_lora(lora_request)
        except ValueError as e:
            raise ValueError(f"lora_request: {e}") from None
        self._lora_paths[lora_id] = lora_request.lora_path
        return added

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter; requests still running with it keep it (their slot stays until they finish, and
        the host cache evicts it later). False when it was unknown."""
        manager = self.runner.lora_manager
        if manager is None or lora_int_id not in manager.list_loras():
            return False
        if any(r.lora_int_id == lora_int_id for r in self.scheduler.requests.values()):
            return True
        return manager.remove_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        manager = self.runner.lora_manager
        return set() if manager is None else manager.list_loras()

    def shutdown(self) -> None:
        """Release everything the core holds: the grammar threads, the workers and process groups of a parallel
        runner, and the device memory of the runners (weights, KV cache, CUDA graphs; a draft model's too), then
        hand the allocator's cached memory back to the device. Idempotent; the core cannot step afterwards (its
        scheduler stays readable: ``get_stats``, ``debug_state``)."""
        if self._shut_down:
            return
        self._shut_down = True
        _LIVE_CUDA_CORES.discard(self)
        self._pending_sample = self._in_flight = None
        if self._cpu_threads is not None:
            self._cpu_threads.release()
        runner, self.runner = self.runner, None
        self._worker = None  # it holds the runner and the parameters
        proposer, self.proposer = self.proposer, None
        structured, self.structured = self.structured, None
        device = runner.device
        draft = getattr(proposer, "runner", None)  # a draft model's own runner (an EAGLE head uses the target's)
        try:
            if structured is not None:
                structured.shutdown()
        finally:
            try:
                if draft is not None and draft is not runner:
                    draft.shutdown()
            finally:
                runner.shutdown()
                del runner, proposer, draft
                _release_device_memory(device)


# The engine cores of this process that hold a CUDA device: cuBLAS's workspaces (one per stream, shared by every
# engine of the process) are baked into the CUDA graphs each one captured, so only the last one to go frees them.
_LIVE_CUDA_CORES: weakref.WeakSet[EngineCore] = weakref.WeakSet()


def _release_device_memory(device: Any) -> None:
    """CUDA: collect what the dropped runners left in reference cycles, then return the caching allocator's free
    blocks to the device, and cuBLAS's workspaces too when no other engine of this process is alive (its graphs
    replay kernels that write to them). (Host memory in cycles goes with the next collection.)"""
    if device.type != "cuda":
        return
    gc.collect()

    with torch.cuda.device(device):
        torch.cuda.synchronize()
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None and not _LIVE_CUDA_CORES:
            clear_workspaces()
        torch.cuda.empty_cache()
