"""Tensor parallelism on rank 0: the runner whose every step also goes to the follower ranks.

On rank 0 one daemon thread sends every message and runs every forward pass, in order,
so a step is never started that the followers did not receive (a gloo send completes
only once the receiver has it). ``cpu_group_timeout`` bounds each collective of the CPU
group, and rank 0 waits at most that long for any step, so a dead or hung rank fails
the others with :class:`~aiocb.DistributedError` instead of a hang; rank 0 sends a
heartbeat after a quarter of it without traffic, so an idle server does not time out.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import pickle
import queue
import threading
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from aiocb.config import ContinuousBatchingConfig
from aiocb.core.scheduler import StepResult
from aiocb.errors import DistributedError, InvalidConfigError, InvalidRequestError
from aiocb.runner.memory import CachePlan
from aiocb.runner.model_runner import ModelRunner, PendingStep
from aiocb.runner.step_batch import StepBatch
from aiocb.runner.tp_channel import ControlChannel, Event, control_channel, is_comm_failure, own_plan
from aiocb.runner.tp_layout import TensorParallelLayout, tensor_parallel_layout
from aiocb.speculative import SpeculativeConfig

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Longest wait for the followers to take the shutdown message at interpreter exit.
_EXIT_TIMEOUT = 10.0


def _followers(layout: TensorParallelLayout) -> str:
    """The follower ranks, for messages: gloo does not say which peer failed."""
    if len(layout.followers) == 1:
        return f"rank {layout.followers[0]}"
    return "one of ranks " + ", ".join(str(rank) for rank in layout.followers)


class Driver:
    """Rank 0's end of the control channel: one thread sends every message and runs every
    forward pass, in order, and sends heartbeats when there is nothing else to send."""

    def __init__(self, channel: ControlChannel, *, after_shutdown: bool = False) -> None:
        self.channel = channel
        #: whether shutdown() released the followers before this driver (their not answering
        #: may then mean they never called run_follower() again: said in the error)
        self.after_shutdown = after_shutdown
        #: whether shutdown() released the followers through this driver
        self.released = False
        #: events for the followers, carried by the next message (appended from any thread)
        self.events: deque[Event] = deque()
        #: why the group is unusable (a rank failed, or a step failed half-way); None while healthy
        self.failure: DistributedError | None = None
        self.closed = False
        #: the runner whose cache the followers hold (the driver thread changes it while the
        #: group is usable, or a runner ending its session, which has no job queued)
        self.current: ModelRunner | None = None
        #: the runner whose manager's session is starting or running: the followers hold one
        #: runner at a time, so no other may start one (weak: an abandoned session's runner
        #: must not hold the ranks once nothing else refers to it)
        self._owner: weakref.ref[ModelRunner] | None = None
        self._owner_lock = threading.Lock()
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name="aiocb-tp-driver", daemon=True)
        self._thread.start()

    @property
    def usable(self) -> bool:
        """Whether messages can still be sent."""
        return self.failure is None and not self.closed

    def call(self, what: str, job: Callable[[], T]) -> T:
        """Run ``job`` on the driver thread and wait at most ``cpu_group_timeout`` for it."""
        if self.failure is not None:
            raise self.failure
        if self.closed:
            raise _released()
        future: Future[T] = Future()
        self._jobs.put((job, future))
        timeout = self.channel.timeout
        try:
            return future.result(timeout=timeout)
        except FutureTimeoutError:
            self._fail(
                DistributedError(
                    f"tensor-parallel {_followers(self.channel.layout)} stopped responding (hung or died)"
                    f"{self._since_shutdown()}: {what} did not complete within cpu_group_timeout={timeout} s "
                    "(rank 0's own share of it counts too: raise cpu_group_timeout if this rank's steps are that "
                    "slow); restart every rank"
                )
            )
            assert self.failure is not None
            raise self.failure from None

    def post(self, what: str, job: Callable[[], None]) -> None:
        """Queue ``job`` on the driver thread without waiting for it: for messages whose
        answer nobody needs, sent from the event loop (ending a session must not hold the
        loop for up to ``cpu_group_timeout`` when a follower hangs). A failure is logged,
        and the next :meth:`call` raises it; jobs run in order, so a later call's job runs
        after this one."""
        if not self.usable:
            return
        future: Future[None] = Future()
        future.add_done_callback(functools.partial(_log_failure, what))
        self._jobs.put((job, future))

    def _since_shutdown(self) -> str:
        """What an error about followers not answering adds when shutdown() released them."""
        if not self.after_shutdown:
            return ""
        return " (aiocb.distributed.shutdown() released them before: did they call run_follower() again?)"

    def owns(self, runner: ModelRunner) -> bool:
        """Whether ``runner``'s manager holds the session."""
        return self._owner is not None and self._owner() is runner

    def claim(self, runner: ModelRunner) -> None:
        """Give ``runner``'s manager the session, or refuse it (another one's is live)."""
        with self._owner_lock:
            owner = None if self._owner is None else self._owner()
            if owner is not None and owner is not runner:
                raise InvalidRequestError(
                    f"another aiocb.Manager's session runs on this tensor-parallel model (ranks "
                    f"{list(self.channel.layout.ranks)}): one manager at a time per tensor-parallel process group; "
                    "stop that one before starting this one"
                )
            self._owner = weakref.ref(runner)

    def disown(self, runner: ModelRunner) -> None:
        """End ``runner``'s hold on the session (no-op if it has none)."""
        with self._owner_lock:
            if self.owns(runner):
                self._owner = None

    def send(self, kind: str, *payload: Any) -> None:
        """Broadcast one message with the pending events (driver thread only)."""
        if self.closed:  # (a step queued while shutdown() released the followers)
            raise _released()
        events: list[Event] = []
        while self.events:
            events.append(self.events.popleft())
        try:
            self.channel.broadcast((kind, *payload, events))
        except Exception as exc:
            raise DistributedError(
                f"tensor-parallel {_followers(self.channel.layout)} stopped responding (died or hung)"
                f"{self._since_shutdown()}: rank 0 could not send it {kind!r} ({exc})"
            ) from exc

    def close(self, timeout: float | None = None) -> None:
        """Send ``shutdown`` (if the group is healthy) and end the driver thread."""
        if self.closed:
            return
        if not dist.is_initialized():
            logger.warning(
                "the process group was destroyed before aiocb.distributed.shutdown(): the follower ranks "
                "fail instead of returning"
            )
        elif self.failure is None:
            future: Future[None] = Future()
            self._jobs.put((self._release_followers, future))
            try:
                future.result(timeout=timeout if timeout is not None else self.channel.timeout)
            except (FutureTimeoutError, DistributedError) as exc:
                logger.warning("could not release the follower ranks: %s", exc)
        self.closed = True
        self._forget_runners()
        self._end_thread(wait=self.failure is None)

    def _release_followers(self) -> None:
        """The shutdown job: closed at once, so that no job after it sends to the followers."""
        self.send("shutdown")
        self.closed = self.released = True

    def retire(self) -> None:
        """End the driver thread without a word to the followers (they no longer listen)."""
        self.closed = True
        self._forget_runners()
        self._end_thread()

    def _forget_runners(self) -> None:
        """A closed driver refers to no runner: a destroyed manager's cache is freed with it."""
        self.current = None

    def _end_thread(self, wait: bool = True) -> None:
        """Stop the driver thread; with ``wait``, also join it (a few seconds at most): a
        thread still inside torch.distributed while the interpreter exits (after
        destroy_process_group(), at the end of a script) can abort the process. A failed
        group's thread may be stuck in a send to a dead rank: it is not waited for."""
        self._jobs.put(None)
        if wait and threading.current_thread() is not self._thread:
            self._thread.join(timeout=_JOIN_TIMEOUT_S)

    def _fail(self, exc: BaseException) -> None:
        if self.failure is None:
            if isinstance(exc, DistributedError):
                self.failure = exc
            else:
                self.failure = DistributedError(
                    f"a step failed on rank 0 after the other tensor-parallel ranks started it ({exc!r}); "
                    "the ranks are out of step: restart every rank"
                )
                self.failure.__cause__ = exc

    def _work(self) -> None:
        while self._serve(self._next_job()):
            pass

    def _next_job(self) -> tuple[Callable[[], Any], Future[Any]] | None:
        """The next job, sending heartbeats while none comes; None: the thread ends."""
        while True:
            try:
                return self._jobs.get(timeout=self.channel.heartbeat_interval)
            except queue.Empty:
                if not dist.is_initialized():
                    self.closed = True  # destroy_process_group() ran: nothing left to talk over
                    return None
                if self.usable:
                    try:
                        self.send("heartbeat")
                    except DistributedError as exc:
                        logger.error("%s", exc)
                        self._fail(exc)

    def _serve(self, item: tuple[Callable[[], Any], Future[Any]] | None) -> bool:
        """Run one job and hand its outcome to its caller; False once the thread is to end."""
        if item is None:
            return False
        job, future = item
        del item
        if future.set_running_or_notify_cancel():
            result, error = _outcome(job)
            # A job is a closure over its runner: let go of it before the caller hears back,
            # or this thread, idle until the next job, would keep a destroyed manager's
            # runner and its KV cache alive.
            del job
            if error is None:
                future.set_result(result)
            else:
                self._fail(error)
                future.set_exception(error)
        return True


