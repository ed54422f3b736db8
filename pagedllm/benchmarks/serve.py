"""`pagedllm bench serve`: load-test any OpenAI-compatible server, with vLLM's `bench serve` definitions.

Prompts come from ``--dataset-name`` (random, sonnet, sharegpt, prefix_repetition, custom; built as vLLM builds
them, see ``pagedllm.benchmarks.datasets``). Requests are streamed (``stream: true`` with
``stream_options.include_usage``) and sent at ``--request-rate`` requests/s (``inf`` sends all at once) with
gamma-distributed gaps of shape ``--burstiness`` (1 is a Poisson process; the send times are rescaled so the last
one falls at ``num_requests / rate``, as vLLM does), at most ``--max-concurrency`` in flight (a semaphore around
each request: a request that arrives while that many are running waits for one to finish). Per request:

- TTFT: request sent -> first chunk carrying output;
- ITL: every gap between consecutive output chunks after the first;
- TPOT: (E2EL - TTFT) / (output tokens - 1), requests with more than one output token only;
- E2EL: request sent -> last chunk.

Output tokens come from the usage the server reports (or the number of chunks when it reports none). Throughputs
divide by the wall time of the whole run: requests/s over successful requests, output tokens/s, and total
(prompt + output) tokens/s. With ``--goodput ttft:MS tpot:MS e2el:MS`` a successful request is good when it meets
every SLO given (its TPOT counts as 0 with one output token); goodput is good requests/s. Latencies are reported in
ms as mean, median, std and the ``--metric-percentiles`` of the ``--percentile-metrics``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from pagedllm.benchmarks import datasets
from pagedllm.benchmarks.datasets import SampleRequest

PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
HTTP_CLIENTS = ("auto", "aiohttp", "httpx")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
DATASET_NAMES = ("random", "random-mm", "sonnet", "sharegpt", "prefix_repetition", "custom")
# Per-request lists of the result JSON (vLLM's detailed keys).
PER_REQUEST_KEYS = (
    "input_lens",
    "output_lens",
    "ttfts",
    "itls",
    "latencies",
    "start_times",
    "generated_texts",
)


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)  # seconds
    latency: float = 0.0  # seconds
    error: str = ""
    start_time: float = 0.0  # seconds: when the request was sent (after the run, relative to the run's start)
    generated_text: str = ""


def _add_dataset_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset-name", default="random", choices=DATASET_NAMES)
    parser.add_argument(
        "--dataset-path",
        default=None,
        help="sharegpt: the JSON file; custom: the .jsonl file; sonnet: a text file (default: the bundled sonnets)",
    )
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--input-len", type=int, default=None, help="sets --random-input-len")
    parser.add_argument(
        "--output-len",
        type=int,
        default=None,
        help="sets the output length of every dataset (random, sharegpt, custom, prefix_repetition)",
    )
    parser.add_argument("--disable-shuffle", action="store_true", help="keep the dataset file's order")
    parser.add_argument("--no-oversample", action="store_true", help="do not repeat requests of a short file")
    parser.add_argument(
        "--skip-chat-template", action="store_true", help="custom: send prompts without the chat template"
    )
    group = parser.add_argument_group("random dataset options")
    group.add_argument("--random-input-len", type=int, default=1024)
    group.add_argument("--random-output-len", type=int, default=128)
    group.add_argument("--random-range-ratio", type=float, default=0.0)
    group.add_argument(
        "--random-prefix-len",
        type=int,
        default=0,
        help="random tokens shared by every prompt, before its own",
    )
    group = parser.add_argument_group("random multimodal dataset options (random-mm; chat endpoint)")
    group.add_argument("--random-mm-base-items-per-request", type=int, default=1)
    group.add_argument("--random-mm-num-mm-items-range-ratio", type=float, default=0.0)
    group.add_argument(
        "--random-mm-limit-mm-per-prompt", type=json.loads, default={"image": 255},
        help='JSON, e.g. \'{"image": 4}\': at most this many images per request',
    )  # fmt: skip
    group.add_argument(
        "--random-mm-bucket-config", default="{(256, 256, 1): 0.5, (720, 1280, 1): 0.5}",
        help="{(height, width, frames): probability}: image sizes (frames 1) and how often each comes",
    )  # fmt: skip
    group.add_argument(
        "--random-mm-num-unique-images", type=int, default=None,
        help="draw images from a pool of this many, so requests repeat them (default: every image is new)",
    )  # fmt: skip
    group = parser.add_argument_group("sonnet dataset options")
    group.add_argument("--sonnet-input-len", type=int, default=550)
    group.add_argument("--sonnet-output-len", type=int, default=150)
    group.add_argument("--sonnet-prefix-len", type=int, default=200)
    group = parser.add_argument_group("sharegpt dataset options")
    group.add_argument(
        "--sharegpt-output-len", type=int, default=None, help="default: each reply's length in tokens"
    )
    group = parser.add_argument_group("custom dataset options")
    group.add_argument(
        "--custom-output-len", type=int, default=256, help="for lines without an 'output_tokens' field"
    )
    group = parser.add_argument_group("prefix repetition dataset options")
    group.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    group.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    group.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    group.add_argument("--prefix-repetition-output-len", type=int, default=128)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (no /v1)")
    parser.add_argument(
        "--endpoint", default=None, choices=["/v1/completions", "/v1/chat/completions"],
        help="default: /v1/chat/completions for --backend openai-chat, else /v1/completions",
    )  # fmt: skip
    parser.add_argument(
        "--backend",
        default=None,
        choices=["openai", "openai-chat", "vllm"],
        help="vLLM's name for the endpoint kind (default: from --endpoint); the result's 'backend'",
    )
    parser.add_argument(
        "--label", default=None, help="the result's label and file-name prefix (default: backend)"
    )
    parser.add_argument(
        "--model", default=None, help="model name to send (default: the server's first model)"
    )
    parser.add_argument(
        "--tokenizer", default=None, help="tokenizer for the prompts (default: the model's path)"
    )
    parser.add_argument("--api-key", default=None, help="default: env OPENAI_API_KEY or PAGEDLLM_API_KEY")
    _add_dataset_args(parser)
    parser.add_argument(
        "--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf: all at once"
    )
    parser.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the arrival gaps: 1 is Poisson, < 1 burstier, > 1 more even, inf constant gaps",
    )
    parser.add_argument(
        "--max-concurrency", type=int, default=None, help="at most this many requests in flight"
    )
    parser.add_argument(
        "--prompt-type",
        default="token_ids",
        choices=["token_ids", "text"],
        help="completions, random and prefix_repetition: send token ids (exact lengths) or decoded text",
    )
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send ignore_eos (a vLLM extension); always on for the random dataset, as in vLLM",
    )
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="KEY:MS",
        help="SLOs in ms, e.g. ttft:500 tpot:50 e2el:2000: goodput counts the requests that meet all of them",
    )
    parser.add_argument(
        "--percentile-metrics",
        default=",".join(PERCENTILE_METRICS),
        help="comma-separated metrics to report (of ttft,tpot,itl,e2el)",
    )
    parser.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    parser.add_argument(
        "--save-result",
        nargs="?",
        const="",
        default=None,
        metavar="FILE.json",
        help="write the result JSON: to FILE.json, or without a value to --result-dir/--result-filename "
        "(default: {label}-{rate}qps[-concurrency{n}]-{model}-{date}.json)",
    )
    parser.add_argument("--save-detailed", action="store_true", help="accepted for vLLM compatibility: "
                        "the per-request lists are always saved")  # fmt: skip
    parser.add_argument(
        "--result-dir", default=None, help="directory of the result JSON (created if missing)"
    )
    parser.add_argument("--result-filename", default=None, help="file name of the result JSON")
    parser.add_argument(
        "--metadata", nargs="*", default=None, metavar="KEY=VALUE", help="extra keys of the result JSON"
    )
    parser.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png",
        help="a PNG of the TTFT and TPOT distributions and the output throughput over time (needs matplotlib)",
    )
    parser.add_argument("--disable-tqdm", action="store_true", help="accepted for vLLM compatibility")
    parser.add_argument("--request-timeout", type=float, default=6 * 3600.0)
    parser.add_argument(
        "--http-client",
        default="auto",
        choices=HTTP_CLIENTS,
        help="the client library: aiohttp (vLLM's; auto picks it when installed) or httpx",
    )


# ------------------------------------------------------------------------------------------- requests


def _chunk_text(obj: dict[str, Any], chat: bool) -> str | None:
    """The output text of a stream chunk, or None when it carries no choice."""
    choices = obj.get("choices")
    if not choices:
        return None
    choice = choices[0]
    if chat:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


def make_http_client(name: str, request_timeout: float, max_concurrency: int | None) -> Any:
    """The client session the requests share: aiohttp (what vLLM's client uses; it spends far less CPU per stream
    than httpx when hundreds are open at once, which shows in the measured TTFT) or httpx. ``auto``: aiohttp when
    installed. Use it as an async context manager."""
    if name not in HTTP_CLIENTS:
        raise ValueError(f"--http-client must be one of {', '.join(HTTP_CLIENTS)}, got {name!r}")
    if name in ("auto", "aiohttp"):
        try:
            import aiohttp
        except ImportError:
            if name == "aiohttp":
                raise ValueError(
                    "--http-client aiohttp: aiohttp is not installed (pip install aiohttp)"
                ) from None
        else:
            connector = aiohttp.TCPConnector(limit=max_concurrency or 0, keepalive_timeout=60)
            timeout = aiohttp.ClientTimeout(total=request_timeout, connect=30.0)
            return aiohttp.ClientSession(connector=connector, timeout=timeout, read_bufsize=1 << 16)
    import httpx

    timeout = httpx.Timeout(request_timeout, connect=30.0)
    limits = httpx.Limits(max_connections=max_concurrency or None, max_keepalive_connections=None)
    return httpx.AsyncClient(timeout=timeout, limits=limits)


@contextlib.asynccontextmanager
async def _post_stream(
    client: Any, url: str, payload: dict[str, Any], headers: dict[str, str]
) -> AsyncIterator[tuple[int, AsyncIterator[str], Callable[[], Awaitable[str]]]]:
    """POST ``payload`` on an aiohttp or httpx client: ``(status, the body's lines, read the whole body)``."""
    if hasattr(client, "stream"):  # httpx.AsyncClient
        async with client.stream("POST", url, json=payload, headers=headers) as response:

            async def read_httpx() -> str:
                return (await response.aread()).decode(errors="replace")

            yield response.status_code, response.aiter_lines(), read_httpx
        return
    async with client.post(url, json=payload, headers=headers) as response:  # aiohttp.ClientSession

        async def lines() -> AsyncIterator[str]:
            async for raw in response.content:  # one line at a time
                yield raw.decode("utf-8", errors="replace")

        async def read_aiohttp() -> str:
            return await response.text(errors="replace")

        yield response.status, lines(), read_aiohttp


async def send_request(
    client: Any, url: str, payload: dict[str, Any], headers: dict[str, str], prompt_len: int, chat: bool
) -> RequestResult:
    """Send one streamed request; time its chunks. A failure is returned as a result, never raised."""
    result = RequestResult(prompt_len=prompt_len)
    start = time.perf_counter()
    result.start_time = start
    last = start
    num_chunks = 0
    usage_tokens = None
    texts: list[str] = []
    try:
        async with _post_stream(client, url, payload, headers) as (status, lines, read_body):
            if status != 200:
                body = await read_body()
                result.error = f"HTTP {status}: {body[:500]}"
                return result
            async for line in lines:
                line = line.strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    result.error = json.dumps(obj["error"])[:500]
                    return result
                if obj.get("usage"):
                    usage_tokens = obj["usage"].get("completion_tokens")
                text = _chunk_text(obj, chat)
                # Chat streams open with a role-only chunk: output starts with the first content.
                if text is None or (chat and not text and not (obj["choices"][0].get("finish_reason"))):
                    continue
                now = time.perf_counter()
                if num_chunks == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                num_chunks += 1
                texts.append(text)
        result.latency = last - start
        result.output_len = usage_tokens if usage_tokens is not None else num_chunks
        result.generated_text = "".join(texts)
        result.success = num_chunks > 0
        if not result.success:
            result.error = "the stream carried no output"
    except Exception as e:  # noqa: BLE001 - a failed request is a data point, not a crash
        result.error = f"{type(e).__name__}: {e}"
    return result


def build_payload(args: argparse.Namespace, model: str, request: SampleRequest, chat: bool) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": model,
        "max_tokens": request.expected_output_len,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if chat and request.mm_content:
        content = [{"type": "text", "text": request.prompt or ""}, *request.mm_content]
        payload["messages"] = [{"role": "user", "content": content}]
    elif chat:
        payload["messages"] = [{"role": "user", "content": request.prompt or ""}]
    elif args.prompt_type == "text" or request.prompt_token_ids is None:
        payload["prompt"] = request.prompt or ""
    else:
        payload["prompt"] = request.prompt_token_ids
    if args.ignore_eos:
        payload["ignore_eos"] = True
    return payload


def interarrival_gaps(
    num_requests: int, request_rate: float, burstiness: float, rng: np.random.Generator
) -> np.ndarray:
    """``num_requests`` gaps (s) before each request: gamma(shape=burstiness, scale=1/(rate * burstiness)), whose
    mean is 1/rate and variance 1/(rate^2 * burstiness); all 0 for an infinite rate, all 1/rate for an infinite
    burstiness."""
    if not request_rate > 0:
        raise ValueError(f"--request-rate must be > 0, got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if math.isinf(request_rate):
        return np.zeros(num_requests)
    if math.isinf(burstiness):
        return np.full(num_requests, 1.0 / request_rate)
    return rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests)


def arrival_times(
    num_requests: int, request_rate: float, burstiness: float, rng: np.random.Generator
) -> np.ndarray:
    """When each request is sent, in s after the start: the running sum of ``interarrival_gaps``, rescaled (as
    vLLM does) so the last request goes at ``num_requests / request_rate``, which steadies the achieved rate
    across seeds."""
    times = np.cumsum(interarrival_gaps(num_requests, request_rate, burstiness, rng))
    if times.size and times[-1] > 0:
        times *= (num_requests / request_rate) / times[-1]
    return times


async def run_benchmark(
    args: argparse.Namespace, model: str, requests: list[SampleRequest], headers: dict[str, str]
) -> tuple[list[RequestResult], float]:
    """Send ``requests`` on the arrival schedule; return their results (``start_time`` relative to the run's
    start) and the run's wall time."""
    chat = _is_chat(args)
    url = args.base_url.rstrip("/") + args.endpoint
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    async with make_http_client(args.http_client, args.request_timeout, args.max_concurrency) as client:

        async def one(request: SampleRequest) -> RequestResult:
            payload = build_payload(args, model, request, chat)
            if limit is None:
                return await send_request(client, url, payload, headers, request.prompt_len, chat)
            async with limit:
                return await send_request(client, url, payload, headers, request.prompt_len, chat)

        # One request first, so a misconfigured run fails fast with the server's message.
        first = requests[0]
        probe = await one(SampleRequest(first.prompt_token_ids, first.prompt_len, 2, first.prompt))
        if not probe.success:
            raise RuntimeError(f"the first test request failed: {probe.error}")
        times = arrival_times(
            len(requests), args.request_rate, args.burstiness, np.random.default_rng(args.seed)
        )
        start = time.perf_counter()
        tasks = []
        for request, at in zip(requests, times):
            delay = start + float(at) - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(request)))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
    for r in results:
        r.start_time -= start
    return results, duration


