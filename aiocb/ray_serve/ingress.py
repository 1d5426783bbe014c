"""The HTTP ingress of a Ray Serve app: reads each request, hashes its prompt's prefix,
and forwards it whole to the replica the router picks, streaming the response back.

It parses nothing but the prompt (to hash it) and checks nothing but the API key (before
reading a body) and the body's size and arrival time: every other route, check and error
is the replicas'. A replica lost before
its response starts gives the client a 503; one lost mid-stream ends the stream with an
error event. A client that goes away cancels the call, which cancels the request on its
replica.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, Iterable, Mapping
from typing import Any, cast

import orjson
from ray.exceptions import RayError
from ray.serve.exceptions import RayServeException
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from aiocb.ray_serve.forwarding import ForwardedRequest, ResponseStart
from aiocb.ray_serve.replica import REPLICA_HEADER
from aiocb.ray_serve.routing import MAX_BLOCKS, prefix_hashes, prompt_text
from aiocb.server.app import api_key_refusal, receive_body
from aiocb.server.edge import PROXIED_REQUEST_ID_HEADER
from aiocb.server.limits import ServerLimits, parse_json
from aiocb.server.protocol import APIError
from aiocb.server.sse import DONE

logger = logging.getLogger(__name__)

#: Bodies up to this size are parsed for their prompt on the ingress's event loop; larger
#: ones in a thread (orjson parses about 1 GB/s, so 64 KiB is well under a millisecond).
_INLINE_PARSE_BYTES = 64 * 1024


class Ingress:
    """The ingress deployment's class: one Starlette request in, one streamed response out."""

    def __init__(
        self, engine: DeploymentHandle[Any], limits: ServerLimits, block_chars: int, api_key: str | None = None
    ) -> None:
        self.engine = engine.options(stream=True)
        self.limits = limits
        self.block_chars = block_chars
        self._key = api_key.encode() if api_key else None

    async def __call__(self, request: Request) -> Response:
        """Forward ``request`` to a replica and stream its response."""
        path = _app_path(request.scope)
        # (as the replicas would, but before an unauthenticated client can send its body)
        refusal = None if self._key is None else api_key_refusal(path, request.headers, self._key)
        if refusal is not None:
            return self._error(refusal)
        try:
            body = await self._body(request)
        except APIError as exc:
            return self._error(exc)
        prefix = await self._prefix(path, body) if request.method == "POST" else ()
        client = request.client
        forwarded = ForwardedRequest(
            method=request.method,
            path=path,
            query_string=request.scope.get("query_string", b""),
            headers=_proxied_id(request.scope["headers"]),
            body=body,
            client=(client.host, client.port) if client else None,
            prefix=prefix,
            replica=request.headers.get(REPLICA_HEADER),
        )
        stream = cast(DeploymentResponseGenerator[Any], self.engine.forward.remote(forwarded))
        try:
            start = await stream.__anext__()
        except asyncio.CancelledError:
            stream.cancel()  # the client went away: the replica cancels its request
            raise
        except (RayError, RayServeException, StopAsyncIteration) as exc:
            stream.cancel()
            logger.warning("a replica failed before its response started: %s", exc)
            return self._error(_replica_failed(exc))
        if not isinstance(start, ResponseStart):
            stream.cancel()
            return self._error(APIError(500, f"a replica sent {type(start).__name__} before its response started"))
        response = _ForwardedResponse(stream, _is_event_stream(start), start)
        return response

    def _error(self, error: APIError) -> JSONResponse:
        """``error`` as one process's server answers it: a 429 or 503 says when to retry; a
        body refused unread leaves the connection unusable."""
        headers = {}
        if error.status in (429, 503):
            headers["Retry-After"] = str(self.limits.retry_after)
        elif error.status == 413:
            headers["Connection"] = "close"
        return JSONResponse(error.to_dict(), status_code=error.status, headers=headers or None)

    async def _body(self, request: Request) -> bytes:
        """The body, refused as one process's server refuses it: too large by its
        Content-Length before it is read, then as it comes (:func:`receive_body`)."""
        too_large = self.limits.declared_too_large(request.headers.get("content-length"))
        if too_large is not None:
            raise too_large
        return await receive_body(request, self.limits)

    async def _prefix(self, path: str, body: bytes) -> tuple[int, ...]:
        """The prompt's prefix hashes (none for a body that is not JSON: the replica says why)."""
        depth = self.limits.max_json_depth
        if len(body) > _INLINE_PARSE_BYTES:
            return await asyncio.to_thread(_hash_body, path, body, self.block_chars, depth)
        return _hash_body(path, body, self.block_chars, depth)


