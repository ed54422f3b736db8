"""PoolingEngineCore: the engine core of a pooling model (embed / classify / score). Token ids in, one pooled
vector per request out; no text, no threads, no KV cache.

It has ``EngineCore``'s interface (``add_request`` / ``step`` / ``abort_requests`` / stats), so ``LLMEngine`` and
the core process drive either. Scheduling is first come, first served under the same limits as generation
(``SchedulerConfig``) and in the same order (the scheduler's ``WaitingQueue``: arrival order, or priority then
arrival with ``scheduling_policy="priority"``): a step takes waiting requests from the head of the queue while
their prompts fit ``max_num_batched_tokens`` and there are at most ``max_num_seqs`` of them. A pooling request needs its whole prompt
in one step (its pooled output reads every token's hidden state), so a prompt is never chunked: one longer than
the token budget (or ``max_model_len``) is refused when added, unless the front-end truncated it
(``PoolingParams.truncate_prompt_tokens``). Every request finishes in the step that runs it; that step's outputs
come back from the next ``step`` call, which first queues the following batch on the device (one step in flight:
the host prepares step N + 1 while the device runs step N), or from the same call when nothing else waits.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.core.sched_output import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from pagedllm.core.scheduler import WaitingQueue
from pagedllm.pooling.params import check_pooling_prompt
from pagedllm.pooling.pooler import check_params
from pagedllm.worker.cpu_threads import CpuThreadGovernor, apply_user_thread_setting
from pagedllm.worker.pooling_runner import PooledStep, PoolingInput, PoolingRunner

logger = logging.getLogger(__name__)


class PoolingEngineCore:
    def __init__(self, config: EngineConfig, tokenizer: Any = None) -> None:
        self.config = config
        self._cpu_threads: CpuThreadGovernor | None = None
        if config.device_config.device.type == "cpu":
            apply_user_thread_setting()
            self._cpu_threads = CpuThreadGovernor()
        config.scheduler_config.resolve_defaults(config.device_config.device)
        self.max_num_tokens = config.scheduler_config.max_num_batched_tokens
        self.max_num_seqs = config.scheduler_config.max_num_seqs
        self.runner = PoolingRunner(config)
        self.vocab_size = config.model_config.vocab_size
        self.kv_cache_info: dict[str, Any] = {}
        self.waiting = WaitingQueue(config.scheduler_config.policy)
        self.requests: dict[str, EngineCoreRequest] = {}  # the waiting ones, by id
        self.stats = SchedulerStats()
        self.num_steps = 0  # batches run since start-up
        # The step on the device whose outputs the next ``step`` returns: (its handle, the queue time of each of
        # its requests not aborted since, by id).
        self._in_flight: tuple[PooledStep, dict[str, float]] | None = None
        self._shut_down = False

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a tokenized pooling request; ``ValueError`` naming the field if it can never run (the front-end
        checks this first)."""
        params = request.pooling_params
        if params is None:
            raise ValueError(
                "this model is a pooling model: it embeds, classifies or scores; it cannot generate text"
            )
        ids = request.prompt_token_ids
        check_pooling_prompt(len(ids), self.config.model_config.max_model_len, self.max_num_tokens)
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise ValueError(
                f"prompt_token_ids must be in [0, {self.vocab_size}): token ids out of vocabulary"
            )
        check_params(params, self.config.model_config.pooler_config)
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in flight")
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def _schedule(self) -> list[EngineCoreRequest]:
        batch: list[EngineCoreRequest] = []
        num_tokens = 0
        while self.waiting and len(batch) < self.max_num_seqs:
            n = len(self.waiting.peek().prompt_token_ids)
            if num_tokens + n > self.max_num_tokens:
                break  # the head waits for the next step; nothing behind it jumps ahead
            request = self.waiting.pop()
            del self.requests[request.request_id]
            batch.append(request)
            num_tokens += n
        self.stats.num_prompt_tokens += num_tokens
        return batch

    def step(self) -> EngineCoreOutputs:
        """Queue the next batch on the device, then return the outputs of the batch queued by the previous call
        (or of this one when nothing is left waiting): one step stays in flight, so the host schedules and
        prepares step N + 1 while the device runs step N. A pooled output feeds nothing back, so the work and its
        order on the device are unchanged."""
        if self._cpu_threads is not None:
            self._cpu_threads.maybe_update()
        batch = self._schedule()
        launched = None
        if batch:
            now = time.monotonic()
            inputs = [
                PoolingInput(r.request_id, r.prompt_token_ids, r.pooling_params, r.token_type_ids)
                for r in batch
            ]
            queue_times = {r.request_id: max(0.0, now - r.arrival_time) for r in batch}
            launched = (self.runner.launch(inputs), queue_times)  # raising, it loses this batch only
            self.num_steps += 1
        previous, self._in_flight = self._in_flight, launched
        if previous is None and launched is not None and not self.waiting:
            previous, self._in_flight = launched, None  # nothing to overlap it with: finish it now
        outputs = self._finish(*previous) if previous is not None else []
        return EngineCoreOutputs(outputs=outputs, stats=self.get_stats(), timestamp=time.monotonic())

    def _finish(self, step: PooledStep, queue_times: dict[str, float]) -> list[EngineCoreOutput]:
        """Wait for ``step``; one output per request of it not aborted meanwhile."""
        return [
            EngineCoreOutput(
                request_id=req_id,
                new_token_ids=[],
                finish_reason="stop",
                queue_time=queue_times[req_id],
                pooling_output=result,
            )
            for req_id, result in zip(step.req_ids, step.results())
            if req_id in queue_times
        ]

    def abort_requests(self, request_ids: list[str]) -> None:
        """Drop waiting requests; one already on the device finishes there but gives no output."""
        for req_id in request_ids:
            request = self.requests.pop(req_id, None)
            if request is not None:
                self.waiting.remove(request)
            elif self._in_flight is not None:
                self._in_flight[1].pop(req_id, None)
        if self._in_flight is not None and not self._in_flight[1]:
            self._in_flight = None  # every request of it aborted: nothing to wait for

    def check_awake(self) -> None:
        """A pooling engine never sleeps (``enable_sleep_mode`` is refused for it)."""

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting) or self._in_flight is not None

    def get_stats(self) -> SchedulerStats:
        self.stats.num_waiting_reqs = len(self.waiting)
        return SchedulerStats(**self.stats.__dict__)

    def check_integrity(self) -> None:
        """Nothing to check: a pooling core holds no KV blocks."""

    def on_idle(self) -> bool:
        return True

    def debug_state(self) -> dict:
        running = len(self._in_flight[1]) if self._in_flight is not None else 0
        return {"num_requests": len(self.requests), "num_running": running, "num_waiting": len(self.waiting)}

    def reset_prefix_cache(self) -> bool:
        return True

    def list_loras(self) -> set[int]:
        return set()

    def add_lora(self, lora_request: Any) -> bool:
        raise ValueError("lora_request: LoRA is not supported with a pooling model")

    def remove_lora(self, lora_int_id: int) -> bool:
        return False

    def shutdown(self) -> None:
        if self._shut_down:
            return
        self._shut_down = True
        self.waiting = WaitingQueue(self.config.scheduler_config.policy)
        self.requests.clear()
        self._in_flight = None
        if self._cpu_threads is not None:
            self._cpu_threads.release()
        self.runner.shutdown()
