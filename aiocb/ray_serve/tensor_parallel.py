"""A tensor-parallel group inside one replica: rank 0 is the replica, the others Ray actors.

``build_app(..., tensor_parallel_size=N)`` gives each replica a placement group of N
bundles. The replica (in bundle 0) starts one actor per other rank in bundles 1 to N-1;
every process joins one torch.distributed group (gloo on CPU, NCCL on GPUs) over the
replica's node address and loads its shard with :func:`aiocb.distributed.load_model`.
The replica then runs the :class:`~aiocb.Manager` as rank 0 and the actors run
:func:`aiocb.distributed.run_follower`, as under ``torchrun``.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from aiocb.config import MAX_CPU_GROUP_TIMEOUT
from aiocb.errors import DistributedError, InvalidConfigError
from aiocb.ray_serve.options import ReplicaOptions

#: The Ray namespace of the follower actors.
FOLLOWER_NAMESPACE = "aiocb"
#: Seconds a follower actor gets to return after rank 0 released it.
CLOSE_TIMEOUT_S = 5.0


class TensorParallelGroup:
    """Rank 0's view of its replica's group: the follower actors and their runs."""

    def __init__(
        self,
        model: str,
        options: ReplicaOptions,
        size: int,
        rank_options: dict[str, Any] | None = None,
        replica_id: str = "",
    ) -> None:
        placement_group = ray.util.get_current_placement_group()
        if placement_group is None:
            raise InvalidConfigError(
                "a tensor-parallel replica needs a placement group of one bundle per rank (build_app sets it)"
            )
        self.model = model
        self.options = options
        self.size = size
        self.address = ray.util.get_node_ip_address()
        self.port = _free_port(self.address)
        actor: Any = ray.remote(TensorParallelRank)
        self.actors: list[Any] = [
            actor.options(
                **(rank_options or {"num_cpus": 1}),
                name=follower_name(replica_id, rank),
                namespace=FOLLOWER_NAMESPACE,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=placement_group, placement_group_bundle_index=rank
                ),
            ).remote()
            for rank in range(1, size)
        ]
        self.runs = [
            actor.run.remote(model, options, rank, size, self.address, self.port)
            for rank, actor in enumerate(self.actors, start=1)
        ]
        self.closed = False

    def load_driver(self) -> tuple[Any, Any]:
        """Join the group as rank 0 and load this rank's shard and the tokenizer (blocks)."""
        from aiocb.cli.serve import load_tokenizer

        model = join_and_load(self.model, self.options, 0, self.size, self.address, self.port)
        options = self.options
        tokenizer = load_tokenizer(options.tokenizer or self.model, options.trust_remote_code, options.chat_template)
        return model, tokenizer

    def check(self) -> None:
        """Raise :class:`~aiocb.DistributedError` when a follower's run has ended (it failed or died)."""
        ended, _ = ray.wait(self.runs, num_returns=1, timeout=0)
        if ended and not self.closed:
            try:
                ray.get(ended[0])
            except Exception as exc:
                raise DistributedError(f"a tensor-parallel follower of this replica failed: {exc}") from exc
            raise DistributedError("a tensor-parallel follower of this replica returned while the replica runs")

    def close(self) -> None:
        """Release the followers (their runs return), then end their actors."""
        import aiocb.distributed

        self.closed = True
        try:
            aiocb.distributed.shutdown(CLOSE_TIMEOUT_S)
            ray.wait(self.runs, num_returns=len(self.runs), timeout=CLOSE_TIMEOUT_S)
        finally:  # (the actors end whatever the release did)
            for actor in self.actors:
                ray.kill(actor)


class TensorParallelRank:
    """A follower rank (a Ray actor in its replica's placement group)."""

    def run(self, model: str, options: ReplicaOptions, rank: int, size: int, address: str, port: int) -> dict[str, Any]:
        """Join the group, load this rank's shard and follow rank 0 until it releases the group."""
        import aiocb.distributed

        loaded = join_and_load(model, options, rank, size, address, port)
        report = aiocb.distributed.run_follower(loaded, options.continuous_batching_config)
        return dataclasses.asdict(report)


def follower_name(replica_id: str, rank: int) -> str:
    """The Ray actor name of a replica's follower rank (in :data:`FOLLOWER_NAMESPACE`)."""
    return f"aiocb-tp-{replica_id}-rank{rank}"


def join_and_load(model: str, options: ReplicaOptions, rank: int, size: int, address: str, port: int) -> Any:
    """Join the replica's torch.distributed group as ``rank`` and load this rank's shard."""
    import torch
    import torch.distributed as dist

    import aiocb.distributed

    cuda = options.device.startswith("cuda") or (options.device == "auto" and torch.cuda.is_available())
    # Ray gives each actor of a GPU replica its own device, so every rank's is cuda:0.
    os.environ.update(
        MASTER_ADDR=address,
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(size),
        LOCAL_RANK="0" if cuda else str(rank),
        LOCAL_WORLD_SIZE="1" if cuda else str(size),
    )
    if options.torch_threads:
        torch.set_num_threads(options.torch_threads)
    if not dist.is_initialized():
        # The model's own collectives wait as long as the group's timeout: a follower left in
        # one when rank 0's forward failed midway waits for cpu_group_timeout, not gloo's 30 min.
        timeout = options.continuous_batching_config.cpu_group_timeout  # (None: for ever, as the config says)
        bound = datetime.timedelta(seconds=MAX_CPU_GROUP_TIMEOUT if timeout is None else timeout)
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=size, timeout=bound)
    dtype: Any = options.dtype if options.dtype == "auto" else getattr(torch, options.dtype)
    return aiocb.distributed.load_model(model, tp_size=size, dtype=dtype, trust_remote_code=options.trust_remote_code)


def _free_port(address: str) -> int:
    with socket.socket() as sock:
        sock.bind((address, 0))
        port: int = sock.getsockname()[1]
        return port
