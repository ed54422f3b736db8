"""POST /v1/chat/completions: chat template, n, logprobs in the chat format, streaming (role delta first)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedllm.beam_search import run_beam_search_async
from pagedllm.engine.async_llm import RequestStream
from pagedllm.engine.input_processor import extract_chat_images
from pagedllm.engine.output_processor import RequestTimeline
from pagedllm.entrypoints.openai.chat_output import ChatOutput
from pagedllm.entrypoints.openai.constraints import (
    ToolPlan,
    check_no_conflict,
    plan_tools,
    structured_outputs_from_request,
)
from pagedllm.entrypoints.openai.errors import OpenAIError, bad_request, from_value_error
from pagedllm.entrypoints.openai.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatMessage,
    ChatResponseMessage,
    UsageInfo,
    chat_chunk,
    usage_chunk,
)
from pagedllm.entrypoints.openai.serving_engine import (
    SSE_DONE,
    OpenAIServing,
    SSEResponse,
    mark_first_output,
    new_request_id,
    sse,
    to_openai_error,
    wait_or_disconnect,
)
from pagedllm.lora.request import LoRARequest
from pagedllm.sampling_params import RequestOutputKind


class OpenAIServingChat(OpenAIServing):
    field_map = {
        **OpenAIServing.field_map,
        "messages": "messages",
        "chat_template": None,
        "logprobs": "top_logprobs",
        "prompt": "messages",
        "prompt_token_ids": "messages",
        "multi_modal_data": "messages",
    }

    def render_prompt(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        images: list[Any] | None = None,
    ) -> tuple[str, list[int]]:
        """Apply the chat template and tokenize; ValueErrors become 400s naming ``messages``. ``images``: a list
        that receives the messages' image parts (``extract_chat_images``); None refuses them."""
        conversation = [_template_message(m.model_dump(exclude_none=True)) for m in messages]
        processor = self.engine.input_processor
        try:
            conversation, found = extract_chat_images(conversation, processor.image_placeholder)
        except ValueError as e:
            raise from_value_error(e, {"messages": "messages"}) from None
        if found and images is None:
            raise bad_request(f"{found[0].field}: images are not accepted here", "messages")
        if images is not None:
            images.extend(found)
        kwargs = dict(template_kwargs or {})
        if tools:
            kwargs["tools"] = tools
        try:
            text = processor.apply_chat_template(
                conversation,
                chat_template=self.chat_template,
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
        except ValueError as e:
            raise from_value_error(e, {"messages": "messages", "chat_template": None}) from None
        token_ids = processor.tokenize(text, add_special_tokens=False)
        if not token_ids:
            raise bad_request("messages render to an empty prompt", "messages")
        return text, token_ids

    async def create_chat_completion(
        self, req: ChatCompletionRequest, raw_request: Request, arrival_time: float | None = None
    ) -> Response:
        """``arrival_time``: when the HTTP handler was entered (``time.monotonic()``; default: now)."""
        if arrival_time is None:
            arrival_time = time.monotonic()
        lora_request = self.check_model(req.model)
        self.check_engine()
        if req.n < 1:
            raise bad_request(f"n must be at least 1, got {req.n}", "n")
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        num_top = (req.top_logprobs or 0) if req.logprobs else None
        self.check_stream_options(req)
        if req.use_beam_search:
            return await self._beam_search(req, raw_request, lora_request)
        self.check_logprobs(num_top, "top_logprobs")
        plan = plan_tools(req, self.enable_auto_tool_choice, self.tool_call_parser)
        structured = structured_outputs_from_request(req)
        check_no_conflict(plan, structured)
        image_parts: list[Any] = []
        prompt_text, token_ids = self.render_prompt(
            req.messages,
            req.add_generation_prompt is not False,
            tools=plan.tools,
            template_kwargs=req.chat_template_kwargs,
            images=image_parts,
        )
        prompt: dict[str, Any] = {"prompt_token_ids": token_ids, "prompt": prompt_text}
        if image_parts:  # fetched, decoded and preprocessed off the event loop: http URLs may take up to the fetch
            # timeout, the image processor tens of milliseconds an image (on the loop, a burst of image requests
            # would hold every stream's output back until the last image was through)
            try:
                loaded = await asyncio.to_thread(
                    self.engine.input_processor.load_chat_images, image_parts, preprocess=True
                )
            except ValueError as e:
                raise from_value_error(e, {"messages": "messages"}) from None
            prompt["multi_modal_data"] = {"image": loaded}
        timeline = RequestTimeline(arrival_time, tokenized_time=time.monotonic())
        num_prompt_tokens = self.engine.input_processor.expanded_prompt_len(token_ids, len(image_parts))
        max_tokens = self._max_tokens(req, num_prompt_tokens)
        streaming = bool(req.stream)
        kind = RequestOutputKind.DELTA if streaming else RequestOutputKind.FINAL_ONLY
        # Parsers that look for special tokens ([TOOL_CALLS], <|python_tag|>) need them in the text.
        keep_special = plan.mode == "auto" and self.tool_call_parser in _PARSERS_READING_SPECIAL_TOKENS
        params = self.sampling_params(
            req,
            max_tokens=max_tokens,
            logprobs=num_top,
            output_kind=kind,
            structured_outputs=plan.constraint or structured,
            skip_special_tokens=False if keep_special else None,
        )
        request_id = new_request_id("chatcmpl")
        stream = self.add_request(request_id, prompt, params, lora_request, timeline)
        token_ids = stream.prompt_token_ids  # image placeholders expanded
        if streaming:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return SSEResponse(
                self._stream(req, request_id, len(token_ids), stream, num_top, include_usage, plan), [stream]
            )
        try:
            response = await wait_or_disconnect(
                raw_request, self._collect(request_id, len(token_ids), stream, num_top, plan)
            )
        except Exception as e:  # noqa: BLE001 - mapped to the OpenAI error shape
            raise to_openai_error(e, self.field_map) from None
        finally:
            stream.close()
        if response is None:
            return Response(status_code=499)
        mark_first_output(stream)  # the response is ready
        self.log_timelines([stream], streaming=False)
        response.model = self.response_model_name(req.model)
        return JSONResponse(response.model_dump())

    def _max_tokens(self, req: ChatCompletionRequest, num_prompt_tokens: int) -> int:
        """The completion's token limit: ``max_completion_tokens`` (OpenAI's newer name) or ``max_tokens``, checked
        against the context (the rest of it when neither is given)."""
        if req.max_completion_tokens is not None:
            param, requested = "max_completion_tokens", req.max_completion_tokens
        else:
            param, requested = "max_tokens", req.max_tokens
        return self.resolve_max_tokens(num_prompt_tokens, requested, prompt_param="messages", max_tokens_param=param)

    async def _beam_search(
        self, req: ChatCompletionRequest, raw_request: Request, lora_request: LoRARequest | None
    ) -> Response:
        """``use_beam_search``: the ``n`` best sequences as choices, best first; usage counts the prompt once
        and the tokens of the returned choices."""
        _, token_ids = self.render_prompt(
            req.messages, req.add_generation_prompt is not False, template_kwargs=req.chat_template_kwargs
        )
        max_tokens = self._max_tokens(req, len(token_ids))
        params = req.to_beam_search_params(max_tokens, self.engine.input_processor)
        plan = plan_tools(req, self.enable_auto_tool_choice, self.tool_call_parser)
        request_id = new_request_id("chatcmpl")
        work = run_beam_search_async(self.engine, token_ids, params, request_id, lora_request)
        output = await self.run_beam_search(raw_request, work)
        if output is None:
            return Response(status_code=499)
        decode = self.choice_decoder(req)
        choices = []
        num_completion_tokens = 0
        for j, seq in enumerate(output.sequences):
            generated = seq.tokens[len(token_ids) :]
            num_completion_tokens += len(generated)
            message, finish_reason = self._output(plan).final(decode(generated), seq.finish_reason)
            choices.append(
                ChatCompletionResponseChoice(
                    index=j,
                    message=ChatResponseMessage(role="assistant", **message),
                    finish_reason=finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        response = ChatCompletionResponse(
            id=request_id,
            model=self.response_model_name(req.model),
            choices=choices,
            usage=UsageInfo.of(len(token_ids), num_completion_tokens),
        )
        return JSONResponse(response.model_dump())

    def _output(self, plan: ToolPlan) -> ChatOutput:
        return ChatOutput(plan, self.reasoning_parser_cls, self.tool_parser_cls)

    async def _collect(
        self,
        request_id: str,
        num_prompt_tokens: int,
        stream: RequestStream,
        num_top: int | None,
        plan: ToolPlan,
    ) -> ChatCompletionResponse:
        final = None
        try:
            async for out in stream:
                final = out
        finally:
            stream.close()
        assert final is not None
        choices = []
        num_completion_tokens = 0
        for c in sorted(final.outputs, key=lambda c: c.index):
            num_completion_tokens += len(c.token_ids)
            logprobs = None
            if num_top is not None:
                logprobs = ChatChoiceLogprobs(
                    content=self.chat_logprobs(c.token_ids, c.logprobs or [], num_top)
                )
            message, finish_reason = self._output(plan).final(c.text, c.finish_reason)
            choices.append(
                ChatCompletionResponseChoice(
                    index=c.index,
                    message=ChatResponseMessage(role="assistant", **message),
                    logprobs=logprobs,
                    finish_reason=finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
        return ChatCompletionResponse(
            id=request_id,
            model=self.model_name,
            choices=choices,
            usage=UsageInfo.of(num_prompt_tokens, num_completion_tokens),
            kv_transfer_params=final.kv_transfer_params,
        )

    async def _stream(
        self,
        req: ChatCompletionRequest,
        request_id: str,
        num_prompt_tokens: int,
        stream: RequestStream,
        num_top: int | None,
        include_usage: bool,
        plan: ToolPlan,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        model = self.response_model_name(req.model)
        num_tokens = [0] * req.n
        outputs = [self._output(plan) for _ in range(req.n)]
        try:
            for index in range(req.n):
                yield sse(chat_chunk(request_id, created, model, index, {"role": "assistant", "content": ""}))
            async for out in stream:
                for c in out.outputs:
                    num_tokens[c.index] += len(c.token_ids)
                    if not c.text and not c.token_ids and c.finish_reason is None:
                        continue
                    logprobs: dict[str, Any] | None = None
                    if num_top is not None:
                        logprobs = {"content": self.chat_logprobs(c.token_ids, c.logprobs or [], num_top)}
                    delta = outputs[c.index].delta(c.text) if c.text else {}
                    finish_reason = c.finish_reason
                    if finish_reason is not None:
                        last, finish_reason = outputs[c.index].finish(finish_reason)
                        _merge_delta(delta, last)
                    if not delta and finish_reason is None and logprobs is None:
                        continue
                    if not delta and finish_reason is None:
                        delta = {"content": ""}
                    chunk = sse(
                        chat_chunk(
                            request_id,
                            created,
                            model,
                            c.index,
                            delta,
                            logprobs,
                            finish_reason,
                            c.stop_reason,
                        )
                    )
                    mark_first_output(stream)  # the chunk is written next
                    yield chunk
            if include_usage:
                usage = UsageInfo.of(num_prompt_tokens, sum(num_tokens))
                yield sse(usage_chunk(request_id, created, model, "chat.completion.chunk", usage))
            self.log_timelines([stream], streaming=True)
        except Exception as e:  # noqa: BLE001 - the status line is sent already: report in the stream
            err: OpenAIError = to_openai_error(e, self.field_map)
            yield sse(err.to_dict())
        finally:
            stream.close()
        yield SSE_DONE


_PARSERS_READING_SPECIAL_TOKENS = ("mistral", "llama3_json", "pythonic")


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message as chat templates expect it: a tool call's JSON ``arguments`` string becomes a dict."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    fixed = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                function = {**function, "arguments": json.loads(function["arguments"])}
            except json.JSONDecodeError:
                pass
            call = {**call, "function": function}
        fixed.append(call)
    return {**message, "tool_calls": fixed}


def _merge_delta(delta: dict[str, Any], more: dict[str, Any]) -> None:
    for key, value in more.items():
        if key == "tool_calls":
            delta.setdefault("tool_calls", []).extend(value)
        else:
            delta[key] = delta.get(key, "") + value
