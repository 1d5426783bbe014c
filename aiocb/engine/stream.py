"""A request's output buffer between the step loop and whoever awaits the request.

The step loop only marks a handle as changed, in O(1); the consumer builds the output
from the request's current state when it wakes up. A slow consumer therefore sees its
updates merged (one output carrying every token since its last one) and never makes
the step loop wait or buffer without bound.
"""

from __future__ import annotations

import asyncio
import enum
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

from aiocb.core.request import Request
from aiocb.engine.turns import Waker
from aiocb.errors import EngineDeadError
from aiocb.outputs import GenerationOutput, RequestStatus

if TYPE_CHECKING:
    from aiocb.engine.router import OutputRouter


_FINISHED = RequestStatus.FINISHED  # statuses from this one on are final (an IntEnum)


class Consumer(enum.Enum):
    """Who takes a request's outputs."""

    RESULTS = "results"  # the manager's shared results (get_result(), async for)
    STREAM = "stream"  # one manager.stream(request_id) iterator
    AWAITER = "awaiter"  # generate() / generate_batch() / get_result(request_id)


class RequestHandle:
    """Delivery state of one request."""

    __slots__ = (
        "_more_waiters",
        "_waiter",
        "consumer",
        "delivered_chars",
        "delivered_tokens",
        "error",
        "final_delivered",
        "in_results",
        "on_finish",
        "request",
        "streaming",
        "waker",
    )

    def __init__(
        self,
        request: Request,
        *,
        streaming: bool,
        consumer: Consumer,
        waker: Waker,
        on_finish: Callable[[], object] | None = None,
    ) -> None:
        self.request = request
        #: paces wake-ups (a loop iteration's budget of consumers at a time)
        self.waker = waker
        self.streaming = streaming
        self.consumer = consumer
        #: called once when the request ends (generate_batch's progress bar)
        self.on_finish = on_finish
        #: whether the handle sits in the manager's shared results queue
        self.in_results = False
        #: output tokens in the last output handed out
        self.delivered_tokens = 0
        #: characters of text in the last output handed out
        self.delivered_chars = 0
        self.final_delivered = False
        #: what awaiters raise when the request failed (hard stop, dead engine)
        self.error: BaseException | None = None
        # Who sleeps in wait(): one future each, so that cancelling one waiter never wakes
        # another. Nearly always a single consumer, hence a slot, and a list for the rare
        # second one (two tasks awaiting the same request's result).
        self._waiter: asyncio.Future[None] | None = None
        self._more_waiters: list[asyncio.Future[None]] | None = None

    def has_news(self, *, partial: bool) -> bool:
        """Whether an output is waiting: the final one, or (``partial``) new tokens."""
        if self.final_delivered:
            return False
        request = self.request
        if request.status >= _FINISHED:
            return True
        return partial and len(request.token_ids) - len(request.prompt_ids) > self.delivered_tokens

    def notify(self) -> None:
        """Wake whoever waits in :meth:`wait` (the step loop calls this after each step
        touching the request), through the :class:`~aiocb.engine.turns.Waker`. Consumers
        re-check :meth:`has_news`, so a notification nobody waits for needs no record."""
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():  # (a cancelled waiter)
                self.waker.wake(waiter)
        if self._more_waiters is not None:
            for waiter in self._more_waiters:
                if not waiter.done():
                    self.waker.wake(waiter)
            self._more_waiters = None

    def wait(self) -> asyncio.Future[None]:
        """A future that the next :meth:`notify` completes: ``await handle.wait()`` sleeps
        until then. (A plain future, not a coroutine: a stream waits once per step, and a
        coroutine object per wait is garbage the collector has to walk.)"""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self._waiter is None or self._waiter.done():
            self._waiter = waiter
        elif self._more_waiters is None:
            self._more_waiters = [waiter]
        else:
            # (the waits of callers that gave up, timed out or cancelled, go now, not at the end)
            self._more_waiters = [*(w for w in self._more_waiters if not w.done()), waiter]
        return waiter

    def take(self) -> GenerationOutput:
        """The request's output now; marks it delivered."""
        request = self.request
        output = request.to_output()
        if output.text is not None:
            output.text_delta = output.text[self.delivered_chars :]
            self.delivered_chars = len(output.text)
        self.delivered_tokens = request.num_output_tokens  # (the output's: read now, not made)
        if output.status >= _FINISHED:
            self.final_delivered = True
        return output


class RequestStream:
    """Async iterator over one request's outputs; see :meth:`aiocb.Manager.stream`.

    Also an async context manager; leaving it (or :meth:`aclose`) before the final output
    cancels the request.
    """

    def __init__(self, router: OutputRouter, handle: RequestHandle, loop: asyncio.AbstractEventLoop) -> None:
        self._router = router
        self._handle = handle
        self._loop = loop
        self._done = False

    @property
    def request_id(self) -> str:
        """The id of the streamed request."""
        return self._handle.request.request_id

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> GenerationOutput:
        if self._done:
            raise StopAsyncIteration
        handle = self._handle
        try:
            while not handle.has_news(partial=True):
                if handle.final_delivered:  # (another task iterating this stream took the last output)
                    self._done = True
                    raise StopAsyncIteration
                await handle.wait()
        except asyncio.CancelledError:
            self._close()
            raise
        if handle.error is not None:
            self._close()
            raise fresh_error(handle.error)
        output = self._router.take(handle)
        if handle.final_delivered:
            self._done = True
        return output

    async def aclose(self) -> None:
        """Stop streaming; cancels the request if it has not finished."""
        self._close()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._close()

    def _close(self) -> None:
        if not self._done:
            self._done = True
            self._router.cancel_own(self._handle)

    def __del__(self) -> None:
        # An `async for` left with break drops the iterator without closing it.
        if not self._done and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(functools.partial(self._router.cancel_own, self._handle))


def fresh_error(error: BaseException) -> BaseException:
    """A new exception like ``error`` for one awaiter: sharing one object among awaiters
    would chain every awaiter's frames into one ever-growing traceback."""
    if isinstance(error, EngineDeadError):
        return EngineDeadError(str(error), error.cause)
    return type(error)(*error.args)
