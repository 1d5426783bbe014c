"""Admission backpressure and per-request deadlines."""

from __future__ import annotations

import asyncio

import pytest
from transformers import PreTrainedModel

import aiocb
from tests.conftest import random_prompts

PROMPTS = random_prompts(6, 20, 40, seed=10)


async def test_add_request_waits_for_room_and_nowait_raises(qwen3: PreTrainedModel) -> None:
    # One request per step and a queue of two: the third add has to wait.
    config = aiocb.ContinuousBatchingConfig(max_queue_size=2, max_requests_per_batch=1)
    async with aiocb.Manager(qwen3, continuous_batching_config=config) as manager:
        first = await manager.add_request(PROMPTS[0], max_new_tokens=50)
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
