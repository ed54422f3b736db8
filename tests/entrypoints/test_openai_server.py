"""The OpenAI-compatible server, driven by the official `openai` client (and httpx for raw checks).

One server (tiny random Llama, CPU, float32, API key set) is shared by the server test modules (conftest.py).
Bad input, auth and the fuzz run are in test_server_errors.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from tests.entrypoints.server_utils import API_KEY, REPO_ROOT, metric

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Point:"]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    from pagedllm import LLM

    return LLM(tiny_llama, dtype="float32", device="cpu", block_size=16, kv_cache_memory_bytes=4 << 20)


def sse_events(response: httpx.Response) -> list[str]:
    """The `data:` payloads of an SSE response, checking the framing."""
    body = response.text
    assert body.endswith("data: [DONE]\n\n"), body[-200:]
    events = body.split("\n\n")
    assert events[-1] == ""
    payloads = []
    for event in events[:-1]:
        assert event.startswith("data: "), event
        payloads.append(event[len("data: ") :])
    assert payloads[-1] == "[DONE]"
    return payloads[:-1]


# ------------------------------------------------------------------------------------------ basics


def test_health_version_models(server, client, model):
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert httpx.get(server.base_url + "/version").json()["version"]
    models = client.models.list()
    assert [m.id for m in models.data] == [model]
    assert models.data[0].model_extra["max_model_len"] == 512


def test_greedy_completion_matches_llm(client, model, llm):
    from pagedllm import SamplingParams

    expected = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    for prompt, exp in zip(PROMPTS, expected):
        out = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
        choice = out.choices[0]
        assert choice.text == exp.outputs[0].text
        assert choice.finish_reason == exp.outputs[0].finish_reason
        assert out.usage.prompt_tokens == len(exp.prompt_token_ids)
        assert out.usage.completion_tokens == len(exp.outputs[0].token_ids)
        assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    # Several prompts in one request: one choice each, in order.
    out = client.completions.create(model=model, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [e.outputs[0].text for e in expected]


def test_greedy_chat_matches_llm(client, model, llm):
    from pagedllm import SamplingParams

    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "a loop"}]
    exp = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)[0]
    out = client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == exp.outputs[0].text
    assert out.usage.prompt_tokens == len(exp.prompt_token_ids)
    # Text parts are joined the same way as the engine does.
    parts = [{"role": "user", "content": [{"type": "text", "text": "a loop"}]}]
    out2 = client.chat.completions.create(
        model=model, messages=parts, max_completion_tokens=10, temperature=0
    )
    exp2 = llm.chat(
        [{"role": "user", "content": "a loop"}],
        SamplingParams(temperature=0.0, max_tokens=10),
        use_tqdm=False,
    )
    assert out2.choices[0].message.content == exp2[0].outputs[0].text


def test_token_id_prompts(client, model, llm):
    from pagedllm import SamplingParams

    ids = [[5, 17, 42, 99], [7, 8, 9]]
    expected = llm.generate(
        [{"prompt_token_ids": p} for p in ids], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False
    )
    out = client.completions.create(model=model, prompt=ids, max_tokens=8, temperature=0)
    assert [c.text for c in out.choices] == [e.outputs[0].text for e in expected]
    assert out.usage.prompt_tokens == 7
    single = client.completions.create(model=model, prompt=ids[0], max_tokens=8, temperature=0)
    assert single.choices[0].text == expected[0].outputs[0].text


# --------------------------------------------------------------------------------------- streaming


def test_completion_stream_matches_non_stream_and_usage(server, client, model):
    full = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=16, temperature=0)
    stream = client.completions.create(
        model=model,
        prompt=PROMPTS[0],
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    text = "".join(c.choices[0].text for c in chunks[:-1])
    assert text == full.choices[0].text
    assert chunks[-2].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
    # Raw framing: data lines, [DONE] last.
    raw = httpx.post(
        server.base_url + "/v1/completions",
        headers=server.headers,
        json={"model": model, "prompt": PROMPTS[0], "max_tokens": 5, "stream": True},
    )
    assert raw.status_code == 200 and raw.headers["content-type"].startswith("text/event-stream")
    payloads = [json.loads(p) for p in sse_events(raw)]
    assert all(p["object"] == "text_completion" for p in payloads)
    assert "usage" not in payloads[-1]


def test_chat_stream(client, model):
    messages = [{"role": "user", "content": "hello"}]
    full = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0, n=2)
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=12,
        temperature=0,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == full.usage.completion_tokens
    texts = {0: "", 1: ""}
    seen_role = set()
    finish = {}
    for chunk in chunks[:-1]:
        assert chunk.object == "chat.completion.chunk"
        (choice,) = chunk.choices
        if choice.index not in seen_role:
            assert choice.delta.role == "assistant"  # the role comes first, alone
            seen_role.add(choice.index)
        else:
            assert choice.delta.role is None
        assert choice.index not in finish, "a chunk after finish_reason"
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason is not None:
            finish[choice.index] = choice.finish_reason
    assert texts == {c.index: c.message.content for c in full.choices}
    assert finish == {c.index: c.finish_reason for c in full.choices}


def test_echo(client, model):
    out = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=6, temperature=0, echo=True)
    plain = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=6, temperature=0)
    assert out.choices[0].text == PROMPTS[1] + plain.choices[0].text
    stream = client.completions.create(
        model=model, prompt=PROMPTS[1], max_tokens=6, temperature=0, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == out.choices[0].text


# ----------------------------------------------------------------------------------- n, seed, stop


def test_n_and_seed(client, model):
    kw = dict(model=model, prompt=PROMPTS[2], max_tokens=10, temperature=1.0, n=2, seed=1234)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    # Two prompts x n=2: indices prompt * n + i.
    c = client.completions.create(model=model, prompt=PROMPTS[:2], max_tokens=4, temperature=0, n=2)
    assert sorted(ch.index for ch in c.choices) == [0, 1, 2, 3]
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "x"}], max_tokens=8, temperature=1.0, n=2, seed=7
    )
    chat2 = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "x"}], max_tokens=8, temperature=1.0, n=2, seed=7
    )
    assert [ch.message.content for ch in chat.choices] == [ch.message.content for ch in chat2.choices]


def test_stop_strings(client, model):
    base = client.completions.create(
        model=model, prompt=PROMPTS[0], max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    )
    text = base.choices[0].text
    # A stop string from the middle of the greedy text: the output ends right before it.
    stop = next(
        text[i : i + 2]
        for i in range(3, len(text) - 2)
        if text[i : i + 2].strip() and "\ufffd" not in text[i : i + 2]
    )
    cut = text[: text.index(stop)]
    out = client.completions.create(
        model=model,
        prompt=PROMPTS[0],
        max_tokens=24,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].text == cut
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] == stop
    stream = client.completions.create(
        model=model,
        prompt=PROMPTS[0],
        max_tokens=24,
        temperature=0,
        stop=stop,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


# --------------------------------------------------------------------------------------- logprobs


def test_completion_logprobs(client, model):
    out = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    n = out.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.text_offset[0] == 0
    for i in range(1, n):
        assert lp.text_offset[i] == lp.text_offset[i - 1] + len(lp.tokens[i - 1])
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0.0
        assert 1 <= len(top) <= 4 and token in top
        # greedy: the sampled token is the most likely one (different ids may share a text, e.g. partial
        # UTF-8 bytes shown as U+FFFD, so the dict can hold fewer entries and a lower value under that text)
        assert value >= max(top.values()) - 1e-4
    # echo + logprobs: prompt tokens first, the very first without a logprob.
    echo = client.completions.create(
        model=model, prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=1, echo=True
    )
    elp = echo.choices[0].logprobs
    assert len(elp.tokens) == echo.usage.prompt_tokens + echo.usage.completion_tokens
    assert elp.token_logprobs[0] is None and elp.top_logprobs[0] is None
    assert all(v is not None for v in elp.token_logprobs[1:])
    # echo with max_tokens=0 scores the prompt (lm-eval-harness style): prompt logprobs, no completion.
    score = client.completions.create(
        model=model, prompt=PROMPTS[0], max_tokens=0, temperature=0, logprobs=1, echo=True
    )
    slp = score.choices[0].logprobs
    assert score.choices[0].text == PROMPTS[0] and score.usage.completion_tokens == 0
    assert slp.tokens == elp.tokens[: echo.usage.prompt_tokens]
    assert slp.token_logprobs[1:] == pytest.approx(elp.token_logprobs[1 : echo.usage.prompt_tokens], abs=1e-4)
    # streamed: offsets continue across chunks
    stream = client.completions.create(
        model=model, prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=3, stream=True
    )
    streamed_tokens, streamed_values = [], []
    for chunk in stream:
        streamed_tokens += chunk.choices[0].logprobs.tokens
        streamed_values += chunk.choices[0].logprobs.token_logprobs
    assert streamed_tokens == lp.tokens
    assert streamed_values == pytest.approx(lp.token_logprobs, abs=1e-4)


def test_chat_logprobs(client, model):
    out = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0.0 and entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-4)  # greedy
    none = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert none.choices[0].logprobs is None


# ------------------------------------------------------------------------------ tokenize / detokenize


def test_tokenize_detokenize(server, model):
    h = server.headers
    r = httpx.post(server.base_url + "/tokenize", headers=h, json={"model": model, "prompt": "hello world"})
    assert r.status_code == 200
    body = r.json()
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 512
    r = httpx.post(
        server.base_url + "/detokenize", headers=h, json={"model": model, "tokens": body["tokens"]}
    )
    assert r.status_code == 200 and r.json()["prompt"].endswith("hello world")
    r = httpx.post(
        server.base_url + "/tokenize", headers=h, json={"messages": [{"role": "user", "content": "hi"}]}
    )
    assert r.status_code == 200 and r.json()["count"] > 1
    r = httpx.post(server.base_url + "/detokenize", headers=h, json={"tokens": [1, 10**6]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


# ---------------------------------------------------------------------------- load, cancel, metrics


def test_metrics_advance(server, client, model):
    before = server.metrics()
    client.completions.create(
        model=model, prompt=PROMPTS[0], max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=3)
    after = server.metrics()
    assert (
        metric(after, "request_success_total", finished_reason="length")
        >= metric(before, "request_success_total", finished_reason="length") + 1
    )
    assert metric(after, "generation_tokens_total") >= metric(before, "generation_tokens_total") + 5
    assert metric(after, "prompt_tokens_total") > metric(before, "prompt_tokens_total")
    assert metric(after, "prefix_cache_queries_total") > metric(before, "prefix_cache_queries_total")
    for name in ("time_to_first_token_seconds_count", "e2e_request_latency_seconds_count"):
        assert metric(after, name) >= metric(before, name) + 2
    assert (
        metric(after, "inter_token_latency_seconds_count")
        >= metric(before, "inter_token_latency_seconds_count") + 4
    )
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total",
                 "prefix_cache_hits_total", "request_queue_time_seconds_count"):  # fmt: skip
        assert f"pagedllm:{name}" in {k.partition("{")[0] for k in after}


def test_disconnect_aborts(server, model):
    before = server.metrics()
    body = {"model": model, "prompt": "x", "max_tokens": 400, "stream": True, "ignore_eos": True}
    start = time.monotonic()
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, headers=server.headers) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
    m = server.wait_idle()
    assert time.monotonic() - start < 20
    assert metric(m, "kv_cache_usage_perc") == 0.0
    assert (
        metric(m, "request_success_total", finished_reason="abort")
        >= metric(before, "request_success_total", finished_reason="abort") + 1
    )


def test_concurrent_streams_with_cancellations(server, model):
    """50 streamed requests run to the end while 20 more are cancelled midway; nothing leaks."""

    async def run() -> tuple[list[tuple[str, int, str | None]], int]:
        aclient = server.async_openai_client()

        async def complete(i: int) -> tuple[str, int, str | None]:
            stream = await aclient.completions.create(
                model=model, prompt=f"# task {i}\n", max_tokens=12, temperature=0.8, seed=i, stream=True,
                stream_options={"include_usage": True},
            )  # fmt: skip
            text, finish, usage = "", None, None
            async for chunk in stream:
                if chunk.choices:
                    assert finish is None
                    text += chunk.choices[0].text
                    finish = chunk.choices[0].finish_reason
                else:
                    usage = chunk.usage
            assert finish in ("stop", "length") and usage is not None
            return text, usage.completion_tokens, finish

        async def cancelled(i: int) -> int:
            async with httpx.AsyncClient(timeout=60) as http:
                body = {
                    "model": model,
                    "prompt": f"# cancel {i}\n",
                    "max_tokens": 300,
                    "stream": True,
                    "ignore_eos": True,
                }
                async with http.stream(
                    "POST", server.base_url + "/v1/completions", json=body, headers=server.headers
                ) as r:
                    seen = 0
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            seen += 1
                            if seen == 2 + i % 3:
                                return seen  # leaving the block closes the connection midway
            raise AssertionError("a cancelled stream ran to its end")

        tasks = [asyncio.create_task(complete(i)) for i in range(50)]
        tasks += [asyncio.create_task(cancelled(i)) for i in range(20)]
        results = await asyncio.gather(*tasks)
        await aclient.close()
        return results[:50], len(results[50:])

    completed, num_cancelled = asyncio.run(run())
    assert num_cancelled == 20
    assert all(
        num_tokens >= 1 and (num_tokens == 12 or finish == "stop") for _, num_tokens, finish in completed
    )
    m = server.wait_idle()
    assert metric(m, "kv_cache_usage_perc") == 0.0


def test_raw_stream_framing_under_load(server, model):
    """Every stream of a concurrent batch is well-formed SSE ending in [DONE]."""

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as http:
            bodies = [
                {"model": model, "prompt": f"x{i}", "max_tokens": 6, "stream": True, "n": 1 + i % 2}
                for i in range(10)
            ]
            return await asyncio.gather(
                *(
                    http.post(server.base_url + "/v1/completions", json=b, headers=server.headers)
                    for b in bodies
                )
            )

    for response in asyncio.run(run()):
        assert response.status_code == 200
        for payload in sse_events(response):
            assert json.loads(payload)["choices"]


# ------------------------------------------------------------------------------------------- bench


def test_bench_serve(server, model, tmp_path):
    out = tmp_path / "result.json"
    cmd = [
        sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", "serve", "--base-url", server.base_url,
        "--model", model, "--api-key", API_KEY, "--num-prompts", "6", "--random-input-len", "16",
        "--random-output-len", "6", "--ignore-eos", "--max-concurrency", "3", "--request-rate", "20",
        "--save-result", str(out),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=REPO_ROOT, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Serving Benchmark Result" in proc.stdout and "Mean TTFT (ms)" in proc.stdout
    result = json.loads(out.read_text())
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["total_input_tokens"] == 6 * 16 and result["total_output_tokens"] == 6 * 6
    assert result["mean_ttft_ms"] > 0 and result["mean_tpot_ms"] > 0 and result["p99_itl_ms"] > 0
    assert len(result["itls"]) == 6 and all(1 <= len(itl) <= 5 for itl in result["itls"])
