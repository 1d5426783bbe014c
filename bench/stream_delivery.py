"""Delivery to streams alone: the cost of one output per stream per step, without a model.

``--streams`` requests, each read through ``manager.stream``'s iterator type by its own
task, get one token per simulated step from the engine's output router (what the step
loop does after each step). Each request starts with ``--generated`` tokens already
generated, so the cost of a long generation's outputs shows. Prints the median
microseconds per output over ``--steps`` steps (the first four left out), ``--repeats``
times.

    python bench/stream_delivery.py [--streams 256] [--steps 64] [--generated 0] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/stream_delivery.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aiocb.core.params import ResolvedParams
from aiocb.core.request import Request
from aiocb.engine.router import OutputRouter
from aiocb.engine.stream import Consumer, RequestStream
from aiocb.outputs import FinishReason, RequestStatus


async def measure(streams: int, steps: int, generated: int) -> float:
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
        async for _ in stream:
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--generated", type=int, default=0, help="tokens each request generated before [0]")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    for _ in range(args.repeats):
        us = asyncio.run(measure(args.streams, args.steps, args.generated))
        print(f"{args.streams} streams, {args.generated} tokens before: {us:.2f} us per output")
    return 0


if __name__ == "__main__":
    sys.exit(main())
