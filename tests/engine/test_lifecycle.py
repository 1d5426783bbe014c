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
    for _ in range(2):  # (and again after a restart)
        manager.start()
        await manager.stop()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="aiocb"):
            with pytest.raises(aiocb.ManagerClosedError, match="stopped"):
                await manager.add_request(PROMPTS[0])
            with pytest.raises(aiocb.ManagerClosedError):
                await manager.add_requests(PROMPTS)
            for _ in range(100):  # (a stop with many callers under way: one line, not one each)
                with pytest.raises(aiocb.ManagerClosedError):
                    manager.add_request_nowait(PROMPTS[0])
        assert [r.message for r in caplog.records if "refused" in r.message] == [
            "request refused: the manager is stopped and accepts no new requests; call start() again "
            "(others refused so are not logged)"
        ]
    await manager.destroy()


async def test_requests_made_before_the_first_start_wait_for_it(qwen3: PreTrainedModel) -> None:
    """As in transformers, requests may be made before ``start()``: they are checked when
    made and queue until the start, by every way of making them; a stream, a result awaited
    and a ``generate`` begun before the start get their outputs after it."""
    expected = [reference_generate(qwen3, p, 6) for p in PROMPTS]
    manager = aiocb.Manager(qwen3)
    first = await manager.add_request(PROMPTS[0], max_new_tokens=6)
    second = manager.add_request_nowait(PROMPTS[1], max_new_tokens=6)
    more = await manager.add_requests(PROMPTS[2:4], max_new_tokens=6)
    streamed = await manager.add_request(PROMPTS[4], max_new_tokens=6, streaming=True)
    doomed = await manager.add_request(PROMPTS[5], max_new_tokens=6)
    assert manager.cancel_request(doomed)
    with pytest.raises(aiocb.InvalidRequestError, match="context length"):
        await manager.add_request(PROMPTS[0], max_new_tokens=10**6)
    stats = manager.statistics()
    assert not stats.is_running and stats.waiting_requests == 5 and stats.steps == 0
    chunks: list[aiocb.GenerationOutput] = []

    async def read() -> None:
        chunks.extend([chunk async for chunk in manager.stream(streamed)])

    reading = asyncio.create_task(read())
    generating = asyncio.create_task(manager.generate(PROMPTS[5], max_new_tokens=6))
    awaited = asyncio.create_task(manager.get_result(first))
    await asyncio.sleep(0.05)
    assert not (reading.done() or generating.done() or awaited.done()), "nothing runs before the start"
    manager.start()
    assert (await awaited).generated_tokens == expected[0]
    assert (await generating).generated_tokens == expected[5]
    await reading
    assert chunks[-1].generated_tokens == expected[4] and len(chunks) > 1
    outputs = {}
    for request_id in (second, *more, doomed):
        output = await manager.get_result(request_id)
        assert output is not None
        outputs[request_id] = output
    assert [outputs[i].generated_tokens for i in (second, *more)] == expected[1:4]
    assert outputs[doomed].status is aiocb.RequestStatus.CANCELLED
    stats = manager.statistics()
    assert stats.free_blocks == stats.total_blocks
    await manager.stop()
    await manager.destroy()


async def test_requests_queued_before_a_start_that_never_comes_are_aborted(qwen3: PreTrainedModel) -> None:
    """A stop or a destroy before the first start aborts what was queued and what waits for
    room in the queue; a ``get_result()`` waiting returns None. After the stop new requests
    are refused, as after any stop, until a start: the manager then serves as a new one."""
    config = aiocb.ContinuousBatchingConfig(max_queue_size=2)
    manager = aiocb.Manager(qwen3, continuous_batching_config=config)
    waiter = asyncio.create_task(manager.generate(PROMPTS[0], max_new_tokens=4))
    queued = await manager.add_request(PROMPTS[1], max_new_tokens=4)
    blocked = asyncio.create_task(manager.add_request(PROMPTS[2], max_new_tokens=4))  # (no room)
    shared = asyncio.create_task(manager.get_result())
    await asyncio.sleep(0.01)
    assert not (blocked.done() or shared.done())
    await manager.stop()
    with pytest.raises(aiocb.RequestAbortedError, match=r"stop\(\) before start\(\) aborted the request"):
        await waiter
    with pytest.raises(aiocb.ManagerClosedError, match=r"stop\(\) before start\(\): the request was not queued"):
        await blocked
    first = await shared
    assert first is not None and first.request_id == queued  # (the aborted output, then no more)
    assert first.status is aiocb.RequestStatus.FAILED and first.finish_reason is aiocb.FinishReason.ABORTED
    assert await manager.get_result() is None
    with pytest.raises(aiocb.ManagerClosedError, match="stopped"):
        await manager.add_request(PROMPTS[0], max_new_tokens=4)
    manager.start()
    again = await manager.generate(PROMPTS[0], max_new_tokens=4)
    assert again.generated_tokens == reference_generate(qwen3, PROMPTS[0], 4)
    await manager.stop()
    await manager.destroy()

    manager = aiocb.Manager(qwen3)
    waiter = asyncio.create_task(manager.generate(PROMPTS[0], max_new_tokens=4))
    await asyncio.sleep(0)
    await manager.destroy()
    with pytest.raises(aiocb.RequestAbortedError, match=r"destroy\(\) before start\(\) aborted the request"):
        await waiter


