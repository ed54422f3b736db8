"""`pagedllm bench latency --prompts-from`: prompts cut from real text (for speculative decoding's acceptance)."""

from __future__ import annotations

import argparse
import json

import pytest

from pagedllm.benchmarks.latency import add_cli_args, main, text_prompts
from pagedllm.tokenizer import get_tokenizer


def test_text_prompts_are_spread_windows_of_the_files(tmp_path):
    tok = get_tokenizer("pagedllm/demo_model")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "b.py").write_text("def b():\n    return 2\n" * 40)
    (tmp_path / "pkg" / "a.py").write_text("def a():\n    return 1\n" * 40)
    (tmp_path / "c.txt").write_text("x = [i for i in range(10)]\n" * 40)
    paths = [str(tmp_path / "pkg"), str(tmp_path / "c.txt")]
    stream = []
    for name in ("pkg/a.py", "pkg/b.py", "c.txt"):  # a directory's *.py files in sorted order, then the file
        stream += tok.encode((tmp_path / name).read_text(), add_special_tokens=False)
    prompts = text_prompts(paths, tok, batch_size=4, input_len=16)
    step = (len(stream) - 16) // 3
    assert prompts == [stream[i * step : i * step + 16] for i in range(4)]
    assert prompts[-1] != prompts[0] and all(len(p) == 16 for p in prompts)
    assert text_prompts(paths, tok, batch_size=1, input_len=16) == [stream[:16]]
    with pytest.raises(ValueError, match="fewer than --input-len"):
        text_prompts(paths, tok, batch_size=1, input_len=len(stream) + 1)
    with pytest.raises(ValueError, match="--prompts-from: no such file or directory: .*missing.py"):
        text_prompts([str(tmp_path / "missing.py")], tok, batch_size=1, input_len=4)


@pytest.mark.parametrize("scheduling", ["--async-scheduling", "--no-async-scheduling"])
def test_bench_latency_with_text_prompts_and_ngram(tmp_path, capsys, scheduling):
    """End to end on CPU: text prompts that repeat themselves give n-gram drafts something to accept; speculation
    runs with either scheduling mode (the switch for A/B runs), and the output says which. --profile-steps adds
    one profiled iteration, the proposer's time among its phases."""
    (tmp_path / "text.py").write_text("for i in range(3):\n    print(i)\n" * 30)
    p = argparse.ArgumentParser()
    add_cli_args(p)
    args = p.parse_args(
        ["--model", "pagedllm/demo_model/draft", "--device", "cpu", "--dtype", "float32",
         "--batch-size", "2", "--input-len", "32", "--output-len", "8", "--num-iters-warmup", "0",
         "--num-iters", "1", "--prompts-from", str(tmp_path / "text.py"), "--speculative-config",
         '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3, "prompt_lookup_min": 2}',
         scheduling, "--output-json", str(tmp_path / "out.json"), "--profile-steps"]
    )  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "Latency (pagedllm)" in out and "(batch 2, 32 in / 8 out)" in out
    assert "Mean acceptance length" in out
    on = scheduling == "--async-scheduling"
    assert f"Scheduling: {'async' if on else 'synchronous'}" in out
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["async_scheduling"] is on
    assert "Step profile:" in out and " propose " in out
    assert result["step_profile"]["steps"] > 0 and result["step_profile"]["propose_ms_per_step"] > 0
