"""The step coroutine: schedule, run the device work without blocking the loop, deliver.

All request and cache state is owned by the event loop's thread; the only other thread
is one worker that runs the forward pass, and it sees nothing but an immutable
:class:`~aiocb.runner.inputs.StepBatch`. There is no lock anywhere on this path.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from aiocb.core.request import Request
from aiocb.core.scheduler import Scheduler, SchedulerOutput, StepResult
from aiocb.engine.turns import LoopTurn
from aiocb.outputs import FinishReason
from aiocb.runner.model_runner import ModelRunner, PendingStep
from aiocb.runner.step_batch import BatchWriter, StepBatch

logger = logging.getLogger(__name__)

#: Called on the loop thread after each step with (requests that got a token, requests that ended).
StepCallback = Callable[[list[Request], list[Request]], None]

#: The loop is the user's too: a large step's bookkeeping (planning, copying the plan out,
#: taking its tokens in, delivery) goes in chunks of this many requests, and gives the
#: loop back between two chunks once it has held it for a slice (:mod:`aiocb.engine.turns`).
CHUNK = 32


class StepLoop:
    """Runs steps while there is work; sleeps on an event (no polling) when idle."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner | None, on_step: StepCallback) -> None:
        self.scheduler = scheduler
        #: None until the session's runner is built (set before :meth:`run`), and once
        #: :meth:`close` ended the session
        self.runner: ModelRunner | None = runner
        self._on_step = on_step
        self._work = asyncio.Event()
        self._draining = False
        self._deadlines: list[tuple[float, int, Request]] = []
        self._tie = itertools.count()
        self._executor: ThreadPoolExecutor | None = None
        self._waiter: ThreadPoolExecutor | None = None
        #: whether requests ended (were cancelled) while the last plan was made and copied
        self._ended_while_planning = False
        self.num_steps = 0
        self.busy_seconds = 0.0
        #: the last steps as ``(finished at, rows, query tokens)``, for step-time statistics
        self.step_log: deque[tuple[float, int, int]] = deque(maxlen=4096)
        #: requests that ended, which the engine holds no more but here (see :meth:`_let_go`)
        self._ended: deque[Request] = deque()

    def add(self, request: Request, children: Sequence[Request] = ()) -> None:
        """Queue a request (with more samples of its prompt, ``children``) and wake the loop."""
        self.scheduler.add(request, children)
        for r in (request, *children):
            if r.deadline is not None:
                heapq.heappush(self._deadlines, (r.deadline, next(self._tie), r))
        self._work.set()

    def finish(self, request: Request, reason: FinishReason, **kwargs: object) -> None:
        """End a request now (cancel, abort); its blocks are free when this returns, or once
        the plan being copied for the device lets them go (see ``Scheduler.hold_blocks``)."""
        self.scheduler.finish(request, reason, time.perf_counter(), **kwargs)  # type: ignore[arg-type]
        if self.runner is not None:
            self.runner.notify("cancel", request.request_id, reason.value)

    def close(self) -> None:
        """Forget the runner and the step callback once the session is over.

        The callback is a bound method of the manager, which holds this loop: a reference
        cycle that only the cyclic garbage collector could free, and never if the manager
        was frozen (``gc.freeze``). Dropping both lets reference counting free the runner
        and its cache as soon as the manager lets go of them. The scheduler stays, for the
        statistics of the ended session.
        """
        self.runner = None
        self._on_step = _ignore_step
        self._deadlines.clear()
        self._ended.clear()  # (a step failed or the run was cancelled before they were let go)

    def drain(self) -> None:
        """Let :meth:`run` return once every queued and running request has ended."""
        self._draining = True
        self._work.set()

    async def run(self) -> None:
        """The step loop. Returns after :meth:`drain` once idle; raises if a step fails.

        With async batching the device always has the next step queued: step N+1 is
        planned (its decode tokens left on the device) and launched before the loop
        collects step N's tokens, so the host's bookkeeping of step N overlaps the device
        work of step N+1.
        """
        loop = asyncio.get_running_loop()
        runner = self.runner
        if runner is None:
            raise RuntimeError("this step loop has no runner: it was closed (a new session needs a new StepLoop)")
        _start_openmp_team()  # (before the step thread starts its own)
        bind = runner.bind_thread
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aiocb-step", initializer=bind)
        # Waiting for a GPU step's results must not queue behind the next launch.
        self._waiter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aiocb-wait", initializer=bind)
        in_flight: tuple[SchedulerOutput, asyncio.Future[PendingStep]] | None = None
        #: a step launched while the one before is collected (in_flight's next, once that is)
        launched: asyncio.Future[PendingStep] | None = None
        pipelined = runner.async_batching
        idle = False  # whether the loop ends with nothing left in the worker threads
        # (the step thread's warm-up: graph captures, which nothing can interrupt midway)
        warming = self._executor.submit(runner.warm_up)
        try:
            await asyncio.wrap_future(warming)
            self.scheduler.verify_cost = runner.verify_cost  # (measured by the warm-up)
            while True:
                await self.expire_deadlines()
                if not self.scheduler.has_work and in_flight is None:
                    if self._draining:
                        idle = True
                        return
                    if self._going_idle(runner.writer):
                        await self._let_go()
                        continue  # (work may have come meanwhile)
                    self._work.clear()
                    await self._work.wait()
                    continue
                planned = await self._plan(runner.writer, pipelined and in_flight is not None)
                output, batch = planned if planned is not None else (None, None)
                planned = None
                if output is not None and batch is None:
                    if in_flight is None:
                        if self._ended_while_planning:
                            # (the plan lost its rows to cancellations made while it paused:
                            # the plan was of the requests before; the next is of those left)
                            continue
                        raise RuntimeError("the scheduler planned an empty step while requests were pending")
                    output = None  # everything left waits on the step in flight
                started = time.perf_counter()
                if pipelined:
                    launched = None
                    if batch is not None:
                        launched = loop.run_in_executor(self._executor, runner.launch, batch)
                    done, result = None, None
                    if in_flight is not None:
                        done = in_flight[0]
                        result = await self._collect(runner, await in_flight[1])
                    in_flight = None if launched is None or output is None else (output, launched)
                    launched = None
                else:
                    assert output is not None and batch is not None
                    result = await loop.run_in_executor(self._executor, runner.execute, batch)
                    done = output
                now = time.perf_counter()
                self.busy_seconds += now - started
                if done is not None and result is not None:
                    self.num_steps += 1
                    self.step_log.append((now, len(done.scheduled), done.num_tokens))
                    turn = LoopTurn()
                    for updated, finished in self.scheduler.update_in_chunks(done, result, now, CHUNK):
                        self._on_step(updated, finished)
                        await turn.give()
                    updated = finished = []
                    # (the step's plan and results hold the requests that ended in it: not
                    # any more, or they would be the last hold on all of them at once)
                    done = result = None
                    if not pipelined:
                        output = batch = None
                    await self._let_go()
                    await asyncio.sleep(0)  # (once per step whatever its size)
        finally:
            if not warming.done():
                # Cancelled during the warm-up: the session's end (detaching the model's
                # attention) must wait until the step thread has left the model.
                await asyncio.wait([asyncio.wrap_future(warming)])
            # (the loop failed with a step in flight, or one launched while the one before
            # was being collected when that failed)
            for future in (None if in_flight is None else in_flight[1], launched):
                if future is None:
                    continue
                if future.done() and not future.cancelled():
                    future.exception()  # retrieved: the loop's own error is the one that matters
                else:
                    future.cancel()
            # A worker thread keeps its last work item (the runner's bound method) until it
            # takes the next one from its queue: when idle, wait for both threads to exit
            # (they have nothing left but that, a fraction of a millisecond), so the
            # runner and its cache can be freed as soon as the session ends. After a
            # failure a step may still be running: do not block the loop on it.
            self._executor.shutdown(wait=idle)
            self._waiter.shutdown(wait=idle)
            self._executor = self._waiter = None

    async def _plan(self, writer: BatchWriter, pipelined: bool) -> tuple[SchedulerOutput, StepBatch | None] | None:
        """Plan the next step and copy it out (None without work; no copy for an empty plan),
        giving the loop back every slice (:class:`~aiocb.engine.turns.LoopTurn`).

        Requests may end meanwhile (another coroutine cancels them): the scheduler keeps
        their blocks until the copy is complete, as the plan may still hold them.
        """
        scheduler = self.scheduler
        if not scheduler.has_work:
            return None
        scheduler.hold_blocks()
        try:
            turn = LoopTurn()
            planner = scheduler.plan(CHUNK)
            while True:
                try:
                    next(planner)
                except StopIteration as done:
                    output: SchedulerOutput = done.value
                    break
                await turn.give()
            if output.is_empty:
                return output, None
            rows = len(output.scheduled)
            departed = scheduler.take_departed()
            writer.begin(output, departed, pipelined)
            for stop in range(CHUNK, rows, CHUNK):
                writer.add_rows(stop)
                await turn.give()
            writer.add_rows(rows)
            batch = writer.finish()
            self._ended.extend(request for request in departed if request.is_finished)
            return output, batch
        finally:
            self._ended_while_planning = scheduler.release_blocks() > 0

    def _going_idle(self, writer: BatchWriter) -> bool:
        """With nothing left to do, give back the slots of the requests that left since the
        last plan and queue those that ended to be let go of (else they, and everything they
        recorded, would be held until a next request comes); whether any are queued."""
        departed = self.scheduler.take_departed()
        if departed:
            writer.release(departed)
            self._ended.extend(request for request in departed if request.is_finished)
        return bool(self._ended)

    async def _let_go(self) -> None:
        """Drop the engine's last references to requests that ended, one request at a time,
        giving the loop back every slice.

        A request is freed with everything it recorded when its last holder lets go:
        when that was the step loop's plan or the writer's list of departed requests, all
        of a step's went at once (the 64 samples of a chat completion with 20 top
        logprobs for 512 tokens each: 32,768 dictionaries, a 19 ms hold). Here each goes
        on its own, unless its consumer still holds it, who then lets it go on its own.
        """
        ended = self._ended
        turn = LoopTurn()
        while ended:
            ended.popleft()
            await turn.give()

    async def _collect(self, runner: ModelRunner, pending: PendingStep) -> StepResult:
        """A launched step's results; a device step is waited for off the loop thread."""
        if pending.event is None:
            return runner.collect(pending)  # a CPU step: already computed
        assert self._waiter is not None
        return await asyncio.get_running_loop().run_in_executor(self._waiter, runner.collect, pending)

    async def expire_deadlines(self) -> None:
        """End the requests whose deadline has passed (the loop does before each plan),
        giving the loop back every slice (4,000 at once held it 2.7 ms)."""
        turn = LoopTurn()
        while self.expire_some(CHUNK):
            await turn.give()

    def expire_some(self, most: int | None = None) -> bool:
        """End up to ``most`` (None: all) of the requests whose deadline has passed; whether
        more are left."""
        if not self._deadlines:
            return False
        scheduler = self.scheduler
        live = len(scheduler.running) + len(scheduler.waiting) + scheduler.num_held_children
        if len(self._deadlines) > 2 * live + 64:
            # Most entries are of requests that ended before their deadline: dropped, or a
            # long timeout would keep every finished request (its tokens, its text) alive.
            # (and those ended go one at a time, as the others that ended: see _let_go)
            kept: list[tuple[float, int, Request]] = []
            for entry in self._deadlines:
                if entry[2].is_finished:
                    self._ended.append(entry[2])
                else:
                    kept.append(entry)
            self._deadlines = kept
            heapq.heapify(kept)
        now = time.perf_counter()
        expired: list[Request] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            if most is not None and len(expired) == most:
                break
            _, _, request = heapq.heappop(self._deadlines)
            if not request.is_finished:
                self.scheduler.finish(request, FinishReason.TIMEOUT, now)
                expired.append(request)
                if self.runner is not None:
                    self.runner.notify("cancel", request.request_id, FinishReason.TIMEOUT.value)
        if expired:
            self._on_step([], expired)
        return bool(self._deadlines) and self._deadlines[0][0] <= now


def _start_openmp_team() -> None:
    """Make sure the event loop's thread has an OpenMP team of its own (torch's, once per thread).

    After each parallel region libgomp's idle workers spin for a long while (some 300,000
    rounds) before they sleep, unless it manages more threads than there are CPUs, when
    they spin a thousand. The step thread's team alone never counts as more; with a team of
    the loop thread's counted too, it does, and the step thread's idle OpenMP workers then
    leave the cores to the event loop at once instead of spinning through its turns. A
    model built or loaded on this thread has usually made the team already (any large
    tensor operation does); one built of small tensors has not. Measured on the 2-core
    development machine, 1,024 rows of the near-zero-compute model: loop lag p99 5.1-6.8 ms
    without the team, 1.5-2.1 ms with it.
    """
    if torch.get_num_threads() > 1:
        torch.empty(1 << 18).fill_(0.0)  # (large enough that torch runs it in parallel)


def _ignore_step(updated: list[Request], finished: list[Request]) -> None:
    """The step callback of a closed step loop."""
