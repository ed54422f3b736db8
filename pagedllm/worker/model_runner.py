"""Model runner: update the persistent batch -> prepare inputs -> forward -> sample.

A thin orchestrator; feature logic lives in InputBatch, the attention backend, the model, the sampler and
spec_step (speculative decoding's verification steps).
"""

from __future__ import annotations

import logging
import math
import operator
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pagedllm.attention.base import AttentionMetadata, get_attention_backend
from pagedllm.config import HIDDEN_STATE_METHODS, EngineConfig
from pagedllm.core.kv_cache_manager import KVCacheLayout, plan_kv_cache_layout
from pagedllm.core.sched_output import LogprobsLists, ModelRunnerOutput, SchedulerOutput
from pagedllm.distributed.parallel_state import local_num_kv_heads
from pagedllm.layers.attention import Attention, kv_scales_summary
from pagedllm.layers.rotary import longrope_original_max, longrope_positions
from pagedllm.platform import use_fused_kernels
from pagedllm.sample.metadata import build_plain_sampling_metadata, build_sampling_metadata
from pagedllm.sample.sampler import LogprobsTensors, Sampler, compute_logprobs_topk
from pagedllm.worker.cuda_graphs import CudaGraphRunner
from pagedllm.worker.graph_io import final_hidden, slice_rows
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.piecewise_graphs import PiecewiseGraphRunner, piecewise_sizes
from pagedllm.worker.spec_step import collect_spec, sample_spec
from pagedllm.worker.weight_offload import loaded_offloader, new_offloader

logger = logging.getLogger(__name__)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class StepInFlight:
    """A launched step. Until ``ModelRunner.collect`` reads it, its sampled ids exist only on the device."""

    step_id: int
    req_ids: list[str] = field(default_factory=list)  # scheduled requests, batch order
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)  # computed at launch
    sample_req_ids: list[str] = field(default_factory=list)  # requests that sampled, in sampling order
    sample_rows: np.ndarray | None = None  # [num_sampled] batch rows
    sample_pos: np.ndarray | None = None  # [num_sampled] position of each sampled token in its row
    sample_gen: np.ndarray | None = None  # [num_sampled] row owner generation when sampled
    sample_num_logprobs: np.ndarray | None = None  # [num_sampled] -1 = no logprobs wanted
    logits: torch.Tensor | None = None  # [num_sampled, vocab_size] between launch and sample
    sampled: torch.Tensor | None = None  # [num_sampled] int64 on the device
    sampled_host: torch.Tensor | None = None  # [num_sampled] int64 host copy (pinned, filled asynchronously)
    logprobs: LogprobsTensors | None = None  # host copies on CUDA
    event: torch.cuda.Event | None = None  # recorded after the copies to the host
    # Speculative decoding (a step that verifies drafts; sampled/sampled_host are then [num_sampled, k + 1]).
    spec_num_draft: np.ndarray | None = None  # [num_sampled] drafts verified per sampled request (0..k)
    spec_draft_ids: np.ndarray | None = None  # [num_sampled, k] the drafts, padded with 0
    spec_num_accepted: torch.Tensor | None = None  # [num_sampled] int64 accepted drafts (on the host on CUDA)
    spec_accepted_dev: torch.Tensor | None = None  # [num_sampled] the same on the device
    spec_draft_dev: torch.Tensor | None = None  # [num_sampled, k] drafts that exist only on the device (SpecAhead)
    output: ModelRunnerOutput | None = None  # set by collect
    kv_connector_output: Any = None  # the KV connector's report for this step (KVConnectorOutput)
    query_start: np.ndarray | None = None  # [num_reqs + 1] offsets of each request's tokens in the step
    draft_hidden: torch.Tensor | None = None  # [num_tokens, D] hidden states an EAGLE draft reads (else None)
    verify_graph_bs: int = 0  # a verification step that replayed the multi-token graph of this batch size
    verify_table_width: int = 0  # ... and the block-table columns it filled there
    device_drafts: Any = None  # the next drafts a proposer started on the device after sampling (its own type)


