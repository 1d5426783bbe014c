"""Tensor parallelism over torch.distributed: rank 0 drives, the other ranks replay its steps.

A model loaded with ``DistributedConfig(tp_size=N)`` holds one shard of every weight on
each of the N ranks, and its forward pass runs collectives (on the model's own process
group) that every rank must join. Rank 0 of the tensor-parallel group owns the
scheduler: everything else is a *follower* that runs the forward passes rank 0 tells
it to, on its shard, over its own shard of the paged cache.

Rank 0 tells them over a dedicated CPU (gloo) group, with ``broadcast_object_list``.
Every message is ``(kind, *payload, events)``:

* ``("init", config, num_requests_hint, keep_cache, plan, events)``: build a runner (a
  new cache). With ``plan`` None every rank then gathers its own cache plan and all take
  the element-wise minimum, so block ids mean the same everywhere; a plan is given when
  a kept runner (a persistent manager's) takes the followers back from another one;
* ``("attach", events)`` / ``("detach", events)``: a manager session starts / ends;
* ``("step", StepBatch, events)``: run this step (rank 0 runs it at the same time);
* ``("heartbeat", events)``: rank 0 is alive but idle;
* ``("shutdown", events)``: :func:`follow` returns.

``events`` are what happened on rank 0 since the last message: ``("cancel", request id,
reason)`` and ``("stop", hard)``. Followers hold no request state, so they only count
them (:class:`FollowerReport`).

On rank 0 one daemon thread sends every message and runs every forward pass, in order,
so a step is never started that the followers did not receive (a gloo send completes
only once the receiver has it). ``cpu_group_timeout`` bounds each collective of the CPU
group, and rank 0 waits at most that long for any step, so a dead or hung rank fails
the others with :class:`~aiocb.DistributedError` instead of a hang; rank 0 sends a
heartbeat after a quarter of it without traffic, so an idle server does not time out.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from aiocb.config import ContinuousBatchingConfig
from aiocb.core.scheduler import StepResult
from aiocb.errors import DistributedError, InvalidConfigError, InvalidRequestError
from aiocb.runner.inputs import StepBatch
from aiocb.runner.memory import CachePlan, plan_cache
from aiocb.runner.model_runner import ModelRunner, PendingStep
from aiocb.runner.model_spec import model_spec

logger = logging.getLogger(__name__)

T = TypeVar("T")
#: A control event recorded on rank 0: ``("cancel", request_id, reason)`` or ``("stop", hard)``.
Event = tuple[Any, ...]

#: ``cpu_group_timeout=None``: collectives wait this long (gloo needs a finite timeout).
_FOREVER = timedelta(days=365)
#: ``cpu_group_timeout=None``: seconds between heartbeats of an idle rank 0.
_SLOW_HEARTBEAT = 3600.0
#: Longest wait for the followers to take the shutdown message at interpreter exit.
_EXIT_TIMEOUT = 10.0
#: Names of the modules that project the attention's keys and values, in TP plans.
_KV_PROJECTIONS = frozenset({"k_proj", "v_proj", "qkv_proj", "query_key_value"})
#: Substrings of the errors torch.distributed backends raise when a peer fails.
_COMM_FAILURE_MARKERS = ("gloo", "nccl", "connection closed", "connection reset", "timed out", "broken pipe", "closure")


@dataclass(frozen=True, slots=True)
class TensorParallelLayout:
    """Where this process sits in its model's tensor-parallel group."""

    #: ranks in the group
    size: int
    #: this process's rank within the group (0 drives)
    rank: int
    #: the group's global ranks, in group order: ``ranks[0]`` is the driver
    ranks: tuple[int, ...]

    @property
    def is_driver(self) -> bool:
        """Whether this process runs the scheduler and the API (group rank 0)."""
        return self.rank == 0

    @property
    def followers(self) -> tuple[int, ...]:
        """The global ranks that replay rank 0's steps."""
        return self.ranks[1:]


def tensor_parallel_layout(model: PreTrainedModel) -> TensorParallelLayout | None:
    """The model's tensor-parallel group, or None when its weights are not sharded.

    Raises :class:`~aiocb.InvalidConfigError` for what aiocb cannot run (see
    :func:`_tp_mesh`).
    """
    mesh = _tp_mesh(model)
    if mesh is None:
        return None
    ranks = tuple(int(r) for r in dist.get_process_group_ranks(mesh.get_group()))
    return TensorParallelLayout(size=int(mesh.size()), rank=int(mesh.get_local_rank()), ranks=ranks)


