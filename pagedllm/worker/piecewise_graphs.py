"""Piecewise CUDA graphs: the steps the decode graphs do not take (prefill chunks mixed with decodes, and decode
batches above the decode graphs' largest size) replay graphs of everything but attention.

Why: an eager forward launches a few hundred kernels, each costing the host 20-60 µs on the lent machines' slow
hosts. For Qwen3-0.6B at 16k tokens a step that is ~31 ms of GPU time cost ~19 ms of launches, which with
scheduling and output handling left the GPU idle for a sixth of the run (docs/benchmarks.md).

What is captured: attention is the only op whose launch depends on more than the step's token count (its grid
comes from the requests: ``num_reqs``, ``max_query_len``, ``max_seq_len``, the leading decodes' split), so the
forward is captured in pieces *between* attention calls, one set per padded token count T (:func:`piecewise_sizes`).
A step of n <= T tokens replays piece 0 (embedding, layer 0's norm, qkv projection, RoPE and its cache write), runs
layer 0's attention eagerly with the step's real metadata, replays piece 1 (o_proj, MLP, layer 1 up to its
attention), and so on; the last piece ends with the final norm (and, when the forward also returns the auxiliary
hidden states an EAGLE-3 draft reads, their concatenation: the layer inputs it reads stay allocated until then, so
no piece overwrites them). Rows n..T are padding: id 0, position 0, slot -1 (nothing written to the cache), and
attention zeroes them.

How the capture splits (:func:`pagedllm.layers.attention.split_at_attention`): while a capture runs,
``Attention.forward`` hands its inputs to :meth:`_Capture.split` instead of attending: the piece being captured
ends, the call is recorded, the next piece begins, and the layer returns a static output buffer that the next
piece reads.

Memory: all pieces of all sizes share one graph pool, captured largest size first. The tensors that cross a split
(q, k, v; the final hidden states) are kept as non-owning views (:func:`_unowned_view`), so the pool may reuse their
memory in later pieces. That is safe: pieces replay in capture order, never concurrently, and the eager attention
reads q/k/v before the next piece runs (the stream orders them); the step's hidden states are read (logits, prompt
logprobs) before the next step replays anything. The attention outputs are one static buffer per shape, shared by
every layer and size (layer i's output is read by piece i + 1 before layer i + 1 writes it).

Inputs: ``input_ids``, ``positions`` and the slot mapping (one row per KV cache group) live in static buffers,
filled by :meth:`PiecewiseGraphRunner.stage` before a replay; the RoPE kernel's cache write reads the slot mapping
inside the pieces, and the step's metadata must carry the same buffers (``stage`` returns them).
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pagedllm.attention.base import AttentionMetadata
from pagedllm.layers.attention import Attention, split_at_attention
from pagedllm.worker.graph_io import map_output
from pagedllm.worker.graph_io import unowned_view as _unowned_view

logger = logging.getLogger(__name__)

# Above this many tokens a step's GPU time dwarfs its launches: such steps stay eager (and capture stays short).
_MAX_PIECEWISE_TOKENS = 16384


def piecewise_sizes(max_num_tokens: int) -> list[int]:
    """The padded token counts captured: powers of two from 16 to 1024, then every 512 to 4096, then every 1024,
    up to ``min(max_num_tokens, 16384)``, which is always one of them (so every step up to it has a size)."""
    top = min(max_num_tokens, _MAX_PIECEWISE_TOKENS)
    sizes = (
        [16, 32, 64, 128, 256, 512, 1024] + list(range(1536, 4097, 512)) + list(range(5120, top + 1, 1024))
    )
    sizes = [s for s in sizes if s < top]
    return sizes + [top] if top >= 1 else []


@dataclass
class _AttentionCall:
    layer: Attention
    query: torch.Tensor  # [T, num_heads, head_dim] (unowned)
    key: torch.Tensor  # [T, num_kv_heads, head_dim] (unowned)
    value: torch.Tensor  # [T, num_kv_heads, head_dim] (unowned)
    kv_cache: torch.Tensor
    kv_written: bool  # the piece before wrote this step's keys and values (RoPE kernel)
    out: torch.Tensor  # [T, num_heads, head_dim], a view of a static buffer


@dataclass
class _Pieces:
    """One token count's capture: ``graphs[i]`` runs before ``calls[i]``; ``graphs[-1]`` ends the forward."""

    graphs: list[Any] = field(default_factory=list)
    calls: list[_AttentionCall] = field(default_factory=list)
    # [T, hidden_size] (unowned), or a tuple of such views when the forward returns more than its final hidden
    # states (an EAGLE-3 draft's auxiliary hidden states, [T, 3 * hidden_size])
    output: Any = None


