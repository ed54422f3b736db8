"""Per-request timelines: the server's PAGEDLLM_REQUEST_TIMELINE file, the phase histograms on /metrics, and
benchmarks/burst_timeline.py's summary of such a file."""

from __future__ import annotations

import importlib.util
import json
import os
import time

import pytest

from tests.entrypoints.server_utils import PHASE_HISTOGRAMS, REPO_ROOT, RemoteServer, metric

# The stamps a request reaches one after another up to its first chunk out (the last token and the front-end's
# "finished" can come before that chunk is written).
ORDERED_STAMPS = ["arrival", "tokenized", "sent", "queued", "scheduled", "first_token", "first_token_out"]


def _load_tool():
    spec = importlib.util.spec_from_file_location(
        "burst_timeline", REPO_ROOT / "benchmarks" / "burst_timeline.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


burst_timeline = _load_tool()


@pytest.fixture(scope="module")
def timeline_server(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("timeline")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    env["PAGEDLLM_REQUEST_TIMELINE"] = str(tmp / "timeline.jsonl")
    srv = RemoteServer(tiny_llama, tmp / "server.log", env=env)
    srv.timeline_path = tmp / "timeline.jsonl"
    yield srv
    assert srv.stop() == 0, srv.log()
    assert "Traceback" not in srv.log(), srv.log()


def _read_records(path, count: int, timeout_s: float = 10.0) -> list[dict]:
    """The file's records once it holds ``count`` of them (AssertionError after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = burst_timeline.load(path) if path.exists() else []
        if len(records) >= count:
            return records
        assert time.monotonic() < deadline, f"{len(records)} timeline records, expected {count}"
        time.sleep(0.05)


def test_timeline_stamps_and_metrics(timeline_server, tiny_llama):
    client = timeline_server.openai_client()
    client_times = {}  # completion id -> (sent, first chunk with text) on this host's monotonic clock
    prompts = ["def fibonacci(n):", "import os\nimport sys\n", "class Point:"]
    for prompt in prompts:
        sent = time.monotonic()
        first = None
        chunk_id = None
        for chunk in client.completions.create(
            model=tiny_llama, prompt=prompt, max_tokens=6, stream=True, extra_body={"ignore_eos": True}
        ):
            chunk_id = chunk.id
            if first is None and chunk.choices and chunk.choices[0].text:
                first = time.monotonic()
        assert first is not None
        client_times[chunk_id] = (sent, first)
    chat_chunks = list(
        client.chat.completions.create(
            model=tiny_llama, messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
        )
    )
    assert chat_chunks[-1].choices[0].finish_reason is not None
    client.chat.completions.create(
        model=tiny_llama, messages=[{"role": "user", "content": "hello"}], max_tokens=3
    )
    client.completions.create(model=tiny_llama, prompt=["a b", "c d"], max_tokens=2)
    num_requests = len(prompts) + 2 + 2  # a completion with two prompts is two engine requests
    records = _read_records(timeline_server.timeline_path, num_requests)
    assert len(records) == num_requests

    for record in records:
        stamps = record["stamps_ms"]
        assert stamps["arrival"] == 0.0
        ordered = [stamps[name] for name in ORDERED_STAMPS]
        assert None not in ordered, record
        assert ordered == sorted(ordered), record
        assert stamps["first_token"] <= stamps["last_token"] <= stamps["finished"], record
        # The phases that the summary charges to TTFT add up to it.
        d = burst_timeline.durations(record)
        assert sum(d[name] for name, _, _ in burst_timeline.PHASES) == pytest.approx(d["ttft"], abs=1e-2)

    # The server's stamps lie inside what the client saw: it sent before the server's arrival and had the first
    # text after the server wrote it; the gap is the HTTP round trip.
    by_id = {r["request_id"].rpartition("-")[0]: r for r in records}
    for completion_id, (sent, first) in client_times.items():
        record = by_id[completion_id]
        arrival = record["arrival_time"]
        server_ttft_s = record["stamps_ms"]["first_token_out"] / 1000.0
        assert sent <= arrival
        assert arrival + server_ttft_s <= first + 1e-5  # stamps are rounded to the microsecond
        assert (first - sent) - server_ttft_s < 1.0

    summary = burst_timeline.summarise(records)
    assert summary["num_requests"] == num_requests
    shares = [summary["phases"][name]["share"] for name, _, _ in burst_timeline.PHASES]
    assert sum(shares) == pytest.approx(1.0, abs=1e-3)
    assert "of TTFT" in burst_timeline.format_table(summary)

    # Every finished request is observed once in each phase histogram.
    m = timeline_server.wait_idle()
    finished = sum(metric(m, "request_success_total", finished_reason=r) for r in ("stop", "length", "abort"))
    assert finished == num_requests
    for name in PHASE_HISTOGRAMS:
        assert metric(m, f"{name}_count") == num_requests, name
    assert metric(m, "request_prefill_time_seconds_sum") > 0.0


def test_summary_by_hand(tmp_path):
    def record(arrival_time: float, **stamps: float) -> dict:
        return {"request_id": "r", "arrival_time": arrival_time, "stamps_ms": stamps}

    a = record(10.0, arrival=0.0, tokenized=1.0, sent=2.0, queued=4.0, scheduled=10.0, first_token=30.0,
               first_token_out=40.0, last_token=50.0, finished=51.0)  # fmt: skip
    b = record(10.5, arrival=0.0, tokenized=3.0, sent=4.0, queued=6.0, scheduled=30.0, first_token=50.0,
               first_token_out=60.0, last_token=90.0, finished=91.0)  # fmt: skip
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (a, b)) + "\n\n")
    summary = burst_timeline.summarise(burst_timeline.load(path))
    assert summary["num_requests"] == 2
    assert summary["arrival_spread_ms"] == pytest.approx(500.0)
    phases = summary["phases"]
    assert phases["ttft"]["p50"] == pytest.approx(50.0)  # 40 and 60
    assert phases["ttft"]["p90"] == pytest.approx(58.0)
    assert phases["queue"]["mean"] == pytest.approx(15.0)  # 6 and 24
    assert phases["queue"]["share"] == pytest.approx(15.0 / 50.0)
    assert phases["tokenize"]["share"] == pytest.approx(2.0 / 50.0)
    assert phases["decode"]["p50"] == pytest.approx(30.0)  # 20 and 40
    assert "share" not in phases["decode"]
    assert sum(phases[name]["share"] for name, _, _ in burst_timeline.PHASES) == pytest.approx(1.0)
