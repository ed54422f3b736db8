"""`pagedllm serve --config FILE`: YAML keys are flag names, values are typed by the flag, the command line wins,
and an unknown key or a refused value is an error naming the key."""

from __future__ import annotations

import argparse

import pytest

from pagedllm.engine.arg_utils import engine_kwargs_from_args
from pagedllm.entrypoints import cli
from pagedllm.entrypoints.config_file import ConfigFileError, apply_config_file, config_to_defaults
from pagedllm.entrypoints.openai.serve_cli import add_cli_args

FLAGS = [
    "serve", "/models/llama",
    "--max-model-len", "4096", "--max-num-seqs", "64", "--gpu-memory-utilization", "0.85",
    "--no-enable-prefix-caching", "--enforce-eager", "--dtype", "bfloat16",
    "--served-model-name", "llama", "llama-8b", "--host", "0.0.0.0", "--port", "8001",
    "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}',
    "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--shutdown-timeout", "12.5",
    "--kv-cache-dtype", "fp8", "-tp", "2",
]  # fmt: skip

YAML = """\
model: /models/llama
max-model-len: 4096
max_num_seqs: 64
gpu-memory-utilization: 0.85
enable-prefix-caching: false
enforce_eager: true
dtype: bfloat16
served-model-name: [llama, llama-8b]
host: 0.0.0.0
port: 8001
speculative-config:
  method: ngram
  num_speculative_tokens: 4
  prompt_lookup_max: 4
enable-auto-tool-choice: true
tool_call_parser: hermes
shutdown-timeout: 12.5
kv-cache-dtype: fp8
tensor-parallel-size: 2
max-cpu-loras: null
"""


def parse_serve(argv: list[str]) -> argparse.Namespace:
    """`pagedllm serve` argv -> the namespace its main receives (the config file applied as cli.main does)."""
    parser, leaves = cli.build_parser(argv)
    apply_config_file(leaves[("serve",)], argv[1:])
    return parser.parse_args(argv)


def server_settings(args: argparse.Namespace) -> dict:
    """What a serve namespace configures: the engine's arguments and the server's flags (not the file's name)."""
    from pagedllm.engine.arg_utils import resolve_model_arg

    settings = dict(vars(args))
    settings.pop("config")
    settings.pop("model_tag")
    settings["model"] = resolve_model_arg(args)
    return {"engine": engine_kwargs_from_args(args), "all": settings}


@pytest.fixture
def config_path(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text(YAML)
    return str(path)


def test_yaml_gives_the_same_arguments_as_the_flags(config_path):
    from_flags = server_settings(parse_serve(FLAGS))
    from_file = server_settings(parse_serve(["serve", "--config", config_path]))
    assert from_file == from_flags
    engine = from_file["engine"]
    assert engine["max_model_len"] == 4096 and engine["gpu_memory_utilization"] == 0.85
    assert engine["enable_prefix_caching"] is False and engine["enforce_eager"] is True
    assert engine["speculative_config"] == {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_max": 4,
    }
    assert from_file["all"]["served_model_name"] == ["llama", "llama-8b"]


def test_the_command_line_wins(config_path):
    args = parse_serve(
        [
            "serve",
            "/models/other",
            f"--config={config_path}",
            "--max-num-seqs",
            "8",
            "--enable-prefix-caching",
        ]
    )
    assert args.max_num_seqs == 8
    assert args.enable_prefix_caching is True
    assert server_settings(args)["all"]["model"] == "/models/other"
    assert args.max_model_len == 4096  # from the file


def test_defaults_without_a_file():
    args = parse_serve(["serve"])
    assert args.config is None and args.max_num_seqs is None and args.port == 8000


def _defaults(config: dict) -> dict:
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    return config_to_defaults(parser, config)


def test_values_are_typed_by_the_flag():
    assert _defaults({"port": "9000", "seed": 3, "served_model_name": "one", "compilation-config": 1}) == {
        "port": 9000,
        "seed": 3,
        "served_model_name": ["one"],
        "compilation_config": 1,
    }
    assert _defaults({"no-enable-chunked-prefill": True}) == {"enable_chunked_prefill": False}


@pytest.mark.parametrize(
    "config, words",
    [
        ({"max-num-seq": 4}, ["'max-num-seq'", "--max-num-seq"]),
        ({"config": "other.yaml"}, ["'config'"]),
        ({"max_num_seqs": "many"}, ["'max_num_seqs'", "invalid int value"]),
        ({"dtype": "int3"}, ["'dtype'", "invalid choice"]),
        ({"enforce-eager": "yes"}, ["'enforce-eager'", "true or false"]),
        ({"port": [1, 2]}, ["'port'", "one value"]),
        ({"speculative-config": "not json"}, ["'speculative-config'", "JSON"]),
    ],
)
def test_bad_keys_and_values_name_the_key(config, words):
    with pytest.raises(ConfigFileError) as e:
        _defaults(config)
    for word in words:
        assert word in str(e.value)


def test_serve_reports_a_bad_file_and_exits_2(tmp_path, monkeypatch, capsys):
    from pagedllm.engine import core_launch

    monkeypatch.setattr(core_launch, "prespawn", lambda: None)
    path = tmp_path / "serve.yaml"
    path.write_text("max-num-seqs: 4\nunknown-flag: 1\n")
    assert cli.main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "'unknown-flag'" in err
    path.write_text("- a list\n")
    assert cli.main(["serve", "--config", str(path)]) == 2
    assert "mapping" in capsys.readouterr().err
    assert cli.main(["serve", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_a_server_runs_from_a_config_file(tiny_llama, tmp_path):
    """`pagedllm serve --config FILE` end to end: the file's model, name, context length and responses store size
    take effect, with the command line's flags (RemoteServer's device, port...) next to them."""
    import openai

    from tests.entrypoints.server_utils import RemoteServer

    path = tmp_path / "serve.yaml"
    path.write_text(
        f"model: {tiny_llama}\nserved_model_name: [tiny]\nmax-model-len: 256\nresponses-store-size: 1\n"
    )
    server = RemoteServer(None, tmp_path / "server.log", extra_args=["--config", str(path)])
    try:
        client = server.openai_client()
        [card] = client.models.list().data
        assert (card.id, card.max_model_len) == ("tiny", 256)
        first = client.responses.create(model="tiny", input="a", max_output_tokens=2)
        second = client.responses.create(model="tiny", input="b", max_output_tokens=2)
        assert client.responses.retrieve(second.id).id == second.id
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(first.id)  # the store holds one response
    finally:
        assert server.stop() == 0, server.log()
