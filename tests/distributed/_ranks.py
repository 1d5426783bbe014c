"""One rank of a 2-process tensor-parallel test run (launched by ``tests/distributed/launch.py``).

``python -m tests.distributed._ranks SCENARIO MODEL_DIR OUT_DIR`` with torchrun's
environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``). Rank 0 runs the
scenario's coroutine on an aiocb.Manager and writes what it saw to ``OUT_DIR/rank0.json``;
rank 1 runs ``run_follower`` and writes its report (or its error) to ``OUT_DIR/rank1.json``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import gc
import json
import logging
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

import aiocb
import aiocb.distributed
from aiocb.runner import tp_channel
from aiocb.runner.model_runner import ModelRunner

#: Prompts of the parity checks (vocabulary of the tiny test models: 512).
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12, 100, 200, 300, 4], [400, 401, 7, 7, 7, 9, 250, 1, 2, 3, 4, 5, 6, 7]]
MAX_NEW_TOKENS = 12
#: The generated tokens of these prompts, written to OUT_DIR by the test before launch.
Scenario = Callable[[Any, Path], Awaitable[dict[str, Any]]]


def _config(**changes: Any) -> aiocb.ContinuousBatchingConfig:
    return aiocb.ContinuousBatchingConfig(page_size=16, num_blocks=128, **changes)


async def _until_steps(manager: aiocb.Manager, steps: int) -> None:
    while manager.statistics().steps < steps:  # noqa: ASYNC110 (polling the statistics is the point)
        await asyncio.sleep(0.001)


async def _generate(manager: aiocb.Manager, **params: Any) -> list[list[int]]:
    outputs = await manager.generate_batch(PROMPTS, max_new_tokens=MAX_NEW_TOKENS, **params)
    return [o.generated_tokens for o in outputs.values()]


async def scenario_main(model: Any, out: Path) -> dict[str, Any]:
    """Parity, cancellation, idle heartbeats, stop + restart, hard stop, async batching."""
    result: dict[str, Any] = {"steps": 0}
    manager = aiocb.Manager(model, continuous_batching_config=_config(cpu_group_timeout=3.0))
    try:  # (requests queue before the start on one process only)
        result["before_start"] = f"ran: {await manager.add_request(PROMPTS[0], max_new_tokens=MAX_NEW_TOKENS)}"
    except aiocb.AiocbError as exc:
        result["before_start"] = f"{type(exc).__name__}: {exc}"
    manager.start()
    await manager.wait_started()
    result["kv_heads_per_shard"] = manager._runner.spec.num_kv_heads  # type: ignore[union-attr]
    result["ranks_on_host"] = [channel.ranks_on_host for channel in tp_channel._CHANNELS.values()]
    result["greedy"] = await _generate(manager)

    # Cancel a running request: its rows leave the batch, the follower hears of it.
    victim = await manager.add_request(PROMPTS[0], max_new_tokens=1000)
    await _until_steps(manager, manager.statistics().steps + 3)
    result["cancelled_id"] = victim
    result["cancel_returned"] = manager.cancel_request(victim)
    # A request past its deadline ends on rank 0: the follower hears of that too.
    result["timed_out_id"] = await manager.add_request(PROMPTS[1], max_new_tokens=1000, timeout=0.2)
    timed_out = await manager.get_result(result["timed_out_id"], timeout=30)
    result["timed_out_reason"] = None if timed_out is None else str(timed_out.finish_reason)

    # Idle for longer than cpu_group_timeout: heartbeats keep the follower waiting.
    await asyncio.sleep(4.0)
    result["after_idle"] = await _generate(manager)

    # Graceful stop with a request in flight: it completes, then the session ends everywhere.
    finishing = asyncio.create_task(manager.generate(PROMPTS[1], max_new_tokens=MAX_NEW_TOKENS))
    await _until_steps(manager, manager.statistics().steps + 2)
    await manager.stop()
    result["steps"] += manager.statistics().steps
    result["finished_during_stop"] = (await finishing).generated_tokens

    # Restart: a new cache on every rank, same outputs.
    manager.start()
    result["after_restart"] = await _generate(manager)

    # Hard stop: the running request is aborted on rank 0, the follower hears of both.
    doomed = asyncio.create_task(manager.generate(PROMPTS[2], max_new_tokens=1000))
    await _until_steps(manager, manager.statistics().steps + 3)
    await manager.stop(hard_stop=True)
    result["steps"] += manager.statistics().steps
    try:
        await doomed
        result["hard_stop_error"] = None
    except aiocb.RequestAbortedError as exc:
        result["hard_stop_error"] = type(exc).__name__
    await manager.destroy()

    # Async batching: step N + 1 is launched on every rank before step N is collected.
    async with aiocb.Manager(model, continuous_batching_config=_config(use_async_batching=True)) as pipelined:
        result["async_batching"] = await _generate(pipelined)
    result["steps"] += pipelined.statistics().steps

    # Prompt lookup: the steps that verify proposals run on every rank too (eagerly, no graph).
    lookup = aiocb.SpeculativeConfig(prompt_lookup_min=1, disable_by_batch_size=None)
    async with aiocb.Manager(model, continuous_batching_config=_config(), speculative_config=lookup) as speculating:
        result["prompt_lookup"] = await _generate(speculating)
    stats = speculating.statistics()
    result["steps"] += stats.steps
    result["draft_tokens"] = stats.draft_tokens

    # A persistent manager keeps its cache between sessions; another manager in between
    # replaces the followers' cache, which the persistent one takes back when it restarts.
    kept = aiocb.Manager(model, continuous_batching_config=_config(), persistent_manager=True)
    result["persistent"] = []
    for manager in (kept, aiocb.Manager(model, continuous_batching_config=_config()), kept):
        async with manager:
            result["persistent"].append(await _generate(manager))
        result["steps"] += manager.statistics().steps
    await kept.destroy()
    return result


async def scenario_kill_follower(model: Any, out: Path) -> dict[str, Any]:
    """SIGKILL the follower mid-generation: every awaiter gets EngineDeadError < DistributedError."""
    result: dict[str, Any] = {}
    manager = aiocb.Manager(model, continuous_batching_config=_config(cpu_group_timeout=10.0))
    manager.start()
    await manager.wait_started()  # the follower runs run_follower, so it wrote its pid
    follower = int((out / "pid1").read_text())
    tasks = [asyncio.create_task(manager.generate(p, max_new_tokens=1500)) for p in PROMPTS]
    await _until_steps(manager, 5)
    os.kill(follower, signal.SIGKILL)
    killed = time.monotonic()
    outcomes = await asyncio.gather(*(asyncio.wait_for(t, 60) for t in tasks), return_exceptions=True)
    result["seconds_to_fail"] = time.monotonic() - killed
    result["errors"] = [_describe(e) for e in outcomes]
    try:
        await manager.add_request(PROMPTS[0])
        result["after_death"] = None
    except aiocb.AiocbError as exc:
        result["after_death"] = type(exc).__name__
    await manager.destroy()
    return result


async def _while_hung(pid: int, seconds: float, call: Callable[[], Awaitable[None]]) -> tuple[float, float]:
    """Await ``call()`` while process ``pid`` is stopped for ``seconds`` (a timer thread
    continues it, whatever the event loop does): how long the call took, and the longest
    the loop was held meanwhile."""
    done = asyncio.Event()
    stalls = asyncio.create_task(_longest_stall(done))
    await asyncio.sleep(0)  # (the ticker runs)
    os.kill(pid, signal.SIGSTOP)
    timer = threading.Timer(seconds, os.kill, (pid, signal.SIGCONT))
    timer.start()
    began = time.monotonic()
    await call()
    took = time.monotonic() - began
    done.set()
    longest = await stalls
    await asyncio.to_thread(timer.join)
    return took, longest


async def scenario_hang_follower(model: Any, out: Path) -> dict[str, Any]:
    """The follower stopped for 1.5 s while a session ends and while a persistent manager is
    destroyed (the event loop stays free); then SIGSTOPped mid-generation: rank 0 fails
    within cpu_group_timeout, then kills it."""
    result: dict[str, Any] = {}
    ended = aiocb.Manager(model, continuous_batching_config=_config(cpu_group_timeout=4.0))
    ended.start()
    await _generate(ended)  # (the follower runs run_follower, so it wrote its pid)
    follower = int((out / "pid1").read_text())
    result["stop_s"], result["stop_stall_s"] = await _while_hung(follower, 1.5, ended.stop)
    kept = aiocb.Manager(model, continuous_batching_config=_config(cpu_group_timeout=4.0), persistent_manager=True)
    kept.start()
    result["kept"] = await _generate(kept)
    result["destroy_s"], result["destroy_stall_s"] = await _while_hung(follower, 1.5, kept.destroy)
    manager = aiocb.Manager(model, continuous_batching_config=_config(cpu_group_timeout=4.0))
    manager.start()
    await manager.wait_started()
    task = asyncio.create_task(manager.generate(PROMPTS[0], max_new_tokens=1500))
    await _until_steps(manager, 5)
    os.kill(follower, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        outcome: Any = await asyncio.wait_for(task, 60)
    except Exception as exc:
        outcome = exc
    result["seconds_to_fail"] = time.monotonic() - stopped
    result["errors"] = [_describe(outcome)]
    os.kill(follower, signal.SIGKILL)
    await asyncio.sleep(1.0)  # the driver thread, stuck in the forward, sees the closed connection
    await manager.destroy()
    return result


async def scenario_kill_driver(model: Any, out: Path) -> dict[str, Any]:
    """Rank 0 dies mid-generation: the follower fails with a clear error."""
    manager = aiocb.Manager(model, continuous_batching_config=_config(cpu_group_timeout=10.0))
    manager.start()
    asyncio.create_task(manager.generate(PROMPTS[0], max_new_tokens=1500))  # noqa: RUF006
    await _until_steps(manager, 5)
    (out / "rank0.json").write_text(json.dumps({"killed_at": time.time()}))
    os.kill(os.getpid(), signal.SIGKILL)
    return {}


async def scenario_driver_forward_fails(model: Any, out: Path) -> dict[str, Any]:
    """Rank 0's forward pass fails midway, the follower inside the model's collective, and
    rank 0 stays alive: the follower fails within the process group's timeout."""
    result: dict[str, Any] = {}
    failing = False

    def fail(*_: Any) -> None:
        if failing:
            raise RuntimeError("rank 0's forward failed")

    model.register_forward_pre_hook(fail)
    manager = aiocb.Manager(model, continuous_batching_config=_config(cpu_group_timeout=30.0))
    manager.start()
    await manager.wait_started()
    task = asyncio.create_task(manager.generate(PROMPTS[0], max_new_tokens=1500))
    await _until_steps(manager, 3)
    failing = True
    try:
        outcome: Any = await asyncio.wait_for(task, 60)
    except Exception as exc:
        outcome = exc
    result["failed_at"] = time.time()
    result["errors"] = [_describe(outcome)]
    await manager.destroy()
    await asyncio.sleep(GROUP_TIMEOUT_S["driver_forward_fails"] + 8.0)  # (alive: the group stays up)
    result["exiting_at"] = time.time()
    return result


