"""`pagedllm disagg-proxy`: one OpenAI endpoint in front of prefill and decode instances (disaggregated P/D).

Each completion or chat completion goes twice, as in vLLM's proxy:

    1. to a prefill instance (round robin), with max_tokens=1, no streaming and
       kv_transfer_params {"do_remote_decode": true}; its response carries the handle of the prompt's KV
    2. to a decode instance (round robin), unchanged but for kv_transfer_params = that handle; its response
       (streamed or not) is what the client gets

The instances are `pagedllm serve` with a P2pConnector ``--kv-transfer-config`` (kv_producer / kv_consumer). The
client's Authorization header goes to both. A backend's error comes back as it sent it (OpenAI's error shape,
same status); an unreachable backend is a 502 in that shape, so the proxy outlives a backend restart: requests
during the outage fail, later ones work. /health is 200 while at least one prefill and one decode instance
answer theirs.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

logger = logging.getLogger(__name__)

FORWARDED_HEADERS = ("authorization", "x-request-id")


def _error(message: str, status: int, type_: str = "server_error", code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


def _backend_error(resp: Any, body: bytes, which: str) -> tuple[dict[str, Any], int]:
    """The backend's error body when it is OpenAI-shaped, else one in that shape with its status."""
    try:
        data = json.loads(body)
        if isinstance(data, dict) and isinstance(data.get("error"), dict):
            return data, resp.status_code
    except ValueError:
        pass
    text = body.decode(errors="replace")[:500]
    return _error(f"{which} instance answered {resp.status_code}: {text}", resp.status_code), resp.status_code


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request for the prefill instance: one token, not streamed, keeping the prompt's KV for a decode one."""
    out = dict(body)
    out["max_tokens"] = 1
    for key in ("max_completion_tokens", "stream_options", "min_tokens", "best_of"):
        out.pop(key, None)
    out["stream"] = False
    out["n"] = 1
    out["kv_transfer_params"] = {"do_remote_decode": True}
    return out


KEEPALIVE_EXPIRY_S = 2.0  # below the backends' keep-alive timeout