def _log_failure(what: str, future: Future[None]) -> None:
    """A posted job's failure, which nobody waits to hear: logged (the driver keeps it)."""
    if not future.cancelled() and future.exception() is not None:
        logger.warning("tensor-parallel %s failed: %s", what, future.exception())


def _released() -> DistributedError:
    return DistributedError(
        "aiocb.distributed.shutdown() released the follower ranks; they must call run_follower() again"
    )


def _outcome(job: Callable[[], T]) -> tuple[T | None, BaseException | None]:
    """What ``job`` returned, or what it raised."""
    try:
        return job(), None
    except BaseException as exc:
        return None, exc


_DRIVERS: dict[tuple[int, tuple[int, ...]], Driver] = {}
#: The tensor-parallel groups this process is rank 0 of (noted when it learns so), by key
_LAYOUTS: dict[tuple[int, tuple[int, ...]], TensorParallelLayout] = {}
#: How long ending the driver thread waits for it (it has only to take the stop from its queue).
_JOIN_TIMEOUT_S = 5.0


def _key(layout: TensorParallelLayout) -> tuple[int, tuple[int, ...]]:
    return (id(dist.group.WORLD), layout.ranks)


def note_layout(layout: TensorParallelLayout | None) -> None:
    """Remember that this process is rank 0 of ``layout`` (if it is): :func:`shutdown`
    releases its followers even if no manager ever ran here."""
    if layout is not None and layout.is_driver:
        _LAYOUTS[_key(layout)] = layout


