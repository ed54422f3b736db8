"""`pagedllm serve`'s entry point: the flags, their checks, the engine config, then the server.

Kept free of FastAPI, uvicorn and the OpenAI protocol models: the engine core process gets its config as soon as it
is built (or, when an earlier start with the same inputs kept one, as soon as the flags are checked: see
``_launch_and_configure``), and those modules (``api_server``) are imported while it loads the model and sizes its
KV cache (``AsyncLLM(while_starting=...)``), instead of before. The core process itself was started at the
command's first line (``core_launch.prespawn``) and imported the engine meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import pickle
import signal
import socket
from collections.abc import Coroutine
from typing import Any

from pagedllm.engine import core_launch
from pagedllm.engine.arg_utils import add_engine_args, engine_kwargs_from_args, resolve_model_arg
from pagedllm.entrypoints.config_file import add_config_arg

logger = logging.getLogger("pagedllm.server")

DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024


def parse_lora_modules(values: list[str] | None) -> list[tuple[str, str]]:
    """``--lora-modules``: ``name=path`` items, or JSON objects ``{"name": ..., "path": ...}`` (vLLM's forms)."""
    out: list[tuple[str, str]] = []
    for value in values or []:
        if value.lstrip().startswith("{"):
            try:
                obj = json.loads(value)
                name, path = obj["name"], obj["path"]
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(
                    f"--lora-modules: {value!r} is not a JSON object with name and path ({e})"
                ) from None
        else:
            name, sep, path = value.partition("=")
            if not sep:
                raise ValueError(f"--lora-modules: {value!r} must be name=path")
        if not name or not path:
            raise ValueError(f"--lora-modules: {value!r} needs a non-empty name and path")
        out.append((name, path))
    return out


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser, model_positional=True)
    add_config_arg(parser)
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 exposes the server)")
    group.add_argument("--port", type=int, default=8000)
    group.add_argument("--api-key", default=None, help="require this key (default: env PAGEDLLM_API_KEY)")
    group.add_argument("--served-model-name", nargs="+", default=None, help="model name(s) clients use")
    group.add_argument(
        "--chat-template", default=None, help="a Jinja chat template: a file path or the template"
    )
    group.add_argument("--disable-log-requests", action="store_true")
    group.add_argument(
        "--disable-log-stats", action="store_true", help="no periodic throughput / spec-decode log"
    )
    group.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
    )
    group.add_argument(
        "--max-logprobs", type=int, default=20, help="largest logprobs / top_logprobs accepted"
    )
    group.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES)
    group.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model decide when to call tools (tool_choice "auto"); needs --tool-call-parser',
    )
    group.add_argument(
        "--tool-call-parser",
        default=None,
        choices=["hermes", "llama3_json", "mistral", "pythonic"],
        help="the format the model writes tool calls in (Qwen2.5/Qwen3/Hermes: hermes)",
    )
    group.add_argument(
        "--enable-debug-endpoints",
        action="store_true",
        help="serve GET /debug/integrity (the engine's integrity check and request tables; for tests) and vLLM's "
        "development endpoints for RL rollouts: /sleep, /wake_up, /is_sleeping, /reset_prefix_cache, /collective_rpc",
    )
    group.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        help="LoRA adapters to serve (needs --enable-lora): name=path, or JSON with name and path; a "
        "request's model field selects one by name",
    )
    group.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (also: env "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)",
    )
    group.add_argument(
        "--responses-store-size",
        type=int,
        default=1000,
        help="/v1/responses results kept in memory for previous_response_id and retrieval (least recently used "
        "dropped first; 0 keeps none)",
    )
    group.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds in-flight requests may take to finish before they are aborted",
    )


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a path to a file holding the template, or the template itself."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:
        raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")
    return value


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


