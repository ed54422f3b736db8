"""Sleep mode: ``LLM.sleep(level)`` releases the weights (level 1: kept on the host; level 2: discarded) and the
KV cache, ``wake_up(tags)`` brings them back, and greedy outputs after waking equal those before (level 2 once
the weights are written again). Generating while asleep and sleeping without ``enable_sleep_mode`` are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from pagedllm import LLM
from tests.utils import ROLLOUT_ENGINE as ENGINE
from tests.utils import greedy_ids as greedy


def _released_bytes(worker) -> tuple[int, int]:
    """(bytes still held by the model's parameters, by the KV cache) on this worker."""
    params = sum(p.untyped_storage().nbytes() for p in worker.model.parameters())
    kv = sum(t.untyped_storage().nbytes() for t in worker.model_runner.kv_caches)
    return params, kv


@pytest.fixture(scope="module")
def sleepy(tiny_llama):
    with LLM(tiny_llama, enable_sleep_mode=True, **ENGINE) as llm:
        yield llm


@pytest.fixture(scope="module")
def reference(sleepy) -> list[list[int]]:
    return greedy(sleepy)


def _state_dict(path: str) -> dict:
    state = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        state.update(load_file(f))
    return state


def test_level1_sleep_and_wake_give_identical_outputs(sleepy, reference):
    kv = sleepy.llm_engine.engine_core.kv_cache_manager
    assert kv.pool.cached_blocks  # the reference prompts' blocks
    sleepy.sleep(level=1)
    assert sleepy.is_sleeping()
    assert not kv.pool.cached_blocks  # the prefix cache was reset
    assert sleepy.collective_rpc(_released_bytes) == [(0, 0)]
    with pytest.raises(RuntimeError, match="sleeping"):
        greedy(sleepy)
    sleepy.wake_up()
    assert not sleepy.is_sleeping()
    assert greedy(sleepy) == reference
    sleepy.llm_engine.check_integrity()


def test_partial_wake_up(sleepy, reference):
    sleepy.sleep(level=1)
    sleepy.wake_up(tags=["kv_cache"])
    assert sleepy.is_sleeping() and sleepy.collective_rpc("sleeping_tags") == [["weights"]]
    params, kv = sleepy.collective_rpc(_released_bytes)[0]
    assert params == 0 and kv > 0
    with pytest.raises(RuntimeError, match="weights"):
        greedy(sleepy)
    sleepy.wake_up(tags=["weights"])
    assert not sleepy.is_sleeping()
    assert greedy(sleepy) == reference


def test_level2_then_weight_update_gives_identical_outputs(sleepy, reference, tiny_llama):
    state = _state_dict(tiny_llama)
    sleepy.sleep(level=2)
    with pytest.raises(RuntimeError, match="asleep"):
        sleepy.update_weights(state.items())
    sleepy.wake_up(tags=["weights"])  # memory back, values discarded
    assert sleepy.update_weights(state.items()) == len(state)
    sleepy.wake_up(tags=["kv_cache"])
    assert greedy(sleepy) == reference


def test_level2_then_reload_from_checkpoint(sleepy, reference, tiny_llama):
    sleepy.sleep(level=2)
    sleepy.wake_up()
    assert sleepy.collective_rpc("reload_weights") == [len(_state_dict(tiny_llama))]
    assert greedy(sleepy) == reference


def test_refusals(sleepy, tiny_llama):
    with pytest.raises(ValueError, match="level"):
        sleepy.sleep(level=3)
    with pytest.raises(ValueError, match="tags"):
        sleepy.wake_up(tags=["everything"])
    with pytest.raises(ValueError, match="tags"):
        sleepy.wake_up(tags="weights")
    assert not sleepy.is_sleeping()
    with LLM(tiny_llama, **ENGINE) as plain:
        with pytest.raises(ValueError, match="enable_sleep_mode"):
            plain.sleep()
        with pytest.raises(ValueError, match="enable_sleep_mode"):
            plain.wake_up()
        assert not plain.is_sleeping()
    with pytest.raises(ValueError, match="enable_sleep_mode"):
        LLM(
            tiny_llama,
            enable_sleep_mode=True,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
            **ENGINE,
        )


def test_sleep_refused_while_a_request_is_unfinished(sleepy, reference):
    from pagedllm import SamplingParams

    engine = sleepy.llm_engine
    engine.add_request("unfinished", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4))
    with pytest.raises(RuntimeError, match="unfinished"):
        sleepy.sleep(level=1)
    assert not sleepy.is_sleeping()
    engine.abort_request("unfinished")
    assert greedy(sleepy) == reference


def test_shutdown_while_asleep(tiny_llama):
    llm = LLM(tiny_llama, enable_sleep_mode=True, **ENGINE)
    llm.sleep(level=2)
    llm.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        llm.wake_up()


@pytest.mark.gpu
def test_gpu_sleep_returns_device_memory_and_wakes_with_graphs(tiny_llama):
    import torch

    kv_bytes = 256 * 2**20
    with LLM(
        tiny_llama,
        dtype="bfloat16",
        device="cuda",
        kv_cache_memory_bytes=kv_bytes,
        max_model_len=256,
        enable_sleep_mode=True,
    ) as llm:
        runner = llm.llm_engine.engine_core.runner
        reference = greedy(llm)
        assert runner.graph_runner is not None
        held = torch.cuda.memory_reserved()
        llm.sleep(level=1)
        assert runner.graph_runner is None
        assert torch.cuda.memory_reserved() < held - kv_bytes * 3 // 4  # handed back to the driver
        llm.wake_up()
        assert runner.graph_runner is not None  # captured again over the memory's new addresses
        assert greedy(llm) == reference