def driver_for(layout: TensorParallelLayout, timeout: float | None) -> Driver:
    """This process's driver for ``layout``: reused across managers until :func:`shutdown`."""
    note_layout(layout)
    key = _key(layout)
    driver = _DRIVERS.get(key)
    if driver is None or driver.closed:
        released = driver is not None and driver.released
        driver = _DRIVERS[key] = Driver(control_channel(layout, timeout), after_shutdown=released)
    return driver


def shutdown(timeout: float | None = None, *, at_exit: bool = False) -> None:
    """Rank 0: release the follower ranks (their :func:`~aiocb.runner.tp_follower.follow`
    returns); no-op elsewhere.

    Each live driver sends ``shutdown``. Called by the program (not ``at_exit``), so are the
    followers of a group this process is rank 0 of where no manager ever ran: the channel is
    made now, with the followers waiting to make it in
    :func:`~aiocb.runner.tp_follower.follow` (a warning if they do not come within
    ``timeout``). Where an every-rank ``generate_batch()`` ended the driver nothing is sent:
    its followers left with the outputs, and a send waits for its receiver. At exit only
    live drivers send, for the same reason.
    """
    for driver in list(_DRIVERS.values()):
        driver.close(timeout)
    if at_exit or not dist.is_available() or not dist.is_initialized():
        return
    channel_timeout = timeout if timeout is not None else ContinuousBatchingConfig().cpu_group_timeout
    for key, layout in list(_LAYOUTS.items()):
        if key in _DRIVERS:
            continue
        try:
            driver_for(layout, channel_timeout).close(timeout)
        except Exception as exc:
            if not is_comm_failure(exc):
                raise
            logger.warning(
                "could not release the follower ranks, which did not join the control channel within %s s "
                "(no manager ran here; they are not in run_follower()): %s",
                channel_timeout,
                exc,
            )


