"""asyncio, uvloop and anyio's asyncio backend; the wrong loop gets a clear error."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
from collections.abc import Iterator

import anyio
import pytest
import uvloop
from transformers import PreTrainedModel

import aiocb
from tests.conftest import random_prompts, reference_generate

PROMPT = random_prompts(1, 20, 20, seed=12)[0]


async def _generate(model: PreTrainedModel) -> list[int]:
    async with aiocb.Manager(model) as manager:
        first, second = await asyncio.gather(
            manager.generate(PROMPT, max_new_tokens=6),
            manager.generate(PROMPT[:10], max_new_tokens=6),
        )
    return first.generated_tokens + second.generated_tokens


def test_runs_under_plain_asyncio(qwen3: PreTrainedModel) -> None:
    expected = reference_generate(qwen3, PROMPT, 6) + reference_generate(qwen3, PROMPT[:10], 6)
    assert asyncio.run(_generate(qwen3)) == expected


def test_runs_under_uvloop(qwen3: PreTrainedModel) -> None:
    expected = reference_generate(qwen3, PROMPT, 6) + reference_generate(qwen3, PROMPT[:10], 6)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert isinstance(runner.get_loop(), uvloop.Loop)
        assert runner.run(_generate(qwen3)) == expected


def test_runs_under_anyio_asyncio_backend(qwen3: PreTrainedModel) -> None:
    expected = reference_generate(qwen3, PROMPT, 6) + reference_generate(qwen3, PROMPT[:10], 6)
    assert anyio.run(_generate, qwen3, backend="asyncio") == expected


@contextlib.contextmanager
def _running_on_another_thread(manager: aiocb.Manager, burst: bool = False) -> Iterator[None]:
    """``manager`` started on an event loop of its own thread (with ``burst``, a caller of a
    burst waiting in its turnstile); destroyed there on exit."""
    loop = asyncio.new_event_loop()

    async def own() -> None:
        manager.start()
        if burst:
            manager._turnstile._waiters.append(loop.create_future())

    # (the loop runs until the destroy has ended: one that ran until the manager stopped
    # ended midway through the destroy, whose stop comes first, and the destroy never did)
    thread = threading.Thread(target=loop.run_forever)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(own(), loop).result(10)
        yield
    finally:
        asyncio.run_coroutine_threadsafe(manager.destroy(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_use_from_another_loop_raises_instead_of_hanging(qwen3: PreTrainedModel) -> None:
    manager = aiocb.Manager(qwen3)

    async def foreign() -> None:
        with pytest.raises(aiocb.WrongEventLoopError, match="another event loop"):
            await manager.add_request(PROMPT)
        with pytest.raises(aiocb.WrongEventLoopError):
            await manager.generate(PROMPT)
        with pytest.raises(aiocb.WrongEventLoopError):
            await manager.stop()

    with _running_on_another_thread(manager):
        asyncio.run(foreign())


def test_a_call_from_another_loop_never_waits_in_the_turnstile(qwen3: PreTrainedModel) -> None:
    """While the manager's loop has callers of a burst waiting in its turnstile, a call
    from another loop raises at once: queued there, it was released from the manager's
    thread, which does not wake its own loop (it hung until something else did)."""
    manager = aiocb.Manager(qwen3)

    async def foreign() -> None:
        for call in (manager.generate(PROMPT), manager.add_request(PROMPT), manager.generate_batch([PROMPT])):
            with pytest.raises(aiocb.WrongEventLoopError, match="another event loop"):
                await asyncio.wait_for(call, 5)

    with _running_on_another_thread(manager, burst=True):
        asyncio.run(foreign())
        assert len(manager._turnstile._waiters) == 1


def test_an_anyio_cancel_scope_around_a_manager_still_destroys_it(qwen3: PreTrainedModel) -> None:
    """anyio cancels again at every await of the exit's stop: the destroy still follows it."""
    from aiocb.engine.manager import _State

    async def run() -> object:
        manager = aiocb.Manager(qwen3)
        with anyio.move_on_after(0.3):
            async with manager, anyio.create_task_group() as group:
                for seed in range(4):
                    prompt = random_prompts(1, 6, 6, seed=seed)[0]
                    group.start_soon(functools.partial(manager.generate, prompt, max_new_tokens=1000))
        for _ in range(200):
            if manager._state is _State.DESTROYED:
                break
            await anyio.sleep(0.01)
        return manager._state

    assert anyio.run(run, backend="asyncio") is _State.DESTROYED