async def scenario_restart_after_shutdown(model: Any, out: Path) -> dict[str, Any]:
    """A manager started after shutdown() while the follower, released, does not follow again."""
    config = _config(cpu_group_timeout=2.0)
    async with aiocb.Manager(model, continuous_batching_config=config) as manager:
        first = await _generate(manager)
    aiocb.distributed.shutdown()
    return {"first": first, "after_shutdown": await _refused(aiocb.Manager(model, continuous_batching_config=config))}


async def _refused(manager: aiocb.Manager) -> str:
    """Start ``manager``, expecting its refusal: the error's name and message."""
    try:
        async with manager:
            return f"ran: {await _generate(manager)}"
    except aiocb.AiocbError as exc:
        return f"{type(exc).__name__}: {exc}"


async def _refused_request(manager: aiocb.Manager) -> str:
    """A request made right after ``manager.start()``, expecting the start's refusal: the error."""
    manager.start()
    try:
        return f"ran: {(await manager.generate(PROMPTS[0], max_new_tokens=MAX_NEW_TOKENS)).generated_tokens}"
    except aiocb.AiocbError as exc:
        return f"{type(exc).__name__}: {exc}"


async def scenario_two_managers(model: Any, out: Path) -> dict[str, Any]:
    """While one manager's session runs, no other may start on the same ranks."""
    result: dict[str, Any] = {}
    kept = aiocb.Manager(model, continuous_batching_config=_config(), persistent_manager=True)
    async with kept:
        result["kept"] = await _generate(kept)
    first = aiocb.Manager(model, continuous_batching_config=_config())
    async with first:
        running = asyncio.create_task(_generate(first))
        await _until_steps(first, 2)
        result["second"] = await _refused(aiocb.Manager(model, continuous_batching_config=_config()))
        result["kept_again"] = await _refused(kept)
        refused = aiocb.Manager(model, continuous_batching_config=_config())
        result["queued_on_refused"] = await _refused_request(refused)
        result["refused_running"] = refused.is_running
        result["first"] = await running
    async with kept:  # its session's turn: the followers get its cache back
        result["kept_after"] = await _generate(kept)
    await kept.destroy()
    async with aiocb.Manager(model, continuous_batching_config=_config()) as after:
        result["after"] = await _generate(after)
    return result


