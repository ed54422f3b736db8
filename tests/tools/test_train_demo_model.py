"""tools/train_demo_model.py end to end on the tiny config (CPU, seconds), and pagedllm.demo."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "tools" / "train_demo_model.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("train_demo_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


tdm = _load_script()

TINY_ARGS = ["--config", "tiny", "--steps", "30", "--max-corpus-mb", "1", "--device", "cpu", "--seed", "0"]
LOG_FIELDS = {
    "command", "seed", "steps", "final_train_loss", "heldout_loss", "best_step", "wall_time_s", "train_time_s",
    "device", "torch_version", "transformers_version", "corpus", "model", "history", "evals", "samples",
    "weights_bytes", "save_dtype",
}  # fmt: skip


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_demo")
    log = tdm.main([*TINY_ARGS, "--out", str(out), "--sample-tokens", "8"])
    return out, log


def test_loss_decreases(tiny_run):
    _, log = tiny_run
    losses = [h["loss"] for h in log["history"]]
    assert log["history"][0]["step"] == 1 and log["steps"] == 30
    assert losses[-1] < losses[0] - 0.5, losses
    assert log["heldout_loss"] < losses[0]
    assert log["heldout_loss"] == min(e["heldout_loss"] for e in log["evals"])


def test_train_log_fields(tiny_run):
    out, log = tiny_run
    saved = json.loads((out / "train_log.json").read_text())
    assert LOG_FIELDS <= saved.keys()
    assert saved["seed"] == 0 and saved["model"]["num_params"] > 0
    assert saved["command"].startswith("python tools/train_demo_model.py --config tiny")
    assert saved["corpus"]["num_heldout_files"] >= 1 and saved["corpus"]["num_bytes"] <= 1_000_000
    assert set(saved["samples"]) == set(tdm.SAMPLE_PROMPTS)
    readme = (out / "README.md").read_text()
    assert saved["command"] in readme and "PSF" in readme and str(saved["heldout_loss"]) in readme


def test_output_loads_with_transformers(tiny_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    out, log = tiny_run
    weights = out / "model.safetensors"
    assert weights.is_file() and weights.stat().st_size <= 25 * 1000 * 1000
    assert json.loads((out / "config.json").read_text())["dtype"] == log["save_dtype"]
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<s>", "</s>", "<pad>")
    ids = tok("def f(x):\n    return x")["input_ids"]
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert tok.decode(ids, skip_special_tokens=True) == "def f(x):\n    return x"
    gen = GenerationConfig.from_pretrained(out)
    assert (gen.bos_token_id, gen.eos_token_id) == (tok.bos_token_id, tok.eos_token_id)
    assert model.config.tie_word_embeddings and model.config.vocab_size == len(tok)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits  # [1, num_tokens, vocab]
    assert logits.shape == (1, len(ids), model.config.vocab_size) and torch.isfinite(logits).all()


def test_chat_template_renders(tiny_run):
    from transformers import AutoTokenizer

    out, _ = tiny_run
    assert "chat_template" in json.loads((out / "tokenizer_config.json").read_text())
    tok = AutoTokenizer.from_pretrained(out)
    messages = [
        {"role": "system", "content": "Write Python."},
        {"role": "user", "content": "fibonacci\nplease"},
        {"role": "assistant", "content": "def fib(n):\n    pass"},
        {"role": "user", "content": "again"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<s># system:\n# Write Python.\n# user:\n# fibonacci\n# please\n# assistant:\ndef fib(n):\n    pass\n"
        "# user:\n# again\n# assistant:\n"
    )
    no_prompt = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=False)
    assert not no_prompt.endswith("# assistant:\n")


def test_seeded_runs_repeat(tmp_path):
    args = [
        "--config",
        "tiny",
        "--steps",
        "4",
        "--max-corpus-mb",
        "0.3",
        "--device",
        "cpu",
        "--sample-tokens",
        "1",
    ]
    first = tdm.main([*args, "--out", str(tmp_path / "a")])
    second = tdm.main([*args, "--out", str(tmp_path / "b")])

    def curve(log):
        return [(h["step"], h["loss"], h["lr"]) for h in log["history"]]

    assert curve(first) == curve(second) and len(curve(first)) == 2
    assert first["heldout_loss"] == second["heldout_loss"]
    assert (tmp_path / "a" / "tokenizer.json").read_text() == (tmp_path / "b" / "tokenizer.json").read_text()


def test_corpus_excludes_tests_and_is_sorted():
    root = tdm.stdlib_root()
    files = tdm.list_corpus(root)
    rel = [f.relative_to(root).as_posix() for f in files]
    assert rel == sorted(rel) and len(rel) > 100
    assert not any(part in tdm.EXCLUDED_DIRS for r in rel for part in r.split("/")[:-1])
    train, heldout = tdm.split_heldout(files)
    assert train + heldout == files and 1 <= len(heldout) <= 0.03 * len(files) + 1


def test_demo_config_fits_size_budget():
    from transformers import LlamaForCausalLM

    spec = tdm.SPECS["demo"]
    with torch.device("meta"):
        model = LlamaForCausalLM(tdm.build_model_config(spec, spec.vocab_size))
    num_params = tdm.count_params(model)
    assert spec.hidden_size == spec.num_attention_heads * spec.head_dim
    # bfloat16 on disk (fp32 would pass 20 MB); the device tool returns files of at most 16 MiB.
    assert num_params * 4 > tdm.MAX_FP32_WEIGHT_BYTES and num_params * 2 <= 16 * 2**20


def test_lr_schedule():
    assert tdm.lr_at(0.0, 1.0, 0.1) <= 0.01
    assert tdm.lr_at(0.1, 1.0, 0.1) == pytest.approx(1.0)
    assert tdm.lr_at(1.0, 1.0, 0.1) == pytest.approx(0.1)
    assert tdm.lr_at(0.3, 1.0, 0.1) > tdm.lr_at(0.6, 1.0, 0.1)


def test_default_model(monkeypatch, tmp_path):
    from pagedllm import demo

    assert demo.DEMO_MODEL_DIR == REPO_ROOT / "pagedllm" / "demo_model"
    monkeypatch.setattr(demo, "DEMO_MODEL_DIR", tmp_path / "missing")
    with pytest.raises(ValueError, match="tools/train_demo_model.py"):
        demo.default_model()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text("{}")
    monkeypatch.setattr(demo, "DEMO_MODEL_DIR", tmp_path)
    assert demo.default_model() == str(tmp_path)
