"""Delivery to streams alone: the cost of one output per stream per step, without a model.

``--streams`` requests, each read through ``manager.stream``'s iterator type by its own
task, get one token per simulated step from the engine's output router (what the step
loop does after each step). Each request starts with ``--generated`` tokens already
generated, so the cost of a long generation's outputs shows. With ``--read`` each reader
reads every output's ``generated_tokens`` (as ``bench/overhead.py``'s streamed mode does).
Prints the median microseconds per output over ``--steps`` steps (the first four left
out), ``--repeats`` times, and beside it the event loop's floor: as many tasks, each
awaiting a fresh future that the step completes, the least any stream's output can cost
(a future made and completed, a task woken); the two interleaved.

    python bench/stream_delivery.py [--streams 256] [--steps 64] [--generated 0] [--repeats 3]
    python bench/stream_delivery.py --read --loop uvloop
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/stream_delivery.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aiocb.core.params import ResolvedParams
from aiocb.core.request import Request
from aiocb.engine.router import OutputRouter
from aiocb.engine.stream import Consumer, RequestStream
from aiocb.outputs import FinishReason, RequestStatus


async def measure(streams: int, steps: int, generated: int, read_tokens: bool) -> float:
    """Median microseconds per delivered output."""
    loop = asyncio.get_running_loop()
    router = OutputRouter(lambda: None)
    params = ResolvedParams(max_new_tokens=generated + steps + 1)
    requests = [Request(f"r{i}", list(range(16)), params, 0.0) for i in range(streams)]
    router.register(requests, streaming=False, consumer=Consumer.RESULTS)
    readers = []
    for request in requests:
        request.token_ids.extend(range(generated))
        request.status = RequestStatus.DECODING
        handle = router.claim_for_stream(request.request_id)
        handle.delivered_tokens = generated  # (read up to here)
        readers.append(RequestStream(router, handle, loop))
    received = 0

    async def read(stream: RequestStream) -> None:
        nonlocal received
        async for output in stream:
            if read_tokens:
                output.generated_tokens  # noqa: B018 (read, as a consumer would)
            received += 1

    tasks = [asyncio.create_task(read(stream)) for stream in readers]
    await asyncio.sleep(0)
    times = []
    for step in range(steps):
        started = time.perf_counter()
        for request in requests:
            request.token_ids.append(step)
        router.on_step(requests, [])
        await asyncio.sleep(0)  # the readers run
        await asyncio.sleep(0)  # (and wait again)
        times.append(time.perf_counter() - started)
    for request in requests:
        request.status, request.finish_reason = RequestStatus.FINISHED, FinishReason.LENGTH
    router.on_step([], requests)
    await asyncio.gather(*tasks)
    if received != streams * (steps + 1):
        raise RuntimeError(f"{received} outputs delivered, {streams * (steps + 1)} expected")
    return statistics.median(times[4:]) / streams * 1e6


async def floor(streams: int, steps: int) -> float:
    """Median microseconds per wake-up of tasks that each await a fresh future per step."""
    loop = asyncio.get_running_loop()
    waiters: list[asyncio.Future[bool]] = [loop.create_future() for _ in range(streams)]

    async def wait(i: int) -> None:
        while await waiters[i]:
            waiters[i] = loop.create_future()

    tasks = [asyncio.create_task(wait(i)) for i in range(streams)]
    await asyncio.sleep(0)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        for waiter in waiters:
            waiter.set_result(True)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        times.append(time.perf_counter() - started)
    for waiter in waiters:
        waiter.set_result(False)
    await asyncio.gather(*tasks)
    return statistics.median(times[4:]) / streams * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--generated", type=int, default=0, help="tokens each request generated before [0]")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--read", action="store_true", help="read every output's generated_tokens")
    parser.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio", help="the event loop [asyncio]")
    args = parser.parse_args(argv)
    run: Callable[[Coroutine[Any, Any, float]], float] = asyncio.run
    if args.loop == "uvloop":
        import uvloop

        run = uvloop.run
    for _ in range(args.repeats):
        us = run(measure(args.streams, args.steps, args.generated, args.read))
        floor_us = run(floor(args.streams, args.steps))
        print(
            f"{args.streams} streams, {args.generated} tokens before{', read' if args.read else ''}, {args.loop}: "
            f"{us:.2f} us per output (the loop's floor {floor_us:.2f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