class ModelRunner:
    def __init__(self, config: EngineConfig, tp: Any = None, pp: Any = None) -> None:
        """``tp``: this rank's ``TPGroup`` under tensor parallelism; ``pp``: its ``PPGroup`` (pipeline stage) under
        pipeline parallelism (pagedllm/distributed/executor.py)."""
        from pagedllm.model_loader import get_model

        self.config = config
        mc = config.model_config
        self.device = config.device_config.device
        self.dtype = mc.dtype
        self.kv_cache_dtype = config.cache_config.kv_cache_torch_dtype(mc.dtype)  # float8_e4m3fn for "fp8"
        self.block_size = config.cache_config.block_size
        self.max_model_len = mc.max_model_len
        config.scheduler_config.resolve_defaults(self.device)  # the batch limits the user left to the device
        self.max_num_reqs = config.scheduler_config.max_num_seqs
        self.max_num_tokens = config.scheduler_config.max_num_batched_tokens
        self.vocab_size = mc.vocab_size
        self.attn_backend = get_attention_backend(self.device, config.attention_backend)
        torch.manual_seed(mc.seed)
        t0 = time.perf_counter()
        self.pp = pp if pp is not None and pp.size > 1 else None  # None: the whole model here
        # cpu_offload_gb: the layers it keeps in host memory are built and loaded there (never whole on the device),
        # so a model larger than the device loads; the rest of the device memory goes to the KV cache.
        offload_gb = getattr(config, "cpu_offload_gb", 0)
        offload = new_offloader(offload_gb, self.device)
        self.model = get_model(mc, self.device, self.attn_backend, tp=tp, pp=self.pp, weight_offload=offload)
        self.weight_offload = loaded_offloader(offload, offload_gb)
        if self.pp is not None and getattr(config.speculative_config, "method", None) == "eagle3":
            # Every stage collects the hidden states of its EAGLE-3 layers (they ride to the last stage with the
            # activations, and from there to the head on rank 0).
            from pagedllm.models.eagle import eagle3_aux_layers

            inner = self.model.model
            inner.aux_hidden_state_layers = eagle3_aux_layers(len(inner.layers))
        self.tp_size = 1 if tp is None else tp.size
        self.num_kv_heads = local_num_kv_heads(mc.num_kv_heads, self.tp_size)  # this rank's
        logger.info(
            "loaded %s in %.2fs (%s, %s)", mc.model, time.perf_counter() - t0, self.dtype, self.device
        )
        self.lora_manager = self._make_lora_manager()  # before the KV cache is sized: slots take memory
        self.sampler = Sampler()
        self.max_blocks_per_req = _cdiv(self.max_model_len, self.block_size)
        self.kv_layout = self._plan_kv_layout()  # the engine core's KV cache manager keeps these groups
        self.input_batch = InputBatch(
            self.max_num_reqs,
            self.max_model_len,
            self.max_blocks_per_req,
            self.device,
            self.kv_layout.num_groups,
        )
        self.kv_caches: list[torch.Tensor] = []
        self.num_blocks = 0
        self.graph_runner: CudaGraphRunner | None = None
        self.piecewise: PiecewiseGraphRunner | None = None  # the other steps, up to 16k tokens
        self.allow_piecewise = True  # a draft model's runner sets False (see _piecewise_wanted)
        # Called right after a verification step's sampling is launched, with (step, tokens [num_sampled, k + 1],
        # accepted [num_sampled]) on the device: an EAGLE or Medusa proposer queues the next drafts there.
        self.after_spec_sample: Callable[[StepInFlight, torch.Tensor, torch.Tensor], None] | None = None
        self._last_step: StepInFlight | None = None  # the latest step with sampled tokens
        self.kv_connector: Any = None  # the worker side of a KV connector (register_kv_connector)
        self._next_step_id = 0
        # EAGLE, Medusa and MTP drafts read each step's hidden states (StepInFlight.draft_hidden): eager steps hand
        # them over as computed, graphed steps as views of the graphs' static outputs (valid until the next step).
        spec = config.speculative_config
        self.keep_hidden = spec is not None and spec.method in HIDDEN_STATE_METHODS
        # Steps of at most this many tokens per request also replay CUDA graphs: k + 1 with speculative decoding
        # (verification; a draft model's runner gets it from its proposer, for its catch-up passes).
        self.graph_query_len = 1 if spec is None else 1 + spec.num_speculative_tokens
        # LongRoPE models: (original_max, max_position) for longrope_positions (None: positions go in as they are).
        original_max = longrope_original_max(mc.hf_config)
        self.longrope = None if original_max is None else (original_max, mc.hf_config.max_position_embeddings)
        # Images (multimodal models): encoder outputs and the steps' image rows (worker/mm_inputs.py).
        self.encoder_runner = None
        if getattr(self.model, "supports_multimodal", False):
            from pagedllm.worker.mm_inputs import EncoderRunner

            self.encoder_runner = EncoderRunner(self.model, self.device, self.dtype)

    # ------------------------------------------------------------------ LoRA

    def _make_lora_manager(self):
        """A ``LoRAManager`` with LoRA layers installed on the model when LoRA is enabled, else None."""
        lc = self.config.lora_config
        if lc is None:
            return None
        from pagedllm.lora.manager import LoRAManager

        return LoRAManager(
            self.model,
            max_loras=lc.max_loras,
            max_lora_rank=lc.max_lora_rank,
            max_num_tokens=max(self.max_num_tokens, self.max_num_reqs),  # CUDA graphs pad to max_num_seqs
            max_cpu_loras=lc.max_cpu_loras,
            dtype=self.dtype,
            device=self.device,  # offloaded layers' weights are in host memory; their adapter slots are not
        )

    def _lora_mapping(self, rows: np.ndarray, num_sched: np.ndarray) -> None:
        """Give this step's adapters slots and write the per-token slot map every LoRA layer reads.

        ``rows``: [num_reqs] batch rows in batch order; ``num_sched``: [num_reqs] tokens each computes. A loop
        over the step's distinct adapters only (rows hold each request's adapter id, 0 for the base model).
        """
        mgr = self.lora_manager
        if mgr is None:
            return
        batch = self.input_batch
        ids = batch.lora_id_np[rows]  # [num_reqs] 0 = base model
        req_slots = np.full(len(rows), -1, dtype=np.int64)  # [num_reqs]
        if batch.num_lora_rows:
            uniq, first = np.unique(ids, return_index=True)
            used = [(int(i), batch.lora_requests[rows[f]]) for i, f in zip(uniq, first) if i != 0]
            if used:
                slots = mgr.activate([req for _, req in used])
                for (lora_id, _), slot in zip(used, slots):
                    req_slots[ids == lora_id] = slot
        mgr.set_mapping(req_slots, num_sched)  # graph replays run the captured LoRA kernels regardless

    # ------------------------------------------------------------------ KV cache layout and sizing

    def _attention_layers(self) -> list[Attention]:
        return [m for m in self.model.modules() if isinstance(m, Attention)]

    def layer_windows(self) -> list[int | None]:
        """The sliding window of each of this rank's KV caches' layers (None: full attention; all None when the
        caches are not ``Attention`` layers', e.g. MLA's)."""
        num_layers = len(self.kv_cache_shapes(1))
        layers = self._attention_layers()
        return [m.sliding_window for m in layers] if len(layers) == num_layers else [None] * num_layers

    def _plan_kv_layout(self) -> KVCacheLayout:
        """This rank's KV cache groups and cache tensors (``plan_kv_cache_layout``): hybrid models get a group per
        kind of layer unless ``disable_hybrid_kv_cache_manager``; others one group, whose window (when every layer
        has the same) the KV cache manager frees behind.

        Every rank plans the same groups. Pipeline stages (no hybrid layout there yet) keep a window only when every
        layer of the model has it, which each stage learns from the model's per-layer rule. Speculative decoding
        frees no window: a draft model reads the target's block ids over its own, unwindowed context. A hybrid
        layout shares cache tensors between groups, so it needs every layer's cache to have the same shape.
        """
        windows = self.layer_windows()
        num_layers = len(windows)
        if self.config.speculative_config is not None:
            return plan_kv_cache_layout([None] * num_layers, self.max_model_len)
        if self.pp is not None:
            mc = self.config.model_config
            rule = self.model.attention_cls.layer_sliding_window
            every = [rule(mc.hf_config, i) for i in range(mc.num_layers)]
            window = plan_kv_cache_layout(every, self.max_model_len, hybrid=False).group_windows[0]
            return plan_kv_cache_layout([window] * num_layers, self.max_model_len)
        hybrid = not self.config.cache_config.disable_hybrid_kv_cache_manager
        hybrid = hybrid and len(set(self.kv_cache_shapes(1))) == 1
        return plan_kv_cache_layout(windows, self.max_model_len, hybrid)

    def kv_cache_shapes(self, num_blocks: int) -> list[tuple[int, ...]]:
        """Each layer's cache shape for ``num_blocks`` blocks: what the model declares (``model.kv_cache_shapes``,
        e.g. MLA's ``[num_blocks, block_size, kv_lora_rank + rope_dim]``), else
        ``[2, num_blocks, block_size, num_kv_heads, head_dim]``. Every shape is linear in ``num_blocks``."""
        declared = getattr(self.model, "kv_cache_shapes", None)
        if declared is not None:
            return declared(num_blocks, self.block_size)
        mc = self.config.model_config
        start, end = (0, mc.num_layers) if self.pp is None else self.pp.layer_range(mc.num_layers)
        shape = (2, num_blocks, self.block_size, self.num_kv_heads, mc.head_dim)
        return [shape] * (end - start)  # this pipeline stage's layers only

    def kv_block_bytes(self, layout: KVCacheLayout | None = None) -> int:
        """Bytes one block takes under ``layout`` (default: this runner's): a page of each cache tensor (every
        layer's; each slot's under a hybrid layout, whose groups share the tensors)."""
        elem = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        slots = (layout or self.kv_layout).layer_slots
        per_slot = dict(zip(slots, (math.prod(s) for s in self.kv_cache_shapes(1))))
        return sum(per_slot.values()) * elem

    def determine_num_blocks(self, extra_block_bytes: int = 0) -> int:
        """Blocks that fit the memory budget: by hand (override / bytes), or profiled on CUDA, or a CPU default.

        ``extra_block_bytes``: what each block costs elsewhere too (a draft model's cache of the same blocks)."""
        cc = self.config.cache_config
        block_bytes = self.kv_block_bytes() + extra_block_bytes
        if cc.num_gpu_blocks_override is not None:
            return cc.num_gpu_blocks_override
        if cc.kv_cache_memory_bytes is not None:
            return cc.kv_cache_memory_bytes // block_bytes
        if self.device.type == "cuda":
            return self._profile_cuda_num_blocks(block_bytes)
        # CPU: a fixed byte budget, but no more than every sequence slot at full length could use.
        by_bytes = cc.cpu_kv_cache_bytes_default // block_bytes
        return max(1, min(by_bytes, self.max_num_reqs * self.max_blocks_per_req * self.kv_layout.num_groups))

    @torch.inference_mode()
    def _profile_cuda_num_blocks(self, block_bytes: int) -> int:
        """Run the largest step the scheduler may send, measure peak memory, give the rest to the KV cache."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        free_before, total = torch.cuda.mem_get_info(self.device)
        allocated_before = torch.cuda.memory_allocated(self.device)  # the weights, mostly
        num_tokens = self.max_num_tokens
        n_blocks = _cdiv(num_tokens, self.block_size)
        caches = [
            torch.empty(shape, dtype=self.kv_cache_dtype, device=self.device)
            for shape in self.kv_cache_shapes(n_blocks)
        ]
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(num_tokens, device=self.device) % self.max_model_len
        seq_len = min(num_tokens, self.max_model_len)
        num_reqs = _cdiv(num_tokens, seq_len)
        q_lens = [seq_len] * (num_reqs - 1) + [num_tokens - seq_len * (num_reqs - 1)]
        block_table = torch.arange(n_blocks, dtype=torch.int32).repeat(num_reqs, 1) % n_blocks
        meta = self._unwritten_metadata(q_lens, q_lens, block_table.to(self.device), kv_groups=1)
        hidden = final_hidden(self._forward(input_ids, positions, caches, meta, communicate=False))
        forward_peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)  # from here: the logits' and the sampler's peak
        spec = self.config.speculative_config
        logits_per_req = 1 if spec is None else 1 + spec.num_speculative_tokens  # verification: k + 1 rows
        n_logits = min(self.max_num_reqs * logits_per_req, num_tokens)
        logits = probs = None
        if hidden is not None:  # None: a pipeline stage before the last (no LM head here)
            logits = self.model.compute_logits(hidden[:n_logits])
            # Sampling with top-p sorts the whole vocabulary: include its working memory.
            probs = logits.softmax(-1).sort(dim=-1)
        cache_scratch = sum(c.numel() * c.element_size() for c in caches)  # one tensor per layer here
        del hidden, logits, probs, caches
        torch.cuda.synchronize(self.device)
        logits_peak = torch.cuda.max_memory_allocated(self.device)
        peak = max(forward_peak, logits_peak)
        # Memory others (and the CUDA context) hold is outside torch's counters: count it as used.
        non_torch = total - free_before - torch.cuda.memory_allocated(self.device)
        budget = total * self.config.cache_config.gpu_memory_utilization
        available = budget - peak - max(non_torch, 0) + cache_scratch
        # Headroom for CUDA graphs and allocator fragmentation.
        available -= 512 * 1024**2
        if self._piecewise_wanted():
            above = allocated_before + cache_scratch  # the weights and the profile's scratch cache
            available -= self._piecewise_reserve(forward_peak - above, logits_peak - above)
        torch.cuda.empty_cache()
        logger.info(
            "memory profile: peak %.2f GiB, non-torch %.2f GiB, budget %.2f GiB, KV cache %.2f GiB",
            peak / 2**30,
            non_torch / 2**30,
            budget / 2**30,
            max(available, 0) / 2**30,
        )
        return int(max(available, 0) // block_bytes)

    def _piecewise_reserve(self, forward_bytes: int, logits_bytes: int) -> float:
        """Memory the piecewise graphs need beyond the profile's peak, ``max(forward, logits)`` (each measured
        above the weights, for a step of ``max_num_tokens``). Their pool keeps the largest size's activations for
        good, beside what the allocator serves the logits and sampler (and eager steps above that size, when the
        budget is larger): the activations of ``top`` tokens (scaled from the profile), less what the profile's
        peak already holds, plus the static attention output buffer."""
        num_tokens = self.max_num_tokens
        sizes = piecewise_sizes(num_tokens)
        if not sizes:
            return 0.0
        top = sizes[-1]
        if num_tokens > top:  # eager steps up to num_tokens still need the profiled forward memory
            pool = forward_bytes * top / num_tokens
        else:  # the pool holds the forward's activations; the allocator's peak is the logits'
            pool = min(forward_bytes, logits_bytes)
        layers = self._attention_layers()
        out_row = max((a.num_heads * a.head_dim for a in layers), default=0) * self.dtype.itemsize
        return max(pool, 0) + top * out_row

    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` blocks: one cache tensor per slot of ``kv_layout`` (per layer, unless hybrid);
        each layer gets its slot's tensor in ``kv_caches`` and reads its group's block table."""
        layout = self.kv_layout
        tensors: dict[int, torch.Tensor] = {}
        for shape, slot in zip(self.kv_cache_shapes(num_blocks), layout.layer_slots):
            if slot not in tensors:
                tensors[slot] = torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)
        self.kv_caches = [tensors[slot] for slot in layout.layer_slots]  # per layer
        for attn, group in zip(self._attention_layers(), layout.layer_groups):
            attn.kv_group = group
        self.num_blocks = num_blocks
        logger.info(
            "KV cache dtype %s%s", self.kv_cache_dtype, kv_scales_summary(self.model, self.kv_cache_dtype)
        )

    def kv_block_dim(self) -> int:
        """The dimension of the cache tensors that indexes blocks (1 for ``[2, num_blocks, ...]``)."""
        one, two = self.kv_cache_shapes(1)[0], self.kv_cache_shapes(2)[0]
        return next(d for d, (a, b) in enumerate(zip(one, two)) if a != b)

    def register_kv_connector(self, connector: Any) -> None:
        """Hand the worker side of a KV connector the cache tensors; each step then loads before its forward and
        saves after it (``KVConnectorBase.begin_step`` / ``end_step``)."""
        connector.register_kv_caches(self.kv_caches, self.kv_block_dim())
        self.kv_connector = connector

    def shutdown(self) -> None:
        """Drop every device tensor this runner holds: the CUDA graphs (and their memory pools) first, then the KV
        cache, the step in flight, the persistent batch's buffers, LoRA slots and the weights. The runner cannot
        run afterwards; the caller empties the allocator's cache (``EngineCore.shutdown``). Idempotent."""
        if self.device.type == "cuda" and self.model is not None:
            torch.cuda.synchronize(self.device)  # nothing queued may still write into what is dropped here
        self.graph_runner = self.piecewise = None
        self._last_step = None
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
        self.kv_connector = None  # (a CPU store's pinned memory with it)
        self.kv_caches = []
        self.input_batch = None
        self.lora_manager = None
        if getattr(self, "weight_offload", None) is not None:
            self.weight_offload.close()  # its hooks held it (and its pinned host copies) from the model
        self.weight_offload = None
        self.encoder_runner = None
        self.model = None

    def _graph_mode(self) -> str:
        """The CUDA graph mode (``EngineConfig.cudagraph_mode``, from vLLM's ``compilation_config``)."""
        return getattr(self.config, "cudagraph_mode", "FULL_AND_PIECEWISE")

    def _graphs_wanted(self) -> bool:
        """Any CUDA graphs: unless eager mode (or ``cudagraph_mode`` NONE) was asked for, the backend cannot be
        captured, or layers are offloaded (``cpu_offload_gb``: the steps wait for the weight copies, not for
        launches; worker/weight_offload.py). Speculative decoding that reads the target's hidden states (EAGLE,
        EAGLE-3, MTP, Medusa) gets them from the graphs' static outputs."""
        return not (
            self.config.enforce_eager
            or self._graph_mode() == "NONE"
            or self.device.type != "cuda"
            or self.attn_backend.name != "triton"
            or self.weight_offload is not None
        )

    def _is_mla(self) -> bool:
        return getattr(self.config.model_config.hf_config, "kv_lora_rank", None) is not None

    def _piecewise_wanted(self) -> bool:
        """Piecewise graphs (worker/piecewise_graphs.py) for the steps the decode graphs do not take: where decode
        graphs are, without LoRA or pipeline stages (neither is validated with them yet), unless
        ``PAGEDLLM_PIECEWISE=0`` (a switch for A/B runs). Under tensor parallelism too (validated against eager
        TP=2 on two GPUs by tests/distributed/test_tp_gpu.py), unless ``PAGEDLLM_TP_PIECEWISE=0``. MLA plans
        attention on the host: it stays eager."""
        if not self.allow_piecewise or not self._graphs_wanted() or self._is_mla():
            return False
        if self._graph_mode() not in ("FULL_AND_PIECEWISE", "PIECEWISE"):
            return False
        if self.lora_manager is not None or self.pp is not None:
            return False
        if self.tp_size > 1 and os.environ.get("PAGEDLLM_TP_PIECEWISE", "1") == "0":
            return False
        return os.environ.get("PAGEDLLM_PIECEWISE", "1") != "0"

    def maybe_capture_cuda_graphs(self) -> None:
        """Capture the decode graphs (unless ``cudagraph_mode`` is PIECEWISE), then the piecewise graphs where
        :meth:`_piecewise_wanted`; nothing in eager mode or where the backend cannot be captured."""
        if not self._graphs_wanted():
            return
        mode = self._graph_mode()
        if mode in ("FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"):
            self._capture_decode_graphs()
        if not (self._piecewise_wanted() and self._capture_piecewise()) and mode == "PIECEWISE":
            # Pieces are not available here (TP with PAGEDLLM_TP_PIECEWISE=0, LoRA, PP, MLA, a draft model, or a
            # failed capture): decode graphs rather than none at all.
            logger.warning("cudagraph_mode PIECEWISE: no piecewise graphs here; decode graphs instead")
            self._capture_decode_graphs()
        self._warm_up_eager_steps()

    def _capture_decode_graphs(self) -> None:
        # MLA plans its multi-token steps on the host (meta.*_cpu): those stay eager.
        mla = self._is_mla()
        query_len = 1 if mla else self.graph_query_len
        self.graph_runner = CudaGraphRunner(
            self.model,
            self.kv_caches,
            self.max_num_reqs,
            self.max_blocks_per_req,
            self.max_model_len,
            self.device,
            self.kv_layout.num_groups,
            max_query_len=query_len,
            max_num_tokens=self.max_num_tokens,
        )
        if self.lora_manager is not None:
            # Graphs record the LoRA kernels whatever the step's adapters; rows without one (and padding
            # rows: LoRAMapping.update writes -1 past the step's tokens) have slot -1 and add nothing.
            self.lora_manager.set_mapping([], [], force_apply=True)
        self.graph_runner.capture()

    def _capture_piecewise(self) -> bool:
        """Capture the piecewise graphs; whether they are in use."""
        sizes = piecewise_sizes(self.max_num_tokens)
        if not sizes:
            return False
        # The runner hands the allocator's cached memory back before each capture (its pool is private); the
        # memory profile reserved the pool (_piecewise_reserve).
        runner = PiecewiseGraphRunner(
            self.model, self.kv_caches, sizes, self.device, self.kv_layout.num_groups
        )
        if runner.capture(len(self._attention_layers())):
            self.piecewise = runner
        return self.piecewise is not None

    @torch.inference_mode()
    def _warm_up_eager_steps(self) -> None:
        """Compile now (or load from Triton's cache) what eager mixed steps and sampling launch, instead of in the
        middle of the first requests: a compile takes seconds on a cold cache, and the step loop waits for it.

        Dummy steps of a decode then a chunk of L tokens (nothing written to the cache) meet the variants:
        a mixed step's prefill tiles depend on its longest chunk through the next power of two (``tile_config``),
        so L = 2, 4, ..., 64 meets every tile configuration; and when few tiles share a long context (the tail of
        a run's prefills, such as a request's last few prompt tokens after its chunk was cut; the few decodes that
        lead a mixed step, in their own launch) the launch splits its keys (``num_kv_splits``), one variant per
        tile configuration and split count, which each L meets over contexts of 512, 1024, ... max_model_len
        tokens. Then the one-pass sampler, without and with a grammar bitmask.
        """
        hidden = None
        for chunk in (2, 4, 8, 16, 32, 64):
            if chunk + 1 > min(self.max_num_tokens, self.max_model_len):
                break
            context = chunk
            while context <= self.max_model_len:
                hidden = self._dummy_mixed_step(chunk, context)
                context = 512 if context < 512 else context * 2
        hidden = final_hidden(hidden)  # (an EAGLE-3 draft's auxiliary hidden states are not needed here)
        if isinstance(hidden, torch.Tensor):
            logits = self.model.compute_logits(hidden[-1:])
            if use_fused_kernels(logits):
                from pagedllm.kernels.gumbel_sample import gumbel_sample

                gumbel_sample(logits, None, 0)
                words = torch.full((1, _cdiv(logits.shape[-1], 32)), -1, dtype=torch.int32, device=logits.device)
                gumbel_sample(logits, None, 0, words)  # with a grammar bitmask (structured outputs)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            from pagedllm.kernels.compile_watch import log_later_compiles

            log_later_compiles()  # a variant this warm-up missed gets a log line naming it

    def _table_width(self, max_seq_len: int) -> int:
        """Columns of an eager step's block table: its longest context's blocks, rounded up to a multiple of 16
        (within the batch's table). The row stride is a kernel argument that Triton specializes on (divisible by 16
        or not): one width rule keeps every step, and the warm-up, on the same variant."""
        return min(_cdiv(_cdiv(max_seq_len, self.block_size), 16) * 16, self.max_blocks_per_req)

    def _dummy_mixed_step(self, chunk: int, seq_len: int) -> Any:
        """The forward of a step with a decode then a chunk of ``chunk`` tokens, both over contexts of ``seq_len``,
        every block read being block 0 and nothing written (slot -1)."""
        dev = self.device
        table = torch.zeros(2, self._table_width(seq_len), dtype=torch.int32, device=dev)
        meta = self._unwritten_metadata([1, chunk], [seq_len, seq_len], table, self.kv_layout.num_groups)
        ids = torch.zeros(chunk + 1, dtype=torch.long, device=dev)
        positions = torch.tensor([seq_len - 1, *range(seq_len - chunk, seq_len)], device=dev)
        return self._forward(ids, positions, self.kv_caches, meta, communicate=False)

    def _unwritten_metadata(
        self, q_lens: list[int], seq_lens: list[int], block_table: torch.Tensor, kv_groups: int
    ) -> AttentionMetadata:
        """Metadata of a dummy step (memory profile, warm-up): requests of ``q_lens`` new tokens and ``seq_lens``
        context read through ``block_table`` (on the device, shared by all ``kv_groups``); no slot is written."""
        num_tokens = sum(q_lens)
        qsl = torch.tensor([0, *np.cumsum(q_lens).tolist()], dtype=torch.int32)
        seq = torch.tensor(seq_lens, dtype=torch.int32)
        slots = torch.full((num_tokens,), -1, dtype=torch.long, device=self.device)  # -1: not written
        return AttentionMetadata(
            num_reqs=len(q_lens),
            num_tokens=num_tokens,
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            query_start_loc=qsl.to(self.device),
            seq_lens=seq.to(self.device),
            block_table=block_table,
            slot_mapping=slots,
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq,
            kv_group_tables=tuple((block_table, slots) for _ in range(kv_groups - 1)),
        )

    # ------------------------------------------------------------------ one step

    def _update_batch(self, sched: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in sched.finished_req_ids:
            batch.remove(req_id, keep_generator=req_id in sched.preempted_req_ids)
        for data in sched.scheduled_new_reqs:
            batch.add(data)
        for data in sched.scheduled_cached_reqs:
            batch.update(data)
        if self.encoder_runner is not None:
            self.encoder_runner.update(sched)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its sampled tokens (the synchronous engine loop)."""
        return self.collect(self.execute_model_async(sched))

    def execute_model_async(self, sched: SchedulerOutput) -> StepInFlight:
        """Launch one step and its sampling; the sampled ids stay on the device (``collect`` reads them later)."""
        step = self.launch(sched)
        self.sample(step)
        return step

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput) -> StepInFlight:
        """Launch one step's forward pass up to the logits of the rows that sample; ``sample`` must follow
        (before the next ``launch``). Between the two the caller may compute a grammar bitmask for
        ``step.sample_req_ids``, while the device runs the forward.

        A request whose last token was sampled by the previous step, still unread, is fed that token on the device.
        Host work is array operations over the persistent batch: no loop over requests unless a request asks for
        a per-request feature (penalties, logit bias, allowed/bad words, min_tokens, prompt logprobs, logprobs).
        """
        self._update_batch(sched)
        step = StepInFlight(step_id=self._next_step_id)
        self._next_step_id += 1
        if self.kv_connector is not None:
            self.kv_connector.begin_step(sched.kv_connector_metadata, len(self.kv_caches))
            if sched.total_num_scheduled_tokens == 0:
                step.kv_connector_output = self.kv_connector.end_step(sched.finished_req_ids)
        if sched.total_num_scheduled_tokens == 0:
            return step
        batch = self.input_batch
        prev = self._last_step
        if prev is not None and prev.output is None and batch.num_history_rows:
            self.collect(prev)  # penalties, bad words and min_tokens read the output tokens on the host
        self._last_step = step
        req_ids = list(sched.num_scheduled_tokens)
        n = len(req_ids)
        rows = np.array(operator.itemgetter(*req_ids)(batch.req_id_to_row), dtype=np.int64).reshape(n)
        num_sched = np.fromiter(sched.num_scheduled_tokens.values(), dtype=np.int64, count=n)
        # [num_reqs] tokens computed before this step
        num_computed = np.fromiter(sched.num_computed_tokens.values(), dtype=np.int64, count=n)

        # Flattened tokens:  token t belongs to request req_of[t], at position positions[t].
        num_tokens = int(num_sched.sum())
        cu = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(num_sched, out=cu[1:])
        req_of = np.repeat(np.arange(n), num_sched)  # [num_tokens]
        positions = np.arange(num_tokens) - cu[req_of] + num_computed[req_of]  # [num_tokens]
        token_rows = rows[req_of]  # [num_tokens]
        input_ids = batch.token_ids_np[token_rows, positions]  # [num_tokens] (placeholders hold 0)
        # One block table and slot mapping per KV cache group (a single group unless the model is hybrid).
        block_ids = batch.block_table_np[:, token_rows, positions // self.block_size]  # [groups, num_tokens]
        # C order: the fancy index above may give a column-major array, and each group's row must be contiguous
        # (the Triton cache write reads slot t at offset t).
        slot_mapping = np.ascontiguousarray(
            block_ids.astype(np.int64) * self.block_size + positions % self.block_size
        )  # [groups, num_tokens]
        seq_lens = (num_computed + num_sched).astype(np.int32)  # [num_reqs]
        max_blocks = self._table_width(int(seq_lens.max()))
        block_table = batch.block_table_np[:, rows, :max_blocks]  # [groups, num_reqs, max_blocks]

        # Speculative decoding: a request's drafts follow its last token, in the batch past its known tokens.
        num_draft = np.zeros(n, dtype=np.int64)  # [num_reqs]
        spec = sched.scheduled_spec_decode_tokens
        ahead = sched.spec_ahead  # a launch ahead of the host: the tokens and drafts are on the device
        if ahead is not None:
            num_draft[:] = ahead.num_draft  # (the positions past a row's known tokens are the device's to fill)
        elif spec:
            for i, req_id in enumerate(req_ids):
                drafts = spec.get(req_id)
                if drafts:
                    row, start = rows[i], batch.num_tokens_np[rows[i]]
                    batch.token_ids_np[row, start : start + len(drafts)] = drafts
                    num_draft[i] = len(drafts)
            input_ids = batch.token_ids_np[token_rows, positions]  # [num_tokens], drafts included
        if self.longrope is not None:  # from here on, positions are rows of the model's rotary table
            positions = longrope_positions(positions, batch.num_tokens_np[token_rows], *self.longrope)
        mrope_3d = None  # [3, num_tokens] M-RoPE positions (Qwen2-VL) for steps with image-prompt tokens
        if self.encoder_runner is not None and self.encoder_runner.uses_mrope:
            positions, mrope_3d = self.encoder_runner.rope_positions(req_ids, cu, positions)

        dev = self.device
        fix = None if ahead is None else ahead.device_fix(cu, self.block_size, dev)
        # Placeholders: a request's pending token is the first token it computes this step.
        pending = batch.pending_idx[rows]  # [num_reqs]
        has_pending = pending >= 0
        input_patch = None
        if has_pending.any():
            assert prev is not None and prev.sampled is not None
            input_patch = (
                torch.from_numpy(cu[:-1][has_pending]).to(dev, non_blocking=True),
                torch.from_numpy(pending[has_pending]).to(dev, non_blocking=True),
                prev.sampled,
            )
        self._lora_mapping(rows, num_sched)
        max_query_len = int(num_sched.max())
        is_pure_decode = max_query_len == 1
        # Chunks over image placeholders: this step runs eagerly on input embeddings (worker/mm_inputs.py).
        mm_spans = (
            self.encoder_runner.step_spans(req_ids, num_computed, num_sched, cu)
            if self.encoder_runner is not None
            else None
        )
        eager_mm = bool(mm_spans) or mrope_3d is not None
        if (
            not eager_mm
            and self.graph_runner is not None
            and self.graph_runner.can_run(n, num_tokens, max_query_len)
        ):
            hidden = self.graph_runner.run(
                input_ids, positions, slot_mapping, seq_lens, block_table, input_patch, cu, fix
            )
            if num_tokens > n:  # the multi-token graph (graph_runner.run): its static inputs hold this step's
                step.verify_graph_bs = self.graph_runner.padded_size(n, self.graph_runner.q)
                step.verify_table_width = max_blocks
        else:
            assert ahead is None, "a launch ahead runs the verification graph (EngineCore._plan_ahead)"
            size = None if self.piecewise is None or eager_mm else self.piecewise.padded_size(num_tokens)
            qsl_cpu = torch.from_numpy(cu.astype(np.int32))
            seq_lens_cpu = torch.from_numpy(seq_lens)
            tables = torch.from_numpy(np.ascontiguousarray(block_table)).to(dev, non_blocking=True)
            if size is None:
                input_ids_dev = torch.from_numpy(input_ids).to(dev, non_blocking=True)
                positions_dev = torch.from_numpy(positions).to(dev, non_blocking=True)
                slots = torch.from_numpy(slot_mapping).to(dev, non_blocking=True)
            else:  # the piecewise graphs' static inputs, padded to `size` rows
                staged = self.piecewise.stage(input_ids, positions, slot_mapping, size)
                input_ids_dev, positions_dev, slots = staged
            meta = AttentionMetadata(
                num_reqs=n,
                num_tokens=num_tokens,
                max_query_len=max_query_len,
                max_seq_len=int(seq_lens.max()),
                query_start_loc=qsl_cpu.to(dev, non_blocking=True),
                seq_lens=seq_lens_cpu.to(dev, non_blocking=True),
                block_table=tables[0],
                slot_mapping=slots[0],
                query_start_loc_cpu=qsl_cpu,
                seq_lens_cpu=seq_lens_cpu,
                is_pure_decode=is_pure_decode,
                kv_group_tables=tuple(zip(tables[1:], slots[1:])),
                bidirectional_spans=self.encoder_runner.bidirectional_spans(mm_spans, cu) if mm_spans else (),
            )
            if input_patch is not None:
                dst, src, values = input_patch
                input_ids_dev[dst] = values[src]
            if size is not None:
                hidden = slice_rows(self.piecewise.replay(size, meta), num_tokens)
            elif eager_mm:
                # [num_tokens, hidden_size] with image rows, or None (text tokens of an M-RoPE prompt)
                embeds = self.encoder_runner.inputs_embeds(input_ids_dev, mm_spans) if mm_spans else None
                if mrope_3d is not None:
                    positions_dev = torch.from_numpy(mrope_3d).to(dev, non_blocking=True)  # [3, num_tokens]
                hidden = self.model(input_ids_dev, positions_dev, self.kv_caches, meta, inputs_embeds=embeds)
            else:
                # [num_tokens, hidden_size], or (that, aux hidden states) for an EAGLE-3 draft; None on a pipeline
                # stage before the last
                hidden = self._forward(input_ids_dev, positions_dev, self.kv_caches, meta)
        if self.kv_connector is not None:
            step.kv_connector_output = self.kv_connector.end_step(sched.finished_req_ids)
        if isinstance(hidden, tuple):
            hidden, step.draft_hidden = hidden
        elif self.keep_hidden:
            step.draft_hidden = hidden  # an EAGLE or Medusa draft reads the target's final hidden states

        step.req_ids = req_ids
        step.query_start = cu  # [num_reqs + 1] flattened offsets of each request's tokens
        if hidden is not None:  # None: a pipeline stage before the last computes no logits
            self._prompt_logprobs(req_ids, rows, num_computed, num_sched, cu, hidden, step.prompt_logprobs)
        # Which requests reach the end of their known tokens (and so produce one).
        if ahead is not None:  # every request verifies (the host has not counted the previous step's tokens yet)
            sample_idx = np.arange(n)
        else:
            sample_idx = np.nonzero((num_computed + num_sched - num_draft) == batch.num_tokens_np[rows])[0]
        if len(sample_idx) == 0:  # [num_sampled]
            return step
        if spec:
            # Logits at the last token and at each draft: [sum(num_draft + 1), vocab_size], request by request.
            counts = num_draft[sample_idx] + 1  # [num_sampled]
            first = np.repeat(cu[1:][sample_idx] - counts, counts)  # [num_logits] its request's first row
            offset = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
            if hidden is not None:  # (a pipeline stage before the last only keeps the bookkeeping)
                logit_idx = torch.from_numpy(first + offset).to(dev, non_blocking=True)
                step.logits = self.model.compute_logits(hidden[logit_idx])
            step.spec_num_draft = num_draft[sample_idx]
            k = int(step.spec_num_draft.max())
            step.spec_draft_ids = np.zeros((len(sample_idx), k), dtype=np.int64)  # [num_sampled, k]
            if fix is not None:
                step.spec_draft_dev = fix.drafts  # (the host's stay zeros: no grammar reads them here)
            else:
                for j, i in enumerate(sample_idx.tolist()):
                    d = int(num_draft[i])
                    if d:
                        step.spec_draft_ids[j, :d] = spec[req_ids[i]]
        elif hidden is not None:
            last_token = torch.from_numpy(cu[1:][sample_idx] - 1).to(dev, non_blocking=True)
            step.logits = self.model.compute_logits(hidden[last_token])  # [num_sampled, vocab_size]
        step.sample_req_ids = np.array(req_ids, dtype=object)[sample_idx].tolist()
        step.sample_rows = rows[sample_idx]  # [num_sampled]
        return step

    def _forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        communicate: bool = True,
    ) -> Any:
        """The model's forward; under pipeline parallelism this stage's part (``run_stage``: activations from the
        previous stage, to the next one), which is None before the last stage."""
        if self.pp is None:
            return self.model(input_ids, positions, kv_caches, meta)
        from pagedllm.distributed.pipeline import run_stage

        hidden_size = self.config.model_config.hf_config.hidden_size
        args = (input_ids, positions, kv_caches, meta, hidden_size, self.dtype, communicate)
        return run_stage(self.model, self.pp, *args)

    @torch.inference_mode()
    def sample(self, step: StepInFlight, grammar_bitmask: torch.Tensor | None = None) -> None:
        """Sample ``step``'s rows. ``grammar_bitmask``: [num_sampled, ceil(vocab_size / 32)] int32 on the host,
        bit j of word w of row i set when token 32 * w + j is allowed for ``step.sample_req_ids[i]``."""
        if step.logits is None:
            return
        if step.spec_num_draft is not None:
            tokens, num_accepted, logprobs = sample_spec(
                step, grammar_bitmask, self.input_batch, self.sampler, self._sampling_metadata, self.device
            )
            self._hold_sampled(step, tokens, logprobs, num_accepted)
            if self.after_spec_sample is not None:
                self.after_spec_sample(step, tokens, num_accepted)
            return
        dev = self.device
        s_rows = step.sample_rows
        meta = self._sampling_metadata(s_rows)
        if grammar_bitmask is not None:
            meta.grammar_bitmask = grammar_bitmask.to(dev, non_blocking=True)
        sampled = self.sampler(step.logits, meta)
        step.logits = None
        self._mark_placeholders(step)
        self._hold_sampled(step, sampled.sampled_token_ids, sampled.logprobs)

    def _mark_placeholders(self, step: StepInFlight) -> None:
        """The step's sampled tokens become placeholders at the end of their rows until ``collect`` reads them."""
        batch = self.input_batch
        s_rows = step.sample_rows
        step.sample_pos = batch.num_tokens_np[s_rows].copy()
        step.sample_gen = batch.row_gen[s_rows].copy()
        step.sample_num_logprobs = batch.num_logprobs_np[s_rows].copy()
        batch.token_ids_np[s_rows, step.sample_pos] = 0
        batch.num_tokens_np[s_rows] += 1
        batch.pending_idx[s_rows] = np.arange(len(s_rows))
        batch.pending_step[s_rows] = step.step_id

    def _hold_sampled(
        self,
        step: StepInFlight,
        sampled: torch.Tensor,
        logprobs: LogprobsTensors | None = None,
        num_accepted: torch.Tensor | None = None,
    ) -> None:
        """Keep ``sampled`` ([num_sampled] int64 on the device; [num_sampled, k + 1] after a verification step,
        with ``num_accepted`` [num_sampled]) for the next launch and start their copies to the host, which
        ``collect`` waits for."""
        step.sampled = sampled
        step.logprobs = logprobs
        step.spec_num_accepted = step.spec_accepted_dev = num_accepted
        if self.device.type == "cuda":
            step.sampled_host = torch.empty(sampled.shape, dtype=torch.long, pin_memory=True)
            step.sampled_host.copy_(sampled, non_blocking=True)
            if num_accepted is not None:
                step.spec_num_accepted = torch.empty(num_accepted.shape, dtype=torch.long, pin_memory=True)
                step.spec_num_accepted.copy_(num_accepted, non_blocking=True)
            if step.logprobs is not None:
                step.logprobs = step.logprobs.to_host_async()
            step.event = torch.cuda.Event()
            step.event.record()
        else:
            step.sampled_host = sampled

    def skip_sample(self, step: StepInFlight) -> int:
        """A tensor-parallel worker's ``sample`` under async scheduling (rank 0 samples): drop the logits and mark
        the placeholders ``sample`` would. Returns how many tokens rank 0 samples for this step; they arrive
        through ``receive_sampled`` before the next launch (pagedllm/distributed/executor.py)."""
        if step.logits is None:
            return 0
        step.logits = None
        self._mark_placeholders(step)
        return len(step.sample_rows)

    def receive_sampled(self, step: StepInFlight, sampled: torch.Tensor) -> None:
        """The tokens rank 0 sampled for ``step`` ([num_sampled] int64, on this rank's device): the next launch
        feeds them on the device, ``collect`` writes them into the batch."""
        self._hold_sampled(step, sampled)

    def apply_sampled(self, sampled: dict[str, list[int]]) -> None:
        """A tensor-parallel worker's stand-in for ``sample`` + ``collect``: append the tokens rank 0 sampled.
        After a speculative step those are each request's emitted tokens (accepted drafts plus one), as
        ``collect_spec`` appends them on rank 0; rejected drafts stay past the row's known tokens, unused."""
        batch = self.input_batch
        for req_id, tokens in sampled.items():
            row = batch.req_id_to_row.get(req_id)
            if row is not None:
                end = int(batch.num_tokens_np[row])
                batch.token_ids_np[row, end : end + len(tokens)] = tokens
                batch.num_tokens_np[row] = end + len(tokens)

    def _sampling_metadata(self, s_rows: np.ndarray):
        batch = self.input_batch
        gen_idx = np.nonzero(batch.has_generator_np[s_rows])[0]
        if batch.num_complex_rows == 0:
            return build_plain_sampling_metadata(
                greedy=batch.greedy_np[s_rows],
                temperature=batch.temperature_np[s_rows],
                top_k=batch.top_k_np[s_rows],
                top_p=batch.top_p_np[s_rows],
                min_p=batch.min_p_np[s_rows],
                num_logprobs=batch.num_logprobs_np[s_rows],
                generators={int(j): batch.generators[s_rows[j]] for j in gen_idx},
                vocab_size=self.vocab_size,
                device=self.device,
            )
        rows = s_rows.tolist()
        params = [batch.params[r] for r in rows]
        history = batch.num_history_rows > 0  # then every placeholder was resolved before this step
        return build_sampling_metadata(
            params=params,
            output_token_ids=[batch.output_token_ids(r) if history else [] for r in rows],
            prompt_token_ids=[
                batch.prompt_token_ids(r) if p.repetition_penalty != 1.0 else [] for r, p in zip(rows, params)
            ],
            generators=[batch.generators[r] for r in rows],
            eos_token_ids=[batch.eos_token_ids[r] for r in rows],
            vocab_size=self.vocab_size,
            device=self.device,
        )

    def collect(self, step: StepInFlight) -> ModelRunnerOutput:
        """Wait for ``step``'s sampled ids, write them into the batch, return them per request (idempotent)."""
        if step.output is not None:
            return step.output
        out = ModelRunnerOutput(sampled_token_ids={r: [] for r in step.req_ids})
        out.prompt_logprobs = step.prompt_logprobs
        out.kv_connector_output = step.kv_connector_output
        step.output = out
        if step.sampled_host is None:
            return out
        if step.event is not None:
            step.event.synchronize()
        if step.spec_num_draft is not None:
            collect_spec(step, out, self.input_batch)
            step.sampled = None
            return out
        token_np = step.sampled_host.numpy()  # [num_sampled]
        token_ids = token_np.tolist()
        out.sampled_token_ids.update(zip(step.sample_req_ids, [[t] for t in token_ids]))
        batch = self.input_batch
        rows = step.sample_rows
        live = batch.row_gen[rows] == step.sample_gen  # rows still owned by the same request
        if live.any():
            rows, pos = rows[live], step.sample_pos[live]
            batch.token_ids_np[rows, pos] = token_np[live]
            rows = rows[batch.pending_step[rows] == step.step_id]
            batch.pending_idx[rows] = -1
        if step.logprobs is not None:
            lp = step.logprobs.tolists()
            for j in np.nonzero(step.sample_num_logprobs >= 0)[0].tolist():
                k = int(step.sample_num_logprobs[j])
                out.logprobs[step.sample_req_ids[j]] = LogprobsLists(
                    [lp.token_ids[j][: k + 1]], [lp.logprobs[j][: k + 1]], [lp.ranks[j]]
                )
        step.sampled = None  # the device copy is no longer needed
        return out

    def _prompt_logprobs(
        self, req_ids, rows, num_computed, num_sched, cu, hidden, out: dict[str, LogprobsLists]
    ) -> None:
        """Logprobs of prompt tokens 1.. covered by this chunk: logits at position p score token p+1."""
        batch = self.input_batch
        if batch.num_prompt_logprob_rows == 0:
            return
        for i, row in enumerate(rows.tolist()):
            params = batch.params[row]
            if params.prompt_logprobs is None:
                continue
            start = int(num_computed[i])
            end = min(
                start + int(num_sched[i]), batch.num_prompt_tokens[row] - 1
            )  # last position scoring a prompt token
            if end <= start:
                continue
            idx = torch.arange(int(cu[i]), int(cu[i]) + end - start, device=self.device)
            targets = torch.from_numpy(batch.token_ids_np[row, start + 1 : end + 1].copy()).to(self.device)
            lp = compute_logprobs_topk(
                self.model.compute_logits(hidden[idx]), targets, params.prompt_logprobs
            )
            out[req_ids[i]] = lp.tolists()
