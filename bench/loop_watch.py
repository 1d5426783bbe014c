"""What the benchmarks watch on the event loop: a heartbeat's lateness, the collector's pauses."""

from __future__ import annotations

import asyncio
import gc
import math
import threading
import time


class Heartbeat:
    """A task that sleeps ``interval`` seconds at a time and records how late it wakes.

    The lateness is the time other work held the loop. Use it as ``async with
    Heartbeat() as beat:`` or with :meth:`start` and :meth:`stop`.
    """

    #: whether a heartbeat runs (the window in which a loop trace counts callbacks)
    running = False

    def __init__(self, interval: float = 0.001) -> None:
        self.interval = interval
        #: each beat's lateness, seconds
        self.lags: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _beat(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            start = loop.time()
            await asyncio.sleep(self.interval)
            self.lags.append(max(0.0, loop.time() - start - self.interval))

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._beat(), name="heartbeat")
        Heartbeat.running = True

    async def stop(self) -> None:
        assert self._task is not None
        Heartbeat.running = False
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    async def __aenter__(self) -> Heartbeat:
        self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    def percentile_ms(self, q: float) -> float:
        """The ``q`` quantile of the lateness (1.0: the largest), milliseconds."""
        if not self.lags:
            return math.nan
        ordered = sorted(self.lags)
        return 1000.0 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def summary(self) -> str:
        """``lag p50 …, p99 …, max … ms (N beats)``."""
        return (
            f"lag p50 {self.percentile_ms(0.5):.2f} ms, p99 {self.percentile_ms(0.99):.2f} ms, "
            f"max {self.percentile_ms(1.0):.2f} ms ({len(self.lags)} beats)"
        )


class GCPauses:
    """Garbage-collector pauses while active (every collection, on any thread: it holds the GIL)."""

    def __init__(self) -> None:
        self.max_pause = 0.0
        self.collections = 0
        #: (seconds, generation, thread that triggered it, objects collected), the longest ones
        self.longest: list[tuple[float, int, str, int]] = []
        self._start = 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        pause = time.perf_counter() - self._start
        self.collections += 1
        self.max_pause = max(self.max_pause, pause)
        if pause > 0.001:
            thread = threading.current_thread().name
            self.longest.append((pause, info.get("generation", -1), thread, info.get("collected", 0)))
            self.longest = sorted(self.longest, reverse=True)[:5]

    def __enter__(self) -> GCPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc_info: object) -> None:
        gc.callbacks.remove(self._callback)
