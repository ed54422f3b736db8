"""Draft-model proposer (vLLM's ``{"model": DRAFT_DIR, "num_speculative_tokens": k}``).

A smaller model sharing the target's tokenizer runs greedily ``k`` times per engine step in its own
``ModelRunner`` (so its decode steps replay CUDA graphs like the target's). Its KV cache has exactly the target's
blocks: request r's draft KV for position p lives in the same block id and slot as its target KV, so the draft
needs no allocator of its own. The scheduler reserves ``k`` lookahead slots past each decoding request
(``SchedulerConfig.num_lookahead_tokens``) for the drafts' KV.

Per request the proposer tracks how far its draft KV is valid::

    target tokens:   t0 .. t(T-1)                          (T = request.num_tokens after the last step)
    draft row:       t0 .. t(v-1) | d1 .. dk                (its last drafts; v = tokens verified last time)
    draft computed:  positions < c hold draft KV of the row's tokens

After a step the target kept some drafts: the row's tokens from the first position where they differ from the
target's are replaced, and ``c`` drops to that position. Then one catch-up pass computes positions ``c .. T-1``
(sampling draft 1 from the last) and ``k - 1`` single-token passes sample drafts 2..k. Drafts are argmax picks
(deterministic), so the rejection sampler treats them as one-hot proposals and the output stays exact whatever
the draft KV holds: a wrong draft KV (a prefix-cache block the draft never wrote) only costs acceptance.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from pagedllm.config import EngineConfig, ModelConfig, ParallelConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.proposer import block_table, can_speculate, num_drafts_allowed
from pagedllm.worker.graph_io import final_hidden

logger = logging.getLogger(__name__)

_GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 30, ignore_eos=True, detokenize=False)


@dataclass
class _DraftState:
    num_computed: int  # positions whose draft KV matches the draft row's tokens
    num_verified: int  # the draft row's tokens below this equal the target's
    num_blocks: int  # block ids the draft runner holds for the request


def draft_engine_config(config: EngineConfig) -> EngineConfig:
    """The draft model's config: the target's cache, scheduler and device settings, its own weights."""
    spec = config.speculative_config
    target = config.model_config
    draft_model = ModelConfig(
        model=spec.model,
        dtype=target.dtype,
        max_model_len=None,
        seed=target.seed,
        trust_remote_code=target.trust_remote_code,
        load_format=target.load_format,
    )
    if draft_model.max_model_len < target.max_model_len:
        raise ValueError(
            f"speculative_config.model: the draft's maximum context ({draft_model.max_model_len}) is shorter than "
            f"max_model_len ({target.max_model_len}); lower max_model_len"
        )
    draft_model.max_model_len = target.max_model_len
    # Under tensor parallelism the draft is not sharded: it runs whole in the engine core's process (rank 0). Its
    # cache follows the target's block ids, one list per request: one KV cache group, whatever its layers' windows.
    # cpu_offload_gb offloads the target's layers only: the draft stays whole on the device.
    return replace(
        config,
        model_config=draft_model,
        cache_config=replace(config.cache_config, disable_hybrid_kv_cache_manager=True),
        speculative_config=None,
        lora_config=None,
        parallel_config=ParallelConfig(),
        cpu_offload_gb=0,
    )


class DraftModelProposer:
    """Proposes ``num_speculative_tokens`` greedy drafts per decoding request with a draft model."""

    reads_every_step = False  # it catches up from the request's tokens whenever it drafts

    def __init__(self, config: EngineConfig, target_runner: Any = None) -> None:
        """``target_runner``: the target's runner (only to say, at start-up, which CUDA graphs speculation uses)."""
        from pagedllm.worker.model_runner import ModelRunner

        self.k = config.speculative_config.num_speculative_tokens
        self.max_model_len = config.model_config.max_model_len
        self.max_num_tokens = config.scheduler_config.max_num_batched_tokens
        self.runner = ModelRunner(draft_engine_config(config))
        self.kv: KVCacheManager | None = None  # the target's block tables (set by the engine core)
        self.states: dict[str, _DraftState] = {}
        self.step_graphs: Any = None  # DraftStepGraphs of steps 2..k (capture_head_graphs), where graphs run
        self.target_runner = target_runner
        self.graphs_summary = ""

    def kv_block_bytes(self) -> int:
        return self.runner.kv_block_bytes()

    def init_kv_cache(self, num_blocks: int, kv: KVCacheManager) -> None:
        """A draft cache of the target's ``num_blocks`` blocks, addressed by the target's block tables."""
        self.runner.init_kv_cache(num_blocks)
        # Catch-up passes compute the tokens the target kept (at most k + 1 a request): graphed like verification.
        self.runner.graph_query_len = self.k + 1
        # No piecewise graphs: the target's memory profile has no room for a second graph pool.
        self.runner.allow_piecewise = False
        self.runner.maybe_capture_cuda_graphs()
        self.kv = kv
        if self.runner.graph_runner is not None:
            self.capture_head_graphs()
        from pagedllm.spec_decode.head_graphs import log_speculation_graphs

        self.graphs_summary = log_speculation_graphs(
            "draft_model", self.target_runner, self.step_graphs, self.runner.graph_runner
        )

    def capture_head_graphs(self) -> None:
        """CUDA graphs of the draft model's steps 2..k, one per padded batch size, each planning its own step on
        the device (``head_graphs.DraftStepGraphs``): a proposal replays them back to back after the catch-up
        pass, feeding each the previous draft, and reads the drafts once."""
        from pagedllm.kernels import compile_watch
        from pagedllm.spec_decode.head_graphs import DraftStepGraphs

        runner = self.runner
        if self.k < 2 or runner.longrope is not None:  # (LongRoPE positions are rotary rows, made on the host)
            return
        self.step_graphs = DraftStepGraphs(
            self._draft_step,
            1,  # (no hidden state is carried from step to step)
            runner.dtype,
            runner.max_num_reqs,
            self.k - 1,
            runner.max_blocks_per_req,
            self.max_model_len,
            runner.device,
            runner.block_size,
        )
        with compile_watch.start_up():  # the warm-ups' compiles are start-up's
            self.step_graphs.capture()
        self._no_hidden = torch.zeros(self.step_graphs.max_bs, 1, dtype=runner.dtype, device=runner.device)

    def _draft_step(
        self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, meta: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step of the draft model over ``tokens`` [n] at ``positions``: the next drafts [n] (argmax)."""
        out = final_hidden(self.runner.model(tokens, positions, self.runner.kv_caches, meta))
        return hidden, self.runner.model.compute_logits(out).argmax(dim=-1)

    def propose(self, requests: Sequence[Request], *step_info: Any) -> None:
        budget = self.max_num_tokens
        chosen: list[tuple[Request, int]] = []  # (request, its number of drafts)
        partial: list[tuple[Request, int]] = []  # (request, tokens of its catch-up this step): no drafts yet
        for request in requests:
            if not can_speculate(request) or budget <= 0:
                continue
            num_tokens = request.num_tokens
            k = num_drafts_allowed(request, self.k, self.max_model_len)
            if k <= 0:
                continue
            state = self.states.get(request.request_id)
            catch_up = num_tokens - (state.num_computed if state else 0)
            if catch_up > budget:  # a long prompt: catch up a chunk now, draft at a later step
                partial.append((request, budget))
                budget = 0
                continue
            budget -= catch_up
            chosen.append((request, k))
        keep = {r.request_id for r, _ in chosen + partial}
        finished = {req_id for req_id in self.states if req_id not in keep}
        for req_id in finished:
            del self.states[req_id]
        if not chosen and not partial:
            if finished:
                self.runner.launch(self._sched_output([], [], {}, {}, finished))
            return
        new, cached, num_sched, num_computed = [], [], {}, {}
        for request, _ in chosen:
            self._sync(request, new, cached, num_sched, num_computed)
        for request, chunk in partial:
            self._sync(request, new, cached, num_sched, num_computed)
            num_sched[request.request_id] = chunk
        batch_tokens = self.runner.input_batch
        # The catch-up pass and steps 2..k are launched back to back, each feeding the next its sampled drafts on
        # the device (the runner's pending tokens, as under async scheduling); the host reads them all once.
        steps = [self._launch(self._sched_output(new, cached, num_sched, num_computed, finished))]
        for request, chunk in partial:
            state = self.states[request.request_id]
            state.num_computed += chunk
            state.num_verified = request.num_tokens
        graphs = self.step_graphs
        if chosen and graphs is not None and graphs.padded_size(len(chosen)) in graphs.graphs:
            self._chain(chosen, steps[0])
        elif chosen:
            # Steps 2..k: one token per request that still wants drafts.
            for j in range(1, max(k for _, k in chosen)):
                step_reqs = [(r, k) for r, k in chosen if k > j]
                num_sched = {r.request_id: 1 for r, _ in step_reqs}
                num_computed = {r.request_id: r.num_tokens + j - 1 for r, _ in step_reqs}
                steps.append(self._launch(self._sched_output([], [], num_sched, num_computed, set())))
        for step in steps:
            self.runner.collect(step)
        for request, k in chosen:
            row = batch_tokens.req_id_to_row[request.request_id]
            num_tokens = request.num_tokens
            request.spec_token_ids = batch_tokens.token_ids_np[row, num_tokens : num_tokens + k].tolist()
            state = self.states[request.request_id]
            state.num_computed = num_tokens + k - 1
            state.num_verified = num_tokens

    @torch.inference_mode()
    def _chain(self, chosen: list[tuple[Request, int]], catch_up: Any) -> None:
        """Drafts 2..k of ``chosen`` through the step graphs, fed draft 1 from the catch-up step ``catch_up``
        (still on the device); then every draft into the draft runner's batch rows and the requests."""
        m = len(chosen)
        where = {req_id: j for j, req_id in enumerate(catch_up.sample_req_ids)}
        rows = torch.from_numpy(np.fromiter((where[r.request_id] for r, _ in chosen), np.int64, count=m))
        first = catch_up.sampled[rows.to(self.runner.device, non_blocking=True)]  # [m] draft 1
        ks = np.fromiter((k for _, k in chosen), np.int64, count=m)  # [m]
        last_pos = np.fromiter((r.num_tokens for r, _ in chosen), np.int64, count=m)  # draft 1's position
        num_blocks = -(-int((last_pos + ks).max()) // self.runner.block_size)
        table = block_table(self.kv, [r.request_id for r, _ in chosen], num_blocks)
        rest = torch.empty(m, int(ks.max()) - 1, dtype=torch.long, device=self.runner.device)  # [m, k - 1]
        self.step_graphs.run(last_pos, ks, table, first, self._no_hidden[:m], rest)
        self.runner.collect(catch_up)  # draft 1 into the batch rows
        batch = self.runner.input_batch
        for (request, k), more in zip(chosen, rest.tolist()):  # (the proposal's one read of drafts 2..k)
            row = batch.req_id_to_row[request.request_id]
            end = request.num_tokens + 1
            batch.token_ids_np[row, end : end + k - 1] = more[: k - 1]
            batch.num_tokens_np[row] = end + k - 1

    def _sync(
        self,
        request: Request,
        new: list[NewRequestData],
        cached: list[CachedRequestData],
        num_sched: dict[str, int],
        num_computed: dict[str, int],
    ) -> None:
        """Bring the draft row up to the target's tokens; schedule the catch-up pass from the first stale
        position."""
        req_id = request.request_id
        num_tokens = request.num_tokens
        block_ids = self.kv.get_block_ids(req_id)
        state = self.states.get(req_id)
        if state is None:
            new.append(
                NewRequestData(
                    req_id=req_id,
                    token_ids=np.asarray(request.all_token_ids).tolist(),
                    num_prompt_tokens=request.num_prompt_tokens,
                    sampling_params=_GREEDY,
                    block_ids=(block_ids,),
                    num_computed_tokens=0,
                )
            )
            state = self.states[req_id] = _DraftState(0, num_tokens, len(block_ids))
        else:
            batch = self.runner.input_batch
            row = batch.req_id_to_row[req_id]
            start = state.num_verified
            end = min(int(batch.num_tokens_np[row]), num_tokens)
            truth = np.asarray(request.all_token_ids[start:end])
            differ = np.nonzero(batch.token_ids_np[row, start:end] != truth)[0]
            first_stale = start + int(differ[0]) if len(differ) else end
            state.num_computed = min(state.num_computed, first_stale)
            batch.set_token_ids(req_id, first_stale, request.all_token_ids[first_stale:])
            if len(block_ids) > state.num_blocks:
                cached.append(CachedRequestData(req_id, (block_ids[state.num_blocks :],), state.num_computed))
                state.num_blocks = len(block_ids)
        num_sched[req_id] = num_tokens - state.num_computed
        num_computed[req_id] = state.num_computed

    def _launch(self, sched: SchedulerOutput) -> Any:
        """One pass of the draft model, sampled on the device (read by ``collect``)."""
        step = self.runner.launch(sched)
        self.runner.sample(step)
        return step

    @staticmethod
    def _sched_output(
        new: list[NewRequestData],
        cached: list[CachedRequestData],
        num_sched: dict[str, int],
        num_computed: dict[str, int],
        finished: set[str],
    ) -> SchedulerOutput:
        return SchedulerOutput(
            scheduled_new_reqs=new,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_sched,
            total_num_scheduled_tokens=sum(num_sched.values()),
            finished_req_ids=finished,
            num_computed_tokens=num_computed,
        )