# -------------------------------------------------------------------------------------------- metrics


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (ms), checked as vLLM checks them."""
    slos: dict[str, float] = {}
    for pair in pairs or []:
        name, sep, value = pair.partition(":")
        try:
            slos[name] = float(value) if sep else float("nan")
        except ValueError:
            slos[name] = float("nan")
        if not sep or math.isnan(slos[name]):
            raise ValueError(f"--goodput: {pair!r} is not KEY:VALUE with a number of milliseconds")
        if name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput: {name!r} is not one of {', '.join(GOODPUT_METRICS)}")
        if slos[name] < 0:
            raise ValueError(f"--goodput: {pair!r} must not be negative")
    return slos


def parse_percentile_metrics(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in PERCENTILE_METRICS]
    if unknown:
        raise ValueError(
            f"--percentile-metrics: {', '.join(unknown)} not among {', '.join(PERCENTILE_METRICS)}"
        )
    return names


def _percentile_key(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def throughput_timeline(results: list[RequestResult]) -> dict[str, Any]:
    """Per one-second bucket from the first successful request's start: output chunks received, and requests in
    flight at some point of that second; plus the peak number in flight at once (vLLM's peak metrics)."""
    ok = [r for r in results if r.success]
    if not ok:
        return {
            "seconds": [],
            "output_tokens_per_s": [],
            "concurrent_requests": [],
            "max_concurrent_requests": 0,
        }
    t0 = min(r.start_time for r in ok)
    num_buckets = int(math.ceil(max(r.start_time + r.latency for r in ok) - t0)) + 1
    tokens = np.zeros(num_buckets)
    concurrent = np.zeros(num_buckets)
    events = []
    for r in ok:
        token_times = r.start_time + r.ttft + np.concatenate([[0.0], np.cumsum(r.itl)])
        for t in token_times:
            bucket = int(t - t0)
            if 0 <= bucket < num_buckets:
                tokens[bucket] += 1
        first = int(r.start_time - t0)
        last = min(num_buckets, int(math.ceil(r.start_time + r.latency - t0)))
        concurrent[first : max(last, first + 1)] += 1
        events += [(r.start_time, 1), (r.start_time + r.latency, -1)]
    peak = running = 0
    for _, delta in sorted(events):  # an end before a start at the same instant: intervals are half-open
        running += delta
        peak = max(peak, running)
    return {
        "seconds": list(range(num_buckets)),
        "output_tokens_per_s": tokens.tolist(),
        "concurrent_requests": concurrent.tolist(),
        "max_concurrent_requests": peak,
    }


def calculate_metrics(
    results: list[RequestResult],
    duration: float,
    percentiles: list[float],
    goodput: dict[str, float] | None = None,
    percentile_metrics: list[str] | tuple[str, ...] = PERCENTILE_METRICS,
) -> dict[str, Any]:
    """vLLM's serving metrics of ``results`` over a run of ``duration`` s (see the module docstring).

    ``goodput`` maps ttft/tpot/e2el to SLOs in ms; ``request_goodput`` is None without it. Latency statistics
    (``mean_ttft_ms``, ``p99_ttft_ms``...) are given for ``percentile_metrics`` only, over successful requests."""
    ok = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_len for r in ok)
    ttfts = [r.ttft for r in ok]
    tpots = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    itls = [gap for r in ok for gap in r.itl]
    e2els = [r.latency for r in ok]
    good = None
    if goodput:
        good = 0
        for r in ok:
            per_request = {
                "ttft": r.ttft,
                "tpot": (r.latency - r.ttft) / (r.output_len - 1) if r.output_len > 1 else 0.0,
                "e2el": r.latency,
            }
            if all(per_request[name] <= slo_ms / 1000.0 for name, slo_ms in goodput.items()):
                good += 1
    timeline = throughput_timeline(results)

    def per_s(n: float) -> float:
        return n / duration if duration > 0 else 0.0

    metrics: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": per_s(len(ok)),
        "request_goodput": per_s(good) if good is not None else None,
        "output_throughput": per_s(total_output),
        "total_token_throughput": per_s(total_input + total_output),
        "max_output_tokens_per_s": max(timeline["output_tokens_per_s"], default=0.0),
        "max_concurrent_requests": timeline["max_concurrent_requests"],
    }
    values = {"ttft": ttfts, "tpot": tpots, "itl": itls, "e2el": e2els}
    for name in percentile_metrics:
        arr = np.asarray(values[name] or [0.0], dtype=np.float64) * 1000.0
        metrics[f"mean_{name}_ms"] = float(arr.mean())
        metrics[f"median_{name}_ms"] = float(np.median(arr))
        metrics[f"std_{name}_ms"] = float(arr.std())
        for p in percentiles:
            metrics[f"p{_percentile_key(p)}_{name}_ms"] = float(np.percentile(arr, p))
    return metrics


