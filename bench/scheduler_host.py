"""The event loop's own host work per decode step, without a model or an event loop.

1,024 requests (16-token prompts, prefix caching on) decode together; each step is
planned (``Scheduler.schedule``), copied out for the device (``BatchWriter.snapshot``)
and then given one token per row (``Scheduler.update``) as a model would. Prints the
median milliseconds of each over ``--steps`` steps (the first two, admission and
prefill, left out).

    python bench/scheduler_host.py [--rows 1024] [--steps 40]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/scheduler_host.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aiocb.core.kv_cache import CacheGroup, KVCacheManager
from aiocb.core.params import ResolvedParams
from aiocb.core.request import Request
from aiocb.core.scheduler import Scheduler, StepResult
from aiocb.runner.step_batch import BatchWriter


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args(argv)
    kv = KVCacheManager([CacheGroup((0,), 8 * args.rows)], 16, enable_prefix_caching=True)
    scheduler = Scheduler(kv, max_batch_tokens=1 << 20, max_requests_per_batch=args.rows)
    params = ResolvedParams(max_new_tokens=10_000, stop_token_ids=frozenset({0}))
    for i in range(args.rows):
        scheduler.add(Request(f"r{i}", [1 + (i * 7 + j) % 500 for j in range(16)], params, 0.0))
    writer = BatchWriter(1, 1000)
    plan_ms: list[float] = []
    copy_ms: list[float] = []
    update_ms: list[float] = []
    for step in range(args.steps):
        started = time.perf_counter()
        output = scheduler.schedule()
        plan_ms.append((time.perf_counter() - started) * 1e3)
        started = time.perf_counter()
        writer.snapshot(output, scheduler.take_departed())
        copy_ms.append((time.perf_counter() - started) * 1e3)
        result = StepResult([5 + step % 100] * sum(1 for item in output.scheduled if item.sample))
        started = time.perf_counter()
        scheduler.update(output, result, 0.0)
        update_ms.append((time.perf_counter() - started) * 1e3)
    plan, copy, update = (statistics.median(ms[2:]) for ms in (plan_ms, copy_ms, update_ms))
    print(f"{args.rows} decoding rows: plan {plan:.2f}, copy {copy:.2f}, update {update:.2f} ms per step (medians)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
