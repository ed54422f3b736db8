"""Prometheus metrics with vLLM's meanings under the ``pagedllm:`` prefix.

Gauges mirror the scheduler's last stats (running / waiting requests, KV cache usage). Counters that the core keeps
cumulatively (prefix-cache queries and hits, preemptions) advance by the difference from the last stats seen.
Token counters, finished-request counts and the latency histograms come from the front-end's per-step
``IterationStats`` (one entry per sequence, so a request with n=2 counts twice, as in vLLM).

Request phases, observed once per finished sequence whose two ends are known (vLLM's definitions for the first
four): queue time (reached the engine core -> first scheduled), prefill time (first scheduled -> first token),
decode time (first token -> last token), inference time (first scheduled -> last token), and the front-end's
tokenize time (arrival, the HTTP handler's entry on a server -> prompt ids ready) and frontend-to-core time (prompt
ids ready -> reached the engine core). Token times are when their outputs left the core.

Each server owns a ``CollectorRegistry``, so several servers (or tests) in one process do not collide.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pagedllm.core.sched_output import SchedulerStats

CONTENT_TYPE = CONTENT_TYPE_LATEST

# No `*_created` series next to every counter and histogram (as in vLLM); this is process-wide.
disable_created_metrics()

# vLLM's buckets.
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0]  # fmt: skip
_REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0]  # fmt: skip

FINISH_REASONS = ("stop", "length", "abort")


class PrometheusStatLogger:
    """Turns engine stats into Prometheus metrics; pass ``record`` to ``AsyncLLM(stat_loggers=[...])``."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Any:
            return Gauge(f"pagedllm:{name}", doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Any:
            return Counter(f"pagedllm:{name}", doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: list[float]) -> Any:
            return Histogram(f"pagedllm:{name}", doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "KV cache usage: 1 means every block is in use.")
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.external_prefix_cache_queries = counter(
            "external_prefix_cache_queries",
            "Prompt tokens looked up in a KV connector's store (the CPU offloading tier) past the device hit.",
        )
        self.external_prefix_cache_hits = counter(
            "external_prefix_cache_hits", "Prompt tokens loaded from a KV connector's store instead of recomputed."
        )
        self.encoder_cache_queries = counter(
            "encoder_cache_queries", "Images whose embeddings a request needed (once per request and image)."
        )
        self.encoder_cache_hits = counter(
            "encoder_cache_hits", "Images whose embeddings were already in the encoder cache (not encoded again)."
        )
        self.mm_cache_queries = counter(
            "mm_cache_queries", "Chat images (data URLs) looked up in the front-end's processor cache."
        )
        self.mm_cache_hits = counter(
            "mm_cache_hits", "Chat images found preprocessed in the processor cache (the image processor skipped)."
        )
        self.num_preemptions = counter("num_preemptions", "Requests preempted (their KV cache freed) so far.")
        self.integrity_check_failures = counter(
            "integrity_check_failures", "Failed idle-time KV cache integrity checks (nonzero means a bug)."
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed (once per sequence).")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self._request_success = Counter(
            "pagedllm:request_success",
            "Finished sequences, by finish reason.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.request_success = {
            reason: self._request_success.labels(model_name, reason) for reason in FINISH_REASONS
        }
        self.ttft = histogram("time_to_first_token_seconds", "Time to the first token.", _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive outputs.", _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", _REQUEST_BUCKETS)
        self.queue_time = histogram(
            "request_queue_time_seconds", "Reached the engine core to first scheduled.", _REQUEST_BUCKETS
        )
        self.prefill_time = histogram(
            "request_prefill_time_seconds", "First scheduled to the first token.", _REQUEST_BUCKETS
        )
        self.decode_time = histogram(
            "request_decode_time_seconds", "First token to the last token.", _REQUEST_BUCKETS
        )
        self.inference_time = histogram(
            "request_inference_time_seconds", "First scheduled to the last token.", _REQUEST_BUCKETS
        )
        self.tokenize_time = histogram(
            "request_tokenize_time_seconds", "Arrival to the prompt's token ids being ready.", _TTFT_BUCKETS
        )
        self.frontend_to_core_time = histogram(
            "request_frontend_to_core_seconds",
            "Prompt token ids ready to the request reaching the engine core.",
            _TTFT_BUCKETS,
        )
        self._phases = [
            ("queue_time", self.queue_time),
            ("prefill_time", self.prefill_time),
            ("decode_time", self.decode_time),
            ("inference_time", self.inference_time),
            ("tokenize_time", self.tokenize_time),
            ("frontend_to_core_time", self.frontend_to_core_time),
        ]
        self.spec_num_drafts = counter(
            "spec_decode_num_drafts", "Verification steps with drafts, per request."
        )
        self.spec_num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self._spec_per_pos = Counter(
            "pagedllm:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft (0 = first).",
            ["model_name", "position"],
            registry=r,
        )
        self._last_cumulative: dict[str, int] = {}
        self.model_name = model_name

    def _advance(self, metric: Any, key: str, total: int) -> None:
        last = self._last_cumulative.get(key, 0)
        if total >= last:
            metric.inc(total - last)
        # A smaller total means the core started over; count from there.
        self._last_cumulative[key] = total

    def record_scheduler_stats(self, stats: SchedulerStats) -> None:
        self.num_requests_running.set(stats.num_running_reqs)
        self.num_requests_waiting.set(stats.num_waiting_reqs)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self._advance(self.prefix_cache_queries, "prefix_cache_queries", stats.prefix_cache_queries)
        self._advance(self.prefix_cache_hits, "prefix_cache_hits", stats.prefix_cache_hits)
        self._advance(
            self.external_prefix_cache_queries, "external_prefix_cache_queries", stats.external_prefix_cache_queries
        )
        self._advance(
            self.external_prefix_cache_hits, "external_prefix_cache_hits", stats.external_prefix_cache_hits
        )
        self._advance(self.encoder_cache_queries, "encoder_cache_queries", stats.encoder_cache_queries)
        self._advance(self.encoder_cache_hits, "encoder_cache_hits", stats.encoder_cache_hits)
        self._advance(self.num_preemptions, "num_preemptions", stats.num_preemptions)
        self._advance(self.integrity_check_failures, "num_integrity_failures", stats.num_integrity_failures)
        if stats.spec_num_drafts or "spec_num_drafts" in self._last_cumulative:
            self._advance(self.spec_num_drafts, "spec_num_drafts", stats.spec_num_drafts)
            self._advance(self.spec_num_draft_tokens, "spec_num_draft_tokens", stats.spec_num_draft_tokens)
            self._advance(
                self.spec_num_accepted_tokens, "spec_num_accepted_tokens", stats.spec_num_accepted_tokens
            )
            for pos, total in enumerate(stats.spec_accepted_per_pos):
                metric = self._spec_per_pos.labels(self.model_name, str(pos))
                self._advance(metric, f"spec_accepted_pos_{pos}", total)

    def record_mm_cache(self, queries: int, hits: int) -> None:
        """The front-end's processor cache counters (cumulative; ``InputProcessor.processor_cache``)."""
        self._advance(self.mm_cache_queries, "mm_cache_queries", queries)
        self._advance(self.mm_cache_hits, "mm_cache_hits", hits)

    def record_iteration_stats(self, stats: Any) -> None:
        if stats.num_prompt_tokens:
            self.prompt_tokens.inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            self.generation_tokens.inc(stats.num_generation_tokens)
        for value in stats.time_to_first_tokens:
            self.ttft.observe(value)
        for value in stats.inter_token_latencies:
            self.itl.observe(value)
        for finished in stats.finished_requests:
            counter = self.request_success.get(finished.finish_reason)
            if counter is None:
                counter = self._request_success.labels(self.model_name, finished.finish_reason)
                self.request_success[finished.finish_reason] = counter
            counter.inc()
            self.e2e.observe(finished.e2e_latency)
            for name, histogram in self._phases:
                value = getattr(finished, name, None)
                if value is not None:
                    histogram.observe(value)

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: Any | None) -> None:
        """The ``AsyncLLM`` stat-logger hook."""
        if scheduler_stats is not None:
            self.record_scheduler_stats(scheduler_stats)
        if iteration_stats is not None:
            self.record_iteration_stats(iteration_stats)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def spec_decode_summary(stats: SchedulerStats, since: SchedulerStats | None = None) -> str | None:
    """vLLM's speculative-decoding log line over the drafts between ``since`` and ``stats`` (None: no drafts).

    Mean acceptance length is 1 + accepted drafts per verification (the tokens each verification emits)."""
    drafts = stats.spec_num_drafts - (since.spec_num_drafts if since else 0)
    if drafts <= 0:
        return None
    draft_tokens = stats.spec_num_draft_tokens - (since.spec_num_draft_tokens if since else 0)
    accepted = stats.spec_num_accepted_tokens - (since.spec_num_accepted_tokens if since else 0)
    before = since.spec_accepted_per_pos if since else []
    per_pos = [
        (n - (before[i] if i < len(before) else 0)) / drafts
        for i, n in enumerate(stats.spec_accepted_per_pos)
    ]
    return (
        f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, "
        f"Accepted: {accepted} tokens, Drafted: {draft_tokens} tokens, "
        f"Per-position acceptance rate: {', '.join(f'{r:.3f}' for r in per_pos)}, "
        f"Avg Draft acceptance rate: {100 * accepted / max(draft_tokens, 1):.1f}%"
    )


