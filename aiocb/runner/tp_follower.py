"""Tensor parallelism on the other ranks: replay the steps rank 0 broadcasts, on this rank's shard."""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedModel

from aiocb.config import ContinuousBatchingConfig
from aiocb.errors import DistributedError, InvalidRequestError
from aiocb.runner.memory import CachePlan
from aiocb.runner.model_runner import ModelRunner, PendingStep
from aiocb.runner.step_batch import StepBatch
from aiocb.runner.tp_channel import ControlChannel, Event, control_channel, is_comm_failure, own_plan
from aiocb.runner.tp_layout import tensor_parallel_layout
from aiocb.speculative import SpeculativeConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class FollowerReport:
    """What a follower rank received from rank 0, returned by :func:`follow`."""

    steps: int
    heartbeats: int
    #: runners (caches) built, and manager sessions started
    inits: int
    sessions: int
    #: ``stop()`` and ``stop(hard_stop=True)`` calls on rank 0
    stops: int
    hard_stops: int
    #: ``(request id, finish reason)`` of the last :data:`KEPT_CANCELLATIONS` requests
    #: cancelled, aborted or timed out on rank 0
    cancelled: tuple[tuple[str, str], ...]
    #: the cache plan of the last runner
    plan: CachePlan | None
    #: requests cancelled, aborted or timed out on rank 0, all told
    cancellations: int = 0


#: Cancellations a follower keeps the ids of (a long-running server's are countless).
KEPT_CANCELLATIONS = 1000


@dataclass(slots=True)
class _Counters:
    steps: int = 0
    heartbeats: int = 0
    inits: int = 0
    sessions: int = 0
    stops: int = 0
    hard_stops: int = 0
    cancelled: deque[tuple[str, str]] = field(default_factory=lambda: deque(maxlen=KEPT_CANCELLATIONS))
    cancellations: int = 0
    plan: CachePlan | None = None

    def record(self, events: list[Event]) -> None:
        for event in events:
            if event[0] == "cancel":
                self.cancelled.append((str(event[1]), str(event[2])))
                self.cancellations += 1
                logger.debug("rank 0 cancelled request %s (%s)", event[1], event[2])
            elif event[0] == "stop":
                if event[1]:
                    self.hard_stops += 1
                else:
                    self.stops += 1
                logger.info("rank 0 stopped its manager%s", " (hard stop)" if event[1] else "")

    def report(self) -> FollowerReport:
        return FollowerReport(
            self.steps,
            self.heartbeats,
            self.inits,
            self.sessions,
            self.stops,
            self.hard_stops,
            tuple(self.cancelled),
            self.plan,
            self.cancellations,
        )


def follow(model: PreTrainedModel, config: ContinuousBatchingConfig | None = None) -> FollowerReport:
    """Run the steps tensor-parallel rank 0 broadcasts until it sends ``shutdown``.

    ``config`` gives only the ``cpu_group_timeout`` to use until rank 0's first manager
    starts; from then on every setting comes from rank 0's configuration.
    """
    follower = _Follower(model, _channel(model, config, "run_follower()"))
    follower.run()
    return follower.counters.report()


def follow_call(model: PreTrainedModel, config: ContinuousBatchingConfig | None, fingerprint: str) -> Any:
    """Follow rank 0 through one call that every rank makes (``generate_batch``) and return
    what rank 0 returned from it, which it broadcasts at the end (``("return", ...)``).

    ``fingerprint`` stands for this rank's arguments: a call that rank 0 made with other
    arguments raises :class:`~aiocb.InvalidRequestError` (the ranks' scripts diverged),
    and an exception rank 0 raised is raised here too.
    """
    follower = _Follower(model, _channel(model, config, "generate_batch()"))
    returned = follower.run(until_return=True)
    if returned is None:
        raise DistributedError(
            "rank 0 called aiocb.distributed.shutdown() while this rank waited for its generate_batch() to return"
        )
    value, error, driver_fingerprint = returned
    if driver_fingerprint != fingerprint:
        raise InvalidRequestError(
            f"generate_batch() on tensor-parallel rank {follower.layout.rank} got other arguments than on rank 0: "
            "every rank must pass the same prompts and parameters (rank 0's ran; this rank's outputs are rank 0's)"
        )
    if error is not None:
        raise error
    return value


def _channel(model: PreTrainedModel, config: ContinuousBatchingConfig | None, caller: str) -> ControlChannel:
    layout = tensor_parallel_layout(model)
    if layout is None:
        raise InvalidRequestError(f"{caller} on a follower needs a model loaded with tensor parallelism (tp_size > 1)")
    if layout.is_driver:
        raise InvalidRequestError(f"this process is tensor-parallel rank 0: it runs the aiocb.Manager, not {caller}")
    timeout = (config or ContinuousBatchingConfig()).cpu_group_timeout
    try:
        channel = control_channel(layout, timeout)
    except Exception as exc:
        if not is_comm_failure(exc):
            raise
        raise DistributedError(
            f"rank 0 (global rank {layout.ranks[0]}) did not join this tensor-parallel group's control channel "
            f"within cpu_group_timeout={timeout} s: it died, or it neither started a manager nor called "
            f"aiocb.distributed.shutdown() ({exc})"
        ) from exc
    logger.info("tensor-parallel rank %d of %d follows rank 0", layout.rank, layout.size)
    return channel


