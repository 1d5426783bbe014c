"""Host cost per step of ``no_repeat_ngram_size``'s bans for one row, by history.

One request's history (prompt and output) of 8,000, 32,000 and 128,000 tokens: one token
over and over, a two-token pattern repeated, or random tokens of a 151,936-token vocabulary.
Each step appends a token (the history's next, for the repeating ones) and asks for the
bans of ``--size``-grams; the median and the longest of ``--steps`` steps are printed.
``--one-at-a-time`` finds every occurrence of the suffix with ``bytearray.find`` (no
vectorised pass past the first few hundred), as aiocb did before.

    python bench/ngram_bans.py [--size 2] [--steps 20] [--one-at-a-time]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/ngram_bans.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aiocb.runner import ngram_bans
from bench.common import machine_info

VOCAB = 151_936


def _history(kind: str, length: int, rng: random.Random) -> list[int]:
    if kind == "same":
        return [7] * length
    if kind == "pattern":
        return [1, 2] * (length // 2)
    return [rng.randrange(VOCAB) for _ in range(length)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--one-at-a-time", action="store_true")
    args = parser.parse_args(argv)
    if args.one_at_a_time:
        ngram_bans._SEARCHED = sys.maxsize
    print(machine_info().describe())
    print("| history | tokens | median ms | longest ms |")
    print("|---|---|---|---|")
    for length in (8_000, 32_000, 128_000):
        for kind in ("same", "pattern", "random"):
            rng = random.Random(0)
            tokens = _history(kind, length, rng)
            ngrams = ngram_bans.RepeatedNgrams()
            ngrams.bans(tokens, args.size)  # (the prompt taken in)
            times = []
            for _ in range(args.steps):
                tokens.append(tokens[-2] if kind != "random" else rng.randrange(VOCAB))
                started = time.perf_counter()
                ngrams.bans(tokens, args.size)
                times.append(time.perf_counter() - started)
            print(f"| {kind} | {length:,} | {statistics.median(times) * 1e3:.3f} | {max(times) * 1e3:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