def run_event_loop(main: Coroutine[Any, Any, int]) -> int:
    """Run the server's coroutine on uvloop when it is installed (a faster event loop: the front end parses every
    request and writes every stream chunk on it), else on asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def _raise_system_exit(signum: int, frame: Any) -> None:
    # Outside uvicorn's own handling (during start-up, and when uvicorn re-raises SIGTERM after its graceful
    # shutdown) SIGTERM ends the process with status 0; `finally` blocks stop the engine core.
    raise SystemExit(0)


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    logger.info("pagedllm serve: arguments parsed")
    api_key = args.api_key or os.environ.get("PAGEDLLM_API_KEY") or None
    try:
        model = resolve_model_arg(args)
        served_model_names = list(args.served_model_name or [model])
        chat_template = load_chat_template(args.chat_template)
        if args.max_logprobs < 0:
            raise ValueError(f"--max-logprobs must be >= 0, got {args.max_logprobs}")
        if args.enable_auto_tool_choice and not args.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        args.lora_modules = parse_lora_modules(args.lora_modules)
        if args.lora_modules and not args.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        if args.responses_store_size < 0:
            raise ValueError(f"--responses-store-size must be >= 0, got {args.responses_store_size}")
        if args.max_request_body_bytes < 1024:
            raise ValueError(
                f"--max-request-body-bytes must be at least 1024, got {args.max_request_body_bytes}"
            )
        kwargs = engine_kwargs_from_args(args)
        kwargs["served_model_name"] = served_model_names[0]
        kwargs["usage_context"] = "api_server"
    except ValueError as e:
        print(f"pagedllm serve: error: {e}", flush=True)
        return 2
    try:
        sock = _bind(args.host, args.port)
    except OSError as e:
        print(f"pagedllm serve: error: cannot listen on {args.host}:{args.port}: {e}", flush=True)
        return 1
    launched: core_launch.LaunchedCore | None = None
    try:
        launched, config = _launch_and_configure(model, kwargs, args.max_logprobs)
        if config is None:
            return 2
        signal.signal(signal.SIGTERM, _raise_system_exit)
        if launched is None and config.data_parallel_size == 1:
            # One engine core: launched now, so that it loads the model while this process imports the engine
            # client, the tokenizer and the server.
            launched = core_launch.launch(config)
        return run_event_loop(
            _serve(
                args,
                config,
                sock,
                served_model_names=served_model_names,
                api_key=api_key,
                chat_template=chat_template,
                launched=launched,
            )
        )
    except KeyboardInterrupt:
        return 0
    except (ValueError, RuntimeError) as e:  # the engine failed to start
        print(f"pagedllm serve: error: {e}", flush=True)
        return 1
    finally:
        sock.close()
        if launched is not None:
            launched.discard()  # when the engine never adopted it


def _launch_and_configure(
    model: str, kwargs: dict[str, Any], max_logprobs: int
) -> tuple[core_launch.LaunchedCore | None, Any]:
    """Build the engine config (None after printing a refused flag), and launch the engine core with the config
    an earlier start with the same inputs kept, if any, before building it (``core_launch``'s config cache): the
    core then loads the model while this process imports transformers. A kept config that differs from the one
    built here is replaced, and its core discarded; the caller launches one when none is returned."""
    key = None
    if kwargs.get("data_parallel_size", 1) == 1:
        key = core_launch.config_cache_key(model, kwargs, {"max_logprobs": max_logprobs})
    kept = core_launch.load_cached_config(key) if key is not None else None
    launched = None
    if kept is not None:
        try:
            kept_config = pickle.loads(kept)
        except Exception as e:  # noqa: BLE001 - an unreadable kept config only costs the early launch
            logger.warning("pagedllm serve: the kept engine config is unreadable (%r); building it", e)
        else:
            launched = core_launch.launch(kept_config)
            logger.info("pagedllm serve: engine core launched with the config kept from an earlier start")
    try:
        from pagedllm.config import make_engine_config

        config = make_engine_config(model, **kwargs)
        config.model_config.max_logprobs = max_logprobs  # read by the InputProcessor
        if key is not None:
            data = pickle.dumps(config, protocol=pickle.HIGHEST_PROTOCOL)
            if data != kept:
                if launched is not None:
                    logger.warning(
                        "pagedllm serve: the kept engine config differs from this start's; the engine core "
                        "starts again with this one"
                    )
                    launched.discard()
                    launched = None
                core_launch.store_cached_config(key, data)
    except BaseException as e:
        if launched is not None:
            launched.discard()
        if not isinstance(e, ValueError):
            raise
        print(f"pagedllm serve: error: {e}", flush=True)  # a flag the config refuses
        return None, None
    return launched, config


async def _serve(
    args: argparse.Namespace,
    config: Any,
    sock: socket.socket,
    *,
    served_model_names: list[str],
    api_key: str | None,
    chat_template: str | None,
    launched: core_launch.LaunchedCore | None = None,
) -> int:
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.metrics import LoggingStatLogger, PrometheusStatLogger

    metrics = PrometheusStatLogger(served_model_names[0])
    stat_loggers = [metrics.record] + ([] if args.disable_log_stats else [LoggingStatLogger()])
    engine = AsyncLLM(
        config,
        log_requests=not args.disable_log_requests,
        stat_loggers=stat_loggers,
        while_starting=_import_http_stack,
        launched=launched,
    )
    try:
        from pagedllm.entrypoints.openai.api_server import run_server

        return await run_server(
            engine,
            args,
            config,
            sock,
            metrics=metrics,
            served_model_names=served_model_names,
            api_key=api_key,
            chat_template=chat_template,
        )
    finally:
        engine.shutdown()


def _import_http_stack() -> None:
    """Import FastAPI, uvicorn and the OpenAI layer: run while the engine core process loads the model."""
    import uvicorn  # noqa: F401

    import pagedllm.entrypoints.openai.api_server  # noqa: F401

    logger.info("pagedllm serve: server modules imported")
