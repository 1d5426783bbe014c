"""The outermost layer of the app: request ids, the access log, and the cheap refusals.

:class:`EdgeMiddleware` is pure ASGI (streams pass through untouched). For every HTTP
request it

- gives the request an id, the client's ``X-Request-Id``, else a fresh one, and puts it on
  the response's ``X-Request-Id`` header;
- refuses, before the app runs, an API request whose ``X-Request-Id`` is not 1 to 128
  visible ASCII characters (400: replaced, it would name the response other than the
  client named it; behind Ray Serve's proxy, which puts the client's on the response,
  the two would differ), a body whose ``Content-Length`` is over the limit (413,
  with the body unread), a request on a server past ``--max-connections`` (503, which the
  connection's protocol marks in the scope: :data:`CROWDED_KEY`) and an API request
  beyond ``max_concurrent_requests`` (429 with ``Retry-After``); probes (``/health``,
  ``/ready``) and ``/metrics`` are never refused;
- writes one access-log line when the response ends: status, tokens and latency;
- drops a client that stops reading: a response that waits more than ``send_timeout``
  seconds for the client to take its bytes has its request cancelled (a stream's
  generation with it) and the connection closed, so that it holds no slot or memory
  (logged and counted as 499, a client gone).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from aiocb.server.limits import ServerLimits
from aiocb.server.metrics import CLIENT_GONE, ServerMetrics
from aiocb.server.protocol import APIError, bad_request, sane_request_id

access_logger = logging.getLogger("aiocb.access")

#: The scope key under which a connection's protocol gives ``--max-connections`` when the
#: server holds more connections (or requests) than that: the request is answered 503.
CROWDED_KEY = "aiocb.crowded"

#: Paths that stay open whatever the load (and without an API key): probes and scrapers.
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
_SCOPE_KEY = "aiocb.access"


@dataclass(slots=True)
class AccessRecord:
    """What the access log says of one request; the handlers fill in the token counts."""

    request_id: str
    #: whether ``request_id`` is the client's (its ``X-Request-Id``), not one made here
    from_client: bool = False
    status: int = 500
    prompt_tokens: int = 0
    completion_tokens: int = 0


def access_record(scope: Scope) -> AccessRecord:
    """The record of the request in ``scope`` (a detached one outside the middleware)."""
    record = scope.get(_SCOPE_KEY)
    return record if isinstance(record, AccessRecord) else AccessRecord("")


#: The header the Ray Serve ingress moves a request's ``X-Request-Id`` to: the proxy in front
#: of it gives every request one (the client's, or one it makes), so it names a request only
#: where its body's ``request_id`` does not.
PROXIED_REQUEST_ID_HEADER = "x-aiocb-proxied-request-id"


def _record(header: str | None, proxied: str | None) -> AccessRecord:
    """The record of a request with this ``X-Request-Id``: the client's id when sane, else
    the one a proxy gave it (:data:`PROXIED_REQUEST_ID_HEADER`), else fresh."""
    if header is not None and sane_request_id(header):  # (1 to 128 visible ASCII characters)
        return AccessRecord(header, from_client=True)
    if proxied is not None and sane_request_id(proxied):
        return AccessRecord(proxied)
    return AccessRecord(uuid.uuid4().hex)


def refused_before_the_app(metrics: ServerMetrics | None, status: int, peer: str) -> None:
    """Count and log a response a connection's protocol gave before any request reached the
    app (a 431: headers too large, never parsed)."""
    if metrics is not None:
        metrics.observe_error(status)
    access_logger.info('%s "- -" %d request_id=- prompt_tokens=0 completion_tokens=0 latency_ms=0.0', peer, status)


class EdgeMiddleware:
    """Request ids, the access log, the body-size precheck and the concurrency bound."""

    def __init__(self, app: ASGIApp, *, limits: ServerLimits, metrics: ServerMetrics) -> None:
        self.app = app
        self.limits = limits
        self.metrics = metrics
        #: API requests in flight (a stream until it ends)
        self.in_flight = 0
        #: the requests whose response waits on a send, and since when (loop time)
        self._sending: dict[asyncio.Task[Any], float] = {}
        #: those cancelled for it, and the next look at the waits (None: none due)
        self._stalled: set[asyncio.Task[Any]] = set()
        self._look: asyncio.TimerHandle | None = None
        self._look_loop: asyncio.AbstractEventLoop | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        headers = Headers(scope=scope)
        record = _record(headers.get("x-request-id"), headers.get(PROXIED_REQUEST_ID_HEADER))
        scope[_SCOPE_KEY] = record
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        sending = self._sending

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
                # (read now: a body's request_id may have named the request meanwhile)
                id_header = (b"x-request-id", record.request_id.encode())
                message = {**message, "headers": [*message.get("headers", ()), id_header]}
            # (a dictionary entry per send, not a timer: sends of stream events are many)
            sending[task] = loop.time()
            if self._look is None or self._look_loop is not loop:  # (an app may outlive a loop)
                self._look_loop = loop
                self._look = loop.call_later(self._look_every, self._cancel_stalled)
            try:
                await send(message)
            finally:
                del sending[task]

        gated = scope["path"] not in OPEN_PATHS
        try:
            refusal = self._refusal(scope, headers) if gated else None
            if refusal is not None:
                self.metrics.observe_error(refusal.status)
                response = JSONResponse(refusal.to_dict(), status_code=refusal.status, headers=self._headers(refusal))
                await response(scope, receive, send_with_id)
                return
            if gated:
                self.in_flight += 1
            try:
                await self.app(scope, receive, send_with_id)
            except asyncio.CancelledError:
                if task not in self._stalled:
                    raise
                # (the response was begun and is left unfinished: the server closes the connection)
                self._stalled.discard(task)
                task.uncancel()
                if record.status != CLIENT_GONE:  # (its stream may have seen the client go meanwhile)
                    record.status = CLIENT_GONE
                    self.metrics.observe_client_gone()
                access_logger.warning(
                    "request_id=%s: the client took no bytes for %s s (--send-timeout); request cancelled",
                    record.request_id,
                    self.limits.send_timeout,
                )
            finally:
                self._stalled.discard(task)
                if gated:
                    self.in_flight -= 1
        finally:
            self._log(scope, record, time.perf_counter() - started)

    @property
    def _look_every(self) -> float:
        return min(1.0, self.limits.send_timeout / 2)

    def _cancel_stalled(self) -> None:
        """Cancel the requests whose response has waited on a send for ``send_timeout``;
        look again while any waits."""
        self._look = None
        if not self._sending:
            return
        loop = asyncio.get_running_loop()
        overdue = loop.time() - self.limits.send_timeout
        for task, since in list(self._sending.items()):
            if since <= overdue and task not in self._stalled:
                self._stalled.add(task)
                task.cancel()
        self._look = loop.call_later(self._look_every, self._cancel_stalled)

    def _refusal(self, scope: Scope, headers: Headers) -> APIError | None:
        too_large = self.limits.declared_too_large(headers.get("content-length"))
        if too_large is not None:
            return too_large
        # (the client's id, moved by a Ray Serve ingress where one forwarded the request:
        # the ids Ray's proxy makes are sane, so one that is not is the client's)
        given = headers.get("x-request-id") or headers.get(PROXIED_REQUEST_ID_HEADER)
        if given and not sane_request_id(given):
            return bad_request(
                "X-Request-Id must be 1 to 128 visible ASCII characters (it names the request and its "
                "response); send another, or none",
                "X-Request-Id",
            )
        connections = scope.get(CROWDED_KEY)
        if connections is not None:
            return APIError(
                503,
                f"the server holds its limit of {connections} connections (--max-connections, per API "
                "worker); retry later",
                type="service_unavailable",
                code="too_many_connections",
            )
        bound = self.limits.max_concurrent_requests
        if bound and self.in_flight >= bound:
            return APIError(
                429,
                f"the server is handling its limit of {bound} concurrent requests "
                "(--max-concurrent-requests, per API worker or replica); retry later",
                type="rate_limit_exceeded",
                code="too_many_concurrent_requests",
            )
        return None

    def _headers(self, error: APIError) -> dict[str, str]:
        if error.status == 400:
            return {}
        if error.status == 413:
            return {"Connection": "close"}  # the body was not read: the connection cannot go on
        if error.code == "too_many_connections":  # (this one among them)
            return {"Retry-After": str(self.limits.retry_after), "Connection": "close"}
        return {"Retry-After": str(self.limits.retry_after)}

    def _log(self, scope: Scope, record: AccessRecord, seconds: float) -> None:
        if not access_logger.isEnabledFor(logging.INFO):
            return
        client: Any = scope.get("client")
        peer = f"{client[0]}:{client[1]}" if client else "-"
        access_logger.info(
            '%s "%s %s" %d request_id=%s prompt_tokens=%d completion_tokens=%d latency_ms=%.1f',
            peer,
            scope["method"],
            scope["path"],
            record.status,
            record.request_id,
            record.prompt_tokens,
            record.completion_tokens,
            seconds * 1e3,
        )
