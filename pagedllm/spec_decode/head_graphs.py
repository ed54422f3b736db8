"""The passes of an EAGLE / EAGLE-3 / MTP head: the draft steps' plan, and CUDA graphs of the draft steps and of
the catch-up pass (GPU).

After the catch-up pass gives draft 1 (pagedllm/spec_decode/eagle.py), each of drafts 2..k is one head pass over
one token per request: step j (0-based) runs the head at position ``num_tokens - 1 + j`` on the draft just made and
the head's own hidden from the step before, and its argmax is the next draft. Such a pass has the shape of a
decode step, and everything it needs (positions, KV slots, context lengths) follows on the device from each
request's last position, its limit and its block table: :func:`plan_draft_step` plans step j there, inside the
graphs and in the eager steps (:func:`run_draft_steps`) alike, so the steps chain on the device and the host reads
the drafts back once, at the end.

A request that needs fewer drafts than the batch's most drops out as a *resting* row: position 0, context of one
key, slot -1 (it writes no key: a slot past the request's blocks would be another request's). Its rows of the
outputs are ignored; every op but attention is row-wise, and attention reads each row's own context.

:class:`DraftStepGraphs` captures one graph per padded batch size (the target's decode sizes,
worker/cuda_graphs.py) over static buffers::

    input_ids[bs]  hidden[bs, H]  positions[bs]  slot_mapping[bs]  seq_lens[bs]  block_table[bs, max_blocks]

Each graph runs embed -> head -> logits -> argmax and writes its results back into its inputs: the draft into
``input_ids`` and the head's hidden into ``hidden``, ready for the next step's replay; each graph first plans its
step (:func:`plan_draft_step`) from ``last_pos``, ``limit``, ``block_table`` and a step counter it counts up.
Padding rows (n..bs) rest like the resting rows. The metadata is a decode step's with ``max_seq_len`` fixed to
``max_model_len`` (the kernels read each row's length from ``seq_lens``), as in the target's decode graphs.
Batches above the largest size run the same steps eagerly.

:class:`CatchUpGraphs` captures the catch-up pass that precedes the draft steps, for passes after verification
steps (at most k + 1 kept positions a request), laid out as the target's multi-token graphs; its graphs also take
draft 1. Prefill catch-ups (longer chunks) and larger batches run eagerly; so does every catch-up under MLA
(MTP), whose multi-token steps are planned on the host (its draft steps, decodes, have their graphs).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedllm.attention.base import AttentionMetadata
from pagedllm.platform import launch_with_pdl
from pagedllm.worker.cuda_graphs import capture_sizes
from pagedllm.worker.graph_io import EagerGraph

logger = logging.getLogger(__name__)

# step_fn(input_ids [n], hidden [n, H], positions [n], metadata) -> (the head's hidden [n, H], the drafts [n])
StepFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata], tuple[torch.Tensor, torch.Tensor]
]


def smallest_at_least(sizes: list[int], n: int) -> int | None:
    """The first of the ascending captured ``sizes`` that holds ``n`` (None: none does, run eagerly)."""
    for size in sizes:
        if size >= n:
            return size
    return None


def plan_draft_step(
    last_pos: torch.Tensor,  # [n] int64 each request's last position: step j runs it at last_pos + j
    limit: torch.Tensor,  # [n] int64 it rests from this position on
    step_idx: torch.Tensor | int,  # j: an int, or a [1] int64 tensor (a graph's step counter)
    block_table: torch.Tensor,  # [n, nb >= 1] int32 its block ids, covering the positions it runs at
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draft step j's positions ``[n]`` int64, KV slots ``[n]`` int64 and context lengths ``[n]`` int32, on the
    inputs' device: request r runs at ``last_pos[r] + j`` while that is below ``limit[r]``, its slot read from
    ``block_table``, and rests otherwise (position 0, slot -1, context 1). The one rule of both the step graphs
    and the eager steps; nothing is read back to the host."""
    pos = last_pos + step_idx  # [n]
    active = pos < limit  # [n]
    pos = torch.where(active, pos, 0)
    blocks = block_table.gather(1, (pos // block_size).unsqueeze(1)).squeeze(1)  # [n]
    slots = torch.where(active, blocks.long() * block_size + pos % block_size, -1)
    return pos, slots, (pos + 1).to(torch.int32)  # (a resting row's position 0: context 1)


def decode_metadata(
    seq_lens: torch.Tensor,  # [n] int32
    block_table: torch.Tensor,  # [n, num_blocks] int32
    slot_mapping: torch.Tensor,  # [n] int64
    query_start_loc: torch.Tensor,  # [n + 1] int32: 0..n
    max_seq_len: int,
    host: tuple[torch.Tensor, torch.Tensor],  # (query_start_loc, seq_lens) on the host
) -> AttentionMetadata:
    """Metadata of a step of one token a request."""
    n = seq_lens.shape[0]
    return AttentionMetadata(
        num_reqs=n,
        num_tokens=n,
        max_query_len=1,
        max_seq_len=max_seq_len,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_table=block_table,
        slot_mapping=slot_mapping,
        query_start_loc_cpu=host[0],
        seq_lens_cpu=host[1],
        is_pure_decode=True,
    )


def run_draft_steps(
    step_fn: StepFn,
    block_size: int,
    last_pos: np.ndarray,  # [n] int64 each request's last position: step j runs it at last_pos + j
    num_drafts: np.ndarray,  # [n] drafts each request gets (>= 1): it runs steps j < num_drafts - 1
    block_table: np.ndarray,  # [n, nb >= 1] int32 its block ids, covering those steps' positions
    tokens: torch.Tensor,  # [n] draft 1
    hidden: torch.Tensor,  # [n, H] the head's hidden that made it
    out: torch.Tensor,  # [n, steps] step j's drafts go to out[:, j]
) -> None:
    """The draft steps eagerly (batches no graph fits, or no graphs): each step planned by
    :func:`plan_draft_step` on the device as a replay of :class:`DraftStepGraphs` plans it (``limit = last_pos +
    num_drafts - 1``), over the ``n`` requests unpadded, with nothing read back to the host. The attention's host
    twins (context lengths, and their maximum as ``max_seq_len``) come from the same plan run on the host."""
    n, steps = out.shape
    device = tokens.device
    host = (
        torch.from_numpy(last_pos),
        torch.from_numpy(last_pos + num_drafts - 1),
        torch.from_numpy(block_table),
    )
    on_host = device.type == "cpu"
    last_dev, limit_dev, table_dev = host if on_host else (t.to(device, non_blocking=True) for t in host)
    qsl_cpu = torch.arange(n + 1, dtype=torch.int32)
    qsl = qsl_cpu.to(device, non_blocking=True)
    for j in range(steps):
        positions, slots, seq_lens = plan_draft_step(last_dev, limit_dev, j, table_dev, block_size)
        seq_cpu = seq_lens if on_host else plan_draft_step(*host[:2], j, host[2], block_size)[2]
        meta = decode_metadata(seq_lens, table_dev, slots, qsl, int(seq_cpu.max()), (qsl_cpu, seq_cpu))
        hidden, tokens = step_fn(tokens, hidden, positions, meta)
        out[:, j] = tokens


class DraftStepGraphs:
    def __init__(
        self,
        step_fn: StepFn,
        hidden_size: int,
        dtype: torch.dtype,
        max_num_seqs: int,
        max_steps: int,
        max_blocks_per_req: int,
        max_model_len: int,
        device: torch.device,
        block_size: int,
        graph_cls: Callable[[], Any] | None = None,
    ) -> None:
        """``step_fn``: one draft step (see ``StepFn``); ``max_steps``: the most steps a plan has (k - 1).
        ``graph_cls``: the graph type (``torch.cuda.CUDAGraph``; None where there is no GPU: ``EagerGraph``
        stand-ins that run ``step_fn`` again at each replay).

        Each graph plans its own step on the device (:func:`plan_draft_step`, step j being ``step_idx``, counted
        up by the graph): request r runs at ``last_pos[r] + j`` while that is below ``limit[r]``, and rests
        otherwise. So a proposal's host work is filling ``last_pos``, ``limit`` and ``block_table`` (from the
        host, or on the device after a verification step), then one replay a step."""
        self.step_fn = step_fn
        self.sizes = capture_sizes(max_num_seqs)
        self.max_bs = b = self.sizes[-1]
        self.max_steps = max(max_steps, 1)
        self.max_model_len = max_model_len
        self.max_blocks = mb = max_blocks_per_req
        self.block_size = block_size
        self.device = device
        self.cuda = device.type == "cuda"
        self.graph_cls = graph_cls if graph_cls is not None else (torch.cuda.CUDAGraph if self.cuda else None)
        # Static inputs. i64 [input_ids (b) | last_pos (b) | limit (b) | step_idx (1)] and i32 [qsl (b + 1) |
        # table]; a proposal fills last_pos, limit and the table, the graphs the rest. Written by the graphs:
        # positions, slots and seq_lens (each step's plan).
        self.dev_i64 = torch.zeros(3 * b + 1, dtype=torch.long, device=device)
        self.dev_i32 = torch.zeros(b + 1 + b * mb, dtype=torch.int32, device=device)
        self.input_ids = self.dev_i64[:b]
        self.last_pos = self.dev_i64[b : 2 * b]
        self.limit = self.dev_i64[2 * b : 3 * b]
        self.step_idx = self.dev_i64[3 * b :]
        self.query_start_loc = self.dev_i32[: b + 1]
        self.block_table = self.dev_i32[b + 1 :].view(b, mb)
        self.positions = torch.zeros(b, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((b,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(b, dtype=torch.int32, device=device)
        self.hidden = torch.zeros(b, hidden_size, dtype=dtype, device=device)
        self.query_start_loc.copy_(torch.arange(b + 1, dtype=torch.int32, device=device))
        # The host path's pinned twin of [last_pos | limit] and of the table: the proposal ends by reading the
        # drafts back, after every copy, so one each is enough.
        pin = self.cuda
        self.host_i64 = torch.zeros(2 * b, dtype=torch.long, pin_memory=pin)
        self.host_table = torch.zeros(b, mb, dtype=torch.int32, pin_memory=pin)
        # run_on_device's pinned twins of limit, used in turn: its proposals are not read back before the next
        # one (a verification launched ahead of the host reads them on the device), so the copies of the two
        # before may still be queued; the one three before is done (the host has read a later step's tokens).
        self.host_limits = [torch.zeros(b, dtype=torch.long, pin_memory=pin) for _ in range(3)]
        self._limit_turn = 0
        self.graphs: dict[int, Any] = {}
        self.num_replays: dict[int, int] = {}

    def padded_size(self, num_reqs: int) -> int | None:
        return smallest_at_least(self.sizes, num_reqs)

    def _metadata(self, bs: int) -> AttentionMetadata:
        if self.cuda:  # placeholders: with the Triton backend nothing reads these host twins
            host = (torch.arange(bs + 1, dtype=torch.int32), torch.ones(bs, dtype=torch.int32))
        else:  # the stand-ins run step_fn again at each replay: the buffers are the host's
            host = (self.query_start_loc[: bs + 1], self.seq_lens[:bs])
        return decode_metadata(
            self.seq_lens[:bs],
            self.block_table[:bs],
            self.slot_mapping[:bs],
            self.query_start_loc[: bs + 1],
            self.max_model_len,
            host,
        )

    def _plan(self, bs: int) -> None:
        """Step ``step_idx``'s positions, slots and context lengths of the first ``bs`` rows
        (:func:`plan_draft_step`), into the static buffers."""
        pos, slots, seq_lens = plan_draft_step(
            self.last_pos[:bs], self.limit[:bs], self.step_idx, self.block_table[:bs], self.block_size
        )
        self.positions[:bs].copy_(pos)
        self.slot_mapping[:bs].copy_(slots)
        self.seq_lens[:bs].copy_(seq_lens)

    def _step(self, bs: int) -> None:
        """One draft step over the static buffers' first ``bs`` rows: its plan, the head, its results written
        back into the buffers, and the step counted."""
        self._plan(bs)
        hidden, tokens = self.step_fn(
            self.input_ids[:bs], self.hidden[:bs], self.positions[:bs], self._metadata(bs)
        )
        self.hidden[:bs].copy_(hidden)
        self.input_ids[:bs].copy_(tokens)
        self.step_idx.add_(1)

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        if not self.cuda:
            for bs in reversed(self.sizes):
                self.graphs[bs] = EagerGraph(lambda bs=bs: self._step(bs))
            return
        pool = torch.cuda.graph_pool_handle()  # the head's own: its graphs never replay inside the target's
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))  # the static buffers' fills come first
        for bs in reversed(self.sizes):
            with launch_with_pdl():
                with torch.cuda.stream(stream):
                    # Warm-up outside capture (Triton compiles, library set-up): the largest size twice.
                    for _ in range(2 if bs == self.max_bs else 1):
                        self._step(bs)
                    self.input_ids.zero_()  # the warm-up's results, back to what the buffers held
                    self.hidden.zero_()
                torch.cuda.synchronize(self.device)
                graph = self.graph_cls()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self._step(bs)
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured CUDA graphs of the draft head's steps for %d batch sizes (1..%d) in %.1f s",
            len(self.sizes),
            self.max_bs,
            time.perf_counter() - start,
        )

    def run(
        self,
        last_pos: np.ndarray,  # [n] int64 each request's last position: step j runs it at last_pos + j
        num_drafts: np.ndarray,  # [n] drafts each request gets (>= 1): it runs steps j < num_drafts - 1
        block_table: np.ndarray,  # [n, nb] int32 its block ids, covering those steps' positions
        tokens: torch.Tensor,  # [n] draft 1
        hidden: torch.Tensor,  # [n, H] the head's hidden that made it
        out: torch.Tensor,  # [n, steps] step j's drafts go to out[:, j]
    ) -> None:
        """As :func:`run_draft_steps` over the same inputs, replaying the graph of the padded batch size
        (``padded_size(n)``, captured) once a step."""
        n, steps = out.shape
        bs = self.padded_size(n)
        assert bs in self.graphs and steps <= self.max_steps
        b, nb = self.max_bs, min(block_table.shape[1], self.max_blocks)
        h64 = self.host_i64.numpy()
        h64[:n] = last_pos
        h64[b : b + n] = last_pos + num_drafts - 1
        h64[b + n : b + bs] = 0  # padding rows rest
        self.host_table.numpy()[:n, :nb] = block_table[:, :nb]
        self.dev_i64[b : 3 * b].copy_(self.host_i64, non_blocking=True)
        self.block_table[:n].copy_(self.host_table[:n], non_blocking=True)
        self._replay(bs, n, steps, tokens, hidden, out)

    def run_on_device(
        self,
        last_pos: torch.Tensor,  # [n] int64 each request's last position: step j runs it at last_pos + j
        limit: np.ndarray,  # [n] int64 positions from this one on have no slot (capacity, max_model_len)
        block_table: torch.Tensor,  # [>= n, nb] int32 the requests' block ids (columns from limit on unread)
        tokens: torch.Tensor,  # [n] draft 1
        hidden: torch.Tensor,  # [n, H] the head's hidden that made it
        out: torch.Tensor,  # [n, steps] step j's drafts go to out[:, j]
    ) -> None:
        """As ``run``, with positions known only on the device (after a verification step, before the host has
        read it): every request runs every step until ``limit``; its drafts from a resting step on are not to
        be used."""
        n, steps = out.shape
        bs = self.padded_size(n)
        nb = min(block_table.shape[1], self.max_blocks)
        host = self.host_limits[self._limit_turn]
        self._limit_turn = (self._limit_turn + 1) % len(self.host_limits)
        h64 = host.numpy()
        h64[:n] = np.minimum(limit, self.max_model_len)
        h64[n:bs] = 0
        self.limit.copy_(host, non_blocking=True)
        self.last_pos[:n].copy_(last_pos)
        self.block_table[:n, :nb].copy_(block_table[:n, :nb])
        self._replay(bs, n, steps, tokens, hidden, out)

    def _replay(
        self, bs: int, n: int, steps: int, tokens: torch.Tensor, hidden: torch.Tensor, out: torch.Tensor
    ) -> None:
        """The steps, graph ``bs`` replayed once a step (last_pos, limit and the table filled)."""
        self.input_ids[:n].copy_(tokens)
        self.hidden[:n].copy_(hidden)
        self.step_idx.zero_()
        graph = self.graphs[bs]
        for j in range(steps):
            graph.replay()
            out[:, j] = self.input_ids[:n]
        self.num_replays[bs] = self.num_replays.get(bs, 0) + steps


def speculation_graphs_summary(
    method: str, runner: Any, step_graphs: Any = None, catch_up_graphs: Any = None, heads: Any = None
) -> str:
    """Which CUDA graphs speculative decoding with ``method`` uses: the target ``runner``'s (its verification
    steps of k + 1 tokens a request, its pure decodes, its mixed steps) and the draft head's (its catch-up pass
    after verification steps, its draft steps; Medusa's ``heads``). For ``draft_model``, ``catch_up_graphs`` is
    the draft runner's own decode graphs (its catch-up passes) and ``step_graphs`` its steps 2..k."""
    graphs = getattr(runner, "graph_runner", None)
    piecewise = getattr(runner, "piecewise", None)
    parts = []
    if graphs is not None and graphs.spec_sizes:
        parts.append(
            f"verification steps ({graphs.q} tokens a request) replay CUDA graphs for batch sizes "
            f"1..{graphs.spec_sizes[-1]}"
        )
    else:
        parts.append("verification steps run eagerly")
    parts.append(
        f"pure decodes replay CUDA graphs for batch sizes 1..{graphs.max_bs}"
        if graphs is not None
        else "pure decodes run eagerly"
    )
    parts.append(
        f"mixed steps replay piecewise CUDA graphs up to {piecewise.max_tokens} tokens"
        if piecewise is not None
        else "mixed steps run eagerly"
    )
    if method == "draft_model":
        parts.append(
            f"the draft model's catch-up passes replay its CUDA graphs for batch sizes 1..{catch_up_graphs.max_bs}"
            if catch_up_graphs is not None
            else "the draft model's catch-up passes run eagerly"
        )
        parts.append(
            f"its steps 2..k replay CUDA graphs for batch sizes 1..{step_graphs.max_bs}"
            if step_graphs is not None
            else "its steps 2..k run eagerly"
        )
    elif method == "medusa":
        parts.append(
            f"the heads replay CUDA graphs for batch sizes 1..{heads.max_bs}"
            if heads is not None
            else "the heads run eagerly"
        )
    else:
        parts.append(
            f"the draft head's catch-up after verification replays CUDA graphs for batch sizes "
            f"1..{catch_up_graphs.max_bs}"
            if catch_up_graphs is not None
            else "the draft head's catch-up runs eagerly"
        )
        parts.append(
            f"the draft head's steps replay CUDA graphs for batch sizes 1..{step_graphs.max_bs}"
            if step_graphs is not None
            else "the draft head's steps run eagerly"
        )
    return f"speculative decoding ({method}): " + "; ".join(parts)


def log_speculation_graphs(
    method: str, runner: Any, step_graphs: Any = None, catch_up_graphs: Any = None, heads: Any = None
) -> str:
    """Log :func:`speculation_graphs_summary` (once, at start-up); returns it (the proposer keeps it as
    ``graphs_summary``, which ``pagedllm bench latency`` prints)."""
    summary = speculation_graphs_summary(method, runner, step_graphs, catch_up_graphs, heads)
    logger.info("%s", summary)
    return summary


@dataclass
class CatchUpInputs:
    """The host inputs of a catch-up pass over ``n`` requests' kept positions (``T`` tokens)."""

    token_ids: np.ndarray  # [T] int64 the token at p + 1 for each position p
    hidden_rows: np.ndarray  # [T] int64 the target step's hidden row of each position
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    seq_lens: np.ndarray  # [n] int32
    query_start_loc: np.ndarray  # [n + 1] int64
    block_table: np.ndarray  # [n, num_blocks] int32

    @property
    def max_query_len(self) -> int:
        return int(np.diff(self.query_start_loc).max())


# pass_fn(input_ids [T], hidden [T, H_in], positions [T], metadata) -> the head's hidden [T, H]
PassFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


class CatchUpGraphs:
    """CUDA graphs of the catch-up pass after a verification step (every request keeps at most ``q = k + 1``
    positions), one per padded batch size ``bs`` whose ``bs * q`` rows fit the step budget, laid out as the target's
    multi-token graphs (worker/cuda_graphs.py): the pass's tokens first, in their flattened order, with their real
    ``query_start_loc``; requests ``n..bs`` have no token and no context; rows past the tokens write no key. Each
    graph also takes the head's hidden at each request's last row and its argmax (draft 1, for the requests that
    speculate: the caller picks theirs)::

        input_ids[t]  hidden[t, H_in]  positions[t]  slot_mapping[t]  seq_lens[bs]  query_start_loc[bs + 1]
        block_table[bs, max_blocks]   ->   last hidden [bs, H], draft 1 [bs]

    ``hidden`` is filled by one gather from the target step's hidden states (EAGLE-3: its auxiliary ones)."""

    def __init__(
        self,
        pass_fn: PassFn,
        first_fn: Callable[[torch.Tensor], torch.Tensor],
        hidden_in_size: int,
        dtype: torch.dtype,
        max_num_seqs: int,
        q: int,
        max_num_tokens: int,
        max_blocks_per_req: int,
        max_model_len: int,
        device: torch.device,
    ) -> None:
        """``first_fn(hidden [n, H]) -> drafts [n]`` (argmax of the head's logits)."""
        self.pass_fn = pass_fn
        self.first_fn = first_fn
        self.q = q
        self.sizes = [s for s in capture_sizes(max_num_seqs) if s * q <= max_num_tokens]
        self.max_bs = b = self.sizes[-1] if self.sizes else 0
        self.max_tokens = t = b * q
        self.max_blocks = mb = max_blocks_per_req
        self.max_model_len = max_model_len
        self.device = device
        self.cuda = device.type == "cuda"
        # i64 [input_ids (t) | positions (t) | slots (t) | hidden rows (t) | each request's output row (b)],
        # i32 [seq_lens (b) | qsl (b + 1) | table]
        self.dev_i64 = torch.zeros(4 * t + b, dtype=torch.long, device=device)
        self.dev_i32 = torch.zeros(2 * b + 1 + b * mb, dtype=torch.int32, device=device)
        self.input_ids = self.dev_i64[:t]
        self.positions = self.dev_i64[t : 2 * t]
        self.slot_mapping = self.dev_i64[2 * t : 3 * t]
        self.hidden_rows = self.dev_i64[3 * t : 4 * t]
        self.out_rows = self.dev_i64[4 * t :]  # the row whose hidden makes a request's draft 1 (its last kept)
        self.row_starts = torch.arange(b, device=device) * q  # [b] each request's first row in a full pass
        self.seq_lens = self.dev_i32[:b]
        self.query_start_loc = self.dev_i32[b : 2 * b + 1]
        self.block_table = self.dev_i32[2 * b + 1 :].view(b, mb)
        self.hidden = torch.zeros(t, hidden_in_size, dtype=dtype, device=device)
        self.slot_mapping.fill_(-1)
        # One pinned host twin each: a proposal's copies have run before the next one (the target's step between
        # them is waited for: its sampled tokens are read back).
        pin = self.cuda
        self.host_i64 = torch.zeros(4 * t + b, dtype=torch.long, pin_memory=pin)
        self.host_i32 = torch.zeros(self.dev_i32.numel(), dtype=torch.int32, pin_memory=pin)
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.num_replays: dict[int, int] = {}

    def padded_size(self, num_reqs: int) -> int | None:
        return smallest_at_least(self.sizes, num_reqs)

    def can_run(self, inputs: CatchUpInputs) -> bool:
        """Whether a captured graph takes the pass: at most ``q`` tokens a request, few enough requests."""
        size = self.padded_size(len(inputs.seq_lens))
        return size is not None and size in self.graphs and inputs.max_query_len <= self.q

    def _metadata(self, bs: int) -> AttentionMetadata:
        rows = bs * self.q
        qsl = self.query_start_loc[: bs + 1]
        if self.cuda:  # placeholders: with the Triton backend nothing reads these host twins
            host = (
                torch.arange(bs + 1, dtype=torch.int32) * self.q,
                torch.full((bs,), self.q, dtype=torch.int32),
            )
        else:  # the stand-ins run the pass again at each replay: the buffers are the host's
            host = (qsl, self.seq_lens[:bs])
        return AttentionMetadata(
            num_reqs=bs,
            num_tokens=rows,
            max_query_len=self.q,
            max_seq_len=self.max_model_len,
            query_start_loc=qsl,
            seq_lens=self.seq_lens[:bs],
            block_table=self.block_table[:bs],
            slot_mapping=self.slot_mapping[:rows],
            query_start_loc_cpu=host[0],
            seq_lens_cpu=host[1],
            is_pure_decode=False,
        )

    def _pass(self, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = bs * self.q
        out = self.pass_fn(
            self.input_ids[:rows], self.hidden[:rows], self.positions[:rows], self._metadata(bs)
        )
        last = torch.index_select(out, 0, self.out_rows[:bs])  # [bs, H] each request's last kept row
        return last, self.first_fn(last)

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        q = self.q
        self.query_start_loc.copy_(torch.arange(self.max_bs + 1, device=self.device) * q)
        if not self.cuda:
            for bs in reversed(self.sizes):
                self.seq_lens.fill_(q)
                graph = EagerGraph(lambda bs=bs: self._pass(bs))
                self.graphs[bs], self.outputs[bs] = graph, graph.output
            return
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        for bs in reversed(self.sizes):
            self.seq_lens.fill_(q)  # a valid batch while capturing: q tokens per request, no context
            with launch_with_pdl():
                with torch.cuda.stream(stream):
                    for _ in range(2 if bs == self.max_bs else 1):
                        self._pass(bs)
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.outputs[bs] = self._pass(bs)
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured CUDA graphs of the draft head's catch-up pass (%d tokens a request) for %d batch sizes "
            "(1..%d) in %.1f s",
            q,
            len(self.sizes),
            self.max_bs,
            time.perf_counter() - start,
        )

    def run(self, inputs: CatchUpInputs, target_hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The pass over ``inputs`` (``can_run``), its hidden rows gathered from ``target_hidden``: each request's
        last hidden ``[n, H]`` and draft 1 ``[n]``, views valid until the next replay."""
        n, num_tokens = len(inputs.seq_lens), len(inputs.token_ids)
        bs = self.padded_size(n)
        rows, t, b, mb = bs * self.q, self.max_tokens, self.max_bs, self.max_blocks
        h64, h32 = self.host_i64.numpy(), self.host_i32.numpy()
        for i, values in enumerate(
            (inputs.token_ids, inputs.positions, inputs.slot_mapping, inputs.hidden_rows)
        ):
            h64[i * t : i * t + num_tokens] = values
        h64[num_tokens:rows] = 0
        h64[t + num_tokens : t + rows] = 0
        h64[2 * t + num_tokens : 2 * t + rows] = -1  # padding rows write no keys
        h32[:n] = inputs.seq_lens
        h32[n:bs] = 0  # padding requests: no token, no context
        qsl = h32[b : 2 * b + 1]
        qsl[: n + 1] = inputs.query_start_loc
        qsl[n + 1 : bs + 1] = num_tokens
        h64[4 * t : 4 * t + n] = inputs.query_start_loc[1:] - 1  # the last row of each request's tokens
        h64[4 * t + n : 4 * t + bs] = 0
        nb = min(inputs.block_table.shape[1], mb)
        table = h32[2 * b + 1 :].reshape(b, mb)
        table[:n, :nb] = inputs.block_table[:, :nb]
        table[n:bs] = 0
        self.dev_i64.copy_(self.host_i64, non_blocking=True)
        end = 2 * b + 1 + bs * mb
        self.dev_i32[:end].copy_(self.host_i32[:end], non_blocking=True)
        torch.index_select(target_hidden, 0, self.hidden_rows[:num_tokens], out=self.hidden[:num_tokens])
        self.graphs[bs].replay()
        self.num_replays[bs] = self.num_replays.get(bs, 0) + 1
        last, first = self.outputs[bs]
        return last[:n], first[:n]

    def run_verified(
        self,
        verify: Any,  # the target's CudaGraphRunner, whose multi-token graph of ``bs`` requests ran the step
        n: int,
        tokens: torch.Tensor,  # [n, q] int64 the step's sampled tokens (accepted drafts, one more, -1 padding)
        num_accepted: torch.Tensor,  # [n] int64
        target_hidden: torch.Tensor,  # [n * q, H_in] the step's hidden rows (its graph's output)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The pass after a verification step of ``q`` tokens a request, without the host: over every position
        the step computed, each fed the token sampled after it (rows past a request's accepted drafts feed the
        head tokens that were not kept: its KV there is rewritten by the next pass before anything reads it, and
        causal attention keeps those rows out of the kept ones). Positions, slots, context lengths and block table
        are the step's own, copied from the verification graph's static inputs; draft 1 comes from the row of
        the last accepted draft. Returns each request's hidden ``[n, H]`` and draft 1 ``[n]``, as ``run``."""
        q = self.q
        bs = self.padded_size(n)
        rows, nt = bs * q, n * q
        torch.clamp(tokens.reshape(nt), min=0, out=self.input_ids[:nt])  # (padding rows: any token, unread)
        self.positions[:rows].copy_(verify.positions[:rows])
        self.slot_mapping[:rows].copy_(verify.slot_mapping[0, :rows])
        self.seq_lens[:bs].copy_(verify.seq_lens[:bs])
        self.query_start_loc[: bs + 1].copy_(verify.spec_query_start_loc[: bs + 1])
        mb = min(self.max_blocks, verify.max_blocks)
        self.block_table[:bs, :mb].copy_(verify.block_table[:bs, 0, :mb])
        self.hidden[:nt].copy_(target_hidden[:nt])
        torch.add(self.row_starts[:n], num_accepted, out=self.out_rows[:n])  # (padding rows: a valid row)
        self.graphs[bs].replay()
        self.num_replays[bs] = self.num_replays.get(bs, 0) + 1
        last, first = self.outputs[bs]
        return last[:n], first[:n]


class RowGraphs:
    """CUDA graphs of a row-wise function of one input, ``fn(x [bs, D]) -> y [bs, ...]``, one per padded batch
    size (the target's decode sizes): Medusa's heads over the target's hidden states. ``x`` lives in a static
    buffer; padding rows hold stale values, and their outputs are ignored."""

    def __init__(
        self,
        fn: Callable[[torch.Tensor], torch.Tensor],
        width: int,
        dtype: torch.dtype,
        max_num_seqs: int,
        device: torch.device,
    ) -> None:
        self.fn = fn
        self.sizes = capture_sizes(max_num_seqs)
        self.max_bs = self.sizes[-1]
        self.device = device
        self.cuda = device.type == "cuda"
        self.x = torch.zeros(self.max_bs, width, dtype=dtype, device=device)
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.num_replays: dict[int, int] = {}

    def padded_size(self, num_rows: int) -> int | None:
        return smallest_at_least(self.sizes, num_rows)

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        if not self.cuda:
            for bs in reversed(self.sizes):
                graph = EagerGraph(lambda bs=bs: self.fn(self.x[:bs]))
                self.graphs[bs], self.outputs[bs] = graph, graph.output
            return
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        for bs in reversed(self.sizes):
            with launch_with_pdl():
                with torch.cuda.stream(stream):
                    for _ in range(2 if bs == self.max_bs else 1):
                        self.fn(self.x[:bs])
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.outputs[bs] = self.fn(self.x[:bs])
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured CUDA graphs of the draft heads for %d batch sizes (1..%d) in %.1f s",
            len(self.sizes),
            self.max_bs,
            time.perf_counter() - start,
        )

    def run(self, x: torch.Tensor) -> torch.Tensor | None:
        """``fn(x)`` ([n, ...], a view valid until the next replay), or None when no graph takes ``n`` rows."""
        n = x.shape[0]
        bs = self.padded_size(n)
        if bs is None or bs not in self.graphs:
            return None
        self.x[:n].copy_(x)
        self.graphs[bs].replay()
        self.num_replays[bs] = self.num_replays.get(bs, 0) + 1
        return self.outputs[bs][:n]
