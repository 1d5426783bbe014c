"""add_requests, get_result, iteration, streams and the streaming flag."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

import pytest
from transformers import PreTrainedModel

import aiocb
from tests.conftest import random_prompts, reference_generate, tiny_qwen3

PROMPTS = random_prompts(8, 5, 50, seed=8)


async def test_add_requests_returns_ids_in_input_order(qwen3: PreTrainedModel) -> None:
    shared = PROMPTS[0]
    inputs = [[*shared, 3], PROMPTS[1], [*shared, 1], PROMPTS[2], [*shared, 2]]
    async with aiocb.Manager(qwen3) as manager:
        ids = await manager.add_requests(inputs, max_new_tokens=4)
        assert ids == [f"req_{i}" for i in range(5)]
        results = {}
        for _ in inputs:
            result = await manager.get_result()
            assert result is not None
            results[result.request_id] = result
    for rid, prompt in zip(ids, inputs, strict=True):
        assert results[rid].prompt_ids == prompt
        assert results[rid].generated_tokens == reference_generate(qwen3, prompt, 4)


async def test_get_result_for_an_id_and_with_timeout(qwen3: PreTrainedModel) -> None:
    async with aiocb.Manager(qwen3) as manager:
        assert await manager.get_result(timeout=0.01) is None
        slow = await manager.add_request(PROMPTS[0], max_new_tokens=30)
        fast = await manager.add_request(PROMPTS[1], max_new_tokens=2)
        assert await manager.get_result(slow, timeout=0.001) is None
        first = await manager.get_result(fast)
        assert first is not None and first.request_id == fast and first.is_finished()
        second = await manager.get_result()
        assert second is not None and second.request_id == slow
        with pytest.raises(aiocb.InvalidRequestError, match="no pending request"):
            await manager.get_result("nope")


@pytest.mark.parametrize("impatient_first", [True, False])
async def test_a_waiter_that_gives_up_leaves_another_waiting(qwen3: PreTrainedModel, impatient_first: bool) -> None:
    # Two tasks await the same request; the one that times out (is cancelled) must not
    # take the other's wake-up with it, whichever of them started waiting first.
    async with aiocb.Manager(qwen3) as manager:
        rid = await manager.add_request(PROMPTS[0], max_new_tokens=12)
        impatient = asyncio.create_task(manager.get_result(rid, timeout=0.001))
        if impatient_first:
            await asyncio.sleep(0)
        patient = asyncio.create_task(manager.get_result(rid))
        assert await impatient is None
        output = await asyncio.wait_for(patient, 30)
    assert output is not None and output.is_finished()
    assert output.generated_tokens == reference_generate(qwen3, PROMPTS[0], 12)


async def test_two_callers_awaiting_one_request_neither_hangs(qwen3: PreTrainedModel) -> None:
    # The final output goes to one of them; the other is told so instead of waiting forever.
    async with aiocb.Manager(qwen3) as manager:
        rid = await manager.add_request(PROMPTS[1], max_new_tokens=6)
        both = asyncio.gather(manager.get_result(rid), manager.get_result(rid), return_exceptions=True)
        first, second = await asyncio.wait_for(both, 30)
    outputs = [r for r in (first, second) if isinstance(r, aiocb.GenerationOutput)]
    errors = [r for r in (first, second) if isinstance(r, BaseException)]
    assert len(outputs) == 1 and outputs[0].generated_tokens == reference_generate(qwen3, PROMPTS[1], 6)
    assert len(errors) == 1 and isinstance(errors[0], aiocb.InvalidRequestError)
    assert "went to another caller" in str(errors[0])


async def test_no_caller_takes_another_consumers_final_output(qwen3: PreTrainedModel) -> None:
    """Whoever owns a request's outputs gets them: ``get_result(id)`` of a request that a
    ``generate`` call (or ``generate_batch``) awaits, or that a stream claimed while it
    waited, is refused; two tasks iterating one stream both end."""
    async with aiocb.Manager(qwen3) as manager:
        owner = asyncio.create_task(manager.generate(PROMPTS[2], max_new_tokens=6, n=2, request_id="x"))
        for _ in range(1_000):  # (until both samples are registered: making them may take turns)
            await asyncio.sleep(0)
            with pytest.raises(aiocb.InvalidRequestError) as refused:
                await manager.get_result("x__child#0")
            if "no pending request" not in str(refused.value):
                break
        for sample in ("x", "x__child#0"):
            with pytest.raises(aiocb.InvalidRequestError, match="awaited by the generate"):
                await manager.get_result(sample)
        outputs = await asyncio.wait_for(owner, 30)
        assert isinstance(outputs, list) and outputs[0].generated_tokens == reference_generate(qwen3, PROMPTS[2], 6)

        rid = await manager.add_request(PROMPTS[3], max_new_tokens=6)
        waiting = asyncio.create_task(manager.get_result(rid))
        await asyncio.sleep(0)
        stream = manager.stream(rid)
        streamed = [chunk async for chunk in stream]
        assert streamed[-1].generated_tokens == reference_generate(qwen3, PROMPTS[3], 6)
        with pytest.raises(aiocb.InvalidRequestError, match="consumed by a stream"):
            await asyncio.wait_for(waiting, 5)

        stream = manager.stream(await manager.add_request(PROMPTS[4], max_new_tokens=6))

        async def read() -> list[aiocb.GenerationOutput]:
            return [chunk async for chunk in stream]

        first, second = await asyncio.wait_for(asyncio.gather(read(), read()), 30)
        chunks = sorted(first + second, key=lambda chunk: len(chunk.generated_tokens))
        assert chunks[-1].generated_tokens == reference_generate(qwen3, PROMPTS[4], 6)
        assert sum(chunk.is_finished() for chunk in chunks) == 1


async def test_cleanup_touches_only_the_callers_own_requests(qwen3: PreTrainedModel) -> None:
    """A ``generate`` cancelled after its request's id was taken by another caller (the
    request itself ended and was read, a sample of it still runs) cancels its sample, not
    the other caller's request."""
    async with aiocb.Manager(qwen3) as manager:
        owner = asyncio.create_task(manager.generate(PROMPTS[5], n=2, request_id="x", max_new_tokens=400))
        await until(lambda: "x" in manager._router)
        assert manager._router.cancel("x")  # (that sample alone: cancel_request("x") ends both)
        await until(lambda: "x" not in manager._router)  # (the generate call read its cancelled output)
        reused = await manager.add_request(PROMPTS[0], request_id="x", max_new_tokens=6)
        owner.cancel()
        with pytest.raises(asyncio.CancelledError):
            await owner
        output = await asyncio.wait_for(manager.get_result(reused), 30)
        assert output is not None and output.generated_tokens == reference_generate(qwen3, PROMPTS[0], 6)
        assert "x__child#0" not in manager._router


