"""``use_beam_search`` on /v1/completions and /v1/chat/completions, through the official `openai` client: the
choices equal ``LLM.beam_search`` on the same model and settings (float32, CPU, block size 16), usage counts the
returned choices, and combinations beam search cannot honor are 400s naming the field."""

from __future__ import annotations

import openai
import pytest

from pagedllm.beam_search import BeamSearchOutput, BeamSearchParams
from pagedllm.tokenizer import make_decode_fn

PROMPTS = ["def fibonacci(n):", "class Point:"]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    from pagedllm import LLM

    return LLM(tiny_llama, dtype="float32", device="cpu", block_size=16, kv_cache_memory_bytes=4 << 20)


def expected_choices(llm, output: BeamSearchOutput, num_prompt_tokens: int) -> list[tuple[str, str, int]]:
    """(text, finish_reason, number of generated tokens) per sequence, best first, as the server shows them."""
    decode = make_decode_fn(llm.get_tokenizer())
    out = []
    for seq in output.sequences:
        generated = seq.tokens[num_prompt_tokens:]
        out.append((decode(generated), seq.finish_reason, len(generated)))
    return out


@pytest.mark.parametrize(
    "n, length_penalty, ignore_eos", [(1, 1.0, False), (3, 1.0, False), (3, 0.5, True), (4, 2.0, False)]
)
def test_completion_matches_llm_beam_search(client, model, llm, n, length_penalty, ignore_eos):
    params = BeamSearchParams(
        beam_width=n, max_tokens=8, length_penalty=length_penalty, ignore_eos=ignore_eos
    )
    expected = llm.beam_search(PROMPTS, params)
    ip = llm.llm_engine.input_processor
    prompt_lens = [len(ip.tokenize(p)) for p in PROMPTS]
    out = client.completions.create(
        model=model,
        prompt=PROMPTS,
        n=n,
        max_tokens=8,
        extra_body={"use_beam_search": True, "length_penalty": length_penalty, "ignore_eos": ignore_eos},
    )
    assert [c.index for c in out.choices] == list(range(n * len(PROMPTS)))
    want = [c for exp, plen in zip(expected, prompt_lens) for c in expected_choices(llm, exp, plen)]
    assert len(want) == n * len(PROMPTS)
    assert [(c.text, c.finish_reason) for c in out.choices] == [(text, reason) for text, reason, _ in want]
    assert out.usage.prompt_tokens == sum(prompt_lens)
    assert out.usage.completion_tokens == sum(num for _, _, num in want)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_chat_matches_llm_beam_search(client, model, llm):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "a loop"}]
    ip = llm.llm_engine.input_processor
    text = ip.apply_chat_template(messages, add_generation_prompt=True)
    prompt_ids = ip.tokenize(text, add_special_tokens=False)
    expected = llm.beam_search([prompt_ids], BeamSearchParams(beam_width=3, max_tokens=6))[0]
    out = client.chat.completions.create(
        model=model, messages=messages, n=3, max_tokens=6, extra_body={"use_beam_search": True}
    )
    want = expected_choices(llm, expected, len(prompt_ids))
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [(c.message.content, c.finish_reason) for c in out.choices] == [(t, r) for t, r, _ in want]
    assert out.usage.prompt_tokens == len(prompt_ids)
    assert out.usage.completion_tokens == sum(num for _, _, num in want)


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"stream": True}, "stream"),
        ({"temperature": 0.7}, "temperature"),
        ({"logprobs": 0}, "logprobs"),
        ({"logprobs": 2}, "logprobs"),
        ({"n": 0}, "n"),
        ({"n": 11}, "n"),  # 2 * 11 logprobs per step > the server's 20
        ({"top_p": 0.5}, "top_p"),
        ({"stop": ["\n"]}, "stop"),
        ({"echo": True}, "echo"),
        ({"length_penalty": "long"}, "length_penalty"),
    ],
)
def test_completion_refusals(client, model, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=model, prompt=PROMPTS[0], max_tokens=4, extra_body={"use_beam_search": True, **extra}
        )
    body = e.value.body
    assert body["type"] == "invalid_request_error" and body["message"]
    assert body["param"] == param, body


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"stream": True}, "stream"),
        ({"temperature": 1.0}, "temperature"),
        ({"logprobs": True}, "logprobs"),
        ({"n": 11}, "n"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_chat_refusals(client, model, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            extra_body={"use_beam_search": True, **extra},
        )
    assert e.value.body["param"] == param, e.value.body


def test_wide_beam_without_eos_fits_logprob_limit(client, model):
    """With ``ignore_eos`` a step needs 2 * n logprobs: n = 10 fits the server's 20."""
    out = client.completions.create(
        model=model,
        prompt=PROMPTS[0],
        n=10,
        max_tokens=3,
        extra_body={"use_beam_search": True, "ignore_eos": True},
    )
    assert len(out.choices) == 10
    assert all(c.finish_reason == "length" for c in out.choices)
