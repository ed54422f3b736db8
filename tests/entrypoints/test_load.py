"""A small load at a fixed rate through the official async `openai` client: every request completes with the
tokens it asked for, and /metrics adds up to what the responses report."""

from __future__ import annotations

import asyncio
import time

from tests.entrypoints.server_utils import PHASE_HISTOGRAMS, metric

NUM_REQUESTS = 40
REQUEST_RATE = 20.0  # requests per second
MAX_TOKENS = 4
HISTOGRAMS = [*PHASE_HISTOGRAMS, "e2e_request_latency_seconds", "time_to_first_token_seconds"]


def _finished(m: dict[str, float]) -> float:
    return sum(metric(m, "request_success_total", finished_reason=r) for r in ("stop", "length", "abort"))


def test_fixed_rate_load(server, tiny_llama):
    before = server.wait_idle()
    client = server.async_openai_client(timeout=60.0)

    async def one(i: int, start: float) -> object:
        # Request i leaves at start + i / rate: an arrival schedule, not a pause between requests.
        await asyncio.sleep(max(0.0, start + i / REQUEST_RATE - time.monotonic()))
        prompt = " ".join(["word"] * (1 + i % 7)) + f" {i}"
        if i % 2:
            return await client.completions.create(
                model=tiny_llama, prompt=prompt, max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True}
            )
        return await client.chat.completions.create(
            model=tiny_llama,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=MAX_TOKENS,
            extra_body={"ignore_eos": True},
        )

    async def run() -> list:
        start = time.monotonic()
        try:
            return await asyncio.wait_for(
                asyncio.gather(*(one(i, start) for i in range(NUM_REQUESTS))), timeout=60.0
            )
        finally:
            await client.close()

    responses = asyncio.run(run())
    assert len(responses) == NUM_REQUESTS
    for response in responses:
        assert response.usage.completion_tokens == MAX_TOKENS
        assert response.choices[0].finish_reason == "length"
    num_prompt_tokens = sum(r.usage.prompt_tokens for r in responses)
    num_generation_tokens = sum(r.usage.completion_tokens for r in responses)

    after = server.wait_idle()
    assert _finished(after) - _finished(before) == NUM_REQUESTS
    assert (
        metric(after, "request_success_total", finished_reason="length")
        - metric(before, "request_success_total", finished_reason="length")
        == NUM_REQUESTS
    )
    assert metric(after, "prompt_tokens_total") - metric(before, "prompt_tokens_total") == num_prompt_tokens
    assert (
        metric(after, "generation_tokens_total") - metric(before, "generation_tokens_total")
        == num_generation_tokens
    )
    for name in HISTOGRAMS:
        assert metric(after, f"{name}_count") - metric(before, f"{name}_count") == NUM_REQUESTS, name
