"""The engine core launched ahead of its client (`core_launch.launch`), as `pagedllm serve` does: the core loads the
model while the API process imports the engine client, the tokenizer and the server."""

from __future__ import annotations

import asyncio
import os

import pytest

from pagedllm.config import make_engine_config
from pagedllm.engine import core_launch
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.sampling_params import SamplingParams

CPU = {"device": "cpu", "dtype": "float32", "max_model_len": 256, "num_gpu_blocks_override": 64}


async def _greedy(engine: AsyncLLM, prompt: list[int], n: int) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    final = None
    async for out in engine.generate({"prompt_token_ids": prompt}, params, request_id="r"):
        final = out
    return list(final.outputs[0].token_ids)


def test_an_adopted_core_serves_what_a_fresh_one_serves(tiny_llama):
    config = make_engine_config(tiny_llama, **CPU)
    prompt = [5, 17, 42, 7, 99, 3]

    async def run(launched: core_launch.LaunchedCore | None) -> list[int]:
        engine = AsyncLLM(config, launched=launched)
        try:
            return await _greedy(engine, prompt, 12)
        finally:
            engine.shutdown()

    launched = core_launch.launch(config)
    adopted = asyncio.run(run(launched))
    assert launched.adopted and launched.popen.poll() is not None  # the client owned it and shut it down
    assert not os.path.exists(launched.tmpdir)
    assert adopted == asyncio.run(run(None))


def test_a_launched_core_that_fails_to_start_is_the_clients_error(tiny_llama):
    """A core that cannot start (here: the wrong engine class) reports through the adopting client, and nothing
    is left behind."""
    config = make_engine_config(tiny_llama, **CPU)
    launched = core_launch.launch(config, "pagedllm.engine.engine_core:NoSuchCore")
    with pytest.raises(ValueError, match="runs pagedllm.engine.engine_core:NoSuchCore"):
        AsyncLLM(config, launched=launched)  # a client for the default core class refuses it
    assert launched.popen.poll() is not None and not os.path.exists(launched.tmpdir)

    launched = core_launch.launch(config, "pagedllm.engine.engine_core:NoSuchCore")
    with pytest.raises(RuntimeError, match="NoSuchCore"):
        AsyncLLM(config, launched=launched, core_cls_path="pagedllm.engine.engine_core:NoSuchCore")
    assert launched.popen.poll() is not None and not os.path.exists(launched.tmpdir)


def test_discard_stops_an_unadopted_core_only(tiny_llama):
    config = make_engine_config(tiny_llama, **CPU)
    launched = core_launch.launch(config)
    launched.discard()
    assert launched.popen.poll() is not None and not os.path.exists(launched.tmpdir)
    launched.discard()  # twice is fine

    adopted = core_launch.launch(config)
    engine = AsyncLLM(config, launched=adopted)
    try:
        adopted.discard()  # the engine owns it now: a no-op
        assert engine.engine_core.proc.is_alive()
        assert asyncio.run(_greedy(engine, [1, 2, 3], 2))
    finally:
        engine.shutdown()
