"""From the engine core's per-step token ids to what users receive.

For every sequence (one per core request; a request with ``n > 1`` has ``n``) the ``OutputProcessor`` keeps
an ``IncrementalDetokenizer``, the token ids, logprobs in the user-facing ``{token_id: Logprob}`` shape, and
what was already sent. Each ``process_outputs`` call:

1. appends new tokens / logprob rows / prompt-logprob rows, detokenizes, and searches for stop strings (the
   core does not know them: a sequence that hits one is finished here and its id is returned in
   ``reqs_to_abort`` so the caller aborts it in the core);
2. builds at most one ``RequestOutput`` per request, honoring ``params.output_kind``:
   CUMULATIVE: every sequence, everything so far; DELTA: only the sequences that changed this step, only
   what is new; FINAL_ONLY: every sequence, once, when the last one finishes;
3. hands it to the request's queue (``put_nowait``) when ``add_request`` got one, else returns it;
4. records timings in ``IterationStats`` for a metrics layer, and each request's ``RequestTimeline``.

Times are ``time.monotonic()`` seconds. That clock (CLOCK_MONOTONIC) is system-wide, so stamps taken in the engine
core process on the same host (when a request was added to the scheduler, first scheduled, when an outputs
message left the core) compare directly with the front-end's. No threads or event loops are assumed; the caller
serializes calls.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from pagedllm.core.sched_output import EngineCoreOutput, LogprobsLists
from pagedllm.engine.detokenizer import IncrementalDetokenizer, check_stop_strings
from pagedllm.engine.input_processor import ProcessedRequest
from pagedllm.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestMetrics, RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.tokenizer import AnyTokenizer, TokenTextCache


class OutputQueue(Protocol):
    """Anything with ``put_nowait`` (``asyncio.Queue``, ``queue.Queue``, a collector of the async front-end)."""

    def put_nowait(self, item: RequestOutput) -> None: ...


@dataclass
class FinishedRequestStats:
    """One sequence (core request) that finished this step. Latencies in seconds."""

    request_id: str  # the core request id (the child's id when n > 1)
    finish_reason: str  # "stop" | "length" | "abort"
    num_prompt_tokens: int
    num_generation_tokens: int
    e2e_latency: float  # finish time - arrival time
    ttft: float | None  # first token time - arrival time; None when it finished without a token
    # Phases (vLLM's definitions; None where an end is unknown, e.g. never scheduled or no token):
    queue_time: float | None = None  # reached the core -> first scheduled
    prefill_time: float | None = None  # first scheduled -> first token left the core
    decode_time: float | None = None  # first token -> last token (both as they left the core)
    inference_time: float | None = None  # first scheduled -> last token left the core
    # Front-end phases of the parent request:
    tokenize_time: float | None = None  # arrival (server: HTTP handler entry) -> prompt ids ready
    frontend_to_core_time: float | None = None  # prompt ids ready -> reached the core


@dataclass
class RequestTimeline:
    """When one request reached each point of its life, ``time.monotonic()`` seconds (None: not reached/known).

    In order: ``arrival_time`` (the server's HTTP handler entry, else when ``AsyncLLM`` got it), ``tokenized_time``
    (prompt ids ready), ``sent_time`` (handed to the engine core client), ``queued_time`` (added to the core's
    scheduler), ``scheduled_time`` (first scheduled), ``first_token_time`` (the outputs message with its first
    token left the core), ``first_token_out_time`` (the server wrote the first chunk carrying output; not
    streaming: the response was ready), ``last_token_time`` (the message with its last token left the core),
    ``finished_time`` (the front-end saw it finish). With n > 1 the core stamps are the earliest over its
    sequences (the last token: the latest). The front-end and the server fill their stamps; the
    ``OutputProcessor`` fills the core's.
    """

    arrival_time: float
    tokenized_time: float | None = None
    sent_time: float | None = None
    queued_time: float | None = None
    scheduled_time: float | None = None
    first_token_time: float | None = None
    first_token_out_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    def set_earliest(self, name: str, value: float) -> None:
        old = getattr(self, name)
        if old is None or value < old:
            setattr(self, name, value)


@dataclass
class IterationStats:
    """What one ``process_outputs`` call saw, for Prometheus-style metrics; counted per sequence.

    Feed ``time_to_first_tokens`` / ``inter_token_latencies`` / each finished ``e2e_latency`` to histograms and
    the token counts to counters; nothing here needs recomputing from ``RequestOutput``s.
    """

    num_generation_tokens: int = 0  # tokens generated this step, over all sequences
    num_prompt_tokens: int = 0  # prompt tokens of the sequences that got their first token this step
    time_to_first_tokens: list[float] = field(default_factory=list)  # one per sequence with its first token
    inter_token_latencies: list[float] = field(default_factory=list)  # one per sequence with later tokens
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]  # only for requests added without a queue
    reqs_to_abort: list[str]  # core request ids finished here by a stop string: abort them in the core
    stats: IterationStats


def _span(start: float | None, end: float | None) -> float | None:
    """``end - start`` (at least 0: stamps from two processes may tie), None if either is unknown."""
    if start is None or end is None:
        return None
    return max(0.0, end - start)


class _SequenceState:
    """One sampled sequence: what it generated and how much of that was already sent (DELTA)."""

    def __init__(
        self, index: int, request_id: str, params: SamplingParams, prompt_token_ids: list[int], tokenizer: Any
    ) -> None:
        self.index = index
        self.request_id = request_id  # core request id
        self.params = params
        self.detokenizer = (
            IncrementalDetokenizer(
                tokenizer, prompt_token_ids, params.skip_special_tokens, params.spaces_between_special_tokens
            )
            if params.detokenize
            else None
        )
        self.token_ids: list[int] = []
        want_logprobs = params.logprobs is not None
        self.logprobs: list[dict[int, Logprob]] | None = [] if want_logprobs else None
        self.cumulative_logprob: float | None = 0.0 if want_logprobs else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_prompt_logprob_rows = 0  # prompt-logprob rows this sequence's core request reported
        self.first_token_time: float | None = None  # front-end clock, when it was processed (TTFT)
        self.last_token_time: float | None = None
        # Core stamps (vLLM's queued_ts / scheduled_ts / first_token_ts / last_token_ts):
        self.queued_time: float | None = None
        self.scheduled_time: float | None = None
        self.first_token_core_time: float | None = None
        self.last_token_core_time: float | None = None
        self.num_sent_tokens = 0
        self.num_sent_chars = 0
        # Hold back the last len(longest stop string) - 1 characters while running: they might begin a stop
        # string that the next token completes, and text once sent cannot be taken back.
        stop = params.stop or []
        self.stop_buffer = max(map(len, stop)) - 1 if stop and not params.include_stop_str_in_output else 0

    @property
    def text(self) -> str:
        return self.detokenizer.output_text if self.detokenizer is not None else ""

    def visible_text_len(self) -> int:
        text_len = len(self.text)
        return text_len if self.finish_reason is not None else max(0, text_len - self.stop_buffer)


class _RequestState:
    """One user request (the parent of its sequences)."""

    def __init__(
        self,
        processed: ProcessedRequest,
        queue: OutputQueue | None,
        tokenizer: Any,
        timeline: RequestTimeline | None,
    ) -> None:
        self.request_id = processed.request_id
        self.prompt = processed.prompt
        self.prompt_token_ids = processed.prompt_token_ids
        self.params = processed.params
        self.queue = queue
        self.seqs = [
            _SequenceState(i, core.request_id, core.sampling_params, processed.prompt_token_ids, tokenizer)
            for i, core in enumerate(processed.core_requests)
        ]
        self.num_unfinished = len(self.seqs)
        # Position 0 has no logprob (nothing precedes it); rows for 1.. arrive as prefill chunks are computed.
        self.prompt_logprobs: PromptLogprobs | None = (
            [None] if self.params.prompt_logprobs is not None else None
        )
        self.num_sent_prompt_logprobs = 0
        self.num_cached_tokens = 0
        self.kv_transfer_params: dict | None = None  # a KV connector's handle (disaggregated prefill)
        self.metrics = RequestMetrics(arrival_time=processed.arrival_time)
        self.timeline = timeline if timeline is not None else RequestTimeline(processed.arrival_time)


class OutputProcessor:
    """Detokenizes, applies stop strings and builds ``RequestOutput``s for every request in flight."""

    def __init__(self, tokenizer: AnyTokenizer) -> None:
        self.tokenizer = tokenizer
        self._token_text = TokenTextCache(tokenizer)
        self._requests: dict[str, _RequestState] = {}  # parent request id -> state
        self._seqs: dict[str, tuple[_RequestState, _SequenceState]] = {}  # core request id -> (parent, seq)

    # ------------------------------------------------------------------ bookkeeping

    def add_request(
        self,
        processed: ProcessedRequest,
        queue: OutputQueue | None = None,
        timeline: RequestTimeline | None = None,
    ) -> None:
        """Start tracking ``processed``; its outputs go to ``queue.put_nowait`` when a queue is given. The core's
        stamps go into ``timeline`` (default: a new one arriving at ``processed.arrival_time``)."""
        if processed.request_id in self._requests:
            raise ValueError(f"request_id {processed.request_id!r} is already in flight")
        taken = [c.request_id for c in processed.core_requests if c.request_id in self._seqs]
        if taken:
            raise ValueError(
                f"request_id {processed.request_id!r}: core request ids {taken} are already in flight"
            )
        req = _RequestState(processed, queue, self.tokenizer, timeline)
        self._requests[req.request_id] = req
        for seq in req.seqs:
            self._seqs[seq.request_id] = (req, seq)

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget requests (parent ids) or single sequences (core ids); return the core request ids that are
        still running and must be aborted in the core. Unknown ids are ignored; no output is emitted for what
        is dropped. An aborted sequence of a request whose other sequences still run is reported with
        finish_reason "abort" when they finish."""
        to_abort: list[str] = []
        for request_id in request_ids:
            req = self._requests.get(request_id)
            if req is not None:
                to_abort.extend(s.request_id for s in req.seqs if s.finish_reason is None)
                self._drop(req)
                continue
            entry = self._seqs.get(request_id)
            if entry is None:
                continue
            req, seq = entry
            if seq.finish_reason is None:
                seq.finish_reason = "abort"
                req.num_unfinished -= 1
                to_abort.append(seq.request_id)
            if req.num_unfinished == 0:
                self._drop(req)
        return to_abort

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    def _drop(self, req: _RequestState) -> None:
        self._requests.pop(req.request_id, None)
        for seq in req.seqs:
            self._seqs.pop(seq.request_id, None)

    # ------------------------------------------------------------------ the per-step work

    def record_queued_times(self, queued_times: dict[str, float]) -> None:
        """The core added these core requests to its scheduler at these times; unknown ids are ignored."""
        for core_id, queued_time in queued_times.items():
            entry = self._seqs.get(core_id)
            if entry is not None:
                req, seq = entry
                seq.queued_time = queued_time
                req.timeline.set_earliest("queued_time", queued_time)

    def process_outputs(
        self, outputs: list[EngineCoreOutput], engine_core_timestamp: float | None = None
    ) -> ProcessedOutputs:
        """Apply one engine step's outputs; see the module docstring. Outputs for unknown (aborted) or already
        finished sequences are ignored. ``engine_core_timestamp``: when the message left the core (default: now);
        the first and last token stamps of the timelines are taken from it."""
        now = time.monotonic()
        core_now = now if engine_core_timestamp is None else engine_core_timestamp
        stats = IterationStats()
        reqs_to_abort: list[str] = []
        updated: dict[str, tuple[_RequestState, list[_SequenceState]]] = {}
        for out in outputs:
            entry = self._seqs.get(out.request_id)
            if entry is None:
                continue
            req, seq = entry
            if seq.finish_reason is not None:
                continue
            if out.num_cached_tokens > req.num_cached_tokens:
                req.num_cached_tokens = out.num_cached_tokens
            if out.kv_transfer_params is not None:
                req.kv_transfer_params = out.kv_transfer_params
            if out.queue_time is not None and seq.scheduled_time is None:
                # The core measures arrival -> first scheduled on the one clock both processes share.
                seq.scheduled_time = req.metrics.arrival_time + out.queue_time
                req.timeline.set_earliest("scheduled_time", seq.scheduled_time)
            if out.new_prompt_logprobs is not None:
                self._add_prompt_logprobs(req, seq, out.new_prompt_logprobs)
            if out.new_token_ids:
                self._add_tokens(req, seq, out, now, core_now, stats)
            finish_reason, stop_reason = out.finish_reason, out.stop_reason
            if seq.detokenizer is not None:
                hit = self._detokenize(seq, out)
                if hit is not None:
                    if finish_reason is None:
                        reqs_to_abort.append(seq.request_id)
                    finish_reason, stop_reason = "stop", hit
            if finish_reason is None and not out.new_token_ids:
                continue  # a prefill chunk: nothing to report yet
            if finish_reason is not None:
                self._finish_seq(req, seq, finish_reason, stop_reason, now, stats)
            updated.setdefault(req.request_id, (req, []))[1].append(seq)

        request_outputs: list[RequestOutput] = []
        for req, seqs in updated.values():
            finished = req.num_unfinished == 0
            if finished:
                req.metrics.finished_time = now
                req.timeline.finished_time = now
                self._drop(req)
            request_output = self._make_request_output(req, seqs, finished)
            if request_output is None:
                continue
            if req.queue is not None:
                req.queue.put_nowait(request_output)
            else:
                request_outputs.append(request_output)
        return ProcessedOutputs(request_outputs=request_outputs, reqs_to_abort=reqs_to_abort, stats=stats)

    def _add_tokens(
        self,
        req: _RequestState,
        seq: _SequenceState,
        out: EngineCoreOutput,
        now: float,
        core_now: float,
        stats: IterationStats,
    ) -> None:
        new_token_ids = out.new_token_ids
        timeline = req.timeline
        if seq.first_token_time is None:
            seq.first_token_time = now
            seq.first_token_core_time = core_now
            timeline.set_earliest("first_token_time", core_now)
            stats.time_to_first_tokens.append(now - req.metrics.arrival_time)
            stats.num_prompt_tokens += len(req.prompt_token_ids)
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
        else:
            stats.inter_token_latencies.append(now - seq.last_token_time)
        seq.last_token_time = now
        seq.last_token_core_time = core_now
        req.metrics.last_token_time = now
        if timeline.last_token_time is None or core_now > timeline.last_token_time:
            timeline.last_token_time = core_now
        stats.num_generation_tokens += len(new_token_ids)
        seq.token_ids.extend(new_token_ids)
        if seq.logprobs is not None and out.new_logprobs is not None:
            rows = out.new_logprobs
            num_top = seq.params.logprobs or 0
            for i in range(len(rows.token_ids)):
                seq.logprobs.append(self._logprob_row(rows, i, num_top))
                seq.cumulative_logprob += rows.logprobs[i][0]

    def _detokenize(self, seq: _SequenceState, out: EngineCoreOutput) -> str | None:
        """Decode the new tokens; return the stop string that ended the sequence, if one did."""
        detokenizer = seq.detokenizer
        params = seq.params
        new_token_ids = out.new_token_ids
        if (
            out.finish_reason == "stop"
            and not isinstance(out.stop_reason, str)
            and new_token_ids
            and not params.include_stop_str_in_output
        ):
            new_token_ids = new_token_ids[:-1]  # the eos / stop token is not part of the text
        num_chars_before = len(detokenizer.output_text)
        detokenizer.add_tokens(new_token_ids)
        if out.finish_reason is not None:
            detokenizer.flush()
        if not params.stop or len(seq.token_ids) <= params.min_tokens:
            return None
        num_new_chars = len(detokenizer.output_text) - num_chars_before
        hit = check_stop_strings(
            detokenizer.output_text, num_new_chars, params.stop, params.include_stop_str_in_output
        )
        if hit is None:
            return None
        stop_str, truncate_to = hit
        detokenizer.truncate(truncate_to)
        return stop_str

    def _finish_seq(
        self,
        req: _RequestState,
        seq: _SequenceState,
        finish_reason: str,
        stop_reason: int | str | None,
        now: float,
        stats: IterationStats,
    ) -> None:
        seq.finish_reason = finish_reason
        seq.stop_reason = stop_reason
        req.num_unfinished -= 1
        arrival = req.metrics.arrival_time
        timeline = req.timeline
        scheduled, first, last = seq.scheduled_time, seq.first_token_core_time, seq.last_token_core_time
        # Without a stamp from the core (an engine in this process: ``LLMEngine``) it reached the core on arrival.
        queued = seq.queued_time if seq.queued_time is not None else arrival
        stats.finished_requests.append(
            FinishedRequestStats(
                request_id=seq.request_id,
                finish_reason=finish_reason,
                num_prompt_tokens=len(req.prompt_token_ids),
                num_generation_tokens=len(seq.token_ids),
                e2e_latency=now - arrival,
                ttft=None if seq.first_token_time is None else seq.first_token_time - arrival,
                queue_time=_span(queued, scheduled),
                prefill_time=_span(scheduled, first),
                decode_time=_span(first, last),
                inference_time=_span(scheduled, last),
                tokenize_time=_span(timeline.arrival_time, timeline.tokenized_time),
                frontend_to_core_time=_span(timeline.tokenized_time, seq.queued_time),
            )
        )

    # ------------------------------------------------------------------ logprobs

    def _logprob_row(self, rows: LogprobsLists, i: int, num_top: int) -> dict[int, Logprob]:
        """Row ``i`` as ``{token_id: Logprob}``: the sampled (or prompt) token first with its true rank, then
        up to ``num_top`` candidates ranked 1.. (a candidate equal to the sampled token appears once)."""
        token_ids = rows.token_ids[i]
        logprobs = rows.logprobs[i]
        text = self._token_text
        first = token_ids[0]
        row = {first: Logprob(logprobs[0], rows.ranks[i], text(first))}
        for j in range(1, min(len(token_ids), num_top + 1)):
            token_id = token_ids[j]
            if token_id not in row:
                row[token_id] = Logprob(logprobs[j], j, text(token_id))
        return row

    def _add_prompt_logprobs(self, req: _RequestState, seq: _SequenceState, rows: LogprobsLists) -> None:
        """Keep rows for prompt positions not seen yet. Every sequence of a request has the same prompt, so
        whichever reports a position first provides it."""
        start = seq.num_prompt_logprob_rows
        num_rows = len(rows.token_ids)
        seq.num_prompt_logprob_rows += num_rows
        if req.prompt_logprobs is None:
            return
        num_top = req.params.prompt_logprobs or 0
        num_known = len(req.prompt_logprobs) - 1  # rows held, for positions 1..num_known
        for i in range(max(0, num_known - start), num_rows):
            req.prompt_logprobs.append(self._logprob_row(rows, i, num_top))

    # ------------------------------------------------------------------ building outputs

    def _make_request_output(
        self, req: _RequestState, updated: list[_SequenceState], finished: bool
    ) -> RequestOutput | None:
        kind = req.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind == RequestOutputKind.DELTA
        seqs = sorted(updated, key=lambda s: s.index) if delta else req.seqs
        prompt_logprobs = req.prompt_logprobs
        if prompt_logprobs is not None:
            if delta:
                num_sent = req.num_sent_prompt_logprobs
                req.num_sent_prompt_logprobs = len(prompt_logprobs)
                prompt_logprobs = prompt_logprobs[num_sent:] or None
            else:
                prompt_logprobs = list(prompt_logprobs)
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=[self._completion_output(seq, delta) for seq in seqs],
            finished=finished,
            num_cached_tokens=req.num_cached_tokens,
            metrics=dataclasses.replace(req.metrics),
            kv_transfer_params=req.kv_transfer_params,
        )

    @staticmethod
    def _completion_output(seq: _SequenceState, delta: bool) -> CompletionOutput:
        text_len = seq.visible_text_len()
        if delta:
            text = seq.text[seq.num_sent_chars : text_len] if text_len > seq.num_sent_chars else ""
            seq.num_sent_chars = max(seq.num_sent_chars, text_len)
            start = seq.num_sent_tokens
        else:
            text = seq.text[:text_len]
            start = 0
        seq.num_sent_tokens = len(seq.token_ids)
        return CompletionOutput(
            index=seq.index,
            text=text,
            token_ids=seq.token_ids[start:],
            cumulative_logprob=seq.cumulative_logprob,
            logprobs=seq.logprobs[start:] if seq.logprobs is not None else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )
