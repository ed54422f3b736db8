"""Medusa proposer (``method="medusa"``): the heads of ``pagedllm/models/medusa.py`` over the target's hidden
states.

After every target step, for each request that may speculate and whose last computed, kept position p is the one
that produced its newest token (p = num_tokens - 2), head i reads the target's final hidden state at p and its
argmax is draft i + 1 (the token at num_tokens + i). The heads keep no KV cache and need no catch-up pass: only
that one row of each request is read. The target's steps hand over their hidden states (views of its CUDA graphs'
static outputs when they replay graphs), and the heads' one pass a step replays CUDA graphs by padded batch size
where the target has graphs (head_graphs.RowGraphs); the drafts are deterministic, so the rejection sampler keeps
the output exact.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.spec_decode.head_graphs import RowGraphs, log_speculation_graphs
from pagedllm.spec_decode.proposer import DeviceDrafts, can_speculate, kept_positions, num_drafts_allowed


class MedusaProposer:
    reads_every_step = False  # only the last step's hidden state of a request that drafts

    def __init__(self, config: EngineConfig, runner: Any) -> None:
        from pagedllm.model_loader import (
            _default_dtype,
            init_dummy_weights,
            iter_safetensors,
            load_weights,
            process_weights_after_loading,
        )
        from pagedllm.models.medusa import MedusaConfig, MedusaHeads, medusa_weight_names

        spec = config.speculative_config
        mc = config.model_config
        self.k = spec.num_speculative_tokens
        self.runner = runner  # the target's (its CUDA graphs are logged at start-up)
        self.device = runner.device
        self.max_model_len = mc.max_model_len
        with open(os.path.join(spec.model, "config.json")) as f:
            head_config = MedusaConfig.from_dict(json.load(f), mc.hf_config.hidden_size, mc.vocab_size)
        if self.k > head_config.num_heads:
            raise ValueError(
                f"speculative_config.num_speculative_tokens ({self.k}) exceeds the Medusa heads' number "
                f"({head_config.num_heads})"
            )
        tensors = {} if mc.load_format == "dummy" else dict(iter_safetensors(spec.model))
        copy = head_config.original_lm_head and (mc.load_format == "dummy" or "lm_head.weight" in tensors)
        tp = getattr(runner, "tp_size", 1)
        # (Under TP the target's LM head is a vocabulary shard, under PP the last stage's.)
        if head_config.original_lm_head and not copy and (tp > 1 or getattr(runner, "pp", None) is not None):
            what = "tensor_parallel_size" if tp > 1 else "pipeline_parallel_size"
            raise ValueError(
                "speculative_config.model: Medusa heads that share the target's LM head need a copy of it "
                f"(lm_head.weight) under {what} > 1"
            )
        with _default_dtype(mc.dtype), torch.device(self.device):
            heads = MedusaHeads(head_config, with_lm_head_copy=copy)
        if mc.load_format == "dummy":
            init_dummy_weights(heads, mc.seed)
        else:
            load_weights(heads, medusa_weight_names(iter(tensors.items()), head_config.num_hidden_layers))
        process_weights_after_loading(heads)
        if head_config.original_lm_head and not copy:
            heads.target_lm_head = runner.model.compute_logits  # the target's own LM head (one process)
        self.heads = heads.eval()
        self.head_graphs: RowGraphs | None = None
        self.num_device_proposals = 0  # proposals queued on the device after a verification step
        self.device_drafts: DeviceDrafts | None = None  # where a proposal queued on the device comes back

    def kv_block_bytes(self) -> int:
        return 0

    def init_kv_cache(self, num_blocks: int, kv: KVCacheManager) -> None:
        self.capture_head_graphs()

    def capture_head_graphs(self) -> None:
        """CUDA graphs of the heads (all k of them, by padded batch size) where the target has decode graphs;
        then one log line of the graphs speculation uses."""
        runner = self.runner
        if getattr(runner, "graph_runner", None) is not None:
            from pagedllm.kernels import compile_watch

            self.head_graphs = RowGraphs(
                self._drafts,
                runner.config.model_config.hf_config.hidden_size,
                runner.dtype,
                runner.max_num_reqs,
                self.device,
            )
            with compile_watch.start_up():  # the warm-up's compiles are start-up's
                self.head_graphs.capture()
        self.graphs_summary = log_speculation_graphs("medusa", runner, heads=self.head_graphs)
        from pagedllm.worker.model_runner import ModelRunner

        if self.head_graphs is not None and type(runner) is ModelRunner:  # (not tensor-parallel workers)
            runner.after_spec_sample = self.draft_on_device

    @torch.inference_mode()
    def draft_on_device(self, step: Any, tokens: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """The runner's hook right after a verification step's sampling: when every request of the step sampled,
        queue the heads' pass over each request's last kept row (its first row plus its accepted drafts, known
        on the device) and the drafts' copy to the host, so that the next proposal waits for nothing more than
        the step itself. ``propose`` then only reads them back."""
        n = len(step.req_ids)
        bs = self.head_graphs.padded_size(n)
        if step.draft_hidden is None or len(step.sample_req_ids) != n or bs not in self.head_graphs.graphs:
            return
        first_rows = torch.from_numpy(step.query_start[:-1]).to(self.device, non_blocking=True)  # [n]
        drafts = self.head_graphs.run(step.draft_hidden[first_rows + num_accepted])  # [n, k]
        if self.device_drafts is None:
            self.device_drafts = DeviceDrafts(self.device, self.head_graphs.max_bs, self.k)
        self.device_drafts.queue(step, drafts)
        self.num_device_proposals += 1

    def _drafts(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, k]`` the k heads' drafts over ``hidden`` [n, H] (argmax)."""
        return self.heads(hidden, self.k).argmax(dim=-1).T

    @torch.inference_mode()
    def propose(
        self,
        requests: Sequence[Request],
        sched: SchedulerOutput | None = None,
        step: Any = None,
        result: ModelRunnerOutput | None = None,
    ) -> None:
        if sched is None or step is None or step.draft_hidden is None:
            return
        if step.device_drafts is not None:
            self.device_drafts.take(requests, step, self.max_model_len)
            return
        live = {r.request_id: r for r in requests}
        rows, chosen = [], []  # the hidden row of each request given drafts; (request, number of drafts)
        for i, req_id in enumerate(step.req_ids):
            request = live.get(req_id)
            if request is None or not can_speculate(request):
                continue
            start, count = kept_positions(req_id, sched, result)
            k = num_drafts_allowed(request, self.k, self.max_model_len)
            if count <= 0 or start + count != request.num_tokens - 1 or k <= 0:
                continue
            rows.append(int(step.query_start[i]) + count - 1)
            chosen.append((request, k))
        if not chosen:
            return
        # (a blocking copy would wait for the device: the proposal's one wait is reading the drafts back)
        rows_dev = torch.from_numpy(np.array(rows, dtype=np.int64)).to(self.device, non_blocking=True)
        hidden = step.draft_hidden[rows_dev]  # [m, H]
        graphed = None if self.head_graphs is None else self.head_graphs.run(hidden)  # [m, k]
        if graphed is not None:
            drafts = graphed.tolist()
        else:
            num_heads = max(k for _, k in chosen)
            drafts = self.heads(hidden, num_heads).argmax(dim=-1).T.tolist()  # [m][num_heads]
        for (request, k), d in zip(chosen, drafts):
            request.spec_token_ids = d[:k]