async def test_a_timeout_ends_a_request_queued_before_the_start_at_its_deadline(qwen3: PreTrainedModel) -> None:
    manager = aiocb.Manager(qwen3)
    waiter = asyncio.create_task(manager.generate(PROMPTS[0], max_new_tokens=4, timeout=0.05))
    kept = await manager.add_request(PROMPTS[1], max_new_tokens=4, timeout=30.0)
    output = await asyncio.wait_for(waiter, 5.0)
    assert output.finish_reason is aiocb.FinishReason.TIMEOUT and not output.generated_tokens
    async with manager:
        result = await manager.get_result(kept)
    assert result is not None and result.generated_tokens == reference_generate(qwen3, PROMPTS[1], 4)


async def test_a_refused_request_before_the_start_queues_nothing(qwen3: PreTrainedModel) -> None:
    """A request refused before the start (or a precompile) leaves no queue behind: a
    ``get_result()`` returns None at once and the manager may start on any loop."""
    manager = aiocb.Manager(qwen3)
    with pytest.raises(aiocb.InvalidRequestError, match="context length"):
        await manager.add_request(PROMPTS[0], max_new_tokens=10**6)
    assert await asyncio.wait_for(manager.get_result(), 1.0) is None

    def elsewhere() -> list[int]:
        async def serve() -> list[int]:
            async with manager:
                return (await manager.generate(PROMPTS[0], max_new_tokens=4)).generated_tokens

        return asyncio.run(serve())

    assert await asyncio.to_thread(elsewhere) == reference_generate(qwen3, PROMPTS[0], 4)


def test_requests_queued_on_a_loop_that_closed_before_the_start_are_dropped(qwen3: PreTrainedModel) -> None:
    """Requests queued before the start on an event loop that then closed (``asyncio.run``
    returned, or ``close()`` with a ``generate``, a ``get_result()`` and a request waiting
    for room still awaiting) are dropped with a warning; the manager starts on a new loop as
    a new one. A start on another loop while the first still runs is refused."""
    manager = aiocb.Manager(qwen3, continuous_batching_config=aiocb.ContinuousBatchingConfig(max_queue_size=1))

    async def queue() -> None:
        await manager.add_request(PROMPTS[0], max_new_tokens=4)

    asyncio.run(queue())
    closed = asyncio.new_event_loop()
    awaiting = [
        closed.create_task(manager.generate(PROMPTS[1], max_new_tokens=4)),
        closed.create_task(manager.add_request(PROMPTS[2], max_new_tokens=4)),  # (no room)
    ]
    closed.run_until_complete(asyncio.sleep(0.01))
    dropped = closed.run_until_complete(manager.get_result())  # (the request queued on the first loop)
    assert dropped is not None and dropped.finish_reason is aiocb.FinishReason.ABORTED
    awaiting.append(closed.create_task(manager.get_result()))
    closed.run_until_complete(asyncio.sleep(0.01))
    assert not any(task.done() for task in awaiting)
    closed.close()

    async def serve() -> list[int]:
        assert manager.statistics().waiting_requests == 0
        async with manager:
            return (await manager.generate(PROMPTS[0], max_new_tokens=4)).generated_tokens

    assert asyncio.run(serve()) == reference_generate(qwen3, PROMPTS[0], 4)

    other = aiocb.Manager(qwen3)
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(other.add_request(PROMPTS[0], max_new_tokens=4))

        async def start_elsewhere() -> None:
            with pytest.raises(aiocb.WrongEventLoopError):
                other.start()

        asyncio.run(start_elsewhere())
        loop.run_until_complete(other.destroy())
    finally:
        loop.close()


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


async def test_the_last_async_with_block_out_stops_the_manager(
    qwen3: PreTrainedModel, caplog: pytest.LogCaptureFixture
) -> None:
    """A block nested in another (a helper's ``async with manager``), or another task's,
    leaves the manager running for the blocks still in it, even leaving by an error: the
    last one out stops and destroys it."""
    manager = aiocb.Manager(qwen3)
    async with manager:
        async with manager:
            await manager.generate(PROMPTS[0], max_new_tokens=2)
        running: asyncio.Task[aiocb.GenerationOutput] | None = None

        async def failing_block() -> None:
            nonlocal running
            async with manager:
                running = asyncio.create_task(manager.generate(PROMPTS[1], max_new_tokens=6))
                raise KeyError("the inner block's")

        with pytest.raises(KeyError):
            await failing_block()
        assert manager.is_running and running is not None

        async def other_task() -> list[int]:
            async with manager:
                return (await manager.generate(PROMPTS[2], max_new_tokens=4)).generated_tokens

        assert await other_task() == reference_generate(qwen3, PROMPTS[2], 4)
        assert (await running).generated_tokens == reference_generate(qwen3, PROMPTS[1], 6)
    assert not manager.is_running
    with pytest.raises(aiocb.ManagerClosedError):
        manager.start()
    assert "already running" not in caplog.text


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


