"""A forward pass that raises kills the engine loudly, never silently or with a hang."""

from __future__ import annotations

import asyncio

import pytest
import torch

import aiocb
from tests.conftest import arm_failure, random_prompts, tiny_qwen3

PROMPTS = random_prompts(4, 10, 40, seed=11)


class Boom(RuntimeError):
    pass


class Interrupt(BaseException):
    """Not an Exception (as pytest.fail's and pytest.skip's are not)."""


# (a BaseException that is no Exception too: pytest.fail in a forward hook, say)
@pytest.mark.parametrize("error", [Boom, Interrupt])
async def test_a_failing_forward_reaches_every_awaiter_and_stream(error: type[BaseException]) -> None:
    model = tiny_qwen3()
    switch = arm_failure(model, error)
    manager = aiocb.Manager(model)
    manager.start()
    await manager.generate(PROMPTS[0], max_new_tokens=2)  # healthy first
    awaiting = [asyncio.create_task(manager.generate(p, max_new_tokens=500)) for p in PROMPTS]
    streamed = await manager.add_request(PROMPTS[0], max_new_tokens=500)
    shared = await manager.add_request(PROMPTS[1], max_new_tokens=500)
    stream = manager.stream(streamed)
    await anext(stream)
    results_waiter = asyncio.create_task(manager.get_result(shared))
    switch["fail"] = True

    for task in awaiting:
        with pytest.raises(aiocb.EngineDeadError) as caught:
            await asyncio.wait_for(task, 10)
        assert isinstance(caught.value.__cause__, error)
        assert isinstance(caught.value.cause, error)
    with pytest.raises(aiocb.EngineDeadError):
        await asyncio.wait_for(anext(stream), 10)
    with pytest.raises(aiocb.EngineDeadError):
        await asyncio.wait_for(results_waiter, 10)
    assert manager.is_dead and not manager.is_running
    with pytest.raises(aiocb.EngineDeadError):
        await manager.add_request(PROMPTS[2])
    with pytest.raises(aiocb.EngineDeadError):
        await manager.get_result()
    with pytest.raises(aiocb.EngineDeadError):
        manager.start()
    await manager.stop()  # no-op on a dead manager
    await manager.destroy()
    assert model.config._attn_implementation == "sdpa"


async def test_a_base_exception_while_the_runner_is_built_fails_the_start(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiocb.engine import manager as manager_module

    def interrupted(*args: object, **kwargs: object) -> None:
        raise Interrupt("while building the runner")

    monkeypatch.setattr(manager_module, "build_runner", interrupted)
    manager = aiocb.Manager(tiny_qwen3())
    manager.start()
    queued = asyncio.create_task(manager.generate(PROMPTS[0], max_new_tokens=2))
    with pytest.raises(Interrupt):
        await asyncio.wait_for(manager.wait_started(), 10)
    with pytest.raises(aiocb.RequestAbortedError, match="Interrupt"):
        await asyncio.wait_for(queued, 10)
    assert not manager.is_running and not manager.is_dead


@pytest.mark.parametrize("error", [torch.OutOfMemoryError, MemoryError])
async def test_a_first_pass_out_of_memory_is_the_cause_not_the_models_attention(error: type[Exception]) -> None:
    """A first pass that fails before any layer reaches aiocb's attention is taken for a
    model whose own attention failed on aiocb's inputs, unless it ran out of memory: that
    is the cause, as it came."""
    model = tiny_qwen3()
    arm_failure(model, error)["fail"] = True
    with pytest.raises(aiocb.EngineDeadError) as caught:
        async with aiocb.Manager(model) as manager:
            await manager.generate(PROMPTS[0], max_new_tokens=3)
    assert type(caught.value.cause) is error


async def test_async_with_around_a_dying_engine_exits_cleanly() -> None:
    model = tiny_qwen3()
    switch = arm_failure(model, Boom)
    switch["fail"] = True
    with pytest.raises(aiocb.EngineDeadError):
        async with aiocb.Manager(model) as manager:
            await manager.generate(PROMPTS[0], max_new_tokens=3)
    assert model.config._attn_implementation == "sdpa"


async def test_a_pipelined_failure_leaves_no_step_unaccounted_for(caplog: pytest.LogCaptureFixture) -> None:
    """Under async batching the next step is launched while the failing one is collected:
    that one's outcome is retrieved too, not left to the collector's "never retrieved"."""
    import gc

    model = tiny_qwen3()
    switch = arm_failure(model, Boom)
    config = aiocb.ContinuousBatchingConfig(use_async_batching=True)
    manager = aiocb.Manager(model, continuous_batching_config=config)
    manager.start()
    await manager.generate(PROMPTS[0], max_new_tokens=2)
    awaiting = [asyncio.create_task(manager.generate(p, max_new_tokens=300)) for p in PROMPTS]
    await asyncio.sleep(0.05)
    switch["fail"] = True
    outcomes = await asyncio.wait_for(asyncio.gather(*awaiting, return_exceptions=True), 20)
    assert all(isinstance(outcome, aiocb.EngineDeadError) for outcome in outcomes)
    await manager.destroy()
    await asyncio.sleep(0.1)
    gc.collect()
    await asyncio.sleep(0)
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]
    stats = manager.statistics()
    assert stats.free_blocks == stats.total_blocks


def test_a_dead_manager_says_so_from_a_new_loop_once_its_own_closed() -> None:
    """The engine died, then its event loop was closed: callers on a new loop hear of the
    failure, not of a wrong event loop, and may destroy the manager."""
    model = tiny_qwen3()
    switch = arm_failure(model, Boom)
    manager = aiocb.Manager(model)
    loop = asyncio.new_event_loop()

    async def die() -> None:
        manager.start()
        switch["fail"] = True
        with pytest.raises(aiocb.EngineDeadError):
            await manager.generate(PROMPTS[0], max_new_tokens=3)

    loop.run_until_complete(die())
    loop.close()

    async def later() -> None:
        with pytest.raises(aiocb.EngineDeadError):
            await manager.get_result()
        with pytest.raises(aiocb.EngineDeadError):
            await manager.add_request(PROMPTS[1], max_new_tokens=3)
        assert manager.is_dead
        await manager.destroy()

    asyncio.run(later())
