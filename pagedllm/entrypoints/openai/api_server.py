"""`pagedllm serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of an ``AsyncLLM``.

Endpoints: /v1/models, /v1/completions, /v1/chat/completions, /v1/responses (and GET /v1/responses/{id}),
/tokenize, /detokenize, /health, /version, /metrics; for a pooling model /v1/embeddings, /pooling, /classify,
/score (/v1/score), /rerank (/v1/rerank, /v2/rerank) instead of the generation endpoints; with
``--enable-debug-endpoints`` /debug/integrity plus vLLM's development endpoints for RL rollout engines (/sleep,
/wake_up, /is_sleeping, /reset_prefix_cache, /collective_rpc); vLLM's ``VLLM_SERVER_DEV_MODE=1`` turns them on
too. Everything but /health, /version and /metrics
needs the API key when one is set (compared in constant time). Request bodies are bounded (``--max-request-body-bytes``) before any parsing.

Life cycle (``serve_cli``, the command's light entry point): the port is bound first (a busy port fails fast), then
the engine core process starts (model load, KV cache sizing) while this module and uvicorn are imported, then uvicorn
serves (:func:`run_server`). SIGTERM: stop accepting, let in-flight requests finish for up to
``--shutdown-timeout`` seconds (then abort them), stop the engine, exit 0. If the engine core process dies, in-flight
requests end with an error at once, /health answers 503, and the server exits with status 1 shortly after,
so a supervisor restarts it.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import logging
import os
import socket
import time
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedllm import __version__
from pagedllm.engine.core_process import EngineDeadError
from pagedllm.entrypoints.openai.errors import OpenAIError, bad_request, error_json_bytes, error_response
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ResponsesRequest,
    TokenizeRequest,
)
from pagedllm.entrypoints.openai.protocol_pooling import (
    ClassificationRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from pagedllm.entrypoints.openai.serve_cli import (  # noqa: F401 (the CLI's names, re-exported)
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    add_cli_args,
    load_chat_template,
    main,
)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_engine import parse_body, to_openai_error
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels, runtime_lora_updating_from_env
from pagedllm.entrypoints.openai.serving_responses import (
    DEFAULT_RESPONSES_STORE_SIZE,
    OpenAIServingResponses,
    ResponseStore,
)
from pagedllm.entrypoints.openai.serving_score import OpenAIServingScore

logger = logging.getLogger("pagedllm.server")

# After the engine dies, keep answering (503s) this long before exiting, so health checks see it.
ENGINE_DEAD_LINGER_S = 2.0
# Paths that never need the API key.
PUBLIC_PATHS = frozenset({"/health", "/ping", "/version", "/metrics", "/docs", "/redoc", "/openapi.json"})


# ------------------------------------------------------------------------------------------- middleware


async def _send_error(
    send: Send, err: OpenAIError, extra_headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    body = error_json_bytes(err)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send(
        {"type": "http.response.start", "status": err.status_code, "headers": headers + (extra_headers or [])}
    )
    await send({"type": "http.response.body", "body": body})


class ApiKeyMiddleware:
    """Refuse requests without ``Authorization: Bearer <key>`` (401), comparing digests in constant time."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._digest = hashlib.sha256(api_key.encode()).digest()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                given = value
                break
        prefix = b"Bearer "
        # Hash both sides so the comparison takes the same time whatever the given key's length.
        ok = given.startswith(prefix) and hmac.compare_digest(
            hashlib.sha256(given[len(prefix) :]).digest(), self._digest
        )
        if not ok:
            err = OpenAIError(
                "Missing or incorrect API key: pass it as 'Authorization: Bearer <key>'.",
                status_code=401,
                type="invalid_request_error",
                code="invalid_api_key",
            )
            await _send_error(send, err, [(b"www-authenticate", b"Bearer")])
            return
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """Read the whole request body before the app sees it; refuse bodies over ``max_bytes`` with a 400.

    The app then gets the body in one message and, after it, the real ``receive`` (for disconnects).
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = None
                break
        too_big = declared is not None and declared > self.max_bytes
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                too_big = True
            if not too_big:
                chunks.append(body)
            # Drain what the client still sends (up to a bound) so it can read the answer.
            if not message.get("more_body", False) or size > 4 * self.max_bytes + (1 << 20):
                break
        if too_big:
            err = bad_request(
                f"the request body is larger than this server's limit of {self.max_bytes} bytes "
                "(--max-request-body-bytes)",
                "body",
            )
            await _send_error(send, err, [(b"connection", b"close")])
            return
        buffered: Message | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay() -> Message:
            nonlocal buffered
            if buffered is not None:
                message, buffered = buffered, None
                return message
            return await receive()

        await self.app(scope, replay, send)


# ------------------------------------------------------------------------------------------------ app


def build_app(
    engine: Any,
    *,
    served_model_names: list[str],
    api_key: str | None = None,
    max_logprobs: int = 20,
    chat_template: str | None = None,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    metrics: Any = None,
    enable_debug_endpoints: bool = False,
    enable_auto_tool_choice: bool = False,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    models: OpenAIServingModels | None = None,
    allow_runtime_lora_updating: bool = False,
    responses_store_size: int = DEFAULT_RESPONSES_STORE_SIZE,
) -> FastAPI:
    """The FastAPI app for ``engine`` (an ``AsyncLLM``); ``metrics`` is a ``PrometheusStatLogger`` or None.

    ``models``: the base names and LoRA adapters a request's ``model`` may name (default: the served names);
    ``allow_runtime_lora_updating`` adds ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.

    ``enable_debug_endpoints`` adds ``GET /debug/integrity`` (behind the API key like /v1): the engine's full
    integrity check and its request-table sizes, for soak tests and operators chasing a leak; and the rollout
    endpoints of ``_add_rollout_endpoints`` (sleep mode, prefix-cache reset, collective_rpc).

    ``responses_store_size``: how many stored /v1/responses results are kept (least recently used dropped first).
    """
    app = FastAPI(title="pagedllm", version=__version__)
    if models is None:
        models = OpenAIServingModels(engine, served_model_names)
    serving_kwargs = dict(
        models=models,
        max_logprobs=max_logprobs,
        chat_template=chat_template,
        enable_auto_tool_choice=enable_auto_tool_choice,
        tool_call_parser=tool_call_parser,
        reasoning_parser=reasoning_parser,
    )
    completion = OpenAIServingCompletion(engine, served_model_names, **serving_kwargs)
    chat = OpenAIServingChat(engine, served_model_names, **serving_kwargs)
    responses = OpenAIServingResponses(chat, ResponseStore(responses_store_size))
    pooling = OpenAIServingScore(engine, served_model_names, models=models)
    model_config = engine.model_config
    is_pooling = getattr(model_config, "runner_type", "generate") == "pooling"

    def check_generates(endpoint: str) -> None:
        if is_pooling:
            raise bad_request(
                f"{endpoint} generates text, but this server's model is a pooling model (embeddings, "
                "classification or scoring): use /v1/embeddings, /pooling, /classify, /score or /rerank",
                "model",
            )

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> Response:
        return error_response(exc)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, exc: EngineDeadError) -> Response:
        return error_response(to_openai_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(OpenAIError(str(exc.detail), status_code=exc.status_code, type=kind))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> Response:
        return error_response(bad_request(str(exc)))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> Response:
        logger.exception("unhandled error")
        return error_response(to_openai_error(exc))

    @app.get("/health")
    async def health() -> Response:
        if engine.errored:
            return error_response(
                to_openai_error(engine.dead_error or EngineDeadError("the engine is not running"))
            )
        return Response(status_code=200)

    @app.get("/ping")
    async def ping() -> Response:
        return await health()

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse(models.model_list(model_config.model, model_config.max_model_len).model_dump())

    if allow_runtime_lora_updating:

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(raw_request: Request) -> Response:
            body = _json_object(await raw_request.body())
            lora = await models.load_lora_adapter(body.get("lora_name"), body.get("lora_path"))
            message = f"Success: LoRA adapter '{lora.lora_name}' added successfully."
            return Response(message, media_type="text/plain")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(raw_request: Request) -> Response:
            body = _json_object(await raw_request.body())
            name = body.get("lora_name")
            await models.unload_lora_adapter(name)
            message = f"Success: LoRA adapter '{name}' removed successfully."
            return Response(message, media_type="text/plain")

    @app.get("/metrics")
    async def get_metrics() -> Response:
        if metrics is None:
            return Response(status_code=404)
        if not engine.errored:
            try:
                metrics.record_scheduler_stats(await asyncio.wait_for(engine.get_stats(), 2.0))
            except (asyncio.TimeoutError, EngineDeadError):
                pass  # the last stats the engine pushed are still there
        cache = getattr(getattr(engine, "input_processor", None), "processor_cache", None)
        if cache is not None:
            metrics.record_mm_cache(cache.queries, cache.hits)
        from pagedllm.metrics import CONTENT_TYPE

        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/completions", openapi_extra=_body_schema(CompletionRequest))
    async def create_completion(raw_request: Request) -> Response:
        arrival_time = time.monotonic()
        req = parse_body(await raw_request.body(), CompletionRequest)
        check_generates("/v1/completions")
        return await completion.create_completion(req, raw_request, arrival_time)

    @app.post("/v1/chat/completions", openapi_extra=_body_schema(ChatCompletionRequest))
    async def create_chat_completion(raw_request: Request) -> Response:
        arrival_time = time.monotonic()
        req = parse_body(await raw_request.body(), ChatCompletionRequest)
        check_generates("/v1/chat/completions")
        return await chat.create_chat_completion(req, raw_request, arrival_time)

    @app.post("/v1/responses", openapi_extra=_body_schema(ResponsesRequest))
    async def create_response(raw_request: Request) -> Response:
        arrival_time = time.monotonic()
        req = parse_body(await raw_request.body(), ResponsesRequest)
        return await responses.create_response(req, raw_request, arrival_time)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> JSONResponse:
        return JSONResponse(responses.retrieve(response_id))
    @app.post("/v1/embeddings", openapi_extra=_body_schema(EmbeddingRequest))
    async def create_embedding(raw_request: Request) -> Response:
        req = parse_body(await raw_request.body(), EmbeddingRequest)
        return await pooling.create_embedding(req, raw_request)

    @app.post("/pooling", openapi_extra=_body_schema(PoolingRequest))
    async def create_pooling(raw_request: Request) -> Response:
        req = parse_body(await raw_request.body(), PoolingRequest)
        return await pooling.create_pooling(req, raw_request)

    @app.post("/classify", openapi_extra=_body_schema(ClassificationRequest))
    async def create_classify(raw_request: Request) -> Response:
        req = parse_body(await raw_request.body(), ClassificationRequest)
        return await pooling.create_classify(req, raw_request)

    async def create_score(raw_request: Request) -> Response:
        req = parse_body(await raw_request.body(), ScoreRequest)
        return await pooling.create_score(req, raw_request)

    async def create_rerank(raw_request: Request) -> Response:
        req = parse_body(await raw_request.body(), RerankRequest)
        return await pooling.create_rerank(req, raw_request)

    for path in ("/score", "/v1/score"):
        app.add_api_route(path, create_score, methods=["POST"], openapi_extra=_body_schema(ScoreRequest))
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.add_api_route(path, create_rerank, methods=["POST"], openapi_extra=_body_schema(RerankRequest))

    @app.post("/tokenize", openapi_extra=_body_schema(TokenizeRequest))
    async def tokenize(raw_request: Request) -> JSONResponse:
        req = parse_body(await raw_request.body(), TokenizeRequest)
        completion.check_model(req.model)
        if req.messages is not None and req.prompt is not None:
            raise bad_request("give either prompt or messages, not both", "messages")
        if req.messages is not None:
            if not req.messages:
                raise bad_request("messages must not be empty", "messages")
            _, token_ids = chat.render_prompt(req.messages, req.add_generation_prompt is not False)
        elif req.prompt is not None:
            token_ids = engine.input_processor.tokenize(
                req.prompt, add_special_tokens=req.add_special_tokens is not False
            )
        else:
            raise bad_request("prompt (or messages) is required", "prompt")
        return JSONResponse(
            {"count": len(token_ids), "max_model_len": completion.max_model_len, "tokens": token_ids}
        )

    @app.post("/detokenize", openapi_extra=_body_schema(DetokenizeRequest))
    async def detokenize(raw_request: Request) -> JSONResponse:
        req = parse_body(await raw_request.body(), DetokenizeRequest)
        completion.check_model(req.model)
        if req.tokens:
            completion.check_token_ids(req.tokens, "tokens")
        return JSONResponse({"prompt": engine.tokenizer.decode(req.tokens)})

    if enable_debug_endpoints:

        @app.get("/debug/integrity")
        async def debug_integrity() -> JSONResponse:
            """200 with ``ok`` true/false and the engine's tables; 503 if the engine is dead."""
            error = None
            try:
                await asyncio.wait_for(engine.check_integrity(), 30.0)
            except AssertionError as e:
                error = f"AssertionError: {e}"
            state = await asyncio.wait_for(engine.debug_state(), 30.0)
            return JSONResponse({"ok": error is None, "error": error, **state})

        _add_rollout_endpoints(app, engine)

    _install_openapi_schemas(
        app,
        [
            CompletionRequest,
            ChatCompletionRequest,
            ResponsesRequest,
            TokenizeRequest,
            DetokenizeRequest,
            EmbeddingRequest,
            PoolingRequest,
            ClassificationRequest,
            ScoreRequest,
            RerankRequest,
        ],
    )
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_request_body_bytes)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    return app


