"""The bundled demo model: the default when no model is given, with text that makes sense."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.demo import DEMO_MODEL_DIR, default_model, demo_draft_model, demo_eagle_head, demo_medusa_head
from tests.entrypoints.server_utils import RemoteServer


@pytest.fixture(scope="module")
def demo_llm() -> LLM:
    return LLM(device="cpu")


def test_default_model_is_the_bundled_one(demo_llm):
    assert default_model() == str(DEMO_MODEL_DIR)
    assert demo_llm.llm_engine.config.model_config.model_path == str(DEMO_MODEL_DIR)
    # Small enough to ship (the tree travels to the lent GPU in 64 MiB): the target at most 40 MB in bf16,
    # target + draft + EAGLE head + Medusa heads at most 51 MB.
    assert (DEMO_MODEL_DIR / "model.safetensors").stat().st_size <= 40 * 10**6
    total = sum(p.stat().st_size for p in DEMO_MODEL_DIR.rglob("*") if p.is_file())
    assert total <= 51 * 10**6, total


def test_demo_target_draft_and_head_fit_together():
    """The demo trio: a 15-20M-parameter target under 2.2 nats/token on the held-out stdlib files, the small
    model as its draft (same tokenizer, same held-out files), and an EAGLE head of the target's width."""
    log = json.loads((DEMO_MODEL_DIR / "train_log.json").read_text())
    assert 15e6 <= log["model"]["num_params"] <= 20e6
    assert log["heldout_loss"] < 2.2 and log["heldout_loss"] == min(e["heldout_loss"] for e in log["evals"])
    draft = Path(demo_draft_model())
    draft_log = json.loads((draft / "train_log.json").read_text())
    assert draft_log["model"]["num_params"] < log["model"]["num_params"] / 2
    assert (draft / "tokenizer.json").read_bytes() == (DEMO_MODEL_DIR / "tokenizer.json").read_bytes()
    assert draft_log["corpus"]["heldout_first_file"] == log["corpus"]["heldout_first_file"]
    assert draft_log["corpus"]["num_heldout_tokens"] == log["corpus"]["num_heldout_tokens"]
    assert draft_log["heldout_loss"] > log["heldout_loss"]  # the target is the better model
    head = json.loads((Path(demo_eagle_head()) / "config.json").read_text())
    target = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    assert head["hidden_size"] == target["hidden_size"] and head["num_hidden_layers"] == 1
    assert json.loads((Path(demo_eagle_head()) / "train_log.json").read_text())["heldout"]["agree"] > 0.5


CODE = "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"


@pytest.mark.parametrize(
    "spec",
    [
        {"model": "draft", "num_speculative_tokens": 4},
        {"method": "eagle", "model": "eagle", "num_speculative_tokens": 3},
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
        {"method": "medusa", "model": "medusa", "num_speculative_tokens": 3},
    ],
    ids=["draft", "eagle", "ngram", "medusa"],
)
def test_speculation_on_the_demo_is_exact_and_accepted(demo_llm, spec):
    """The shipped draft and head predict the shipped target: greedy output is unchanged and most drafts are
    accepted (real acceptance on real code, not a test construction)."""
    if "model" in spec:
        heads = {"draft": demo_draft_model, "eagle": demo_eagle_head, "medusa": demo_medusa_head}
        spec = {**spec, "model": heads[spec["model"]]()}
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    want = demo_llm.generate(CODE, greedy, use_tqdm=False)[0].outputs[0]
    llm = LLM(device="cpu", speculative_config=spec)
    got = llm.generate(CODE, greedy, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids
    stats = llm.llm_engine.get_stats()
    assert stats.spec_num_draft_tokens > 0
    # Medusa's heads guess 2, 3 and 4 tokens ahead from one hidden state (no draft token read): fewer accepted
    # (the first head agrees with the target's greedy token 26% of the time on the held-out files).
    floor = 0.15 if spec.get("method") == "medusa" else 0.4
    assert stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens > floor, stats


def test_completes_python(demo_llm):
    out = demo_llm.generate(
        "def fibonacci(n):", SamplingParams(temperature=0, max_tokens=48), use_tqdm=False
    )[0]
    text = out.outputs[0].text
    # A code model continues a def with an indented body.
    assert text.startswith("\n") and "\n    " in text, text
    assert "\ufffd" not in text


def test_stop_strings_and_repetition_penalty_on_real_text(demo_llm):
    greedy = SamplingParams(temperature=0, max_tokens=48)
    plain = demo_llm.generate("import os\n", greedy, use_tqdm=False)[0].outputs[0]
    assert "import" in plain.text and "\n" in plain.text  # more imports, one per line
    stopped = demo_llm.generate(
        "import os\n", SamplingParams(temperature=0, max_tokens=48, stop=["\n"]), use_tqdm=False
    )[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == "\n"
    assert stopped.text == plain.text.split("\n")[0]
    penalized = SamplingParams(temperature=0, max_tokens=48, repetition_penalty=1.5, frequency_penalty=1.0)
    varied = demo_llm.generate("import os\n", penalized, use_tqdm=False)[0].outputs[0]
    # Code repeats tokens (import, from, newlines); the penalties make the model reuse fewer of them.
    assert len(set(varied.token_ids)) > len(set(plain.token_ids))


def test_chat_template_gets_code_back(demo_llm):
    out = demo_llm.chat(
        [{"role": "user", "content": "write a function that adds two numbers"}],
        SamplingParams(temperature=0, max_tokens=32),
        use_tqdm=False,
    )[0]
    assert out.outputs[0].text.strip()


def test_serve_without_a_model_serves_the_demo(demo_llm, tmp_path):
    server = RemoteServer(None, tmp_path / "server.log")
    try:
        client = server.openai_client()
        models = [m.id for m in client.models.list().data]
        assert len(models) == 1
        comp = client.completions.create(
            model=models[0], prompt="def fibonacci(n):", max_tokens=48, temperature=0
        )
        want = (
            demo_llm.generate(
                "def fibonacci(n):", SamplingParams(temperature=0, max_tokens=48), use_tqdm=False
            )[0]
            .outputs[0]
            .text
        )
        assert comp.choices[0].text == want
        chat = client.chat.completions.create(
            model=models[0],
            messages=[{"role": "user", "content": "sort a list"}],
            max_tokens=32,
            temperature=0,
        )
        assert chat.choices[0].message.content.strip()
    finally:
        assert server.stop() == 0
