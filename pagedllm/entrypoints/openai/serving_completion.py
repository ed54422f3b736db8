"""POST /v1/completions: prompts as text or token ids (one or many), echo, logprobs, n, streaming."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedllm.beam_search import BeamSearchOutput, run_beam_search_async
from pagedllm.engine.async_llm import RequestStream
from pagedllm.engine.output_processor import RequestTimeline
from pagedllm.entrypoints.openai.constraints import structured_outputs_from_request
from pagedllm.entrypoints.openai.errors import OpenAIError, bad_request
from pagedllm.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    UsageInfo,
    completion_chunk,
    usage_chunk,
)
from pagedllm.entrypoints.openai.serving_engine import (
    SSE_DONE,
    OpenAIServing,
    SSEResponse,
    mark_first_output,
    merge_streams,
    new_request_id,
    sse,
    to_openai_error,
    wait_or_disconnect,
)
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import RequestOutputKind


class _Prompt:
    """One prompt of a completion request: its token ids, and its text (decoded lazily for token-id prompts)."""

    def __init__(self, serving: OpenAIServing, text: str | None, token_ids: list[int]) -> None:
        self._serving = serving
        self._text = text
        self.token_ids = token_ids
        self.logprob_rows: list[dict[int, Logprob] | None] = []  # prompt logprobs gathered so far (echo)

    @property
    def text(self) -> str:
        if self._text is None:
            self._text = self._serving.tokenizer.decode(self.token_ids)
        return self._text

    @property
    def given_text(self) -> str | None:
        return self._text


def _visible(
    c: CompletionOutput, score_only: bool
) -> tuple[str, list[int], list, str | None, int | str | None]:
    """(text, token ids, logprob rows, finish reason, stop reason) of a completion as the client sees it."""
    if score_only:  # the one token generated to score the prompt is not shown
        return "", [], [], ("length" if c.finish_reason is not None else None), None
    return c.text, c.token_ids, list(c.logprobs or []), c.finish_reason, c.stop_reason


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(
        self, req: CompletionRequest, raw_request: Request, arrival_time: float | None = None
    ) -> Response:
        """``arrival_time``: when the HTTP handler was entered (``time.monotonic()``; default: now)."""
        if arrival_time is None:
            arrival_time = time.monotonic()
        lora_request = self.check_model(req.model)
        self.check_engine()
        if req.suffix is not None:
            raise bad_request("suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request(f"best_of must equal n ({req.n}) when given; got {req.best_of}", "best_of")
        if req.n < 1:
            raise bad_request(f"n must be at least 1, got {req.n}", "n")
        self.check_stream_options(req)
        if req.use_beam_search:
            return await self._beam_search(req, raw_request, lora_request)
        self.check_logprobs(req.logprobs, "logprobs")
        structured = structured_outputs_from_request(req)
        prompts = self._prompts(req.prompt)
        tokenized_time = time.monotonic()
        echo = bool(req.echo)
        # echo with max_tokens=0 scores the prompt (prompt logprobs, as lm-eval-harness asks): generate one
        # token to get there, then report none.
        score_only = echo and req.max_tokens == 0
        streaming = bool(req.stream)
        kind = RequestOutputKind.DELTA if streaming else RequestOutputKind.FINAL_ONLY
        request_id = new_request_id("cmpl")
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(prompts):
                max_tokens = self.resolve_max_tokens(
                    len(prompt.token_ids),
                    1 if score_only else req.max_tokens,
                    prompt_param="prompt",
                    max_tokens_param="max_tokens",
                )
                params = self.sampling_params(
                    req,
                    max_tokens=max_tokens,
                    logprobs=req.logprobs,
                    prompt_logprobs=req.logprobs if echo else None,
                    output_kind=kind,
                    structured_outputs=structured,
                )
                engine_prompt: dict[str, Any] = {"prompt_token_ids": prompt.token_ids}
                if prompt.given_text is not None:
                    engine_prompt["prompt"] = prompt.given_text
                timeline = RequestTimeline(arrival_time, tokenized_time=tokenized_time)
                streams.append(
                    self.add_request(f"{request_id}-{i}", engine_prompt, params, lora_request, timeline)
                )
        except BaseException:
            for stream in streams:
                stream.close()
            raise
        if streaming:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return SSEResponse(
                self._stream(req, request_id, prompts, streams, include_usage, score_only), streams
            )
        try:
            response = await wait_or_disconnect(
                raw_request, self._collect(req, request_id, prompts, streams, score_only)
            )
        except Exception as e:  # noqa: BLE001 - mapped to the OpenAI error shape
            raise to_openai_error(e, self.field_map) from None
        if response is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        for stream in streams:
            mark_first_output(stream)  # the response is ready
        self.log_timelines(streams, streaming=False)
        return JSONResponse(response.model_dump())

    def _prompts(self, prompt: Any) -> list[_Prompt]:
        """Normalize str | list[str] | list[int] | list[list[int]] to prompts with token ids, checked."""
        if isinstance(prompt, str):
            items: list[Any] = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            items = [prompt]
        elif isinstance(prompt, list):
            items = prompt
        else:
            raise bad_request(
                "prompt must be a string, a list of strings, token ids or lists of token ids", "prompt"
            )
        if not items:
            raise bad_request("prompt must not be empty", "prompt")
        out = []
        for j, item in enumerate(items):
            param = "prompt" if len(items) == 1 else f"prompt[{j}]"
            if isinstance(item, str):
                if not item:
                    raise bad_request(f"{param} must not be empty", param)
                token_ids = self.engine.input_processor.tokenize(item)
                if not token_ids:
                    raise bad_request(f"{param} has no tokens", param)
                out.append(_Prompt(self, item, token_ids))
            else:
                token_ids = list(item)
                self.check_token_ids(token_ids, param)
                out.append(_Prompt(self, None, token_ids))
        return out

    # ------------------------------------------------------------------ beam search

    async def _beam_search(
        self, req: CompletionRequest, raw_request: Request, lora_request: LoRARequest | None
    ) -> Response:
        """``use_beam_search``: per prompt, the ``n`` best sequences as choices ``i * n .. i * n + n - 1``, best
        first. Usage counts each prompt once and the tokens of the returned choices."""
        prompts = self._prompts(req.prompt)
        params = []
        for prompt in prompts:
            max_tokens = self.resolve_max_tokens(
                len(prompt.token_ids), req.max_tokens, prompt_param="prompt", max_tokens_param="max_tokens"
            )
            params.append(req.to_beam_search_params(max_tokens, self.engine.input_processor))
        request_id = new_request_id("cmpl")

        async def search_all() -> list[BeamSearchOutput]:
            tasks = [
                asyncio.ensure_future(
                    run_beam_search_async(self.engine, p.token_ids, bp, f"{request_id}-{i}", lora_request)
                )
                for i, (p, bp) in enumerate(zip(prompts, params))
            ]
            try:
                return list(await asyncio.gather(*tasks))
            finally:
                for task in tasks:  # one failed: stop the others (a finished task ignores this)
                    task.cancel()

        outputs = await self.run_beam_search(raw_request, search_all())
        if outputs is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        decode = self.choice_decoder(req)
        choices = []
        num_completion_tokens = 0
        for i, (prompt, output) in enumerate(zip(prompts, outputs)):
            for j, seq in enumerate(output.sequences):
                token_ids = seq.tokens[len(prompt.token_ids) :]
                num_completion_tokens += len(token_ids)
                choices.append(
                    CompletionResponseChoice(
                        index=i * req.n + j,
                        text=decode(token_ids),
                        finish_reason=seq.finish_reason,
                        stop_reason=seq.stop_reason,
                    )
                )
        response = CompletionResponse(
            id=request_id,
            model=self.response_model_name(req.model),
            choices=choices,
            usage=UsageInfo.of(sum(len(p.token_ids) for p in prompts), num_completion_tokens),
        )
        return JSONResponse(response.model_dump())

    # ------------------------------------------------------------------ non-streaming

    async def _collect(
        self,
        req: CompletionRequest,
        request_id: str,
        prompts: list[_Prompt],
        streams: list[RequestStream],
        score_only: bool,
    ) -> CompletionResponse:
        finals: list[RequestOutput | None] = [None] * len(streams)
        async for i, out in merge_streams(streams):
            finals[i] = out
        choices = []
        num_prompt_tokens = 0
        num_completion_tokens = 0
        for i, final in enumerate(finals):
            assert final is not None
            prompt = prompts[i]
            num_prompt_tokens += len(prompt.token_ids)
            for c in sorted(final.outputs, key=lambda c: c.index):
                text, token_ids, rows, finish_reason, stop_reason = _visible(c, score_only)
                num_completion_tokens += len(token_ids)
                if req.echo:
                    text = prompt.text + text
                    token_ids = prompt.token_ids + token_ids
                    rows = list(final.prompt_logprobs or [None] * len(prompt.token_ids)) + rows
                logprobs = None
                if req.logprobs is not None:
                    logprobs = CompletionLogProbs(**self.completion_logprobs(token_ids, rows, 0))
                choices.append(
                    CompletionResponseChoice(
                        index=i * req.n + c.index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=finish_reason,
                        stop_reason=stop_reason,
                    )
                )
        return CompletionResponse(
            id=request_id,
            model=self.response_model_name(req.model),
            choices=choices,
            usage=UsageInfo.of(num_prompt_tokens, num_completion_tokens),
            # one prompt (the disaggregated-prefill case): its handle; several: none
            kv_transfer_params=finals[0].kv_transfer_params if len(finals) == 1 else None,
        )

    # ------------------------------------------------------------------ streaming

    async def _stream(
        self,
        req: CompletionRequest,
        request_id: str,
        prompts: list[_Prompt],
        streams: list[RequestStream],
        include_usage: bool,
        score_only: bool,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        n = req.n
        num_sent_chars = [0] * (len(prompts) * n)
        num_tokens = [0] * (len(prompts) * n)
        echoed: set[int] = set()
        want_logprobs = req.logprobs is not None
        try:
            async for i, out in merge_streams(streams):
                prompt = prompts[i]
                if out.prompt_logprobs:
                    prompt.logprob_rows.extend(out.prompt_logprobs)
                for c in out.outputs:
                    index = i * n + c.index
                    text, token_ids, rows, finish_reason, stop_reason = _visible(c, score_only)
                    num_tokens[index] += len(token_ids)
                    if req.echo and index not in echoed:
                        echoed.add(index)
                        text = prompt.text + text
                        token_ids = prompt.token_ids + token_ids
                        prompt_rows = prompt.logprob_rows or [None] * len(prompt.token_ids)
                        rows = list(prompt_rows) + rows
                    if not text and not token_ids and finish_reason is None:
                        continue
                    logprobs = None
                    if want_logprobs:
                        logprobs = self.completion_logprobs(token_ids, rows, num_sent_chars[index])
                    num_sent_chars[index] += len(text)
                    chunk = sse(
                        completion_chunk(
                            request_id,
                            created,
                            self.response_model_name(req.model),
                            index,
                            text,
                            logprobs,
                            finish_reason,
                            stop_reason,
                        )
                    )
                    mark_first_output(streams[i])  # the chunk is written next
                    yield chunk
            if include_usage:
                num_prompt_tokens = sum(len(p.token_ids) for p in prompts)
                usage = UsageInfo.of(num_prompt_tokens, sum(num_tokens))
                model = self.response_model_name(req.model)
                yield sse(usage_chunk(request_id, created, model, "text_completion", usage))
            self.log_timelines(streams, streaming=True)
        except Exception as e:  # noqa: BLE001 - the status line is sent already: report in the stream
            err: OpenAIError = to_openai_error(e, self.field_map)
            yield sse(err.to_dict())
        yield SSE_DONE
