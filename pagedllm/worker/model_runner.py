"""Model runner: update the persistent batch -> prepare inputs -> forward -> sample.

A thin orchestrator; feature logic lives in InputBatch, the attention backend, the model and the sampler.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from pagedllm.attention.base import AttentionMetadata, get_attention_backend
from pagedllm.config import EngineConfig
from pagedllm.core.sched_output import LogprobsLists, ModelRunnerOutput, SchedulerOutput
from pagedllm.sample.metadata import build_sampling_metadata
from pagedllm.sample.sampler import Sampler, compute_logprobs_topk
from pagedllm.worker.cuda_graphs import CudaGraphRunner
from pagedllm.worker.input_batch import InputBatch

logger = logging.getLogger(__name__)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        from pagedllm.model_loader import get_model

        self.config = config
        mc = config.model_config
        self.device = config.device_config.device
        self.dtype = mc.dtype
        self.block_size = config.cache_config.block_size
        self.max_model_len = mc.max_model_len
        self.max_num_reqs = config.scheduler_config.max_num_seqs
        self.max_num_tokens = config.scheduler_config.max_num_batched_tokens
        self.vocab_size = mc.vocab_size
        self.attn_backend = get_attention_backend(self.device, config.attention_backend)
        torch.manual_seed(mc.seed)
        t0 = time.perf_counter()
        self.model = get_model(mc, self.device, self.attn_backend)
        logger.info(
            "loaded %s in %.2fs (%s, %s)", mc.model, time.perf_counter() - t0, self.dtype, self.device
        )
        self.sampler = Sampler()
        self.max_blocks_per_req = _cdiv(self.max_model_len, self.block_size)
        self.input_batch = InputBatch(
            self.max_num_reqs, self.max_model_len, self.max_blocks_per_req, self.device
        )
        self.kv_caches: list[torch.Tensor] = []
        self.num_blocks = 0
        self.graph_runner: CudaGraphRunner | None = None

    # ------------------------------------------------------------------ KV cache sizing

    def kv_block_bytes(self) -> int:
        mc = self.config.model_config
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * mc.num_layers * self.block_size * mc.num_kv_heads * mc.head_dim * elem

    def determine_num_blocks(self) -> int:
        """Blocks that fit the memory budget: by hand (override / bytes), or profiled on CUDA, or a CPU default."""
        cc = self.config.cache_config
        block_bytes = self.kv_block_bytes()
        if cc.num_gpu_blocks_override is not None:
            return cc.num_gpu_blocks_override
        if cc.kv_cache_memory_bytes is not None:
            return cc.kv_cache_memory_bytes // block_bytes
        if self.device.type == "cuda":
            return self._profile_cuda_num_blocks(block_bytes)
        # CPU: a fixed byte budget, but no more than every sequence slot at full length could use.
        by_bytes = cc.cpu_kv_cache_bytes_default // block_bytes
        return max(1, min(by_bytes, self.max_num_reqs * self.max_blocks_per_req))

    @torch.inference_mode()
    def _profile_cuda_num_blocks(self, block_bytes: int) -> int:
        """Run the largest step the scheduler may send, measure peak memory, give the rest to the KV cache."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        free_before, total = torch.cuda.mem_get_info(self.device)
        num_tokens = self.max_num_tokens
        mc = self.config.model_config
        n_blocks = _cdiv(num_tokens, self.block_size)
        caches = [
            torch.empty(
                2,
                n_blocks,
                self.block_size,
                mc.num_kv_heads,
                mc.head_dim,
                dtype=self.dtype,
                device=self.device,
            )
            for _ in range(mc.num_layers)
        ]
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(num_tokens, device=self.device) % self.max_model_len
        seq_len = min(num_tokens, self.max_model_len)
        num_reqs = _cdiv(num_tokens, seq_len)
        q_lens = [seq_len] * (num_reqs - 1) + [num_tokens - seq_len * (num_reqs - 1)]
        qsl = torch.tensor([0, *np.cumsum(q_lens).tolist()], dtype=torch.int32)
        seq_lens = torch.tensor(q_lens, dtype=torch.int32)
        block_table = torch.arange(n_blocks, dtype=torch.int32).repeat(num_reqs, 1) % n_blocks
        meta = AttentionMetadata(
            num_reqs=num_reqs,
            num_tokens=num_tokens,
            max_query_len=max(q_lens),
            max_seq_len=max(q_lens),
            query_start_loc=qsl.to(self.device),
            seq_lens=seq_lens.to(self.device),
            block_table=block_table.to(self.device),
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.long, device=self.device),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
        )
        hidden = self.model(input_ids, positions, caches, meta)
        n_logits = min(self.max_num_reqs, num_tokens)
        logits = self.model.compute_logits(hidden[:n_logits])
        # Sampling with top-p sorts the whole vocabulary: include its working memory.
        probs = logits.softmax(-1).sort(dim=-1)
        del hidden, logits, probs, caches
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        weights_and_cache_scratch = n_blocks * block_bytes
        # Memory others (and the CUDA context) hold is outside torch's counters: count it as used.
        non_torch = total - free_before - torch.cuda.memory_allocated(self.device)
        budget = total * self.config.cache_config.gpu_memory_utilization
        available = budget - peak - max(non_torch, 0) + weights_and_cache_scratch
        # Headroom for CUDA graphs and allocator fragmentation.
        available -= 512 * 1024**2
        torch.cuda.empty_cache()
        logger.info(
            "memory profile: peak %.2f GiB, non-torch %.2f GiB, budget %.2f GiB, KV cache %.2f GiB",
            peak / 2**30,
            non_torch / 2**30,
            budget / 2**30,
            max(available, 0) / 2**30,
        )
        return int(max(available, 0) // block_bytes)

    def init_kv_cache(self, num_blocks: int) -> None:
        mc = self.config.model_config
        shape = (2, num_blocks, self.block_size, mc.num_kv_heads, mc.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(mc.num_layers)
        ]
        self.num_blocks = num_blocks

    def maybe_capture_cuda_graphs(self) -> None:
        """Capture decode graphs unless eager mode was asked for or the backend cannot be captured."""
        if self.config.enforce_eager or self.device.type != "cuda" or self.attn_backend.name != "triton":
            return
        self.graph_runner = CudaGraphRunner(
            self.model,
            self.kv_caches,
            self.max_num_reqs,
            self.max_blocks_per_req,
            self.max_model_len,
            self.device,
        )
        self.graph_runner.capture()

    # ------------------------------------------------------------------ one step

    def _update_batch(self, sched: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in sched.finished_req_ids:
            batch.remove(req_id, keep_generator=req_id in sched.preempted_req_ids)
        for data in sched.scheduled_new_reqs:
            batch.add(data)
        for data in sched.scheduled_cached_reqs:
            batch.update(data)

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._update_batch(sched)
        if sched.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(sampled_token_ids={})
        batch = self.input_batch
        req_ids = list(sched.num_scheduled_tokens)
        rows = np.fromiter((batch.req_id_to_row[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        num_sched = np.fromiter(sched.num_scheduled_tokens.values(), dtype=np.int64, count=len(req_ids))
        computed_by_id = {d.req_id: d.num_computed_tokens for d in sched.scheduled_new_reqs}
        computed_by_id.update({d.req_id: d.num_computed_tokens for d in sched.scheduled_cached_reqs})
        # [num_reqs] tokens computed before this step
        num_computed = np.fromiter((computed_by_id[r] for r in req_ids), dtype=np.int64, count=len(req_ids))

        # Flattened tokens:  token t belongs to request req_of[t], at position positions[t].
        num_tokens = int(num_sched.sum())
        cu = np.zeros(len(req_ids) + 1, dtype=np.int64)
        np.cumsum(num_sched, out=cu[1:])
        req_of = np.repeat(np.arange(len(req_ids)), num_sched)  # [num_tokens]
        positions = np.arange(num_tokens) - cu[req_of] + num_computed[req_of]  # [num_tokens]
        token_rows = rows[req_of]  # [num_tokens]
        input_ids = batch.token_ids_np[token_rows, positions]  # [num_tokens]
        block_ids = batch.block_table_np[token_rows, positions // self.block_size]  # [num_tokens]
        slot_mapping = block_ids.astype(np.int64) * self.block_size + positions % self.block_size
        seq_lens = (num_computed + num_sched).astype(np.int32)  # [num_reqs]
        max_blocks = _cdiv(int(seq_lens.max()), self.block_size)
        block_table = batch.block_table_np[rows, :max_blocks]  # [num_reqs, max_blocks]

        dev = self.device
        is_pure_decode = bool((num_sched == 1).all())
        if self.graph_runner is not None and is_pure_decode and len(req_ids) <= self.graph_runner.max_bs:
            hidden = self.graph_runner.run(input_ids, positions, slot_mapping, seq_lens, block_table)
        else:
            qsl_cpu = torch.from_numpy(cu.astype(np.int32))
            seq_lens_cpu = torch.from_numpy(seq_lens)
            meta = AttentionMetadata(
                num_reqs=len(req_ids),
                num_tokens=num_tokens,
                max_query_len=int(num_sched.max()),
                max_seq_len=int(seq_lens.max()),
                query_start_loc=qsl_cpu.to(dev, non_blocking=True),
                seq_lens=seq_lens_cpu.to(dev, non_blocking=True),
                block_table=torch.from_numpy(np.ascontiguousarray(block_table)).to(dev, non_blocking=True),
                slot_mapping=torch.from_numpy(slot_mapping).to(dev, non_blocking=True),
                query_start_loc_cpu=qsl_cpu,
                seq_lens_cpu=seq_lens_cpu,
                is_pure_decode=is_pure_decode,
            )
            hidden = self.model(
                torch.from_numpy(input_ids).to(dev, non_blocking=True),
                torch.from_numpy(positions).to(dev, non_blocking=True),
                self.kv_caches,
                meta,
            )  # [num_tokens, hidden_size]

        # Which requests reach the end of their known tokens (and so produce one).
        sample_mask = (num_computed + num_sched) == batch.num_tokens_np[rows]  # [num_reqs]
        sample_idx = np.nonzero(sample_mask)[0]
        out = ModelRunnerOutput(sampled_token_ids={r: [] for r in req_ids})
        self._prompt_logprobs(req_ids, rows, num_computed, num_sched, cu, hidden, out)
        if len(sample_idx) == 0:
            return out
        last_token = torch.from_numpy(cu[1:][sample_idx] - 1).to(dev, non_blocking=True)
        logits = self.model.compute_logits(hidden[last_token])  # [num_sampled, vocab_size]
        sample_rows = rows[sample_idx].tolist()
        meta_s = build_sampling_metadata(
            params=[batch.params[r] for r in sample_rows],
            output_token_ids=[batch.output_token_ids[r] for r in sample_rows],
            prompt_token_ids=[batch.prompt_token_ids(r) for r in sample_rows]
            if any(batch.params[r].repetition_penalty != 1.0 for r in sample_rows)
            else [[] for _ in sample_rows],
            generators=[batch.generators[r] for r in sample_rows],
            eos_token_ids=[batch.eos_token_ids[r] for r in sample_rows],
            vocab_size=self.vocab_size,
            device=dev,
        )
        sampled = self.sampler(logits, meta_s)
        token_ids = sampled.sampled_token_ids.tolist()  # the one host sync per step
        lp = sampled.logprobs.tolists() if sampled.logprobs is not None else None
        for j, (i, row) in enumerate(zip(sample_idx.tolist(), sample_rows)):
            req_id = req_ids[i]
            batch.append_token(row, token_ids[j])
            out.sampled_token_ids[req_id] = [token_ids[j]]
            k = batch.params[row].logprobs
            if lp is not None and k is not None:
                out.logprobs[req_id] = LogprobsLists(
                    [lp.token_ids[j][: k + 1]], [lp.logprobs[j][: k + 1]], [lp.ranks[j]]
                )
        return out

    def _prompt_logprobs(
        self, req_ids, rows, num_computed, num_sched, cu, hidden, out: ModelRunnerOutput
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
            out.prompt_logprobs[req_ids[i]] = lp.tolists()
