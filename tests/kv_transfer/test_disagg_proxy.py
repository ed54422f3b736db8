"""`pagedllm disagg-proxy` in front of a `pagedllm serve` prefill instance (kv_producer) and a decode instance
(kv_consumer): completions and chat, streamed or not, equal what one instance answers alone; the decode
instance really loaded the prompts' KV; the client's API key reaches the backends; backend errors come back in
OpenAI's shape; a prefill instance restart fails the requests during the outage (502) and not the later ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.entrypoints.server_utils import API_KEY, REPO_ROOT, RemoteServer, free_port, metric

ARGS = ["--block-size", "4", "--max-model-len", "128"]


def p2p_args(role: str, **extra) -> list[str]:
    config = {"kv_connector": "P2pConnector", "kv_role": role,
              "kv_connector_extra_config": {"pull_timeout_s": 3, "transfer_timeout_s": 5, **extra}}  # fmt: skip
    return [*ARGS, "--kv-transfer-config", json.dumps(config)]


class Proxy:
    def __init__(self, prefill: str, decode: str, log_path) -> None:
        self.port = free_port()
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pagedllm.entrypoints.cli", "disagg-proxy", "--prefill", prefill,
             "--decode", decode, "--port", str(self.port), "--uvicorn-log-level", "warning"],
            stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while True:  # up once /health answers (200: both backends are up)
            assert self.proc.poll() is None and time.monotonic() < deadline, open(log_path).read()
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(20)
        self._log.close()


def start_both(tiny_llama, tmp_path, kv_ports: dict[str, int]) -> tuple[RemoteServer, RemoteServer]:
    """The prefill and decode servers, started side by side."""
    out: dict[str, RemoteServer] = {}

    def start(name: str, args: list[str]) -> None:
        out[name] = RemoteServer(tiny_llama, tmp_path / f"{name}.log", extra_args=args)

    threads = [
        threading.Thread(target=start, args=("prefill", p2p_args("kv_producer", **kv_ports))),
        threading.Thread(target=start, args=("decode", p2p_args("kv_consumer"))),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(out) == {"prefill", "decode"}, "a server did not start (see its log)"
    return out["prefill"], out["decode"]


def test_proxy_end_to_end_and_prefill_restart(tiny_llama, tmp_path):
    # Both of the producer's ports from free_port(): kv_port + 1, the default store port, may be taken.
    kv_ports = {"kv_port": free_port(), "kv_store_port": free_port()}
    prefill, decode = start_both(tiny_llama, tmp_path, kv_ports)
    proxy = None
    try:
        proxy = Proxy(prefill.base_url, decode.base_url, tmp_path / "proxy.log")
        # The reference: the prefill instance alone, before the prompt is in any cache (same weights, same device).
        client, alone = proxy.client(), prefill.openai_client()
        prompt = "the quick brown fox jumps over the lazy dog and then it runs far away"
        kw = dict(model=tiny_llama, max_tokens=8, temperature=0.0, logprobs=2)
        expect = alone.completions.create(prompt=prompt, **kw)
        got = client.completions.create(prompt=prompt, **kw)
        assert decode.wait_idle() and metric(decode.metrics(), "external_prefix_cache_hits_total") > 0
        assert got.choices[0].text == expect.choices[0].text
        for a, b in zip(got.choices[0].logprobs.token_logprobs, expect.choices[0].logprobs.token_logprobs):
            assert a == pytest.approx(b, abs=1e-4)
        stream = client.completions.create(prompt=prompt, stream=True, **kw)
        assert "".join(c.choices[0].text for c in stream) == expect.choices[0].text

        messages = [{"role": "user", "content": "tell me about the brown fox please"}]
        chat_kw = dict(model=tiny_llama, messages=messages, max_tokens=8, temperature=0.0)
        chat_expect = alone.chat.completions.create(**chat_kw).choices[0].message.content
        chat = client.chat.completions.create(**chat_kw)
        assert chat.choices[0].message.content == chat_expect
        chunks = client.chat.completions.create(stream=True, **chat_kw)
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.choices[0].message.content

        # The client's key goes to the backends; their 401 comes back in OpenAI's shape.
        r = httpx.post(proxy.url + "/v1/completions", json={"model": tiny_llama, "prompt": "hi"},
                       headers={"Authorization": "Bearer wrong"}, timeout=30)  # fmt: skip
        assert r.status_code == 401 and "message" in r.json()["error"]

        # The prefill instance restarts: meanwhile 502 (and /health 503), afterwards the proxy works again.
        port = prefill.port
        prefill.stop()
        r = httpx.post(proxy.url + "/v1/completions", json={"model": tiny_llama, "prompt": prompt, "max_tokens": 2},
                       headers=prefill.headers, timeout=30)  # fmt: skip
        assert r.status_code == 502 and r.json()["error"]["code"] == "bad_gateway"
        assert httpx.get(proxy.url + "/health", timeout=10).status_code == 503
        prefill = RemoteServer(
            tiny_llama, tmp_path / "prefill2.log", extra_args=p2p_args("kv_producer", **kv_ports), port=port
        )
        hits = metric(decode.metrics(), "external_prefix_cache_hits_total")
        prompt = "a different prompt after the restart, long enough to span blocks"
        expect = prefill.openai_client().completions.create(prompt=prompt, **kw)
        assert client.completions.create(prompt=prompt, **kw).choices[0].text == expect.choices[0].text
        assert metric(decode.wait_idle(), "external_prefix_cache_hits_total") > hits  # from the new producer
        for server in (prefill, decode):
            assert metric(server.wait_idle(), "integrity_check_failures_total") == 0
    finally:
        if proxy is not None:
            proxy.stop()
        prefill.stop()
        decode.stop()


def test_prefill_leg_asks_one_token_and_keeps_the_kv():
    from pagedllm.entrypoints.disagg_proxy import prefill_body

    body = {"model": "m", "messages": [], "max_completion_tokens": 50, "stream": True, "n": 2,
            "stream_options": {"include_usage": True}, "min_tokens": 5, "kv_transfer_params": {"x": 1}}  # fmt: skip
    out = prefill_body(body)
    assert out == {"model": "m", "messages": [], "max_tokens": 1, "stream": False, "n": 1,
                   "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
    assert body["max_completion_tokens"] == 50  # the decode leg's request is untouched


def test_idle_connections_expire_before_the_backends_close_them():
    """A pooled connection the backend is closing when the proxy reuses it fails that request (ReadError); the
    proxy drops idle connections before uvicorn's keep-alive timeout does."""
    import asyncio

    import uvicorn

    from pagedllm.entrypoints.disagg_proxy import KEEPALIVE_EXPIRY_S, DisaggProxy

    assert KEEPALIVE_EXPIRY_S < uvicorn.Config(app=None).timeout_keep_alive
    proxy = DisaggProxy(["http://127.0.0.1:1"], ["http://127.0.0.1:2"])
    try:
        assert proxy.client._transport._pool._keepalive_expiry == KEEPALIVE_EXPIRY_S
    finally:
        asyncio.run(proxy.close())
