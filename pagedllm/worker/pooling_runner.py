"""Pooling runner: one step of whole prompts -> one pooled output per request. No KV cache is kept.

Encoder models (BERT, XLM-RoBERTa) attend bidirectionally within each request (``attention/encoder.py``).
Decoder models run their own causal paged attention over scratch caches sized for one step (the token budget
plus a block of rounding per request): each step writes its keys there and reads them back, and the next step
overwrites them (after this one: the device runs the steps in order on one stream).

``launch`` only queues a step: on CUDA its inputs go up through pinned memory with asynchronous copies, the
pooled outputs are finished on the device (float32, normalized...) and copied back into pinned buffers behind an
event, and nothing waits for the device until ``PooledStep.results()``.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.attention.base import AttentionMetadata, get_attention_backend
from pagedllm.attention.encoder import PoolingBatch
from pagedllm.config import EngineConfig
from pagedllm.pooling.params import PoolingParams
from pagedllm.pooling.pooler import finish_pooled_groups, pool_hidden

logger = logging.getLogger(__name__)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PooledStep:
    """A step queued on the device: its requests, in order, and where their outputs land on the host."""

    __slots__ = ("req_ids", "_groups", "_event")

    def __init__(
        self,
        req_ids: list[str],
        groups: list[tuple[list[int], torch.Tensor]],
        event: torch.cuda.Event | None,
    ) -> None:
        self.req_ids = req_ids
        # (request indices, [n, D] float32 host tensor): pinned buffers the device copies into on CUDA
        self._groups = groups
        self._event = event  # recorded after the copies (CUDA); None: already done

    def results(self) -> list[np.ndarray]:
        """Wait for the step; each request's output as a float32 row, in ``req_ids`` order. The rows of a group
        share one (pageable) host array: the pinned buffers go back to their pool."""
        if self._event is not None:
            self._event.synchronize()
        out: list[np.ndarray] = [None] * len(self.req_ids)  # type: ignore[list-item]
        for indices, host in self._groups:
            values = host.numpy()
            if self._event is not None:
                values = values.copy()  # off the pinned buffer
            for i, row in zip(indices, values):
                out[i] = row
        return out


@dataclass
class PoolingInput:
    """One request of a pooling step: its whole prompt."""

    req_id: str
    token_ids: list[int]
    params: PoolingParams
    token_type_ids: list[int] | None = None  # BERT segment ids of a text pair (None: all 0)


class PoolingRunner:
    def __init__(self, config: EngineConfig) -> None:
        from pagedllm.model_loader import get_model
        from pagedllm.models.decoder_pooling import DecoderEmbeddingModel

        self.config = config
        mc = config.model_config
        self.device = config.device_config.device
        self.dtype = mc.dtype
        self.pooler_config = mc.pooler_config
        config.scheduler_config.resolve_defaults(self.device)
        self.max_num_tokens = config.scheduler_config.max_num_batched_tokens
        self.max_num_reqs = config.scheduler_config.max_num_seqs
        self.block_size = config.cache_config.block_size
        torch.manual_seed(mc.seed)
        t0 = time.perf_counter()
        self.attn_backend = get_attention_backend(self.device, config.attention_backend)
        self.model = get_model(mc, self.device, self.attn_backend)
        logger.info(
            "loaded pooling model %s in %.2fs (%s, %s)",
            mc.model,
            time.perf_counter() - t0,
            self.dtype,
            self.device,
        )
        self.kv_caches: list[torch.Tensor] | None = None
        if isinstance(self.model, DecoderEmbeddingModel):
            num_blocks = _cdiv(self.max_num_tokens, self.block_size) + self.max_num_reqs
            shape = (2, num_blocks, self.block_size, mc.num_kv_heads, mc.head_dim)
            self.kv_caches = [
                torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(mc.num_layers)
            ]

    def _upload(self, array: np.ndarray) -> torch.Tensor:
        """A host array on the device without waiting for the device: on CUDA through pinned memory with an
        asynchronous copy (a pageable copy would first wait for the step still running there)."""
        t = torch.from_numpy(array)
        if self.device.type != "cuda":
            return t.to(self.device)
        return t.pin_memory().to(self.device, non_blocking=True)

    def _decoder_metadata(self, lens: np.ndarray, cu: np.ndarray, positions: np.ndarray) -> AttentionMetadata:
        """Request i's tokens go to consecutive scratch blocks; its block table lists them in order."""
        bs = self.block_size
        num_blocks = (lens + bs - 1) // bs  # [num_reqs]
        first_block = np.concatenate([[0], np.cumsum(num_blocks)[:-1]])  # [num_reqs]
        max_blocks = int(num_blocks.max())
        block_table = (first_block[:, None] + np.arange(max_blocks)[None, :]).astype(
            np.int32
        )  # [num_reqs, max_blocks]
        slot_mapping = np.repeat(first_block, lens) * bs + positions  # [num_tokens] consecutive blocks
        qsl_cpu = torch.from_numpy(cu.astype(np.int32))
        seq_lens_cpu = torch.from_numpy(lens.astype(np.int32))
        return AttentionMetadata(
            num_reqs=len(lens),
            num_tokens=int(cu[-1]),
            max_query_len=int(lens.max()),
            max_seq_len=int(lens.max()),
            query_start_loc=self._upload(qsl_cpu.numpy()),
            seq_lens=self._upload(seq_lens_cpu.numpy()),
            block_table=self._upload(block_table),
            slot_mapping=self._upload(slot_mapping.astype(np.int64)),
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=seq_lens_cpu,
        )

    @torch.inference_mode()
    def launch(self, inputs: list[PoolingInput]) -> PooledStep:
        """Queue one step on the device and return without waiting for it: ``PooledStep.results()`` waits and
        gives each request's output (float32 values on the host): an embedding, class probabilities or logits,
        or the raw pooled hidden state, as its ``params.task`` asks (``pooling/pooler.py``). On CUDA nothing
        here waits for the device, so the host can prepare the next step while this one runs."""
        lens = np.fromiter(
            (len(x.token_ids) for x in inputs), dtype=np.int64, count=len(inputs)
        )  # [num_reqs]
        cu = np.zeros(len(inputs) + 1, dtype=np.int64)  # [num_reqs + 1]
        np.cumsum(lens, out=cu[1:])
        num_tokens = int(cu[-1])
        assert num_tokens <= self.max_num_tokens, (num_tokens, self.max_num_tokens)
        ids = np.fromiter(
            itertools.chain.from_iterable(x.token_ids for x in inputs), dtype=np.int64, count=num_tokens
        )  # [num_tokens]
        positions = np.arange(num_tokens) - np.repeat(cu[:-1], lens)  # [num_tokens] position in its request
        batch = PoolingBatch.build(cu, self.device, upload=self._upload, positions=positions)
        if any(x.token_type_ids is not None for x in inputs):
            types = np.fromiter(
                itertools.chain.from_iterable(x.token_type_ids or [0] * len(x.token_ids) for x in inputs),
                dtype=np.int64,
                count=num_tokens,
            )
            batch.token_type_ids = self._upload(types)  # [num_tokens]
        if self.kv_caches is not None:
            batch.kv_caches = self.kv_caches
            batch.attn_metadata = self._decoder_metadata(lens, cu, positions)
        pooling_type = self.pooler_config.pooling_type
        if pooling_type == "CLS":
            pool_index = self._upload(cu[:-1].copy())
        elif pooling_type == "LAST":
            pool_index = self._upload(cu[1:] - 1)
        else:
            pool_index = None
        hidden = self.model(self._upload(ids), self._upload(positions), batch)  # [num_tokens, hidden_size]
        pooled = self.model.head(
            pool_hidden(hidden, cu, pooling_type, index=pool_index, owner=batch.owner)
        )  # [num_reqs, D]
        groups = finish_pooled_groups(pooled, [x.params for x in inputs], self.pooler_config)
        event = None
        if self.device.type == "cuda":
            staged = []
            for indices, values in groups:
                host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
                host.copy_(values, non_blocking=True)
                staged.append((indices, host))
            groups = staged
            event = torch.cuda.Event()
            event.record()
        else:
            groups = [(indices, values.cpu()) for indices, values in groups]
        return PooledStep([x.req_id for x in inputs], groups, event)

    def execute(self, inputs: list[PoolingInput]) -> dict[str, np.ndarray]:
        """``launch`` and wait: each request's output by id."""
        step = self.launch(inputs)
        return dict(zip(step.req_ids, step.results()))

    def shutdown(self) -> None:
        self.kv_caches = None
        self.model = None