async def _longest_stall(done: asyncio.Event) -> float:
    """The longest the event loop was held (beyond a 5 ms sleep) until ``done`` is set."""
    loop = asyncio.get_running_loop()
    longest = 0.0
    while not done.is_set():
        before = loop.time()
        await asyncio.sleep(0.005)
        longest = max(longest, loop.time() - before - 0.005)
    return longest


async def _start_only(model: Any) -> aiocb.Manager:
    manager = aiocb.Manager(model, continuous_batching_config=_config())
    manager.start()
    return manager


async def scenario_late_follower(model: Any, out: Path) -> dict[str, Any]:
    """The follower reaches run_follower() late: start() returns at once, requests wait for it."""
    result: dict[str, Any] = {}
    # (made first: the first manager of a process sets the garbage collector up, ~0.1 s)
    manager = aiocb.Manager(model, continuous_batching_config=_config())
    done = asyncio.Event()
    stalls = asyncio.create_task(_longest_stall(done))
    await asyncio.sleep(0)  # (the ticker runs)
    began = time.perf_counter()
    manager.start()
    result["start_s"] = time.perf_counter() - began
    result["greedy"] = await _generate(manager)  # made before the ranks agreed on a cache
    done.set()
    result["longest_stall_s"] = await stalls
    await manager.stop()
    # A stop, and a destroy, while the start is under way: the session ends once it began.
    manager.start()
    await manager.stop()
    result["stopped_while_starting"] = not manager.is_running
    manager.start()
    result["restarted"] = await _generate(manager)
    await manager.destroy()
    destroyed = aiocb.Manager(model, continuous_batching_config=_config())
    destroyed.start()
    await destroyed.destroy()
    # An event loop that ends while the start is under way (asyncio.run() cancels it).
    abandoned = await asyncio.to_thread(asyncio.run, _start_only(model))
    result["abandoned_running"] = abandoned.is_running
    async with aiocb.Manager(model, continuous_batching_config=_config()) as again:
        result["again"] = await _generate(again)
    return result


