"""`pagedllm bench startup` against a real `pagedllm serve` child on the CPU (tiny model)."""

from __future__ import annotations

import json

from pagedllm.benchmarks.startup import parse_phases
from pagedllm.entrypoints.cli import main


def test_parse_phases():
    log = "x\nINFO start-up phases: load 1.20 s, profile 0.50 s, kv cache 0.01 s, cuda graphs 3.00 s, engine 4.71 s\n"
    assert parse_phases(log) == {
        "load": 1.2,
        "profile": 0.5,
        "kv cache": 0.01,
        "cuda graphs": 3.0,
        "engine": 4.71,
    }
    assert parse_phases("nothing here") == {}


def test_bench_startup_measures_first_completed_request(tiny_llama, tmp_path, capsys):
    out = tmp_path / "startup.json"
    serve_args = "--device cpu --dtype float32 --kv-cache-memory-bytes 8388608"
    rc = main(
        ["bench", "startup", "--model", tiny_llama, "--serve-args", serve_args, "--output-json", str(out)]
    )
    assert rc == 0
    result = json.loads(out.read_text())
    engine = result["phases"]["engine"]
    assert set(result["phases"]) == {"load", "profile", "kv cache", "cuda graphs", "engine"}
    assert 0 < engine < result["startup_s"]  # the engine's phases are part of the whole
    assert "Start-up:" in capsys.readouterr().out


def test_bench_startup_reports_a_server_that_dies(tmp_path, capsys):
    rc = main(["bench", "startup", "--model", str(tmp_path / "missing"), "--serve-args", "--device cpu"])
    assert rc == 1
    assert "exited" in capsys.readouterr().err
