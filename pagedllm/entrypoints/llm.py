"""``LLM``: vLLM's offline API (generate, chat) as a thin layer over ``LLMEngine``."""

from __future__ import annotations

import functools
import gc
import itertools
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import Any, TypeVar

import torch

from pagedllm.beam_search import BeamSearchOutput, BeamSearchParams, run_beam_search
from pagedllm.config import make_engine_config
from pagedllm.engine.input_processor import extract_chat_images
from pagedllm.engine.llm_engine import LLMEngine, PromptType
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from pagedllm.pooling.params import PoolingParams
from pagedllm.pooling.score import score_pairs
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

ChatMessages = list[dict[str, Any]]
T = TypeVar("T")


def _gc_paused(method: Callable[..., T]) -> Callable[..., T]:
    """``method`` with Python's cyclic garbage collector paused while it runs (and resumed after, if it was on):
    a large pooling batch allocates an object or more per token list and per output, and each full collection
    that triggers walks all of them again (more than half of the host work besides tokenizing, on a CPU run of
    20,000 texts). A pooling call makes no reference cycles of its own, so nothing is left for the collector."""

    @functools.wraps(method)
    def paused(*args: Any, **kwargs: Any) -> T:
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return method(*args, **kwargs)
        finally:
            if was_enabled:
                gc.enable()

    return paused


