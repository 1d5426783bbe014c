"""The control channel of a tensor-parallel group: rank 0 tells the other ranks what to run.

Rank 0 tells them over a dedicated CPU (gloo) group, with ``broadcast_object_list``.
Every message is ``(kind, *payload, events)``:

* ``("init", config, num_requests_hint, speculative, keep_cache, plan, events)``: build a
  runner (a new cache). With ``plan`` None every rank then gathers its own cache plan
  (``speculative``: for the rows of steps that verify proposals) and all take the
  element-wise minimum, so block ids mean the same everywhere; a plan is given when a
  kept runner (a persistent manager's) takes the followers back from another one. Each
  follower then builds its runner and joins a gather of why it could not (None: it did),
  so that rank 0 fails the start naming the rank and its reason;
* ``("attach", events)`` / ``("detach", events)``: a manager session starts / ends;
* ``("release", events)``: free the cache kept between sessions (its persistent manager
  was destroyed); every rank then joins a gather, so that rank 0 knows it is freed;
* ``("step", StepBatch, events)``: run this step (rank 0 runs it at the same time);
* ``("heartbeat", events)``: rank 0 is alive but idle;
* ``("return", value, error, fingerprint, events)``: ``generate_batch`` returned
  ``value`` or raised ``error`` on rank 0, given arguments that hash to ``fingerprint``;
  every rank then joins a gather of whether it keeps following: True under
  :func:`~aiocb.runner.tp_follower.follow` (rank 0 made the call alone), False in the
  rank's own call, which returns;
* ``("shutdown", events)``: :func:`~aiocb.runner.tp_follower.follow` returns.

``events`` are what happened on rank 0 since the last message: ``("cancel", request id,
reason)`` (cancelled, aborted or timed out) and ``("stop", hard)``. Followers hold no request state, so they only count
them (:class:`~aiocb.runner.tp_follower.FollowerReport`).
"""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from aiocb.config import MAX_CPU_GROUP_TIMEOUT, ContinuousBatchingConfig
from aiocb.runner.memory import CachePlan, plan_cache
from aiocb.runner.model_spec import model_spec
from aiocb.runner.tp_layout import TensorParallelLayout
from aiocb.speculative import SpeculativeConfig

logger = logging.getLogger(__name__)

#: A control event recorded on rank 0: ``("cancel", request_id, reason)`` or ``("stop", hard)``.
Event = tuple[Any, ...]

#: ``cpu_group_timeout=None``: collectives wait this long (gloo needs a finite timeout).
_FOREVER = timedelta(seconds=MAX_CPU_GROUP_TIMEOUT)
#: ``cpu_group_timeout=None``: seconds between heartbeats of an idle rank 0.
_SLOW_HEARTBEAT = 3600.0
#: Substrings of the errors torch.distributed backends raise when a peer fails.
_COMM_FAILURE_MARKERS = ("gloo", "nccl", "connection closed", "connection reset", "timed out", "broken pipe", "closure")


class ControlChannel:
    """The CPU (gloo) group of one tensor-parallel group: rank 0 broadcasts, the others receive."""

    def __init__(self, layout: TensorParallelLayout, timeout: float | None) -> None:
        self.layout = layout
        self.timeout = timeout
        use_local = len(layout.ranks) < dist.get_world_size()
        self.group: Any = dist.new_group(
            ranks=list(layout.ranks), backend="gloo", timeout=_timedelta(timeout), use_local_synchronization=use_local
        )
        #: the processes on this machine that share its host memory (this one included)
        self.ranks_on_host = ranks_sharing_host(self.gather(socket.gethostname()), socket.gethostname())

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

    def gather(self, answer: Any = None) -> list[Any]:
        """Every rank's ``answer``, in rank order (each rank waits for all the others')."""
        answers: list[Any] = [None] * self.layout.size
        dist.all_gather_object(answers, answer, group=self.group)
        return answers

    def agree_on_plan(self, own: CachePlan | str) -> CachePlan | str:
        """Every rank's cache plan -> the element-wise minimum, or the first rank's error message."""
        plans = self.gather(own)
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


def ranks_sharing_host(hostnames: list[str], here: str) -> int:
    """How many processes plan on this machine's host memory: this group's ranks on it
    (``hostnames``: each rank's), or torchrun's count of its processes on this node
    (``LOCAL_WORLD_SIZE``), where that is more (other groups' ranks, data-parallel ones)."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return max(hostnames.count(here), int(local) if local.isdigit() else 1)


def own_plan(
    model: PreTrainedModel,
    config: ContinuousBatchingConfig,
    num_requests_hint: int | None,
    speculative: SpeculativeConfig | None,
    ranks_on_host: int = 1,
) -> CachePlan | str:
    """This rank's cache plan for ``model``, or why none fits (the message of its
    :class:`MemoryError`); with ``speculative``, the logits' room counts the rows of the
    steps that verify proposals, as on one process. ``ranks_on_host`` ranks share this
    machine's memory: each plans with its share of it."""
    try:
        return plan_cache(
            model_spec(model),
            config,
            num_requests_hint=num_requests_hint,
            speculative=speculative,
            host_share=ranks_on_host,
        )
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


def is_comm_failure(exc: BaseException) -> bool:
    """Whether ``exc`` looks like a torch.distributed backend failing to reach a peer."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(marker in text for marker in _COMM_FAILURE_MARKERS)
