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
import heapq
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")

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


#: Items sorted in one go by :func:`sorted_in_turns` (about 1 ms of list comparisons).
_RUN = 1024


async def sorted_in_turns(items: Sequence[T], key: Callable[[T], Any], turn: LoopTurn) -> list[T]:
    """``sorted(items, key=key)``, a slice of the loop at a time: runs of :data:`_RUN` items
    sorted one by one, then merged an item at a time (in one call, sorting 20,000 prompts
    by their token ids held the loop some 30 ms). Stable, as ``sorted``."""
    runs: list[list[T]] = []
    for start in range(0, len(items), _RUN):
        runs.append(sorted(items[start : start + _RUN], key=key))
        await turn.give()
    if len(runs) < 2:
        return runs[0] if runs else []
    merged: list[T] = []
    for item in heapq.merge(*runs, key=key):  # (equal keys: the earlier run's first, as stable)
        merged.append(item)
        await turn.give()
    return merged


async def each_in_turns(items: Iterable[T], action: Callable[[T], object]) -> None:
    """``action`` on each of ``items``, giving the loop back whenever a slice of it is used
    (cancelling a batch of 20,000 requests in one pass held it 79 ms); interrupted (its
    caller cancelled again while it cleans up), on the rest at once, then the error."""
    turn = LoopTurn()
    rest = iter(items)
    try:
        for item in rest:
            action(item)
            await turn.give()
    except BaseException:
        for item in rest:
            action(item)
        raise


async def release(items: list[Any]) -> None:
    """Empty ``items``, last first, giving the loop back whenever a slice of it is used: an
    item that is the last hold on much (a choice's logprobs, a finished request) is freed as
    it is taken out."""
    turn = LoopTurn()
    while items:
        items.pop()
        await turn.give()


#: Items :func:`release_slices` frees at a time (a fraction of a millisecond of small ones).
RELEASED_AT_ONCE = 1 << 15


async def release_slices(items: list[Any]) -> None:
    """Empty ``items`` of small values (ids, numbers), :data:`RELEASED_AT_ONCE` at a time,
    giving the loop back between: freed at once, millions of them hold it for milliseconds."""
    while items:
        del items[-RELEASED_AT_ONCE:]
        await asyncio.sleep(0)


#: Consumer work that one loop iteration of a :class:`Waker`'s wake-ups may take (seconds).
WAKE_BUDGET = 2 * SLICE
#: Bounds of a :class:`Waker`'s batch: at least this many a turn, however slow the
#: consumers seem (the iteration's other work is charged to them too), so that a
#: thousand of them still wake within a few hundred iterations; at most the other.
_MIN_BATCH, _MAX_BATCH = 8, 512


class Waker:
    """Wakes the consumers a step touched a loop iteration's budget at a time.

    A step can touch a thousand requests. Woken at once, all their consumers run in the
    same loop iteration: a few microseconds each for a stream that only takes its output,
    but a server's stream detokenizes, matches stop strings and formats its chunk, tens of
    microseconds each, and a thousand of those held the loop for tens of milliseconds.
    The waker completes the sleepers' futures in batches, one batch an iteration, each
    sized from what the last batch cost (the time from one batch to the next, charged
    to its consumers) so that an iteration's share stays near :data:`WAKE_BUDGET`.
    """

    __slots__ = ("_batch", "_pending", "_scheduled", "_since", "_woken")

    def __init__(self) -> None:
        self._pending: deque[asyncio.Future[None]] = deque()
        #: the loop a run is scheduled on (None: none is); a persistent manager's next
        #: loop schedules its own
        self._scheduled: asyncio.AbstractEventLoop | None = None
        self._batch = _MIN_BATCH  # (grows once a batch is measured: consumers may be slow)
        #: when the last batch was woken, and how many it woke (0: none to measure)
        self._since = 0.0
        self._woken = 0

    def wake(self, waiter: asyncio.Future[None]) -> None:
        """Complete ``waiter`` (with None) in this batch or a later one."""
        loop = waiter.get_loop()
        if loop.is_closed():
            return  # (its consumer's loop was closed under it: nothing runs there any more)
        self._pending.append(waiter)
        if self._scheduled is not loop:
            self._scheduled = loop
            loop.call_soon(self._run, loop)

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._scheduled is not loop:
            return  # (scheduled on an earlier loop, which another has replaced)
        now = time.perf_counter()
        if self._woken:
            cost = (now - self._since) / self._woken
            self._batch = min(_MAX_BATCH, max(_MIN_BATCH, int(WAKE_BUDGET / cost) if cost > 0 else _MAX_BATCH))
        pending = self._pending
        woken = 0
        while pending and woken < self._batch:
            waiter = pending.popleft()
            # (its consumer may have been cancelled meanwhile, or have lived on another loop)
            if not waiter.done() and waiter.get_loop() is loop:
                waiter.set_result(None)
                woken += 1
        self._since, self._woken = time.perf_counter(), woken
        if pending or woken:
            # Scheduled after the woken tasks' steps: the next run measures them.
            loop.call_soon(self._run, loop)
        else:
            self._scheduled = None
