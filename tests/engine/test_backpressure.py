"""Admission backpressure and per-request deadlines."""

from __future__ import annotations

import asyncio

import pytest
from transformers import PreTrainedModel

import aiocb
from tests.conftest import random_prompts, reference_generate

PROMPTS = random_prompts(6, 20, 40, seed=10)


async def test_add_request_waits_for_room_and_nowait_raises(qwen3: PreTrainedModel) -> None:
    # One request per step and a queue of two: the third add has to wait.
    config = aiocb.ContinuousBatchingConfig(max_queue_size=2, max_requests_per_batch=1)
    async with aiocb.Manager(qwen3, continuous_batching_config=config) as manager:
        # (long enough to run through the checks below on a fast machine)
        first = await manager.add_request(PROMPTS[0], max_new_tokens=400, ignore_eos=True)
        await asyncio.sleep(0.05)  # first is admitted and running
        await manager.add_request(PROMPTS[1], max_new_tokens=5)
        await manager.add_request(PROMPTS[2], max_new_tokens=5)
        assert manager.statistics().waiting_requests == 2
        with pytest.raises(aiocb.WouldBlock):
            manager.add_request_nowait(PROMPTS[3], max_new_tokens=5)
        with pytest.raises(aiocb.WouldBlock, match="admission queue is full"):
            await manager.add_request(PROMPTS[3], max_new_tokens=5, wait=False)
        assert manager.statistics().waiting_requests == 2  # (neither refusal queued anything)
        blocked = asyncio.create_task(manager.add_request(PROMPTS[3], max_new_tokens=5))
        await asyncio.sleep(0.01)
        assert not blocked.done()
        assert manager.statistics().waiting_requests == 2
        first_result = await manager.get_result(first)
        assert first_result is not None
        rid = await asyncio.wait_for(blocked, 5)
        result = await manager.get_result(rid)
        assert result is not None and result.status is aiocb.RequestStatus.FINISHED


async def test_room_goes_to_the_waiting_callers_by_priority(qwen3: PreTrainedModel) -> None:
    """The admission queue handed out room first come, first served: an urgent request
    waited behind every lower-priority caller blocked before it (finishing fifth of six)."""
    config = aiocb.ContinuousBatchingConfig(max_queue_size=1, max_requests_per_batch=1)
    finished: list[str] = []

    async def generate(name: str, prompt: list[int], priority: int) -> None:
        await manager.generate(prompt, max_new_tokens=6, ignore_eos=True, priority=priority)
        finished.append(name)

    async with aiocb.Manager(qwen3, continuous_batching_config=config) as manager:
        # (long enough to run until every caller below waits, however fast the machine)
        hog = await manager.add_request(PROMPTS[0], max_new_tokens=400, ignore_eos=True, priority=5)
        await asyncio.sleep(0.05)
        low = [asyncio.create_task(generate(f"low{i}", PROMPTS[1 + i], 5)) for i in range(4)]
        await asyncio.sleep(0.02)
        urgent = asyncio.create_task(generate("urgent", PROMPTS[5], -10))
        await asyncio.sleep(0.02)
        manager.cancel_request(hog)
        await asyncio.gather(urgent, *low)
        stats = manager.statistics()
        assert stats.free_blocks == stats.total_blocks
    # (low0 may have been queued before the urgent request came: only it may finish first)
    assert finished.index("urgent") <= 1, finished
    assert [name for name in finished if name != "urgent"] == ["low0", "low1", "low2", "low3"]


async def test_a_newcomer_goes_ahead_of_waiting_callers_only_by_a_better_priority(qwen3: PreTrainedModel) -> None:
    """Where the first waiting caller does not fit yet (its prompt too long for the room
    left), a newcomer that fits is refused behind it at the same priority, first come first
    served, and let through at a better one."""
    config = aiocb.ContinuousBatchingConfig(max_queued_tokens=50, max_requests_per_batch=1)
    long, short = list(range(1, 41)), list(range(1, 11))
    async with aiocb.Manager(qwen3, continuous_batching_config=config) as manager:
        hog = await manager.add_request(PROMPTS[0], max_new_tokens=400, ignore_eos=True)
        await asyncio.sleep(0.05)  # (running: the queue is empty)
        queued = manager.add_request_nowait(list(range(1, 31)), max_new_tokens=2, priority=5)  # 30 tokens wait
        waiter = asyncio.create_task(manager.add_request(long, max_new_tokens=2, priority=5))
        await asyncio.sleep(0.01)
        assert not waiter.done()  # (30 + 40 tokens would pass the bound)
        with pytest.raises(aiocb.WouldBlock):
            manager.add_request_nowait(short, max_new_tokens=2, priority=5)
        ahead = manager.add_request_nowait(short, max_new_tokens=2, priority=4)
        for rid in (hog, queued, ahead):
            manager.cancel_request(rid)
        manager.cancel_request(await asyncio.wait_for(waiter, 5))


