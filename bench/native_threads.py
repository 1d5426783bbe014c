"""Sampled steps with the C kernels on torch's OpenMP team against threads of their own.

One manager, the near-zero-compute model of ``bench/overhead.py`` (1 layer, vocab 4,096),
``--batch`` requests of 16-token prompts and 32 new tokens; greedy, then sampled
(temperature 1.0, top-k 50, top-p 0.9), with the kernels on the team and then on their own
threads, ``--rounds`` times in turn within the one process (the machine's speed drifts
more between processes than within one). Prints ms per step and sampled / greedy.

    python bench/native_threads.py --batch 256 --rounds 6
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiocb
from aiocb.runner import native
from bench.common import make_workload
from bench.overhead import PROMPT_LEN, cache_blocks, run_batch, tiny_model

NEW_TOKENS = 32
SAMPLED = aiocb.SamplingParams(do_sample=True, temperature=1.0, top_k=50, top_p=0.9)


async def measure(batch: int, rounds: int) -> dict[tuple[str, str], list[float]]:
    library = native.library()
    if library is None:
        raise SystemExit("the C kernels are unavailable (see the warning above)")
    team = native._openmp_entry_points()
    model = tiny_model(1, 4096, 0)
    prompts = make_workload(batch, PROMPT_LEN, PROMPT_LEN, vocab_size=4096, seed=0)
    config = aiocb.ContinuousBatchingConfig(
        page_size=256,
        num_blocks=cache_blocks(batch, NEW_TOKENS, 256),
        max_requests_per_batch=batch,
        max_batch_tokens=batch * PROMPT_LEN,
        seed=0,
    )
    results: dict[tuple[str, str], list[float]] = {}
    async with aiocb.Manager(model, continuous_batching_config=config, num_requests_hint=batch) as manager:
        await run_batch(manager, prompts, NEW_TOKENS, None, "greedy")  # warm-up
        try:
            for _ in range(rounds):
                for threads in ("team", "own threads"):
                    library.aiocb_use_openmp(*(team if threads == "team" else (None, None, None)))
                    for mode, params in (("greedy", None), ("sampled", SAMPLED)):
                        steps = manager.statistics().steps
                        started = time.perf_counter()
                        await run_batch(manager, prompts, NEW_TOKENS, params, mode)
                        elapsed = time.perf_counter() - started
                        per_step = elapsed * 1e3 / (manager.statistics().steps - steps)
                        results.setdefault((threads, mode), []).append(per_step)
        finally:
            library.aiocb_use_openmp(*team)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args(argv)
    results = asyncio.run(measure(args.batch, args.rounds))
    print(f"{args.batch} rows, vocab 4,096, {args.rounds} rounds")
    print("| kernels' threads | greedy ms per step | sampled ms per step | sampled / greedy, each round |")
    print("| :--- | :--- | :--- | :--- |")
    for threads in ("team", "own threads"):
        greedy, sampled = results[(threads, "greedy")], results[(threads, "sampled")]
        ratios = " / ".join(f"{s / g:.2f}" for g, s in zip(greedy, sampled, strict=True))
        print(f"| {threads} | {statistics.median(greedy):.2f} | {statistics.median(sampled):.2f} | {ratios} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
