"""Pooling endpoints: /v1/embeddings (OpenAI's shape), /pooling (the raw pooled output) and /classify.

Each input of a request becomes one pooling request (``AsyncLLM.encode``), all in flight at once; the engine
batches them under its token budget. A client that disconnects aborts them. Every bad input is a 400 in OpenAI's
error shape naming the field: empty input, a mix of strings and token ids, a prompt over the context (unless
``truncate_prompt_tokens`` asks to cut it), ``dimensions`` on a model without Matryoshka support, an embeddings
request to a model that generates text or to a classifier.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.errors import OpenAIError, bad_request
from pagedllm.entrypoints.openai.protocol_pooling import (
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingData,
    PoolingRequest,
    PoolingResponse,
    PoolingUsage,
)
from pagedllm.entrypoints.openai.serving_engine import OpenAIServing, new_request_id, wait_or_disconnect
from pagedllm.outputs import PoolingRequestOutput
from pagedllm.pooling.params import PoolingParams

# Leading names of the engine's ValueError messages -> the request field to blame.
_PARAM_OF = {
    "dimensions": "dimensions",
    "truncate_prompt_tokens": "truncate_prompt_tokens",
    "normalize": "normalize",
    "prompt_token_ids": "input",
    "prompt": "input",
}


def parse_inputs(value: Any, param: str = "input") -> list[str | list[int]]:
    """``input`` as a list of prompts: a string, a list of strings, one list of token ids, or a list of token-id
    lists. 400 naming ``param`` when it is missing, empty, of another type, or mixes strings and token ids."""
    shape = "a string, a list of strings, a list of token ids or a list of token-id lists"
    if value is None:
        raise bad_request(f"{param} is required", param)
    if isinstance(value, str):
        if not value:
            raise bad_request(f"{param} must not be empty", param)
        return [value]
    if not isinstance(value, list):
        raise bad_request(f"{param} must be {shape}, got {type(value).__name__}", param)
    if not value:
        raise bad_request(f"{param} must not be empty", param)
    kinds = {
        "str"
        if isinstance(x, str)
        else "ids"
        if isinstance(x, list)
        else "int"
        if isinstance(x, int) and not isinstance(x, bool)
        else "other"
        for x in value
    }
    if "other" in kinds:
        raise bad_request(f"{param} must be {shape}", param)
    if len(kinds) > 1:
        raise bad_request(f"{param} mixes strings and token ids in one batch; send {shape}, not a mix", param)
    kind = kinds.pop()
    if kind == "int":
        return [value]
    for i, item in enumerate(value):
        if kind == "str" and not item:
            raise bad_request(f"{param}[{i}] must not be empty", param)
        if kind == "ids" and (
            not item or not all(isinstance(t, int) and not isinstance(t, bool) for t in item)
        ):
            raise bad_request(f"{param}[{i}] must be a non-empty list of token ids", param)
    return list(value)


def encode_vector(values: Any, encoding_format: str) -> list[float] | str:
    """A float list, or its little-endian float32 bytes in base64 (OpenAI's ``encoding_format``)."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode("ascii")
    return values.tolist() if hasattr(values, "tolist") else list(values)


def _value_error(e: ValueError, default_param: str) -> OpenAIError:
    message = str(e)
    for name, param in _PARAM_OF.items():
        if message.startswith(name):
            return bad_request(message, param)
    return bad_request(message, default_param)


class OpenAIServingPooling(OpenAIServing):
    """What the pooling endpoints share: the model checks, running a batch of inputs, usage."""

    engine: AsyncLLM

    def check_pooling(self, model: str | None, endpoint: str) -> Any:
        """The engine's ``PoolerConfig``; 400 naming ``model`` when this server's model has no pooling output."""
        if self.check_model(model) is not None:
            raise bad_request(f"{endpoint} does not take LoRA adapters", "model")
        self.check_engine()
        pooler = self.engine.model_config.pooler_config
        if pooler is None:
            raise bad_request(
                f"{endpoint} needs a pooling model (embedding, classification or scoring); this server's model "
                "generates text (serve a pooling model, or start it with --runner pooling)",
                "model",
            )
        return pooler

    async def run_batch(
        self,
        raw_request: Request,
        prompts: list[Any],
        params: PoolingParams,
        request_id: str,
        pairs: list[str] | None = None,
        param: str = "input",
    ) -> list[PoolingRequestOutput] | None:
        """Encode every prompt (with ``pairs[i]`` as its second text); None when the client went away."""

        processed = []  # every input checked before any is queued
        for i, prompt in enumerate(prompts):
            try:
                pair = pairs[i] if pairs is not None else None
                processed.append(self.engine.process_pooling(prompt, params, f"{request_id}-{i}", pair))
            except ValueError as e:
                raise _value_error(e, param) from None

        async def one(i: int) -> PoolingRequestOutput:
            try:
                return await self.engine.encode_processed(*processed[i])
            except ValueError as e:  # refused by the engine core
                raise _value_error(e, param) from None

        async def run_all() -> list[PoolingRequestOutput]:
            tasks = [asyncio.ensure_future(one(i)) for i in range(len(processed))]
            try:
                return list(await asyncio.gather(*tasks))
            finally:
                for task in tasks:
                    task.cancel()

        return await wait_or_disconnect(raw_request, run_all())

    @staticmethod
    def usage(outs: list[PoolingRequestOutput]) -> PoolingUsage:
        num = sum(len(o.prompt_token_ids) for o in outs)
        return PoolingUsage(prompt_tokens=num, total_tokens=num)

    @staticmethod
    def params(req: Any, task: str, **kwargs: Any) -> PoolingParams:
        try:
            return PoolingParams(truncate_prompt_tokens=req.truncate_prompt_tokens, task=task, **kwargs)
        except ValueError as e:
            raise _value_error(e, "input") from None

    async def create_embedding(self, req: EmbeddingRequest, raw_request: Request) -> Response:
        pooler = self.check_pooling(req.model, "/v1/embeddings")
        if pooler.is_classifier:
            raise bad_request(
                "this model is a classifier: it has no embeddings; use /classify, /score or /rerank", "model"
            )
        prompts = parse_inputs(req.input)
        params = self.params(req, "embed", dimensions=req.dimensions, normalize=req.normalize)
        request_id = new_request_id("embd")
        outs = await self.run_batch(raw_request, prompts, params, request_id)
        if outs is None:
            return Response(status_code=499)
        data = [
            EmbeddingData(index=i, embedding=encode_vector(o.outputs.data.numpy(), req.encoding_format))
            for i, o in enumerate(outs)
        ]
        resp = EmbeddingResponse(
            id=request_id, model=self.response_model_name(req.model), data=data, usage=self.usage(outs)
        )
        return JSONResponse(resp.model_dump())

    async def create_pooling(self, req: PoolingRequest, raw_request: Request) -> Response:
        self.check_pooling(req.model, "/pooling")
        prompts = parse_inputs(req.input)
        params = self.params(req, "encode")
        request_id = new_request_id("pool")
        outs = await self.run_batch(raw_request, prompts, params, request_id)
        if outs is None:
            return Response(status_code=499)
        data = [
            PoolingData(index=i, data=encode_vector(o.outputs.data.numpy(), req.encoding_format))
            for i, o in enumerate(outs)
        ]
        resp = PoolingResponse(
            id=request_id, model=self.response_model_name(req.model), data=data, usage=self.usage(outs)
        )
        return JSONResponse(resp.model_dump())

    async def create_classify(self, req: ClassificationRequest, raw_request: Request) -> Response:
        pooler = self.check_pooling(req.model, "/classify")
        if not pooler.is_classifier:
            raise bad_request("this model has no classification head: use /v1/embeddings", "model")
        prompts = parse_inputs(req.input)
        params = self.params(req, "classify")
        request_id = new_request_id("classify")
        outs = await self.run_batch(raw_request, prompts, params, request_id)
        if outs is None:
            return Response(status_code=499)
        id2label = getattr(self.engine.model_config.hf_config, "id2label", None) or {}
        data = []
        for i, o in enumerate(outs):
            probs = o.outputs.data.tolist()
            best = int(np.argmax(probs))
            label = id2label.get(best, id2label.get(str(best)))
            data.append(ClassificationData(index=i, label=label, probs=probs, num_classes=len(probs)))
        resp = ClassificationResponse(
            id=request_id, model=self.response_model_name(req.model), data=data, usage=self.usage(outs)
        )
        return JSONResponse(resp.model_dump())
