"""AsyncLLM: the asyncio front-end of the engine, with the engine core in its own process.

One background task (the output handler) pulls ``EngineCoreOutputs`` from the core process, runs the
``OutputProcessor`` (detokenization, stop strings), which puts each request's ``RequestOutput`` on that request's
``asyncio.Queue``; ``generate`` reads its queue. Stop-string hits finish a sequence here, so the handler sends
aborts for them to the core. Metrics go to the registered stat loggers.

    generate() --add--> EngineCoreClient --zmq--> core process: step() loop
        ^                                              |
        | asyncio.Queue per request                   | EngineCoreOutputs (+ SchedulerStats)
        +---- OutputProcessor <---- output handler <----+

Leaving ``generate`` before its request finished (the consumer breaks out, is cancelled, or the client of the
server disconnects) aborts the request, which frees its KV blocks in the core.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pagedllm.config import EngineConfig, make_engine_config
from pagedllm.core.sched_output import EngineCoreRequest, SchedulerStats
from pagedllm.engine.core_launch import LaunchedCore
from pagedllm.engine.core_process import (
    DEFAULT_ENGINE_CORE,
    EngineCoreClient,
    EngineDeadError,
    EngineSleepingError,
)
from pagedllm.engine.input_processor import InputProcessor
from pagedllm.engine.output_processor import (
    FinishedRequestStats,
    IterationStats,
    OutputProcessor,
    RequestTimeline,
)
from pagedllm.engine.pooling_input import PoolingInputProcessor, PoolingPrompt
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import CompletionOutput, PoolingOutput, PoolingRequestOutput, RequestOutput
from pagedllm.pooling.params import PoolingParams
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.tokenizer import get_tokenizer

logger = logging.getLogger(__name__)

PromptType = str | list[int] | Mapping[str, Any]

# Called after every outputs message: (scheduler stats or None, this message's iteration stats or None).
StatLogger = Callable[[SchedulerStats | None, IterationStats | None], None]


class _Aborted:
    """Queue marker: ``abort(request_id)`` was called from outside ``generate``."""


@dataclass
class _RequestEntry:
    queue: asyncio.Queue
    child_ids: list[str]
    params: SamplingParams
    arrival_time: float
    num_prompt_tokens: int
    finished_indices: set[int] = field(default_factory=set)


class AsyncLLM:
    """Streams ``RequestOutput``s from an engine core running in its own process.

    Build it with a running event loop (or call any coroutine method later: the background task starts on first
    use). ``tokenizer`` and ``model_config`` are the engine's; ``errored`` turns true once the core process died.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        log_requests: bool = False,
        stat_loggers: list[StatLogger] | None = None,
        core_cls_path: str = DEFAULT_ENGINE_CORE,
        startup_timeout_s: float | None = None,
        while_starting: Callable[[], None] | None = None,
        launched: LaunchedCore | None = None,
    ) -> None:
        """``while_starting``: more work to run while the engine core process starts (after the tokenizer loads),
        e.g. the server's own imports. ``launched``: the core process, already started with this config by
        ``core_launch.launch``; one engine only (no data parallelism)."""
        self.config = config
        self.model_config = config.model_config
        self.log_requests = log_requests
        self.stat_loggers: list[StatLogger] = list(stat_loggers or [])
        self._requests: dict[str, _RequestEntry] = {}  # parent request id -> entry
        self._child_to_parent: dict[str, str] = {}
        self._handler: asyncio.Task | None = None
        self._handler_error: EngineDeadError | None = None
        self._dead_event: asyncio.Event | None = None
        self._closed = False
        self._sleeping = False  # this front-end put the core to sleep: requests are refused until wake_up
        self.last_stats: SchedulerStats | None = None
        # Pooling models: request id -> (prompt, future of its output); no output processor involved.
        self.is_pooling = self.model_config.runner_type == "pooling"
        self.pooling_processor: PoolingInputProcessor | None = None
        self._pooling: dict[str, tuple[PoolingPrompt, asyncio.Future]] = {}

        def load_tokenizer() -> None:  # while the core process loads the model
            self.tokenizer = get_tokenizer(
                self.model_config.tokenizer, trust_remote_code=self.model_config.trust_remote_code
            )
            self.input_processor = InputProcessor(self.model_config, self.tokenizer)
            self.output_processor = OutputProcessor(self.tokenizer)
            if self.is_pooling:
                self.pooling_processor = PoolingInputProcessor(config, self.tokenizer)
            if while_starting is not None:
                while_starting()

        if config.data_parallel_size > 1:
            from pagedllm.engine.data_parallel import DataParallelCoreClient

            if launched is not None:
                launched.discard()
                raise ValueError("a launched core process serves one data-parallel rank, not several")
            self.engine_core = DataParallelCoreClient(
                config,
                core_cls_path=core_cls_path,
                startup_timeout_s=startup_timeout_s,
                while_starting=load_tokenizer,
            )
        else:
            self.engine_core = EngineCoreClient(
                config,
                core_cls_path=core_cls_path,
                startup_timeout_s=startup_timeout_s,
                while_starting=load_tokenizer,
                launched=launched,
            )
        self.kv_cache_info: dict = self.engine_core.kv_cache_info
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            self._ensure_started()

    @classmethod
    def from_engine_config(cls, config: EngineConfig, **kwargs: Any) -> AsyncLLM:
        return cls(config, **kwargs)

    @classmethod
    def from_kwargs(cls, model: str, **engine_kwargs: Any) -> AsyncLLM:
        """``AsyncLLM.from_kwargs(model, dtype=..., max_model_len=...)`` with ``make_engine_config``'s names."""
        return cls(make_engine_config(model, **engine_kwargs))

    # ------------------------------------------------------------------ state

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self.engine_core.dead_error or self._handler_error

    @property
    def errored(self) -> bool:
        return self.dead_error is not None or (not self._closed and not self.engine_core.proc.is_alive())

    @property
    def is_running(self) -> bool:
        return not self._closed and not self.errored

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests) + len(self._pooling)

    async def wait_until_dead(self) -> EngineDeadError:
        """Return (with the error) once the engine has died; never returns while it is healthy."""
        self._ensure_started()
        if self._dead_event is not None:  # None only when shut down before it ever started
            await self._dead_event.wait()
        return self.dead_error or EngineDeadError("the engine is shut down")

    def _ensure_started(self) -> None:
        if self._handler is not None or self._closed:
            return
        self.engine_core.start()
        self._dead_event = asyncio.Event()
        self._handler = asyncio.get_running_loop().create_task(
            self._run_output_handler(), name="pagedllm-outputs"
        )

    def _check_alive(self) -> None:
        if self._closed:
            raise EngineDeadError("the engine is shut down")
        err = self.dead_error
        if err is not None:
            raise err

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        sampling_params: SamplingParams,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        timeline: RequestTimeline | None = None,
    ) -> RequestStream:
        """Validate and queue a request now; return the stream of its outputs. ``lora_request``: the adapter
        it runs with (the core loads it; a load failure ends the stream with a ``ValueError``).

        ``timeline``: the caller's stamps so far (a server: its HTTP arrival and when the prompt ids were ready);
        without one, arrival and tokenized are taken around the input processing here. The engine fills in the
        rest; ``RequestStream.timeline`` is the same object.

        Raises ``ValueError`` (naming the field) for invalid input, with nothing queued, and ``EngineDeadError``
        if the engine is dead. The caller must iterate the stream to its end or ``close()`` it (which aborts the
        request if it is still running); ``generate`` does this for you.
        """
        self._ensure_started()
        self._check_alive()
        if self._sleeping:
            raise EngineSleepingError("the engine is sleeping: wake it up (POST /wake_up) first")
        if self.is_pooling:
            raise ValueError(
                "this model runs as a pooling model (runner='pooling'): it embeds, classifies or scores text and "
                "cannot generate"
            )
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        if lora_request is not None and self.config.lora_config is None:
            raise ValueError(
                "lora_request: LoRA is not enabled; start the engine with enable_lora=True (--enable-lora)"
            )
        started = time.monotonic()
        processed = self.input_processor.process(
            request_id, prompt, sampling_params, priority=priority, lora_request=lora_request
        )
        if timeline is None:
            timeline = RequestTimeline(started, tokenized_time=processed.arrival_time)
        elif timeline.tokenized_time is None:
            timeline.tokenized_time = processed.arrival_time
        queue: asyncio.Queue = asyncio.Queue()
        self.output_processor.add_request(processed, queue, timeline)
        entry = _RequestEntry(
            queue,
            [c.request_id for c in processed.core_requests],
            processed.params,
            processed.arrival_time,
            len(processed.prompt_token_ids),
        )
        self._requests[request_id] = entry
        for child_id in entry.child_ids:
            self._child_to_parent[child_id] = request_id
        # Stamped before the send: the core may stamp its receipt before the send call returns.
        timeline.sent_time = time.monotonic()
        try:
            for core_req in processed.core_requests:
                self.engine_core.add_request(core_req)
        except BaseException:
            self._forget(request_id)
            self.output_processor.abort_requests([request_id])
            raise
        if self.log_requests:
            logger.info(
                "request %s: %d prompt tokens, n=%d, max_tokens=%s, temperature=%s",
                request_id,
                len(processed.prompt_token_ids),
                processed.params.n,
                processed.params.max_tokens,
                processed.params.temperature,
            )
        return RequestStream(self, processed, entry, timeline)

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream outputs for one request (cumulative, deltas or final only, as ``sampling_params.output_kind``).

        Raises ``ValueError`` (naming the field) for invalid input before anything is queued, and
        ``EngineDeadError`` if the engine dies. Leaving the iteration early aborts the request.
        """
        stream = self.add_request(request_id, prompt, sampling_params, priority, lora_request)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    def process_pooling(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams,
        request_id: str,
        text_pair: str | None = None,
        priority: int = 0,
    ) -> tuple[PoolingPrompt, EngineCoreRequest]:
        """Validate and tokenize a pooling request without queueing it (``ValueError`` naming the field); hand
        the result to ``encode_processed``. A server checks every input of a batch so before it queues any."""
        self._check_alive()
        if self.pooling_processor is None:
            raise ValueError(
                "this model generates text (runner='generate'): it has no pooling output; serve it with "
                "--runner pooling to embed with it"
            )
        return self.pooling_processor.process(
            request_id, prompt, pooling_params, time.monotonic(), text_pair, priority
        )

    async def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams,
        request_id: str,
        text_pair: str | None = None,
        priority: int = 0,
    ) -> PoolingRequestOutput:
        """A pooling model's output for one prompt (``pooling_params.task`` set; ``text_pair``: the second text of
        a cross-encoder pair). ``ValueError`` (naming the field) before anything is queued, or when the core
        refuses it; ``EngineDeadError`` if the engine dies. Cancelling the call aborts the request."""
        self._ensure_started()
        processed = self.process_pooling(prompt, pooling_params, request_id, text_pair, priority)
        return await self.encode_processed(*processed)

    async def encode_processed(self, prompt_info: PoolingPrompt, core_req: EngineCoreRequest) -> PoolingRequestOutput:
        """Queue a request ``process_pooling`` made and wait for its output (see ``encode``)."""

        self._ensure_started()
        self._check_alive()
        request_id = core_req.request_id
        if request_id in self._pooling or request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._pooling[request_id] = (prompt_info, future)
        try:
            self.engine_core.add_request(core_req)
            data = await future
        except BaseException:
            entry = self._pooling.pop(request_id, None)
            if entry is not None and not self.errored:  # still queued or running: drop it in the core
                try:
                    self.engine_core.abort_requests([request_id])
                except EngineDeadError:
                    pass
            raise
        return PoolingRequestOutput(
            request_id,
            PoolingOutput(data),
            prompt_info.token_ids,
            True,
            prompt_info.prompt,
        )

    def _finish_pooling(self, outputs: list) -> list:
        """Resolve the pooling requests among ``outputs``; return the others."""
        rest = []
        for out in outputs:
            if out.pooling_output is None:
                rest.append(out)
                continue
            entry = self._pooling.pop(out.request_id, None)
            if entry is not None and not entry[1].done():
                entry[1].set_result(out.pooling_output)
        return rest

    async def abort(self, request_id: str | list[str]) -> None:
        """Abort requests by id; their ``generate`` iterators end with a final output (finish_reason "abort")."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            entry = self._requests.get(rid)
            self._abort_now(rid)
            if entry is not None:
                entry.queue.put_nowait(_Aborted())

    def _abort_now(self, request_id: str) -> None:
        child_ids = self.output_processor.abort_requests([request_id])
        if not child_ids:
            return
        if not self.errored:
            try:
                self.engine_core.abort_requests(child_ids)
            except EngineDeadError:
                pass
        entry = self._requests.get(request_id)
        if entry is not None and self.stat_loggers:
            # The output processor drops aborted requests silently; count them as finished with "abort".
            now = time.monotonic()
            stats = IterationStats(
                finished_requests=[
                    FinishedRequestStats(
                        child_id, "abort", entry.num_prompt_tokens, 0, now - entry.arrival_time, None
                    )
                    for child_id in child_ids
                ]
            )
            self._log_stats(None, stats)

    def _forget(self, request_id: str) -> None:
        entry = self._requests.pop(request_id, None)
        if entry is not None:
            for child_id in entry.child_ids:
                self._child_to_parent.pop(child_id, None)

    # ------------------------------------------------------------------ the output handler

    async def _run_output_handler(self) -> None:
        core = self.engine_core
        try:
            while True:
                outputs, errors = await core.get_output_async()
                if errors:
                    self._fail_requests(errors)
                iteration_stats = None
                queued_times = outputs.queued_times
                if queued_times:
                    self.output_processor.record_queued_times(queued_times)
                if outputs.outputs and self.is_pooling:
                    outputs.outputs = self._finish_pooling(outputs.outputs)
                if outputs.outputs:
                    processed = self.output_processor.process_outputs(
                        outputs.outputs, outputs.timestamp or None
                    )
                    if processed.reqs_to_abort:
                        core.abort_requests(processed.reqs_to_abort)
                    iteration_stats = processed.stats
                if outputs.stats is not None:
                    self.last_stats = outputs.stats
                self._log_stats(outputs.stats, iteration_stats)
                # Let request handlers run between batches even when outputs arrive back to back.
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            raise
        except EngineDeadError as e:
            self._fail_all(e)
        except Exception as e:  # noqa: BLE001 - a bug here must not leave requests hanging
            logger.exception("the output handler failed")
            self._handler_error = EngineDeadError(
                f"the engine's output handler failed: {type(e).__name__}: {e}"
            )
            self._fail_all(self._handler_error)
            core.shutdown()
        finally:
            if self._dead_event is not None:
                self._dead_event.set()

    def _log_stats(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None
    ) -> None:
        for stat_logger in self.stat_loggers:
            try:
                stat_logger(scheduler_stats, iteration_stats)
            except Exception:  # noqa: BLE001 - metrics must never take the engine down
                logger.exception("stat logger failed")

    def _fail_requests(self, errors: dict[str, str]) -> None:
        """The core refused these core requests (ValueError): fail their parents, abort their siblings."""
        for child_id, message in errors.items():
            pooling = self._pooling.pop(child_id, None)
            if pooling is not None:
                if not pooling[1].done():
                    pooling[1].set_exception(ValueError(message))
                continue
            parent = self._child_to_parent.get(child_id)
            if parent is None:
                continue
            entry = self._requests.get(parent)
            siblings = self.output_processor.abort_requests([parent])
            self.engine_core.abort_requests([c for c in siblings if c != child_id])
            if entry is not None:
                entry.queue.put_nowait(ValueError(message))

    def _fail_all(self, error: BaseException) -> None:
        for _, future in self._pooling.values():
            if not future.done():
                future.set_exception(error)
        self._pooling.clear()
        for request_id, entry in list(self._requests.items()):
            self.output_processor.abort_requests([request_id])
            entry.queue.put_nowait(error)

    # ------------------------------------------------------------------ utilities

    async def get_stats(self) -> SchedulerStats:
        """Fresh scheduler stats from the core (running / waiting requests, KV cache usage, counters)."""
        self._ensure_started()
        self._check_alive()
        return await self.engine_core.call_utility_async("get_stats")

    async def check_integrity(self) -> None:
        """Raise AssertionError if the core's block pool is inconsistent (leaked blocks, wrong ref counts)."""
        self._ensure_started()
        self._check_alive()
        await self.engine_core.call_utility_async("check_integrity")

    async def debug_state(self) -> dict:
        """The core's request tables, block counts and idle-check results (``EngineCore.debug_state``), plus
        the requests this front-end still tracks (``num_frontend_requests``)."""
        self._ensure_started()
        self._check_alive()
        state = dict(await self.engine_core.call_utility_async("debug_state"))
        state["num_frontend_requests"] = self.num_unfinished_requests
        state["num_output_processor_requests"] = self.output_processor.get_num_unfinished_requests()
        return state

    async def reset_prefix_cache(self) -> bool:
        """Drop every cached block that no request uses (for benchmarks); False if the core could not."""
        self._ensure_started()
        self._check_alive()
        return bool(await self.engine_core.call_utility_async("reset_prefix_cache"))

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter in the core ahead of its requests (``ValueError`` naming what is wrong); False when
        it was loaded already. Running requests are not disturbed."""
        self._ensure_started()
        self._check_alive()
        return bool(await self.engine_core.call_utility_async("add_lora", lora_request))

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter in the core (requests running with it finish with it); False when unknown."""
        self._ensure_started()
        self._check_alive()
        return bool(await self.engine_core.call_utility_async("remove_lora", lora_int_id))

    async def list_loras(self) -> set[int]:
        self._ensure_started()
        self._check_alive()
        return set(await self.engine_core.call_utility_async("list_loras"))

    async def is_idle(self) -> bool:
        self._ensure_started()
        self._check_alive()
        return await self.engine_core.call_utility_async("is_idle")

    async def sleep(self, level: int = 1) -> None:
        """Put the core to sleep (``EngineCore.sleep``: needs ``enable_sleep_mode``, an idle engine); new
        requests are refused with ``EngineSleepingError`` from now until ``wake_up``."""
        self._ensure_started()
        self._check_alive()
        was_sleeping, self._sleeping = self._sleeping, True
        try:
            await self.engine_core.call_utility_async("sleep", level)
        except BaseException:
            self._sleeping = was_sleeping or bool(await self.engine_core.call_utility_async("is_sleeping"))
            raise

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back ``tags`` ("weights", "kv_cache"; None: both); requests run again once nothing sleeps."""
        self._ensure_started()
        self._check_alive()
        try:
            await self.engine_core.call_utility_async("wake_up", tags)
        finally:
            self._sleeping = bool(await self.engine_core.call_utility_async("is_sleeping"))

    async def is_sleeping(self) -> bool:
        self._ensure_started()
        self._check_alive()
        return bool(await self.engine_core.call_utility_async("is_sleeping"))

    async def collective_rpc(
        self, method: str | Callable[..., Any], args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """``EngineCore.collective_rpc`` in the core process: one result per rank. A callable is sent pickled
        (``pagedllm.worker.worker.encode_method``)."""
        from pagedllm.worker.worker import encode_method

        self._ensure_started()
        self._check_alive()
        payload = encode_method(method)
        return list(await self.engine_core.call_utility_async("collective_rpc", payload, tuple(args), kwargs))

    async def check_health(self) -> None:
        """Raise ``EngineDeadError`` if the engine is dead."""
        self._check_alive()
        if not self.engine_core.is_alive():
            raise EngineDeadError("the engine core process is not running")

    def shutdown(self) -> None:
        """Stop the core process and end every request still in flight. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._handler is not None and not self._handler.done():
            try:
                self._handler.cancel()
            except RuntimeError:  # its loop is closed already
                pass
        self.engine_core.shutdown()
        err = EngineDeadError("the engine is shut down")
        for entry in self._requests.values():
            entry.queue.put_nowait(err)
        for _, future in self._pooling.values():
            if not future.done():
                future.set_exception(err)
        self._pooling.clear()
        if self._dead_event is not None:
            self._dead_event.set()

    def __del__(self) -> None:
        engine_core = getattr(self, "engine_core", None)
        if engine_core is not None:
            engine_core.shutdown()


