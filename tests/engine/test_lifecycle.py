"""start / stop / hard stop / restart / destroy / async with / persistent managers."""

from __future__ import annotations

import asyncio
import logging
import threading
import warnings
from types import SimpleNamespace

import pytest
import torch
from transformers import GenerationConfig, PreTrainedModel

import aiocb
from aiocb.runner.model_runner import ModelRunner
from tests.conftest import random_prompts, reference_generate

PROMPTS = random_prompts(6, 10, 60, seed=7)


async def test_stop_finishes_queued_and_running_requests(qwen3: PreTrainedModel) -> None:
    manager = aiocb.Manager(qwen3)
    manager.start()
    assert manager.is_running
    ids = await manager.add_requests(PROMPTS, max_new_tokens=8)
    await manager.stop()
    assert not manager.is_running
    results = {}
    while (result := await manager.get_result()) is not None:
        results[result.request_id] = result
    assert sorted(results) == sorted(ids)
    assert all(r.status is aiocb.RequestStatus.FINISHED and len(r.generated_tokens) == 8 for r in results.values())
    await manager.destroy()


async def test_stop_takes_transformers_arguments_in_its_order(qwen3: PreTrainedModel) -> None:
    """``stop(block, timeout, keep_for_next_session, hard_stop)``: not blocking, it returns
    with the stop begun (new requests refused, running ones finishing); keeping the manager
    for the next session makes it the model's persistent one."""
    manager = aiocb.Manager(qwen3)
    manager.start()
    running = asyncio.create_task(manager.generate(PROMPTS[0], max_new_tokens=8))
    await asyncio.sleep(0)
    await manager.stop(False, None, True)
    assert manager.is_running, "stopping, not stopped"
    with pytest.raises(aiocb.ManagerClosedError):
        await manager.add_request(PROMPTS[1], max_new_tokens=2)
    output = await running
    assert output.generated_tokens == reference_generate(qwen3, PROMPTS[0], 8)
    await manager.stop(True)  # (joins the stop begun)
    assert not manager.is_running
    again = aiocb.Manager(qwen3, persistent_manager=True)
    assert again is manager and manager._runner is not None
    async with again:
        assert (await again.generate(PROMPTS[1], max_new_tokens=3)).generated_tokens == reference_generate(
            qwen3, PROMPTS[1], 3
        )
    await manager.destroy()
    fresh = aiocb.Manager(qwen3, persistent_manager=True)
    assert fresh is not manager
    await fresh.destroy()


async def test_hard_stop_fails_pending_requests(qwen3: PreTrainedModel) -> None:
    manager = aiocb.Manager(qwen3)
    manager.start()
    waiters = [asyncio.create_task(manager.generate(p, max_new_tokens=500)) for p in PROMPTS]
    queued = await manager.add_request(PROMPTS[0], max_new_tokens=500)
    await asyncio.sleep(0.05)
    await manager.stop(hard_stop=True)
    for waiter in waiters:
        with pytest.raises(aiocb.RequestAbortedError):
            await waiter
        assert isinstance(waiter.exception(), RuntimeError)
    result = await manager.get_result(queued)
    assert result is not None
    assert result.status is aiocb.RequestStatus.FAILED and result.error
    assert result.finish_reason is aiocb.FinishReason.ABORTED
    await manager.destroy()


async def test_stop_timeout_aborts_what_is_left(qwen3: PreTrainedModel) -> None:
    manager = aiocb.Manager(qwen3)
    manager.start()
    waiter = asyncio.create_task(manager.generate(PROMPTS[0], max_new_tokens=1500))
    await asyncio.sleep(0.05)
    await manager.stop(timeout=0.1)
    with pytest.raises(aiocb.RequestAbortedError):
        await waiter
    await manager.destroy()


async def test_add_after_stop_is_refused_with_a_warning(
    qwen3: PreTrainedModel, caplog: pytest.LogCaptureFixture
) -> None:
    manager = aiocb.Manager(qwen3)
    with pytest.raises(aiocb.ManagerClosedError, match="not started"):
        await manager.add_request(PROMPTS[0])
    manager.start()
    await manager.stop()
    with caplog.at_level(logging.WARNING, logger="aiocb"), pytest.raises(aiocb.ManagerClosedError, match="stopped"):
        await manager.add_request(PROMPTS[0])
    assert any("refused" in r.message for r in caplog.records)
    with pytest.raises(aiocb.ManagerClosedError):
        await manager.add_requests(PROMPTS)
    await manager.destroy()


async def test_restart_after_stop_runs_a_new_session(qwen3: PreTrainedModel) -> None:
    expected = reference_generate(qwen3, PROMPTS[1], 5)
    manager = aiocb.Manager(qwen3)
    for _ in range(2):
        manager.start()
        output = await manager.generate(PROMPTS[1], max_new_tokens=5)
        assert output.generated_tokens == expected
        await manager.stop()
    await manager.destroy()
    with pytest.raises(aiocb.ManagerClosedError, match="destroyed"):
        manager.start()
    await manager.destroy()  # idempotent