class _Capture:
    """The splitter ``Attention.forward`` calls while one token count's forward is captured."""

    def __init__(self, runner: PiecewiseGraphRunner, pool: Any) -> None:
        self.runner = runner
        self.pool = pool
        self.pieces = _Pieces()
        self._graph: Any = None

    def begin(self) -> None:
        self._graph = self.runner.graph_cls()
        self._graph.capture_begin(pool=self.pool)

    def end(self) -> None:
        self._graph.capture_end()
        self.pieces.graphs.append(self._graph)
        self._graph = None

    def abandon(self) -> None:
        """After a failure mid-capture: end the open capture if there is one (its graph is dropped)."""
        graph, self._graph = self._graph, None
        if graph is not None:
            try:
                graph.capture_end()
            except Exception:  # the capture was invalidated; ending it is all that was needed
                pass

    def split(
        self,
        layer: Attention,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        kv_written: bool,
    ) -> torch.Tensor:
        self.end()
        out = self.runner.attention_out(query)
        views = [_unowned_view(t) for t in (query, key, value)]
        self.pieces.calls.append(_AttentionCall(layer, *views, kv_cache, kv_written, out))
        self.begin()
        return out


class PiecewiseGraphRunner:
    def __init__(
        self,
        forward: Callable[..., Any],
        kv_caches: list[torch.Tensor],
        sizes: list[int],
        device: torch.device,
        num_kv_groups: int = 1,
        graph_cls: Callable[[], Any] | None = None,
    ) -> None:
        """``forward(input_ids, positions, kv_caches, metadata)`` -> hidden states: the model's forward, whose
        attention layers are :class:`~pagedllm.layers.attention.Attention` modules. ``graph_cls``: the graph
        type (``torch.cuda.CUDAGraph``; tests pass a stand-in)."""
        self.forward = forward
        self.kv_caches = kv_caches
        self.sizes = sorted(sizes)
        self.device = device
        self.graph_cls = graph_cls or torch.cuda.CUDAGraph
        self.num_groups = g = num_kv_groups
        t = self.max_tokens = self.sizes[-1]
        # Static inputs, one flat buffer (one host-to-device copy a step): [input_ids (t) | positions (t) | slots
        # (groups * t)], and two pinned host twins used in turn (the previous step's copy may still be queued).
        self.dev_i64 = torch.zeros((2 + g) * t, dtype=torch.long, device=device)
        self.input_ids = self.dev_i64[:t]
        self.positions = self.dev_i64[t : 2 * t]
        self.slot_mapping = self.dev_i64[2 * t :].view(g, t)  # [groups, t]
        self.slot_mapping.fill_(-1)
        pin = device.type == "cuda"
        self.host_i64 = [torch.zeros((2 + g) * t, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        # Recorded after each twin's copy; a twin is refilled only once its last copy ran. (The decode runner can
        # rely on sampled ids being read back every step; a prefill-only step samples nothing, so here nothing
        # else keeps the host from running two steps ahead of the stream.)
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self._attention_out: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}
        self.pieces: dict[int, _Pieces] = {}
        self.num_replays: dict[int, int] = {}

    def padded_size(self, num_tokens: int) -> int | None:
        """The captured token count a step of ``num_tokens`` tokens replays (None: none fits, run it eagerly)."""
        i = bisect.bisect_left(self.sizes, num_tokens)
        return self.sizes[i] if i < len(self.sizes) and self.sizes[i] in self.pieces else None

    def attention_out(self, query: torch.Tensor) -> torch.Tensor:
        """The static attention output for ``query``'s shape ``[T, num_heads, head_dim]``: ``[:T]`` of one buffer
        per (heads, head_dim, dtype), shared by every layer and size."""
        t, h, d = query.shape
        key = (h, d, query.dtype)
        buf = self._attention_out.get(key)
        if buf is None:
            buf = torch.zeros(self.max_tokens, h, d, dtype=query.dtype, device=query.device)
            self._attention_out[key] = buf
        return buf[:t]

    def _dummy_metadata(self, size: int) -> AttentionMetadata:
        """Metadata of a capture-time step: ``size`` requests of one token, one key each, read from block 0;
        slots from the static buffer (-1: nothing written). Only the warm-up's eager attention reads it."""
        dev = self.device
        qsl = torch.arange(size + 1, dtype=torch.int32)
        seq = torch.ones(size, dtype=torch.int32)
        table = torch.zeros(size, 1, dtype=torch.int32, device=dev)
        return AttentionMetadata(
            num_reqs=size,
            num_tokens=size,
            max_query_len=1,
            max_seq_len=1,
            query_start_loc=qsl.to(dev),
            seq_lens=seq.to(dev),
            block_table=table,
            slot_mapping=self.slot_mapping[0, :size],
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq,
            is_pure_decode=True,
            kv_group_tables=tuple((table, self.slot_mapping[g, :size]) for g in range(1, self.num_groups)),
        )

    @torch.inference_mode()
    def capture(self, num_attention_layers: int) -> bool:
        """Capture every size, largest first. False (and nothing kept: those steps stay eager) when the model has
        no attention layer, when a forward did not make exactly ``num_attention_layers`` attention calls (some
        attention does not go through ``Attention`` and would be baked into a piece with the capture's metadata),
        or when a capture failed (logged)."""
        if num_attention_layers < 1:
            return False
        try:
            return self._capture(num_attention_layers)
        except Exception:  # e.g. an op that cannot be captured: those steps stay eager
            logger.exception("piecewise CUDA graphs off: the capture failed")
            self.pieces.clear()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return False

    def _capture(self, num_attention_layers: int) -> bool:
        start = time.perf_counter()
        cuda = self.device.type == "cuda"
        pool = torch.cuda.graph_pool_handle() if cuda else None
        stream = torch.cuda.Stream(self.device) if cuda else None
        if cuda:
            stream.wait_stream(torch.cuda.current_stream(self.device))  # the static buffers' fills come first
        for size in reversed(self.sizes):
            meta = self._dummy_metadata(size)
            args = (self.input_ids[:size], self.positions[:size], self.kv_caches, meta)
            with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
                # Warm-up: Triton compiles and library set-up happen outside capture. The largest size and the
                # small ones meet every variant (the sizes are multiples of 16, so the kernels' integer
                # specializations agree); the sizes between would only add GPU time to start-up (~0.4 s for an
                # 8B model at 16k tokens).
                if size == self.sizes[-1] or size <= 1024:
                    self.forward(*args)
                if cuda:
                    torch.cuda.synchronize(self.device)
                    # The warm-up's activations, cached by the allocator, go back to the device before the
                    # private pool takes its own (as torch.cuda.graph does before a capture).
                    torch.cuda.empty_cache()
                capture = _Capture(self, pool)
                try:
                    with split_at_attention(capture):
                        capture.begin()
                        hidden = self.forward(*args)
                        capture.end()
                except BaseException:
                    capture.abandon()
                    raise
            if len(capture.pieces.calls) != num_attention_layers:
                logger.warning(
                    "piecewise CUDA graphs off: a forward made %d Attention calls, the model has %d attention layers",
                    len(capture.pieces.calls),
                    num_attention_layers,
                )
                self.pieces.clear()
                return False
            capture.pieces.output = map_output(_unowned_view, hidden)
            self.pieces[size] = capture.pieces
        if cuda:
            torch.cuda.synchronize(self.device)
        logger.info(
            "captured piecewise CUDA graphs for %d token counts (%d..%d), %d pieces each, in %.1f s",
            len(self.sizes),
            self.sizes[0],
            self.sizes[-1],
            num_attention_layers + 1,
            time.perf_counter() - start,
        )
        return True

    def stage(
        self,
        input_ids: np.ndarray,  # [n] int64
        positions: np.ndarray,  # [n] int64
        slot_mapping: np.ndarray,  # [groups, n] int64
        size: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Copy a step's inputs into the static buffers, padded to ``size`` rows; returns the device views
        ``(input_ids [size], positions [size], slot_mapping [groups, size])`` the step's metadata must use."""
        n, t = input_ids.shape[0], self.max_tokens
        turn = self._turn
        self._turn ^= 1
        host = self.host_i64[turn]
        if self._copied[turn] is not None:
            self._copied[turn].synchronize()  # its previous copy to the device has run (rarely waits)
        h = host.numpy()
        h[:n] = input_ids
        h[n:size] = 0
        h[t : t + n] = positions
        h[t + n : t + size] = 0
        slots = h[2 * t :].reshape(self.num_groups, t)
        slots[:, :n] = slot_mapping
        slots[:, n:size] = -1  # padding rows write no keys
        self.dev_i64.copy_(host, non_blocking=True)
        if self.device.type == "cuda":
            event = self._copied[turn] or torch.cuda.Event()
            event.record()
            self._copied[turn] = event
        return self.input_ids[:size], self.positions[:size], self.slot_mapping[:, :size]

    def replay(self, size: int, metadata: AttentionMetadata) -> Any:
        """Run the step staged by :meth:`stage` (``metadata``: its real requests, with the staged slot mapping).
        Returns the hidden states ``[size, hidden_size]`` (or the tuple the forward returns, each ``[size, ...]``),
        valid until the next replay."""
        pieces = self.pieces[size]
        graphs = pieces.graphs
        for i, call in enumerate(pieces.calls):
            graphs[i].replay()
            call.layer.forward(
                call.query,
                call.key,
                call.value,
                call.kv_cache,
                metadata,
                kv_written=call.kv_written,
                out=call.out,
            )
        graphs[-1].replay()
        self.num_replays[size] = self.num_replays.get(size, 0) + 1
        return pieces.output