class LLM:
    """Generate text for batches of prompts with continuous batching over a paged KV cache.

    ``model=None`` loads the bundled demo model. Keyword arguments carry vLLM's names and defaults.
    ``runner="pooling"`` (automatic for encoders, sequence classifiers and sentence-transformers checkpoints) makes
    it a pooling model: ``embed`` / ``classify`` / ``score`` / ``encode`` instead of ``generate``;
    ``pooler_config={"pooling_type": "MEAN", "normalize": False}`` overrides the checkpoint's pooling.

    ``shutdown()`` releases the engine's worker processes, torch.distributed groups, device memory and threads,
    so that another ``LLM`` (tensor- or pipeline-parallel too) can start in this process; ``with LLM(...) as llm:``
    shuts down on leaving the block, and dropping the last reference to the ``LLM`` does it when the object is
    collected. A shut-down ``LLM`` raises ``RuntimeError`` when used.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        tokenizer: str | None = None,
        dtype: str = "auto",
        max_model_len: int | None = None,
        block_size: int = 16,
        gpu_memory_utilization: float = 0.9,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        seed: int = 0,
        device: str = "auto",
        load_format: str = "auto",
        tokenizer_mode: str = "auto",
        trust_remote_code: bool = False,
        kv_cache_memory_bytes: int | None = None,
        kv_cache_dtype: str = "auto",
        num_gpu_blocks_override: int | None = None,
        disable_hybrid_kv_cache_manager: bool = False,
        enforce_eager: bool = False,
        compilation_config: dict[str, Any] | str | int | None = None,
        optimization_level: int | None = None,
        attention_backend: str | None = None,
        scheduling_policy: str = "fcfs",
        long_prefill_token_threshold: int = 0,
        max_num_partial_prefills: int = 1,
        max_long_partial_prefills: int = 1,
        check_integrity_on_idle: bool = True,
        async_scheduling: bool | None = None,
        reasoning_parser: str | None = None,
        speculative_config: dict[str, Any] | None = None,
        data_parallel_size: int = 1,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        distributed_executor_backend: str | None = None,
        enable_expert_parallel: bool = False,
        quantization: str | None = None,
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        max_cpu_loras: int | None = None,
        enable_sleep_mode: bool = False,
        worker_extension_cls: str | None = None,
        runner: str = "auto",
        pooler_config: dict[str, Any] | None = None,
        kv_transfer_config: dict[str, Any] | None = None,
        kv_offloading_size: float | None = None,
        kv_offloading_backend: str | None = None,
        swap_space: float | None = None,
        cpu_offload_gb: float = 0,
        limit_mm_per_prompt: dict[str, int] | None = None,
        allowed_local_media_path: str | None = None,
        mm_processor_cache_gb: float = 4.0,
        **kwargs: Any,
    ) -> None:
        if kwargs:
            raise ValueError(f"unknown LLM arguments: {', '.join(sorted(kwargs))}")
        if model is None:
            from pagedllm.demo import default_model

            model = default_model()
        config = make_engine_config(
            model,
            tokenizer=tokenizer,
            dtype=dtype,
            max_model_len=max_model_len,
            block_size=block_size,
            gpu_memory_utilization=gpu_memory_utilization,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
            enable_chunked_prefill=enable_chunked_prefill,
            seed=seed,
            device=device,
            load_format=load_format,
            trust_remote_code=trust_remote_code,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            kv_cache_dtype=kv_cache_dtype,
            num_gpu_blocks_override=num_gpu_blocks_override,
            disable_hybrid_kv_cache_manager=disable_hybrid_kv_cache_manager,
            enforce_eager=enforce_eager,
            compilation_config=compilation_config,
            optimization_level=optimization_level,
            attention_backend=attention_backend,
            scheduling_policy=scheduling_policy,
            long_prefill_token_threshold=long_prefill_token_threshold,
            max_num_partial_prefills=max_num_partial_prefills,
            max_long_partial_prefills=max_long_partial_prefills,
            check_integrity_on_idle=check_integrity_on_idle,
            async_scheduling=async_scheduling,
            reasoning_parser=reasoning_parser,
            speculative_config=speculative_config,
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            distributed_executor_backend=distributed_executor_backend,
            enable_expert_parallel=enable_expert_parallel,
            quantization=quantization,
            enable_lora=enable_lora,
            max_loras=max_loras,
            max_lora_rank=max_lora_rank,
            max_cpu_loras=max_cpu_loras,
            enable_sleep_mode=enable_sleep_mode,
            worker_extension_cls=worker_extension_cls,
            runner=runner,
            pooler_config=pooler_config,
            kv_transfer_config=kv_transfer_config,
            kv_offloading_size=kv_offloading_size,
            kv_offloading_backend=kv_offloading_backend,
            swap_space=swap_space,
            cpu_offload_gb=cpu_offload_gb,
            limit_mm_per_prompt=limit_mm_per_prompt,
            allowed_local_media_path=allowed_local_media_path,
            mm_processor_cache_gb=mm_processor_cache_gb,
        )
        self.llm_engine = LLMEngine(config)
        self._counter = itertools.count()
        self._pooling_tokenizer_thread: bool | None = None  # None: by device (see _tokenize_in_thread)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def shutdown(self) -> None:
        """Release the engine (``LLMEngine.shutdown``): worker processes, process groups, device memory (weights,
        KV cache, CUDA graphs, the allocator's cache) and threads. Idempotent."""
        self.llm_engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.shutdown()

    def _check_running(self) -> None:
        if self.llm_engine.is_shut_down:
            raise RuntimeError("this LLM has been shut down; create a new LLM to generate again")

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.

        A prompt is a string, a list of token ids, ``{"prompt": str}`` or ``{"prompt_token_ids": [...]}``.
        ``lora_request``: one adapter for every prompt, or one (or None: the base model) per prompt; needs
        ``enable_lora=True``. Every prompt is validated before any is queued, so a ``ValueError`` leaves the
        engine untouched (an adapter that fails to load is refused when its request is added). ``RuntimeError``
        after ``shutdown()``.
        """
        self._check_running()
        self.llm_engine.engine_core.check_awake()
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"sampling_params has {len(params_list)} entries but there are {len(prompts)} prompts"
                )
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority has {len(priority)} entries but there are {len(prompts)} prompts")
        if not isinstance(lora_request, (list, tuple)):  # one for every prompt (checked when processed)
            lora_list = [lora_request] * len(prompts)
        else:
            lora_list = list(lora_request)
            if len(lora_list) != len(prompts):
                raise ValueError(
                    f"lora_request has {len(lora_list)} entries but there are {len(prompts)} prompts"
                )
        engine = self.llm_engine
        now = time.monotonic()
        processed = [
            engine.process_request(
                str(next(self._counter)),
                p,
                sp,
                arrival_time=now,
                priority=priority[i] if priority else 0,
                lora_request=lora_list[i],
            )
            for i, (p, sp) in enumerate(zip(prompts, params_list))
        ]
        for pr in processed:
            # Only final results are read here: skip building per-step outputs (a large share of CPU time).
            pr.params.output_kind = RequestOutputKind.FINAL_ONLY
        added = []
        try:
            for pr in processed:
                engine.add_processed_request(pr)
                added.append(pr.request_id)
            return self._run_engine([pr.request_id for pr in processed], use_tqdm)
        except BaseException:
            engine.abort_request(added)
            raise

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search (vLLM's ``LLM.beam_search``): one ``BeamSearchOutput`` per prompt, in input order, holding
        ``params.beam_width`` sequences (prompt + generated ``tokens``, ``text``, ``cum_logprob``), best first.

        Each step runs every live beam of every prompt as a one-token request with ``logprobs`` set to the number
        of candidates kept, all in one batch; prefix caching shares the beams' common full KV blocks, so a step
        recomputes only each beam's last partial block. Candidate selection, EOS handling and the length-penalized
        score (``cum_logprob / generated_len ** length_penalty``) are transformers' beam search with
        ``early_stopping=False`` (see ``pagedllm.beam_search``). ``concurrency_limit`` bounds how many prompts are
        searched at once. Bad ``params`` or prompts raise ``ValueError`` before any request runs.
        """
        self._check_running()
        return run_beam_search(self, prompts, params, lora_request, use_tqdm, concurrency_limit)

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them, then ``generate``.

        ``tools`` (OpenAI-style function definitions) and ``chat_template_kwargs`` (``enable_thinking``...) reach
        the template, as in vLLM. Calls the model writes stay in the text: the server's ``--tool-call-parser``
        parses them, or ``structured_outputs`` forces a JSON shape.

        A multimodal model also takes image parts: ``{"type": "image_url", "image_url": {"url": ...}}`` (data,
        http(s) or, under ``allowed_local_media_path``, file URLs) and ``{"type": "image_pil", "image_pil": img}``.
        """
        self._check_running()
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of messages or of conversations")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        ip = self.llm_engine.input_processor
        prompts = []
        for conv in conversations:
            kwargs = dict(chat_template_kwargs or {})
            if tools:
                kwargs["tools"] = tools
            conv, images = extract_chat_images(conv, ip.image_placeholder)
            text = ip.apply_chat_template(
                conv, chat_template=chat_template, add_generation_prompt=add_generation_prompt, **kwargs
            )
            ids = self.llm_engine.tokenizer(text, add_special_tokens=False)["input_ids"]
            prompt: dict[str, Any] = {"prompt_token_ids": ids, "prompt": text}
            if images:
                prompt["multi_modal_data"] = {"image": ip.load_chat_images(images)}
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    # ------------------------------------------------------------------ rollout-engine hooks (RL frameworks)

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Run ``method`` on every rank's worker and return the results, one per rank in rank order (vLLM's
        ``collective_rpc``). A string names a method of ``pagedllm.worker.worker.Worker`` (or of
        ``worker_extension_cls``), called as ``worker.method(*args, **kwargs)``; a callable is called as
        ``method(worker, *args, **kwargs)`` (sent to the other ranks with cloudpickle where installed). Arguments
        and results cross process boundaries by pickle. ``timeout`` is accepted for vLLM's signature; calls run
        to completion. After writing weights through a worker method, call ``reset_prefix_cache()``."""
        return self.llm_engine.collective_rpc(method, timeout, args, kwargs)

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> int:
        """Replace weights in place from tensors named and shaped as in the HF checkpoint (a trainer's
        ``state_dict()``, all of it or part): each tensor-parallel rank takes its shard as at load time, values
        are cast to the engine's dtype, and the prefix cache is reset. Every tensor is checked first: an unknown
        name, a non-floating dtype or a wrong shape is a ``ValueError`` naming it, and nothing changes. Returns
        how many tensors rank 0 took."""
        return self.llm_engine.update_weights(weights)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached KV block (after a weight update the cached keys and values are stale); False when
        requests still hold blocks."""
        return self.llm_engine.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Release device memory between rollouts (needs ``enable_sleep_mode=True``): ``level=1`` moves the
        weights to host memory and discards the KV cache; ``level=2`` discards both (write the weights again
        with ``update_weights`` or ``collective_rpc("reload_weights")`` before generating). The prefix cache is
        reset. ``generate`` raises ``RuntimeError`` until ``wake_up``."""
        self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what ``sleep`` released: ``tags`` None (everything), ``["weights"]`` or ``["kv_cache"]``
        (e.g. the weights first, update them, then the KV cache)."""
        self.llm_engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        """Whether any part of the engine (weights, KV cache) is released by ``sleep``."""
        return self.llm_engine.is_sleeping()

    # ------------------------------------------------------------------ pooling models (runner="pooling")

    @_gc_paused
    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_task: str = "encode",
    ) -> list[PoolingRequestOutput]:
        """The pooled output of each prompt (``.outputs.data``, a float32 tensor), in input order: for
        ``pooling_task="encode"`` the pooled hidden state as is (a classifier's logits), for "embed" / "classify"
        what ``embed`` / ``classify`` return in tensor form. Every prompt is validated before any is queued
        (``ValueError`` naming the field)."""
        prompts = self._prompt_list(prompts)
        params = self._pooling_params_list(pooling_params, len(prompts), pooling_task, truncate_prompt_tokens)
        return self._run_pooling([(p, sp, None) for p, sp in zip(prompts, params)], use_tqdm)

    @_gc_paused
    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (``.outputs.embedding``, list of floats), normalized unless the checkpoint or
        ``pooling_params.normalize`` says otherwise; ``pooling_params.dimensions`` shortens it (Matryoshka
        models)."""
        outs = self.encode(
            prompts,
            pooling_params,
            truncate_prompt_tokens=truncate_prompt_tokens,
            use_tqdm=use_tqdm,
            pooling_task="embed",
        )
        return [EmbeddingRequestOutput.from_base(o) for o in outs]

    @_gc_paused
    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt (``.outputs.probs``: softmax over the labels, sigmoid for one label)
        from a sequence-classification model."""
        outs = self.encode(
            prompts,
            pooling_params,
            truncate_prompt_tokens=truncate_prompt_tokens,
            use_tqdm=use_tqdm,
            pooling_task="classify",
        )
        return [ClassificationRequestOutput.from_base(o) for o in outs]

    @_gc_paused
    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        /,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
    ) -> list[ScoringRequestOutput]:
        """Similarity of text pairs (``.outputs.score``): one ``data_1`` against each of ``data_2``, or pairwise
        for two lists of the same length. A cross-encoder (a classifier with one label) reads each pair as one
        input and gives the sigmoid of its logit; an embedding model gives the cosine of the two embeddings."""
        pairs = score_pairs(data_1, data_2)
        pooler = self.llm_engine.config.model_config.pooler_config
        if pooler is None:
            raise ValueError("score needs a pooling model (runner='pooling'); this model generates text")
        params = pooling_params or PoolingParams()
        if truncate_prompt_tokens is not None:
            params = PoolingParams(**{**params.__dict__, "truncate_prompt_tokens": truncate_prompt_tokens})
        if pooler.is_classifier:
            if pooler.num_labels != 1:
                raise ValueError(
                    f"score needs a cross-encoder with one label; this classifier has {pooler.num_labels} labels: "
                    "use classify"
                )
            task_params = params.with_task("score")
            outs = self._run_pooling([(a, task_params, b) for a, b in pairs], use_tqdm)
            return [
                ScoringRequestOutput(o.request_id, ScoringOutput(float(o.outputs.data[0])), o.prompt_token_ids)
                for o in outs
            ]
        import torch

        task_params = params.with_task("embed")
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))  # each distinct text embedded once
        outs = dict(zip(texts, self._run_pooling([(t, task_params, None) for t in texts], use_tqdm)))
        results = []
        for text_1, text_2 in pairs:
            a, b = outs[text_1], outs[text_2]
            score = torch.nn.functional.cosine_similarity(a.outputs.data, b.outputs.data, dim=0).item()
            results.append(
                ScoringRequestOutput(a.request_id, ScoringOutput(score), a.prompt_token_ids + b.prompt_token_ids)
            )
        return results

    @staticmethod
    def _prompt_list(prompts: Any) -> list[Any]:
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            return [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ValueError("prompts must not be empty")
        if any(isinstance(p, str) for p in prompts) and any(isinstance(p, (list, tuple)) for p in prompts):
            raise ValueError(
                "prompts mixes strings and token-id lists in one batch; give all strings or all token-id lists "
                "(or {'prompt': ...} / {'prompt_token_ids': [...]} dicts)"
            )
        return prompts

    @staticmethod
    def _pooling_params_list(
        pooling_params: PoolingParams | Sequence[PoolingParams] | None,
        num_prompts: int,
        task: str,
        truncate_prompt_tokens: int | None,
    ) -> list[PoolingParams]:
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params_list = [pooling_params or PoolingParams()] * num_prompts
        else:
            params_list = list(pooling_params)
            if len(params_list) != num_prompts:
                raise ValueError(
                    f"pooling_params has {len(params_list)} entries but there are {num_prompts} prompts"
                )
        converted: dict[int, PoolingParams] = {}  # one copy per distinct object (shared by its prompts)
        out = []
        for p in params_list:
            q = converted.get(id(p))
            if q is None:
                if not isinstance(p, PoolingParams):
                    raise ValueError(f"pooling_params must be PoolingParams, got {type(p).__name__}")
                q = p
                if truncate_prompt_tokens is not None:
                    q = PoolingParams(**{**p.__dict__, "truncate_prompt_tokens": truncate_prompt_tokens})
                q = converted[id(p)] = q.with_task(task)
            out.append(q)
        return out

    def _run_pooling(
        self, items: list[tuple[Any, PoolingParams, str | None]], use_tqdm: bool
    ) -> list[PoolingRequestOutput]:
        """Validate, queue and run every (prompt, params, text pair); the outputs in input order.

        Plain text prompts are tokenized in chunks of about one step's tokens, in input order, kept about three
        steps ahead of the engine: on a GPU by a tokenizer thread, while this thread queues the chunks already
        tokenized and steps the engine (a fast tokenizer runs outside the GIL, so tokenizing overlaps both the
        host's stepping and the device's work, instead of the device waiting for every text to be tokenized
        first); on the CPU, where the model needs the cores itself, here between steps. Everything that can be checked without
        tokenizing (every parameter, every prompt that is not plain text, and the texts of the first chunk) is
        checked before anything is queued; a later text that turns out too long still raises ``ValueError``,
        with every request of this call aborted. The tokenizer is used by the tokenizer thread only, and the call
        returns (or raises) only after that thread is done with it.
        """
        self._check_running()
        engine = self.llm_engine
        processor = engine.pooling_processor
        now = time.monotonic()
        req_ids = [str(next(self._counter)) for _ in items]
        if processor is None:  # a generating model: process_pooling_request says why it cannot
            engine.process_pooling_request(req_ids[0], items[0][0], items[0][1], now, items[0][2])
        is_text = [processor.plain_text(*item) is not None for item in items]
        for params in {id(sp): sp for _, sp, _ in items}.values():
            processor.check_params(params)
        processed: dict[int, tuple[Any, Any]] = {
            i: engine.process_pooling_request(req_ids[i], prompt, sp, arrival_time=now, text_pair=pair)
            for i, (prompt, sp, pair) in enumerate(items)
            if not is_text[i]
        }
        budget = processor.max_num_batched_tokens or 16384

        def tokenize(chunk: range) -> list[Any]:
            return processor.tokenize_batch([items[i] for i in chunk if is_text[i]])

        pbar = None
        if use_tqdm and len(items) > 1:
            from tqdm.auto import tqdm

            pbar = tqdm(total=len(items), desc="Processed prompts", dynamic_ncols=True)
        added: list[str] = []
        done: dict[str, PoolingRequestOutput] = {}
        tokenizer_thread = None
        try:
            first = range(0, min(len(items), 256))
            chunks: list[tuple[range, Any]] = [(first, tokenize(first))]
            avg_len = None  # prompt tokens per text, from the first chunk
            num_queued = 0  # items[:num_queued] are queued
            pending_tokens = 0  # prompt tokens queued and not finished
            while chunks or len(done) < len(added):
                # Queue tokenized chunks while fewer than about three steps of tokens wait (one on the device,
                # one being prepared, one spare); wait for the tokenizer unless a full step is ready to go.
                while chunks and pending_tokens < 3 * budget:
                    chunk, result = chunks[0]
                    if result is None:  # no tokenizer thread: tokenized here, between steps
                        result = tokenize(chunk)
                    elif not isinstance(result, list):  # a Future of the tokenizer thread
                        if not result.done() and pending_tokens >= 2 * budget:
                            break
                        result = result.result()
                    chunks.pop(0)
                    texts = iter(result)
                    requests = [
                        engine.process_pooling_request(
                            req_ids[i], next(texts), items[i][1], arrival_time=now, text_pair=items[i][2]
                        )
                        if is_text[i]
                        else processed.pop(i)
                        for i in chunk
                    ]
                    for info, request in requests:  # the whole chunk checked, then queued
                        engine.add_processed_pooling_request(info, request)
                        added.append(request.request_id)
                        pending_tokens += len(request.prompt_token_ids)
                    num_queued = chunk.stop
                    if avg_len is None and num_queued < len(items):  # the rest, about a step's tokens a chunk
                        avg_len = max(1.0, pending_tokens / len(chunk))
                        size = max(16, int(budget / avg_len))
                        if self._tokenize_in_thread():
                            tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="pagedllm-tokenize")
                        for start in range(num_queued, len(items), size):
                            rest = range(start, min(len(items), start + size))
                            todo = tokenizer_thread.submit(tokenize, rest) if tokenizer_thread else None
                            chunks.append((rest, todo))
                if len(done) < len(added):
                    for out in engine.step():
                        if out.request_id not in done and out.finished:
                            done[out.request_id] = out
                            pending_tokens -= len(out.prompt_token_ids)
                            if pbar is not None:
                                pbar.update(1)
                    if len(done) < len(added) and not engine.has_unfinished_requests():
                        unfinished = len(added) - len(done)
                        raise RuntimeError(f"engine went idle with {unfinished} requests unfinished")
        except BaseException:
            engine.abort_request([r for r in added if r not in done])
            raise
        finally:
            if tokenizer_thread is not None:
                tokenizer_thread.shutdown(wait=True, cancel_futures=True)
            if pbar is not None:
                pbar.close()
        return [done[r] for r in req_ids]

    def _tokenize_in_thread(self) -> bool:
        """Whether ``_run_pooling`` tokenizes in a tokenizer thread: on an accelerator (its host cores are free
        while it computes), not on the CPU; ``_pooling_tokenizer_thread`` overrides."""
        if self._pooling_tokenizer_thread is not None:
            return self._pooling_tokenizer_thread
        return self.llm_engine.config.device_config.device.type != "cpu"

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        pending = set(request_ids)
        done: dict[str, RequestOutput] = {}
        pbar = None
        if use_tqdm and len(request_ids) > 1:
            from tqdm.auto import tqdm

            pbar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True)
        start = time.perf_counter()
        num_out_tokens = 0
        try:
            while pending:
                for out in engine.step():
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        done[out.request_id] = out
                        if pbar is not None:
                            if isinstance(out, RequestOutput):
                                num_out_tokens += sum(len(o.token_ids) for o in out.outputs)
                            pbar.set_postfix_str(
                                f"output {num_out_tokens / (time.perf_counter() - start):.1f} tok/s"
                            )
                            pbar.update(1)
                if pending and not engine.has_unfinished_requests():
                    raise RuntimeError(f"engine went idle with {len(pending)} requests unfinished")
        finally:
            if pbar is not None:
                pbar.close()  # also ends tqdm's monitor thread once no bar is left
        return [done[r] for r in request_ids]
