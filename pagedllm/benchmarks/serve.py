"""`pagedllm bench serve`: load-test any OpenAI-compatible server, with vLLM's `bench serve` metric definitions.

Requests are streamed (``stream: true`` with ``stream_options.include_usage``) and sent on a Poisson schedule
(``--request-rate``; ``inf`` sends all at once), at most ``--max-concurrency`` in flight. Per request:

- TTFT: request sent -> first chunk carrying output;
- ITL: every gap between consecutive output chunks after the first;
- TPOT: (E2EL - TTFT) / (output tokens - 1), requests with more than one output token only;
- E2EL: request sent -> last chunk.

Output tokens come from the usage the server reports (or the number of chunks when it reports none). Throughputs
divide by the wall time of the whole run: requests/s over successful requests, output tokens/s, and total
(prompt + output) tokens/s. Latencies are reported in ms as mean, median, std and the asked percentiles.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import numpy as np

from pagedllm.benchmarks.datasets import SampleRequest, random_token_prompts


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)  # seconds
    latency: float = 0.0  # seconds
    error: str = ""


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (no /v1)")
    parser.add_argument(
        "--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"]
    )
    parser.add_argument(
        "--model", default=None, help="model name to send (default: the server's first model)"
    )
    parser.add_argument(
        "--tokenizer", default=None, help="tokenizer for the prompts (default: the model's path)"
    )
    parser.add_argument("--api-key", default=None, help="default: env OPENAI_API_KEY or PAGEDLLM_API_KEY")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument(
        "--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf: all at once"
    )
    parser.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps; 1 is Poisson"
    )
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--random-input-len", type=int, default=1024)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument("--random-range-ratio", type=float, default=0.0)
    parser.add_argument(
        "--prompt-type",
        default="token_ids",
        choices=["token_ids", "text"],
        help="completions only: send prompts as token ids (exact lengths) or decoded text",
    )
    parser.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (a vLLM extension)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    parser.add_argument("--save-result", default=None, metavar="FILE.json")
    parser.add_argument("--disable-tqdm", action="store_true", help="accepted for vLLM compatibility")
    parser.add_argument("--request-timeout", type=float, default=6 * 3600.0)


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


async def send_request(
    client: Any, url: str, payload: dict[str, Any], headers: dict[str, str], prompt_len: int, chat: bool
) -> RequestResult:
    result = RequestResult(prompt_len=prompt_len)
    start = time.perf_counter()
    last = start
    num_chunks = 0
    usage_tokens = None
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:500]}"
                return result
            async for line in response.aiter_lines():
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
        result.latency = last - start
        result.output_len = usage_tokens if usage_tokens is not None else num_chunks
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
    if chat:
        payload["messages"] = [{"role": "user", "content": request.prompt or ""}]
    elif args.prompt_type == "text":
        payload["prompt"] = request.prompt or ""
    else:
        payload["prompt"] = request.prompt_token_ids
    if args.ignore_eos:
        payload["ignore_eos"] = True
    return payload


async def _arrivals(num: int, rate: float, burstiness: float, seed: int):
    """Yield request indices, sleeping gamma-distributed gaps (mean 1/rate) between them."""
    rng = np.random.default_rng(seed)
    for i in range(num):
        yield i
        if rate == float("inf") or i == num - 1:
            continue
        theta = 1.0 / (rate * burstiness)
        await asyncio.sleep(float(rng.gamma(shape=burstiness, scale=theta)))


async def run_benchmark(
    args: argparse.Namespace, model: str, requests: list[SampleRequest], headers: dict[str, str]
) -> tuple[list[RequestResult], float]:
    import httpx

    chat = args.endpoint == "/v1/chat/completions"
    url = args.base_url.rstrip("/") + args.endpoint
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    limits = httpx.Limits(max_connections=args.max_concurrency or None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def one(request: SampleRequest) -> RequestResult:
            payload = build_payload(args, model, request, chat)
            if limit is None:
                return await send_request(client, url, payload, headers, request.prompt_len, chat)
            async with limit:
                return await send_request(client, url, payload, headers, request.prompt_len, chat)

        # One request first, so a misconfigured run fails fast with the server's message.
        probe = await one(
            SampleRequest(requests[0].prompt_token_ids, requests[0].prompt_len, 2, requests[0].prompt)
        )
        if not probe.success:
            raise RuntimeError(f"the first test request failed: {probe.error}")
        start = time.perf_counter()
        tasks = []
        async for i in _arrivals(len(requests), args.request_rate, args.burstiness, args.seed):
            tasks.append(asyncio.create_task(one(requests[i])))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return list(results), duration


# -------------------------------------------------------------------------------------------- metrics


def calculate_metrics(
    results: list[RequestResult], duration: float, percentiles: list[float]
) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_len for r in ok)
    ttfts = [r.ttft for r in ok]
    tpots = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    itls = [gap for r in ok for gap in r.itl]
    e2els = [r.latency for r in ok]
    metrics: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": total_output / duration if duration > 0 else 0.0,
        "total_token_throughput": (total_input + total_output) / duration if duration > 0 else 0.0,
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        arr = np.asarray(values or [0.0], dtype=np.float64) * 1000.0
        metrics[f"mean_{name}_ms"] = float(arr.mean())
        metrics[f"median_{name}_ms"] = float(np.median(arr))
        metrics[f"std_{name}_ms"] = float(arr.std())
        for p in percentiles:
            metrics[f"p{p:g}_{name}_ms"] = float(np.percentile(arr, p))
    return metrics


def print_table(
    metrics: dict[str, Any], percentiles: list[float], max_concurrency: int | None, rate: float
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
    row("Output token throughput (tok/s):", metrics["output_throughput"], ".2f")
    row("Total Token throughput (tok/s):", metrics["total_token_throughput"], ".2f")
    titles = {
        "ttft": ("Time to First Token", "TTFT"),
        "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
        "itl": ("Inter-token Latency", "ITL"),
        "e2el": ("End-to-end Latency", "E2EL"),
    }
    for key, (title, short) in titles.items():
        print("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        row(f"Mean {short} (ms):", metrics[f"mean_{key}_ms"], ".2f")
        row(f"Median {short} (ms):", metrics[f"median_{key}_ms"], ".2f")
        for p in percentiles:
            row(f"P{p:g} {short} (ms):", metrics[f"p{p:g}_{key}_ms"], ".2f")
    print("=" * 50, flush=True)


# ------------------------------------------------------------------------------------------------ main


def _server_models(base_url: str, headers: dict[str, str]) -> list[dict[str, Any]]:
    import httpx

    response = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30.0)
    response.raise_for_status()
    return list(response.json().get("data", []))


def _load_tokenizer(candidates: list[str | None]) -> Any:
    from pagedllm.tokenizer import get_tokenizer

    errors = []
    for name in candidates:
        if not name:
            continue
        try:
            return get_tokenizer(name)
        except ValueError as e:
            errors.append(str(e))
    raise ValueError("no tokenizer could be loaded; pass --tokenizer. Tried: " + " | ".join(errors))


def main(args: argparse.Namespace) -> int:
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get("PAGEDLLM_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    try:
        models = (
            _server_models(args.base_url, headers) if args.model is None or args.tokenizer is None else []
        )
        model = args.model or (models[0]["id"] if models else None)
        if model is None:
            raise ValueError("the server lists no model; pass --model")
        roots = [m.get("root") for m in models if m.get("id") == model]
        tokenizer = _load_tokenizer([args.tokenizer, model, *roots])
        chat = args.endpoint == "/v1/chat/completions"
        requests = random_token_prompts(
            tokenizer,
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.seed,
            decode=chat or args.prompt_type == "text",
        )
        print(
            f"pagedllm bench serve: {args.num_prompts} prompts to {args.base_url}{args.endpoint} ({model}), "
            f"request rate {args.request_rate}, max concurrency {args.max_concurrency}",
            flush=True,
        )
        results, duration = asyncio.run(run_benchmark(args, model, requests, headers))
    except (ValueError, RuntimeError, OSError) as e:
        print(f"pagedllm bench serve: error: {e}", file=sys.stderr, flush=True)
        return 1
    metrics = calculate_metrics(results, duration, percentiles)
    print_table(metrics, percentiles, args.max_concurrency, args.request_rate)
    errors = [r.error for r in results if not r.success]
    if errors:
        print(f"{len(errors)} requests failed; first error: {errors[0]}", flush=True)
    if args.save_result:
        result = {
            "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
            "backend": "openai",
            "base_url": args.base_url,
            "endpoint": args.endpoint,
            "model_id": model,
            "num_prompts": args.num_prompts,
            "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
            "burstiness": args.burstiness,
            "max_concurrency": args.max_concurrency,
            "random_input_len": args.random_input_len,
            "random_output_len": args.random_output_len,
            "random_range_ratio": args.random_range_ratio,
            **metrics,
            "input_lens": [r.prompt_len for r in results],
            "output_lens": [r.output_len for r in results],
            "ttfts": [r.ttft for r in results],
            "itls": [r.itl for r in results],
            "e2els": [r.latency for r in results],
            "errors": [r.error for r in results],
        }
        with open(args.save_result, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
        print(f"pagedllm bench serve: result written to {args.save_result}", flush=True)
    return 0
