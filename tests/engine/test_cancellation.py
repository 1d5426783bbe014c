"""Cancellation the asyncio way: cancelled tasks, closed streams and cancel_request."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import pytest
from transformers import PreTrainedModel

import aiocb
from aiocb.engine.requests import sample_ids
from tests.conftest import random_prompts, reference_generate

PROMPTS = random_prompts(4, 30, 80, seed=9)


async def _until_steps(manager: aiocb.Manager, steps: int) -> None:
    while manager.statistics().steps < steps:  # noqa: ASYNC110 (steps are counters, not events)
        await asyncio.sleep(0.001)


async def test_cancelling_a_generate_task_cancels_the_request(qwen3: PreTrainedModel) -> None:
    async with aiocb.Manager(qwen3) as manager:
        other = asyncio.create_task(manager.generate(PROMPTS[1], max_new_tokens=60))
        victim = asyncio.create_task(manager.generate(PROMPTS[0], max_new_tokens=1000))
        await _until_steps(manager, 3)
        assert manager.statistics().running_requests == 2
        victim.cancel()
        await asyncio.gather(victim, return_exceptions=True)
        assert victim.cancelled()
        stats = manager.statistics()
        assert stats.running_requests == 1, "the cancelled request left the batch at once"
        result = await other
        assert result.generated_tokens == reference_generate(qwen3, PROMPTS[1], 60)
        stats = manager.statistics()
        assert stats.free_blocks == stats.total_blocks


async def test_breaking_out_of_a_stream_cancels_the_request(qwen3: PreTrainedModel) -> None:
    async with aiocb.Manager(qwen3) as manager:
        keeps_running = await manager.add_request(PROMPTS[1], max_new_tokens=1000)
        rid = await manager.add_request(PROMPTS[0], max_new_tokens=1000)
        async for chunk in manager.stream(rid):
            if len(chunk.generated_tokens) >= 3:
                break
        steps = manager.statistics().steps
        await _until_steps(manager, steps + 1)
        stats = manager.statistics()
        assert stats.running_requests == 1 and stats.waiting_requests == 0
        manager.cancel_request(keeps_running)
        stats = manager.statistics()
        assert stats.free_blocks == stats.total_blocks


async def test_cancelling_a_task_iterating_a_stream_cancels_the_request(qwen3: PreTrainedModel) -> None:
    async with aiocb.Manager(qwen3) as manager:
        rid = await manager.add_request(PROMPTS[2], max_new_tokens=1000)

        async def consume() -> None:  # holds the stream while it is cancelled
            async for _ in manager.stream(rid):
                pass

        task = asyncio.create_task(consume())
        await _until_steps(manager, 3)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        stats = manager.statistics()
        assert stats.running_requests == 0 and stats.free_blocks == stats.total_blocks


async def test_a_request_cancelled_before_its_first_token_never_runs(qwen3: PreTrainedModel) -> None:
    async with aiocb.Manager(qwen3) as manager:
        rid = await manager.add_request(PROMPTS[3], max_new_tokens=5)
        assert manager.cancel_request(rid)
        result = await manager.get_result(rid)
        assert result is not None
        assert result.status is aiocb.RequestStatus.CANCELLED
        assert result.finish_reason is aiocb.FinishReason.CANCELLED
        assert result.generated_tokens == []
        await asyncio.sleep(0.05)
        assert manager.statistics().tokens_computed == 0
        assert not manager.cancel_request(rid)
        assert not manager.cancel_request("unknown")


async def test_cancel_request_ends_a_stream_with_a_cancelled_output(qwen3: PreTrainedModel) -> None:
    async with aiocb.Manager(qwen3) as manager:
        rid = await manager.add_request(PROMPTS[0], max_new_tokens=1000)
        chunks = []
        async for chunk in manager.stream(rid):
            chunks.append(chunk)
            if len(chunks) == 2:
                manager.cancel_request(rid)
        assert chunks[-1].status is aiocb.RequestStatus.CANCELLED
        assert len(chunks[-1].generated_tokens) >= 2
        stats = manager.statistics()
        assert stats.free_blocks == stats.total_blocks


async def test_cancelling_generate_batch_cancels_all_its_requests(qwen3: PreTrainedModel) -> None:
    async with aiocb.Manager(qwen3) as manager:
        task = asyncio.create_task(manager.generate_batch(PROMPTS, max_new_tokens=1000))
        await _until_steps(manager, 3)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        stats = manager.statistics()
        assert stats.running_requests == stats.waiting_requests == 0
        assert stats.free_blocks == stats.total_blocks


async def test_generate_batch_cancelled_while_it_looks_its_requests_up_cancels_them_all(
    qwen3: PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """generate_batch looks its requests up a slice of the loop at a time once they are
    queued: cancelled then, it cancels them all, those not looked up yet too (a slice at
    a time as well: the loop is given back at every one here)."""
    from aiocb.engine.router import OutputRouter

    monkeypatch.setattr("aiocb.engine.turns.SLICE", 0.0)  # give the loop back at every lookup
    lookups = 0
    get = OutputRouter.get

    def counted(self: OutputRouter, request_id: str) -> Any:
        nonlocal lookups
        if sys._getframe(1).f_code.co_name in ("generate_batch", "_cancel_own_request"):
            lookups += 1
            if lookups == 3:
                task.cancel()
        return get(self, request_id)

    prompts = random_prompts(20, 5, 20, seed=10)
    async with aiocb.Manager(qwen3) as manager:
        monkeypatch.setattr(OutputRouter, "get", counted)
        task = asyncio.create_task(manager.generate_batch(prompts, max_new_tokens=1000))
        with pytest.raises(asyncio.CancelledError):
            await task
        stats = manager.statistics()
        assert lookups == 3 + len(prompts)  # (cancelled at the third: the clean-up looks them all up)
        assert stats.running_requests == stats.waiting_requests == 0
        assert stats.free_blocks == stats.total_blocks


async def test_a_batch_cancelled_again_while_it_cleans_up_still_cancels_every_request(
    qwen3: PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The clean-up of a cancelled generate_batch gives the loop back between requests (one
    pass over 20,000 held it 79 ms); cancelled again meanwhile, it cancels the rest at once."""
    from aiocb.engine.manager import Manager

    monkeypatch.setattr("aiocb.engine.turns.SLICE", 0.0)  # give the loop back at every request
    cancelled = 0
    cancel_own = Manager._cancel_own_request

    def counted(self: Manager, request: Any) -> None:
        nonlocal cancelled
        cancelled += 1
        if cancelled == 2:
            task.cancel()  # (again, mid-way through the clean-up)
        cancel_own(self, request)

    prompts = random_prompts(20, 5, 20, seed=11)
    async with aiocb.Manager(qwen3) as manager:
        monkeypatch.setattr(Manager, "_cancel_own_request", counted)
        task = asyncio.create_task(manager.generate_batch(prompts, max_new_tokens=1000))
        await _until_steps(manager, 3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        stats = manager.statistics()
        assert cancelled == len(prompts)
        assert stats.running_requests == stats.waiting_requests == 0
        assert stats.free_blocks == stats.total_blocks


async def test_samples_cancelled_while_their_fork_pauses_leave_the_engine_running(qwen3: PreTrainedModel) -> None:
    """Forking hundreds of samples pauses between slices; cancelling them all then empties
    the plan being made (a 17-token prompt on 16-token pages: the fork copies no block).
    The next plan is of what is left, and the manager goes on."""
    config = aiocb.ContinuousBatchingConfig(page_size=16, num_blocks=64)
    prompt = list(range(1, 18))
    async with aiocb.Manager(qwen3, continuous_batching_config=config) as manager:
        task = asyncio.create_task(manager.generate(prompt, 4, n=300, temperature=1.0, seed=1))
        for _ in range(100_000):
            await asyncio.sleep(0)
            steps = manager._steps  # (the scheduler's state, only to time the cancellation)
            if steps is not None and steps.scheduler._forks and len(steps.scheduler.running) > 1:
                break
        else:
            raise AssertionError("the fork never paused")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        output = await asyncio.wait_for(manager.generate([5, 6, 7], 3), 30)
        assert output.generated_tokens == reference_generate(qwen3, [5, 6, 7], 3)
        assert not manager.is_dead
        stats = manager.statistics()
        assert stats.free_blocks == stats.total_blocks


@pytest.mark.parametrize("when", ["queued", "running"])
async def test_cancel_request_of_a_request_with_samples_ends_every_sample(qwen3: PreTrainedModel, when: str) -> None:
    """A request's id stands for its ``n`` samples: cancelling it ended its first sample
    alone, and the others ran on to their length, their blocks held, their results unread."""
    async with aiocb.Manager(qwen3) as manager:
        free = manager.statistics().free_blocks
        rid = await manager.add_request(PROMPTS[0], max_new_tokens=200, n=4, temperature=1.0, seed=1)
        if when == "running":
            async for chunk in manager.stream(f"{rid}__child#2"):
                if len(chunk.generated_tokens) >= 5:
                    break  # (that sample cancelled alone)
            assert manager.cancel_request(rid)
        else:
            assert manager.cancel_request(rid)
        ids = [rid, f"{rid}__child#0", f"{rid}__child#1"]
        results = [await manager.get_result(i, timeout=30) for i in ids]
        assert all(r is not None and r.status is aiocb.RequestStatus.CANCELLED for r in results), results
        assert all(len(r.generated_tokens) < 200 for r in results if r is not None)
        assert manager.statistics().free_blocks == free
        # With its first sample ended and its output taken already, its id still ends the
        # others (seeded: the first stops at its 5th token, the others at their 61st and 58th).
        stops = list(range(0, 512, 25))
        rid = await manager.add_request(
            PROMPTS[2], max_new_tokens=200, n=3, temperature=1.0, seed=82, stop_token_ids=stops
        )
        first = await manager.get_result(rid, timeout=30)
        assert first is not None and first.finish_reason is aiocb.FinishReason.STOP
        assert manager.cancel_request(rid)
        assert manager.cancel_request(rid) is False  # (nothing left)
        results = [await manager.get_result(f"{rid}__child#{i}", timeout=30) for i in (0, 1)]
        assert all(r is not None and r.status is aiocb.RequestStatus.CANCELLED for r in results), results
        # A sample's own id ends that sample alone.
        other = await manager.add_request(PROMPTS[1], max_new_tokens=12, n=2)
        assert manager.cancel_request(f"{other}__child#0")
        kept = await manager.get_result(other, timeout=30)
        assert kept is not None and kept.finish_reason is aiocb.FinishReason.LENGTH


async def test_cancel_request_ends_many_samples_a_slice_of_the_loop_at_a_time(qwen3: PreTrainedModel) -> None:
    """The first 64 samples end as it returns, the others in the loop turns that follow (a
    request of 4,096 samples ended in one pass held the loop 34 ms); all of them end, their
    blocks free, and nothing is kept of the request once its outputs are read."""
    from aiocb.engine.router import SAMPLES_AT_ONCE

    async with aiocb.Manager(qwen3) as manager:
        free = manager.statistics().free_blocks
        n = 3 * SAMPLES_AT_ONCE
        rid = await manager.add_request(PROMPTS[0], max_new_tokens=500, n=n, temperature=1.0, seed=3, ignore_eos=True)
        ids = sample_ids(rid, n)
        await asyncio.sleep(0.05)
        assert manager.cancel_request(rid)
        handles = [manager._router.get(i) for i in ids]
        assert sum(h is not None and h.request.is_finished for h in handles) == 1 + SAMPLES_AT_ONCE
        results = [await manager.get_result(i, timeout=30) for i in ids]
        assert all(r is not None and r.status is aiocb.RequestStatus.CANCELLED for r in results)
        assert manager.statistics().free_blocks == free
        assert not manager._router._families, "the request's samples are let go of"


async def test_cancel_request_finds_the_samples_of_a_request_that_reused_an_id(qwen3: PreTrainedModel) -> None:
    """A request taking the id of one whose samples still run: once its own output is taken,
    its id ends its own samples (the earlier ones ending did not make it forget them)."""
    long = {"max_new_tokens": 500, "temperature": 1.0, "seed": 2, "ignore_eos": True}
    async with aiocb.Manager(qwen3) as manager:
        await manager.add_request(PROMPTS[0], request_id="A", n=3, **long)
        await manager.stream("A").aclose()  # (the first sample alone: its output is gone)
        assert manager.cancel_request("A__child#0")
        await manager.get_result("A__child#0", timeout=30)
        await manager.add_request(PROMPTS[1], request_id="A", n=2, **long)  # (A__child#1 still runs)
        assert manager.cancel_request("A__child#1")
        await manager.get_result("A__child#1", timeout=30)  # (the earlier request's last sample let go of)
        await manager.stream("A").aclose()
        assert manager.cancel_request("A"), "the later request's sample, A__child#0, still ran"
        ended = await manager.get_result("A__child#0", timeout=30)
        assert ended is not None and ended.finish_reason is aiocb.FinishReason.CANCELLED
        stats = manager.statistics()
        assert stats.free_blocks == stats.total_blocks
        assert not manager._router._families


async def test_cancel_request_ends_only_samples_of_that_request(qwen3: PreTrainedModel) -> None:
    """An id whose request is gone (its output read) or never was ends no request whose id
    merely begins with it and ``__child#`` (a caller may name one so)."""
    async with aiocb.Manager(qwen3) as manager:
        done = await manager.generate(PROMPTS[0], max_new_tokens=3, request_id="job")
        assert done.finish_reason is aiocb.FinishReason.LENGTH
        other = await manager.add_request(PROMPTS[1], max_new_tokens=40, request_id="job__child#x")
        stranger = await manager.add_request(PROMPTS[2], max_new_tokens=40, request_id="nosuch__child#0")
        assert manager.cancel_request("job") is False and manager.cancel_request("nosuch") is False
        for rid in (other, stranger):
            result = await manager.get_result(rid, timeout=30)
            assert result is not None and result.finish_reason is aiocb.FinishReason.LENGTH


async def test_a_stream_closed_by_another_task_wakes_the_task_reading_it(qwen3: PreTrainedModel) -> None:
    """A client-disconnect handler closing the stream a reader waits on, a second reader of
    one stream cancelled, a stream that took the request a get_result waits on closed: each
    waiting task wakes (with the cancelled output, or an error naming the stream) rather
    than waiting for ever; no block stays taken."""
    prompt = random_prompts(1, 6, 6, seed=9)[0]
    async with aiocb.Manager(qwen3) as manager:
        rid = await manager.add_request(prompt, max_new_tokens=10_000 // 10, ignore_eos=True)
        stream = manager.stream(rid)

        async def read() -> list[aiocb.GenerationOutput]:
            return [output async for output in stream]

        reader = asyncio.create_task(read())
        await asyncio.sleep(0.05)
        await stream.aclose()
        outputs = await asyncio.wait_for(reader, 5)
        assert not outputs or outputs[-1].finish_reason is aiocb.FinishReason.CANCELLED

        rid = await manager.add_request(prompt, max_new_tokens=1000, ignore_eos=True)
        waiting = asyncio.create_task(manager.get_result(rid))
        await asyncio.sleep(0.05)
        claimed = manager.stream(rid)
        await claimed.aclose()
        with pytest.raises(aiocb.InvalidRequestError, match="consumed by a stream"):
            await asyncio.wait_for(waiting, 5)
        await asyncio.sleep(0.05)
        stats = manager.statistics()
        assert stats.free_blocks == stats.total_blocks