SERVER_DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"  # vLLM's switch for the same endpoints


def server_dev_mode_from_env() -> bool:
    """``VLLM_SERVER_DEV_MODE=1``: the development endpoints, as ``--enable-debug-endpoints``."""
    return os.environ.get(SERVER_DEV_MODE_ENV, "").strip().lower() in ("1", "true", "yes")


async def _engine_call(call: Any, param: str | None = None) -> Any:
    """Await an engine call for the development endpoints: ``ValueError`` is a 400 naming ``param``, any other
    refusal (``RuntimeError``: requests still running, weights asleep) a 409."""
    try:
        return await call
    except EngineDeadError:
        raise
    except ValueError as e:
        raise bad_request(str(e), param) from None
    except RuntimeError as e:
        raise OpenAIError(str(e), status_code=409, type="conflict_error") from None


def _add_rollout_endpoints(app: FastAPI, engine: Any) -> None:
    """vLLM's development endpoints for RL rollout engines (``--enable-debug-endpoints`` here, as vLLM's
    ``VLLM_SERVER_DEV_MODE=1``): ``POST /sleep?level=1|2``, ``POST /wake_up[?tags=weights&tags=kv_cache]``,
    ``GET /is_sleeping``, ``POST /reset_prefix_cache`` and ``POST /collective_rpc`` with
    ``{"method": name, "args": [...], "kwargs": {...}}`` (JSON in and out)."""

    @app.post("/sleep")
    async def sleep(raw_request: Request) -> Response:
        level_text = raw_request.query_params.get("level", "1")
        try:
            level = int(level_text)
        except ValueError:
            raise bad_request(f"level must be an integer, got {level_text!r}", "level") from None
        await _engine_call(engine.sleep(level), "level")
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up(raw_request: Request) -> Response:
        tags = raw_request.query_params.getlist("tags") or None
        await _engine_call(engine.wake_up(tags), "tags")
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping() -> JSONResponse:
        return JSONResponse({"is_sleeping": await engine.is_sleeping()})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        if not await engine.reset_prefix_cache():
            raise OpenAIError("requests still hold cached blocks", status_code=409, type="conflict_error")
        return Response(status_code=200)

    @app.post("/collective_rpc")
    async def collective_rpc(raw_request: Request) -> JSONResponse:
        body = _json_object(await raw_request.body())
        method = body.get("method")
        if not isinstance(method, str) or not method:
            raise bad_request("method (a worker method name) is required", "method")
        args, kwargs = body.get("args") or [], body.get("kwargs") or {}
        if not isinstance(args, list) or not isinstance(kwargs, dict):
            raise bad_request("args must be a list and kwargs an object", "args")
        results = await _engine_call(engine.collective_rpc(method, tuple(args), kwargs), "method")
        return JSONResponse({"results": results})


