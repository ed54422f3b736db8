"""CUDA graphs for pure-decode steps, captured once per padded batch size at start-up (GPU only).

A decode step of ``n`` requests runs the graph captured for the smallest size ``>= n``. Everything the graph reads
lives in static device buffers that each step overwrites in place::

    input_ids[bs]  positions[bs]  slot_mapping[bs]  seq_lens[bs]  block_table[bs, max_blocks]  -> hidden[bs, H]

A hybrid model (KV cache groups, core/kv_cache_manager.py) has one slot mapping and one block table per group:
``slot_mapping[groups, bs]`` and ``block_table[bs, groups, max_blocks]`` (group g's table is the strided view
``[:, g]``, rows ``max_blocks * groups`` apart, so the rows a batch uses stay one contiguous copy).

Padding rows (n..bs) get slot -1 (their keys are never written) and a context of one token, so they read block 0
harmlessly and their rows of ``hidden`` are ignored. The attention kernel's grid depends only on the batch size
and on ``max_seq_len``, which is fixed at capture to ``max_model_len`` (the kernel reads each row's real length
from ``seq_lens``), so one graph serves every context length.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from pagedllm.attention.base import AttentionMetadata

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
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = capture_sizes(max_num_seqs)
        self.max_bs = self.sizes[-1]
        self.max_model_len = max_model_len
        self.device = device
        bs = self.max_bs
        self.max_blocks = max_blocks_per_req
        self.num_groups = g = num_kv_groups
        # Static device buffers (the graphs' inputs), as views of two flat buffers so that one step's inputs
        # arrive in two host-to-device copies:
        #   i64: [input_ids (bs) | positions (bs) | slot_mapping (groups * bs)]
        #   i32: [seq_lens (bs) | block_table (bs * groups * max_blocks)]
        self.dev_i64 = torch.zeros((2 + g) * bs, dtype=torch.long, device=device)
        self.dev_i32 = torch.zeros(bs + bs * g * max_blocks_per_req, dtype=torch.int32, device=device)
        self.input_ids = self.dev_i64[:bs]  # [bs]
        self.positions = self.dev_i64[bs : 2 * bs]  # [bs]
        self.slot_mapping = self.dev_i64[2 * bs :].view(g, bs)  # [groups, bs]
        self.seq_lens = self.dev_i32[:bs]  # [bs]
        self.block_table = self.dev_i32[bs:].view(bs, g, max_blocks_per_req)  # [bs, groups, max_blocks]
        self.slot_mapping.fill_(-1)
        self.seq_lens.fill_(1)
        self.query_start_loc = torch.arange(bs + 1, dtype=torch.int32, device=device)  # [bs + 1]
        # Pinned host twins, two of each used in turn: with async scheduling the host fills step N+1's inputs
        # while step N's copy may still wait in the stream. Step N-1's copy, the last user of the other twin, is
        # done by then (the engine has read step N-1's sampled ids, which the stream produced after that copy).
        self.host_i64 = [torch.zeros((2 + g) * bs, dtype=torch.long, pin_memory=True) for _ in range(2)]
        self.host_i32 = [
            torch.zeros(bs + bs * g * max_blocks_per_req, dtype=torch.int32, pin_memory=True)
            for _ in range(2)
        ]
        self._turn = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_reqs=bs,
            num_tokens=bs,
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_table=self.block_table[:bs, 0],
            slot_mapping=self.slot_mapping[0, :bs],
            query_start_loc_cpu=torch.arange(bs + 1, dtype=torch.int32),
            seq_lens_cpu=torch.ones(bs, dtype=torch.int32),
            is_pure_decode=True,
            kv_group_tables=tuple(
                (self.block_table[:bs, g], self.slot_mapping[g, :bs]) for g in range(1, self.num_groups)
            ),
        )

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        # The side stream must not run ahead of the default stream's work: the static buffers' zero fills (and a
        # large KV cache's) may still be queued there, and reading them unfilled feeds garbage token ids to the
        # embedding (a device-side assert seen when the cache was tens of GiB).
        stream.wait_stream(torch.cuda.current_stream(self.device))
        for bs in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
            meta = self._metadata(bs)
            args = (self.input_ids[:bs], self.positions[:bs], self.kv_caches, meta)
            with torch.cuda.stream(stream):
                # Warm-up: Triton compilation and lazy library set-up happen outside capture. The first (largest)
                # size runs twice; later sizes once, which compiles any specialization they add.
                for _ in range(2 if bs == self.max_bs else 1):
                    self.model(*args)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self.outputs[bs] = self.model(*args)
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured CUDA graphs for %d decode batch sizes (1..%d) in %.1f s",
            len(self.sizes),
            self.max_bs,
            time.perf_counter() - start,
        )

    def padded_size(self, num_reqs: int) -> int | None:
        for s in self.sizes:
            if s >= num_reqs:
                return s
        return None

    def run(
        self,
        input_ids: np.ndarray,  # [n] int64
        positions: np.ndarray,  # [n] int64
        slot_mapping: np.ndarray,  # [groups, n] int64
        seq_lens: np.ndarray,  # [n] int32
        block_table: np.ndarray,  # [groups, n, nb] int32
        input_patch: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:  # [n, hidden_size], a view of the graph's output (valid until the next replay)
        """``input_patch`` = (dst, src, values): ``input_ids[dst] = values[src]`` on the device before the
        replay (tokens sampled by the previous, still running step)."""
        n = input_ids.shape[0]
        bs = self.padded_size(n)
        nb = block_table.shape[2]
        m, mb, g = self.max_bs, self.max_blocks, self.num_groups
        host_i64, host_i32 = self.host_i64[self._turn], self.host_i32[self._turn]
        self._turn ^= 1
        h64, h32 = host_i64.numpy(), host_i32.numpy()
        h64[:n] = input_ids
        h64[m : m + n] = positions
        slots = h64[2 * m :].reshape(g, m)
        slots[:, :n] = slot_mapping
        h64[n:bs] = 0
        h64[m + n : m + bs] = 0
        slots[:, n:bs] = -1  # padding rows write no keys
        h32[:n] = seq_lens
        h32[n:bs] = 1  # padding rows attend to one (ignored) key
        table = h32[m:].reshape(m, g, mb)
        table[:n, :, :nb] = block_table.transpose(1, 0, 2)
        table[n:bs, :, :nb] = 0
        self.dev_i64.copy_(host_i64, non_blocking=True)
        end = m + bs * g * mb
        self.dev_i32[:end].copy_(host_i32[:end], non_blocking=True)
        if input_patch is not None:
            dst, src, values = input_patch
            self.input_ids[dst] = values[src]
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
