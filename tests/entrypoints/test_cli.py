"""The `pagedllm` command line: dispatch, lazy subcommand imports, and the chat REPL."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from pagedllm.entrypoints import cli
from tests.entrypoints.server_utils import REPO_ROOT


def test_help_lists_commands(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for name in ("serve", "generate", "chat", "bench"):
        assert name in out
    assert cli.main([]) == 2


@pytest.mark.parametrize("argv", [["serve", "--help"], ["bench", "serve", "--help"], ["chat", "--help"]])
def test_subcommand_help(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--model" in out or "--base-url" in out


def test_serve_flags(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in (
        "--host", "--port", "--api-key", "--served-model-name", "--max-model-len", "--gpu-memory-utilization",
        "--max-num-seqs", "--max-num-batched-tokens", "--block-size", "--enable-prefix-caching",
        "--no-enable-prefix-caching", "--dtype", "--seed", "--chat-template", "--enforce-eager", "--load-format",
        "--device", "--disable-log-requests", "--uvicorn-log-level", "--max-logprobs", "--max-request-body-bytes",
    ):  # fmt: skip
        assert flag in out, flag


def test_serve_defaults_expose_nothing():
    from pagedllm.entrypoints.openai.serve_cli import DEFAULT_MAX_REQUEST_BODY_BYTES, add_cli_args

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(["some-model"])
    assert args.host == "127.0.0.1" and args.port == 8000
    assert not args.enable_debug_endpoints
    assert args.max_request_body_bytes == DEFAULT_MAX_REQUEST_BODY_BYTES


def test_a_missing_module_only_breaks_its_own_command(monkeypatch, capsys):
    monkeypatch.setitem(cli.COMMANDS, "generate", ("pagedllm.no_such_module", "broken"))
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--model", "x"])
    assert "unavailable" in str(e.value.code)
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--help"])
    assert e.value.code == 0


def test_serve_entry_point_leaves_the_http_stack_for_later():
    """`pagedllm serve`'s module (flags, checks, config) imports neither FastAPI, uvicorn, pydantic nor the serving
    layer: they load while the engine core starts (serve_cli._import_http_stack)."""
    code = (
        "import sys; import pagedllm.entrypoints.openai.serve_cli; "
        "print(sorted(m for m in ('fastapi', 'uvicorn', 'pydantic', 'pagedllm.entrypoints.openai.api_server', "
        "'pagedllm.entrypoints.openai.protocol') if m in sys.modules))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_serve_launches_the_engine_core_before_its_slow_imports(tiny_llama, tmp_path):
    """`pagedllm serve` hands the engine core its config before this process imports the engine client, the
    tokenizer and the server; and, when an earlier start with the same inputs kept its config, before it imports
    transformers to build its own (core_launch's config cache). The core loads the model meanwhile: on the lent
    GPU hosts the config alone took 8-10 s, which the core used to wait out."""
    code = f"""
import argparse, sys
from pagedllm.engine import core_launch
from pagedllm.entrypoints.openai import serve_cli
class Launched(Exception):
    pass
def spy(config, *args):
    late = ("transformers", "pagedllm.engine.async_llm", "pagedllm.tokenizer", "fastapi")
    print(type(config).__name__, sorted(m for m in late if m in sys.modules))
    raise Launched
core_launch.launch = spy
serve_cli._bind = lambda host, port: type("Socket", (), {{"close": lambda self: None}})()
serve_cli.signal.signal = lambda *a: None
parser = argparse.ArgumentParser()
serve_cli.add_cli_args(parser)
try:
    serve_cli.main(parser.parse_args([{tiny_llama!r}, "--device", "cpu"]))
except Launched:
    pass
"""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PAGEDLLM_CACHE_DIR": str(tmp_path)}
    lines = []
    for _ in range(2):  # the first start builds its config (and keeps it); the second finds it kept
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO_ROOT)
        assert out.returncode == 0, out.stderr
        lines.append(out.stdout.strip().splitlines()[-1])
    assert lines == ["EngineConfig ['transformers']", "EngineConfig []"]


def test_serve_with_a_missing_dependency_says_so_in_one_line(monkeypatch, capsys):
    """A broken install (no fastapi, or no pyzmq) makes `pagedllm serve` stop at once with one line naming what is
    missing: before it starts an engine core process (which would fail on it with a traceback) or binds a port."""
    import importlib.util

    from pagedllm.engine import core_launch

    real_find_spec = importlib.util.find_spec
    gone = {"fastapi", "zmq"}
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in gone else real_find_spec(name, *a)
    )
    monkeypatch.setattr(core_launch, "prespawn", lambda: pytest.fail("started an engine core"))
    assert cli.main(["serve", "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert "unavailable (missing fastapi, pyzmq" in err
    assert len(err.strip().splitlines()) == 1


def test_chat_repl(tiny_llama):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedllm.entrypoints.cli",
            "chat",
            tiny_llama,
            "--device",
            "cpu",
            "--max-tokens",
            "4",
        ],
        input="hello\nmore\n\n",
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("> ") == 3


def test_new_engine_flags_reach_the_engine_config(tiny_llama):
    """The engine flags, as `pagedllm serve/generate/bench` parse them, build the configs they name; bad
    values are refused by the parser or by the config with the field's name."""
    from pagedllm.config import make_engine_config
    from pagedllm.engine.arg_utils import add_engine_args, engine_kwargs_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(
        ["--model", tiny_llama, "--device", "cpu", "--quantization", "fp8", "--kv-cache-dtype", "fp8",
         "--data-parallel-size", "2", "--tensor-parallel-size", "2", "--distributed-executor-backend", "mp",
         "--enable-lora", "--max-loras", "3", "--max-lora-rank", "32"]
    )  # fmt: skip
    kw = engine_kwargs_from_args(args)
    both = make_engine_config(tiny_llama, **kw)  # LoRA composes with TP
    assert both.lora_config.max_loras == 3 and both.parallel_config.tensor_parallel_size == 2
    kw.update(enable_lora=False, tensor_parallel_size=1)
    config = make_engine_config(tiny_llama, **kw)
    assert config.model_config.quantization == "fp8"
    assert config.cache_config.cache_dtype == "fp8"
    assert config.parallel_config.data_parallel_size == 2
    assert config.parallel_config.distributed_executor_backend == "mp"
    kw.update(tensor_parallel_size=2, data_parallel_size=1, quantization=None)
    assert make_engine_config(tiny_llama, **kw).parallel_config.tensor_parallel_size == 2
    more = parser.parse_args(["--model", tiny_llama, "-pp", "2", "--enable-expert-parallel"])
    assert more.pipeline_parallel_size == 2 and more.enable_expert_parallel
    kw = engine_kwargs_from_args(more)
    assert kw["pipeline_parallel_size"] == 2 and kw["enable_expert_parallel"] is True
    assert make_engine_config(tiny_llama, **kw).parallel_config.enable_expert_parallel  # no-op for a dense model
    for bad in (["--kv-cache-dtype", "int8"], ["--quantization", "int3"], ["--tensor-parallel-size", "x"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


def test_a_refused_engine_flag_is_a_usage_error(capsys):
    """A value the engine's config refuses (here -pp 0) ends the command with its message and exit 2, no
    traceback."""
    from pagedllm.demo import default_model

    argv = ["generate", "hi", "--model", default_model(), "--device", "cpu", "--max-tokens", "2"]
    assert cli.main(argv + ["-pp", "0"]) == 2
    assert "error: pipeline_parallel_size must be an integer >= 1, got 0" in capsys.readouterr().err
    assert cli.main(argv + ["--block-size", "3"]) == 2
    assert "block_size must be a power of two" in capsys.readouterr().err


def test_serve_builds_its_engine_with_the_server_batch_defaults(tiny_llama, monkeypatch):
    """`pagedllm serve` makes its engine config with usage_context="api_server", so on a large GPU its unset
    token budget is vLLM's served 8192, not the offline 16384 (checked with a faked H100's properties)."""
    import signal
    from types import SimpleNamespace

    import torch

    from pagedllm.entrypoints.openai import serve_cli

    served = {}

    async def fake_serve(args, config, sock, **kwargs):
        served["config"] = config
        return 0

    class FakeSocket:
        def close(self) -> None:
            pass

    monkeypatch.setattr(serve_cli, "_serve", fake_serve)
    monkeypatch.setattr(serve_cli, "_bind", lambda host, port: FakeSocket())
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # main installs a SIGTERM handler
    parser = argparse.ArgumentParser()
    serve_cli.add_cli_args(parser)
    assert serve_cli.main(parser.parse_args([tiny_llama])) == 0
    sched = served["config"].scheduler_config
    assert sched.usage_context == "api_server"
    assert (sched.max_num_batched_tokens, sched.max_num_seqs) == (None, None)  # resolved where the device is known
    props = SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=80 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    sched.resolve_defaults(torch.device("cuda", 0))
    assert (sched.max_num_batched_tokens, sched.max_num_seqs) == (8192, 1024)


def test_runner_flag_reaches_the_engine_config(tiny_llama):
    """--runner pooling serves a causal-LM checkpoint as a last-token embedder; bad values are refused."""
    from pagedllm.config import make_engine_config
    from pagedllm.engine.arg_utils import add_engine_args, engine_kwargs_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    kw = engine_kwargs_from_args(parser.parse_args(["--model", tiny_llama, "--device", "cpu"]))
    assert make_engine_config(tiny_llama, **kw).model_config.runner_type == "generate"
    kw = engine_kwargs_from_args(parser.parse_args(["--model", tiny_llama, "--device", "cpu", "--runner", "pooling"]))
    pooler = make_engine_config(tiny_llama, **kw).model_config.pooler_config
    assert (pooler.pooling_type, pooler.normalize, pooler.is_classifier) == ("LAST", True, False)
    args = parser.parse_args(
        ["--model", tiny_llama, "--runner", "pooling", "--pooler-config", '{"pooling_type": "MEAN", "normalize": false}']
    )
    pooler = make_engine_config(tiny_llama, **engine_kwargs_from_args(args)).model_config.pooler_config
    assert (pooler.pooling_type, pooler.normalize) == ("MEAN", False)
    with pytest.raises(SystemExit):
        parser.parse_args(["--runner", "embed"])
