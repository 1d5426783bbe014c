"""An HTTP request carried from the ingress to a replica, and the replica's ASGI app run on it.

The ingress reads the request and sends it whole (``ForwardedRequest``, with the prefix
hashes the router reads); the replica runs its :func:`aiocb.server.build_app` app on it
in-process and streams back a :class:`ResponseStart`, then the body's chunks as bytes.
So every route, limit and error of ``aiocb serve`` is the replica's own, streaming
included, with nothing re-implemented on the way.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Message

#: Seconds a replica's app gets to notice a gone client (and cancel its requests) before
#: its task is cancelled.
_DISCONNECT_GRACE_S = 1.0
#: Apps cancelled after their client left, until they are done.
_CLOSING: set[asyncio.Task[None]] = set()

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ForwardedRequest:
    """One HTTP request as the ingress received it."""

    method: str
    path: str
    query_string: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    client: tuple[str, int] | None = None
    #: chained hashes of the prompt's full blocks (see :func:`aiocb.ray_serve.routing.prefix_hashes`)
    prefix: tuple[int, ...] = field(default=())
    #: the replica the client asked for (its ``x-aiocb-replica`` request header), if any
    replica: str | None = None


@dataclass(frozen=True, slots=True)
class ResponseStart:
    """The status and headers of a replica's response: the first item it streams back."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]


async def run_asgi(
    app: ASGIApp, request: ForwardedRequest, extra_headers: tuple[tuple[bytes, bytes], ...] = ()
) -> AsyncGenerator[ResponseStart | bytes, None]:
    """Run ``app`` on ``request``: yields one :class:`ResponseStart` (with ``extra_headers``
    added), then the body's non-empty chunks as they are sent.

    Closing the iterator early (the client went away, so the caller was cancelled) tells
    the app the client disconnected, which cancels its generation, and cancels the app
    if it has not returned within a second.
    """
    messages: asyncio.Queue[Message | None] = asyncio.Queue()
    gone = asyncio.Event()
    body_given = False

    async def receive() -> Message:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if gone.is_set():
            raise OSError("the client disconnected")
        await messages.put(message)

    async def run() -> None:
        try:
            await app(_scope(request), receive, send)
        finally:
            messages.put_nowait(None)

    task = asyncio.create_task(run())
    finished = False
    try:
        while (message := await messages.get()) is not None:
            if message["type"] == "http.response.start":
                headers = tuple((bytes(k), bytes(v)) for k, v in message.get("headers", ())) + extra_headers
                yield ResponseStart(int(message["status"]), headers)
            elif message["type"] == "http.response.body":
                chunk = bytes(message.get("body", b""))
                if chunk:
                    yield chunk
                if not message.get("more_body", False):
                    finished = True
                    break
        await asyncio.wait({task})
        error = task.exception()
        if error is not None and not finished:
            raise error  # the app failed before it finished its response
        if error is not None:
            logger.error("the app raised after its response was sent", exc_info=error)
    finally:
        if not task.done():
            gone.set()  # the app's disconnect watchers cancel its requests
            try:
                if not finished:
                    await asyncio.wait({task}, timeout=_DISCONNECT_GRACE_S)
            finally:
                task.cancel()
                _CLOSING.add(task)  # held until it is done: nothing else references it
                task.add_done_callback(_CLOSING.discard)


def _scope(request: ForwardedRequest) -> dict[str, Any]:
    return {
        "type": "http",
        # 2.3: Starlette's streaming responses then watch receive() for the disconnect.
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.path.encode(),
        "query_string": request.query_string,
        "root_path": "",
        "headers": list(request.headers),
        "client": request.client,
        "server": None,
        "state": {},
    }
