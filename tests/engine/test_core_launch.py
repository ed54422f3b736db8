"""The engine core launched ahead of its client (`core_launch.launch`), as `pagedllm serve` does: with a
``ConfigRecipe`` the core builds its config itself, so it starts before the API process has imported transformers."""

from __future__ import annotations

import argparse
import asyncio
import os

import pytest

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


def test_a_core_built_from_a_recipe_serves_what_a_sent_config_serves(tiny_llama):
    recipe = core_launch.ConfigRecipe(tiny_llama, dict(CPU), {"max_logprobs": 3})
    prompt = [5, 17, 42, 7, 99, 3]

    async def run(launched: core_launch.LaunchedCore | None) -> list[int]:
        engine = AsyncLLM(recipe.build(), launched=launched)
        try:
            return await _greedy(engine, prompt, 12)
        finally:
            engine.shutdown()

    launched = core_launch.launch(recipe)
    from_recipe = asyncio.run(run(launched))
    assert launched.adopted and launched.popen.poll() is not None  # the client owned it and shut it down
    assert not os.path.exists(launched.tmpdir)
    assert from_recipe == asyncio.run(run(None))
    assert recipe.build().model_config.max_logprobs == 3


def test_a_recipe_the_core_refuses_is_the_clients_value_error(tiny_llama):
    """The core's own config check fails: the client raises that ValueError, and nothing is left behind."""
    launched = core_launch.launch(core_launch.ConfigRecipe(tiny_llama, {**CPU, "block_size": 7}))
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        AsyncLLM(core_launch.ConfigRecipe(tiny_llama, dict(CPU)).build(), launched=launched)
    assert launched.popen.poll() is not None
    assert not os.path.exists(launched.tmpdir)


def test_discard_stops_an_unadopted_core_only(tiny_llama):
    launched = core_launch.launch(core_launch.ConfigRecipe(tiny_llama, dict(CPU)))
    launched.discard()
    assert launched.popen.poll() is not None and not os.path.exists(launched.tmpdir)
    launched.discard()  # twice is fine

    adopted = core_launch.launch(core_launch.ConfigRecipe(tiny_llama, dict(CPU)))
    engine = AsyncLLM(core_launch.ConfigRecipe(tiny_llama, dict(CPU)).build(), launched=adopted)
    try:
        adopted.discard()  # the engine owns it now: a no-op
        assert engine.engine_core.proc.is_alive()
        assert asyncio.run(_greedy(engine, [1, 2, 3], 2))
    finally:
        engine.shutdown()


def test_serve_discards_its_launched_core_when_the_config_is_refused(tiny_llama, monkeypatch, capsys):
    """`pagedllm serve` launches the core before building its own config; a flag the config refuses is still a
    usage error (exit 2, naming it), and the launched core is stopped."""
    from pagedllm.entrypoints.openai import serve_cli

    launched = []
    real_launch = core_launch.launch
    monkeypatch.setattr(core_launch, "launch", lambda *a: launched.append(real_launch(*a)) or launched[-1])

    class FakeSocket:
        closed = False

        def close(self) -> None:
            self.closed = True

    sock = FakeSocket()
    monkeypatch.setattr(serve_cli, "_bind", lambda host, port: sock)
    parser = argparse.ArgumentParser()
    serve_cli.add_cli_args(parser)
    args = parser.parse_args([tiny_llama, "--device", "cpu", "--max-model-len", "100000"])
    assert serve_cli.main(args) == 2
    assert "max_model_len (100000) is larger than the model's maximum context" in capsys.readouterr().out
    assert len(launched) == 1 and launched[0].popen.poll() is not None and not os.path.exists(launched[0].tmpdir)
    assert sock.closed