def return_to_followers(
    layout: TensorParallelLayout,
    timeout: float | None,
    value: Any,
    error: BaseException | None,
    fingerprint: str,
) -> None:
    """Rank 0, at the end of ``generate_batch``: send what it returned (``value``) or raised
    (``error``) to the followers, those waiting in
    :func:`~aiocb.runner.tp_follower.follow_call` (every rank made the call) and those in
    :func:`~aiocb.runner.tp_follower.follow` (rank 0 made it alone), which keep following."""
    if error is not None:
        try:
            pickle.dumps(error)
        except Exception:  # an exception that cannot travel is described instead
            error = DistributedError(f"generate_batch() failed on rank 0: {type(error).__name__}: {error}")
    driver = driver_for(layout, timeout)

    def give_back() -> list[bool]:
        driver.send("return", value, error, fingerprint)
        return driver.channel.gather()[1:]  # whether each follower keeps following

    following = driver.call("returning generate_batch()'s outputs", give_back)
    if all(following):
        return
    if any(following):
        logger.error(
            "generate_batch() ran on rank 0 while some follower ranks called it too and others ran "
            "run_follower(): those stop at cpu_group_timeout; call it on every rank, or on rank 0 alone"
        )
    # Those that called it stopped listening when they took its outputs: no heartbeat or
    # shutdown may follow, since a gloo send waits for its receiver. The next call gets a
    # new driver.
    driver.retire()


@atexit.register
def _release_followers_at_exit() -> None:
    shutdown(_EXIT_TIMEOUT, at_exit=True)


