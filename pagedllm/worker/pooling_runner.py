"""Pooling runner: one step of whole prompts -> one pooled output per request. No KV cache is kept.

Encoder models (BERT, XLM-RoBERTa) attend bidirectionally within each request (``attention/encoder.py``).
Decoder models run their own causal paged attention over scratch caches sized for one step (the token budget
plus a block of rounding per request): each step writes its keys there and reads them back, and the next step
overwrites them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.attention.base import AttentionMetadata, get_attention_backend
from pagedllm.attention.encoder import PoolingBatch
from pagedllm.config import EngineConfig
from pagedllm.pooling.params import PoolingParams
from pagedllm.pooling.pooler import finish_pooled_batch, pool_hidden

logger = logging.getLogger(__name__)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


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

    def _decoder_metadata(self, lens: np.ndarray, cu: np.ndarray) -> AttentionMetadata:
        """Request i's tokens go to consecutive scratch blocks; its block table lists them in order."""
        bs = self.block_size
        num_blocks = (lens + bs - 1) // bs  # [num_reqs]
        first_block = np.concatenate([[0], np.cumsum(num_blocks)[:-1]])  # [num_reqs]
        max_blocks = int(num_blocks.max())
        block_table = (first_block[:, None] + np.arange(max_blocks)[None, :]).astype(
            np.int32
        )  # [num_reqs, max_blocks]
        positions = np.arange(int(cu[-1])) - np.repeat(cu[:-1], lens)  # [num_tokens]
        slot_mapping = np.repeat(first_block, lens) * bs + positions  # [num_tokens] consecutive blocks
        dev = self.device
        qsl_cpu = torch.from_numpy(cu.astype(np.int32))
        seq_lens_cpu = torch.from_numpy(lens.astype(np.int32))
        return AttentionMetadata(
            num_reqs=len(lens),
            num_tokens=int(cu[-1]),
            max_query_len=int(lens.max()),
            max_seq_len=int(lens.max()),
            query_start_loc=qsl_cpu.to(dev),
            seq_lens=seq_lens_cpu.to(dev),
            block_table=torch.from_numpy(block_table).to(dev),
            slot_mapping=torch.from_numpy(slot_mapping.astype(np.int64)).to(dev),
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=seq_lens_cpu,
        )

    @torch.inference_mode()
    def execute(self, inputs: list[PoolingInput]) -> dict[str, list[float]]:
        """Run one step; each request's output (float32 values, on the host): an embedding, class probabilities
        or logits, or the raw pooled hidden state, as its ``params.task`` asks (``pooling/pooler.py``)."""
        lens = np.array([len(x.token_ids) for x in inputs], dtype=np.int64)  # [num_reqs]
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)  # [num_reqs + 1]
        assert int(cu[-1]) <= self.max_num_tokens, (int(cu[-1]), self.max_num_tokens)
        dev = self.device
        input_ids = torch.tensor([t for x in inputs for t in x.token_ids], dtype=torch.long, device=dev)
        positions = torch.from_numpy(np.arange(int(cu[-1])) - np.repeat(cu[:-1], lens)).to(
            dev
        )  # [num_tokens]
        batch = PoolingBatch.build(cu, dev)
        if any(x.token_type_ids is not None for x in inputs):
            types = [t for x in inputs for t in (x.token_type_ids or [0] * len(x.token_ids))]
            batch.token_type_ids = torch.tensor(types, dtype=torch.long, device=dev)  # [num_tokens]
        if self.kv_caches is not None:
            batch.kv_caches = self.kv_caches
            batch.attn_metadata = self._decoder_metadata(lens, cu)
        hidden = self.model(input_ids, positions, batch)  # [num_tokens, hidden_size]
        pooled = self.model.head(pool_hidden(hidden, cu, self.pooler_config.pooling_type))  # [num_reqs, D]
        results = finish_pooled_batch(pooled, [x.params for x in inputs], self.pooler_config)
        return {x.req_id: r for x, r in zip(inputs, results)}

    def shutdown(self) -> None:
        self.kv_caches = None
        self.model = None
