"""benchmarks/spec_cost.py on the CPU: a plain and an EAGLE engine over a tiny llama, timed step by step; its JSON
lines hold positive times and the implied speedup MAL * t_plain / (t_verify + t_propose)."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def _load_script():
    spec = importlib.util.spec_from_file_location("spec_cost", REPO_ROOT / "benchmarks" / "spec_cost.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


spec_cost = _load_script()

COMMON = [
    "--device",
    "cpu",
    "--dtype",
    "float32",
    "--input-len",
    "12",
    "--output-len",
    "20",
    "--warmup-steps",
    "2",
]
COMMON += ["--max-model-len", "128", "--num-speculative-tokens", "3", "--mal", "3.0", "3.6"]


def _records(out: str) -> list[dict]:
    return [json.loads(line)["spec_cost"] for line in out.splitlines() if line.startswith('{"spec_cost"')]


def _check(rec: dict) -> None:
    for key in ("t_plain_ms", "t_verify_ms", "t_propose_ms", "t_plain_step_wall_ms", "t_spec_step_wall_ms"):
        assert rec[key] > 0, key
    t_plain, t_verify, t_propose = rec["t_plain_ms"], rec["t_verify_ms"], rec["t_propose_ms"]
    assert rec["verify_over_plain"] == pytest.approx(t_verify / t_plain)
    assert rec["propose_over_plain"] == pytest.approx(t_propose / t_plain)
    assert set(rec["implied_speedup"]) == {"3.0", "3.6"}
    for mal, speedup in rec["implied_speedup"].items():
        assert speedup == pytest.approx(float(mal) * t_plain / (t_verify + t_propose))
    # Full steps only, warm-up dropped: 19 plain decodes; with (almost) no accepted drafts, nearly as many
    # verifications, each followed by one proposal.
    steps = rec["num_steps"]
    assert steps["plain"] == 20 - 1 - 2
    assert 0 < steps["verify"] == steps["propose"] <= steps["plain"]
    assert rec["measured_mal"] >= 1
    assert rec["timer"] == "perf_counter"
    assert not any(rec["graphs"].values())  # CPU: everything eager
    assert "run eagerly" in rec["speculation_graphs"]


def test_dummy_weights_two_batch_sizes(tiny_llama, tmp_path, monkeypatch, capsys) -> None:
    returned = spec_cost.main(
        [
            "--model",
            tiny_llama,
            "--load-format",
            "dummy",
            "--batch-sizes",
            "1",
            "2",
            "--work-dir",
            str(tmp_path),
        ]
        + COMMON
    )
    out = capsys.readouterr().out
    records = _records(out)
    assert records == json.loads(json.dumps(returned))
    assert [r["batch_size"] for r in records] == [1, 2]
    for rec in records:
        _check(rec)
        assert rec["enforce_eager"] is False
    assert out.count("Spec cost (batch") == 2
    assert (
        list(tmp_path.iterdir()) == []
    )  # the head it wrote (config only) is gone with its temporary directory


def test_random_head_weights_written_and_loaded(tiny_llama, tmp_path, monkeypatch, capsys) -> None:
    """Real target weights: the script writes random EAGLE-1 weights, which the engine loads strictly."""
    head = spec_cost.write_eagle_head(tiny_llama, tmp_path / "head", with_weights=True)
    assert sorted(os.listdir(head)) == ["config.json", "model.safetensors"]
    assert json.loads((Path(head) / "config.json").read_text())["num_hidden_layers"] == 1
    (rec,) = spec_cost.main(["--model", tiny_llama, "--enforce-eager"] + COMMON)
    _check(rec)
    assert rec["enforce_eager"] is True
    assert rec["batch_size"] == 1 and rec["load_format"] == "auto"


def test_timer_counts_a_proposal_queued_on_the_device_once(tiny_llama, tmp_path):
    """With the target's verification graphs (stand-ins on the CPU) an EAGLE proposal is queued by the runner's
    hook right after sampling: the timer closes the verification interval there, times the proposal from there,
    and does not count the ``propose`` call that only reads those drafts back; stopping restores the hook."""
    from pagedllm import LLM, SamplingParams
    from tests.spec_decode.test_eagle import make_eagle_head
    from tests.spec_decode.test_spec_graphs import install_stand_in_graphs

    head = make_eagle_head(tiny_llama, tmp_path / "head", "eagle")
    llm = LLM(
        tiny_llama, dtype="float32", device="cpu", max_model_len=128, block_size=4,
        speculative_config={"method": "eagle", "model": head, "num_speculative_tokens": 3},
    )  # fmt: skip
    install_stand_in_graphs(llm, piecewise=False)
    core = llm.llm_engine.engine_core
    hook = core.runner.after_spec_sample
    timer = spec_cost.FullStepTimer(llm.llm_engine, batch_size=2, query_len=4)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": [30, 31, 32]}], params, use_tqdm=False)
    times = timer.stop(warmup_steps=0)
    assert core.proposer.num_device_proposals > 0
    assert 0 < len(times["propose"]) == len(times["step"]) == core.proposer.num_device_proposals
    assert core.runner.after_spec_sample == hook
