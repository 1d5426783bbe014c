"""Manners toward the event loop: bursts are spread out, awaiters sleep until their answer,
and every failed awaiter gets its own exception."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from transformers import PreTrainedModel

import aiocb
from aiocb.engine.admission import Turnstile
from aiocb.engine.stream import RequestHandle
from tests.conftest import random_prompts

PROMPTS = random_prompts(4, 5, 30, seed=31)


async def test_turnstile_lets_a_fixed_number_through_per_iteration() -> None:
    turnstile = Turnstile(per_iteration=10)
    iteration = 0
    passed_at: list[int] = []

    async def ticker() -> None:
        nonlocal iteration
        while len(passed_at) < 35:
            await asyncio.sleep(0)
            iteration += 1

    async def caller() -> None:
        await turnstile.enter()
        passed_at.append(iteration)

    tick = asyncio.create_task(ticker())
    await asyncio.gather(*(caller() for _ in range(35)))
    await tick
    per_iteration = {i: passed_at.count(i) for i in set(passed_at)}
    assert max(per_iteration.values()) <= 10
    assert len(per_iteration) >= 4
    assert passed_at == sorted(passed_at), "first come, first served"


async def test_a_cancelled_waiter_hands_its_place_on() -> None:
    turnstile = Turnstile(per_iteration=1)
    await turnstile.enter()
    first = asyncio.create_task(turnstile.enter())
    second = asyncio.create_task(turnstile.enter())
    await asyncio.sleep(0)
    first.cancel()
    await asyncio.wait_for(second, 1)


async def test_a_burst_of_requests_leaves_the_loop_responsive(qwen3: PreTrainedModel) -> None:
    added = 0
    seen_by_heartbeat: list[int] = []
    async with aiocb.Manager(qwen3) as manager:

        async def heartbeat() -> None:
            while added < 600:
                seen_by_heartbeat.append(added)
                await asyncio.sleep(0)

        async def add(i: int) -> str:
            nonlocal added
            rid = await manager.add_request([1 + i % 400, 2, 3], max_new_tokens=1)
            added += 1
            return rid

        beat = asyncio.create_task(heartbeat())
        ids = await asyncio.gather(*(add(i) for i in range(600)))
        await beat
    assert len(set(ids)) == 600
    # The heartbeat ran between admissions: no more than one turnstile's worth at a time.
    steps = [b - a for a, b in itertools.pairwise(seen_by_heartbeat)]
    assert len(seen_by_heartbeat) >= 600 // 64
    assert max(steps) <= 64


async def test_awaiters_are_woken_by_the_final_output_only(
    qwen3: PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    wakeups = 0
    original = RequestHandle.wait

    async def counting_wait(self: RequestHandle) -> None:
        nonlocal wakeups
        wakeups += 1
        await original(self)

    monkeypatch.setattr(RequestHandle, "wait", counting_wait)
    async with aiocb.Manager(qwen3) as manager:
        output = await manager.generate(PROMPTS[0], max_new_tokens=20)
    assert len(output.generated_tokens) == 20
    assert wakeups == 1


async def test_each_aborted_awaiter_gets_its_own_exception(qwen3: PreTrainedModel) -> None:
    manager = aiocb.Manager(qwen3)
    manager.start()
    tasks = [asyncio.create_task(manager.generate(p, max_new_tokens=500)) for p in PROMPTS * 5]
    await asyncio.sleep(0.05)
    await manager.stop(hard_stop=True)
    await asyncio.gather(*tasks, return_exceptions=True)
    errors = [task.exception() for task in tasks]
    assert all(isinstance(e, aiocb.RequestAbortedError) for e in errors)
    assert len({id(e) for e in errors}) == len(errors)
    depth = [sum(1 for _ in _frames(e)) for e in errors]
    assert max(depth) < 10, "tracebacks do not accumulate other awaiters' frames"
    await manager.destroy()


def _frames(error: BaseException | None) -> list[object]:
    frames = []
    tb = error.__traceback__ if error is not None else None
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames
