"""SSEResponse closes (aborts) its request streams when the client goes away while the body generator waits at a
``yield``, which a plain StreamingResponse leaves to the garbage collector."""

from __future__ import annotations

import asyncio

import pytest
from starlette.responses import StreamingResponse

from pagedllm.entrypoints.openai.serving_engine import SSE_DONE, SSEResponse


class FakeStream:
    """Stands in for a RequestStream: records ``close()``, which aborts a running request."""

    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


def body(stream: FakeStream):
    async def gen():
        try:
            for i in range(100):
                yield f"data: {i}\n\n"
                await asyncio.sleep(0)
        finally:
            stream.close()
        yield SSE_DONE

    return gen()


async def drive(response: StreamingResponse, spec_version: str) -> None:
    """Serve ``response`` to a client that disconnects after two events (the way the ASGI version says)."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version}}
    num_events = 0
    gone = asyncio.Event()

    async def receive():
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        nonlocal num_events
        if message["type"] != "http.response.body":
            return
        num_events += 1
        if num_events == 2:
            gone.set()
            if spec_version == "2.3":
                await asyncio.sleep(3600)  # a full socket buffer: blocked here when the disconnect is seen
        elif num_events > 2:
            raise OSError("the client is gone")  # ASGI 2.4: sending is how the app learns of a disconnect

    try:
        await asyncio.wait_for(response(scope, receive, send), 10)
    except Exception:  # noqa: BLE001 - Starlette's ClientDisconnect under ASGI 2.4
        pass


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
async def test_sse_response_closes_streams_on_disconnect(spec_version):
    stream = FakeStream()
    gen = body(stream)  # held here, so only an explicit close can run its finally
    await drive(SSEResponse(gen, [stream]), spec_version)
    assert stream.closed


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
async def test_plain_streaming_response_leaves_the_generator_suspended(spec_version):
    """Why SSEResponse exists: the request would keep running until the generator is collected."""
    stream = FakeStream()
    gen = body(stream)
    await drive(StreamingResponse(gen, media_type="text/event-stream"), spec_version)
    assert not stream.closed
    await gen.aclose()
    assert stream.closed


async def test_sse_response_closes_streams_at_the_end():
    stream = FakeStream()

    async def short():
        yield "data: 1\n\n"

    sent = []

    async def receive():
        await asyncio.sleep(3600)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}
    await SSEResponse(short(), [stream])(scope, receive, send)
    assert stream.closed and sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