def merge_request_outputs(first: RequestOutput, then: RequestOutput, kind: RequestOutputKind) -> RequestOutput:
    """One output that stands for ``first`` followed by ``then`` (two consecutive outputs of one request).

    Cumulative outputs already hold everything: ``then``'s sequences replace ``first``'s. Delta outputs are
    concatenated per sequence (text, token ids, logprobs; the finish reason and cumulative logprob are ``then``'s)
    and so are delta prompt logprobs. A sequence only one of them carries is kept as it is."""
    delta = kind == RequestOutputKind.DELTA
    by_index = {c.index: c for c in first.outputs}
    for c in then.outputs:
        old = by_index.get(c.index)
        if old is not None and delta:
            if old.logprobs is not None and c.logprobs is not None:
                logprobs = old.logprobs + c.logprobs
            else:
                logprobs = c.logprobs if old.logprobs is None else old.logprobs
            c = CompletionOutput(
                index=c.index,
                text=old.text + c.text,
                token_ids=old.token_ids + c.token_ids,
                cumulative_logprob=c.cumulative_logprob,
                logprobs=logprobs,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
        by_index[c.index] = c
    prompt_logprobs = then.prompt_logprobs
    if delta and first.prompt_logprobs is not None:
        prompt_logprobs = first.prompt_logprobs + (then.prompt_logprobs or [])
    return RequestOutput(
        request_id=then.request_id,
        prompt=then.prompt,
        prompt_token_ids=then.prompt_token_ids,
        prompt_logprobs=prompt_logprobs,
        outputs=sorted(by_index.values(), key=lambda c: c.index) if delta else list(by_index.values()),
        finished=then.finished,
        num_cached_tokens=then.num_cached_tokens,
        metrics=then.metrics,
        kv_transfer_params=then.kv_transfer_params,
    )


class RequestStream:
    """The outputs of one request, as an async iterator; ``close()`` aborts the request if it still runs."""

    def __init__(
        self, engine: AsyncLLM, processed: Any, entry: _RequestEntry, timeline: RequestTimeline | None = None
    ) -> None:
        self.engine = engine
        # Stamps of the request's life; complete once the stream finished (see ``RequestTimeline``).
        self.timeline = timeline if timeline is not None else RequestTimeline(processed.arrival_time)
        self.request_id: str = processed.request_id
        self.prompt: str | None = processed.prompt
        self.prompt_token_ids: list[int] = processed.prompt_token_ids
        self.params: SamplingParams = processed.params
        self._entry = entry
        self._last: RequestOutput | None = None
        self._held: Any = None  # an item taken from the queue while merging, not yet delivered
        self.finished = False
        self._closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished or self._closed:
            raise StopAsyncIteration
        queue = self._entry.queue
        if self._held is not None:
            item, self._held = self._held, None
        else:
            item = queue.get_nowait() if not queue.empty() else await queue.get()
        # A consumer that fell behind (a busy server) gets what queued up as one output, as vLLM's collector does:
        # fewer, larger stream chunks instead of a burst of small ones sent back to back.
        while isinstance(item, RequestOutput) and not item.finished and not queue.empty():
            nxt = queue.get_nowait()
            if not isinstance(nxt, RequestOutput):
                self._held = nxt  # an error or an abort: delivered by the next call
                break
            item = merge_request_outputs(item, nxt, self.params.output_kind)
        if isinstance(item, BaseException):
            self.finished = True  # nothing more will come; the engine side is already cleaned up
            self.close()
            raise item
        if isinstance(item, _Aborted):
            item = self._aborted_output()
        for completion in item.outputs:
            if completion.finish_reason is not None:
                self._entry.finished_indices.add(completion.index)
        self._last = item
        if item.finished:
            self.finished = True
            self.close()
        return item

    def close(self) -> None:
        """Stop following the request; abort it in the engine unless it finished. Idempotent."""
        if self._closed:
            return
        self._closed = True
        engine = self.engine
        if not self.finished:
            engine._abort_now(self.request_id)
        engine._forget(self.request_id)
        if engine.log_requests:
            logger.info("request %s: %s", self.request_id, "finished" if self.finished else "aborted")

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.close()

    def _aborted_output(self) -> RequestOutput:
        """The final output after ``AsyncLLM.abort``: unfinished sequences end with finish_reason "abort"."""
        entry = self._entry
        last = self._last
        cumulative = self.params.output_kind == RequestOutputKind.CUMULATIVE and last is not None
        previous = {c.index: c for c in last.outputs} if cumulative and last is not None else {}
        outputs = []
        for index in range(len(entry.child_ids)):
            if index in entry.finished_indices and not cumulative:
                continue
            prev = previous.get(index)
            if prev is not None:
                outputs.append(
                    CompletionOutput(
                        index=index,
                        text=prev.text,
                        token_ids=list(prev.token_ids),
                        cumulative_logprob=prev.cumulative_logprob,
                        logprobs=prev.logprobs,
                        finish_reason=prev.finish_reason or "abort",
                        stop_reason=prev.stop_reason,
                    )
                )
            else:
                outputs.append(CompletionOutput(index, "", [], None, None, finish_reason="abort"))
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=None,
            outputs=outputs,
            finished=True,
        )
