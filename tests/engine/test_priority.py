"""Priority scheduling: lower ``priority`` is admitted first and may preempt running work."""

from __future__ import annotations

import asyncio

from transformers import PreTrainedModel

import aiocb
from tests.conftest import random_prompts, reference_generate

LOW = random_prompts(10, 40, 60, seed=41)
URGENT = random_prompts(1, 30, 30, seed=42)[0]


async def _steps_to_first_token(
    model: PreTrainedModel, priority: int | None
) -> tuple[int, list[aiocb.GenerationOutput]]:
    """Fill a small cache with low-priority work (and a queue behind it), then add one request:
    how many steps pass before its first token, and every output."""
    config = aiocb.ContinuousBatchingConfig(page_size=16, num_blocks=24, max_batch_tokens=64)
    async with aiocb.Manager(model, continuous_batching_config=config) as manager:
        low = [asyncio.create_task(manager.generate(p, max_new_tokens=80, priority=5)) for p in LOW]
        stats = manager.statistics
        while stats().waiting_requests == 0 or stats().tokens_generated < 20:  # noqa: ASYNC110 (counters, not events)
            await asyncio.sleep(0.001)
        assert manager.statistics().free_blocks < 4  # the cache is full of low-priority work
        added_at = manager.statistics().steps
        rid = await manager.add_request(URGENT, max_new_tokens=8, priority=priority)
        first_at = None
        async for output in manager.stream(rid):
            if first_at is None and output.generated_tokens:
                first_at = manager.statistics().steps
            urgent = output
        outputs = [*(await asyncio.gather(*low)), urgent]
        stats = manager.statistics()
    assert stats.free_blocks == stats.total_blocks
    assert first_at is not None
    return first_at - added_at, outputs


async def test_high_priority_request_runs_within_a_few_steps(qwen3: PreTrainedModel) -> None:
    urgent_steps, outputs = await _steps_to_first_token(qwen3, priority=-1)
    queued_steps, _ = await _steps_to_first_token(qwen3, priority=None)  # priority 0: still ahead of 5
    fifo_steps, _ = await _steps_to_first_token(qwen3, priority=5)  # same priority: behind the queue
    assert urgent_steps <= 4, urgent_steps
    assert queued_steps <= 4, queued_steps
    assert fifo_steps > 4 * max(urgent_steps, 1), (fifo_steps, urgent_steps)
    # Preempted or not, every request still gives model.generate's tokens.
    for prompt, output in zip([*LOW, URGENT], outputs, strict=True):
        assert output.generated_tokens == reference_generate(qwen3, prompt, len(output.generated_tokens))