def _tp_mesh(model: PreTrainedModel) -> Any:
    """The model's (1-D) tensor-parallel device mesh, or None without tensor parallelism.

    Raises :class:`~aiocb.InvalidConfigError` for a TP size that does not divide the
    model's ``num_key_value_heads``, for FSDP or pipeline parallelism, and for a
    ``device_map`` next to tensor parallelism. Uses no process group.
    """
    mesh = getattr(model, "_device_mesh", None)
    declared = int(getattr(model, "tp_size", None) or 1)
    if mesh is None:
        if declared > 1:
            raise InvalidConfigError(f"the model reports tp_size={declared} but has no device mesh")
        return None
    names = mesh.mesh_dim_names
    if names:
        for name in names:
            if name != "tp" and mesh[name].size() > 1:
                raise InvalidConfigError(
                    f"aiocb runs tensor parallelism only; the model's device mesh also splits {name!r} "
                    f"over {mesh[name].size()} ranks"
                )
        if "tp" not in names:
            return None
        mesh = mesh["tp"]
    size = int(mesh.size())
    if size <= 1:
        return None
    text = model.config.get_text_config()
    check_tp_size(size, int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads))
    device_map = getattr(model, "hf_device_map", None)
    if device_map and len(set(device_map.values())) > 1:
        raise InvalidConfigError(
            f"the model was loaded with a device_map over several devices and with tensor parallelism "
            f"(tp_size={size}); they are mutually exclusive: drop the device_map"
        )
    return mesh


def check_tp_size(tp_size: int, num_kv_heads: int) -> None:
    """Raise :class:`~aiocb.InvalidConfigError` unless ``tp_size`` divides ``num_kv_heads``."""
    if tp_size < 1 or num_kv_heads % tp_size:
        divisors = [d for d in range(1, num_kv_heads + 1) if num_kv_heads % d == 0]
        raise InvalidConfigError(
            f"tp_size={tp_size} does not divide the model's num_key_value_heads={num_kv_heads}: every "
            f"tensor-parallel rank must hold whole KV heads; use a tp_size in {divisors}"
        )


def shard_heads(model: PreTrainedModel, num_heads: int, num_kv_heads: int) -> tuple[int, int, int]:
    """``(tp_size, query heads, KV heads)`` of this rank's shard of the attention.

    Heads are split when the model's TP plan shards the outputs of its K and V
    projections (``colwise``, as Llama's ``k_proj``); a plan that gathers them again
    (Phi-3's ``qkv_proj: colwise_gather_output``) leaves every head on every rank.
    """
    mesh = _tp_mesh(model)
    if mesh is None:
        return 1, num_heads, num_kv_heads
    size = int(mesh.size())
    plan: dict[str, str] = getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None) or {}
    styles = [style for key, style in plan.items() if key.rsplit(".", 1)[-1] in _KV_PROJECTIONS]
    if not styles or not all("colwise" in style and "gather" not in style for style in styles):
        return size, num_heads, num_kv_heads
    return size, num_heads // size, num_kv_heads // size


# --------------------------------------------------------------------------- the CPU group


class ControlChannel:
    """The CPU (gloo) group of one tensor-parallel group: rank 0 broadcasts, the others receive."""

    def __init__(self, layout: TensorParallelLayout, timeout: float | None) -> None:
        self.layout = layout
        self.timeout = timeout
        use_local = len(layout.ranks) < dist.get_world_size()
        self.group: Any = dist.new_group(
            ranks=list(layout.ranks), backend="gloo", timeout=_timedelta(timeout), use_local_synchronization=use_local
        )

    @property
    def heartbeat_interval(self) -> float:
        """Seconds of silence after which an idle rank 0 sends a heartbeat."""
        return _SLOW_HEARTBEAT if self.timeout is None else self.timeout / 4

    def set_timeout(self, timeout: float | None) -> None:
        """Change the group's collective timeout (every rank does, at the same message)."""
        if timeout == self.timeout:
            return
        setter = getattr(self.group, "set_timeout", None)
        if setter is None:
            logger.warning("this torch cannot change a process group's timeout; keeping %s s", self.timeout)
            return
        setter(_timedelta(timeout))
        self.timeout = timeout

    def broadcast(self, message: Any = None) -> Any:
        """Rank 0: send ``message``; the others: return rank 0's message."""
        holder = [message if self.layout.is_driver else None]
        dist.broadcast_object_list(holder, src=self.layout.ranks[0], group=self.group, device=torch.device("cpu"))
        return holder[0]

    def agree_on_plan(self, own: CachePlan | str) -> CachePlan | str:
        """Every rank's cache plan -> the element-wise minimum, or the first rank's error message."""
        plans: list[Any] = [None] * self.layout.size
        dist.all_gather_object(plans, own, group=self.group)
        for rank, plan in enumerate(plans):
            if isinstance(plan, str):
                return f"tensor-parallel rank {rank}: {plan}"
        return _minimum_plan(plans)


