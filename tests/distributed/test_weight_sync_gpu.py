"""Weights broadcast over NCCL: a trainer process on ``cuda:1`` sends a checkpoint to an engine on ``cuda:0``
through ``init_weight_update_group`` / ``update_weight``; outputs then equal a fresh engine loaded with it.
Skipped with fewer than two GPUs."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from pagedllm import LLM
from tests.distributed.rl_workers import BAD_TENSOR, checkpoint_tensors, trainer_broadcast
from tests.entrypoints.server_utils import free_port
from tests.utils import greedy_ids

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

ENGINE = dict(dtype="float32", device="cuda", kv_cache_memory_bytes=64 * 2**20, max_model_len=256)


def test_nccl_broadcast_from_trainer_on_another_gpu(tiny_llama, updated_tiny_llama):
    with LLM(updated_tiny_llama[0], **ENGINE) as fresh:
        expected = greedy_ids(fresh)
    with LLM(tiny_llama, enable_sleep_mode=True, **ENGINE) as llm:
        assert greedy_ids(llm) != expected
        llm.sleep(level=2)  # the weights go, then come back holding nothing until the trainer sends them
        llm.wake_up(tags=["weights"])
        port = free_port()
        trainer = multiprocessing.get_context("spawn").Process(
            target=trainer_broadcast, args=(port, 2, updated_tiny_llama[0], "cuda:1"), daemon=True
        )
        trainer.start()
        try:
            llm.collective_rpc("init_weight_update_group", args=("127.0.0.1", port, 1, 2))
            with pytest.raises(ValueError, match=BAD_TENSOR[0].replace(".", r"\.")):
                llm.collective_rpc("update_weight", args=(BAD_TENSOR[0], torch.float32, BAD_TENSOR[1]))
            for name, tensor in checkpoint_tensors(updated_tiny_llama[0]):
                llm.collective_rpc("update_weight", args=(name, tensor.dtype, tuple(tensor.shape)))
            trainer.join(120)
            assert trainer.exitcode == 0
        finally:
            llm.collective_rpc("destroy_weight_update_group")
            if trainer.is_alive():
                trainer.kill()
                trainer.join()
        llm.wake_up(tags=["kv_cache"])  # CUDA graphs captured again here
        assert greedy_ids(llm) == expected