class DriverRunner(ModelRunner):
    """The model runner of rank 0 under tensor parallelism: each step goes to every rank."""

    def __init__(
        self,
        model: PreTrainedModel,
        config: ContinuousBatchingConfig,
        layout: TensorParallelLayout,
        *,
        num_requests_hint: int | None = None,
        keep_cache: bool = False,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        driver = driver_for(layout, config.cpu_group_timeout)
        own = own_plan(model, config, num_requests_hint, speculative, driver.channel.ranks_on_host)
        self._driver = driver
        self.layout = layout

        def start() -> tuple[CachePlan | str, str]:
            return self._init_followers(config, num_requests_hint, speculative, keep_cache, None, own)

        driver.claim(self)  # before "init", which replaces the followers' cache
        try:
            plan, problems = driver.call("agreeing on the cache size", start)
        except BaseException:
            driver.disown(self)
            raise
        if isinstance(plan, str) or problems:
            driver.disown(self)
            raise MemoryError(plan) if isinstance(plan, str) else DistributedError(problems)
        self._num_requests_hint = num_requests_hint
        self._speculative = speculative
        self._keep_cache = keep_cache
        try:
            super().__init__(model, config, num_requests_hint=num_requests_hint, plan=plan)
        except BaseException:
            # (the followers built theirs: they free them, and the ranks stay free)
            with contextlib.suppress(DistributedError):
                driver.call("freeing the followers' caches", self._release_followers)
            driver.current = None
            driver.disown(self)
            raise
        logger.info("tensor parallelism over ranks %s: rank 0 drives, the others follow", list(layout.ranks))
        mixing = os.environ.get("NCCL_GRAPH_MIXING_SUPPORT")
        if self.device.type == "cuda" and config.disable_nccl_graph_mixing and mixing != "0":
            logger.warning(
                "NCCL_GRAPH_MIXING_SUPPORT is not 0: build the ContinuousBatchingConfig before "
                "init_process_group() / from_pretrained(), or set it in the launch environment"
            )

    def _init_followers(
        self,
        config: ContinuousBatchingConfig,
        hint: int | None,
        speculative: SpeculativeConfig | None,
        keep_cache: bool,
        plan: CachePlan | None,
        own: CachePlan | str | None,
    ) -> tuple[CachePlan | str, str]:
        """Driver thread: send ``init`` (with ``plan``, or to agree on one from ``own``); the
        plan, or why none fits, and why followers could not build their runners ("": they
        did, and hold this runner's cache; else those that did free theirs)."""
        driver = self._driver
        driver.send("init", config, hint, speculative, keep_cache, plan)
        driver.channel.set_timeout(config.cpu_group_timeout)
        agreed = plan if plan is not None else driver.channel.agree_on_plan(own)  # type: ignore[arg-type]
        if isinstance(agreed, str):
            driver.current = None
            return agreed, ""
        # Each follower builds its runner, then says whether it could: heard in this same job
        # (a heartbeat sent meanwhile would meet the followers in that gather), before this
        # rank builds its own.
        answers = driver.channel.gather(None)[1:]
        problems = "; ".join(
            f"tensor-parallel rank {rank} could not build its runner: {answer}"
            for rank, answer in zip(self.layout.followers, answers, strict=True)
            if answer is not None
        )
        if problems:
            self._release_followers()
        else:
            driver.current = self
        return agreed, problems

    def _release_followers(self) -> None:
        """Driver thread: the followers free their caches (a round trip)."""
        self._driver.current = None
        self._driver.send("release")
        self._driver.channel.gather()

    def attach(self) -> None:
        """Start a session on every rank; refused while another manager's session runs."""
        if self._driver.closed and not self._driver.released:
            # Retired at the end of a generate_batch() every rank made (its followers left
            # with its outputs): a kept runner's next session goes through the next driver,
            # which sends the followers its cache again.
            self._driver = driver_for(self.layout, self.config.cpu_group_timeout)
        self._driver.claim(self)

        def attach() -> str:
            if self._driver.current is not self:  # another manager's cache replaced this one's
                _, problems = self._init_followers(
                    self.config, self._num_requests_hint, self._speculative, self._keep_cache, self.plan, None
                )
                if problems:
                    return problems  # (raised by the caller: the group is still in step)
                if self.graphs is not None:
                    # The followers' new runners capture their decode graphs at the first
                    # decode step, running collectives in every warm-up pass: this rank
                    # must capture again at that same step, or they would wait for it.
                    self.graphs.release()
            self._driver.send("attach")
            ModelRunner.attach(self)
            return ""

        try:
            problems = self._driver.call("starting a session", attach)
        except BaseException:
            self._driver.disown(self)
            raise
        if problems:
            self._driver.disown(self)
            raise DistributedError(problems)

    def detach(self) -> None:
        """End the session on every rank; only on this one when the group has failed, or
        when this runner's session is not the one running (it was refused). The message is
        queued, not waited for: this runs on the event loop (a stop, an engine's death), and
        a hung follower would hold it for ``cpu_group_timeout``; the next session's start
        and :meth:`close` wait for the driver thread, after it."""
        driver = self._driver
        if driver.usable and driver.owns(self):
            if not self._keep_cache:
                # The followers drop their cache too. Let go of this runner now, not in the
                # queued job: a manager that drops it must free it by reference counting
                # (none of its jobs is queued: its session has ended).
                driver.current = None
            driver.post("ending a session", functools.partial(driver.send, "detach"))
        driver.disown(self)
        ModelRunner.detach(self)

    closes_remotely = True

    def close(self) -> None:
        """Make the followers free this runner's cache if they hold it (a persistent
        manager's, kept between sessions), and wait until they have (a round trip: the
        manager calls this on a worker thread)."""
        driver = self._driver

        def release() -> None:
            if driver.current is self:
                driver.send("release")
                driver.channel.gather()
                driver.current = None

        if driver.usable:
            try:
                driver.call("freeing the cache", release)
            except DistributedError as exc:
                logger.warning("%s", exc)
        if driver.current is self:  # the group failed: nothing more to tell the followers
            driver.current = None

    def warm_up(self) -> None:
        """Only the CPU kernels' load and the sampler's compile before the first step: the
        decode graphs' warm-up passes run collectives, so every rank captures them together,
        at the first decode step (all ranks run it), and no graphs of steps that verify
        proposals (those run eagerly). Nor is ``verify_cost`` measured (its timed passes
        would run collectives too): speculation is refused under tensor parallelism with a
        draft model, and prompt lookup keeps the floor it is given."""
        self.load_kernels()
        with torch.inference_mode():
            self.compile_sampler()

    def notify(self, *event: object) -> None:
        """Queue a control event for the followers (thread-safe)."""
        self._driver.events.append(event)

    def execute(self, batch: StepBatch) -> StepResult:
        """Run one step on every rank and wait for its results."""
        self._check_session()
        return self._driver.call(
            "a step", lambda: self._step(batch, lambda: ModelRunner.collect(self, ModelRunner.launch(self, batch)))
        )

    def launch(self, batch: StepBatch) -> PendingStep:
        """Async batching: launch ``batch`` on every rank (followers collect the step before
        it when they launch it; rank 0 collects separately)."""
        self._check_session()
        return self._driver.call("a step", lambda: self._step(batch, lambda: ModelRunner.launch(self, batch)))

    def _check_session(self) -> None:
        """The followers run a step on the cache of the session that holds them: never
        send them another runner's."""
        if not self._driver.owns(self):
            raise DistributedError("a step of a manager whose tensor-parallel session is not the one running")

    def _step(self, batch: StepBatch, run: Callable[[], T]) -> T:
        self._driver.send("step", batch)
        try:
            return run()
        except Exception as exc:
            if is_comm_failure(exc):
                raise DistributedError(
                    f"tensor-parallel {_followers(self.layout)} stopped responding (died or hung) during a forward "
                    f"pass ({exc})"
                ) from exc
            raise


def driver_layout(model: PreTrainedModel, draft_model: PreTrainedModel | None = None) -> TensorParallelLayout | None:
    """The model's tensor-parallel layout, where this process may run a manager on it
    (rank 0); None without tensor parallelism. Uses no process group.

    Raises :class:`~aiocb.InvalidRequestError` on the other ranks, and
    :class:`~aiocb.InvalidConfigError` for a draft model (one process only).
    """
    layout = tensor_parallel_layout(model)
    if layout is None:
        return None
    if draft_model is not None:
        raise InvalidConfigError("speculative decoding with a draft model does not support tensor parallelism yet")
    if not layout.is_driver:
        raise InvalidRequestError(
            f"this process is tensor-parallel rank {layout.rank} of {layout.size}: only rank 0 runs an "
            "aiocb.Manager; call aiocb.distributed.run_follower(model) here instead"
        )
    return layout


def build_runner(
    model: PreTrainedModel,
    config: ContinuousBatchingConfig,
    *,
    num_requests_hint: int | None = None,
    keep_cache: bool = False,
    draft_model: PreTrainedModel | None = None,
    speculative: SpeculativeConfig | None = None,
    plan: CachePlan | None = None,
) -> ModelRunner:
    """The runner for ``model``: a plain one, or rank 0's :class:`DriverRunner` under tensor parallelism.

    ``keep_cache`` tells the followers to keep their cache between sessions, as a
    persistent manager keeps its own. ``draft_model`` is speculative decoding's (one
    process only); given ``speculative``, a single process's runner also captures graphs
    of the steps that verify proposals. ``plan`` is a single process's cache plan, made
    beforehand (:func:`~aiocb.runner.model_runner.runner_plan`; None: made here). Under
    tensor parallelism this is a round trip to every other rank, which agree on the plan
    (see :func:`driver_layout`).
    """
    layout = driver_layout(model, draft_model)
    if layout is None:
        return ModelRunner(
            model,
            config,
            num_requests_hint=num_requests_hint,
            plan=plan,
            draft_model=draft_model,
            speculative=speculative,
        )
    return DriverRunner(
        model, config, layout, num_requests_hint=num_requests_hint, keep_cache=keep_cache, speculative=speculative
    )