def _minimum_plan(plans: list[CachePlan]) -> CachePlan:
    """A plan that fits every rank: the smallest of each size."""

    def per_group(name: str) -> list[int]:
        return [min(values) for values in zip(*(getattr(p, name) for p in plans), strict=True)]

    return CachePlan(
        page_size=plans[0].page_size,
        num_blocks=per_group("num_blocks"),
        max_batch_tokens=min(p.max_batch_tokens for p in plans),
        max_requests_per_batch=min(p.max_requests_per_batch for p in plans),
        budget_bytes=min(p.budget_bytes for p in plans),
        num_host_blocks=per_group("num_host_blocks"),
    )


def _timedelta(timeout: float | None) -> timedelta:
    return _FOREVER if timeout is None else timedelta(seconds=timeout)


def _own_plan(
    model: PreTrainedModel, config: ContinuousBatchingConfig, num_requests_hint: int | None
) -> CachePlan | str:
    try:
        return plan_cache(model_spec(model), config, num_requests_hint=num_requests_hint)
    except MemoryError as exc:
        return str(exc)


_CHANNELS: dict[tuple[int, tuple[int, ...]], ControlChannel] = {}


def control_channel(layout: TensorParallelLayout, timeout: float | None) -> ControlChannel:
    """This process's control channel for ``layout`` (created on first use: a collective)."""
    key = (id(dist.group.WORLD), layout.ranks)
    channel = _CHANNELS.get(key)
    if channel is None:
        channel = _CHANNELS[key] = ControlChannel(layout, timeout)
    return channel


def _followers(layout: TensorParallelLayout) -> str:
    """The follower ranks, for messages: gloo does not say which peer failed."""
    if len(layout.followers) == 1:
        return f"rank {layout.followers[0]}"
    return "one of ranks " + ", ".join(str(rank) for rank in layout.followers)


def is_comm_failure(exc: BaseException) -> bool:
    """Whether ``exc`` looks like a torch.distributed backend failing to reach a peer."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(marker in text for marker in _COMM_FAILURE_MARKERS)


# --------------------------------------------------------------------------- rank 0


class Driver:
    """Rank 0's end of the control channel: one thread sends every message and runs every
    forward pass, in order, and sends heartbeats when there is nothing else to send."""

    def __init__(self, channel: ControlChannel) -> None:
        self.channel = channel
        #: events for the followers, carried by the next message (appended from any thread)
        self.events: deque[Event] = deque()
        #: why the group is unusable (a rank failed, or a step failed half-way); None while healthy
        self.failure: DistributedError | None = None
        self.closed = False
        #: the runner whose cache the followers hold (only the driver thread changes it)
        self.current: ModelRunner | None = None
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
            raise DistributedError(
                "aiocb.distributed.shutdown() released the follower ranks; they must call run_follower() again"
            )
        future: Future[T] = Future()
        self._jobs.put((job, future))
        timeout = self.channel.timeout
        try:
            return future.result(timeout=timeout)
        except FutureTimeoutError:
            self._fail(
                DistributedError(
                    f"tensor-parallel {_followers(self.channel.layout)} stopped responding (hung or died): {what} "
                    f"did not complete within cpu_group_timeout={timeout} s; restart every rank"
                )
            )
            assert self.failure is not None
            raise self.failure from None

    def send(self, kind: str, *payload: Any) -> None:
        """Broadcast one message with the pending events (driver thread only)."""
        events: list[Event] = []
        while self.events:
            events.append(self.events.popleft())
        try:
            self.channel.broadcast((kind, *payload, events))
        except Exception as exc:
            raise DistributedError(
                f"tensor-parallel {_followers(self.channel.layout)} stopped responding (died or hung): rank 0 "
                f"could not send it {kind!r} ({exc})"
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
            self._jobs.put((lambda: self.send("shutdown"), future))
            try:
                future.result(timeout=timeout if timeout is not None else self.channel.timeout)
            except (FutureTimeoutError, DistributedError) as exc:
                logger.warning("could not release the follower ranks: %s", exc)
        self.closed = True
        self._jobs.put(None)

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
        while True:
            try:
                item = self._jobs.get(timeout=self.channel.heartbeat_interval)
            except queue.Empty:
                if not dist.is_initialized():
                    self.closed = True  # destroy_process_group() ran: nothing left to talk over
                    return
                if self.usable:
                    try:
                        self.send("heartbeat")
                    except DistributedError as exc:
                        logger.error("%s", exc)
                        self._fail(exc)
                continue
            if item is None:
                return
            job, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = job()
            except BaseException as exc:
                self._fail(exc)
                future.set_exception(exc)
            else:
                future.set_result(result)


_DRIVERS: dict[tuple[int, tuple[int, ...]], Driver] = {}


def driver_for(layout: TensorParallelLayout, timeout: float | None) -> Driver:
    """This process's driver for ``layout``: reused across managers until :func:`shutdown`."""
    key = (id(dist.group.WORLD), layout.ranks)
    driver = _DRIVERS.get(key)
    if driver is None or driver.closed:
        driver = _DRIVERS[key] = Driver(control_channel(layout, timeout))
    return driver


