"""What planning prompt lookup costs the event loop per step, by the lengths looked up.

Each case plans ``--requests`` decoding requests a step through the scheduler's
:class:`~aiocb.core.speculation.SpeculationPlanner`, in a fixed order, as the scheduler
does; each request's output copies its prompt (a 50-token cycle, repeated), so every
proposal is accepted and each step adds ``k + 1`` tokens to every request. It reports the
loop time of a step's planning (median, p99, worst, over the steps after the first 50), and
how many requests never proposed (a budget spent by the first requests planned leaves the
others behind).

    python bench/lookup_planning.py [--requests 32] [--steps 300] [--lengths 2-4,2-8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

if __package__ in (None, ""):  # run as `python bench/lookup_planning.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiocb
from aiocb.core.speculation import SpeculationPlanner
from bench.common import machine_info

#: tokens of the cycle each request's prompt repeats and its output copies
CYCLE = 50


def run(low: int, high: int, requests: int, steps: int, k: int) -> tuple[list[float], int]:
    """Each step's planning time (seconds), and the requests that never proposed."""
    config = aiocb.SpeculativeConfig(prompt_lookup_min=low, prompt_lookup_max=high, num_speculative_tokens=k)
    planner = SpeculationPlanner(config, None, max_batch_tokens=8192, max_model_len=None)
    params = SimpleNamespace(uses_controls=False, needs_known_history=False, max_new_tokens=10**9)
    rows = []
    for r in range(requests):
        cycle = [1000 * r + i for i in range(CYCLE)]
        rows.append(
            SimpleNamespace(params=params, grammar=None, token_ids=cycle * 4, proposer=None, num_output_tokens=0)
        )
    proposed = [0] * requests
    times = []
    for _ in range(steps):
        planner.start_step(requests)
        start = time.perf_counter()
        drafts = []
        for row in rows:
            row.num_tokens = len(row.token_ids)
            drafts.append(planner.propose(row, 10**6))  # type: ignore[arg-type]
        times.append(time.perf_counter() - start)
        for i, (row, proposal) in enumerate(zip(rows, drafts, strict=True)):
            proposed[i] += bool(proposal)
            for _ in range(1 + len(proposal or ())):  # (every proposal accepted: the output copies)
                row.token_ids.append(1000 * i + len(row.token_ids) % CYCLE)
    return times, sum(1 for count in proposed if not count)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--requests", type=int, default=32, help="requests planned a step (the default disable_by_batch_size)"
    )
    parser.add_argument("--steps", type=int, default=300, help="steps planned")
    parser.add_argument("--lengths", default="2-4,2-8", help="prompt_lookup_min-prompt_lookup_max cases")
    parser.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    args = parser.parse_args(argv)
    print(machine_info().describe())
    print("| lengths | requests | median ms | p99 ms | worst ms | never proposed |")
    print("| :--- | ---: | ---: | ---: | ---: | ---: |")
    for case in args.lengths.split(","):
        low, high = (int(n) for n in case.split("-"))
        times, never = run(low, high, args.requests, args.steps, args.k)
        late = sorted(times[50:])
        p99 = late[min(len(late) - 1, int(len(late) * 0.99))]
        print(
            f"| {low}-{high} | {args.requests} | {1e3 * statistics.median(late):.2f} | {1e3 * p99:.2f} "
            f"| {1e3 * late[-1]:.2f} | {never} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
