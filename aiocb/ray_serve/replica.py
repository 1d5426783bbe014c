"""One Ray Serve replica: an :class:`aiocb.Manager` behind ``aiocb serve``'s ASGI app.

The ingress forwards each HTTP request whole; the replica runs its app on it in-process
(:func:`~aiocb.ray_serve.forwarding.run_asgi`) and streams the response back, marked
with its :data:`REPLICA_HEADER`. The manager's step coroutine runs on the replica's
event loop, beside the handlers, as under ``aiocb serve``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from aiocb.errors import DistributedError
from aiocb.ray_serve.forwarding import ForwardedRequest, ResponseStart, run_asgi
from aiocb.ray_serve.options import ReplicaOptions
from aiocb.ray_serve.tensor_parallel import TensorParallelGroup

logger = logging.getLogger(__name__)

#: The response header naming the replica that served a request.
REPLICA_HEADER = "x-aiocb-replica"
#: How long a replica whose engine died lets the answers already made leave before it
#: exits (seconds).
_LAST_ANSWERS_S = 0.5


class ReplicaLeavingError(RuntimeError):
    """A request came to a replica whose engine is dead (it is about to exit)."""


class EngineReplica:
    """The replica deployment's class (``build_app`` makes it a Ray Serve deployment)."""

    async def __init__(  # type: ignore[misc]  # Ray Serve awaits an async constructor
        self,
        model: str | None,
        options: ReplicaOptions,
        tensor_parallel_size: int = 1,
        rank_options: dict[str, Any] | None = None,
    ) -> None:
        import aiocb
        from aiocb.cli.serve import load_pretrained, model_name
        from aiocb.server import build_app

        self.replica_id = serve.get_replica_context().replica_id.unique_id
        _set_up_logging(options)
        options = _with_device(options)
        self.options = options
        self.group: TensorParallelGroup | None = None
        if tensor_parallel_size > 1:
            if model is None:
                raise ValueError("tensor parallelism needs a model path; the bundled model is too small to shard")
            self.group = TensorParallelGroup(model, options, tensor_parallel_size, rank_options, self.replica_id)
            loaded, tokenizer = await self._load_with_followers(self.group)
        else:
            loaded, tokenizer = await asyncio.to_thread(
                load_pretrained,
                model,
                tokenizer=options.tokenizer,
                dtype=options.dtype,
                device=options.device,
                trust_remote_code=options.trust_remote_code,
                torch_threads=options.torch_threads,
                chat_template=options.chat_template,
            )
        self.manager = aiocb.Manager(
            loaded,
            continuous_batching_config=options.continuous_batching_config,
            grammar_tokenizer=tokenizer,
            speculative_config=options.speculative_config,
        )
        self.manager.start()
        await self.manager.wait_started()  # (its runner and cache built; under tensor parallelism, the ranks reached)
        self.app = build_app(
            self.manager,
            tokenizer,
            model_name(model, options.served_model_name),
            api_key=options.api_key,
            shutdown_timeout=options.shutdown_timeout,
            limits=options.limits,
            tool_call_parser=options.tool_call_parser,
            reasoning_parser=options.reasoning_parser,
            replica=self.replica_id,
        )
        self._header = ((REPLICA_HEADER.encode(), self.replica_id.encode()),)
        self._watch = asyncio.get_running_loop().create_task(self._leave_when_the_engine_dies())
        logger.info("aiocb replica %s serves %s", self.replica_id, model_name(model, options.served_model_name))

    async def _leave_when_the_engine_dies(self) -> None:
        """End this replica's process once its engine is dead. Its requests fail at once
        (500s), so it looks the least loaded of all and the router would keep sending it
        work until health checks failed three times; a replica that is gone is routed
        around at once, and Ray starts another."""
        steps = self.manager._task  # (the step loop's task: it ends when the engine dies, or stops)
        if steps is not None:
            await asyncio.wait([steps])
        if not self.manager.is_dead:
            return  # (stopped: the replica is shutting down)
        logger.error("aiocb replica %s: the engine is dead; the replica exits for Ray to replace it", self.replica_id)
        await asyncio.sleep(_LAST_ANSWERS_S)  # (the failed requests' answers leave first)
        if self.group is not None:
            await asyncio.to_thread(self.group.close)
        os._exit(1)

    @staticmethod
    async def _load_with_followers(group: TensorParallelGroup) -> tuple[Any, Any]:
        """Rank 0's load, which the followers' loads join; a follower that ends first fails it."""
        loading = asyncio.ensure_future(asyncio.to_thread(group.load_driver))
        followers = [asyncio.ensure_future(asyncio.wrap_future(run.future())) for run in group.runs]
        try:
            done, _ = await asyncio.wait([loading, *followers], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for follower in followers:
                follower.cancel()  # their runs go on in the actors; only the waits end here
                follower.add_done_callback(lambda f: f.cancelled() or f.exception())
        if loading not in done:
            ended = next(iter(done))
            why = repr(ended.exception()) if ended.exception() is not None else "it returned"
            raise DistributedError(f"a tensor-parallel follower ended while the ranks loaded the model: {why}")
        return loading.result()

    async def forward(self, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
        """Serve one HTTP request: its :class:`ResponseStart`, then its body's chunks. Once the
        engine is dead (the replica exits in a moment) a request fails before its response
        starts, which the ingress answers as it does a lost replica's: a 503 that says when
        to retry, where the replica's server would say 500 (its engine failed)."""
        if self.manager.is_dead:
            raise ReplicaLeavingError(f"aiocb replica {self.replica_id}: its engine is dead, and the replica exits")
        async with contextlib.aclosing(run_asgi(self.app, request, self._header)) as parts:
            async for part in parts:
                yield part

    async def check_health(self) -> None:
        """Ray Serve's health check: raises once the engine is dead (Ray then replaces the replica)."""
        if self.manager.is_dead:
            raise RuntimeError(f"aiocb replica {self.replica_id}: the engine is dead")
        if self.group is not None:
            self.group.check()

    async def __del__(self) -> None:
        """Ray Serve's drain has ended (it waits for running requests, ``shutdown_timeout``
        seconds at most, before calling this): the engine stops, the followers are released."""
        if not hasattr(self, "app"):  # the constructor failed: Ray still calls this
            if getattr(self, "group", None) is not None:
                await asyncio.to_thread(self.group.close)  # type: ignore[union-attr]
            return
        ctx: Any = self.app.state.aiocb
        ctx.draining = True
        try:
            if self.manager.is_running:
                await self.manager.stop(timeout=self.options.shutdown_timeout)
        finally:
            ctx.close()
            if self.group is not None:
                await asyncio.to_thread(self.group.close)


def _set_up_logging(options: ReplicaOptions) -> None:
    """aiocb's log lines in the replica's log, at ``log_level`` (Ray sets up only its own logger)."""
    aiocb_logger = logging.getLogger("aiocb")
    if not aiocb_logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        aiocb_logger.addHandler(handler)
    aiocb_logger.setLevel(options.log_level.upper())
    if not options.access_log:
        logging.getLogger("aiocb.access").setLevel(logging.WARNING)


def _with_device(options: ReplicaOptions) -> ReplicaOptions:
    """``options`` with ``device="auto"`` resolved by the GPUs Ray gave this replica."""
    import dataclasses

    import ray

    # (a CUDA device named outright build_app checked against the replicas' num_gpus)
    if options.device == "auto":
        return dataclasses.replace(options, device="cuda" if ray.get_gpu_ids() else "cpu")
    return options
