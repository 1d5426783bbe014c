"""Event-loop lag while one request brings controls that list much of a vocabulary.

A 1-layer Qwen3 (hidden 16) with Qwen3's vocabulary (151,936 tokens) generates 32 tokens
for one 3-token prompt (``await manager.generate``), given one control of ``--ids`` token
ids: a ``logit_bias``, ``stop_token_ids``, ``allowed_token_ids``, single-token
``bad_words_ids``, or stop tokens held off by ``min_tokens`` 16 (banned at every step
until then); ``none`` gives none. A 1 ms heartbeat on the same loop records how late it
wakes: the time the check of the controls, the steps that apply them, or the collector
kept the loop (or the GIL) from it. Each case runs ``--repeats`` times on one manager.

    python bench/large_controls.py [--ids 150000] [--repeats 3] [--cases logit_bias,allowed_token_ids]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/large_controls.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiocb
from bench.common import build_model, machine_info
from bench.loop_watch import Heartbeat
from bench.overhead import TINY_SHAPE

VOCAB = 151_936


def cases(ids: int) -> dict[str, dict[str, Any]]:
    return {
        "none": {},
        "logit_bias": {"logit_bias": {i: 0.5 for i in range(ids)}},
        "stop_token_ids": {"stop_token_ids": list(range(1, ids))},
        "allowed_token_ids": {"allowed_token_ids": list(range(1, ids))},
        "bad_words_ids": {"bad_words_ids": [[i] for i in range(2, ids)]},
        "held_stops": {"stop_token_ids": list(range(1, ids)), "min_tokens": 16},
    }


async def run(chosen: list[str], ids: int, repeats: int) -> None:
    model = build_model(seed=0, vocab_size=VOCAB, num_hidden_layers=1, **TINY_SHAPE)
    controls = cases(ids)
    async with aiocb.Manager(model) as manager:
        await manager.generate([1, 2, 3], max_new_tokens=2)  # warm-up
        for name in chosen:
            for _ in range(repeats):
                async with Heartbeat() as beat:
                    await asyncio.sleep(0.01)
                    beat.lags.clear()
                    started = time.perf_counter()
                    await manager.generate([5, 6, 7], max_new_tokens=32, **controls[name])
                    wall = time.perf_counter() - started
                print(f"{name:18} request {wall * 1e3:7.1f} ms; {beat.summary()}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ids", type=int, default=150_000, help="token ids in the control")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", default=",".join(cases(0)), help=f"comma-separated, of {list(cases(0))}")
    args = parser.parse_args(argv)
    chosen = args.cases.split(",")
    unknown = sorted(set(chosen) - set(cases(0)))
    if unknown:
        parser.error(f"unknown cases {unknown}")
    print(machine_info().describe())
    asyncio.run(run(chosen, args.ids, args.repeats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