async def test_queued_tokens_bound(qwen3: PreTrainedModel) -> None:
    config = aiocb.ContinuousBatchingConfig(max_queued_tokens=50, max_requests_per_batch=1)
    async with aiocb.Manager(qwen3, continuous_batching_config=config) as manager:
        await manager.add_request(PROMPTS[0], max_new_tokens=30)
        await asyncio.sleep(0.05)
        manager.add_request_nowait(PROMPTS[1], max_new_tokens=2)  # <= 40 tokens queued
        with pytest.raises(aiocb.WouldBlock, match="full"):
            manager.add_request_nowait(PROMPTS[2], max_new_tokens=2)


async def test_cancelled_adder_leaves_no_trace(qwen3: PreTrainedModel) -> None:
    config = aiocb.ContinuousBatchingConfig(max_queue_size=1, max_requests_per_batch=1)
    async with aiocb.Manager(qwen3, continuous_batching_config=config) as manager:
        await manager.add_request(PROMPTS[0], max_new_tokens=40)
        await asyncio.sleep(0.05)
        await manager.add_request(PROMPTS[1], max_new_tokens=2)
        adder = asyncio.create_task(manager.add_request(PROMPTS[2], max_new_tokens=2))
        await asyncio.sleep(0.01)
        adder.cancel()
        await asyncio.gather(adder, return_exceptions=True)
        # The queue works for the next caller.
        rid = await asyncio.wait_for(manager.add_request(PROMPTS[3], max_new_tokens=2), 5)
        assert (await manager.get_result(rid)) is not None


async def test_timeout_ends_a_running_request(qwen3: PreTrainedModel) -> None:
    async with aiocb.Manager(qwen3) as manager:
        output = await manager.generate(PROMPTS[0], max_new_tokens=1500, timeout=0.2)
        assert output.finish_reason is aiocb.FinishReason.TIMEOUT
        assert 0 < len(output.generated_tokens) < 1500
        stats = manager.statistics()
        assert stats.free_blocks == stats.total_blocks


async def test_timeout_counts_queue_time(qwen3: PreTrainedModel) -> None:
    config = aiocb.ContinuousBatchingConfig(max_requests_per_batch=1)
    async with aiocb.Manager(qwen3, continuous_batching_config=config) as manager:
        hog = await manager.add_request(PROMPTS[0], max_new_tokens=400)
        late = await manager.generate(PROMPTS[1], max_new_tokens=5, timeout=0.1)
        assert late.finish_reason is aiocb.FinishReason.TIMEOUT
        assert late.generated_tokens == [], "it timed out while still queued"
        manager.cancel_request(hog)


async def test_timeout_while_waiting_for_room(qwen3: PreTrainedModel) -> None:
    config = aiocb.ContinuousBatchingConfig(max_queue_size=1, max_requests_per_batch=1)
    async with aiocb.Manager(qwen3, continuous_batching_config=config) as manager:
        await manager.add_request(PROMPTS[0], max_new_tokens=400)
        await asyncio.sleep(0.05)
        await manager.add_request(PROMPTS[1], max_new_tokens=400)
        rid = await manager.add_request(PROMPTS[2], max_new_tokens=5, timeout=0.05)
        result = await manager.get_result(rid)
        assert result is not None and result.finish_reason is aiocb.FinishReason.TIMEOUT


async def test_room_freed_once_lets_through_only_what_fits(qwen3: PreTrainedModel) -> None:
    """A freed place goes to one waiter: the ones woken have not queued their requests yet
    when the next ones are looked at, and must count (the queue grew to 29 of 2)."""
    config = aiocb.ContinuousBatchingConfig(max_queue_size=2, max_requests_per_batch=1)
    prompts = random_prompts(30, 30, 30, seed=2)
    most = 0
    async with aiocb.Manager(qwen3, continuous_batching_config=config) as manager:

        async def add(prompt: list[int]) -> str:
            nonlocal most
            rid = await manager.add_request(prompt, max_new_tokens=3)
            most = max(most, manager.statistics().waiting_requests)
            return rid

        ids = await asyncio.gather(*(add(p) for p in prompts))
        results = [await manager.get_result(rid) for rid in ids]
    assert most <= 2
    assert all(r is not None and len(r.generated_tokens) == 3 for r in results)


