"""The offloading connector's worker side on CPU tensors: blocks saved after a step come back bit for bit, for
the usual cache layout and for one indexed by blocks in dimension 0 (MLA's), with layers sharing a tensor."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedllm.config import KVTransferConfig
from pagedllm.kv_transfer.base import KVConnectorRole
from pagedllm.kv_transfer.cpu_offloading import OffloadingConnector, OffloadingMetadata


def make_worker(num_cpu_blocks: int = 4) -> OffloadingConnector:
    config = SimpleNamespace(
        kv_transfer_config=KVTransferConfig(
            "OffloadingConnector", kv_connector_extra_config={"num_cpu_blocks": num_cpu_blocks}
        ),
        cache_config=SimpleNamespace(block_size=4),
    )
    return OffloadingConnector(config, KVConnectorRole.WORKER, kv_block_bytes=1)


@pytest.mark.parametrize("shape, block_dim", [((2, 6, 4, 2, 8), 1), ((6, 4, 24), 0)])
def test_saved_blocks_load_back_exactly(shape, block_dim):
    torch.manual_seed(0)
    layer0, layer1 = torch.randn(shape), torch.randn(shape)
    caches = [layer0, layer1, layer0]  # a tensor shared by two layers is copied once
    worker = make_worker()
    worker.register_kv_caches(caches, block_dim)
    assert len(worker._dev_caches) == 2
    want = [c.narrow(block_dim, 3, 1).clone() for c in (layer0, layer1)]
    worker.begin_step(OffloadingMetadata(stores=[(3, 1)]), len(caches))
    out = worker.end_step(set())
    assert out.is_empty()
    for c in (layer0, layer1):
        c.narrow(block_dim, 5, 1).zero_()
    worker.begin_step(OffloadingMetadata(loads=[(1, 5)], load_req_ids=["r"]), len(caches))
    out = worker.end_step(set())
    assert out.finished_recving == {"r"} and not out.invalid_block_ids
    for c, w in zip((layer0, layer1), want):
        assert torch.equal(c.narrow(block_dim, 5, 1), w)


def test_many_blocks_through_a_small_staging_buffer_and_pool_chunks(monkeypatch):
    """More blocks than the staging buffer holds, slots in runs and out of order across pool chunks: every block
    comes back where it was sent."""
    from pagedllm.kv_transfer import cpu_offloading

    torch.manual_seed(0)
    layer0, layer1 = torch.randn(2, 12, 4, 2, 8), torch.randn(2, 12, 4, 2, 8).to(torch.bfloat16)
    slot_bytes = 2 * 4 * 2 * 8 * (4 + 2)  # one block of each
    monkeypatch.setattr(cpu_offloading, "STAGING_SLOTS", 3)
    monkeypatch.setattr(cpu_offloading, "POOL_CHUNK_BYTES", 4 * slot_bytes)
    worker = make_worker(num_cpu_blocks=10)
    worker.register_kv_caches([layer0, layer1], 1)
    assert worker._staging.shape[0] == 3 and len(worker._pool) == 3  # chunks of 4, 4 and 2 slots
    stores = [(0, 2), (1, 3), (2, 4), (3, 5), (4, 9), (5, 0), (6, 1), (7, 8)]  # (device block, slot)
    want = {b: (layer0[:, b].clone(), layer1[:, b].clone()) for b, _ in stores}
    worker.begin_step(OffloadingMetadata(stores=stores), 2)
    worker.end_step(set())
    layer0.zero_()
    layer1.zero_()
    loads = [(slot, 11 - b) for b, slot in stores]  # every block into another device block
    worker.begin_step(OffloadingMetadata(loads=loads, load_req_ids=["r"]), 2)
    worker.end_step(set())
    for b, _ in stores:
        assert torch.equal(layer0[:, 11 - b], want[b][0]) and torch.equal(layer1[:, 11 - b], want[b][1])