async def test_async_with_stops_and_destroys(qwen3: PreTrainedModel) -> None:
    async with aiocb.Manager(qwen3) as manager:
        assert manager.is_running
        await manager.generate(PROMPTS[0], max_new_tokens=2)
    assert not manager.is_running
    with pytest.raises(aiocb.ManagerClosedError):
        manager.start()
    # The model's own attention is back: plain generate works and matches.
    assert qwen3.config._attn_implementation == "sdpa"


async def test_async_with_hard_stops_when_the_body_raises(qwen3: PreTrainedModel) -> None:
    pending: asyncio.Task[aiocb.GenerationOutput] | None = None

    async def body() -> None:
        nonlocal pending
        async with aiocb.Manager(qwen3) as manager:
            pending = asyncio.create_task(manager.generate(PROMPTS[0], max_new_tokens=2000))
            await asyncio.sleep(0.02)
            raise KeyError("boom")

    with pytest.raises(KeyError):
        await body()
    assert pending is not None
    with pytest.raises(aiocb.RequestAbortedError):
        await pending


async def test_persistent_manager_is_reused_by_the_next_async_with(qwen3: PreTrainedModel) -> None:
    async with aiocb.Manager(qwen3, persistent_manager=True) as first:
        await first.generate(PROMPTS[0], max_new_tokens=2)
        runner = first._runner
    async with aiocb.Manager(qwen3, persistent_manager=True) as second:
        assert second is first
        assert second._runner is runner, "the cache and compiled state are kept"
        await second.generate(PROMPTS[0], max_new_tokens=2)
    await second.destroy()
    async with aiocb.Manager(qwen3, persistent_manager=True) as third:
        assert third is not first
    await third.destroy()


async def test_each_session_of_a_persistent_manager_starts_with_an_empty_batch(qwen3: PreTrainedModel) -> None:
    """Requests that end in a session's last step never depart from the persistent batch
    (no step follows): the next session's batch starts empty, or slots pile up session
    after session (and a copy cut short by a closed loop would be left half made)."""
    config = aiocb.ContinuousBatchingConfig(page_size=4, num_blocks=64)
    try:
        for session in range(3):
            prompts = random_prompts(8, 3, 10, seed=session)
            async with aiocb.Manager(qwen3, persistent_manager=True, continuous_batching_config=config) as manager:
                outputs = await manager.generate_batch(prompts, max_new_tokens=4)
                assert [o.generated_tokens for o in outputs.values()] == [
                    reference_generate(qwen3, p, 4) for p in prompts
                ]
            runner = manager._runner
            assert runner is not None and runner.writer.num_live_slots <= len(prompts), session
    finally:
        await manager.destroy()


async def test_a_persistent_manager_refuses_another_configuration(qwen3: PreTrainedModel) -> None:
    config = aiocb.ContinuousBatchingConfig(num_blocks=64)
    generation = GenerationConfig(max_new_tokens=3, eos_token_id=qwen3.generation_config.eos_token_id)
    kept = aiocb.Manager(qwen3, generation, config, persistent_manager=True)
    try:
        # The same configuration (or none given) finds the same manager.
        assert (
            aiocb.Manager(qwen3, generation, aiocb.ContinuousBatchingConfig(num_blocks=64), persistent_manager=True)
            is kept
        )
        assert aiocb.Manager(qwen3, persistent_manager=True, num_requests_hint=500) is kept
        ngram = aiocb.SpeculativeConfig(method="ngram")
        for changes, named in [
            (
                {"continuous_batching_config": aiocb.ContinuousBatchingConfig(num_blocks=65)},
                "continuous_batching_config",
            ),
            ({"speculative_config": ngram}, "speculative_config"),
            ({"generation_config": GenerationConfig(max_new_tokens=4)}, "generation_config"),
        ]:
            with pytest.raises(aiocb.InvalidConfigError, match=f"another {named};"):
                aiocb.Manager(qwen3, persistent_manager=True, **changes)
        async with aiocb.Manager(qwen3, persistent_manager=True) as manager:
            output = await manager.generate(PROMPTS[0])
        assert len(output.generated_tokens) == 3  # (its own GenerationConfig still)
    finally:
        await kept.destroy()


def test_persistent_manager_survives_successive_asyncio_runs(qwen3: PreTrainedModel) -> None:
    expected = reference_generate(qwen3, PROMPTS[2], 4)

    async def session() -> tuple[aiocb.Manager, list[int]]:
        async with aiocb.Manager(qwen3, persistent_manager=True) as manager:
            output = await manager.generate(PROMPTS[2], max_new_tokens=4)
        return manager, output.generated_tokens

    first, tokens_a = asyncio.run(session())
    second, tokens_b = asyncio.run(session())
    assert first is second and tokens_a == tokens_b == expected
    asyncio.run(first.destroy())


