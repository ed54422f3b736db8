"""Request and response schemas of the OpenAI-compatible API (the subset pagedllm serves, plus vLLM's extras).

Requests are pydantic models: unknown fields are accepted and ignored (clients send vendor fields), wrong types
and missing fields fail validation, which the server turns into a 400 naming the field. Range checks that need
the model (context length, vocabulary, logprobs cap) happen in ``serving_*``; ``SamplingParams`` checks the rest.

Responses are pydantic models too; streamed chunks are plain dicts built by the ``*_chunk`` helpers below,
because OpenAI's chunk shapes omit some keys (a chat delta carries ``role`` only in its first chunk).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedllm.beam_search import BeamSearchParams, beam_search_eos_ids, beam_search_num_logprobs
from pagedllm.entrypoints.openai.errors import bad_request, from_value_error

if TYPE_CHECKING:
    from pagedllm.engine.input_processor import InputProcessor

# ---------------------------------------------------------------------------------------------- requests


class OpenAIBaseModel(BaseModel):
    # Unknown fields are ignored, as vLLM and OpenAI do.
    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False


class JsonSchemaFormat(OpenAIBaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(OpenAIBaseModel):
    """Fields shared by completions and chat completions (OpenAI's, then vLLM's extensions)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = False
    min_tokens: int | None = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    spaces_between_special_tokens: bool | None = True
    # Beam search (vLLM's): ``n`` is the beam width; the n best sequences come back, best first.
    use_beam_search: bool | None = False
    length_penalty: float | None = 1.0
    # Output constraints: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields.
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Disaggregated prefill/decode (vLLM's): {"do_remote_decode": true} to a prefill instance; the handle its
    # response returns, to the decode instance.
    kv_transfer_params: dict[str, Any] | None = None

    def to_beam_search_params(self, max_tokens: int, ip: InputProcessor) -> BeamSearchParams:
        """``BeamSearchParams`` for ``use_beam_search`` (``n`` is the beam width). A field beam search cannot
        honor (streaming, sampling, stop sequences, constraints) is a 400 naming it, not silently ignored."""
        if self.stream:
            raise bad_request("stream is not supported with use_beam_search", "stream")
        if self.temperature not in (None, 0):
            raise bad_request(
                f"temperature must be 0 with use_beam_search (it ranks by the model's log-probabilities), "
                f"got {self.temperature}",
                "temperature",
            )
        logprobs = getattr(self, "logprobs", None)
        if logprobs is not None and logprobs is not False:  # completions: any number (0 too); chat: true
            raise bad_request("logprobs is not supported with use_beam_search", "logprobs")
        for name, neutral in _BEAM_SEARCH_NEUTRAL.items():
            value = getattr(self, name, None)
            if value is not None and value not in neutral:
                raise bad_request(f"{name} is not supported with use_beam_search", name)
        rf = self.response_format
        if rf is not None and rf.type != "text":
            raise bad_request("response_format is not supported with use_beam_search", "response_format")
        length_penalty = 1.0 if self.length_penalty is None else self.length_penalty
        try:
            params = BeamSearchParams(
                beam_width=self.n,
                max_tokens=max_tokens,
                ignore_eos=bool(self.ignore_eos),
                length_penalty=length_penalty,
                include_stop_str_in_output=bool(self.include_stop_str_in_output),
            )
        except ValueError as e:
            raise from_value_error(
                e, {"beam_width": "n", "max_tokens": None, "length_penalty": "length_penalty"}
            ) from None
        num_logprobs = beam_search_num_logprobs(self.n, beam_search_eos_ids(ip, params))
        if num_logprobs > ip.max_logprobs:
            raise bad_request(
                f"n (the beam width) {self.n} needs {num_logprobs} logprobs per step, more than this server's "
                f"max_logprobs ({ip.max_logprobs})",
                "n",
            )
        return params


# Fields beam search leaves alone: unset, or one of these values (which change nothing), else a 400.
_BEAM_SEARCH_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "top_p": (1.0,),
    "top_k": (0, -1),
    "min_p": (0.0,),
    "presence_penalty": (0.0,),
    "frequency_penalty": (0.0,),
    "repetition_penalty": (1.0,),
    "min_tokens": (0,),
    "stop": ([],),
    "stop_token_ids": ([],),
    "logit_bias": ({},),
    "structured_outputs": (),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "echo": (False,),
    "top_logprobs": (),
    "tools": ([],),
}


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


class TextContentPart(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class ImageURL(OpenAIBaseModel):
    url: str  # data:image/...;base64,..., http(s)://..., or file://... (under --allowed-local-media-path)
    detail: str | None = None  # accepted, not used


class ImageURLContentPart(OpenAIBaseModel):
    type: Literal["image_url"]
    image_url: ImageURL


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[TextContentPart | ImageURLContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls, sent back with the results
    reasoning_content: str | None = None


class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favor of max_completion_tokens; both work
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = True
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables (enable_thinking...)


class ResponsesTextFormat(OpenAIBaseModel):
    """``text.format`` of a Responses request: plain text, any JSON object, or JSON for a schema."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponsesTextConfig(OpenAIBaseModel):
    format: ResponsesTextFormat | None = None


class ResponsesRequest(OpenAIBaseModel):
    """POST /v1/responses (OpenAI's Responses API). ``input`` items and ``tools`` are checked item by item by
    ``serving_responses``, so that a 400 names the item (``input[1].content``, ``tools[0].type``)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    text: ResponsesTextConfig | None = None
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # vLLM extensions (sampling), as in chat completions
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None


class TokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = True
    add_generation_prompt: bool | None = True


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


# --------------------------------------------------------------------------------------------- responses


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        """Usage with ``total_tokens`` derived, so no caller can get the sum wrong."""
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a prefill instance's handle for the decode one


class ChatTopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(OpenAIBaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a prefill instance's handle for the decode one


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ------------------------------------------------------------------------------------------ stream chunks


def completion_chunk(
    request_id: str,
    created: int,
    model: str,
    index: int,
    text: str,
    logprobs: dict[str, Any] | None,
    finish_reason: str | None,
    stop_reason: int | str | None,
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
            }
        ],
    }


def chat_chunk(
    request_id: str,
    created: int,
    model: str,
    index: int,
    delta: dict[str, Any],
    logprobs: dict[str, Any] | None = None,
    finish_reason: str | None = None,
    stop_reason: int | str | None = None,
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": index,
        "delta": delta,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    return {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def usage_chunk(request_id: str, created: int, model: str, obj: str, usage: UsageInfo) -> dict[str, Any]:
    """The last chunk when ``stream_options.include_usage`` is set: no choices, the request's usage."""
    return {
        "id": request_id,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage.model_dump(),
    }
