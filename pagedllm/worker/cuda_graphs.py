"""CUDA graphs for decode steps, captured once per padded batch size at start-up (GPU only).

A pure-decode step of ``n`` requests runs the graph captured for the smallest size ``>= n``. Everything the graph
reads lives in static device buffers that each step overwrites in place::

    input_ids[bs]  positions[bs]  slot_mapping[bs]  seq_lens[bs]  block_table[bs, max_blocks]  -> hidden[bs, H]

With speculative decoding a second set of graphs, one per padded batch size ``bs``, serves steps whose requests
each compute at most ``q = k + 1`` tokens (verification: the last token plus up to k drafts; a draft model's
catch-up): ``bs * q`` token rows, ``max_query_len = q``. The step's real tokens come first, in their flattened
order, with its real ``query_start_loc``; requests ``n..bs`` get a query length and a context of 0, so the
attention kernel skips them (its grid depends only on ``bs``, ``bs * q``, ``q`` and ``max_seq_len``). Rows past the
real tokens belong to no request: their keys are not written (slot -1), the attention leaves their output
unwritten, and their hidden rows are ignored (every other op is row-wise, so nothing reaches a real row).

Speculative decoding that reads the target's hidden states (EAGLE, EAGLE-3, MTP, Medusa) uses these graphs too: a
step's output is the rows of the graph's static output that its tokens own, handed to the proposer as views (read
before the next replay). An EAGLE-3 target's forward returns a pair, the final hidden states and its auxiliary
layers' states ``[bs * q, 3 * H]``: both are kept, as views that do not hold their memory (the graphs captured
later may reuse it), as the piecewise graphs keep theirs.

A hybrid model (KV cache groups, core/kv_cache_manager.py) has one slot mapping and one block table per group:
``slot_mapping[groups, bs]`` and ``block_table[bs, groups, max_blocks]`` (group g's table is the strided view
``[:, g]``, rows ``max_blocks * groups`` apart, so the rows a batch uses stay one contiguous copy).

Padding rows (n..bs) get slot -1 (their keys are never written) and a context of one token, so they read block 0
harmlessly and their rows of ``hidden`` are ignored. The attention kernel's grid depends only on the batch size
and on ``max_seq_len``, which is fixed at capture to ``max_model_len`` (the kernel reads each row's real length
from ``seq_lens``), so one graph serves every context length.

On Hopper and later the Triton kernels inside these graphs are programmatic dependent launches
(``platform.launch_with_pdl``): each starts launching while the one before it drains, which hides most of the
~1 µs gap between the few hundred small kernels of a batch-1 step.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from pagedllm.attention.base import AttentionMetadata
from pagedllm.platform import launch_with_pdl
from pagedllm.worker.graph_io import EagerGraph, map_output, slice_rows, unowned_view

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, 513, 32))
    return [s for s in sizes if s <= max_num_seqs] or [1]


class CudaGraphRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        max_num_seqs: int,
        max_blocks_per_req: int,
        max_model_len: int,
        device: torch.device,
        num_kv_groups: int = 1,
        max_query_len: int = 1,
        max_num_tokens: int | None = None,
    ) -> None:
        """``max_query_len`` > 1 (speculative decoding: k + 1) adds the multi-token graphs, for the batch sizes
        whose ``bs * max_query_len`` rows fit ``max_num_tokens``."""
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = capture_sizes(max_num_seqs)
        self.max_bs = self.sizes[-1]
        self.q = q = max(1, max_query_len)
        limit = max_num_tokens if max_num_tokens is not None else self.max_bs * q
        self.spec_sizes = [s for s in self.sizes if s * q <= limit] if q > 1 else []
        self.max_model_len = max_model_len
        self.device = device
        bs = self.max_bs
        t = max(bs, self.spec_sizes[-1] * q if self.spec_sizes else 0)  # token rows
        self.max_tokens = t
        self.max_blocks = max_blocks_per_req
        self.num_groups = g = num_kv_groups
        # Static device buffers (the graphs' inputs), as views of two flat buffers so that one step's inputs
        # arrive in two host-to-device copies:
        #   i64: [input_ids (t) | positions (t) | slot_mapping (groups * t)]
        #   i32: [seq_lens (bs) | query_start_loc (bs + 1) | block_table (bs * groups * max_blocks)]
        self.dev_i64 = torch.zeros((2 + g) * t, dtype=torch.long, device=device)
        self.dev_i32 = torch.zeros(2 * bs + 1 + bs * g * max_blocks_per_req, dtype=torch.int32, device=device)
        self.input_ids = self.dev_i64[:t]  # [t]
        self.positions = self.dev_i64[t : 2 * t]  # [t]
        self.slot_mapping = self.dev_i64[2 * t :].view(g, t)  # [groups, t]
        self.seq_lens = self.dev_i32[:bs]  # [bs]
        self.spec_query_start_loc = self.dev_i32[bs : 2 * bs + 1]  # [bs + 1] (multi-token graphs)
        # [bs, groups, max_blocks]
        self.block_table = self.dev_i32[2 * bs + 1 :].view(bs, g, max_blocks_per_req)
        self.slot_mapping.fill_(-1)
        self.seq_lens.fill_(1)
        # [bs + 1]: the pure-decode graphs' fixed offsets (one token a request)
        self.query_start_loc = torch.arange(bs + 1, dtype=torch.int32, device=device)
        # Pinned host twins, two of each used in turn: with async scheduling the host fills step N+1's inputs
        # while step N's copy may still wait in the stream. Step N-1's copy, the last user of the other twin, is
        # done by then (the engine has read step N-1's sampled ids, which the stream produced after that copy).
        pin = device.type == "cuda"
        self.host_i64 = [torch.zeros((2 + g) * t, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self.host_i32 = [
            torch.zeros(self.dev_i32.numel(), dtype=torch.int32, pin_memory=pin) for _ in range(2)
        ]
        self._turn = 0
        self.graphs: dict[tuple[int, int], Any] = {}  # (batch size, query length) -> torch.cuda.CUDAGraph
        # The model's output per graph: its hidden states [bs * q, H], or a tuple of them (the final hidden states
        # and an EAGLE-3 draft's auxiliary hidden states, [bs * q, 3 * H])
        self.outputs: dict[tuple[int, int], Any] = {}
        self.num_replays: dict[tuple[int, int], int] = {}

    def _metadata(self, bs: int, q: int = 1) -> AttentionMetadata:
        t = bs * q
        qsl = (self.query_start_loc if q == 1 else self.spec_query_start_loc)[: bs + 1]
        if self.device.type == "cuda":
            # Placeholders: with the Triton backend nothing reads these host twins (graphs need no host data)
            qsl_cpu = torch.arange(bs + 1, dtype=torch.int32) * q
            seq_lens_cpu = torch.full((bs,), q, dtype=torch.int32)
        else:  # the stand-in graphs (EagerGraph) run the forward again at each replay: the buffers are the host's
            qsl_cpu, seq_lens_cpu = qsl, self.seq_lens[:bs]
        return AttentionMetadata(
            num_reqs=bs,
            num_tokens=t,
            max_query_len=q,
            max_seq_len=self.max_model_len,
            query_start_loc=qsl,
            seq_lens=self.seq_lens[:bs],
            block_table=self.block_table[:bs, 0],
            slot_mapping=self.slot_mapping[0, :t],
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=seq_lens_cpu,
            is_pure_decode=q == 1,
            kv_group_tables=tuple(
                (self.block_table[:bs, g], self.slot_mapping[g, :t]) for g in range(1, self.num_groups)
            ),
        )

    def _keys(self) -> list[tuple[int, int]]:
        """(batch size, query length) of every graph, in capture order: the multi-token graphs first (the most
        rows: the pool's largest), largest first."""
        return [(bs, self.q) for bs in reversed(self.spec_sizes)] + [(bs, 1) for bs in reversed(self.sizes)]

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        if self.device.type != "cuda":
            self._capture_stand_ins()
            return
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        # The side stream must not run ahead of the default stream's work: the static buffers' zero fills (and a
        # large KV cache's) may still be queued there, and reading them unfilled feeds garbage token ids to the
        # embedding (a device-side assert seen when the cache was tens of GiB).
        stream.wait_stream(torch.cuda.current_stream(self.device))
        # Multi-token graphs first (the most rows: the pool's largest), captured over requests of q tokens each.
        keys = self._keys()
        self.spec_query_start_loc.copy_(torch.arange(self.max_bs + 1, device=self.device) * self.q)
        for bs, q in keys:
            self.seq_lens.fill_(q)  # a valid batch while capturing: q tokens per request, no context
            meta = self._metadata(bs, q)
            args = (self.input_ids[: bs * q], self.positions[: bs * q], self.kv_caches, meta)
            # Kernels launch as programmatic dependent launches where the GPU has them (platform.launch_with_pdl):
            # the warm-up compiles the same variants the capture records.
            with launch_with_pdl():
                with torch.cuda.stream(stream):
                    # Warm-up: Triton compilation and lazy library set-up happen outside capture. The first
                    # (largest) size of each kind runs twice; later sizes once, which compiles any specialization
                    # they add.
                    for _ in range(2 if bs == (self.spec_sizes[-1] if q > 1 else self.max_bs) else 1):
                        self.model(*args)
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    output = self.model(*args)
                if isinstance(output, tuple):
                    # An EAGLE-3 target's (hidden, aux hidden), aux 3x as wide: kept as views that do not hold
                    # their memory, so that the graphs captured after this one may reuse it (as the piecewise
                    # graphs' outputs are; worker/piecewise_graphs.py). A step reads its graph's outputs before
                    # the next replay, of any graph, may write there.
                    output = map_output(unowned_view, output)
                self.outputs[(bs, q)] = output
                del output
            self.graphs[(bs, q)] = graph
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured CUDA graphs for %d decode batch sizes (1..%d)%s in %.1f s",
            len(self.sizes),
            self.max_bs,
            f" and {len(self.spec_sizes)} of {self.q} tokens per request" if self.spec_sizes else "",
            time.perf_counter() - start,
        )

    def _capture_stand_ins(self) -> None:
        """Where there is no GPU (tests): ``EagerGraph`` stand-ins, each replay running the forward on the static
        buffers, padding rows included, with metadata built from them."""
        self.spec_query_start_loc.copy_(torch.arange(self.max_bs + 1, device=self.device) * self.q)
        for bs, q in self._keys():

            def forward(bs: int = bs, q: int = q) -> Any:
                rows = bs * q
                meta = self._metadata(bs, q)
                return self.model(self.input_ids[:rows], self.positions[:rows], self.kv_caches, meta)

            self.seq_lens.fill_(q)
            graph = EagerGraph(forward)
            self.graphs[(bs, q)] = graph
            self.outputs[(bs, q)] = graph.output
        self.seq_lens.fill_(1)

    def padded_size(self, num_reqs: int, q: int = 1) -> int | None:
        for s in self.sizes if q == 1 else self.spec_sizes:
            if s >= num_reqs:
                return s
        return None

    def can_run(self, num_reqs: int, num_tokens: int, max_query_len: int) -> bool:
        """A step of ``num_reqs`` requests computing ``num_tokens`` tokens, none more than ``max_query_len``."""
        if max_query_len == 1:
            return num_reqs <= self.max_bs
        return max_query_len <= self.q and self.padded_size(num_reqs, self.q) is not None

    def run(
        self,
        input_ids: np.ndarray,  # [num_tokens] int64
        positions: np.ndarray,  # [num_tokens] int64
        slot_mapping: np.ndarray,  # [groups, num_tokens] int64
        seq_lens: np.ndarray,  # [n] int32 (n requests)
        block_table: np.ndarray,  # [groups, n, nb] int32
        input_patch: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        query_start_loc: np.ndarray | None = None,  # [n + 1] token offsets (None: one token a request)
        fix: Any = None,  # a DeviceFix (worker/spec_step.py): the inputs the device corrects before the replay
    ) -> Any:
        """The step's hidden states, ``[num_tokens, hidden_size]`` (a tuple of such rows when the model returns
        more than its final hidden states: an EAGLE-3 draft's auxiliary hidden states): views of the graph's
        output, valid until the next replay. ``input_patch`` = (dst, src, values): ``input_ids[dst] =
        values[src]`` on the device before the replay (tokens sampled by the previous, still running step)."""
        num_tokens = input_ids.shape[0]
        n = seq_lens.shape[0]
        q = 1 if num_tokens == n else self.q
        bs = self.padded_size(n, q)
        rows = bs * q  # the graph's token rows; the step's tokens are the first num_tokens
        nb = block_table.shape[2]
        m, t, mb, g = self.max_bs, self.max_tokens, self.max_blocks, self.num_groups
        host_i64, host_i32 = self.host_i64[self._turn], self.host_i32[self._turn]
        self._turn ^= 1
        h64, h32 = host_i64.numpy(), host_i32.numpy()
        h64[:num_tokens] = input_ids
        h64[t : t + num_tokens] = positions
        slots = h64[2 * t :].reshape(g, t)
        slots[:, :num_tokens] = slot_mapping
        h64[num_tokens:rows] = 0
        h64[t + num_tokens : t + rows] = 0
        slots[:, num_tokens:rows] = -1  # padding rows write no keys
        h32[:n] = seq_lens
        # Pure decode: padding requests attend to one (ignored) key. Multi-token: they have no tokens, no context.
        h32[n:bs] = 1 if q == 1 else 0
        if q > 1:
            qsl = h32[m : 2 * m + 1]
            qsl[: n + 1] = query_start_loc
            qsl[n + 1 : bs + 1] = num_tokens
        table = h32[2 * m + 1 :].reshape(m, g, mb)
        table[:n, :, :nb] = block_table.transpose(1, 0, 2)
        table[n:bs, :, :nb] = 0
        self.dev_i64.copy_(host_i64, non_blocking=True)
        end = 2 * m + 1 + bs * g * mb
        self.dev_i32[:end].copy_(host_i32[:end], non_blocking=True)
        if input_patch is not None:
            dst, src, values = input_patch
            self.input_ids[dst] = values[src]
        if fix is not None:
            nt = num_tokens
            fix.apply(
                self.input_ids[:nt], self.positions[:nt], self.slot_mapping[0, :nt], self.seq_lens[:n],
                self.block_table[:n, 0],
            )
        self.graphs[(bs, q)].replay()
        self.num_replays[(bs, q)] = self.num_replays.get((bs, q), 0) + 1
        return slice_rows(self.outputs[(bs, q)], num_tokens)
