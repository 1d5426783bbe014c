"""Tensor parallelism: serve a model larger than one device from several processes.

Launch one process per device with ``torchrun --nproc-per-node N`` (``--nnodes`` to span
machines). Every rank loads its shard of the weights; rank 0 runs the
:class:`~aiocb.Manager` (the event loop, the scheduler, the API), every other rank runs
:func:`run_follower`, which replays the steps rank 0 broadcasts::

    import aiocb, aiocb.distributed

    model = aiocb.distributed.load_model(path, tp_size=2)
    if aiocb.distributed.is_driver(model):
        asyncio.run(serve(model))          # an aiocb.Manager, as on one device
        aiocb.distributed.shutdown()       # release the other ranks
    else:
        aiocb.distributed.run_follower(model)

One manager's session runs on the ranks at a time, as they hold one cache at a time:
starting another manager on rank 0 while one runs raises
:class:`~aiocb.InvalidRequestError` (a persistent manager between its sessions does not
count; the next session of either takes the cache back).

Rank 0 talks to the others over a CPU (gloo) process group. ``cpu_group_timeout`` (of
the :class:`~aiocb.ContinuousBatchingConfig`) bounds every wait on another rank: when a
rank dies or hangs, the others fail with :class:`~aiocb.DistributedError` (on rank 0,
every pending request gets :class:`~aiocb.EngineDeadError` caused by it) instead of
waiting forever. Restart every rank after that. The model's own collectives wait as long
as the process group's timeout: initialise it with the same
(``dist.init_process_group(backend, timeout=datetime.timedelta(seconds=...))``), or a
follower left inside one when rank 0's forward pass failed midway waits for the backend's
default (30 minutes with gloo) or for rank 0 to exit.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from aiocb.collector import thaw_frozen_objects
from aiocb.config import ContinuousBatchingConfig
from aiocb.errors import InvalidConfigError
from aiocb.runner.distributed import (
    FollowerReport,
    TensorParallelLayout,
    check_tp_size,
    follow,
    note_layout,
    tensor_parallel_layout,
)
from aiocb.runner.distributed import shutdown as _shutdown

__all__ = [
    "FollowerReport",
    "TensorParallelLayout",
    "is_driver",
    "load_model",
    "run_follower",
    "shutdown",
    "tensor_parallel_layout",
    "validate_tp",
]


def validate_tp(path: str | os.PathLike[str], tp_size: int, *, device_map: Any = None, **config_kwargs: Any) -> None:
    """Check, from the model's config alone, that ``tp_size`` can shard it.

    Raises :class:`~aiocb.InvalidConfigError` when ``device_map`` is given with
    ``tp_size > 1`` (each rank loads its own shard on its own device), when transformers
    has no tensor-parallel plan for the model, or when ``tp_size`` does not divide the
    model's ``num_key_value_heads``.
    """
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise InvalidConfigError(f"tp_size must be an int >= 1, got {tp_size!r}")
    if tp_size == 1:
        return
    if device_map is not None:
        raise InvalidConfigError(
            f"device_map={device_map!r} and tensor parallelism (tp_size={tp_size}) are mutually exclusive: "
            "under torchrun every rank loads its shard on its own device; drop device_map"
        )
    text = AutoConfig.from_pretrained(path, **config_kwargs).get_text_config()
    if not getattr(text, "base_model_tp_plan", None):
        raise InvalidConfigError(
            f"transformers has no tensor-parallel plan for {type(text).__name__} (its base_model_tp_plan is "
            f"empty): the model cannot be sharded, tp_size={tp_size}"
        )
    num_heads = int(text.num_attention_heads)
    check_tp_size(tp_size, int(getattr(text, "num_key_value_heads", None) or num_heads))


def load_model(
    path: str | os.PathLike[str],
    tp_size: int,
    *,
    device_map: Any = None,
    **kwargs: Any,
) -> PreTrainedModel:
    """Load a causal LM with its weights sharded over ``tp_size`` ranks (one shard here).

    Call it on every rank, under ``torchrun --nproc-per-node tp_size`` (the process group
    is initialised from torchrun's environment if it is not already). The configuration
    is checked first (see :func:`validate_tp`), so a wrong ``tp_size`` fails before any
    weight is read. ``tp_size=1`` loads an ordinary model. Other keyword arguments go to
    ``AutoModelForCausalLM.from_pretrained``.
    """
    if "distributed_config" in kwargs or "tp_plan" in kwargs:
        raise InvalidConfigError("load_model() builds the distributed config from tp_size; do not pass one")
    config_kwargs = {k: kwargs[k] for k in ("revision", "trust_remote_code", "token", "cache_dir") if k in kwargs}
    validate_tp(path, tp_size, device_map=device_map, **config_kwargs)
    if tp_size == 1:
        model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(path, device_map=device_map, **kwargs)
    else:
        from transformers import DistributedConfig

        model = AutoModelForCausalLM.from_pretrained(
            path, distributed_config=DistributedConfig(tp_size=tp_size), **kwargs
        )
        note_layout(tensor_parallel_layout(model))  # (shutdown() releases the followers of rank 0's groups)
    return model  # from_pretrained returns it in eval mode


def is_driver(model: PreTrainedModel) -> bool:
    """Whether this process runs the :class:`~aiocb.Manager`: rank 0 of the model's
    tensor-parallel group, or any process of a model without tensor parallelism."""
    layout = tensor_parallel_layout(model)
    note_layout(layout)
    return layout is None or layout.is_driver


def run_follower(
    model: PreTrainedModel, continuous_batching_config: ContinuousBatchingConfig | None = None
) -> FollowerReport:
    """On every rank but 0: run the steps rank 0 broadcasts, until rank 0 calls :func:`shutdown`.

    Those are the steps of rank 0's managers, and of :func:`aiocb.generate_batch` called
    on rank 0 alone (called on every rank, it follows rank 0 by itself instead).

    Blocks. Returns what was received (counts of steps, sessions, stops and
    cancellations); raises :class:`~aiocb.DistributedError` if rank 0 dies or sends
    nothing for ``cpu_group_timeout`` seconds. Every other setting follows rank 0's
    manager configuration; ``continuous_batching_config`` gives only the timeout to use
    until rank 0's first manager starts.
    """
    return follow(model, continuous_batching_config)


def shutdown(timeout: float | None = None) -> None:
    """On rank 0: release the follower ranks (their :func:`run_follower` returns).

    Call it once rank 0 is done with its managers, before ``destroy_process_group()``,
    whether or not a manager ran: the followers of a model :func:`load_model` loaded or
    :func:`is_driver` saw on rank 0 are released all the same (where none ran, it waits up
    to ``timeout`` for them to join in :func:`run_follower`, then warns). It also runs at
    interpreter exit, for the followers of managers. A no-op on other ranks and without
    tensor parallelism; waits at most ``timeout`` seconds a step (default:
    ``cpu_group_timeout``). After ``generate_batch()`` called on every rank the followers
    are free: it releases nobody (a follower that then runs :func:`run_follower` follows
    rank 0's next manager or ``generate_batch()``).

    On every rank of a process group, the objects aiocb moved out of the garbage collector's view (see
    :mod:`aiocb.collector`) are put back and collected: a cycle of them left frozen keeps
    what it refers to of torch.distributed alive past ``destroy_process_group()``, to be
    torn down at the interpreter's exit, which aborted rank 0 about one exit in twenty
    ("terminate called without an active exception").
    """
    _shutdown(timeout)
    if dist.is_available() and dist.is_initialized():
        thaw_frozen_objects()
