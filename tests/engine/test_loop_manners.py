"""Manners toward the event loop: bursts are spread out, awaiters sleep until their answer,
and every failed awaiter gets its own exception."""

from __future__ import annotations

import asyncio
import gc
import itertools
import os
import threading
import time
from collections.abc import Generator, Iterator
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel

import aiocb
from aiocb.core import scheduler as scheduler_module
from aiocb.core.kv_cache import KVCacheManager
from aiocb.core.params import ResolvedParams
from aiocb.core.request import Request
from aiocb.core.scheduler import Scheduler, SchedulerOutput
from aiocb.engine import manager as manager_module
from aiocb.engine import step_loop
from aiocb.engine.admission import Turnstile
from aiocb.engine.requests import RequestFactory
from aiocb.engine.router import OutputRouter
from aiocb.engine.stream import RequestHandle
from aiocb.engine.turns import Waker
from aiocb.runner.step_batch import BatchWriter
from tests.conftest import LoopTurns, gil_turn, random_prompts, reference_generate

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


async def test_turnstile_lets_no_more_through_once_an_iteration_s_budget_is_spent() -> None:
    """Callers let through run their synchronous work in the iteration they pass in: once
    those have held it ``budget`` seconds, the rest wait for a later one, in order (64
    requests with a stop string at once held the loop 13 ms)."""
    turnstile = Turnstile(per_iteration=64, budget=0.001)
    iteration = 0
    passed_at: list[tuple[int, int]] = []

    async def ticker() -> None:
        nonlocal iteration
        while len(passed_at) < 40:
            await asyncio.sleep(0)
            iteration += 1

    async def caller(index: int) -> None:
        await turnstile.enter()
        passed_at.append((iteration, index))
        spin = time.perf_counter() + 0.0003  # (its work: 0.3 ms)
        while time.perf_counter() < spin:
            pass

    tick = asyncio.create_task(ticker())
    await asyncio.gather(*(caller(i) for i in range(40)))
    await tick
    iterations = [i for i, _ in passed_at]
    assert max(iterations.count(i) for i in iterations) <= 4, "past 1 ms: 0.3 ms each, 4 at most"
    assert [index for _, index in passed_at] == list(range(40)), "first come, first served"
    assert iterations == sorted(iterations)


async def test_a_released_caller_cancelled_before_it_resumes_keeps_the_order() -> None:
    """Its place goes on in the next iteration, after the callers deferred from this one:
    a later arrival never passes before them."""
    turnstile = Turnstile(per_iteration=64, budget=0.001)
    order: list[int] = []
    late: list[asyncio.Task[None]] = []

    async def caller(index: int) -> None:
        await turnstile.enter()
        order.append(index)
        if index == 0:  # (later arrivals, in the next loop turn)
            late.extend(asyncio.create_task(caller(i)) for i in (10, 11, 12))
        if index in (0, 1):  # (these take their iteration's budget)
            spin = time.perf_counter() + 0.002
            while time.perf_counter() < spin:
                pass

    tasks = [asyncio.create_task(caller(i)) for i in range(10)]
    while not (turnstile._released and not tasks[2].done()):  # noqa: ASYNC110 (its state is the point)
        await asyncio.sleep(0)
    tasks[2].cancel()  # (let through, not resumed yet)
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.gather(*late)
    assert order == [0, 1, *range(3, 10), 10, 11, 12]
    assert turnstile._released == 0


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


