"""Server faults: the engine core process killed mid-traffic, and SIGTERM with requests in flight.

Each test starts its own server (they end it).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.entrypoints.server_utils import RemoteServer


@pytest.fixture
def fresh_server(tiny_llama, tmp_path):
    srv = RemoteServer(tiny_llama, tmp_path / "server.log")
    yield srv
    srv.stop(signal.SIGKILL)


def _stream_lines(
    srv: RemoteServer, body: dict, out: dict, key: str, first_chunk: threading.Event | None = None
):
    try:
        with httpx.stream(
            "POST", srv.base_url + "/v1/completions", json=body, headers=srv.headers, timeout=60
        ) as r:
            out[key + "_status"] = r.status_code
            lines = []
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    if first_chunk is not None:
                        first_chunk.set()
            out[key] = lines
    except Exception as e:  # noqa: BLE001 - recorded for the assertions
        out[key] = e


def test_engine_death(fresh_server, tiny_llama):
    srv = fresh_server
    body = {"model": tiny_llama, "prompt": "x", "max_tokens": 450, "ignore_eos": True}
    results: dict = {}
    started = threading.Event()
    threads = [
        threading.Thread(target=_stream_lines, args=(srv, {**body, "stream": True}, results, "s1", started)),
        threading.Thread(target=_stream_lines, args=(srv, {**body, "stream": True, "n": 2}, results, "s2")),
    ]

    def blocking() -> None:
        try:
            results["b"] = httpx.post(
                srv.base_url + "/v1/completions", json=body, headers=srv.headers, timeout=60
            )
        except Exception as e:  # noqa: BLE001
            results["b"] = e

    threads.append(threading.Thread(target=blocking))
    for t in threads:
        t.start()
    assert started.wait(30)
    time.sleep(0.3)
    os.kill(srv.engine_pid(), signal.SIGKILL)
    killed_at = time.monotonic()
    for t in threads:
        t.join(15)
        assert not t.is_alive(), "an in-flight request hangs after the engine died"
    assert time.monotonic() - killed_at < 10
    # Streams: 200 already sent, so an error event, then [DONE].
    for key in ("s1", "s2"):
        lines = results[key]
        assert isinstance(lines, list), lines
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2][len("data: ") :])["error"]
        assert error["code"] == "engine_dead" and "died" in error["message"]
    # Non-streamed: a 5xx in OpenAI's shape.
    response = results["b"]
    assert isinstance(response, httpx.Response), response
    assert response.status_code == 503 and response.json()["error"]["code"] == "engine_dead"
    # /health turns 503 at once, new requests fail fast, then the server exits non-zero by itself.
    health = httpx.get(srv.base_url + "/health", timeout=5)
    assert health.status_code == 503
    r = httpx.post(
        srv.base_url + "/v1/completions", json={**body, "max_tokens": 1}, headers=srv.headers, timeout=5
    )
    assert r.status_code == 503
    srv.proc.wait(30)
    assert srv.proc.returncode not in (0, None), srv.log()


def test_sigterm_finishes_in_flight_requests_and_exits_0(fresh_server, tiny_llama):
    srv = fresh_server
    body = {"model": tiny_llama, "prompt": "x", "max_tokens": 40, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    results: dict = {}
    started = threading.Event()
    thread = threading.Thread(target=_stream_lines, args=(srv, body, results, "s", started))
    thread.start()
    assert started.wait(30)
    srv.proc.send_signal(signal.SIGTERM)
    thread.join(60)
    assert not thread.is_alive()
    lines = results["s"]
    assert isinstance(lines, list), lines
    assert lines[-1] == "data: [DONE]"
    usage = json.loads(lines[-2][len("data: ") :])["usage"]
    assert usage["completion_tokens"] == 40  # it ran to the end
    assert srv.proc.wait(30) == 0, srv.log()
    # The engine core process is gone too.
    with pytest.raises(ProcessLookupError):
        for _ in range(50):
            os.kill(srv.engine_pid(), 0)
            time.sleep(0.1)
    assert "Traceback" not in srv.log(), srv.log()
