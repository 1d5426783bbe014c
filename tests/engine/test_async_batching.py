"""Async batching: step N+1 is planned before step N's tokens reach the host.

On CPU the same pipeline runs (the worker launches N+1 before collecting N), so the
bookkeeping of tokens still in flight is tested exactly: stop tokens, max lengths,
cancellation, logprobs and seeded sampling must come out as without it.
"""

from __future__ import annotations

import asyncio

from transformers import PreTrainedModel

import aiocb
from tests.conftest import random_prompts, reference_generate

PROMPTS = random_prompts(6, 5, 60, seed=15)
ASYNC = aiocb.ContinuousBatchingConfig(use_async_batching=True)


async def _run(
    model: PreTrainedModel, config: aiocb.ContinuousBatchingConfig, **params: object
) -> list[aiocb.GenerationOutput]:
    async with aiocb.Manager(model, continuous_batching_config=config) as manager:
        outputs = await manager.generate_batch(PROMPTS, **params)
        if config.use_async_batching:
            assert manager._steps is not None
            assert manager._steps.scheduler.stats.num_carried_tokens > 0, "steps really overlapped"
        stats = manager.statistics()
        assert stats.free_blocks == stats.total_blocks
    return list(outputs.values())


async def test_stop_tokens_and_lengths_are_exact_with_a_step_in_flight(qwen3: PreTrainedModel) -> None:
    references = [reference_generate(qwen3, p, 16) for p in PROMPTS]
    stop = references[0][4]  # ends request 0 early; others maybe too
    outputs = await _run(qwen3, ASYNC, max_new_tokens=16, stop_token_ids=[stop])
    for output, reference in zip(outputs, references, strict=True):
        expected = reference[: reference.index(stop) + 1] if stop in reference else reference
        assert output.generated_tokens == expected
        assert output.finish_reason is (aiocb.FinishReason.STOP if stop in reference else aiocb.FinishReason.LENGTH)


async def test_per_request_max_new_tokens_is_exact(qwen3: PreTrainedModel) -> None:
    async with aiocb.Manager(qwen3, continuous_batching_config=ASYNC) as manager:
        outputs = await asyncio.gather(*(manager.generate(p, max_new_tokens=1 + i) for i, p in enumerate(PROMPTS)))
    for i, (prompt, output) in enumerate(zip(PROMPTS, outputs, strict=True)):
        assert output.generated_tokens == reference_generate(qwen3, prompt, 1 + i)


async def test_sampling_and_logprobs_match_the_synchronous_pipeline(qwen3: PreTrainedModel) -> None:
    params = {"max_new_tokens": 12, "temperature": 0.9, "top_p": 0.95, "seed": 3, "return_logprobs": True}
    sync = await _run(qwen3, aiocb.ContinuousBatchingConfig(), **params)
    pipelined = await _run(qwen3, ASYNC, **params)
    for a, b in zip(sync, pipelined, strict=True):
        assert a.generated_tokens == b.generated_tokens
        assert a.logprobs is not None and b.logprobs is not None
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4


async def test_cancellation_with_a_step_in_flight_delivers_nothing_more(qwen3: PreTrainedModel) -> None:
    async with aiocb.Manager(qwen3, continuous_batching_config=ASYNC) as manager:
        keeper = asyncio.create_task(manager.generate(PROMPTS[1], max_new_tokens=40))
        rid = await manager.add_request(PROMPTS[0], max_new_tokens=1000)
        chunks = []
        async for chunk in manager.stream(rid):
            chunks.append(chunk)
            if len(chunk.generated_tokens) >= 5:
                manager.cancel_request(rid)
        final = chunks[-1]
        assert final.status is aiocb.RequestStatus.CANCELLED
        # Nothing sampled after the cancellation reached the output.
        assert len(final.generated_tokens) == len(chunks[-2].generated_tokens)
        reference = reference_generate(qwen3, PROMPTS[0], len(final.generated_tokens))
        assert final.generated_tokens == reference
        assert (await keeper).generated_tokens == reference_generate(qwen3, PROMPTS[1], 40)
        stats = manager.statistics()
        assert stats.free_blocks == stats.total_blocks and stats.running_requests == 0