async def test_generate_batch_adds_and_collects_a_slice_at_a_time(
    qwen3: PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every request of the batch ends in the same step: their outputs are all ready at once,
    # and building them in one go would hold the loop for milliseconds at a large batch.
    monkeypatch.setattr("aiocb.engine.turns.SLICE", 0.0)  # give the loop back after every request
    other = LoopTurns()
    seen: dict[str, list[int]] = {"built": [], "taken": []}
    build, take = RequestFactory.build, RequestHandle.take

    released: list[list[Any]] = []
    release = manager_module.release

    def recorded_build(self: RequestFactory, *args: Any, **kwargs: Any) -> tuple[Request, Iterator[Request]]:
        seen["built"].append(other.turns)
        return build(self, *args, **kwargs)

    def recorded_take(self: RequestHandle) -> aiocb.GenerationOutput:
        seen["taken"].append(other.turns)
        return take(self)

    async def recorded_release(items: list[Any]) -> None:
        released.append(list(items))
        await release(items)

    monkeypatch.setattr(RequestFactory, "build", recorded_build)
    monkeypatch.setattr(RequestHandle, "take", recorded_take)
    monkeypatch.setattr(manager_module, "release", recorded_release)
    prompts = random_prompts(40, 3, 12, seed=35)
    async with aiocb.Manager(qwen3) as manager, other:
        outputs = await manager.generate_batch(prompts, max_new_tokens=1)
    assert [len(o.generated_tokens) for o in outputs.values()] == [1] * len(prompts)
    for what, marks in seen.items():
        assert len(marks) == len(prompts)
        assert other.gave_back(marks) >= len(prompts) - 2, f"the loop was not given back between requests {what}"
    # The finished requests are let go of a slice of the loop at a time, not all as it returns.
    assert [[r.request_id for r in items] for items in released] == [list(outputs)]


async def test_a_sort_in_turns_is_sorted_and_gives_the_loop_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """generate_batch queues prompts that share a prefix together, sorted by their ids: in
    runs merged an item at a time (20,000 prompts sorted in one call held the loop some 30
    ms), in the order ``sorted`` gives, equal keys too."""
    import random

    from aiocb.engine import turns

    rng = random.Random(5)
    items = [(rng.randrange(50), i) for i in range(5000)]  # (many equal keys, across runs)
    assert await turns.sorted_in_turns(items, lambda x: x[0], turns.LoopTurn()) == sorted(items, key=lambda x: x[0])
    assert await turns.sorted_in_turns([], lambda x: x, turns.LoopTurn()) == []
    monkeypatch.setattr("aiocb.engine.turns.SLICE", 0.0)  # give the loop back at every chance
    marks: list[int] = []

    def key(item: tuple[int, int]) -> int:
        marks.append(other.turns)
        return item[0]

    async with LoopTurns() as other:
        await turns.sorted_in_turns(items, key, turns.LoopTurn())
    assert other.gave_back(marks) >= len(items) // 2  # (after every run, and every item merged)


async def test_a_request_with_many_samples_is_forked_a_slice_at_a_time(
    qwen3: PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # n = 1,024 samples take milliseconds to make: an awaited add spreads them out.
    monkeypatch.setattr("aiocb.engine.turns.SLICE", 0.0)  # give the loop back after every sample
    other = LoopTurns()
    forked_at = _turns_at_calls(monkeypatch, ResolvedParams, "with_seed", other)
    async with aiocb.Manager(qwen3) as manager, other:
        samples = await manager.generate(PROMPTS[0], max_new_tokens=2, n=40, do_sample=True, seed=5)
    assert len(samples) == 40 and len(forked_at) == 39
    assert other.gave_back(forked_at) >= 37, "the loop was not given back between samples"


async def test_consumers_that_a_step_touched_are_woken_a_few_per_loop_turn(qwen3: PreTrainedModel) -> None:
    # Each stream's reader works a millisecond per chunk (a server's detokenizing and
    # formatting, exaggerated): woken at once, 200 of them held the loop for 200 ms.
    handled = 0
    marks: list[int] = []

    async def read(manager: aiocb.Manager, rid: str) -> int:
        nonlocal handled
        chunks = 0
        async for _ in manager.stream(rid):
            until = time.perf_counter() + 0.001
            while time.perf_counter() < until:
                pass
            handled += 1
            chunks += 1
        return chunks

    async with aiocb.Manager(qwen3) as manager:
        # (queued without a yield: no step may deliver before the readers wait, when a
        # reader would find its chunk in its first turn, and all of them handle it at once)
        ids = [manager.add_request_nowait([1 + i, 2, 3], max_new_tokens=3) for i in range(200)]
        async with LoopTurns() as turns:
            readers = asyncio.gather(*(read(manager, rid) for rid in ids))
            while not readers.done():
                marks.append(handled)
                await asyncio.sleep(0)
            chunks = await readers
    assert sum(chunks) == handled >= 200
    assert turns.turns > 20
    most = max(b - a for a, b in itertools.pairwise(marks))
    assert most <= 16, most


def test_a_waker_left_scheduled_on_a_closed_loop_wakes_on_the_next() -> None:
    # A persistent manager outlives its loop: a run scheduled there never comes.
    waker = Waker()
    first = asyncio.new_event_loop()
    waker.wake(first.create_future())
    first.close()

    async def on_the_next_loop() -> None:
        waiter = asyncio.get_running_loop().create_future()
        waker.wake(waiter)
        await asyncio.wait_for(waiter, 1)

    asyncio.run(on_the_next_loop())


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


async def test_a_large_step_gives_the_loop_back_and_survives_cancellations_meanwhile(
    qwen3: PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A step's planning, its copy for the device and its delivery each give the loop back
    # every CHUNK requests; requests cancelled at those moments (while a plan holds them)
    # must not disturb the others or leak blocks.
    monkeypatch.setattr(step_loop, "CHUNK", 3)
    monkeypatch.setattr("aiocb.engine.turns.SLICE", 0.0)  # give the loop back after every chunk
    events: list[tuple[str, int]] = []  # (what paused, the other coroutine's turns so far)
    turns = 0
    plan, add_rows, on_step = Scheduler.plan, BatchWriter.add_rows, OutputRouter.on_step

    def recorded_plan(self: Scheduler, chunk: int = 256) -> Generator[None, None, SchedulerOutput]:
        planner = plan(self, chunk)
        while True:
            try:
                next(planner)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            events.append(("plan", turns))
            yield

    def recorded_add_rows(self: BatchWriter, stop: int) -> None:
        add_rows(self, stop)
        events.append(("copy", turns))

    def recorded_on_step(self: OutputRouter, updated: list[Request], finished: list[Request]) -> None:
        on_step(self, updated, finished)
        events.append(("delivery", turns))

    monkeypatch.setattr(Scheduler, "plan", recorded_plan)
    monkeypatch.setattr(BatchWriter, "add_rows", recorded_add_rows)
    monkeypatch.setattr(OutputRouter, "on_step", recorded_on_step)
    prompts = random_prompts(20, 5, 30, seed=33)
    config = aiocb.ContinuousBatchingConfig(max_requests_per_batch=32, max_batch_tokens=1024)
    cancelled_mid_plan = 0
    async with aiocb.Manager(qwen3, continuous_batching_config=config) as manager:
        ids = [await manager.add_request(p, max_new_tokens=8) for p in prompts]
        doomed = ids[1::4]
        finished = False

        async def probe() -> None:
            nonlocal turns, cancelled_mid_plan
            while not finished:
                await asyncio.sleep(0)
                turns += 1
                gil_turn()
                if events and events[-1][0] in ("plan", "copy") and doomed and manager.statistics().steps >= 2:
                    manager.cancel_request(doomed.pop())  # ended while a plan or its copy is paused
                    cancelled_mid_plan += 1

        probing = asyncio.create_task(probe())
        outputs = {i: await manager.get_result(i) for i in ids}
        finished = True
        await probing
        stats = manager.statistics()
    assert cancelled_mid_plan == len(ids[1::4])
    assert stats.free_blocks == stats.total_blocks, "blocks leaked"
    for request_id, prompt in zip(ids, prompts, strict=True):
        output = outputs[request_id]
        assert output is not None
        if request_id in ids[1::4]:
            assert output.status is aiocb.RequestStatus.CANCELLED
        else:
            assert output.generated_tokens == reference_generate(qwen3, prompt, 8)
    for kind in ("plan", "copy", "delivery"):
        marks = [t for k, t in events if k == kind]
        gave_back = sum(1 for a, b in itertools.pairwise(marks) if b > a)
        assert gave_back >= 10, f"the loop was not given back during {kind}"


async def test_a_batch_completing_its_blocks_together_registers_them_a_chunk_at_a_time(
    qwen3: PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rows admitted together with prompts of one length fill a page in the same step: with
    # prefix caching each hashes and registers its block then, which must not be done in one
    # go on the loop (1,024 rows: about 9 ms).
    monkeypatch.setattr(step_loop, "CHUNK", 3)
    monkeypatch.setattr("aiocb.engine.turns.SLICE", 0.0)
    other = LoopTurns()
    registered: list[int] = []  # the other coroutine's turns at each registration of a completed block
    cache_full_blocks = KVCacheManager.cache_full_blocks

    def recorded(self: KVCacheManager, request: Request) -> None:
        before = request.num_registered_blocks
        cache_full_blocks(self, request)
        if request.num_registered_blocks > before and request.num_computed_tokens > 15:
            registered.append(other.turns)

    monkeypatch.setattr(KVCacheManager, "cache_full_blocks", recorded)
    prompts = random_prompts(12, 15, 15, seed=37)
    config = aiocb.ContinuousBatchingConfig(page_size=16, allow_block_sharing=True)
    async with aiocb.Manager(qwen3, continuous_batching_config=config) as manager, other:
        outputs = await manager.generate_batch(prompts, max_new_tokens=4)
    for prompt, output in zip(prompts, outputs.values(), strict=True):
        assert output.generated_tokens == reference_generate(qwen3, prompt, 4)
    assert len(registered) == len(prompts), "every row registered its first block in the same step"
    assert other.gave_back(registered) >= len(prompts) // 3 - 1


@pytest.mark.skipif(
    "parallel backend: OpenMP" not in torch.__config__.parallel_info() or not os.path.isdir("/proc/self/task"),
    reason="torch does not run on OpenMP here, or there is no /proc to count threads in",
)
def test_the_loop_thread_gets_an_openmp_team_before_the_step_thread() -> None:
    """A thread that has run no parallel torch operation gets an OpenMP team (a worker thread
    more in the process) from the step loop's start, so that the step thread's idle OpenMP
    workers count as more threads than CPUs and yield the cores instead of spinning."""

    # (the process's thread ids, compared as sets: the OpenMP workers of threads that ended
    # in the tests before may still be ending, which a count would take for this one's)
    def process_threads() -> set[str]:
        return set(os.listdir("/proc/self/task"))

    counts: list[set[str]] = []

    def fresh_thread() -> None:
        counts.append(process_threads())
        step_loop._start_openmp_team()
        counts.append(process_threads())
        step_loop._start_openmp_team()  # (once is enough: the team stays with the thread)
        counts.append(process_threads())

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        worker = threading.Thread(target=fresh_thread)
        worker.start()
        worker.join()
    finally:
        torch.set_num_threads(threads)
    assert len(counts[1] - counts[0]) == 1 and not counts[2] - counts[1]


@pytest.mark.parametrize(
    ("pipelined", "count", "timeout"),
    [(False, 12, None), (True, 12, None), (False, 70, 600.0)],
    ids=["synchronous", "async_batching", "with-deadlines"],
)
async def test_requests_that_ended_together_are_let_go_of_one_at_a_time(
    qwen3: PreTrainedModel, monkeypatch: pytest.MonkeyPatch, pipelined: bool, count: int, timeout: float | None
) -> None:
    """Requests that ended in one step, whose outputs nobody holds any more, are freed (with
    every logprob they recorded) one between two loop turns, not all at once when the
    step loop lets go of its plan (or, with a timeout each, of their deadlines: more than
    64 ended ones are pruned from the deadline heap at once): 64 chat samples with 20 top
    logprobs a token held the loop 19 ms so (bench/RESULTS.md)."""
    alive: list[int] = []

    def ended_alive() -> int:
        return sum(1 for o in gc.get_objects() if isinstance(o, Request) and o.request_id.startswith("ended-"))

    class CountingTurn(step_loop.LoopTurn):
        async def give(self) -> None:
            alive.append(ended_alive())
            await super().give()

    monkeypatch.setattr(step_loop, "LoopTurn", CountingTurn)
    config = aiocb.ContinuousBatchingConfig(use_async_batching=pipelined)
    async with aiocb.Manager(qwen3, continuous_batching_config=config) as manager:
        params: dict[str, Any] = {"max_new_tokens": 3, "top_logprobs": 5, "prompt_logprobs": True, "timeout": timeout}
        # (with deadlines: six longer requests keep the heap of 76 from being pruned, at more
        # than 64 + 2 per live request, until the short ones' plans are long gone and their
        # deadlines the last hold on them)
        longer = [
            asyncio.create_task(manager.generate(PROMPTS[i % 4], max_new_tokens=40, timeout=timeout)) for i in range(6)
        ]
        outputs = await asyncio.gather(
            *(manager.generate(PROMPTS[0], request_id=f"ended-{i}", **params) for i in range(count))
        )
        assert all(o.finish_reason is not None for o in outputs)
        del outputs
        await asyncio.gather(*longer)
        await manager.generate(PROMPTS[1], max_new_tokens=4)  # (steps after theirs)
        assert ended_alive() == 0, "the engine still holds requests that ended"
    assert max(alive) == count
    drops = [before - after for before, after in itertools.pairwise(alive)]
    assert max(drops) == 1, f"requests freed together: {alive}"


async def test_a_long_prompts_logprobs_are_recorded_a_slice_between_two_loop_turns(
    qwen3: PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step that scored a long prompt with twenty alternatives a position records them a
    slice at a time, giving the loop back in between (8,192 positions took 20 ms in one
    go on this project's CPU machine), and the recorded logprobs are the model's."""
    monkeypatch.setattr("aiocb.engine.turns.SLICE", 0.0)  # give the loop back whenever the update pauses
    record = scheduler_module._record_prompt_logprobs
    slices: list[tuple[int, int]] = []  # (the counter's turns, entries recorded)
    counter = LoopTurns()

    def recorded(*args: Any) -> Iterator[tuple[int, bool]]:
        for entries, more in record(*args):
            slices.append((counter.turns, entries))
            yield entries, more

    monkeypatch.setattr(scheduler_module, "_record_prompt_logprobs", recorded)
    prompt = random_prompts(1, 1200, 1200, seed=12)[0]
    async with aiocb.Manager(qwen3) as manager, counter:
        output = await manager.generate(prompt, max_new_tokens=1, prompt_logprobs=True, top_logprobs=20)
    per_turn: dict[int, int] = {}
    for turn, entries in slices:
        per_turn[turn] = per_turn.get(turn, 0) + entries
    assert sum(per_turn.values()) == (len(prompt) - 1) * 21
    assert max(per_turn.values()) <= scheduler_module._PROMPT_ENTRIES_PER_SLICE
    assert len(per_turn) >= len(prompt) * 21 // scheduler_module._PROMPT_ENTRIES_PER_SLICE
    with torch.no_grad():
        logprobs = qwen3(torch.tensor([prompt])).logits[0].log_softmax(-1)
    assert output.prompt_logprobs is not None and output.prompt_top_logprobs is not None
    expected = logprobs[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor(output.prompt_logprobs[1:]), expected, atol=1e-4)
    best = logprobs[:-1].topk(20)
    for j, top in enumerate(output.prompt_top_logprobs[1:]):
        assert top is not None and list(top) == best.indices[j].tolist()
        assert torch.allclose(torch.tensor(list(top.values())), best.values[j], atol=1e-4)


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "async-batching"])
async def test_requests_that_ended_are_let_go_of_when_the_engine_goes_idle(
    qwen3: PreTrainedModel, pipelined: bool
) -> None:
    """Once the engine has nothing left to do, it holds none of the requests that ended (with
    everything they recorded): not until a next request comes, which may be never."""

    def ended_alive() -> int:
        return sum(1 for o in gc.get_objects() if isinstance(o, Request) and o.request_id.startswith("idle-"))

    config = aiocb.ContinuousBatchingConfig(use_async_batching=pipelined)
    async with aiocb.Manager(qwen3, continuous_batching_config=config) as manager:
        params: dict[str, Any] = {"max_new_tokens": 4, "top_logprobs": 5, "prompt_logprobs": True}
        outputs = await asyncio.gather(
            *(manager.generate(PROMPTS[i % 4], request_id=f"idle-{i}", **params) for i in range(6))
        )
        assert [o.generated_tokens for o in outputs] == [reference_generate(qwen3, PROMPTS[i % 4], 4) for i in range(6)]
        del outputs
        for _ in range(100):  # (a few loop turns: the step loop goes idle)
            await asyncio.sleep(0)
        assert ended_alive() == 0, "the idle engine still holds requests that ended"
        stats = manager.statistics()
        assert stats.free_blocks == stats.total_blocks
        # and it serves on as before (the slots of those that ended were given back)
        again = await manager.generate(PROMPTS[1], max_new_tokens=4)
        assert again.generated_tokens == reference_generate(qwen3, PROMPTS[1], 4)


@pytest.fixture
def slow_cache(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Allocating a runner's KV cache takes 0.4 s (as a large one's first touch or a GPU's
    allocation can); returns the names of the threads that allocated one."""
    from aiocb.runner import model_runner

    threads: list[str] = []
    allocate = model_runner.PagedKVCache

    def slow(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        time.sleep(0.4)
        return allocate(*args, **kwargs)

    monkeypatch.setattr(model_runner, "PagedKVCache", slow)
    return threads


async def test_a_start_builds_the_runner_off_the_loop_and_takes_requests_meanwhile(
    qwen3: PreTrainedModel, slow_cache: list[str]
) -> None:
    manager = aiocb.Manager(qwen3)
    began = time.perf_counter()
    manager.start()
    request_id = manager.add_request_nowait(PROMPTS[0], max_new_tokens=6)  # (checked against the plan)
    assert time.perf_counter() - began < 0.1, "the cache was allocated on the loop"
    with pytest.raises(aiocb.InvalidRequestError, match="max_new_tokens"):
        manager.add_request_nowait(PROMPTS[1], max_new_tokens=-1)
    assert manager.continuous_batching_config.num_blocks is not None  # (the plan's)
    try:
        # A request's timeout ends it at its deadline, though the steps have not begun.
        late = await manager.generate(PROMPTS[1], max_new_tokens=6, timeout=0.1)
        assert late.finish_reason == "timeout" and time.perf_counter() - began < 0.35
        await manager.wait_started()
        assert time.perf_counter() - began >= 0.4
        output = await manager.get_result(request_id, timeout=60)
    finally:
        await manager.stop()
    assert output is not None and output.generated_tokens == reference_generate(qwen3, PROMPTS[0], 6)
    assert len(slow_cache) == 1 and slow_cache[0] != threading.current_thread().name
    assert manager.statistics().free_blocks == manager.statistics().total_blocks


async def test_a_runner_that_cannot_be_built_fails_the_start_and_what_waits(
    qwen3: PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The start fails, naming why; what was queued meanwhile is aborted; the manager is as
    it was, and a later start (the memory back) serves."""
    from aiocb.runner import model_runner

    allocate = model_runner.PagedKVCache

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("CUDA out of memory (a stand-in)")

    monkeypatch.setattr(model_runner, "PagedKVCache", failing)
    manager = aiocb.Manager(qwen3)
    queued = manager.add_request_nowait(PROMPTS[1], max_new_tokens=4)  # (before the start)
    manager.start()
    waiting = asyncio.ensure_future(manager.generate(PROMPTS[0], max_new_tokens=4))
    with pytest.raises(RuntimeError, match="out of memory"):
        await manager.wait_started()
    with pytest.raises(aiocb.RequestAbortedError, match="out of memory"):
        await waiting
    result = await manager.get_result(queued)  # (its result says so, as a hard stop's)
    assert result is not None and result.finish_reason is aiocb.FinishReason.ABORTED
    assert result.error is not None and "start failed" in result.error
    assert not manager.is_running and not manager.is_dead
    assert qwen3.config._attn_implementation != "aiocb_paged"
    monkeypatch.setattr(model_runner, "PagedKVCache", allocate)
    async with manager:
        output = await manager.generate(PROMPTS[0], max_new_tokens=4)
    assert output.generated_tokens == reference_generate(qwen3, PROMPTS[0], 4)


class FailingCache:
    """Allocating a runner's KV cache fails (once :attr:`go` is set; :attr:`began` is set
    when the allocation begins) while :attr:`failing`; else it is allocated."""

    def __init__(self) -> None:
        self.began, self.go = threading.Event(), threading.Event()
        self.failing = True


@pytest.fixture
def failing_cache(monkeypatch: pytest.MonkeyPatch) -> FailingCache:
    from aiocb.runner import model_runner

    cache, allocate = FailingCache(), model_runner.PagedKVCache

    def failing(*args: Any, **kwargs: Any) -> Any:
        if not cache.failing:
            return allocate(*args, **kwargs)
        cache.began.set()
        cache.go.wait(30)
        raise RuntimeError("CUDA out of memory (a stand-in)")

    monkeypatch.setattr(model_runner, "PagedKVCache", failing)
    return cache


async def _a_burst_as_the_start_fails(
    manager: aiocb.Manager, failing_cache: FailingCache, *, before_start: bool = False
) -> list[asyncio.Future[Any]]:
    """A thousand ``generate`` calls begun during (or just before) a start whose build
    fails while most of them are still on their way: they pass the turnstile 64 a loop
    turn, and the loop is held until the build has failed."""
    if not before_start:
        manager.start()
        await asyncio.to_thread(failing_cache.began.wait, 30)
    calls = [asyncio.ensure_future(manager.generate(PROMPTS[0], max_new_tokens=4)) for _ in range(1_000)]
    await asyncio.sleep(0)  # (the first 64 pass)
    if before_start:
        manager.start()
        for _ in range(3):  # (the start's task hands the build to its thread)
            await asyncio.sleep(0)
        # (then the loop held while the build comes to the cache: turns given meanwhile let
        # the callers through, all of them on a slow machine)
        assert failing_cache.began.wait(30)
    failing_cache.go.set()
    time.sleep(0.2)  # noqa: ASYNC251  (the loop held: the build fails before the next ones pass)
    return calls


@pytest.mark.parametrize("before_start", [False, True], ids=["during the start", "before the start"])
async def test_callers_under_way_when_the_start_fails_are_refused_not_left_queued(
    qwen3: PreTrainedModel, failing_cache: FailingCache, before_start: bool
) -> None:
    """Those still on their way when the build failed were queued for a next start that
    might never come (the manager is as before the start), and hung."""
    manager = aiocb.Manager(qwen3)
    calls = await _a_burst_as_the_start_fails(manager, failing_cache, before_start=before_start)
    done, pending = await asyncio.wait(calls, timeout=30)
    assert not pending
    errors = [call.exception() for call in done]
    assert all(isinstance(e, (aiocb.RequestAbortedError, aiocb.ManagerClosedError)) for e in errors)
    assert all("out of memory" in str(e) for e in errors)
    assert any(isinstance(e, aiocb.ManagerClosedError) for e in errors)  # (some were on their way)
    assert not manager.is_running
    await manager.destroy()


async def test_callers_under_way_when_the_start_fails_join_a_start_that_follows(
    qwen3: PreTrainedModel, failing_cache: FailingCache
) -> None:
    manager = aiocb.Manager(qwen3)
    calls = await _a_burst_as_the_start_fails(manager, failing_cache)
    with pytest.raises(RuntimeError, match="out of memory"):
        await manager.wait_started()
    assert not manager.is_running and not all(call.done() for call in calls)
    failing_cache.failing = False
    manager.start()  # (the memory back: a retry)
    done, pending = await asyncio.wait(calls, timeout=60)
    assert not pending
    served = [call.result() for call in done if call.exception() is None]
    assert served and all(o.generated_tokens == reference_generate(qwen3, PROMPTS[0], 4) for o in served)
    # (the rest were queued for the failed start, or came while it had failed: refused)
    refused = (aiocb.RequestAbortedError, aiocb.ManagerClosedError)
    assert all(isinstance(c.exception(), refused) for c in done if c.exception() is not None)
    await manager.stop()


async def test_a_stop_while_the_start_fails_leaves_the_manager_stopped(
    qwen3: PreTrainedModel, failing_cache: FailingCache
) -> None:
    manager = aiocb.Manager(qwen3)
    manager.start()
    stopping = asyncio.ensure_future(manager.stop())
    await asyncio.sleep(0.05)
    failing_cache.go.set()
    await stopping
    assert not manager.is_running
    with pytest.raises(aiocb.ManagerClosedError, match="stopped"):  # (not queued for a start to come)
        await asyncio.wait_for(manager.generate(PROMPTS[0], max_new_tokens=4), 5)
    await manager.destroy()


async def test_an_async_with_whose_entry_is_cancelled_during_the_build_ends_its_session(
    qwen3: PreTrainedModel, slow_cache: list[str]
) -> None:
    """No ``__aexit__`` follows an ``__aenter__`` that raised: the session it began must end
    (it ran on, holding the model's attention and its cache, with nobody to stop it)."""
    original = qwen3.config._attn_implementation
    manager = aiocb.Manager(qwen3)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05), manager:
            pass
    for _ in range(200):
        if not manager.is_running:
            break
        await asyncio.sleep(0.05)
    assert not manager.is_running
    assert qwen3.config._attn_implementation == original
    with pytest.raises(aiocb.ManagerClosedError, match="destroyed"):
        await manager.generate(PROMPTS[0], max_new_tokens=4)


async def test_an_entry_of_a_persistent_manager_cancelled_during_the_build_ends_only_its_own_session(
    qwen3: PreTrainedModel, slow_cache: list[str]
) -> None:
    """An entry cancelled while it joined a session another task began leaves that session
    running; one that began its own session stops it, and a retry at once enters a new one
    (it entered the session being stopped, whose requests were all refused)."""
    manager = aiocb.Manager(qwen3, persistent_manager=True)
    expected = reference_generate(qwen3, PROMPTS[0], 4)

    async def enter_and_generate() -> list[int]:
        async with manager:
            return (await manager.generate(PROMPTS[0], max_new_tokens=4)).generated_tokens

    first = asyncio.ensure_future(enter_and_generate())
    await asyncio.sleep(0)  # (it began the session)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05), manager:
            pass
    assert await first == expected
    await manager.destroy()
    manager = aiocb.Manager(qwen3, persistent_manager=True)  # (its runner built anew: slowly)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05), manager:
            pass
    assert await enter_and_generate() == expected  # (at once)
    await manager.destroy()


def test_a_loop_closed_while_the_runner_is_built_leaves_the_model_as_it_was(
    qwen3: PreTrainedModel, slow_cache: list[str]
) -> None:
    """The build finishes on its thread after the loop is gone: the runner it made is
    detached as soon as it is attached, so the model keeps its own attention, and a start on
    a new loop (whose build waits for that one) serves."""
    original = qwen3.config._attn_implementation
    manager = aiocb.Manager(qwen3)

    async def start() -> None:
        manager.start()
        await asyncio.sleep(0.05)

    loop = asyncio.new_event_loop()
    loop.run_until_complete(start())
    loop.close()
    assert not manager.is_running  # (the session ends with its loop)
    time.sleep(0.6)  # (the build's thread finishes)
    assert qwen3.config._attn_implementation == original

    async def serve() -> list[int]:
        async with manager:
            return (await manager.generate(PROMPTS[0], max_new_tokens=5)).generated_tokens

    assert asyncio.run(serve()) == reference_generate(qwen3, PROMPTS[0], 5)
    assert qwen3.config._attn_implementation == original
    # asyncio.run() returning during a build cancels the session, which waits for the build
    # and ends it: nothing keeps that runner (or its cache) afterwards.
    manager = aiocb.Manager(qwen3)
    asyncio.run(start())
    assert not manager.is_running and manager._pending_build is None and manager._runner is None
    assert qwen3.config._attn_implementation == original


def test_a_start_after_a_build_abandoned_with_its_loop_waits_for_that_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """A persistent manager's build, slow to attach, is abandoned with its closed loop: the
    next session's build waits for it, so the two never attach the model at once, and the
    model has its own attention back once that session stops."""
    from aiocb.runner import attention
    from tests.conftest import tiny_qwen3

    model = tiny_qwen3()
    original = model.config._attn_implementation
    install, calls = attention.install, []

    def slow_second_install(target: PreTrainedModel) -> None:
        calls.append(1)
        if len(calls) == 2:  # (the session whose loop closes)
            time.sleep(0.3)
        install(target)

    monkeypatch.setattr(attention, "install", slow_second_install)
    manager = aiocb.Manager(model, persistent_manager=True)

    async def first() -> None:
        manager.start()
        await manager.wait_started()
        await manager.stop()

    async def started_only() -> None:
        manager.start()
        await asyncio.sleep(0.05)

    async def serve() -> list[int]:
        manager.start()
        await manager.wait_started()
        await asyncio.sleep(0.4)  # (the abandoned build has ended by now, whatever the order)
        output = await manager.generate(PROMPTS[1], max_new_tokens=5)
        await manager.stop()
        return output.generated_tokens

    try:
        asyncio.run(first())
        loop = asyncio.new_event_loop()
        loop.run_until_complete(started_only())
        loop.close()
        assert asyncio.run(serve()) == reference_generate(model, PROMPTS[1], 5)
        assert model.config._attn_implementation == original
    finally:
        asyncio.run(manager.destroy())


async def test_a_hard_stop_ends_its_requests_a_slice_of_the_loop_at_a_time(
    qwen3: PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (4,096 live requests ended in one pass held the loop 18 ms)
    from aiocb.engine.router import OutputRouter

    monkeypatch.setattr("aiocb.engine.turns.SLICE", 0.0)  # give the loop back after every request
    other = LoopTurns()
    async with aiocb.Manager(qwen3) as manager:
        for prompt in random_prompts(40, 4, 8, seed=2):
            manager.add_request_nowait(prompt, max_new_tokens=1000, ignore_eos=True)
        await asyncio.sleep(0.05)
        ended_at = _turns_at_calls(monkeypatch, OutputRouter, "end", other)
        async with other:
            await manager.stop(hard_stop=True)
    assert len(ended_at) == 40
    assert other.gave_back(ended_at) >= 35, "the loop was not given back between requests"


async def test_deadlines_that_pass_together_end_their_requests_a_slice_of_the_loop_at_a_time(
    qwen3: PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (4,000 requests whose timeouts passed together, ended in one pass, held the loop 2.7 ms)
    from aiocb.engine.router import OutputRouter

    monkeypatch.setattr("aiocb.engine.turns.SLICE", 0.0)  # give the loop back after every chunk
    other = LoopTurns()
    expired_at: list[int] = []
    on_step = OutputRouter.on_step

    def recorded(router: OutputRouter, updated: list[Any], finished: list[Any]) -> None:
        if not updated and finished:  # (a pass over expired deadlines)
            expired_at.append(other.turns)
        on_step(router, updated, finished)

    monkeypatch.setattr(OutputRouter, "on_step", recorded)
    config = aiocb.ContinuousBatchingConfig(max_requests_per_batch=2)
    async with aiocb.Manager(qwen3, continuous_batching_config=config) as manager:
        ids = [
            manager.add_request_nowait(prompt, max_new_tokens=1000, ignore_eos=True, timeout=0.3)
            for prompt in random_prompts(100, 4, 8, seed=3)
        ]
        time.sleep(0.4)  # noqa: ASYNC251 (the loop held while every deadline passes: one pass finds them all)
        async with other:
            outputs = [await manager.get_result(rid) for rid in ids]
    assert all(output.finish_reason is aiocb.FinishReason.TIMEOUT for output in outputs)
    # (the counter's first turn may come after the first two passes: it counts from its second)
    assert len(expired_at) >= 3 and other.gave_back(expired_at) >= len(expired_at) - 2


def _turns_at_calls(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, turns: LoopTurns) -> list[int]:
    """The count of ``turns`` at each call of ``owner.name`` from now on (the call goes on as before)."""
    marks: list[int] = []
    original = getattr(owner, name)

    def recorded(*args: Any, **kwargs: Any) -> Any:
        marks.append(turns.turns)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, recorded)
    return marks