async def scenario_generate_batch_alone(model: Any, out: Path) -> dict[str, Any]:
    """aiocb.generate_batch() on rank 0 alone, while the follower runs run_follower()."""
    config = _config(cpu_group_timeout=2.0)
    outputs = await asyncio.to_thread(
        aiocb.generate_batch, model, PROMPTS, continuous_batching_config=config, max_new_tokens=MAX_NEW_TOKENS
    )
    # Idle for longer than cpu_group_timeout: heartbeats keep the follower waiting.
    await asyncio.sleep(3.0)
    async with aiocb.Manager(model, continuous_batching_config=config) as manager:
        after = await _generate(manager)
    return {"generate_batch": [o.generated_tokens for o in outputs.values()], "after": after}


async def scenario_no_manager(model: Any, out: Path) -> dict[str, Any]:
    """Rank 0 starts no manager (its work failed before one, say), then calls shutdown()."""
    return {}


async def scenario_shutdown_mid_session(model: Any, out: Path) -> dict[str, Any]:
    """aiocb.distributed.shutdown() while a manager runs: its request fails, naming it."""
    manager = aiocb.Manager(model, continuous_batching_config=_config(cpu_group_timeout=10.0))
    manager.start()
    task = asyncio.create_task(manager.generate(PROMPTS[0], max_new_tokens=1500))
    await _until_steps(manager, 5)
    await asyncio.to_thread(aiocb.distributed.shutdown)
    outcome: Any
    try:
        outcome = await asyncio.wait_for(task, 60)
    except Exception as exc:
        outcome = exc
    await manager.destroy()
    return {"error": _describe(outcome)}


