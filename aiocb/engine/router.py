"""Where each request's outputs go: its awaiter, its stream, or the shared results.

The :class:`OutputRouter` owns every live request's :class:`RequestHandle`. The step loop
tells it which requests changed (:meth:`OutputRouter.on_step`); consumers take outputs
from it. Every way a request can end early (a cancellation, a hard stop, a dead engine)
goes through one path, :meth:`OutputRouter.end`: the scheduler frees its blocks, and its
consumer is told, with an error where it must raise one.
"""

from __future__ import annotations

import asyncio
import functools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from aiocb.core.request import Request
from aiocb.engine.step_loop import StepLoop
from aiocb.engine.stream import Consumer, RequestHandle, fresh_error
from aiocb.engine.turns import Waker, each_in_turns
from aiocb.errors import EngineDeadError, InvalidRequestError, RequestAbortedError
from aiocb.outputs import FinishReason, GenerationOutput, RequestStatus

#: Samples of a request that :meth:`OutputRouter.cancel_with_samples` ends at once (the
#: rest in a task of their own, a slice of the loop at a time).
SAMPLES_AT_ONCE = 64


@dataclass(slots=True)
class _Family:
    """The ids of a request's samples (its children, in order), and how many of their
    handles live."""

    children: dict[str, None]
    live: int