async def test_a_waiter_cancelled_after_its_room_came_hands_it_on(
    qwen3: PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aiocb.engine.admission import AdmissionQueue

    config = aiocb.ContinuousBatchingConfig(max_queue_size=1, max_requests_per_batch=1)
    prompts = random_prompts(4, 20, 20, seed=3)
    doomed: list[asyncio.Task[str]] = []
    release = AdmissionQueue.release

    def release_then_cancel(self: AdmissionQueue) -> None:
        release(self)
        if self._granted:  # (its room came: cancelled before it could use it)
            for task in doomed:
                task.cancel()

    monkeypatch.setattr(AdmissionQueue, "release", release_then_cancel)
    async with aiocb.Manager(qwen3, continuous_batching_config=config) as manager:
        running = await manager.add_request(prompts[0], max_new_tokens=500, eos_token_id=[])
        await asyncio.sleep(0.05)  # admitted: the queue is empty again
        await manager.add_request(prompts[1], max_new_tokens=3)  # the queue's one place
        doomed.append(asyncio.create_task(manager.add_request(prompts[2], max_new_tokens=3)))
        await asyncio.sleep(0.01)
        after = asyncio.create_task(manager.add_request(prompts[3], max_new_tokens=3))
        await asyncio.sleep(0.01)
        assert not doomed[0].done() and not after.done()
        manager.cancel_request(running)  # (the queued one is admitted: its place frees)
        rid = await asyncio.wait_for(after, 10)
        assert (await manager.get_result(rid)) is not None
        assert doomed[0].cancelled()


async def test_requests_that_end_before_their_deadline_are_let_go(qwen3: PreTrainedModel) -> None:
    """A finished request is not kept alive until its (long) timeout would have passed."""
    prompts = random_prompts(300, 5, 10, seed=4)
    async with aiocb.Manager(qwen3) as manager:
        await manager.generate_batch(prompts, max_new_tokens=2, timeout=3600.0)
        await manager.generate(prompts[0], max_new_tokens=2)  # (a step after they all ended)
        steps = manager._steps
        assert steps is not None
        assert len(steps._deadlines) <= 64


@pytest.mark.parametrize("started", [False, True], ids=["before-the-start", "running"])
async def test_a_cancelled_request_makes_room_for_the_next(qwen3: PreTrainedModel, started: bool) -> None:
    """``cancel_request`` takes a request out of the queue: a caller waiting for room gets
    it at once (the engine may be idle, or not started: no step comes to hand it on)."""
    config = aiocb.ContinuousBatchingConfig(max_queue_size=1, max_requests_per_batch=1)
    manager = aiocb.Manager(qwen3, continuous_batching_config=config)
    if started:
        manager.start()
        await manager.add_request(PROMPTS[0], max_new_tokens=200, eos_token_id=[])  # (holds the one row)
        await asyncio.sleep(0.05)
    queued = await manager.add_request(PROMPTS[1], max_new_tokens=5)
    waiting = asyncio.create_task(manager.add_request(PROMPTS[2], max_new_tokens=5))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    assert manager.cancel_request(queued)
    admitted = await asyncio.wait_for(waiting, 5)
    if not started:
        manager.start()
    output = await asyncio.wait_for(manager.get_result(admitted), 30)
    assert output is not None and output.generated_tokens == reference_generate(qwen3, PROMPTS[2], 5)
    await manager.stop(hard_stop=True)


async def test_a_request_made_while_the_manager_is_destroyed_is_refused(qwen3: PreTrainedModel) -> None:
    """A ``generate`` whose request is still being made (its samples forked a slice of the
    loop at a time) when ``destroy()`` comes raises ManagerClosedError."""
    manager = aiocb.Manager(qwen3)
    manager.start()
    making = asyncio.create_task(manager.generate(PROMPTS[3], max_new_tokens=4, n=600, do_sample=True))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    await manager.destroy()
    with pytest.raises(aiocb.ManagerClosedError):
        await asyncio.wait_for(making, 10)


async def test_room_given_to_a_caller_that_then_fails_to_queue_goes_to_the_next(qwen3: PreTrainedModel) -> None:
    """Two callers waiting for room with one request id: the second is refused when its turn
    comes (the id is taken, its request finished but unread), and the room it was given goes
    on to the caller after it, with no step left to hand it on (the engine idle)."""
    prompts = random_prompts(4, 4, 4, seed=4)
    config = aiocb.ContinuousBatchingConfig(page_size=16, num_blocks=64, max_queue_size=1)
    async with aiocb.Manager(qwen3, continuous_batching_config=config) as manager:
        await manager.add_request(prompts[0], max_new_tokens=1)  # (the queue is full)
        first = asyncio.create_task(manager.add_request(prompts[1], request_id="x", max_new_tokens=1))
        same = asyncio.create_task(manager.add_request(prompts[2], request_id="x", max_new_tokens=1))
        other = asyncio.create_task(manager.add_request(prompts[3], max_new_tokens=1))
        assert await asyncio.wait_for(first, 10) == "x"
        with pytest.raises(aiocb.InvalidRequestError, match="already in use"):
            await asyncio.wait_for(same, 10)
        rid = await asyncio.wait_for(other, 10)
        output = await asyncio.wait_for(manager.get_result(rid), 10)
        assert output is not None and output.generated_tokens == reference_generate(qwen3, prompts[3], 1)
