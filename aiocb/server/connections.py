"""uvicorn, bounded and draining: deadlines and a size bound on request headers, a bound
on connections, a drain on exit signals.

uvicorn closes a keep-alive connection that stays idle, but a connection that sends its
headers a byte at a time (or nothing at all after connecting) is kept for ever: a few
thousand such clients hold every file descriptor. The protocols here give each request's
headers ``header_timeout`` seconds from the first byte (or from the connection, for its
first request), and at most ``max_header_bytes`` bytes; past either the connection is
closed, with a 431 for headers too large. The body has a deadline of its own, enforced by
the app (``--body-timeout``). A connection closed with bytes its client does not take
(one that stopped reading: its response cut at ``--send-timeout``) is dropped after
``send_timeout`` more seconds, not kept while the client keeps it open. Past
``max_connections`` open connections (or requests), a request gets a 503 naming
``--max-connections``, with ``Retry-After``; the probes (``/health``, ``/ready``,
``/metrics``) are still served.

:class:`DrainingServer` is uvicorn's server that, on the first ``SIGTERM`` or ``SIGINT``,
also drains the app (:func:`~aiocb.server.app.begin_drain`) while uvicorn stops accepting
connections and waits for the open ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import signal
import socket
import types
from collections.abc import AsyncIterator
from typing import Any

import h11
import uvicorn
from starlette.applications import Starlette
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from aiocb.server.app import begin_drain
from aiocb.server.edge import CROWDED_KEY, refused_before_the_app
from aiocb.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)


class _ConnectionBound:
    """The app, told past ``bound`` open connections or requests that the server holds too
    many (:data:`~aiocb.server.edge.CROWDED_KEY` in the scope): its edge answers a request
    other than a probe with a 503 naming ``--max-connections``, counted and logged as its
    other refusals (uvicorn's own is plain text, and refuses probes too: an orchestrator
    would take a flooded server for a dead one)."""

    def __init__(self, app: ASGIApp, connections: set[Any], tasks: set[Any], bound: int) -> None:
        self.app = app
        self.connections = connections
        self.tasks = tasks
        self.bound = bound

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # (this connection and this request count among the open ones)
        if len(self.connections) > self.bound or len(self.tasks) > self.bound:
            scope = {**scope, CROWDED_KEY: self.bound}
        await self.app(scope, receive, send)


class _LingeringClose:
    """A transport whose :meth:`close` leaves the client ``linger`` seconds to take the
    bytes still buffered, then aborts: closed, a transport waits for them to drain, as long
    as the client keeps the connection open without reading."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop, linger: float) -> None:
        self._transport = transport
        self._loop = loop
        self._linger = linger
        self._timer: asyncio.TimerHandle | None = None
        self._gone = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def close(self) -> None:
        self._transport.close()
        if self._timer is None and not self._gone and self._transport.get_write_buffer_size():
            self._timer = self._loop.call_later(self._linger, self._transport.abort)

    def forget(self) -> None:
        """The connection is gone: no abort to come (uvloop's transport, closed again as
        uvicorn's protocol lets go of it, may still count bytes it will never send)."""
        self._gone = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class _HeaderBounds:
    """Mixed into a uvicorn protocol, before it in the bases."""

    header_timeout: float = 30.0
    max_header_bytes: int = 16384
    max_connections: int | None = None
    send_timeout: float | None = None
    metrics: ServerMetrics | None = None
    _header_timer: asyncio.TimerHandle | None = None
    _header_bytes: int = 0
    _header_tail = b""
    #: the cycles whose responses were still going when a pipelined request's took their
    #: place (the one under way among them: uvicorn's protocol knows only the newest)
    _displaced: list[Any] | None = None
    # provided by the uvicorn protocol
    app: ASGIApp
    connections: set[Any]
    tasks: set[Any]
    cycle: Any
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.max_connections is not None:
            self.app = _ConnectionBound(self.app, self.connections, self.tasks, self.max_connections)

    def connection_made(self, transport: asyncio.Transport) -> None:
        if self.send_timeout is not None:
            transport = _LingeringClose(transport, self.loop, self.send_timeout)  # type: ignore[assignment]
        super().connection_made(transport)  # type: ignore[misc]
        self._arm()

    def data_received(self, data: bytes) -> None:
        before = self.cycle
        # Bytes after a whole request are the next request's, also while the response is
        # still going (pipelining): the parser keeps such headers until they end, unbounded.
        # The body of a request answered before it was read (a 401, a 429) is not headers,
        # though the connection is on the clock as it waits for the next request.
        waiting = before is None or before.response_complete or not before.more_body
        headers = before is None or not before.more_body
        end = -1
        if waiting and headers:
            # The bytes of this chunk that belong to the headers: up to the blank line
            # that ends them (which may straddle two chunks), or all of it.
            seen = self._header_tail + data
            end = seen.find(b"\r\n\r\n")
            head = len(data) if end < 0 else end + 4 - len(self._header_tail)
            self._header_bytes += head
            if self._header_bytes > self.max_header_bytes:
                self._refuse_headers()  # before the parser sees them
                return
            self._header_tail = seen[-3:] if end < 0 else b""
        super().data_received(data)  # type: ignore[misc]
        if self.cycle is not before or end >= 0:
            # A new request's headers arrived (a pipelined one's wait, with reading paused,
            # for the response in progress to end)
            self._disarm()
        elif waiting:
            self._arm()  # part of the next request's headers (or of a refused body): on the clock

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        displaced, self._displaced = self._displaced or [], None
        for cycle in displaced:
            # A response under way when pipelined requests came: uvicorn's protocol marks
            # only the newest cycle gone, and this one's next write met the closed transport
            # (an error logged, a 200 recorded for a client that left). Those still queued
            # never start: marking them changes nothing.
            if not cycle.response_complete:
                cycle.disconnected = True
                cycle.message_event.set()
        lingering = self.transport if isinstance(self.transport, _LingeringClose) else None
        super().connection_lost(exc)  # type: ignore[misc]
        if lingering is not None:  # (after: uvicorn's protocol closes its transport again)
            lingering.forget()

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _disarm(self) -> None:
        self._header_bytes = 0
        self._header_tail = b""
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        cycle = self.cycle
        if cycle is None or cycle.response_complete or not cycle.more_body:
            self.transport.close()  # (a pipelined request's headers too: the response is cut short)

    def _refuse_headers(self) -> None:
        self._disarm()
        error = {
            "message": f"the request's headers are larger than the server's limit of {self.max_header_bytes} "
            "bytes (--max-header-bytes)",
            "type": "invalid_request_error",
            "param": None,
            "code": "headers_too_large",
        }
        body = json.dumps({"error": error}).encode()
        head = (
            "HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        self.transport.write(head.encode() + body)
        self.transport.close()
        peer = self.transport.get_extra_info("peername")
        refused_before_the_app(self.metrics, 431, f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "-")


def http_protocol(header_timeout: float, max_header_bytes: int, **bounds: Any) -> type[asyncio.Protocol]:
    """uvicorn's fastest HTTP protocol here (httptools when installed, else h11), bounded
    (``bounds``: see :func:`_bounded`)."""
    if importlib.util.find_spec("httptools") is not None:
        return httptools_protocol(header_timeout, max_header_bytes, **bounds)
    return h11_protocol(header_timeout, max_header_bytes, **bounds)


class _H11BodyEnd:
    """h11's protocol: a body read past after its response was sent (a refusal) ends, for
    the header bound, when h11 has it all (uvicorn leaves the request's ``more_body`` set,
    and the bytes after it, the next request's headers, went uncounted)."""

    cycle: Any
    conn: Any

    def handle_events(self) -> None:
        super().handle_events()  # type: ignore[misc]
        cycle = self.cycle
        ended = cycle is not None and cycle.response_complete and self.conn.their_state is not h11.SEND_BODY
        if ended and cycle.more_body:
            cycle.more_body = False


class _HttpToolsBodyEnd:
    """httptools' protocol: as :class:`_H11BodyEnd`, at the parser's end of the message;
    and the cycles whose responses are under way kept when pipelined requests' take their
    place (uvicorn's protocol then knows only the newest: see ``connection_lost``)."""

    cycle: Any
    _displaced: list[Any] | None

    def on_headers_complete(self) -> None:
        before = self.cycle
        super().on_headers_complete()  # type: ignore[misc]
        if self.cycle is not before and before is not None and not before.response_complete:
            kept = [cycle for cycle in self._displaced or () if not cycle.response_complete]
            self._displaced = [*kept, before]

    def on_message_complete(self) -> None:
        cycle = self.cycle
        if cycle is not None and cycle.response_complete:
            cycle.more_body = False
        super().on_message_complete()  # type: ignore[misc]


def h11_protocol(header_timeout: float, max_header_bytes: int = 16384, **bounds: Any) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol with bounded headers (and ``bounds``: see :func:`_bounded`)."""
    return _bounded((_H11BodyEnd, H11Protocol), header_timeout, max_header_bytes, **bounds)


def httptools_protocol(header_timeout: float, max_header_bytes: int = 16384, **bounds: Any) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol (needs httptools), bounded as :func:`h11_protocol`'s."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    return _bounded((_HttpToolsBodyEnd, HttpToolsProtocol), header_timeout, max_header_bytes, **bounds)


def _bounded(
    bases: tuple[type, type[asyncio.Protocol]],
    header_timeout: float,
    max_header_bytes: int,
    *,
    max_connections: int | None = None,
    send_timeout: float | None = None,
    metrics: ServerMetrics | None = None,
) -> type[asyncio.Protocol]:
    """The protocol of ``bases`` with bounded headers (a 431 past them, counted in
    ``metrics``); with ``max_connections``, a 503 from the app's edge past that many
    connections; with ``send_timeout``, a connection closed with bytes left unread dropped
    that long after."""
    attributes = {
        "header_timeout": header_timeout,
        "max_header_bytes": max_header_bytes,
        "max_connections": max_connections,
        "send_timeout": send_timeout,
        "metrics": metrics,
    }
    return type(f"Bounded{bases[-1].__name__}", (_HeaderBounds, *bases), attributes)


#: How long a forced exit waits for the app's lifespan to end (seconds).
_FORCED_LIFESPAN_END_S = 2.0


class DrainingServer(uvicorn.Server):
    """uvicorn's server, draining the app on the first exit signal."""

    def __init__(
        self, config: uvicorn.Config, app: Starlette, shutdown_timeout: float, *, start_engine: bool = False
    ) -> None:
        super().__init__(config)
        self._app = app
        self._shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task[None] | None = None
        #: whether :meth:`startup` starts the app's engine before uvicorn's startup (else the
        #: app's lifespan does, and uvicorn reports an engine that fails to start with the
        #: lifespan's traceback); the lifespan's end still stops it, as one it started
        self._start_engine = start_engine
        #: what made the engine fail to start (nothing was served then)
        self.start_error: Exception | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """Remember the loop (for the signal handler), start the engine (``start_engine``),
        start as uvicorn does, then say where it listens (the port it was given, or with
        port 0 the one it took)."""
        self._loop = asyncio.get_running_loop()
        if self._start_engine:
            if not await self._engine_started():
                self.should_exit = True  # (uvicorn's serve returns: nothing started, nothing to shut)
                return
            self._app.state.aiocb.stops_engine = True
        try:
            await super().startup(sockets)
        except BaseException:  # (uvicorn exits when its startup fails: the engine stops first)
            if self._start_engine:
                await self._stopped(self._app.state.aiocb.manager)
            raise
        for server in self.servers:
            for bound in server.sockets:
                address = bound.getsockname()
                if isinstance(address, tuple):
                    host = f"[{address[0]}]" if ":" in address[0] else address[0]  # (an IPv6 address)
                    logger.info("listening on http://%s:%d", host, address[1])

    async def _engine_started(self) -> bool:
        """Start the app's engine: whether it runs; if not, :attr:`start_error` says why
        (None: a signal came while it started, and its drain stopped it)."""
        manager = self._app.state.aiocb.manager
        try:
            manager.start()  # (the cache is planned here: it may not fit)
            await manager.wait_started()
        except Exception as exc:
            if not self.should_exit:
                self.start_error = exc
            await self._stopped(manager)
            return False
        if self.should_exit:
            await self._stopped(manager)
            return False
        return True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """Shut down as uvicorn does. A forced exit (a second ``SIGINT``) skips the app's
        lifespan, whose end stops the engine: an engine this server started then ends here,
        its requests aborted, before the loop is torn down around its step thread."""
        await super().shutdown(sockets)
        manager = self._app.state.aiocb.manager
        if self._start_engine and manager.is_running:
            await manager.stop(hard_stop=True)
        if self.force_exit:
            # uvicorn skips the lifespan's end on a forced exit (an app's may hang): left
            # waiting, it is cancelled as the loop ends, which it logs as a traceback at
            # ERROR. This one's is quick once the engine has stopped: it gets a moment.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.lifespan.shutdown(), _FORCED_LIFESPAN_END_S)

    async def _stopped(self, manager: Any) -> None:
        """Wait for the drain a signal began, then stop ``manager`` if it still runs."""
        if self._drain is not None:
            with contextlib.suppress(Exception):
                await self._drain
        if manager.is_running:
            await manager.stop(timeout=self._shutdown_timeout)

    def handle_exit(self, sig: int, frame: types.FrameType | None) -> None:
        """The signal handler: begin the drain and uvicorn's shutdown; a second ``SIGINT`` forces it.

        Unlike uvicorn's own handler, the signal is not raised again once the server has
        stopped: a drained server exits with status 0.
        """
        if self.should_exit:
            self.force_exit = self.force_exit or sig == signal.SIGINT
            return
        self.should_exit = True
        if self._loop is not None:
            # A signal handler may run anywhere in the loop's own code: hand over to the loop.
            self._loop.call_soon_threadsafe(self._begin_drain)

    def _begin_drain(self) -> None:
        self._drain = begin_drain(self._app, self._shutdown_timeout)


@contextlib.asynccontextmanager
async def local_server(app: Starlette, host: str = "127.0.0.1") -> AsyncIterator[str]:
    """Serve ``app`` with uvicorn on a free port of ``host``, on the running event loop;
    yields its base URL (``http://host:port``) once it accepts connections, and stops it
    on exit. For scripts and notebooks that drive the server from the same process."""
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=0, log_level="warning"))
    serving = asyncio.get_running_loop().create_task(server.serve(), name="aiocb-local-server")
    try:
        while not server.started:  # (uvicorn offers a flag, not an event)
            if serving.done():
                serving.result()  # (its startup failed: raise why)
                raise RuntimeError("uvicorn exited before it started")
            await asyncio.sleep(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        await serving
