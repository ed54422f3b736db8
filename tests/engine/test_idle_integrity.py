"""The idle-time integrity check: run once per transition to idle, by ``LLMEngine`` and by the engine core
process; a deliberately leaked block is caught, logged and counted, and the engine keeps serving."""

from __future__ import annotations

import asyncio
import logging

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import make_engine_config
from pagedllm.engine import engine_core as engine_core_module
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.engine_core import EngineCore
from pagedllm.metrics import PrometheusStatLogger
from pagedllm.sampling_params import RequestOutputKind

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


class LeakyEngineCore(EngineCore):
    """Leaks one block: the first step that sees a request whose id starts with "leak" holding blocks takes an
    extra reference on its first block (as a missing ``free`` would), so the block outlives the request."""

    def step(self):
        outputs = super().step()
        for req_id, blocks in self.kv_cache_manager.req_to_blocks.items():
            if req_id.startswith("leak") and blocks and not getattr(self, "leaked", False):
                blocks[0].ref_cnt += 1
                self.leaked = True
        return outputs


def make_llm(path: str, **kw) -> LLM:
    return LLM(
        path, dtype="float32", device="cpu", block_size=4, num_gpu_blocks_override=16, max_model_len=48, **kw
    )


def run_one(llm: LLM, request_id: str, corrupt=None) -> None:
    """Run one request to its end through ``LLMEngine``, calling ``corrupt(core)`` after its first step."""
    engine = llm.llm_engine
    engine.add_request(request_id, {"prompt_token_ids": [5, 6, 7, 8, 9]}, PARAMS)
    first = True
    while engine.has_unfinished_requests():
        engine.step()
        if first and corrupt is not None:
            corrupt(engine.engine_core)
        first = False


def bump_own_block(core: EngineCore) -> None:
    (blocks,) = core.kv_cache_manager.req_to_blocks.values()
    blocks[0].ref_cnt += 1  # one reference too many: the block is never freed


def test_llm_engine_catches_a_leak_when_it_goes_idle(tiny_llama, caplog):
    llm = make_llm(tiny_llama)
    engine = llm.llm_engine
    llm.generate("a clean run", PARAMS, use_tqdm=False)
    assert engine.get_stats().num_integrity_failures == 0
    with caplog.at_level(logging.ERROR, logger="pagedllm.engine.engine_core"):
        run_one(llm, "leaky", corrupt=bump_own_block)
    assert engine.get_stats().num_integrity_failures == 1
    assert "ref_cnt 1 != owners 0" in engine.engine_core.last_integrity_error
    assert "INTEGRITY CHECK FAILED" in caplog.text
    # Once per transition to idle, not on every idle step.
    for _ in range(3):
        engine.step()
    assert engine.get_stats().num_integrity_failures == 1
    with pytest.raises(AssertionError, match="ref_cnt"):
        engine.check_integrity()
    # The engine goes on serving (the leaked block stays leaked, so the next idle check fails again).
    out = llm.generate("still serving", PARAMS, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 6
    assert engine.get_stats().num_integrity_failures == 2


def test_idle_check_can_be_turned_off(tiny_llama):
    llm = make_llm(tiny_llama, check_integrity_on_idle=False)
    run_one(llm, "leaky", corrupt=bump_own_block)
    assert llm.llm_engine.get_stats().num_integrity_failures == 0
    with pytest.raises(AssertionError):
        llm.llm_engine.check_integrity()


def test_large_pools_are_checked_in_a_rotating_window(tiny_llama, monkeypatch):
    # As if 16 blocks were a large pool: each idle transition checks 4 of them, so a bad ref count on a free
    # block that no request touches (block 15: the free queue hands out the least recently freed first) is
    # found on the 4th transition, when the window reaches it.
    monkeypatch.setattr(engine_core_module, "IDLE_CHECK_MAX_BLOCKS", 4)
    llm = make_llm(tiny_llama)
    core = llm.llm_engine.engine_core
    core.kv_cache_manager.pool.blocks[15].ref_cnt = 1
    one_block = SamplingParams(temperature=0.0, max_tokens=1)
    for expected_failures in (0, 0, 0, 1):
        llm.generate({"prompt_token_ids": [5, 6]}, one_block, use_tqdm=False)
        assert core.num_integrity_failures == expected_failures
    assert "ref_cnt 1 != owners 0" in core.last_integrity_error


async def test_core_process_catches_a_leak_when_it_goes_idle(tiny_llama):
    config = make_engine_config(
        tiny_llama, dtype="float32", device="cpu", block_size=4, num_gpu_blocks_override=16, max_model_len=48
    )
    metrics = PrometheusStatLogger("tiny")
    engine = AsyncLLM(config, core_cls_path=f"{__name__}:LeakyEngineCore", stat_loggers=[metrics.record])
    try:
        final = SamplingParams(
            temperature=0.0, max_tokens=6, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
        )

        async def run(request_id: str) -> None:
            outs = [o async for o in engine.generate([5, 6, 7, 8, 9], final, request_id)]
            assert len(outs[-1].outputs[0].token_ids) == 6

        await asyncio.wait_for(run("clean"), 60)
        assert (await engine.get_stats()).num_integrity_failures == 0
        await asyncio.wait_for(run("leak-1"), 60)
        # The core ran the check after sending the last outputs, before it read this call.
        stats = await engine.get_stats()
        assert stats.num_integrity_failures == 1
        state = await engine.debug_state()
        assert state["num_requests"] == 0 and state["num_free_blocks"] == state["num_blocks"] - 1
        assert "ref_cnt 1 != owners 0" in state["last_integrity_error"]
        with pytest.raises(AssertionError, match="ref_cnt"):
            await engine.check_integrity()
        # Pushed to the stat loggers without waiting for another request.
        for _ in range(100):
            if engine.last_stats is not None and engine.last_stats.num_integrity_failures == 1:
                break
            await asyncio.sleep(0.02)
        assert b'pagedllm:integrity_check_failures_total{model_name="tiny"} 1.0' in metrics.render()
        # Still serving.
        await asyncio.wait_for(run("after"), 60)
        assert engine.is_running
    finally:
        engine.shutdown()
