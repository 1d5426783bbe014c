"""Event-loop lag while 512 constrained requests decode, against the same run free.

The bundled model and tokenizer; 512 eight-token prompts, 24 new tokens at temperature
1.0, in one batch, with torch limited to one thread (the loop keeps a core of its own,
see ``bench/loop_lag.py``); in the constrained runs every request follows
``bench/structured.py``'s schema, so each step's copy for the device fills 512 token
bitmask rows on the loop. A 1 ms heartbeat records how late it wakes; runs alternate.

    python bench/structured_lag.py [--rows 512] [--repeats 2]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/structured_lag.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import aiocb
from aiocb.default_model import load_default_model
from bench.loop_watch import Heartbeat
from bench.structured import SCHEMA


async def _run(model: Any, tokenizer: Any, rows: int, constrained: bool) -> str:
    config = aiocb.ContinuousBatchingConfig(
        max_requests_per_batch=rows, num_blocks=rows * 2 + 8, page_size=64, max_batch_tokens=rows * 8
    )
    async with aiocb.Manager(model, tokenizer=tokenizer, continuous_batching_config=config) as manager:
        await manager.generate("x", max_new_tokens=4, json_schema=SCHEMA)  # warm-up, schema compiled
        extra: dict[str, Any] = {"json_schema": SCHEMA} if constrained else {}
        prompts = [[1 + i % 300] * 8 for i in range(rows)]
        async with Heartbeat() as beat:
            await manager.generate_batch(prompts, max_new_tokens=24, temperature=1.0, **extra)
    return f"{'constrained' if constrained else 'free':>11}: {beat.summary()}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model, tokenizer = load_default_model()
    for _ in range(args.repeats):
        for constrained in (False, True):
            print(asyncio.run(_run(model, tokenizer, args.rows, constrained)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
