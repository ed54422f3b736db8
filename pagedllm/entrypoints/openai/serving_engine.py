"""What completions and chat completions share: body parsing, model check, context-length and parameter
validation, ``SamplingParams`` construction, logprob formatting, SSE framing and disconnect handling."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pagedllm.engine.async_llm import AsyncLLM, RequestStream
from pagedllm.engine.core_process import EngineDeadError, EngineSleepingError
from pagedllm.engine.output_processor import RequestTimeline
from pagedllm.entrypoints.openai.errors import (
    OpenAIError,
    bad_request,
    engine_dead,
    from_validation_error,
    from_value_error,
)
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import Logprob
from pagedllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from pagedllm.tokenizer import TokenTextCache, make_decode_fn

logger = logging.getLogger(__name__)

# More stop sequences than this, or longer ones, are refused (OpenAI allows 4; vLLM has no limit).
MAX_STOP_SEQUENCES = 16
MAX_STOP_LENGTH = 1024
# Logprob floor used in JSON: -inf is not valid JSON.
_MIN_LOGPROB = -9999.0

ModelT = TypeVar("ModelT", bound=BaseModel)
T = TypeVar("T")

# Debug switch: a file the server appends one JSON line to per finished request, with its timeline.
REQUEST_TIMELINE_ENV = "PAGEDLLM_REQUEST_TIMELINE"
# (name in the file, RequestTimeline attribute), in the order a request reaches them (a short request's last
# token and finish may come before its first chunk is written).
TIMELINE_STAMPS = (
    ("arrival", "arrival_time"),  # the HTTP handler's entry
    ("tokenized", "tokenized_time"),  # prompt token ids ready
    ("sent", "sent_time"),  # handed to the engine core client
    ("queued", "queued_time"),  # added to the engine core's scheduler
    ("scheduled", "scheduled_time"),  # first scheduled
    ("first_token", "first_token_time"),  # its first token left the engine core
    (
        "first_token_out",
        "first_token_out_time",
    ),  # first chunk with output written (not streaming: response ready)
    ("last_token", "last_token_time"),  # its last token left the engine core
    ("finished", "finished_time"),  # the front-end saw it finish
)


class RequestTimelineLog:
    """Appends one JSON line per finished engine request (one per prompt of a completion request)::

        {"request_id": ..., "stream": true, "arrival_time": <time.monotonic() s>, "num_prompt_tokens": 12,
         "stamps_ms": {"arrival": 0.0, "tokenized": 0.4, "sent": 0.5, "queued": 1.1, "scheduled": 1.3,
                       "first_token": 30.2, "first_token_out": 31.0, "last_token": 80.4, "finished": 80.9}}

    ``stamps_ms`` are milliseconds after arrival, in the order of ``TIMELINE_STAMPS``; a stamp never reached is
    null. The server process writes (one event loop: lines never interleave); ``benchmarks/burst_timeline.py``
    summarises a file.
    """

    _open: dict[str, RequestTimelineLog] = {}  # path -> log: completions and chat share one file

    def __init__(self, path: str) -> None:
        self.path = path
        self._file = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - open for the server's life

    @classmethod
    def from_env(cls) -> RequestTimelineLog | None:
        """The log named by ``PAGEDLLM_REQUEST_TIMELINE``, or None when it is unset or empty."""
        path = os.environ.get(REQUEST_TIMELINE_ENV)
        if not path:
            return None
        log = cls._open.get(path)
        if log is None:
            log = cls._open[path] = cls(path)
        return log

    def write(self, stream: RequestStream, streaming: bool) -> None:
        if not stream.finished:
            return  # failed or aborted: no timeline to speak of
        self._file.write(json.dumps(timeline_record(stream, streaming), separators=(",", ":")) + "\n")


def timeline_record(stream: RequestStream, streaming: bool) -> dict[str, Any]:
    """One line of the ``RequestTimelineLog``."""
    timeline = stream.timeline
    arrival = timeline.arrival_time
    stamps: dict[str, float | None] = {}
    for name, attr in TIMELINE_STAMPS:
        value = getattr(timeline, attr)
        stamps[name] = None if value is None else round(1000.0 * (value - arrival), 3)
    return {
        "request_id": stream.request_id,
        "stream": streaming,
        "arrival_time": arrival,
        "num_prompt_tokens": len(stream.prompt_token_ids),
        "stamps_ms": stamps,
    }


def mark_first_output(stream: RequestStream) -> None:
    """Stamp ``first_token_out_time`` unless it is set: call as a chunk carrying its output is handed to the
    server to write (streaming) or the response is ready."""
    timeline = stream.timeline
    if timeline.first_token_out_time is None:
        timeline.first_token_out_time = time.monotonic()


def parse_body(body: bytes, model_cls: type[ModelT]) -> ModelT:
    """Decode, parse and validate a JSON request body; every failure is a 400 saying what is wrong."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"the request body is not valid UTF-8 (byte {e.start})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise bad_request(
            f"the request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
        ) from None
    if not isinstance(data, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class SSEResponse(StreamingResponse):
    """A ``text/event-stream`` response that closes its request streams however it ends (aborting any still
    running).

    Why not leave it to the body generator's ``finally``: a disconnect can surface while the generator is
    suspended at a ``yield``, not inside it. Starlette cancels the task sending the body, which may be blocked
    in ``send`` (a slow reader has let the socket buffer fill); servers speaking ASGI 2.4 make ``send`` itself
    raise. Either way nobody resumes the generator, so its ``finally`` (which aborts the requests) would run
    only when the garbage collector gets to it, and until then the engine generates for nobody.
    """

    def __init__(self, content: AsyncIterator[str], streams: list[RequestStream]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self._streams = streams

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for stream in self._streams:
                stream.close()
            try:
                await self.body_iterator.aclose()  # type: ignore[union-attr]
            except Exception:  # noqa: BLE001 - the requests are closed already; just tidying up
                logger.exception("closing a response stream failed")


def clamp_logprob(value: float) -> float:
    return max(value, _MIN_LOGPROB) if not math.isnan(value) else _MIN_LOGPROB


def to_openai_error(
    exc: BaseException, known_fields: dict[str, str | None] | set[str] | None = None
) -> OpenAIError:
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return engine_dead(f"the engine is not running: {exc}")
    if isinstance(exc, EngineSleepingError):
        return OpenAIError(str(exc), status_code=503, type="server_error", code="engine_sleeping")
    if isinstance(exc, ValueError):
        return from_value_error(exc, known_fields)
    return OpenAIError(
        f"internal error: {type(exc).__name__}: {exc}",
        status_code=500,
        type="server_error",
        code="internal_error",
    )


class OpenAIServing:
    """Base of the completion and chat handlers: one per server, shared by all requests."""

    # Engine-side names (ValueError messages) -> request fields; subclasses extend it.
    field_map: dict[str, str | None] = {
        "n": "n",
        "best_of": "best_of",
        "presence_penalty": "presence_penalty",
        "frequency_penalty": "frequency_penalty",
        "repetition_penalty": "repetition_penalty",
        "temperature": "temperature",
        "top_p": "top_p",
        "top_k": "top_k",
        "min_p": "min_p",
        "seed": "seed",
        "stop": "stop",
        "stop_token_ids": "stop_token_ids",
        "max_tokens": "max_tokens",
        "min_tokens": "min_tokens",
        "logit_bias": "logit_bias",
        "logprobs": "logprobs",
        "prompt_logprobs": "logprobs",
        "prompt": "prompt",
        "prompt_token_ids": "prompt",
        "request_id": None,
        "lora_request": "model",
    }

    def __init__(
        self,
        engine: AsyncLLM,
        served_model_names: list[str],
        *,
        max_logprobs: int = 20,
        chat_template: str | None = None,
        enable_auto_tool_choice: bool = False,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
        models: OpenAIServingModels | None = None,
    ) -> None:
        """``models``: the server's base names and LoRA adapters (default: ``served_model_names`` only)."""
        from pagedllm.entrypoints.openai.reasoning_parsers import get_reasoning_parser
        from pagedllm.entrypoints.openai.tool_parsers import get_tool_parser

        self.engine = engine
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.tool_call_parser = tool_call_parser
        self.tool_parser_cls = get_tool_parser(tool_call_parser) if tool_call_parser else None
        self.reasoning_parser_cls = get_reasoning_parser(reasoning_parser) if reasoning_parser else None
        self.served_model_names = served_model_names
        self.model_name = served_model_names[0]
        self.models = models if models is not None else OpenAIServingModels(engine, served_model_names)
        self.max_logprobs = max_logprobs
        self.chat_template = chat_template
        self.tokenizer = engine.tokenizer
        self.max_model_len = int(engine.model_config.max_model_len)
        self.vocab_size = int(engine.model_config.vocab_size)
        self.token_text = TokenTextCache(self.tokenizer)
        self.timeline_log = RequestTimelineLog.from_env()

    # ------------------------------------------------------------------ checks

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter ``model`` selects (None: the base model); 404 ``model_not_found`` if unknown."""
        return self.models.resolve(model)

    def response_model_name(self, model: str | None) -> str:
        """The ``model`` of a response: the adapter's name when the request named one, else the base name."""
        return model if model is not None and model not in self.served_model_names else self.model_name

    def check_engine(self) -> None:
        err = self.engine.dead_error
        if err is not None or self.engine.errored:
            raise engine_dead(f"the engine is not running: {err}")

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        if not token_ids:
            raise bad_request(f"{param} must not be empty", param)
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(
                f"{param} contains token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}", param
            )

    def resolve_max_tokens(
        self, prompt_len: int, max_tokens: int | None, *, prompt_param: str, max_tokens_param: str
    ) -> int:
        """Check the prompt and the requested completion against the context; return max_tokens to use."""
        limit = self.max_model_len
        if max_tokens is not None and max_tokens < 1:
            raise bad_request(f"{max_tokens_param} must be at least 1, got {max_tokens}", max_tokens_param)
        if prompt_len >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, your prompt has {prompt_len} "
                f"tokens, which leaves no room for the completion ({prompt_len} + at least 1 > {limit}). Please "
                "shorten the prompt.",
                prompt_param,
            )
        if max_tokens is None:
            return limit - prompt_len
        if prompt_len + max_tokens > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} in the completion). "
                f"Please reduce the length of the prompt or {max_tokens_param}.",
                max_tokens_param,
            )
        return max_tokens

    async def run_beam_search(self, raw_request: Request, work: Awaitable[T]) -> T | None:
        """Await a beam search (``use_beam_search``); None if the client went away first. An engine error is
        raised in OpenAI's error shape."""
        try:
            return await wait_or_disconnect(raw_request, work)
        except Exception as e:  # noqa: BLE001 - mapped to the OpenAI error shape
            raise to_openai_error(e, self.field_map) from None

    def choice_decoder(self, req: Any) -> Any:
        """Token ids -> text for a beam-search choice, with the request's special-token settings."""
        return make_decode_fn(
            self.tokenizer, req.skip_special_tokens is not False, req.spaces_between_special_tokens is not False
        )

    @staticmethod
    def check_stream_options(req: Any) -> None:
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")

    def check_logprobs(self, value: int | None, param: str) -> None:
        if value is None:
            return
        if value < 0:
            raise bad_request(f"{param} must be >= 0, got {value}", param)
        if value > self.max_logprobs:
            raise bad_request(
                f"{param} must be at most {self.max_logprobs} on this server, got {value}", param
            )

    # ------------------------------------------------------------------ sampling params

    def sampling_params(
        self,
        req: Any,
        *,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        output_kind: RequestOutputKind,
        structured_outputs: StructuredOutputsParams | None = None,
        skip_special_tokens: bool | None = None,
    ) -> SamplingParams:
        stop = req.stop
        if isinstance(stop, str):
            stop = [stop]
        if stop is not None:
            if len(stop) > MAX_STOP_SEQUENCES:
                raise bad_request(
                    f"stop may hold at most {MAX_STOP_SEQUENCES} sequences, got {len(stop)}", "stop"
                )
            if any(len(s) > MAX_STOP_LENGTH for s in stop):
                raise bad_request(f"stop sequences must be at most {MAX_STOP_LENGTH} characters long", "stop")
        logit_bias = None
        if req.logit_bias:
            try:
                logit_bias = {int(k): float(v) for k, v in req.logit_bias.items()}
            except ValueError:
                raise bad_request(
                    "logit_bias keys must be token ids (integers as strings)", "logit_bias"
                ) from None
        kwargs: dict[str, Any] = dict(
            n=req.n,
            max_tokens=max_tokens,
            stop=stop,
            seed=req.seed,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=logit_bias,
            ignore_eos=bool(req.ignore_eos),
            stop_token_ids=req.stop_token_ids,
            include_stop_str_in_output=bool(req.include_stop_str_in_output),
            skip_special_tokens=req.skip_special_tokens is not False
            if skip_special_tokens is None
            else skip_special_tokens,
            structured_outputs=structured_outputs,
            spaces_between_special_tokens=req.spaces_between_special_tokens is not False,
            output_kind=output_kind,
            kv_transfer_params=req.kv_transfer_params,
        )
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "min_tokens",
        ):
            value = getattr(req, name)
            if value is not None:
                kwargs[name] = value
        try:
            params = SamplingParams(**kwargs)
            params.verify_vocab(self.vocab_size)
        except ValueError as e:
            raise from_value_error(e, self.field_map) from None
        return params

    def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams,
        lora_request: LoRARequest | None = None,
        timeline: RequestTimeline | None = None,
    ) -> RequestStream:
        try:
            return self.engine.add_request(
                request_id, prompt, params, lora_request=lora_request, timeline=timeline
            )
        except (ValueError, EngineDeadError, EngineSleepingError) as e:
            raise to_openai_error(e, self.field_map) from None

    def log_timelines(self, streams: list[RequestStream], streaming: bool) -> None:
        """Append the finished streams' timelines to the timeline log, when there is one."""
        if self.timeline_log is not None:
            for stream in streams:
                self.timeline_log.write(stream, streaming)

    # ------------------------------------------------------------------ logprobs

    def token_str(self, token_id: int, row: dict[int, Logprob] | None) -> str:
        if row is not None:
            lp = row.get(token_id)
            if lp is not None and lp.decoded_token is not None:
                return lp.decoded_token
        return self.token_text(token_id)

    def completion_logprobs(
        self,
        token_ids: list[int],
        rows: list[dict[int, Logprob] | None],
        initial_offset: int,
    ) -> dict[str, Any]:
        """Completions format: tokens, token_logprobs, top_logprobs (token text -> logprob), text_offset
        (character offset of each token in the choice's text, counting from ``initial_offset``)."""
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top_logprobs: list[dict[str, float] | None] = []
        text_offset: list[int] = []
        offset = initial_offset
        for token_id, row in zip(token_ids, rows):
            text = self.token_str(token_id, row)
            tokens.append(text)
            text_offset.append(offset)
            offset += len(text)
            if row is None or token_id not in row:
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(clamp_logprob(row[token_id].logprob))
            top_logprobs.append({self.token_str(t, row): clamp_logprob(lp.logprob) for t, lp in row.items()})
        return {
            "text_offset": text_offset,
            "token_logprobs": token_logprobs,
            "tokens": tokens,
            "top_logprobs": top_logprobs,
        }

    def chat_logprobs(
        self, token_ids: list[int], rows: list[dict[int, Logprob]], num_top: int
    ) -> list[dict[str, Any]]:
        """Chat format: one entry per token with its text, logprob, UTF-8 bytes and the ``num_top`` best."""
        content = []
        for token_id, row in zip(token_ids, rows):
            text = self.token_str(token_id, row)
            lp = row.get(token_id)
            ranked = sorted(
                ((t, c) for t, c in row.items() if c.rank is not None and c.rank <= num_top),
                key=lambda x: x[1].rank,
            )
            top = []
            for t, c in ranked:
                t_text = self.token_str(t, row)
                top.append(
                    {"token": t_text, "logprob": clamp_logprob(c.logprob), "bytes": list(t_text.encode())}
                )
            content.append(
                {
                    "token": text,
                    "logprob": clamp_logprob(lp.logprob) if lp is not None else _MIN_LOGPROB,
                    "bytes": list(text.encode()),
                    "top_logprobs": top,
                }
            )
        return content


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, Any]]:
    """Yield ``(stream index, output)`` from several request streams as outputs arrive. Closes every stream
    when the caller stops iterating (which aborts requests still running)."""
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            streams[0].close()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
            queue.put_nowait((i, done))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, who raises it
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(streams)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.close()


async def wait_or_disconnect(raw_request: Request, work: Awaitable[T]) -> T | None:
    """Run ``work``; if the client disconnects first, cancel it (aborting its requests) and return None."""
    task = asyncio.ensure_future(work)

    async def wait_disconnect() -> None:
        while True:
            message = await raw_request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task.done():
        watcher.cancel()
        return task.result()
    task.cancel()  # the client went away: abort its requests
    try:
        await task
    except (asyncio.CancelledError, Exception):  # noqa: BLE001 - nobody is left to tell
        pass
    return None
