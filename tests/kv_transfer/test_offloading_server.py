"""`pagedllm serve --kv-offloading-size`: a prompt evicted from a small device cache comes back from the CPU tier
with the same greedy completion, and /metrics counts the tier's hits."""

from __future__ import annotations

import random

from tests.entrypoints.server_utils import RemoteServer, metric


def test_serve_with_cpu_offloading(tiny_llama, tmp_path):
    server = RemoteServer(
        tiny_llama,
        tmp_path / "server.log",
        extra_args=[
            "--block-size", "4", "--num-gpu-blocks-override", "16", "--max-model-len", "64",
            "--kv-offloading-size", "0.01", "--kv-offloading-backend", "native",
        ],
    )  # fmt: skip
    try:
        client = server.openai_client()
        rng = random.Random(0)
        p, q = ([rng.randrange(3, 200) for _ in range(48)] for _ in range(2))

        def complete(prompt: list[int]) -> str:
            out = client.completions.create(model=tiny_llama, prompt=prompt, max_tokens=4, temperature=0.0)
            return out.choices[0].text

        first = complete(p)
        complete(q)  # takes most of the device cache: p's blocks are evicted there, kept in the CPU tier
        assert complete(p) == first
        m = server.wait_idle()
        assert metric(m, "external_prefix_cache_hits_total") > 0
        assert metric(m, "integrity_check_failures_total") == 0
    finally:
        server.stop()