def print_table(
    metrics: dict[str, Any],
    percentiles: list[float],
    max_concurrency: int | None,
    rate: float,
    percentile_metrics: list[str] | tuple[str, ...] = PERCENTILE_METRICS,
) -> None:
    def row(label: str, value: Any, fmt: str = "") -> None:
        print(f"{label:<40} {value:<10{fmt}}")

    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    row("Successful requests:", metrics["completed"])
    row("Failed requests:", metrics["failed"])
    if max_concurrency is not None:
        row("Maximum request concurrency:", max_concurrency)
    row("Request rate configured (RPS):", rate, ".2f")
    row("Benchmark duration (s):", metrics["duration"], ".2f")
    row("Total input tokens:", metrics["total_input_tokens"])
    row("Total generated tokens:", metrics["total_output_tokens"])
    row("Request throughput (req/s):", metrics["request_throughput"], ".2f")
    if metrics.get("request_goodput") is not None:
        row("Request goodput (req/s):", metrics["request_goodput"], ".2f")
    row("Output token throughput (tok/s):", metrics["output_throughput"], ".2f")
    row("Peak output token throughput (tok/s):", metrics["max_output_tokens_per_s"], ".2f")
    row("Peak concurrent requests:", metrics["max_concurrent_requests"], ".2f")
    row("Total Token throughput (tok/s):", metrics["total_token_throughput"], ".2f")
    titles = {
        "ttft": ("Time to First Token", "TTFT"),
        "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
        "itl": ("Inter-token Latency", "ITL"),
        "e2el": ("End-to-end Latency", "E2EL"),
    }
    for key, (title, short) in titles.items():
        if key not in percentile_metrics:
            continue
        print("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        row(f"Mean {short} (ms):", metrics[f"mean_{key}_ms"], ".2f")
        row(f"Median {short} (ms):", metrics[f"median_{key}_ms"], ".2f")
        for p in percentiles:
            row(f"P{_percentile_key(p)} {short} (ms):", metrics[f"p{_percentile_key(p)}_{key}_ms"], ".2f")
    print("=" * 50, flush=True)


# ---------------------------------------------------------------------------------------- result + plot


def build_result(
    args: argparse.Namespace,
    model: str,
    tokenizer_id: str | None,
    results: list[RequestResult],
    metrics: dict[str, Any],
    date: str,
) -> dict[str, Any]:
    """The result JSON, with vLLM's keys (setup, then metrics and per-request lists), plus pagedllm's own
    (``base_url``, ``endpoint``, ``dataset_name``, ``e2els``, the random dataset's settings)."""
    backend = _backend(args)
    result: dict[str, Any] = {
        "date": date,
        "endpoint_type": backend,
        "backend": backend,
        "label": args.label,
        "model_id": model,
        "tokenizer_id": tokenizer_id,
        "num_prompts": args.num_prompts,
    }
    for item in args.metadata or []:
        key, _, value = item.partition("=")
        result[key.strip()] = value.strip()
    result.update(
        {
            "request_rate": args.request_rate if not math.isinf(args.request_rate) else "inf",
            "burstiness": args.burstiness,
            "max_concurrency": args.max_concurrency,
            "base_url": args.base_url,
            "endpoint": args.endpoint,
            "dataset_name": args.dataset_name,
            "random_input_len": args.random_input_len,
            "random_output_len": args.random_output_len,
            "random_range_ratio": args.random_range_ratio,
        }
    )
    stats = {k: v for k, v in metrics.items() if k.startswith(("mean_", "median_", "std_", "p"))}
    peaks = {k: metrics[k] for k in ("max_output_tokens_per_s", "max_concurrent_requests")}
    result.update({k: v for k, v in metrics.items() if k not in stats and k not in peaks})
    result.update(
        {
            "input_lens": [r.prompt_len for r in results],
            "output_lens": [r.output_len if r.success else 0 for r in results],
            "ttfts": [r.ttft for r in results],
            "itls": [r.itl for r in results],
            "latencies": [r.latency for r in results],
            "e2els": [r.latency for r in results],
            "start_times": [r.start_time for r in results],
            "generated_texts": [r.generated_text for r in results],
            "errors": [r.error for r in results],
        }
    )
    result.update(peaks)
    result.update(stats)
    return result


def result_path(args: argparse.Namespace, model: str, date: str) -> Path | None:
    """Where ``--save-result`` writes: its FILE, else ``--result-filename``, else vLLM's name
    ``{label}-{rate}qps[-concurrency{n}]-{model}-{date}.json``; inside ``--result-dir`` when given."""
    if args.save_result is None:
        return None
    name = args.save_result or args.result_filename
    if not name:
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
        label = args.label or _backend(args)
        name = f"{label}-{args.request_rate}qps{concurrency}-{model.rstrip('/').split('/')[-1]}-{date}.json"
    path = Path(name)
    if args.result_dir:
        Path(args.result_dir).mkdir(parents=True, exist_ok=True)
        path = Path(args.result_dir) / path
    return path


def plot_data(results: list[RequestResult]) -> dict[str, Any]:
    """What ``--plot`` draws: TTFT and TPOT of each successful request (ms) and ``throughput_timeline``."""
    ok = [r for r in results if r.success]
    return {
        "ttfts_ms": [r.ttft * 1000.0 for r in ok],
        "tpots_ms": [(r.latency - r.ttft) / (r.output_len - 1) * 1000.0 for r in ok if r.output_len > 1],
        **throughput_timeline(results),
    }


def require_matplotlib() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError(
            "--plot needs matplotlib, which is not installed: pip install matplotlib (or pagedllm[plot])"
        ) from e
    return plt


def save_plot(path: str | Path, results: list[RequestResult], title: str = "") -> None:
    """A PNG: TTFT histogram, TPOT histogram, output tokens/s and requests in flight per second."""
    plt = require_matplotlib()
    data = plot_data(results)
    fig, (ax_ttft, ax_tpot, ax_time) = plt.subplots(1, 3, figsize=(15, 4))
    for ax, key, name in ((ax_ttft, "ttfts_ms", "TTFT"), (ax_tpot, "tpots_ms", "TPOT")):
        ax.hist(data[key], bins=30)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("requests")
        ax.set_title(f"{name} distribution")
    ax_time.plot(data["seconds"], data["output_tokens_per_s"], label="output tokens/s")
    ax_time.set_xlabel("time since the first request (s)")
    ax_time.set_ylabel("output tokens/s")
    ax_time.set_title("throughput over time")
    ax_conc = ax_time.twinx()
    ax_conc.plot(data["seconds"], data["concurrent_requests"], color="tab:orange", label="requests in flight")
    ax_conc.set_ylabel("requests in flight")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------ main


def _backend(args: argparse.Namespace) -> str:
    return args.backend or ("openai-chat" if args.endpoint == "/v1/chat/completions" else "openai")


def _is_chat(args: argparse.Namespace) -> bool:
    return args.endpoint == "/v1/chat/completions"


def _resolve_args(args: argparse.Namespace) -> None:
    """Fill the defaults that depend on other flags, as vLLM does; raise ValueError on contradictions."""
    if args.endpoint is None:
        args.endpoint = "/v1/chat/completions" if args.backend == "openai-chat" else "/v1/completions"
    if args.max_concurrency is not None and args.max_concurrency <= 0:
        raise ValueError("--max-concurrency must be greater than 0")
    bad = [item for item in args.metadata or [] if "=" not in item]
    if bad:
        raise ValueError(f"--metadata: {bad[0]!r} is not KEY=VALUE")
    if args.dataset_name in ("random", "prefix_repetition") and args.dataset_path is not None:
        raise ValueError(f"the {args.dataset_name} dataset takes no --dataset-path")
    if args.dataset_name in ("sharegpt", "custom") and args.dataset_path is None:
        raise ValueError(f"the {args.dataset_name} dataset needs --dataset-path")
    if args.input_len is not None:
        args.random_input_len = args.input_len
    if args.output_len is not None:
        args.random_output_len = args.sharegpt_output_len = args.output_len
        args.custom_output_len = args.prefix_repetition_output_len = args.output_len
    if args.dataset_name in ("random", "random-mm"):  # vLLM: random prompts run to their asked length
        args.ignore_eos = True
    if args.dataset_name == "random-mm":
        if not _is_chat(args):
            raise ValueError("--dataset-name random-mm sends images: it needs --backend openai-chat")
        args.random_mm_bucket_config = datasets.parse_bucket_config(args.random_mm_bucket_config)


def sample_requests(args: argparse.Namespace, tokenizer: Any) -> list[SampleRequest]:
    """The requests of ``--dataset-name`` with its flags."""
    chat = _is_chat(args)
    decode = chat or args.prompt_type == "text"
    name = args.dataset_name
    if name == "random":
        return datasets.random_token_prompts(
            tokenizer, args.num_prompts, args.random_input_len, args.random_output_len,
            args.random_range_ratio, args.seed, decode=decode, prefix_len=args.random_prefix_len,
        )  # fmt: skip
    if name == "random-mm":
        return datasets.random_mm_prompts(
            tokenizer, args.num_prompts, args.random_input_len, args.random_output_len, args.random_range_ratio,
            args.seed, base_items_per_request=args.random_mm_base_items_per_request,
            num_mm_items_range_ratio=args.random_mm_num_mm_items_range_ratio,
            limit_mm_per_prompt=args.random_mm_limit_mm_per_prompt, bucket_config=args.random_mm_bucket_config,
            num_unique_images=args.random_mm_num_unique_images,
        )  # fmt: skip
    if name == "prefix_repetition":
        return datasets.prefix_repetition_prompts(
            tokenizer, args.num_prompts, args.prefix_repetition_prefix_len, args.prefix_repetition_suffix_len,
            args.prefix_repetition_num_prefixes, args.prefix_repetition_output_len, args.seed,
            decode=decode, shuffle=not args.disable_shuffle,
        )  # fmt: skip
    if name == "sonnet":
        # vLLM: a chat endpoint gets the raw text (the server applies the template), completions the templated.
        return datasets.sonnet_prompts(
            tokenizer, args.num_prompts, args.sonnet_input_len, args.sonnet_output_len, args.sonnet_prefix_len,
            args.seed, path=args.dataset_path, return_formatted=not chat,
        )  # fmt: skip
    if name == "sharegpt":
        return datasets.sharegpt_prompts(
            tokenizer, args.dataset_path, args.num_prompts, args.sharegpt_output_len, args.seed,
            shuffle=not args.disable_shuffle, oversample=not args.no_oversample,
        )  # fmt: skip
    return datasets.custom_prompts(
        tokenizer, args.dataset_path, args.num_prompts, args.custom_output_len, args.seed,
        apply_chat_template=not (chat or args.skip_chat_template), shuffle=not args.disable_shuffle,
        oversample=not args.no_oversample,
    )  # fmt: skip


def _server_models(base_url: str, headers: dict[str, str]) -> list[dict[str, Any]]:
    import httpx

    response = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30.0)
    response.raise_for_status()
    return list(response.json().get("data", []))


