"""tools/train_eagle_head.py on a tiny target (CPU, seconds): the head it trains is the head pagedllm runs (same
drafts, step by step), and the corpus options of tools/train_demo_model.py it shares (tokenizer reuse, extra
packages with a license check)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pagedllm import LLM, SamplingParams

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def _load(name: str):
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


tdm = _load("train_demo_model")
teh = _load("train_eagle_head")
CORPUS = ["--max-corpus-mb", "1", "--device", "cpu", "--seed", "0"]


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny_target")
    tdm.main(["--config", "tiny", "--steps", "30", *CORPUS, "--out", str(out), "--sample-tokens", "4"])
    return out


@pytest.fixture(scope="module")
def tiny_head(tiny_target, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("tiny_head")
    args = ["--target", str(tiny_target), "--out", str(out), "--steps", "30", "--batch-size", "4"]
    log = teh.main([*args, "--seq-len", "64", "--eval-every", "10", "--log-every", "10", *CORPUS])
    return out, log


def test_head_trains_and_is_saved_in_the_eagle_layout(tiny_head, tiny_target):
    out, log = tiny_head
    agree = [e["agree"] for e in log["evals"]]
    assert log["heldout"]["agree"] == max(agree) and max(agree) > agree[0]
    names = set(load_file(str(out / "model.safetensors")))
    assert "fc.weight" in names and "layers.0.self_attn.q_proj.weight" in names
    assert not any("input_layernorm" in n for n in names)  # EAGLE-1's layer has none
    config = json.loads((out / "config.json").read_text())
    target = json.loads((tiny_target / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["hidden_size"] == target["hidden_size"]
    readme = (out / "README.md").read_text()
    assert log["command"] in readme and f"{log['heldout']['agree']:.1%}" in readme


def test_engine_drafts_are_the_training_code_drafts(tiny_head, tiny_target):
    """The engine's EAGLE proposer, step by step (prefill, accepted and rejected drafts), proposes exactly what
    the training code's head proposes from scratch for the same tokens: the layout, the token/hidden pairing
    and the rotary positions agree."""
    from transformers import AutoModelForCausalLM

    out, _ = tiny_head
    target = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    head = teh.EagleHead(json.loads((out / "config.json").read_text()))
    head.load_state_dict({k: v.float() for k, v in load_file(str(out / "model.safetensors")).items()})
    head.eval()
    spec = {"method": "eagle", "model": str(out), "num_speculative_tokens": 3}
    llm = LLM(str(tiny_target), dtype="float32", device="cpu", block_size=4, speculative_config=spec)
    engine, core = llm.llm_engine, llm.llm_engine.engine_core
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    engine.add_request("r0", {"prompt_token_ids": [0, 50, 60, 70, 80, 90, 100, 33, 44, 12, 13]}, params)
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        for request in core.scheduler.requests.values():
            if request.spec_token_ids:
                drafts = list(request.spec_token_ids)
                assert teh.greedy_drafts(target, head, list(request.all_token_ids), len(drafts)) == drafts
                checked += 1
    assert checked >= 3


def test_reused_tokenizer_and_extra_corpus(tiny_target, monkeypatch):
    from transformers import AutoTokenizer

    text = "def f(x):\n    return x + 1\n"
    want = AutoTokenizer.from_pretrained(tiny_target).encode(text, add_special_tokens=False)
    assert tdm.load_tokenizer(tiny_target).encode(text, add_special_tokens=False).ids == want
    _, train, heldout, corpus = tdm.prepare_data(1, 300, False, tiny_target, ["jinja2"], 0.2)
    _, train0, heldout0, _ = tdm.prepare_data(1, 300, False, tiny_target)
    assert torch.equal(heldout, heldout0) and train.numel() > train0.numel()  # extra code trains, never tests
    (extra,) = corpus["extra"]
    assert extra["package"] == "jinja2" and "BSD" in extra["license"] and 0 < extra["num_bytes"] <= 200_000
    assert corpus["tokenizer"] == f"reused from {tiny_target}"
    monkeypatch.setattr(tdm, "package_license", lambda dist: "GPL-3.0-or-later")
    with pytest.raises(SystemExit, match="jinja2: license 'GPL-3.0-or-later'"):
        tdm.package_corpus(["jinja2"], 10**6)
    with pytest.raises(SystemExit, match="no installed package"):
        tdm.package_corpus(["no_such_package_xyz"], 10**6)


@pytest.mark.parametrize(
    "license_, ok",
    [("MIT", True), ("BSD-3-Clause AND MIT", True), ("Apache-2.0", True), ("GPL-3.0", False),
     ("BSD-3-Clause AND GPL-3.0-or-later", False), ("", False), ("Proprietary", False)],
)  # fmt: skip
def test_is_permissive(license_, ok):
    assert tdm.is_permissive(license_) is ok