class LoggingStatLogger:
    """Logs a summary line every ``interval`` seconds while there is work (the engine's stats log)."""

    def __init__(self, interval: float = 10.0) -> None:
        import logging
        import time

        self._logger = logging.getLogger("pagedllm.stats")
        self._clock = time.monotonic
        self.interval = interval
        self._last_time = self._clock()
        self._last: SchedulerStats | None = None

    def __call__(self, scheduler_stats: SchedulerStats | None, iteration_stats: Any | None) -> None:
        if scheduler_stats is None:
            return
        now = self._clock()
        if now - self._last_time < self.interval:
            return
        last = self._last
        s = scheduler_stats
        gen = s.num_generation_tokens - (last.num_generation_tokens if last else 0)
        prompt = s.num_prompt_tokens - (last.num_prompt_tokens if last else 0)
        if gen or prompt or s.num_running_reqs or s.num_waiting_reqs:
            dt = now - self._last_time
            self._logger.info(
                "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, Running: %d reqs, "
                "Waiting: %d reqs, GPU KV cache usage: %.1f%%",
                prompt / dt,
                gen / dt,
                s.num_running_reqs,
                s.num_waiting_reqs,
                100 * s.kv_cache_usage,
            )
            line = spec_decode_summary(s, last)
            if line is not None:
                self._logger.info("%s", line)
        self._last_time = now
        self._last = s
