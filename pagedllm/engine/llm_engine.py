"""LLMEngine: the synchronous engine loop (add_request / step / abort) over an in-process EngineCore."""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from pagedllm.config import EngineConfig, make_engine_config
from pagedllm.core.sched_output import EngineCoreRequest, SchedulerStats
from pagedllm.engine.engine_core import EngineCore
from pagedllm.engine.input_processor import InputProcessor, ProcessedRequest
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.pooling_input import PoolingInputProcessor, PoolingPrompt
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import PoolingOutput, PoolingRequestOutput, RequestOutput
from pagedllm.pooling.params import PoolingParams
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizer import get_tokenizer

PromptType = str | list[int] | Mapping[str, Any]


class LLMEngine:
    """Text in, ``RequestOutput``s out, one ``step()`` at a time. Not thread-safe: one caller drives it.

    ``shutdown()`` releases the engine (worker processes, process groups, device memory, threads); so does
    dropping the last reference to it, and interpreter exit.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc = config.model_config
        self.tokenizer = get_tokenizer(mc.tokenizer, trust_remote_code=mc.trust_remote_code)
        self.input_processor = InputProcessor(mc, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.is_pooling = mc.runner_type == "pooling"
        self.pooling_processor: PoolingInputProcessor | None = None
        self._pooling_prompts: dict[str, PoolingPrompt] = {}  # pooling requests in flight
        if self.is_pooling:
            from pagedllm.engine.pooling_core import PoolingEngineCore

            self.pooling_processor = PoolingInputProcessor(config, self.tokenizer)
            self.engine_core = PoolingEngineCore(config, tokenizer=self.tokenizer)
        elif config.data_parallel_size > 1:
            from pagedllm.engine.data_parallel import DataParallelEngineCore

            self.engine_core = DataParallelEngineCore(config, tokenizer=self.tokenizer)
        else:
            self.engine_core = EngineCore(config, tokenizer=self.tokenizer)
        self.last_stats = SchedulerStats()
        # The core never refers back to this engine, so the finalizer (which holds the core) lets it be collected.
        self._finalizer = weakref.finalize(self, self.engine_core.shutdown)

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> LLMEngine:
        return cls(make_engine_config(model, **kwargs))

    def process_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> ProcessedRequest:
        """Tokenize and validate (``ValueError`` naming the field) without queueing anything."""
        if self.is_pooling:
            raise ValueError(
                "this model runs as a pooling model (runner='pooling'): it embeds, classifies or scores text and "
                "cannot generate; use embed / classify / score / encode"
            )
        if arrival_time is None:
            arrival_time = time.monotonic()
        return self.input_processor.process(
            request_id, prompt, params, arrival_time, priority, lora_request=lora_request
        )

    def add_processed_request(self, processed: ProcessedRequest) -> None:
        """Queue a processed request in both halves; on failure neither half keeps any of it."""
        self._check_running()
        self.output_processor.add_request(processed)  # raises on a duplicate request id
        added: list[str] = []
        try:
            for core_req in processed.core_requests:
                self.engine_core.add_request(core_req)
                added.append(core_req.request_id)
        except Exception:
            self.engine_core.abort_requests(added)
            self.output_processor.abort_requests([processed.request_id])
            raise

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Validate and queue one request; on ``ValueError`` nothing is queued and running requests go on.
        ``lora_request``: the adapter it runs with (loaded here, so a bad one is a ``ValueError`` now)."""
        self.add_processed_request(
            self.process_request(request_id, prompt, params, arrival_time, priority, lora_request)
        )

    def process_pooling_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: PoolingParams,
        arrival_time: float | None = None,
        text_pair: str | None = None,
        priority: int = 0,
    ) -> tuple[PoolingPrompt, EngineCoreRequest]:
        """Validate and tokenize one pooling request (``params.task`` set) without queueing it; ``ValueError``
        naming the field. ``text_pair``: the second text of a cross-encoder pair."""
        self._check_running()
        if self.pooling_processor is None:
            raise ValueError(
                "this model generates text (runner='generate'): it has no pooling output; start it with "
                "runner='pooling' to embed with it"
            )
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        return self.pooling_processor.process(request_id, prompt, params, arrival_time, text_pair, priority)

    def add_processed_pooling_request(self, prompt: PoolingPrompt, request: EngineCoreRequest) -> None:
        if request.request_id in self._pooling_prompts:
            raise ValueError(f"request_id {request.request_id!r} is already in flight")
        self.engine_core.add_request(request)
        self._pooling_prompts[request.request_id] = prompt

    def add_pooling_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: PoolingParams,
        arrival_time: float | None = None,
        text_pair: str | None = None,
        priority: int = 0,
    ) -> None:
        """``process_pooling_request``, then queue it."""
        self.add_processed_pooling_request(
            *self.process_pooling_request(request_id, prompt, params, arrival_time, text_pair, priority)
        )

    def _pooling_step(self) -> list[PoolingRequestOutput]:
        outputs = self.engine_core.step()
        if outputs.stats is not None:
            self.last_stats = outputs.stats
        results = []
        for out in outputs.outputs:
            info = self._pooling_prompts.pop(out.request_id, None)
            if info is None or out.pooling_output is None:
                continue
            results.append(
                PoolingRequestOutput(
                    out.request_id, PoolingOutput(out.pooling_output), info.token_ids, True, info.prompt
                )
            )
        return results

    def step(self) -> list[RequestOutput]:
        self._check_running()
        if self.is_pooling:
            return self._pooling_step()
        outputs = self.engine_core.step()
        if outputs.stats is not None:
            self.last_stats = outputs.stats
        processed = self.output_processor.process_outputs(outputs.outputs)
        if processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort)
        self.engine_core.on_idle()  # the integrity check, once, when this step left no work
        return processed.request_outputs

    def abort_request(self, request_ids: str | list[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        if self.is_shut_down:  # nothing runs any more
            self.output_processor.abort_requests(list(request_ids))
            return
        if self.is_pooling:
            for rid in request_ids:
                self._pooling_prompts.pop(rid, None)
            self.engine_core.abort_requests(list(request_ids))
            return
        self.engine_core.abort_requests(self.output_processor.abort_requests(list(request_ids)))
        self.engine_core.on_idle()

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests() or self.engine_core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests() + len(self._pooling_prompts)

    def get_stats(self) -> SchedulerStats:
        return self.engine_core.get_stats()

    def check_integrity(self) -> None:
        self.engine_core.check_integrity()

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter ahead of its requests (``ValueError`` if it cannot be served)."""
        self._check_running()
        return self.engine_core.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        self._check_running()
        return self.engine_core.remove_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        self._check_running()
        return self.engine_core.list_loras()

    # Rollout-engine hooks, also reached as ``llm.llm_engine.*`` by RL frameworks (see ``LLM``).

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        self._check_running()
        return self.engine_core.collective_rpc(method, args, kwargs)

    def update_weights(self, weights: Any) -> int:
        self._check_running()
        return self.engine_core.update_weights(weights)

    def reset_prefix_cache(self) -> bool:
        self._check_running()
        return self.engine_core.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        self._check_running()
        self.engine_core.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._check_running()
        self.engine_core.wake_up(tags)

    def is_sleeping(self) -> bool:
        self._check_running()
        return self.engine_core.is_sleeping()

    @property
    def is_shut_down(self) -> bool:
        return not self._finalizer.alive

    def _check_running(self) -> None:
        if self.is_shut_down:
            raise RuntimeError("this engine has been shut down")

    def shutdown(self) -> None:
        """Stop the engine core and release what it holds: tensor/pipeline-parallel worker processes, this
        process's torch.distributed groups, device memory (weights, KV cache, CUDA graphs, the allocator's cache)
        and grammar threads. Idempotent. Unfinished requests are dropped; ``step``, ``add_request`` and the LoRA
        calls raise ``RuntimeError`` afterwards."""
        self._finalizer()
