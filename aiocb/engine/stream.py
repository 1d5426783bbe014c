"""A request's output buffer between the step loop and whoever awaits the request.

The step loop only marks a handle as changed, in O(1); the consumer builds the output
from the request's current state when it wakes up. A slow consumer therefore sees its
updates merged (one output carrying every token since its last one) and never makes
the step loop wait or buffer without bound.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable

from aiocb.core.request import Request
from aiocb.outputs import GenerationOutput


class Consumer(enum.Enum):
    """Who takes a request's outputs."""

    RESULTS = "results"  # the manager's shared results (get_result(), async for)
    STREAM = "stream"  # one manager.stream(request_id) iterator
    AWAITER = "awaiter"  # generate() / generate_batch() / get_result(request_id)


class RequestHandle:
    """Delivery state of one request."""

    __slots__ = (
        "_changed",
        "consumer",
        "delivered_chars",
        "delivered_tokens",
        "error",
        "final_delivered",
        "in_results",
        "on_finish",
        "request",
        "streaming",
    )

    def __init__(
        self,
        request: Request,
        *,
        streaming: bool,
        consumer: Consumer,
        on_finish: Callable[[], object] | None = None,
    ) -> None:
        self.request = request
        self.streaming = streaming
        self.consumer = consumer
        #: called once when the request ends (generate_batch's progress bar)
        self.on_finish = on_finish
        #: whether the handle sits in the manager's shared results queue
        self.in_results = False
        #: output tokens in the last output handed out (-1: none handed out yet)
        self.delivered_tokens = -1
        #: characters of text in the last output handed out
        self.delivered_chars = 0
        self.final_delivered = False
        #: what awaiters raise when the request failed (hard stop, dead engine)
        self.error: BaseException | None = None
        self._changed = asyncio.Event()

    def has_news(self, *, partial: bool) -> bool:
        """Whether an output is waiting: the final one, or (``partial``) new tokens."""
        if self.final_delivered:
            return False
        if self.request.is_finished:
            return True
        return partial and self.request.num_output_tokens > max(self.delivered_tokens, 0)

    def notify(self) -> None:
        """Wake the consumer (called by the step loop after each step touching the request)."""
        self._changed.set()

    async def wait(self) -> None:
        """Sleep until the next :meth:`notify`."""
        await self._changed.wait()
        self._changed.clear()

    def take(self) -> GenerationOutput:
        """The request's output now; marks it delivered."""
        output = self.request.to_output()
        if output.text is not None:
            output.text_delta = output.text[self.delivered_chars :]
            self.delivered_chars = len(output.text)
        self.delivered_tokens = len(output.generated_tokens)
        if output.is_finished():
            self.final_delivered = True
        return output