def shutdown(timeout: float | None = None) -> None:
    """Rank 0: release the follower ranks (their :func:`follow` returns); no-op elsewhere."""
    for driver in list(_DRIVERS.values()):
        driver.close(timeout)


@atexit.register
def _release_followers_at_exit() -> None:
    shutdown(_EXIT_TIMEOUT)


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
    ) -> None:
        driver = driver_for(layout, config.cpu_group_timeout)
        own = _own_plan(model, config, num_requests_hint)

        def start() -> CachePlan | str:
            driver.send("init", config, num_requests_hint, keep_cache, None)
            driver.channel.set_timeout(config.cpu_group_timeout)
            agreed = driver.channel.agree_on_plan(own)
            driver.current = None if isinstance(agreed, str) else self
            return agreed

        plan = driver.call("agreeing on the cache size", start)
        if isinstance(plan, str):
            raise MemoryError(plan)
        self._driver = driver
        self._num_requests_hint = num_requests_hint
        self._keep_cache = keep_cache
        self.layout = layout
        super().__init__(model, config, num_requests_hint=num_requests_hint, plan=plan)
        logger.info("tensor parallelism over ranks %s: rank 0 drives, the others follow", list(layout.ranks))
        mixing = os.environ.get("NCCL_GRAPH_MIXING_SUPPORT")
        if self.device.type == "cuda" and config.disable_nccl_graph_mixing and mixing != "0":
            logger.warning(
                "NCCL_GRAPH_MIXING_SUPPORT is not 0: build the ContinuousBatchingConfig before "
                "init_process_group() / from_pretrained(), or set it in the launch environment"
            )

    def attach(self) -> None:
        """Start a session on every rank."""

        def attach() -> None:
            if self._driver.current is not self:  # another manager's cache replaced this one's
                self._driver.send("init", self.config, self._num_requests_hint, self._keep_cache, self.plan)
                self._driver.channel.set_timeout(self.config.cpu_group_timeout)
                self._driver.current = self
            self._driver.send("attach")
            ModelRunner.attach(self)

        self._driver.call("starting a session", attach)

    def detach(self) -> None:
        """End the session on every rank (only here when the group has failed)."""
        if self._driver.usable:

            def detach() -> None:
                self._driver.send("detach")
                if not self._keep_cache:
                    self._driver.current = None  # the followers drop their cache too
                ModelRunner.detach(self)

            try:
                self._driver.call("ending a session", detach)
                return
            except DistributedError as exc:
                logger.warning("%s", exc)
        ModelRunner.detach(self)

    def notify(self, *event: object) -> None:
        """Queue a control event for the followers (thread-safe)."""
        self._driver.events.append(event)

    def execute(self, batch: StepBatch) -> StepResult:
        """Run one step on every rank and wait for its results."""
        return self._driver.call(
            "a step", lambda: self._step(batch, lambda: ModelRunner.collect(self, ModelRunner.launch(self, batch)))
        )

    def launch(self, batch: StepBatch) -> PendingStep:
        """Async batching: launch ``batch`` on every rank (followers collect the step before
        it when they launch it; rank 0 collects separately)."""
        return self._driver.call("a step", lambda: self._step(batch, lambda: ModelRunner.launch(self, batch)))

    def _step(self, batch: StepBatch | None, run: Callable[[], T]) -> T:
        if batch is not None:
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


