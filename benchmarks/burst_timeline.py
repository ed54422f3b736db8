"""Where the time to first token goes: summarise a server's request timeline file.

Start the server with ``PAGEDLLM_REQUEST_TIMELINE=PATH`` (it appends one JSON line per finished request, see
``RequestTimelineLog`` in pagedllm/entrypoints/openai/serving_engine.py), run a load (e.g. a burst:
``pagedllm bench serve --request-rate inf``), then::

    python benchmarks/burst_timeline.py PATH [--json]

prints p50 / p90 / p99 of each phase in milliseconds and the share of the time to first token each phase takes
(the phase's mean over the mean TTFT). The first six phases follow one another from the HTTP handler's entry to
the first chunk written, so their shares add up to 100%:

    tokenize    arrival -> prompt ids ready (body read, parsing, chat template, tokenizer)
    prepare     prompt ids ready -> sent to the engine core (validation, sampling params, output bookkeeping)
    transport   sent -> added to the core's scheduler (socket, pickling, the core finishing its current step)
    queue       added -> first scheduled (waiting for a batch slot or KV blocks)
    prefill     first scheduled -> first token left the core (chunked prefill steps, other requests' steps)
    delivery    first token left the core -> first chunk written (front-end output loop, detokenize, SSE)

``ttft`` (arrival -> first chunk written) and ``decode`` (first -> last token) are listed too. Stamps share the
host's monotonic clock, so the core's stamps and the server's compare directly.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

# (phase, start stamp, end stamp); the first six partition the time to first token.
PHASES = (
    ("tokenize", "arrival", "tokenized"),
    ("prepare", "tokenized", "sent"),
    ("transport", "sent", "queued"),
    ("queue", "queued", "scheduled"),
    ("prefill", "scheduled", "first_token"),
    ("delivery", "first_token", "first_token_out"),
)
TTFT = ("ttft", "arrival", "first_token_out")
DECODE = ("decode", "first_token", "last_token")
PERCENTILES = (50, 90, 99)


def load(path: str | Path) -> list[dict[str, Any]]:
    """The records of a timeline file (blank lines skipped)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def durations(record: dict[str, Any]) -> dict[str, float]:
    """Each phase's length in ms for one record; phases with a missing end are left out."""
    stamps = record["stamps_ms"]
    out = {}
    for name, start, end in (*PHASES, TTFT, DECODE):
        if stamps.get(start) is not None and stamps.get(end) is not None:
            out[name] = stamps[end] - stamps[start]
    return out


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile with linear interpolation between ranks (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarise(records: list[dict[str, Any]]) -> dict[str, Any]:
    """``{"num_requests", "arrival_spread_ms", "phases": {name: {"p50", "p90", "p99", "mean", "share"}}}``;
    ``share`` (of TTFT, for the six TTFT phases) is the phase's mean over the mean TTFT, over the requests that
    have every TTFT stamp."""
    complete = [d for d in map(durations, records) if all(name in d for name, _, _ in (*PHASES, TTFT))]
    mean_ttft = sum(d["ttft"] for d in complete) / len(complete) if complete else math.nan
    phases: dict[str, dict[str, float]] = {}
    all_durations = [durations(r) for r in records]
    for name, _, _ in (*PHASES, TTFT, DECODE):
        values = [d[name] for d in all_durations if name in d]
        row = {f"p{q}": percentile(values, q) for q in PERCENTILES}
        row["mean"] = sum(values) / len(values) if values else math.nan
        if any(name == p for p, _, _ in PHASES) and complete and mean_ttft > 0:
            row["share"] = sum(d[name] for d in complete) / len(complete) / mean_ttft
        phases[name] = row
    arrivals = [r["arrival_time"] for r in records if "arrival_time" in r]
    spread = 1000.0 * (max(arrivals) - min(arrivals)) if arrivals else math.nan
    return {"num_requests": len(records), "arrival_spread_ms": spread, "phases": phases}


def format_table(summary: dict[str, Any]) -> str:
    lines = [
        f"{summary['num_requests']} requests, arrivals spread over {summary['arrival_spread_ms']:.1f} ms",
        f"{'phase':<10}" + "".join(f"{'p' + str(q) + ' ms':>12}" for q in PERCENTILES) + f"{'mean ms':>12}"
        + f"{'of TTFT':>10}",
    ]  # fmt: skip
    for name, row in summary["phases"].items():
        share = f"{100.0 * row['share']:9.1f}%" if "share" in row else f"{'':>10}"
        lines.append(
            f"{name:<10}"
            + "".join(f"{row[f'p{q}']:12.1f}" for q in PERCENTILES)
            + f"{row['mean']:12.1f}"
            + share
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="a PAGEDLLM_REQUEST_TIMELINE file")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = parser.parse_args(argv)
    summary = summarise(load(args.path))
    print(json.dumps(summary, indent=2) if args.json else format_table(summary))


if __name__ == "__main__":
    main()
