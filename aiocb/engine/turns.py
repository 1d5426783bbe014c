"""Sharing the event loop: aiocb's long loop-side work gives the loop back in slices.

The loop is the user's too. A coroutine woken by a timer runs two loop iterations after
its timer is due, and one iteration runs every ready callback, aiocb's and the user's,
so a heartbeat's lateness is about two iterations' worth of work: each piece of aiocb's
work on the loop (a chunk of a step's bookkeeping, a slice of a list of requests being
added or collected) must stay well under a millisecond for the loop's lag to stay under
two.
"""

from __future__ import annotations

import asyncio
import time

#: How long one piece of aiocb's loop-side work may hold the loop (seconds).
SLICE = 0.00025


class LoopTurn:
    """Gives the loop back once it has been held for :data:`SLICE` seconds.

    Call :meth:`give` between two small units of work (a request, a chunk of rows): it
    returns at once until the slice is used up, then lets every other ready callback run.
    """

    __slots__ = ("_since",)

    def __init__(self) -> None:
        self._since = time.perf_counter()

    async def give(self) -> None:
        """Yield to the loop if this turn has held it for a slice."""
        if time.perf_counter() - self._since >= SLICE:
            await asyncio.sleep(0)
            self._since = time.perf_counter()
