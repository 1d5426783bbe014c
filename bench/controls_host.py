"""Host work of per-request controls in one decode step, without a model.

256 sampled rows whose requests hold 600 prompt and 500 generated tokens, with and
without penalties (repetition, presence, frequency), a bias and a ban, and with
``--bad-words N`` also N multi-token bad words each (2 to 4 tokens: each step matches them
against the row's history). For each step it times the event loop's part (``snapshot``:
the plan copied out of the scheduler) and the step worker's part
(``controls_host_tensors``: the flat tensors sent to the device).

    python bench/controls_host.py [--rows 256] [--steps 40] [--bad-words 800]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/controls_host.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aiocb.core.params import ResolvedParams
from aiocb.core.request import Request
from aiocb.core.scheduler import ScheduledRequest, SchedulerOutput
from aiocb.runner import inputs, step_batch


def _requests(rows: int, controls: bool, bad_words: int, rng: random.Random) -> list[Request]:
    requests = []
    words = tuple((tuple(rng.randrange(1000) for _ in range(rng.randint(2, 4))), 0.0) for _ in range(bad_words))
    for i in range(rows):
        penalties = {"repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": 0.3}
        extra = {**penalties, "biases": ((5, 1.0),), "bans": (3,), "bad_sequences": words} if controls else {}
        params = ResolvedParams(max_new_tokens=4096, temperature=1.0, seed=i, **extra)  # type: ignore[arg-type]
        request = Request(f"r{i}", [rng.randrange(1000) for _ in range(600)], params, 0.0)
        request.token_ids += [rng.randrange(1000) for _ in range(500)]
        request.block_ids = [list(range(i * 70, i * 70 + 70))]
        request.num_computed_tokens = request.num_tokens - 1
        if controls:
            step_batch.token_history(request)  # as aiocb's RequestFactory does when it builds the request
        requests.append(request)
    return requests


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--bad-words", type=int, default=0)
    args = parser.parse_args(argv)
    rng = random.Random(0)
    for controls in (False, True):
        requests = _requests(args.rows, controls, args.bad_words, rng)
        writer = step_batch.BatchWriter(1, 1000)
        loop_ms: list[float] = []
        worker_ms: list[float] = []
        for _ in range(args.steps):
            for request in requests:
                request.token_ids.append(rng.randrange(1000))
                request.num_computed_tokens += 1
            scheduled = [ScheduledRequest(r, r.num_computed_tokens - 1, 1, True) for r in requests]
            plan = SchedulerOutput(scheduled=scheduled)
            started = time.perf_counter()
            batch = writer.snapshot(plan)
            loop_ms.append((time.perf_counter() - started) * 1e3)
            started = time.perf_counter()
            inputs.controls_host_tensors(batch.controls, batch.num_sampled)
            worker_ms.append((time.perf_counter() - started) * 1e3)
        name = "controls" if controls else "plain"
        print(
            f"{name:>8}: loop (snapshot) median {statistics.median(loop_ms):.2f} ms, max {max(loop_ms):.2f} ms; "
            f"worker (control tensors) median {statistics.median(worker_ms):.2f} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