class DisaggProxy:
    def __init__(self, prefill_urls: list[str], decode_urls: list[str], timeout_s: float = 600.0) -> None:
        if not prefill_urls or not decode_urls:
            raise ValueError("disagg-proxy needs at least one --prefill and one --decode URL")
        self.prefill_urls = [u.rstrip("/") for u in prefill_urls]
        self.decode_urls = [u.rstrip("/") for u in decode_urls]
        self._prefill = itertools.cycle(self.prefill_urls)
        self._decode = itertools.cycle(self.decode_urls)
        self._warned: set[str] = set()  # prefill instances that returned no handle (said once)
        # Idle connections are dropped before the backends' own keep-alive timeout (uvicorn's: 5 s) closes them:
        # reusing one the server is closing at that moment fails the request with a ReadError.
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=5.0),
            limits=httpx.Limits(max_connections=None, keepalive_expiry=KEEPALIVE_EXPIRY_S),
        )

    async def close(self) -> None:
        await self.client.aclose()

    def _headers(self, request: Any) -> dict[str, str]:
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        headers.setdefault("x-request-id", uuid.uuid4().hex)  # one id for both legs, in both logs
        return headers

    async def forward(self, request: Any, path: str) -> Any:
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse(_error("the body is not valid JSON", 400, "invalid_request_error"), status_code=400)
        if not isinstance(body, dict):
            return JSONResponse(_error("the body must be a JSON object", 400, "invalid_request_error"), 400)
        headers = self._headers(request)
        prefill_url = next(self._prefill)
        try:
            resp = await self.client.post(prefill_url + path, json=prefill_body(body), headers=headers)
        except httpx.HTTPError as e:
            logger.warning("prefill instance %s: %s", prefill_url, e)
            msg = f"prefill instance {prefill_url} is unreachable: {type(e).__name__}"
            return JSONResponse(_error(msg, 502, code="bad_gateway"), status_code=502)
        if resp.status_code != 200:
            data, status = _backend_error(resp, resp.content, "prefill")
            return JSONResponse(data, status_code=status)
        handle = resp.json().get("kv_transfer_params")
        if not handle and prefill_url not in self._warned:
            self._warned.add(prefill_url)
            logger.warning("prefill instance %s returned no kv_transfer_params: is it started with a P2pConnector "
                           "kv_producer --kv-transfer-config? (the decode instance computes the prompt)", prefill_url)
        decode_req = dict(body)
        if handle:
            decode_req["kv_transfer_params"] = handle
        decode_url = next(self._decode)
        try:
            upstream = await self.client.send(
                self.client.build_request("POST", decode_url + path, json=decode_req, headers=headers), stream=True
            )
        except httpx.HTTPError as e:
            logger.warning("decode instance %s: %s", decode_url, e)
            msg = f"decode instance {decode_url} is unreachable: {type(e).__name__}"
            return JSONResponse(_error(msg, 502, code="bad_gateway"), status_code=502)
        if upstream.status_code != 200 or not body.get("stream"):
            try:
                content = await upstream.aread()
            except httpx.HTTPError as e:
                msg = f"decode instance {decode_url} failed mid-response: {type(e).__name__}"
                return JSONResponse(_error(msg, 502, code="bad_gateway"), status_code=502)
            finally:
                await upstream.aclose()
            if upstream.status_code != 200:
                data, status = _backend_error(upstream, content, "decode")
                return JSONResponse(data, status_code=status)
            return JSONResponse(json.loads(content))

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            except httpx.HTTPError as e:  # the decode instance went away mid-stream: say so, in SSE
                msg = f"decode instance {decode_url} failed mid-stream: {type(e).__name__}"
                yield f"data: {json.dumps(_error(msg, 502, code='bad_gateway'))}\n\n".encode()
            finally:
                await upstream.aclose()

        return StreamingResponse(relay(), media_type="text/event-stream")

    async def health(self) -> tuple[bool, dict[str, bool]]:
        async def ok(url: str) -> bool:
            try:
                return (await self.client.get(url + "/health", timeout=2.0)).status_code == 200
            except httpx.HTTPError:
                return False

        urls = list(dict.fromkeys(self.prefill_urls + self.decode_urls))
        states = dict(zip(urls, await asyncio.gather(*(ok(u) for u in urls))))
        healthy = any(states[u] for u in self.prefill_urls) and any(states[u] for u in self.decode_urls)
        return healthy, states


def build_app(proxy: DisaggProxy) -> Any:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await proxy.close()

    app = FastAPI(title="pagedllm disagg-proxy", lifespan=lifespan)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await proxy.forward(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        url = proxy.decode_urls[0]
        try:
            resp = await proxy.client.get(url + "/v1/models", headers=proxy._headers(request))
        except httpx.HTTPError as e:
            return JSONResponse(_error(f"decode instance {url} is unreachable: {type(e).__name__}", 502), 502)
        return Response(resp.content, status_code=resp.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        healthy, states = await proxy.health()
        return JSONResponse({"healthy": healthy, "backends": states}, status_code=200 if healthy else 503)

    return app


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", action="append", required=True, metavar="URL",
                        help="a prefill instance (kv_producer), e.g. http://127.0.0.1:8100; repeat for several")
    parser.add_argument("--decode", action="append", required=True, metavar="URL",
                        help="a decode instance (kv_consumer), e.g. http://127.0.0.1:8200; repeat for several")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 exposes the proxy)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a backend may take to answer")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])  # fmt: skip


def main(args: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not two lines per request
    proxy = DisaggProxy(args.prefill, args.decode, args.timeout)
    logger.info("disagg-proxy on %s:%d: prefill %s, decode %s", args.host, args.port, proxy.prefill_urls,
                proxy.decode_urls)  # fmt: skip
    uvicorn.run(build_app(proxy), host=args.host, port=args.port, log_level=args.uvicorn_log_level)
    return 0