class _Follower:
    """A follower rank's state: a runner (or none) and the step it has yet to collect."""

    def __init__(self, model: PreTrainedModel, channel: ControlChannel) -> None:
        self.model = model
        self.channel = channel
        self.layout = channel.layout
        self.counters = _Counters()
        self.runner: ModelRunner | None = None
        self.keep_cache = False
        #: the last step launched: collected after the next one is launched, as rank 0 does
        self.previous: PendingStep | None = None

    def run(self, *, until_return: bool = False) -> Any:
        """Replay rank 0's messages until ``shutdown`` (None), or with ``until_return`` until
        ``return`` too (its payload)."""
        try:
            while True:
                kind, *payload, events = _receive(self.channel)
                self.counters.record(events)
                if kind != "step":
                    self._collect()
                if kind == "shutdown":
                    logger.info("rank 0 released tensor-parallel rank %d", self.layout.rank)
                    return None
                if kind == "return":
                    # Rank 0 learns whether this rank keeps following (run_follower(): the
                    # call was rank 0's alone) or leaves with the outputs (its own call).
                    self.channel.gather(not until_return)
                    if until_return:
                        return tuple(payload)
                    continue
                handler = getattr(self, f"_on_{kind}", None)
                if handler is None:
                    raise DistributedError(f"unknown control message {kind!r} from rank 0")
                handler(*payload)
        finally:
            self.previous = None  # after a failure there is nothing worth collecting
            if self.runner is not None:
                self.runner.detach()

    def _on_init(
        self,
        config: ContinuousBatchingConfig,
        hint: int | None,
        speculative: SpeculativeConfig | None,
        keep_cache: bool,
        plan: CachePlan | None,
    ) -> None:
        self._drop()  # free the old cache before sizing the new one
        self.keep_cache = keep_cache
        self.channel.set_timeout(config.cpu_group_timeout)
        own = None if plan is not None else own_plan(self.model, config, hint, speculative, self.channel.ranks_on_host)
        agreed = plan if own is None else self.channel.agree_on_plan(own)
        if isinstance(agreed, str):
            logger.error("no cache this time: %s", agreed)
            return
        # (a new runner captures its decode graphs at the first decode step, as rank 0's does:
        # rank 0 builds a new runner, or drops its graphs, whenever it sends "init")
        try:
            self.runner = ModelRunner(self.model, config, num_requests_hint=hint, plan=agreed)
        except Exception as exc:  # (its cache did not fit, say): rank 0 hears why, and the ranks go on
            logger.exception("tensor-parallel rank %d could not build its runner", self.layout.rank)
            self.channel.gather(f"{type(exc).__name__}: {exc}")
            return
        self.channel.gather(None)  # (rank 0 learns that every rank built one)
        self.counters.inits += 1
        self.counters.plan = agreed

    def _on_attach(self) -> None:
        self._runner().attach()
        self.counters.sessions += 1

    def _on_detach(self) -> None:
        if self.runner is not None:
            self.runner.detach()
            if not self.keep_cache:
                self.runner = None

    def _on_release(self) -> None:
        self._drop()
        self.channel.gather()  # rank 0 waits until the cache is freed

    def _on_heartbeat(self) -> None:
        self.counters.heartbeats += 1

    def _on_step(self, batch: StepBatch) -> None:
        runner = self._runner()
        try:
            pending = runner.launch(batch)
            self._collect()  # rank 0's order: launch N + 1, then collect N
        except Exception as exc:
            if is_comm_failure(exc):
                peers = "rank 0 (the driver)" if self.layout.size == 2 else "rank 0 or another follower"
                raise DistributedError(
                    f"a forward pass failed on tensor-parallel rank {self.layout.rank}: {peers} died or "
                    f"stopped responding ({exc})"
                ) from exc
            raise
        self.previous = pending
        self.counters.steps += 1

    def _runner(self) -> ModelRunner:
        if self.runner is None:
            raise DistributedError("rank 0 sent work before the cache was built: the ranks are out of step")
        return self.runner

    def _collect(self) -> None:
        if self.previous is not None and self.runner is not None:
            self.runner.collect(self.previous)
        self.previous = None

    def _drop(self) -> None:
        self._collect()
        if self.runner is not None:
            self.runner.detach()
            self.runner = None


def _receive(channel: ControlChannel) -> Any:
    try:
        return channel.broadcast()
    except Exception as exc:
        timeout = channel.timeout
        if "timed out" in str(exc).lower():
            raise DistributedError(
                f"rank 0 (the driver, global rank {channel.layout.ranks[0]}) sent nothing for "
                f"cpu_group_timeout={timeout} s, not even a heartbeat: it hung or died, or a step failed "
                "there (its log says why)"
            ) from exc
        raise DistributedError(
            f"rank 0 (the driver, global rank {channel.layout.ranks[0]}) stopped responding: it died, a step "
            f"failed there (its log says why), or it closed its process group without "
            f"aiocb.distributed.shutdown() ({exc})"
        ) from exc