def _load_tokenizer(candidates: list[str | None]) -> tuple[Any, str]:
    from pagedllm.tokenizer import get_tokenizer

    errors = []
    for name in candidates:
        if not name:
            continue
        try:
            return get_tokenizer(name), name
        except ValueError as e:
            errors.append(str(e))
    raise ValueError("no tokenizer could be loaded; pass --tokenizer. Tried: " + " | ".join(errors))


def main(args: argparse.Namespace) -> int:
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get("PAGEDLLM_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        _resolve_args(args)
        percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
        percentile_metrics = parse_percentile_metrics(args.percentile_metrics)
        goodput = parse_goodput(args.goodput)
        if args.plot:
            require_matplotlib()
        models = (
            _server_models(args.base_url, headers) if args.model is None or args.tokenizer is None else []
        )
        model = args.model or (models[0]["id"] if models else None)
        if model is None:
            raise ValueError("the server lists no model; pass --model")
        roots = [m.get("root") for m in models if m.get("id") == model]
        tokenizer, tokenizer_id = _load_tokenizer([args.tokenizer, model, *roots])
        requests = sample_requests(args, tokenizer)
        print(
            f"pagedllm bench serve: {len(requests)} {args.dataset_name} prompts to {args.base_url}{args.endpoint} "
            f"({model}), request rate {args.request_rate}, burstiness {args.burstiness}, "
            f"max concurrency {args.max_concurrency}",
            flush=True,
        )
        results, duration = asyncio.run(run_benchmark(args, model, requests, headers))
    except (ValueError, RuntimeError, OSError) as e:
        print(f"pagedllm bench serve: error: {e}", file=sys.stderr, flush=True)
        return 1
    metrics = calculate_metrics(results, duration, percentiles, goodput, percentile_metrics)
    print_table(metrics, percentiles, args.max_concurrency, args.request_rate, percentile_metrics)
    errors = [r.error for r in results if not r.success]
    if errors:
        print(f"{len(errors)} requests failed; first error: {errors[0]}", flush=True)
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    path = result_path(args, model, date)
    if path is not None:
        result = build_result(args, model, tokenizer_id, results, metrics, date)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
        print(f"pagedllm bench serve: result written to {path}", flush=True)
    if args.plot:
        save_plot(args.plot, results, title=f"{model} @ {args.request_rate} req/s")
        print(f"pagedllm bench serve: plot written to {args.plot}", flush=True)
    return 0