def _runner_refs(manager: aiocb.Manager) -> list[weakref.ref[Any]]:
    """Weak references to a manager's runner and to every K and V tensor of its cache."""
    runner = manager._runner
    assert runner is not None
    return [weakref.ref(runner), *(weakref.ref(t) for t in (*runner.cache.key, *runner.cache.value))]


def _alive(refs: list[weakref.ref[Any]]) -> int:
    return sum(ref() is not None for ref in refs)


async def scenario_release(model: Any, out: Path) -> dict[str, Any]:
    """Destroyed managers free their cache on rank 0 by reference counting alone, while rank 0 idles."""
    result: dict[str, Any] = {}
    gc.disable()  # (only reference counting frees what the check looks at)
    async with aiocb.Manager(model, continuous_batching_config=_config()) as plain:
        await _generate(plain)
        refs = _runner_refs(plain)
    result["plain_alive"] = _alive(refs)
    kept = aiocb.Manager(model, continuous_batching_config=_config(), persistent_manager=True)
    async with kept:
        await _generate(kept)
        refs = _runner_refs(kept)
    await kept.destroy()
    result["persistent_alive"] = _alive(refs)
    result["destroyed_at"] = time.time()
    gc.enable()
    return result


def _fail_cache_builds(which: set[int], rank: int, slow: set[int] = frozenset()) -> None:  # type: ignore[assignment]
    """Make this rank's ``which`` KV cache builds (counted from 1) fail, as an out-of-memory
    would, and its ``slow`` ones take a second."""
    from aiocb.runner import model_runner

    real = model_runner.PagedKVCache
    builds = 0

    def flaky(*args: Any, **kwargs: Any) -> Any:
        nonlocal builds
        builds += 1
        if builds in which:
            raise RuntimeError(f"rank {rank}'s cache build {builds} failed")
        if builds in slow:
            time.sleep(1.0)
        return real(*args, **kwargs)

    model_runner.PagedKVCache = flaky  # type: ignore[misc]


async def scenario_failed_builds(model: Any, out: Path) -> dict[str, Any]:
    """Rank 0's first runner fails to build, then the follower's second: each start fails
    at once naming it, and the next managers run, the group in step throughout; rank 0's
    next build takes longer than a heartbeat's interval (nothing is sent meanwhile)."""
    _fail_cache_builds({1}, 0, slow={2})
    result: dict[str, Any] = {}
    for name in ("rank0_failed", "follower_failed"):
        began = time.monotonic()
        manager = aiocb.Manager(model, continuous_batching_config=_config(cpu_group_timeout=2.0))
        manager.start()
        try:
            await manager.wait_started()
            result[name] = None
        except Exception as exc:
            result[name] = _describe(exc) | {"seconds": time.monotonic() - began}
        await manager.destroy()
    async with aiocb.Manager(model, continuous_batching_config=_config(cpu_group_timeout=2.0)) as manager:
        result["slow_build"] = await _generate(manager)
    async with aiocb.Manager(model, continuous_batching_config=_config()) as manager:
        result["after"] = await _generate(manager)
    return result


async def _start_a_manager(model: Any) -> str | None:
    """On a follower: the error a Manager gives at start."""
    try:
        aiocb.Manager(model).start()
    except aiocb.AiocbError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _watch_runners() -> list[float]:
    """When each model runner of this process is freed (``time.time()``, rank 0's clock too)."""
    freed: list[float] = []
    build = ModelRunner.__init__

    def watched(runner: ModelRunner, *args: Any, **kwargs: Any) -> None:
        build(runner, *args, **kwargs)
        weakref.finalize(runner, lambda: freed.append(time.time()))

    ModelRunner.__init__ = watched  # type: ignore[method-assign]
    return freed


def _describe(outcome: object) -> dict[str, Any]:
    if not isinstance(outcome, BaseException):
        return {"type": None}
    cause = outcome.__cause__
    return {
        "type": type(outcome).__name__,
        "message": str(outcome),
        "cause_type": None if cause is None else type(cause).__name__,
        "cause_message": None if cause is None else str(cause),
    }