def _json_object(body: bytes) -> dict[str, Any]:
    import json

    try:
        data = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(data).__name__}")
    return data


def _body_schema(model_cls: type) -> dict[str, Any]:
    """OpenAPI request body for a route that parses its body by hand (to control error messages)."""
    ref = {"$ref": f"#/components/schemas/{model_cls.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def _install_openapi_schemas(app: FastAPI, models: list[type]) -> None:
    original = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = original()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model_cls in models:
            model_schema = model_cls.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(model_schema.pop("$defs", {}))
            components[model_cls.__name__] = model_schema
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


# ------------------------------------------------------------------------------------- serving


async def run_server(
    engine: Any,
    args: argparse.Namespace,
    config: Any,
    sock: socket.socket,
    *,
    metrics: Any,
    served_model_names: list[str],
    api_key: str | None,
    chat_template: str | None,
) -> int:
    """Serve ``engine`` (an ``AsyncLLM``, started by ``serve_cli``) on the bound ``sock`` until shutdown; the exit
    status. The caller shuts the engine down."""
    import uvicorn

    watchdog = None
    try:
        models = OpenAIServingModels(engine, served_model_names)
        for name, path in getattr(args, "lora_modules", None) or []:
            try:
                await models.load_lora_adapter(name, path)
            except OpenAIError as e:
                raise ValueError(f"--lora-modules {name}={path}: {e.message}") from None
            logger.info("LoRA adapter %s loaded from %s", name, path)
        app = build_app(
            engine,
            served_model_names=served_model_names,
            api_key=api_key,
            max_logprobs=args.max_logprobs,
            chat_template=chat_template,
            max_request_body_bytes=args.max_request_body_bytes,
            metrics=metrics,
            enable_debug_endpoints=args.enable_debug_endpoints or server_dev_mode_from_env(),
            enable_auto_tool_choice=args.enable_auto_tool_choice,
            tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser,
            models=models,
            allow_runtime_lora_updating=args.allow_runtime_lora_updating or runtime_lora_updating_from_env(),
            responses_store_size=args.responses_store_size,
        )
        uv_config = uvicorn.Config(
            app,
            log_level=args.uvicorn_log_level,
            timeout_graceful_shutdown=args.shutdown_timeout,
            lifespan="off",
        )
        server = uvicorn.Server(uv_config)
        exit_code = 0

        async def watch_engine() -> None:
            nonlocal exit_code
            err = await engine.wait_until_dead()
            if not engine.errored:
                return  # a normal shutdown
            logger.error("%s; the server exits in %.0f s", err, ENGINE_DEAD_LINGER_S)
            exit_code = 1
            await asyncio.sleep(ENGINE_DEAD_LINGER_S)
            server.should_exit = True

        watchdog = asyncio.create_task(watch_engine())
        info = engine.kv_cache_info
        host, port = sock.getsockname()[:2]
        if config.model_config.runner_type != "pooling":  # a pooling model keeps no KV cache
            print(
                f"pagedllm: KV cache: {info.get('num_blocks')} blocks of {info.get('block_size')} tokens "
                f"({info.get('num_tokens')} tokens); maximum concurrency for "
                f"{config.model_config.max_model_len}-token requests: {info.get('max_concurrency', 0):.2f}x",
                flush=True,
            )
        else:
            pooling_type = config.model_config.pooler_config.pooling_type
            print(f"pagedllm: pooling model ({pooling_type} pooling), no KV cache", flush=True)
        print(
            f"pagedllm: serving {', '.join(served_model_names)} on http://{host}:{port}"
            f"{' (API key required)' if api_key else ''} (engine core pid {engine.engine_core.pid})",
            flush=True,
        )
        await server.serve(sockets=[sock])
        return exit_code
    finally:
        if watchdog is not None:
            watchdog.cancel()
