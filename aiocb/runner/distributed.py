"""Tensor parallelism over torch.distributed: rank 0 drives, the other ranks replay its steps.

A model loaded with ``DistributedConfig(tp_size=N)`` holds one shard of every weight on
each of the N ranks, and its forward pass runs collectives (on the model's own process
group) that every rank must join. Rank 0 of the tensor-parallel group owns the
scheduler: everything else is a *follower* that runs the forward passes rank 0 tells
it to, on its shard, over its own shard of the paged cache.

The parts, by job:

* :mod:`aiocb.runner.tp_layout`: where a process sits in its group, its shard of the heads;
* :mod:`aiocb.runner.tp_channel`: the CPU (gloo) group rank 0 sends its messages over;
* :mod:`aiocb.runner.tp_driver`: rank 0's runner, which sends every step to the others;
* :mod:`aiocb.runner.tp_follower`: the other ranks' loop, which replays them.

This module gathers the names the rest of aiocb uses (the engine builds its runner with
:func:`build_runner`; :mod:`aiocb.distributed` exposes the others).
"""

from __future__ import annotations

from aiocb.runner.tp_driver import build_runner, driver_layout, note_layout, return_to_followers, shutdown
from aiocb.runner.tp_follower import FollowerReport, follow, follow_call
from aiocb.runner.tp_layout import TensorParallelLayout, check_tp_size, tensor_parallel_layout

__all__ = [
    "FollowerReport",
    "TensorParallelLayout",
    "build_runner",
    "check_tp_size",
    "driver_layout",
    "follow",
    "follow_call",
    "note_layout",
    "return_to_followers",
    "shutdown",
    "tensor_parallel_layout",
]
