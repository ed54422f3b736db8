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


class _FakeLaunched:
    def __init__(self, events: list, config) -> None:
        self.events, self.config = events, config

    def discard(self) -> None:
        self.events.append("discard")


def _serve_main(tiny_llama, monkeypatch, events: list, extra_args: tuple[str, ...] = ()) -> dict:
    """`pagedllm serve tiny_llama --device cpu` up to the engine: what it launched and handed on, in order."""
    import argparse
    import signal

    import pagedllm.config
    from pagedllm.entrypoints.openai import serve_cli

    served: dict = {}

    async def fake_serve(args, config, sock, **kwargs):
        served.update(config=config, launched=kwargs["launched"])
        events.append("serve")
        return 0

    def make(*a, **kw):
        events.append("configure")
        return make_engine_config(*a, **kw)  # the real one (a second call in one test finds this wrapper set)

    def launch(config, *a):
        events.append("launch")
        return _FakeLaunched(events, config)

    monkeypatch.setattr(serve_cli, "_serve", fake_serve)
    monkeypatch.setattr(serve_cli, "_bind", lambda host, port: type("Socket", (), {"close": lambda self: None})())
    monkeypatch.setattr(signal, "signal", lambda *a: None)
    monkeypatch.setattr(pagedllm.config, "make_engine_config", make)
    monkeypatch.setattr(core_launch, "launch", launch)
    parser = argparse.ArgumentParser()
    serve_cli.add_cli_args(parser)
    assert serve_cli.main(parser.parse_args([tiny_llama, "--device", "cpu", *extra_args])) == 0
    return served


def test_serve_launches_its_core_with_a_kept_config_before_building_its_own(tiny_llama, monkeypatch, tmp_path):
    """The first start builds the config, then launches the core, and keeps the config; the next start with the
    same inputs launches the core with the kept config first, builds its own meanwhile, and keeps that core
    because the two are equal."""
    import pickle

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    events: list = []
    first = _serve_main(tiny_llama, monkeypatch, events)
    assert events == ["configure", "launch", "serve", "discard"]  # discard: no engine adopted the fake core
    assert len(list((tmp_path / "serve_configs").glob("*.pkl"))) == 1

    events.clear()
    second = _serve_main(tiny_llama, monkeypatch, events)
    assert events == ["launch", "configure", "serve", "discard"]
    assert pickle.dumps(second["launched"].config) == pickle.dumps(second["config"]) == pickle.dumps(first["config"])

    events.clear()  # other inputs, another key: built first again
    _serve_main(tiny_llama, monkeypatch, events, ("--max-model-len", "128"))
    assert events == ["configure", "launch", "serve", "discard"]


def test_serve_replaces_a_kept_config_that_differs(tiny_llama, monkeypatch, tmp_path):
    """A kept config that is not the one this start builds (stale, or unreadable) never reaches the engine: its
    core is discarded, the built config launched and kept instead."""
    import pickle

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    events: list = []
    _serve_main(tiny_llama, monkeypatch, events)
    (kept,) = (tmp_path / "serve_configs").glob("*.pkl")
    good = kept.read_bytes()
    stale = make_engine_config(tiny_llama, device="cpu", max_model_len=64, usage_context="api_server")
    kept.write_bytes(pickle.dumps(stale, protocol=pickle.HIGHEST_PROTOCOL))

    events.clear()
    served = _serve_main(tiny_llama, monkeypatch, events)
    assert events == ["launch", "configure", "discard", "launch", "serve", "discard"]
    assert served["launched"].config is served["config"]
    assert kept.read_bytes() == good

    kept.write_bytes(b"not a pickle")
    events.clear()
    served = _serve_main(tiny_llama, monkeypatch, events)
    assert events == ["configure", "launch", "serve", "discard"]
    assert served["launched"].config is served["config"] and kept.read_bytes() == good


def test_the_config_cache_key_follows_the_inputs(tiny_llama, tmp_path, monkeypatch):
    key = core_launch.config_cache_key
    base = key(tiny_llama, {"device": "cpu"}, {"max_logprobs": 20})
    assert base == key(tiny_llama, {"device": "cpu"}, {"max_logprobs": 20})
    assert base != key(tiny_llama, {"device": "cpu", "max_model_len": 64}, {"max_logprobs": 20})
    assert base != key(tiny_llama, {"device": "cpu"}, {"max_logprobs": 5})
    monkeypatch.setenv("PAGEDLLM_SOMETHING", "1")
    assert base != key(tiny_llama, {"device": "cpu"}, {"max_logprobs": 20})
    assert key(str(tmp_path), {}, {}) is None  # no config.json: a hub name or a bad path; built, not kept
    monkeypatch.setenv("PAGEDLLM_SERVE_CONFIG_CACHE", "0")
    assert key(tiny_llama, {"device": "cpu"}, {"max_logprobs": 20}) is None


def test_a_kept_config_others_may_write_is_not_read(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    core_launch.store_cached_config("k", b"data")
    path = tmp_path / "serve_configs" / "k.pkl"
    assert path.stat().st_mode & 0o777 == 0o600
    assert core_launch.load_cached_config("k") == b"data"
    path.chmod(0o666)
    assert core_launch.load_cached_config("k") is None
    assert core_launch.load_cached_config("missing") is None