def test_waiters_left_on_a_closed_loop_hold_no_place_on_the_next(qwen3: PreTrainedModel) -> None:
    """Callers that waited for room in the queue, or for their turn through the turnstile
    (more than 64 in one loop turn), when their loop was closed under them, keep no room and
    no turn from the callers of the next loop."""
    config = aiocb.ContinuousBatchingConfig(max_queue_size=1, max_requests_per_batch=1)
    manager = aiocb.Manager(qwen3, continuous_batching_config=config, persistent_manager=True)
    loop = asyncio.new_event_loop()
    crowd: list[asyncio.Task[aiocb.GenerationOutput]] = []

    async def gather_a_crowd() -> None:
        manager.start()
        crowd.extend(loop.create_task(manager.generate(PROMPTS[0], max_new_tokens=50)) for _ in range(100))
        await asyncio.sleep(0.05)  # (they wait for room in the queue)

    async def gather_more() -> None:  # (64 pass the turnstile; the loop closes before the next turn)
        crowd.extend(loop.create_task(manager.generate(PROMPTS[1], max_new_tokens=50)) for _ in range(100))

    loop.run_until_complete(gather_a_crowd())
    loop.run_until_complete(gather_more())
    assert not any(task.done() for task in crowd)
    loop.close()

    async def second() -> list[int]:
        async with aiocb.Manager(qwen3, persistent_manager=True) as again:
            assert again is manager
            output = await asyncio.wait_for(again.generate(PROMPTS[2], max_new_tokens=4), 30.0)
            stats = again.statistics()
        await again.destroy()
        assert stats.free_blocks == stats.total_blocks
        return output.generated_tokens

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the first loop's tasks, pending when it closed)
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


@pytest.mark.parametrize("held", ["one model", "two models of one config"])
async def test_managers_holding_one_config_keep_its_attention_until_the_last_stops(held: str) -> None:
    """The attention setting lives on the config, which two managers may hold at once: of
    one model, or of two (transformers keeps the config object a model is made with, so a
    model made from another's config shares it). The first to stop gave the config its
    original attention back under the other, which then computed its steps with plain
    attention over no cache (wrong tokens, no error)."""
    from tests.conftest import tiny_qwen3

    first = tiny_qwen3(seed=0, attn_implementation="eager")
    torch.manual_seed(1)
    models = (first, first) if held == "one model" else (first, type(first)(first.config).eval())
    assert models[1].config is first.config
    expected = [reference_generate(model, PROMPTS[0], 10) for model in models]
    for stopping_first in (0, 1):
        managers = [aiocb.Manager(model) for model in models]
        for manager in managers:
            manager.start()
            await manager.wait_started()
        await managers[stopping_first].stop()
        other = managers[1 - stopping_first]
        served = await other.generate(PROMPTS[0], max_new_tokens=10)
        assert served.generated_tokens == expected[1 - stopping_first]
        await other.stop()
        assert first.config._attn_implementation == "eager"
        for manager in managers:
            await manager.destroy()


@pytest.mark.parametrize("ending", ["stop", "destroy"])
async def test_a_batch_made_while_the_manager_stops_is_refused_naming_the_stop(
    qwen3: PreTrainedModel, monkeypatch: pytest.MonkeyPatch, ending: str
) -> None:
    """Controls over thousands of ids are merged off the loop; a stop or destroy that lands
    meanwhile refuses the batch as a stopped manager does (the session's layout is gone)."""
    from aiocb.engine.requests import RequestFactory

    merged = RequestFactory.merged
    merging = threading.Event()

    def slow(self: RequestFactory, *args: object, **kwargs: object) -> object:
        merging.set()
        threading.Event().wait(0.3)
        return merged(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(RequestFactory, "merged", slow)
    allowed = [token for token in range(1, 101) for _ in range(50)]  # (5,000 ids: merged on a worker thread)
    manager = aiocb.Manager(qwen3)
    async with manager:
        batch = asyncio.create_task(
            manager.generate_batch(random_prompts(3, 4, 6), max_new_tokens=2, allowed_token_ids=allowed)
        )
        await asyncio.to_thread(merging.wait, 10)
        await (manager.stop() if ending == "stop" else manager.destroy())
        with pytest.raises(aiocb.ManagerClosedError):
            await batch
