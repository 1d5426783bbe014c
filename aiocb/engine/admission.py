"""Admission: spreading a burst of new requests over loop iterations, and backpressure.

When thousands of tasks call ``add_request`` at once (``asyncio.gather`` over an agent's
fan-out), their first steps all run in one event-loop iteration: validating and queueing
each takes tens of microseconds, so the whole burst would hold the loop for a long time
and starve every other coroutine. The turnstile lets a fixed number of callers through
per iteration and parks the rest on futures released in later iterations, in order.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections import deque

from aiocb.core.request import Request
from aiocb.core.scheduler import Scheduler

#: How long the callers let through in one loop iteration may hold it before the rest wait
#: for a later one (seconds): an ``add_request`` of token ids takes some 0.1 ms, of a text
#: with a stop string 0.2 ms (64 of those at once held the loop 13 ms).
BUDGET = 0.0005


class Turnstile:
    """At most ``per_iteration`` callers of :meth:`enter` pass per loop iteration, and no
    more once those let through in it have held the loop ``budget`` seconds (each runs
    its synchronous work in the iteration it passes in, one after the other)."""

    def __init__(self, per_iteration: int = 64, budget: float = BUDGET) -> None:
        self.per_iteration = per_iteration
        self.budget = budget
        self._passed = 0
        #: when the first caller let through in this iteration went on (None: none yet)
        self._opened: float | None = None
        self._waiters: deque[asyncio.Future[None]] = deque()
        #: callers released for this iteration and found past its budget: first in the next
        self._deferred: list[asyncio.Future[None]] = []
        #: callers released whose tasks have not resumed yet (no newcomer goes before them)
        self._released = 0
        self._reset_pending = False

    async def enter(self) -> None:
        """Pass now if this iteration still has room, else wait for a later one (FIFO)."""
        waiting = self._waiters or self._deferred or self._released
        if not waiting and self._passed < self.per_iteration and self._in_budget():
            self._passed += 1
            self._schedule_reset()
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._schedule_reset()
        while True:
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    # It was let through: its place goes on in the next iteration, after
                    # those deferred from this one (they came first).
                    self._released -= 1
                    self._schedule_reset()
                raise
            self._released -= 1
            if self._in_budget():
                return
            # (those released before it took the iteration's budget: it goes first in the next)
            waiter = asyncio.get_running_loop().create_future()
            self._deferred.append(waiter)
            self._schedule_reset()

    def _in_budget(self) -> bool:
        """Whether the callers let through in this iteration have left it budget (the first
        always goes on)."""
        now = time.perf_counter()
        if self._opened is None:
            self._opened = now
            return True
        return now - self._opened < self.budget

    def _schedule_reset(self) -> None:
        if not self._reset_pending:
            self._reset_pending = True
            asyncio.get_running_loop().call_soon(self._next_iteration)

    def _next_iteration(self) -> None:
        self._reset_pending = False
        self._passed = 0
        self._opened = None
        if self._deferred:
            self._waiters.extendleft(reversed(self._deferred))
            self._deferred.clear()
        self._release()

    def _release(self) -> None:
        while self._waiters and self._passed < self.per_iteration:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                self._passed += 1
                self._released += 1
        if self._passed or self._waiters:
            self._schedule_reset()


class AdmissionQueue:
    """Backpressure: room in the scheduler's queue (``max_queue_size``, ``max_queued_tokens``),
    handed out to the callers waiting for it by their requests' ``priority`` (lower first,
    as the scheduler admits them), first come, first served within one."""

    def __init__(self, max_queue_size: int, max_queued_tokens: int) -> None:
        self.max_queue_size = max_queue_size
        self.max_queued_tokens = max_queued_tokens
        #: the scheduler of the running session (None between sessions)
        self.scheduler: Scheduler | None = None
        #: the waiting callers, a heap by (priority, arrival)
        self._waiters: list[tuple[int, int, asyncio.Future[None], Request]] = []
        self._arrivals = itertools.count()
        #: room handed to waiters whose callers have not queued their requests yet (they
        #: resume in a later callback): requests (samples counted) and tokens
        self._granted = 0
        self._granted_tokens = 0

    def forget(self) -> None:
        """The loop the waiters lived on was closed under them: drop them, and the room held
        for callers there (they will never queue their requests)."""
        self._waiters.clear()
        self._granted = self._granted_tokens = 0

    def has_room(self, request: Request) -> bool:
        """Whether ``request`` (and its samples) may be queued now, ahead of nobody of its
        priority or a lower value's."""
        if self._waiters and self._waiters[0][0] <= request.params.priority:
            return False  # (first come, first served within a priority)
        return self._fits(request)

    async def wait_for_room(self, request: Request) -> None:
        """Return once ``request`` may be queued, or once its deadline passed."""
        if self.has_room(request):
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (request.params.priority, next(self._arrivals), waiter, request)
        heapq.heappush(self._waiters, entry)
        remaining = None if request.deadline is None else request.deadline - time.perf_counter()
        gave_up = True
        try:
            async with asyncio.timeout(remaining):
                await waiter
            gave_up = False
        except TimeoutError:
            pass  # the caller finds the deadline passed and ends it with finish_reason "timeout"
        finally:
            if entry in self._waiters:
                self._waiters.remove(entry)
                heapq.heapify(self._waiters)
                self.release()
            elif waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                # Its room, held for it since release(): the caller queues the request as
                # soon as this returns, or (timed out, cancelled) hands the room on.
                self._granted -= 1 + len(request.children)
                self._granted_tokens -= request.num_tokens
                if gave_up:
                    self.release()

    def release(self) -> None:
        """Let through the waiters that fit now, in order (call when the queue shrank)."""
        while self._waiters and self._fits(self._waiters[0][3]):
            _, _, waiter, request = heapq.heappop(self._waiters)
            if not waiter.done():
                waiter.set_result(None)
                self._granted += 1 + len(request.children)
                self._granted_tokens += request.num_tokens

    def fail(self, error: BaseException) -> None:
        """Wake every waiter with ``error`` (the manager stops or died)."""
        while self._waiters:
            _, _, waiter, _ = self._waiters.pop()
            # (one whose loop was closed under it can never run again: nothing to wake)
            if not waiter.done() and not waiter.get_loop().is_closed():
                waiter.set_exception(error)

    def _fits(self, request: Request) -> bool:
        scheduler = self.scheduler
        if scheduler is None:  # (between sessions: the manager refuses the caller, or fails its wait)
            return False
        queued = len(scheduler.waiting) + scheduler.num_held_children + self._granted
        # (a group of n samples counts as n requests)
        if self.max_queue_size and queued + 1 + len(request.children) > self.max_queue_size:
            return False
        limit = self.max_queued_tokens
        waiting_tokens = scheduler.num_waiting_tokens + self._granted_tokens
        return not limit or waiting_tokens == 0 or waiting_tokens + request.num_tokens <= limit