def test_a_manager_abandoned_by_its_loop_can_start_on_a_new_one(qwen3: PreTrainedModel) -> None:
    manager = aiocb.Manager(qwen3, persistent_manager=True)

    async def abandon() -> None:
        manager.start()
        await manager.generate(PROMPTS[0], max_new_tokens=2)
        # asyncio.run() returns without stop(): the loop cancels the step task.

    asyncio.run(abandon())
    assert not manager.is_running

    async def reuse() -> list[int]:
        async with manager:
            return (await manager.generate(PROMPTS[0], max_new_tokens=2)).generated_tokens

    assert asyncio.run(reuse()) == reference_generate(qwen3, PROMPTS[0], 2)
    asyncio.run(manager.destroy())


def test_start_outside_a_running_loop_says_how_to_use_it(qwen3: PreTrainedModel) -> None:
    manager = aiocb.Manager(qwen3)
    with pytest.raises(RuntimeError, match="running event loop"):
        manager.start()


async def test_the_step_thread_makes_the_models_device_current_before_its_first_work(
    qwen3: PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (CUDA's current device is per thread and starts as device 0; Triton launches there)
    events: list[tuple[str, str]] = []
    bind, warm_up = ModelRunner.bind_thread, ModelRunner.warm_up

    def recorded_bind(self: ModelRunner) -> None:
        events.append(("bind", threading.current_thread().name))

    def recorded_warm_up(self: ModelRunner) -> None:
        events.append(("warm_up", threading.current_thread().name))
        warm_up(self)

    monkeypatch.setattr(ModelRunner, "bind_thread", recorded_bind)
    monkeypatch.setattr(ModelRunner, "warm_up", recorded_warm_up)
    async with aiocb.Manager(qwen3) as manager:
        output = await manager.generate(PROMPTS[0], max_new_tokens=3)
    assert output.generated_tokens == reference_generate(qwen3, PROMPTS[0], 3)
    assert [event for event, _ in events[:2]] == ["bind", "warm_up"] and events[0][1] == events[1][1]
    assert events[0][1].startswith("aiocb-step")

    set_to: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", set_to.append)
    for device in (torch.device("cuda", 1), torch.device("cpu")):
        bind(SimpleNamespace(device=device))  # type: ignore[arg-type]
    assert set_to == [torch.device("cuda", 1)]


def test_a_manager_whose_loop_was_closed_without_a_stop_starts_anew(qwen3: PreTrainedModel) -> None:
    """``loop.close()`` after ``run_until_complete`` cancels nothing: the session can never
    resume, and the next loop must still be able to use, stop and destroy the manager."""
    loop = asyncio.new_event_loop()

    async def first() -> aiocb.Manager:
        manager = aiocb.Manager(qwen3, persistent_manager=True)
        manager.start()
        await manager.generate(PROMPTS[0], max_new_tokens=2)
        return manager

    manager = loop.run_until_complete(first())
    loop.close()

    async def second() -> list[int]:
        again = aiocb.Manager(qwen3, persistent_manager=True)
        assert again is manager and not again.is_running
        async with again:
            output = await again.generate(PROMPTS[2], max_new_tokens=4)
        await again.destroy()
        return output.generated_tokens

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the first loop's step task, pending when it closed)
        assert asyncio.run(second()) == reference_generate(qwen3, PROMPTS[2], 4)


async def test_a_call_from_a_thread_without_a_loop_names_the_problem(qwen3: PreTrainedModel) -> None:
    async with aiocb.Manager(qwen3) as manager:
        rid = await manager.add_request(PROMPTS[0], max_new_tokens=200)
        for call in (lambda: manager.cancel_request(rid), lambda: manager.add_request_nowait(PROMPTS[1])):
            with pytest.raises(aiocb.WrongEventLoopError, match="run_coroutine_threadsafe"):
                await asyncio.to_thread(call)
        manager.cancel_request(rid)


async def test_start_while_a_stop_is_under_way_is_refused(qwen3: PreTrainedModel) -> None:
    manager = aiocb.Manager(qwen3)
    manager.start()
    rid = await manager.add_request(PROMPTS[0], max_new_tokens=30)
    stopping = asyncio.create_task(manager.stop())
    await asyncio.sleep(0)
    with pytest.raises(aiocb.ManagerClosedError, match="still stopping"):
        manager.start()
    await stopping
    assert (await manager.get_result(rid)) is not None
    manager.start()  # (once stopped, a new session)
    assert len((await manager.generate(PROMPTS[1], max_new_tokens=2)).generated_tokens) == 2
    await manager.destroy()
