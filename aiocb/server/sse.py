"""Server-sent events as OpenAI streams them: ``data: {json}`` lines, then ``data: [DONE]``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from aiocb.server.edge import AccessRecord, access_record
from aiocb.server.metrics import CLIENT_GONE, ServerMetrics
from aiocb.server.protocol import error_from_exception

logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"


#: Characters that ``str.splitlines`` (and so httpx's ``aiter_lines`` and requests'
#: ``iter_lines``) breaks lines at, which JSON leaves raw inside strings, as UTF-8: escaped,
#: so a generated U+2028 does not cut an event in two on the client. They can only occur
#: inside JSON strings, where the escape means the same character.
_LINE_BREAKS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def dumps(value: Any) -> bytes:
    """Compact JSON (UTF-8, non-ASCII kept as is) that stays on one line for any line splitter."""
    data = orjson.dumps(value)
    if b"\xc2\x85" in data or b"\xe2\x80" in data:
        for raw, escaped in _LINE_BREAKS:
            data = data.replace(raw, escaped)
    return data


def event(value: Any) -> bytes:
    """One ``data:`` event."""
    return b"data: " + dumps(value) + b"\n\n"


async def events(
    chunks: AsyncIterator[dict[str, Any]], metrics: ServerMetrics, record: AccessRecord
) -> AsyncIterator[bytes]:
    """The chunks as events, ended by ``[DONE]``; an error mid-stream becomes an error event
    (its status counted, and the access log's: the response began 200)."""
    try:
        async for chunk in chunks:
            yield event(chunk)
    except Exception as exc:
        error = error_from_exception(exc)
        if error.status >= 500 and error.status != 503:  # (503: the server stopping, not a fault)
            logger.error("a streamed request failed", exc_info=exc)
        metrics.observe_error(error.status)
        record.status = error.status
        yield event(error.to_dict())
    finally:
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()
    yield DONE


class EventStreamResponse(StreamingResponse):
    """A ``text/event-stream`` response that always closes its iterator.

    When the client goes away the stream stops; closing the iterator here (rather than
    whenever it is garbage-collected) cancels the requests behind it at once. The client's
    leaving is listened for by a plain task that cancels the stream, not Starlette's anyio
    task group: anyio's task-done callback keeps the stream's CancelledError in a reference
    cycle with its traceback, and so every frame of the stream's pipeline and the requests
    behind it (some 140 objects a stream, for the cyclic collector: 512 streams that went
    at once made young collections of 20-30 ms on the loop).
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], metrics: ServerMetrics) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._iterator = content
        self._metrics = metrics
        self._complete = False
        self._client_gone = False

    async def stream_response(self, send: Send) -> None:
        await super().stream_response(send)
        self._complete = True

    async def listen_for_disconnect(self, receive: Receive) -> None:
        await super().listen_for_disconnect(receive)
        # (a client may close as the last event reaches it, before this is cancelled)
        self._client_gone = not self._complete

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streaming = asyncio.current_task()
        assert streaming is not None
        listener = asyncio.get_running_loop().create_task(self.listen_for_disconnect(receive))
        stopped = False  # (the stream cancelled here, its client gone)
        ended = False  # (this call past its stream: a callback scheduled before may come after)

        def stop(done: asyncio.Task[None]) -> None:
            nonlocal stopped
            if ended or done.cancelled():
                return
            if done.exception() is not None:  # (the connection's receive failed: no client to answer)
                self._client_gone = not self._complete
            if self._client_gone:
                stopped = True
                streaming.cancel()

        listener.add_done_callback(stop)
        try:
            try:
                await self.stream_response(send)
            except OSError:
                raise ClientDisconnect() from None
            except asyncio.CancelledError:
                if not stopped or streaming.uncancel() > 0:  # (cancelled from elsewhere too)
                    raise
            if self.background is not None and not self._client_gone:
                await self.background()
        except ClientDisconnect:
            self._client_gone = True
        finally:
            ended = True
            listener.remove_done_callback(stop)
            listener.cancel()
            if self._client_gone:
                self._metrics.observe_client_gone()
                access_record(scope).status = CLIENT_GONE
            aclose = getattr(self._iterator, "aclose", None)
            if aclose is not None:
                await aclose()