async def test_async_for_yields_results_until_the_manager_stops(qwen3: PreTrainedModel) -> None:
    manager = aiocb.Manager(qwen3)
    manager.start()
    ids = await manager.add_requests(PROMPTS, max_new_tokens=3)
    seen: list[str] = []

    async def consume() -> None:
        async for result in manager:
            assert result.is_finished()
            seen.append(result.request_id)

    consumer = asyncio.create_task(consume())
    await manager.stop()
    await asyncio.wait_for(consumer, 5)
    assert sorted(seen) == sorted(ids)
    await manager.destroy()


async def test_streaming_flag_sends_partial_outputs_to_get_result(qwen3: PreTrainedModel) -> None:
    async with aiocb.Manager(qwen3) as manager:
        rid = await manager.add_request(PROMPTS[3], max_new_tokens=6, streaming=True)
        outputs = []
        while True:
            output = await manager.get_result(rid)
            assert output is not None
            outputs.append(output)
            if output.is_finished():
                break
        assert len(outputs) > 1
        assert outputs[-1].status is aiocb.RequestStatus.FINISHED
        assert outputs[-1].generated_tokens == reference_generate(qwen3, PROMPTS[3], 6)
        # Without the flag only the final output is delivered.
        plain = await manager.add_request(PROMPTS[3], max_new_tokens=6)
        only = await manager.get_result(plain)
        assert only is not None and only.is_finished()


async def test_a_slow_stream_consumer_gets_merged_updates(qwen3: PreTrainedModel) -> None:
    async with aiocb.Manager(qwen3) as manager:
        rid = await manager.add_request(PROMPTS[4], max_new_tokens=40)
        chunks = []
        async for chunk in manager.stream(rid):
            chunks.append(chunk)
            await asyncio.sleep(0.02)  # slower than the steps: updates pile up and merge
        assert chunks[-1].generated_tokens == reference_generate(qwen3, PROMPTS[4], 40)
        assert len(chunks) < 40
        assert any(len(b.generated_tokens) - len(a.generated_tokens) > 1 for a, b in itertools.pairwise(chunks))