SCENARIOS: dict[str, Scenario] = {
    "main": scenario_main,
    "kill_follower": scenario_kill_follower,
    "hang_follower": scenario_hang_follower,
    "kill_driver": scenario_kill_driver,
    "release": scenario_release,
    "two_managers": scenario_two_managers,
    "generate_batch_alone": scenario_generate_batch_alone,
    "shutdown_mid_session": scenario_shutdown_mid_session,
    "late_follower": scenario_late_follower,
    "driver_forward_fails": scenario_driver_forward_fails,
    "restart_after_shutdown": scenario_restart_after_shutdown,
    "failed_builds": scenario_failed_builds,
    "no_manager": scenario_no_manager,
}
#: What a follower does before run_follower() in a scenario.
FOLLOWER_SETUP: dict[str, Callable[[int], None]] = {
    "failed_builds": lambda rank: _fail_cache_builds({2}, rank),
}
#: Seconds the follower stays after run_follower() returned, as if it did other work.
FOLLOWER_STAYS_S = {"restart_after_shutdown": 8.0}
#: The process group's timeout (the model's collectives'), where a scenario sets it.
GROUP_TIMEOUT_S = {"driver_forward_fails": 4.0}
#: Seconds the follower waits before run_follower(), as if it were still loading.
FOLLOWER_LATE_S = {"late_follower": 2.0}


def every_rank_generate_batch(model: Any, rank: int) -> dict[str, Any]:
    """``aiocb.generate_batch`` called on every rank, as transformers users write it: a good
    call, one rank 0 refuses, one whose prompts differ on this rank, then a good one again."""
    record: dict[str, Any] = {}

    def call(name: str, prompts: list[list[int]], **params: Any) -> None:
        try:
            outputs = aiocb.generate_batch(model, prompts, continuous_batching_config=_config(), **params)
            record[name] = {"ids": list(outputs), "tokens": [o.generated_tokens for o in outputs.values()]}
        except aiocb.AiocbError as exc:
            record[name] = {"error": f"{type(exc).__name__}: {exc}"}

    call("first", PROMPTS, max_new_tokens=MAX_NEW_TOKENS)
    call("refused", PROMPTS, max_new_tokens=MAX_NEW_TOKENS, temperature=-1.0)
    call("diverged", PROMPTS if rank == 0 else PROMPTS[:2], max_new_tokens=MAX_NEW_TOKENS)
    # An argument refused on one follower alone: the follower still follows rank 0's call.
    call("refused_here", PROMPTS, max_new_tokens=MAX_NEW_TOKENS, **({} if rank == 0 else {"warmup": False}))
    # A one-shot iterable, whose repr differs between processes: read once, the same everywhere.
    call("generator", PROMPTS, max_new_tokens=MAX_NEW_TOKENS, allowed_token_ids=(t for t in range(0, 512, 2)))
    # A persistent manager kept between calls that every rank makes: its cache sent again.
    call("persistent", PROMPTS, max_new_tokens=MAX_NEW_TOKENS, persistent_manager=True)
    call("persistent_again", PROMPTS, max_new_tokens=MAX_NEW_TOKENS, persistent_manager=True)
    call("empty", [], max_new_tokens=MAX_NEW_TOKENS)
    call("again", PROMPTS[1:], max_new_tokens=MAX_NEW_TOKENS)
    return record


def main() -> None:
    scenario, model_dir, out_dir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S.get(scenario, 1800.0)))
    rank = dist.get_rank()
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    model = aiocb.distributed.load_model(model_dir, tp_size=2)
    if scenario == "generate_batch":
        record = every_rank_generate_batch(model, rank)
        aiocb.distributed.shutdown()
        (out_dir / f"rank{rank}.json").write_text(json.dumps(record))
    elif aiocb.distributed.is_driver(model):
        result = asyncio.run(SCENARIOS[scenario](model, out_dir))
        aiocb.distributed.shutdown()
        (out_dir / "rank0.json").write_text(json.dumps(result))
    else:
        (out_dir / f"pid{rank}").write_text(str(os.getpid()))
        record: dict[str, Any] = {"manager_here": asyncio.run(_start_a_manager(model))}
        record["runners_freed_at"] = _watch_runners()
        time.sleep(FOLLOWER_LATE_S.get(scenario, 0.0))
        FOLLOWER_SETUP.get(scenario, lambda _: None)(rank)
        try:
            report = aiocb.distributed.run_follower(model, _config(cpu_group_timeout=10.0))
            record |= {"report": dataclasses.asdict(report), "error": None}
        except Exception as exc:
            record |= {"report": None, "error": {"type": type(exc).__name__, "message": str(exc)}}
        record["ended_at"] = time.time()
        time.sleep(FOLLOWER_STAYS_S.get(scenario, 0.0))
        (out_dir / f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
