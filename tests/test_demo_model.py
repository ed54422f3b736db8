"""The bundled demo model: the default when no model is given, with text that makes sense."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.demo import DEMO_MODEL_DIR, default_model
from tests.entrypoints.server_utils import RemoteServer


@pytest.fixture(scope="module")
def demo_llm() -> LLM:
    return LLM(device="cpu")


def test_default_model_is_the_bundled_one(demo_llm):
    assert default_model() == str(DEMO_MODEL_DIR)
    assert demo_llm.llm_engine.config.model_config.model_path == str(DEMO_MODEL_DIR)
    # Small enough to ship: weights at most 25 MB.
    assert (DEMO_MODEL_DIR / "model.safetensors").stat().st_size <= 25 * 10**6


def test_completes_python(demo_llm):
    out = demo_llm.generate(
        "def fibonacci(n):", SamplingParams(temperature=0, max_tokens=48), use_tqdm=False
    )[0]
    text = out.outputs[0].text
    # A code model continues a def with an indented body.
    assert text.startswith("\n") and "\n    " in text, text
    assert "\ufffd" not in text


def test_stop_strings_and_repetition_penalty_on_real_text(demo_llm):
    greedy = SamplingParams(temperature=0, max_tokens=24)
    repeated = demo_llm.generate("import os\n", greedy, use_tqdm=False)[0].outputs[0].text
    assert repeated.count("import os") >= 3  # the model loops on imports: n-gram repetition
    stopped = demo_llm.generate(
        "import os\n", SamplingParams(temperature=0, max_tokens=24, stop=["\n"]), use_tqdm=False
    )[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == "\n"
    assert stopped.text == repeated.split("\n")[0]
    penalized = SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.5, frequency_penalty=1.0)
    varied = demo_llm.generate("import os\n", penalized, use_tqdm=False)[0].outputs[0].text
    assert varied.count("import os") < repeated.count("import os")


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