async def test_stream_of_a_finished_request_yields_its_final_output(qwen3: PreTrainedModel) -> None:
    async with aiocb.Manager(qwen3) as manager:
        rid = await manager.add_request(PROMPTS[5], max_new_tokens=2)
        await asyncio.sleep(0.2)
        chunks = [c async for c in manager.stream(rid)]
        assert len(chunks) == 1 and chunks[0].is_finished()
        with pytest.raises(aiocb.InvalidRequestError):
            manager.stream(rid)  # delivered and forgotten


async def test_one_stream_per_request(qwen3: PreTrainedModel) -> None:
    async with aiocb.Manager(qwen3) as manager:
        rid = await manager.add_request(PROMPTS[6], max_new_tokens=5)
        stream = manager.stream(rid)
        with pytest.raises(aiocb.InvalidRequestError, match="consumer"):
            manager.stream(rid)
        async with stream:
            assert [c async for c in stream][-1].is_finished()


async def test_a_hybrid_models_cache_use_and_capacity_are_its_full_layers() -> None:
    """The sliding layers' pool counted as room: usage read 0.47 with the full layers' pool
    nearly full (preemptions came at "65%"), and the capacity was twice what fits."""
    model = tiny_qwen3(
        0,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=16,
        use_sliding_window=True,
        max_window_layers=0,
    )
    config = aiocb.ContinuousBatchingConfig(num_blocks=16, page_size=16, max_batch_tokens=256)
    async with aiocb.Manager(model, continuous_batching_config=config) as manager:
        assert manager.statistics().capacity_tokens == 16 * 16
        rid = await manager.add_request(list(range(1, 201)), max_new_tokens=8, ignore_eos=True)
        seen = [manager.statistics() async for _ in manager.stream(rid)]
    stats = seen[0]  # (as the first token came)
    # The full layers hold 13 blocks of 16 for 201 tokens; the sliding ones a ring of 2 or 3.
    assert stats.cache_usage == 13 / 16, stats
    assert stats.total_blocks == 32


async def test_statistics_snapshot(qwen3: PreTrainedModel) -> None:
    async with aiocb.Manager(qwen3) as manager:
        before = manager.statistics()
        assert before.is_running and before.free_blocks == before.total_blocks and before.steps == 0
        await manager.generate_batch(PROMPTS[:3], max_new_tokens=5)
        after = manager.statistics()
    assert after.steps > 0 and after.tokens_generated == 15
    assert after.tokens_computed >= sum(len(p) for p in PROMPTS[:3]) + 12
    assert after.running_requests == after.waiting_requests == 0
    assert after.cache_usage == 0.0
    with pytest.raises(AttributeError):
        after.steps = 3  # type: ignore[misc]


async def test_cached_tokens_are_the_prompts_alone_after_a_preemption(
    qwen3: PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request readmitted after a preemption finds the blocks of its own generated tokens
    in the prefix cache: they are not prompt tokens served from it (nor, in the manager's
    counters, prefix hits)."""
    from aiocb.core.kv_cache import KVCacheManager

    matched: list[int] = []
    match = KVCacheManager.match_prefix
    monkeypatch.setattr(KVCacheManager, "match_prefix", lambda self, r: matched.append(match(self, r)) or matched[-1])
    config = aiocb.ContinuousBatchingConfig(page_size=8, num_blocks=20, max_batch_tokens=32)
    prompts = random_prompts(3, 3, 3, seed=8)
    async with aiocb.Manager(qwen3, continuous_batching_config=config) as manager:
        outputs = await asyncio.gather(*(manager.generate(p, max_new_tokens=60, ignore_eos=True) for p in prompts))
        stats = manager.statistics()
    assert stats.preemptions > 0 and max(matched) > 3  # (what the test is about happened)
    assert all(0 <= o.num_cached_tokens <= len(o.prompt_ids) for o in outputs), [o.num_cached_tokens for o in outputs]
    assert stats.prefix_hit_tokens == 0


async def test_outputs_carry_cached_tokens_and_timestamps(qwen3: PreTrainedModel) -> None:
    prompt = random_prompts(1, 70, 70, seed=77)[0]
    config = aiocb.ContinuousBatchingConfig(page_size=16)
    async with aiocb.Manager(qwen3, continuous_batching_config=config) as manager:
        first = await manager.generate(prompt, max_new_tokens=4)
        again = await manager.generate(prompt, max_new_tokens=4)
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == 64  # four full blocks; the last token is always computed
    for output in (first, again):
        assert output.scheduled_time is not None and output.first_token_time is not None
        assert output.finished_time is not None
        assert output.created_time <= output.scheduled_time <= output.first_token_time <= output.finished_time


async def until(condition: Callable[[], bool]) -> None:
    """Give the loop turns until ``condition()`` holds (a few hundred at most)."""
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("the condition never held")