def build_runner(
    model: PreTrainedModel,
    config: ContinuousBatchingConfig,
    *,
    num_requests_hint: int | None = None,
    keep_cache: bool = False,
) -> ModelRunner:
    """The runner for ``model``: a plain one, or rank 0's :class:`DriverRunner` under tensor parallelism.

    ``keep_cache`` tells the followers to keep their cache between sessions, as a
    persistent manager keeps its own.
    """
    layout = tensor_parallel_layout(model)
    if layout is None:
        return ModelRunner(model, config, num_requests_hint=num_requests_hint)
    if not layout.is_driver:
        raise InvalidRequestError(
            f"this process is tensor-parallel rank {layout.rank} of {layout.size}: only rank 0 runs an "
            "aiocb.Manager; call aiocb.distributed.run_follower(model) here instead"
        )
    return DriverRunner(model, config, layout, num_requests_hint=num_requests_hint, keep_cache=keep_cache)


# --------------------------------------------------------------------------- the other ranks


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
    #: ``(request id, finish reason)`` of each request cancelled or aborted on rank 0
    cancelled: tuple[tuple[str, str], ...]
    #: the cache plan of the last runner
    plan: CachePlan | None


@dataclass(slots=True)
class _Counters:
    steps: int = 0
    heartbeats: int = 0
    inits: int = 0
    sessions: int = 0
    stops: int = 0
    hard_stops: int = 0
    cancelled: list[tuple[str, str]] = field(default_factory=list)
    plan: CachePlan | None = None

    def record(self, events: list[Event]) -> None:
        for event in events:
            if event[0] == "cancel":
                self.cancelled.append((str(event[1]), str(event[2])))
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
        )


def follow(model: PreTrainedModel, config: ContinuousBatchingConfig | None = None) -> FollowerReport:
    """Run the steps tensor-parallel rank 0 broadcasts until it sends ``shutdown``.

    ``config`` gives only the ``cpu_group_timeout`` to use until rank 0's first manager
    starts; from then on every setting comes from rank 0's configuration.
    """
    layout = tensor_parallel_layout(model)
    if layout is None:
        raise InvalidRequestError("run_follower() needs a model loaded with tensor parallelism (tp_size > 1)")
    if layout.is_driver:
        raise InvalidRequestError(
            "this process is tensor-parallel rank 0: it runs the aiocb.Manager, not run_follower()"
        )
    channel = control_channel(layout, (config or ContinuousBatchingConfig()).cpu_group_timeout)
    logger.info("tensor-parallel rank %d of %d follows rank 0", layout.rank, layout.size)
    return _Follower(model, channel).run()


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

    def run(self) -> FollowerReport:
        try:
            while True:
                kind, *payload, events = _receive(self.channel)
                self.counters.record(events)
                if kind != "step":
                    self._collect()
                if kind == "shutdown":
                    logger.info("rank 0 released tensor-parallel rank %d", self.layout.rank)
                    return self.counters.report()
                handler = getattr(self, f"_on_{kind}", None)
                if handler is None:
                    raise DistributedError(f"unknown control message {kind!r} from rank 0")
                handler(*payload)
        finally:
            self.previous = None  # after a failure there is nothing worth collecting
            if self.runner is not None:
                self.runner.detach()

    def _on_init(
        self, config: ContinuousBatchingConfig, hint: int | None, keep_cache: bool, plan: CachePlan | None
    ) -> None:
        self._drop()  # free the old cache before sizing the new one
        self.keep_cache = keep_cache
        self.channel.set_timeout(config.cpu_group_timeout)
        agreed = plan if plan is not None else self.channel.agree_on_plan(_own_plan(self.model, config, hint))
        if isinstance(agreed, str):
            logger.error("no cache this time: %s", agreed)
            return
        self.runner = ModelRunner(self.model, config, num_requests_hint=hint, plan=agreed)
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
                f"cpu_group_timeout={timeout} s, not even a heartbeat: it hung or died"
            ) from exc
        raise DistributedError(
            f"rank 0 (the driver, global rank {channel.layout.ranks[0]}) stopped responding: it died or "
            f"closed its process group without aiocb.distributed.shutdown() ({exc})"
        ) from exc
