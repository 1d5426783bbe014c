"""Spreading a burst of new requests over loop iterations.

When thousands of tasks call ``add_request`` at once (``asyncio.gather`` over an agent's
fan-out), their first steps all run in one event-loop iteration: validating and queueing
each takes tens of microseconds, so the whole burst would hold the loop for a long time
and starve every other coroutine. The turnstile lets a fixed number of callers through
per iteration and parks the rest on futures released in later iterations, in order.
"""

from __future__ import annotations

import asyncio
from collections import deque


class Turnstile:
    """At most ``per_iteration`` callers of :meth:`enter` pass per loop iteration."""

    def __init__(self, per_iteration: int = 64) -> None:
        self.per_iteration = per_iteration
        self._passed = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._reset_pending = False

    async def enter(self) -> None:
        """Pass now if this iteration still has room, else wait for a later one (FIFO)."""
        if self._passed < self.per_iteration and not self._waiters:
            self._passed += 1
            self._schedule_reset()
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._schedule_reset()
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._release()  # it was let through: hand its place on
            raise

    def _schedule_reset(self) -> None:
        if not self._reset_pending:
            self._reset_pending = True
            asyncio.get_running_loop().call_soon(self._next_iteration)

    def _next_iteration(self) -> None:
        self._reset_pending = False
        self._passed = 0
        self._release()

    def _release(self) -> None:
        while self._waiters and self._passed < self.per_iteration:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                self._passed += 1
        if self._passed:
            self._schedule_reset()
