"""EAGLE / EAGLE-3 proposer: a one-layer head over the target's hidden states (``pagedllm/models/eagle.py``).

After every target step the head runs over what the target just computed and kept (prefill chunks included,
rejected drafts excluded), so its own one-layer KV cache follows the target's tokens: for each kept position p it
reads the token at p + 1 and the target's hidden state at p. The head's KV cache has the target's blocks (the
same block ids and slots, like the draft model's), with the scheduler's ``k`` lookahead slots for the drafts.
For each request that may speculate, the head's output at its last position gives draft 1 (argmax); drafts
2..k feed the head its own output hidden and the previous draft, in draft steps chained on the device
(head_graphs.py: CUDA graphs per padded batch size where the target has graphs), read back once. The target's
steps hand over their hidden states (views of its CUDA graphs' static outputs when they replay graphs), and drafts
are deterministic, so the rejection sampler keeps the output exact.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from pagedllm.attention.base import AttentionMetadata
from pagedllm.config import EngineConfig, PlainHFConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.spec_decode.head_graphs import (
    CatchUpGraphs,
    CatchUpInputs,
    DraftStepGraphs,
    log_speculation_graphs,
    run_draft_steps,
)
from pagedllm.spec_decode.proposer import (
    DeviceDrafts,
    block_table,
    can_speculate,
    kept_positions,
    num_drafts_allowed,
)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class EagleProposer:
    reads_every_step = True  # its head's KV cache follows every step's tokens

    def __init__(self, config: EngineConfig, runner: Any) -> None:
        from pagedllm.model_loader import (
            _default_dtype,
            init_dummy_weights,
            iter_safetensors,
            load_weights,
            process_weights_after_loading,
        )
        from pagedllm.models.eagle import Eagle3LlamaHead, EagleLlamaHead, eagle3_aux_layers
        from pagedllm.models.llama import LlamaModel

        spec = config.speculative_config
        self.k = spec.num_speculative_tokens
        self.method = spec.method
        self.runner = runner  # the target's: its model (embedding, LM head), device, attention backend
        self.device = runner.device
        self.block_size = config.cache_config.block_size
        self.max_model_len = config.model_config.max_model_len
        target = runner.model
        inner = getattr(target, "model", None)
        if not isinstance(inner, LlamaModel) or type(inner).forward is not LlamaModel.forward:
            raise ValueError(
                f"speculative_config.method {spec.method!r} needs a Llama-family target (Llama, Mistral, Qwen2/3)"
            )
        with open(os.path.join(spec.model, "config.json")) as f:
            head_config = PlainHFConfig(json.load(f))
        tensors = {} if config.model_config.load_format == "dummy" else dict(iter_safetensors(spec.model))
        with _default_dtype(config.model_config.dtype), torch.device(self.device):
            if spec.method == "eagle":
                head = EagleLlamaHead(head_config, runner.attn_backend, fc_bias="fc.bias" in tensors)
            else:
                head = Eagle3LlamaHead(head_config, runner.attn_backend, config.model_config.vocab_size)
        if head_config.hidden_size != config.model_config.hf_config.hidden_size:
            raise ValueError(
                f"speculative_config.model: the head's hidden_size ({head_config.hidden_size}) differs from the "
                f"target's ({config.model_config.hf_config.hidden_size})"
            )
        if config.model_config.load_format == "dummy":
            init_dummy_weights(head, config.model_config.seed)
        else:
            tensors.pop("embed_tokens.weight", None)  # EAGLE-1 ships a copy of the target's embedding
            d2t = tensors.pop("d2t", None)
            tensors.pop("t2d", None)
            load_weights(head, iter(tensors.items()))
            if d2t is not None:
                head.d2t.copy_(d2t.to(torch.long))
        process_weights_after_loading(head)
        if spec.method == "eagle3":
            head.map_draft_vocab()  # reads d2t once, here, not at every draft step
        self.head = head.eval()
        # Under tensor parallelism the target's embedding and LM head each hold a vocabulary shard, and their
        # forward is a collective the other ranks do not join; under pipeline parallelism the LM head is the last
        # stage's: the head (on rank 0) reads whole copies.
        self.embed: torch.nn.Module | None = None
        self.lm_head: torch.nn.Module | None = None
        tp, pp = getattr(runner, "tp_size", 1), getattr(runner, "pp", None)
        if tp > 1 or pp is not None:
            from pagedllm.models.llama import LlamaForCausalLM

            if type(inner).embed is not LlamaModel.embed or (
                spec.method == "eagle" and type(target).compute_logits is not LlamaForCausalLM.compute_logits
            ):
                what = "tensor_parallel_size" if tp > 1 else "pipeline_parallel_size"
                raise ValueError(
                    f"speculative_config.method {spec.method!r} with {what} > 1 needs a target whose "
                    "embedding and LM head are plain tables (Llama, Mistral, Qwen2/3)"
                )
            self.embed, self.lm_head = self._whole_tables(config)
        self.aux_layers = eagle3_aux_layers(len(inner.layers)) if spec.method == "eagle3" else ()
        if self.aux_layers and len(set(self.aux_layers)) != 3 or min(self.aux_layers, default=0) < 0:
            raise ValueError(
                f"speculative_config.method 'eagle3' reads target layers {self.aux_layers}: the target needs at "
                "least 7 layers"
            )
        # The target returns the hidden states its aux layers read (EAGLE-3): from its memory profile and CUDA graph
        # capture on, which come before init_kv_cache.
        inner.aux_hidden_state_layers = self.aux_layers
        self.kv_cache: list[torch.Tensor] = []
        self.kv: KVCacheManager | None = None
        self.step_graphs: DraftStepGraphs | None = None
        self.catch_up_graphs: CatchUpGraphs | None = None
        self.num_device_proposals = 0  # proposals queued on the device after a verification step
        self.device_drafts: DeviceDrafts | None = None  # where a proposal queued on the device comes back

    def _whole_tables(self, config: EngineConfig) -> tuple[torch.nn.Module, torch.nn.Module | None]:
        """Unsharded copies of the target's embedding and (EAGLE-1, whose logits are the target's) LM head, read
        from the target checkpoint (random with dummy weights)."""
        from safetensors import safe_open

        from pagedllm.layers.embedding import LMHead, VocabEmbedding
        from pagedllm.model_loader import _default_dtype, init_dummy_weights, safetensors_files

        mc = config.model_config
        hf = mc.hf_config
        tied = bool(getattr(hf, "tie_word_embeddings", False))
        with _default_dtype(mc.dtype), torch.device(self.device):
            embed = VocabEmbedding(hf.vocab_size, hf.hidden_size)
            lm_head = None
            if self.method == "eagle":
                lm_head = LMHead(hf.vocab_size, hf.hidden_size, tied_to=embed if tied else None)
        if mc.load_format == "dummy":
            init_dummy_weights(embed, mc.seed)
            if lm_head is not None and not tied:
                init_dummy_weights(lm_head, mc.seed)
            return embed, lm_head
        wanted = {"model.embed_tokens.weight": embed.weight}
        if lm_head is not None and not tied:
            wanted["lm_head.weight"] = lm_head.weight
        for path in safetensors_files(mc.model_path):
            with safe_open(path, framework="pt", device="cpu") as f, torch.no_grad():
                for name in [n for n in f.keys() if n in wanted]:  # noqa: SIM118 - safe_open is not a dict
                    wanted.pop(name).copy_(f.get_tensor(name))
        if wanted:
            raise ValueError(
                f"the target checkpoint lacks {sorted(wanted)} (needed by the EAGLE head under TP or PP)"
            )
        return embed, lm_head

    # ------------------------------------------------------------------ start-up

    def kv_block_bytes(self) -> int:
        attn = self._attn()
        elem = torch.empty((), dtype=self.runner.dtype).element_size()
        return 2 * self.block_size * attn.num_kv_heads * attn.head_dim * elem

    def _attn(self) -> Any:
        return self.head.layers[0].self_attn if self.method == "eagle" else self.head.midlayer.self_attn

    def init_kv_cache(self, num_blocks: int, kv: KVCacheManager) -> None:
        attn = self._attn()
        shape = (2, num_blocks, self.block_size, attn.num_kv_heads, attn.head_dim)
        self.kv_cache = [torch.zeros(shape, dtype=self.runner.dtype, device=self.device)]
        self.kv = kv
        self.capture_head_graphs()

    def capture_head_graphs(self) -> None:
        """CUDA graphs of the head (head_graphs.py), where the target has decode graphs (captured before: not in
        eager mode, nor under ``cudagraph_mode`` NONE or PIECEWISE): of its draft steps (drafts 2..k) when k > 1,
        and of its catch-up pass after verification steps where the target has multi-token graphs (not MLA,
        whose multi-token steps are planned on the host). Then one log line of the graphs speculation uses."""
        graphs = getattr(self.runner, "graph_runner", None)
        if graphs is not None:
            from pagedllm.kernels import compile_watch

            with compile_watch.start_up():  # the warm-ups' compiles are start-up's
                if self.k > 1:
                    self.step_graphs = self.new_step_graphs()
                    self.step_graphs.capture()
                if graphs.q > 1:
                    self.catch_up_graphs = self.new_catch_up_graphs(graphs.q)
                    if self.catch_up_graphs.sizes:
                        self.catch_up_graphs.capture()
                    else:
                        self.catch_up_graphs = None
        self.graphs_summary = log_speculation_graphs(
            self.method, self.runner, self.step_graphs, self.catch_up_graphs
        )
        from pagedllm.worker.model_runner import ModelRunner

        if (
            self.catch_up_graphs is not None
            and type(self.runner) is ModelRunner  # in this process (not tensor-parallel workers)
            and self.runner.longrope is None  # (positions in the graphs' inputs are then rotary rows)
        ):
            self.runner.after_spec_sample = self.draft_on_device

    @torch.inference_mode()
    def draft_on_device(self, step: Any, tokens: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """The runner's hook right after a verification step's sampling: when every request of the step verified
        k drafts through the target's multi-token graph, queue the next proposal behind it on the device (the
        catch-up over all k + 1 positions, ``CatchUpGraphs.run_verified``, then the draft steps planned there)
        and its copy to the host, so that neither waits for the host to learn what was accepted. ``propose``
        then only reads the drafts back (``DeviceDrafts.take``). Other steps propose on the host after them."""
        graphs = self.catch_up_graphs
        bs = step.verify_graph_bs
        n = len(step.req_ids)
        if (
            not bs
            or step.draft_hidden is None
            or len(step.sample_req_ids) != n
            or not bool((step.spec_num_draft == self.k).all())
            or graphs.padded_size(n) != bs
            or bs not in graphs.graphs
            or (self.step_graphs is not None and self.step_graphs.padded_size(n) not in self.step_graphs.graphs)
        ):
            return
        verify = self.runner.graph_runner
        last, first = graphs.run_verified(verify, n, tokens, num_accepted, step.draft_hidden)
        drafts = torch.empty(n, self.k, dtype=torch.long, device=self.device)  # [n, k]
        drafts[:, 0] = first
        nb = step.verify_table_width
        capacity = np.fromiter(
            (min(len(self.kv.get_block_ids(r)), nb) * self.block_size for r in step.req_ids), np.int64, count=n
        )
        if self.k > 1:
            # Each request's last position after this step: its first position in it plus the tokens it emits.
            last_pos = verify.positions[: n * graphs.q : graphs.q] + num_accepted + 1  # [n]
            self.step_graphs.run_on_device(
                last_pos, capacity, verify.block_table[:n, 0, :nb], first, last, drafts[:, 1:]
            )
        if self.device_drafts is None:
            self.device_drafts = DeviceDrafts(self.device, graphs.max_bs, self.k)
        self.device_drafts.queue(step, drafts, capacity)
        self.num_device_proposals += 1

    def new_catch_up_graphs(self, q: int) -> CatchUpGraphs:
        """Catch-up graphs (not captured yet) over this head, for passes of at most ``q`` tokens a request."""
        runner = self.runner
        hidden_size = runner.config.model_config.hf_config.hidden_size
        return CatchUpGraphs(
            self._head_pass,
            self._first,
            hidden_size * max(1, len(self.aux_layers)),  # EAGLE-3 reads the aux layers' states, concatenated
            runner.dtype,
            runner.max_num_reqs,
            q,
            runner.max_num_tokens,
            _cdiv(self.max_model_len, self.block_size),
            self.max_model_len,
            self.device,
        )

    def new_step_graphs(self) -> DraftStepGraphs:
        """Draft-step graphs (not captured yet) over this head, for the target's decode batch sizes."""
        runner = self.runner
        return DraftStepGraphs(
            self._draft_step,
            runner.config.model_config.hf_config.hidden_size,
            runner.dtype,
            runner.max_num_reqs,
            self.k - 1,
            _cdiv(self.max_model_len, self.block_size),
            self.max_model_len,
            self.device,
            self.block_size,
        )

    # ------------------------------------------------------------------ per step

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
        # 1. Catch up over every position the target computed and kept this step.
        rows, segs = [], []  # hidden rows to read; (request, first position, count) per request
        for i, req_id in enumerate(step.req_ids):
            request = live.get(req_id)
            if request is None:
                continue
            start, count = kept_positions(req_id, sched, result)
            count = min(count, request.num_tokens - 1 - start)  # the head needs the token at p + 1
            if count <= 0:
                continue
            first = int(step.query_start[i])
            rows.extend(range(first, first + count))
            segs.append((request, start, count))
        if not segs:
            return
        token_ids = np.concatenate(
            [np.asarray(r.all_token_ids[s + 1 : s + 1 + c], dtype=np.int64) for r, s, c in segs]
        )
        inputs = self._catch_up_inputs(token_ids, np.array(rows, dtype=np.int64), segs)
        # 2. Drafts for the requests that may speculate and whose last kept position is their last token's.
        chosen = []  # (request, its index in segs, drafts)
        for i, (request, start, count) in enumerate(segs):
            k = num_drafts_allowed(request, self.k, self.max_model_len)
            # Drafts 2..k run the head at positions num_tokens - 1 .. num_tokens + k - 3, writing its KV there:
            # no more than the request's blocks hold (a prefill chunk that stopped one token short of the prompt's
            # end left no block, nor lookahead slots, past it; a slot outside them is another request's).
            capacity = len(self.kv.get_block_ids(request.request_id)) * self.block_size
            k = min(k, capacity - request.num_tokens + 2)
            if can_speculate(request) and start + count == request.num_tokens - 1 and k > 0:
                chosen.append((request, i, k))
        # The catch-up pass (it writes the head's KV, whether or not anyone drafts): draft 1 from each chosen
        # request's last row.
        dev = self.device
        graphs = self.catch_up_graphs
        if graphs is not None and graphs.can_run(inputs):
            last, first = graphs.run(inputs, step.draft_hidden)  # [len(segs), H], [len(segs)]
            if not chosen:
                return
            sel = np.array([i for _, i, _ in chosen], dtype=np.int64)
            sel = torch.from_numpy(sel).to(dev, non_blocking=True)  # (blocking, it would wait for the device)
            h, first = last[sel], first[sel]  # [m, H], [m]
        else:
            rows_dev = torch.from_numpy(inputs.hidden_rows).to(dev, non_blocking=True)
            out = self._forward(inputs, step.draft_hidden[rows_dev])  # [n, H]
            if not chosen:
                return
            ends = inputs.query_start_loc[1:][[i for _, i, _ in chosen]] - 1
            h = out[torch.from_numpy(ends).to(dev, non_blocking=True)]  # [m, H]
            first = self._logits(h).argmax(dim=-1)  # [m] the draft at position num_tokens
        # 3. Drafts 2..k from draft steps, chained on the device (no host read until every draft is made).
        ks = np.array([k for _, _, k in chosen], dtype=np.int64)  # [m]
        drafts = torch.empty(len(chosen), int(ks.max()), dtype=torch.long, device=dev)  # [m, max k]
        drafts[:, 0] = first
        if drafts.shape[1] > 1:
            self._draft_steps([request for request, _, _ in chosen], ks, first, h, drafts[:, 1:])
        for (request, _, k), d in zip(chosen, drafts.tolist()):  # the one device-to-host sync of a proposal
            request.spec_token_ids = d[:k]

    def _draft_steps(
        self,
        requests: list[Request],
        ks: np.ndarray,  # [m] drafts each request gets (>= 1)
        tokens: torch.Tensor,  # [m] draft 1
        hidden: torch.Tensor,  # [m, H] the head's hidden that made it
        out: torch.Tensor,  # [m, max(ks) - 1] drafts 2.. go here
    ) -> None:
        """Drafts 2..k: step j runs the head at position ``num_tokens - 1 + j`` on draft j + 1 and the hidden
        that made it (pagedllm/spec_decode/head_graphs.py), replaying CUDA graphs where the batch fits them."""
        m = len(requests)
        last_pos = np.fromiter((r.num_tokens - 1 for r in requests), dtype=np.int64, count=m)
        # Blocks covering every step's position (up to num_tokens + k - 3)
        num_blocks = _cdiv(int((last_pos + ks).max()) - 1, self.block_size)
        table = block_table(self.kv, [r.request_id for r in requests], num_blocks)
        graphs = self.step_graphs
        if graphs is not None and graphs.padded_size(m) in graphs.graphs:
            graphs.run(last_pos, ks, table, tokens, hidden, out)
        else:
            run_draft_steps(self._draft_step, self.block_size, last_pos, ks, table, tokens, hidden, out)

    def _head_pass(
        self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The head over ``tokens`` ([T] the tokens at p + 1) and ``hidden`` ([T, H_in] the hidden at p) at
        ``positions`` [T]: its hidden ``[T, H]``."""
        embed = self.runner.model.model.embed if self.embed is None else self.embed
        embeds = embed(tokens)
        return self.head(embeds, hidden.to(embeds.dtype), positions, self.kv_cache, meta)

    def _draft_step(
        self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step: the head over ``tokens`` ([n] the drafts just made) and ``hidden`` ([n, H]) at
        ``positions``; returns its hidden ``[n, H]`` and the next drafts ``[n]`` (argmax)."""
        out = self._head_pass(tokens, hidden, positions, meta)
        return out, self._first(out)

    def _first(self, hidden: torch.Tensor) -> torch.Tensor:
        """The drafts the head's ``hidden`` [n, H] make: ``[n]``, argmax of its logits."""
        return self._logits(hidden).argmax(dim=-1)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.method == "eagle":
            return (self.runner.model.compute_logits if self.lm_head is None else self.lm_head)(hidden)
        return self.head.compute_logits(hidden)

    def _catch_up_inputs(
        self, token_ids: np.ndarray, hidden_rows: np.ndarray, segs: list[tuple[Request, int, int]]
    ) -> CatchUpInputs:
        """The host inputs of a catch-up pass: request r's tokens at positions ``start .. start + count - 1`` (its
        context before them is in the head's cache), reading the target step's hidden rows ``hidden_rows``."""
        bs = self.block_size
        counts = np.array([c for _, _, c in segs], dtype=np.int64)
        starts = np.array([s for _, s, _ in segs], dtype=np.int64)
        cu = np.zeros(len(segs) + 1, dtype=np.int64)
        np.cumsum(counts, out=cu[1:])
        req_of = np.repeat(np.arange(len(segs)), counts)
        positions = np.arange(int(cu[-1])) - cu[req_of] + starts[req_of]
        seq_lens = (starts + counts).astype(np.int32)
        table = block_table(self.kv, [r.request_id for r, _, _ in segs], _cdiv(int(seq_lens.max()), bs))
        slots = table[req_of, positions // bs].astype(np.int64) * bs + positions % bs
        return CatchUpInputs(token_ids, hidden_rows, positions, slots, seq_lens, cu, table)

    def _forward(self, inputs: CatchUpInputs, hidden: torch.Tensor) -> torch.Tensor:  # [T, H]
        """The catch-up pass, eagerly, over ``hidden`` ([T, H_in] the target's hidden rows)."""
        dev = self.device
        counts = np.diff(inputs.query_start_loc)
        qsl = torch.from_numpy(inputs.query_start_loc.astype(np.int32))
        lens = torch.from_numpy(inputs.seq_lens)
        meta = AttentionMetadata(
            num_reqs=len(counts),
            num_tokens=len(inputs.token_ids),
            max_query_len=int(counts.max()),
            max_seq_len=int(inputs.seq_lens.max()),
            query_start_loc=qsl.to(dev, non_blocking=True),
            seq_lens=lens.to(dev, non_blocking=True),
            block_table=torch.from_numpy(inputs.block_table).to(dev, non_blocking=True),
            slot_mapping=torch.from_numpy(inputs.slot_mapping).to(dev, non_blocking=True),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=lens,
            is_pure_decode=bool((counts == 1).all()),
        )
        tokens = torch.from_numpy(np.ascontiguousarray(inputs.token_ids)).to(dev, non_blocking=True)
        positions = torch.from_numpy(inputs.positions).to(dev, non_blocking=True)
        return self._head_pass(tokens, hidden, positions, meta)