class OutputRouter:
    """Delivery state of every live request, and the shared results queue."""

    def __init__(self, on_room: Callable[[], None]) -> None:
        #: called when requests left the scheduler's queue (admission may let others in)
        self._on_room = on_room
        #: the running session's step loop (None between sessions)
        self.steps: StepLoop | None = None
        self._handles: dict[str, RequestHandle] = {}
        #: the samples' ids (``n``: children) of a request by its id, with how many of their
        #: handles live: found when its own handle has gone (its output taken)
        self._families: dict[str, _Family] = {}
        self._results: deque[RequestHandle] = deque()
        #: tasks ending the samples of a request past the first SAMPLES_AT_ONCE
        self._cancelling: set[asyncio.Task[None]] = set()
        self.results_changed = asyncio.Event()
        self._waker = Waker()

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._handles

    def get(self, request_id: str) -> RequestHandle | None:
        """The handle of a live (or finished but unread) request."""
        return self._handles.get(request_id)

    def register(
        self,
        requests: Sequence[Request],
        *,
        streaming: bool,
        consumer: Consumer,
        on_finish: Callable[[], object] | None = None,
    ) -> list[RequestHandle]:
        """Handles for new requests (checked free of id clashes first: all or none)."""
        for request in requests:
            if request.request_id in self._handles:
                raise InvalidRequestError(f"request id {request.request_id!r} is already in use by a live request")
        waker = self._waker
        handles = [
            RequestHandle(r, streaming=streaming, consumer=consumer, waker=waker, on_finish=on_finish) for r in requests
        ]
        for handle in handles:
            request = handle.request
            self._handles[request.request_id] = handle
            if request.children:  # (registered with it: it comes first in its group)
                children = dict.fromkeys(child.request_id for child in request.children)
                self._families[request.request_id] = _Family(children, len(children))
        return handles

    def _forget(self, request_id: str) -> None:
        """Drop the handle of ``request_id`` (if any): nobody reads its request any more."""
        handle = self._handles.pop(request_id, None)
        parent = None if handle is None else handle.request.sample_of
        if parent is None:
            return
        family = self._families.get(parent)
        # (not a family that a later request with its parent's id made: that one's own samples)
        if family is not None and request_id in family.children:
            family.live -= 1
            if not family.live:
                del self._families[parent]

    # ------------------------------------------------------------------ from the step loop

    def on_step(self, updated: list[Request], finished: list[Request]) -> None:
        """After a step: wake the consumers of the requests it touched."""
        handles, stream = self._handles, Consumer.STREAM
        for request in updated:
            handle = handles.get(request.request_id)
            # (a new token is news only to a stream: awaiters and the shared results of
            # whole outputs wait for the final one, so no call for theirs; an ended
            # request is in `finished`)
            if handle is None or request.is_finished:
                continue
            if handle.consumer is stream:
                handle.notify()
            elif handle.streaming:
                self.deliver(handle)
        for request in finished:
            handle = handles.get(request.request_id)
            if handle is not None:
                self.deliver(handle)
        self._on_room()

    def deliver(self, handle: RequestHandle) -> None:
        """Tell whoever consumes ``handle`` that it changed (O(1), never blocks).

        Awaiters of a final output are only woken by it, not by every token.
        """
        finished = handle.request.is_finished
        if finished and handle.on_finish is not None:
            handle.on_finish()
            handle.on_finish = None
        queue = handle.consumer is Consumer.RESULTS and not handle.in_results
        if queue and handle.has_news(partial=handle.streaming):
            handle.in_results = True
            self._results.append(handle)
            self.results_changed.set()
        if finished or handle.consumer is Consumer.STREAM or handle.streaming:
            handle.notify()

    # ------------------------------------------------------------------ ending requests

    def end(
        self,
        handle: RequestHandle,
        reason: FinishReason,
        *,
        status: RequestStatus,
        error: str | None = None,
        raises: BaseException | None = None,
        forget: bool = False,
        queue: bool = True,
    ) -> None:
        """End a live request now and notify its consumer: the one path every early end takes.

        Its blocks are free when this returns, or, when a plan being copied for the device
        still holds them, as soon as that copy is complete (well under a millisecond).
        ``raises`` is what its consumer raises instead of reading an output; with
        ``forget`` nobody reads it any more (its handle goes); without ``queue`` its output
        does not join the shared results (only its own consumers are woken).
        """
        request = handle.request
        if not request.is_finished and self.steps is not None:
            self.steps.finish(request, reason, status=status, error=error)
        if raises is not None:
            handle.error = raises
        if forget:
            self._forget(request.request_id)
            handle.notify()  # (another task waiting on it: it finds the request ended)
        elif queue:
            self.deliver(handle)
        else:
            handle.notify()
        self._on_room()  # (the request left the queue: room for a caller waiting for it, now)

    def cancel(self, request_id: str, *, forget: bool = False) -> bool:
        """Cancel a live request; whether there was one to cancel."""
        handle = self._handles.get(request_id)
        if handle is None or handle.request.is_finished:
            if forget:
                self._forget(request_id)
            return False
        self.end(handle, FinishReason.CANCELLED, status=RequestStatus.CANCELLED, forget=forget)
        return True

    def cancel_with_samples(self, request_id: str) -> bool:
        """Cancel a live request and its other samples (``n``: its children, which share
        none of its consumers); whether any was live.

        The first :data:`SAMPLES_AT_ONCE` samples end now, the rest a slice of the loop at
        a time in a task of their own (each takes some 10 µs: 4,096 held the loop 34 ms).
        """
        handle = self._handles.get(request_id)
        cancelled = self.cancel(request_id)
        if handle is not None:
            samples = [child.request_id for child in handle.request.children]
        else:  # (its own output was taken already: its samples, if any live)
            family = self._families.get(request_id)
            samples = [] if family is None else list(family.children)
        is_live = functools.partial(self._is_sample_of, request_id)
        for sample in samples[:SAMPLES_AT_ONCE]:
            cancelled = (is_live(sample) and self.cancel(sample)) or cancelled
        rest = samples[SAMPLES_AT_ONCE:]
        if any(map(is_live, rest)):  # (the first one looked at, as a rule)
            end = functools.partial(self._cancel_sample_of, request_id)
            task = asyncio.get_running_loop().create_task(each_in_turns(rest, end))
            self._cancelling.add(task)  # (held until done: the loop keeps only a weak reference)
            task.add_done_callback(self._cancelling.discard)
            return True
        return cancelled

    def _is_sample_of(self, request_id: str, sample_id: str) -> bool:
        """Whether ``sample_id`` names a live sample of ``request_id`` (not a later request
        that took its id)."""
        live = self._handles.get(sample_id)
        return live is not None and live.request.sample_of == request_id and not live.request.is_finished

    def _cancel_sample_of(self, request_id: str, sample_id: str) -> None:
        if self._is_sample_of(request_id, sample_id):
            self.cancel(sample_id)

    def cancel_own(self, handle: RequestHandle) -> None:
        """Cancel and forget ``handle``'s request while the handle is still its id's: a
        caller cleaning up touches only what it made, never a later request reusing the id."""
        request_id = handle.request.request_id
        if self._handles.get(request_id) is handle:
            self.cancel(request_id, forget=True)

    def abort_all(self, reason: str) -> None:
        """End every live request as aborted; awaiters and streams raise RequestAbortedError."""
        abort = functools.partial(self._abort, error=RequestAbortedError(reason))
        for handle in list(self._handles.values()):
            abort(handle)

    async def abort_all_in_turns(self, reason: str) -> None:
        """:meth:`abort_all`, giving the loop back whenever a slice of it is used (a hard stop
        with 4,096 requests live held it 18 ms in one pass)."""
        abort = functools.partial(self._abort, error=RequestAbortedError(reason))
        await each_in_turns(list(self._handles.values()), abort)

    def _abort(self, handle: RequestHandle, *, error: RequestAbortedError) -> None:
        if not handle.request.is_finished:
            raises = error if handle.consumer is not Consumer.RESULTS else None
            reason = str(error)
            self.end(handle, FinishReason.ABORTED, status=RequestStatus.FAILED, error=reason, raises=raises)

    def fail_all(self, error: EngineDeadError, cause: BaseException) -> None:
        """The engine died: every consumer, of a finished request too, raises ``error``
        (the shared results raise it too, once drained)."""
        reason, failed = FinishReason.ERROR, RequestStatus.FAILED
        for handle in list(self._handles.values()):
            self.end(handle, reason, status=failed, error=str(cause), raises=error, queue=False)
        self.results_changed.set()

    # ------------------------------------------------------------------ to consumers

    def take(self, handle: RequestHandle) -> GenerationOutput:
        """The request's output now; forgets the handle once the final output is out."""
        output = handle.take()
        if handle.final_delivered:
            self._forget(handle.request.request_id)
        return output

    def claim_for_stream(self, request_id: str) -> RequestHandle:
        """Make a request's outputs go to one stream (from the shared results)."""
        handle = self._handles.get(request_id)
        if handle is None:
            raise InvalidRequestError(f"no pending request with id {request_id!r}")
        if handle.consumer is not Consumer.RESULTS:
            raise InvalidRequestError(f"request {request_id!r} already has a consumer ({handle.consumer.value})")
        handle.consumer = Consumer.STREAM
        self._drop_from_results(handle)
        return handle

    async def next_shared(self, check: Callable[[], bool]) -> GenerationOutput | None:
        """The next output of the shared results; None once ``check()`` (which raises if the
        engine died) says no more will come."""
        while not self._results:
            if not check():
                return None
            self.results_changed.clear()
            await self.results_changed.wait()
        handle = self._results.popleft()
        handle.in_results = False
        return self.take(handle)

    async def next_of(self, request_id: str) -> GenerationOutput:
        """The next output of one request (its final one unless it streams)."""
        handle = self._handles.get(request_id)
        if handle is None:
            raise InvalidRequestError(f"no pending request with id {request_id!r}")
        while True:
            # (checked again after each wait: a stream may have claimed the request meanwhile)
            if handle.consumer is Consumer.STREAM:
                raise InvalidRequestError(f"request {request_id!r} is consumed by a stream")
            if handle.consumer is Consumer.AWAITER:
                raise InvalidRequestError(
                    f"request {request_id!r} is awaited by the generate() or generate_batch() call that made it"
                )
            if handle.has_news(partial=handle.streaming):
                break
            if handle.final_delivered:  # (another caller waiting on the same request took it)
                raise InvalidRequestError(f"request {request_id!r} ended and its final output went to another caller")
            await handle.wait()
        if handle.error is not None:
            self._forget(request_id)
            raise fresh_error(handle.error)
        self._drop_from_results(handle)
        return self.take(handle)

    async def final(self, handle: RequestHandle) -> GenerationOutput:
        """The request's final output; cancelling the waiting task cancels the request."""
        try:
            while not handle.has_news(partial=False):
                await handle.wait()
        except asyncio.CancelledError:
            self.cancel_own(handle)
            raise
        if self._handles.get(handle.request.request_id) is handle:
            self._forget(handle.request.request_id)
        if handle.error is not None:
            raise fresh_error(handle.error)
        return handle.take()

    def _drop_from_results(self, handle: RequestHandle) -> None:
        if handle.in_results:
            self._results.remove(handle)
            handle.in_results = False