def _proxied_id(headers: Iterable[tuple[bytes, bytes]]) -> tuple[tuple[bytes, bytes], ...]:
    """``headers`` with ``X-Request-Id`` moved to :data:`PROXIED_REQUEST_ID_HEADER`: Ray Serve's
    proxy sets one on every request that lacks it, and the replica must not take it for the
    client's, which would name the request before a body's ``request_id``."""
    proxied = PROXIED_REQUEST_ID_HEADER.encode()
    kept = []
    for name, value in headers:
        lowered = name.lower()
        if lowered == b"x-request-id":
            kept.append((proxied, value))
        elif lowered != proxied:  # (a client's own is not the proxy's)
            kept.append((name, value))
    return tuple(kept)


def _app_path(scope: Mapping[str, Any]) -> str:
    """The request's path below the app's route prefix (``/v1/completions`` for an app run
    with ``route_prefix="/qwen"`` and a request to ``/qwen/v1/completions``)."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root):
        return path[len(root) :] or "/"
    return path


def _hash_body(path: str, body: bytes, block_chars: int, max_depth: int) -> tuple[int, ...]:
    """The prefix hashes of ``body``'s prompt: a large body (on a worker thread) parsed a
    piece at a time, letting the loop's thread have the GIL between (parsed whole, 7 MB
    held it 44-92 ms)."""
    try:
        parsed = orjson.loads(body) if len(body) <= _INLINE_PARSE_BYTES else parse_json(body, max_depth)
        text = prompt_text(path, parsed, block_chars * MAX_BLOCKS)
    except (orjson.JSONDecodeError, APIError, RecursionError, TypeError, ValueError):
        return ()  # not a prompt to route by: the replica answers the request as it is
    return prefix_hashes(text, block_chars) if text else ()


class _ForwardedResponse(StreamingResponse):
    """A replica's response as it streams in; however it ends (finished, the client gone,
    cancelled before its body began), the replica's call is cancelled if it still runs."""

    def __init__(self, stream: DeploymentResponseGenerator[Any], event_stream: bool, start: ResponseStart) -> None:
        super().__init__(_rest(stream, event_stream), status_code=start.status)
        # Ray Serve's proxy puts its own x-request-id on the response (the client's, or the
        # one it made); the replica's (a body's request_id may have named it) would be a second.
        self.raw_headers = [(k, v) for k, v in start.headers if k.lower() != b"x-request-id"]
        self.stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.stream.cancel()  # a no-op once it has ended
            await cast(AsyncGenerator[bytes, None], self.body_iterator).aclose()


async def _rest(stream: DeploymentResponseGenerator[Any], event_stream: bool) -> AsyncGenerator[bytes, None]:
    """The body's chunks; a replica lost mid-stream ends an event stream with an error event
    and ``[DONE]`` (any other body is cut short, which its Content-Length tells the client)."""
    try:
        async for chunk in stream:
            yield chunk
    except (RayError, RayServeException) as exc:
        logger.warning("a replica failed mid-response: %s", exc)
        if not event_stream:
            raise
        yield b"data: " + json.dumps(_replica_failed(exc).to_dict()).encode() + b"\n\n"
        yield DONE  # (as one process's server ends a stream after its error event)


def _is_event_stream(start: ResponseStart) -> bool:
    return any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in start.headers)


def _replica_failed(exc: BaseException) -> APIError:
    lines = str(exc).strip().splitlines()
    reason = f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return APIError(503, f"the replica serving this request failed: {reason}", type="service_unavailable")
