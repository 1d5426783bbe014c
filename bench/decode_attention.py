"""The CPU decode-attention kernel alone: milliseconds per call, by how its threads run.

A model's decode step calls attention once per layer between torch operations (the
layer's matrix products), so each call here follows a matrix product as large as W1's
(``bench/throughput.py``): torch's OpenMP threads are spinning, waiting for more work,
when the kernel starts. Over ``--layers`` caches of W1's shape (page 256, 8 heads over 4 KV
heads of 32, float32; the rows' contexts 48..288 keys), in turn:

* ``team``: the kernel on torch's OpenMP team (what aiocb does);
* ``own threads``: on threads of its own, started for the call;
* ``one thread``: on the calling thread alone;
* ``none``: the matrix products alone (subtract from the others).

    python bench/decode_attention.py                 # 64 rows, 4 layers
    python bench/decode_attention.py --rows 256 --layers 8 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from aiocb.runner import native

HEADS, KV_HEADS, DIM, PAGE = 8, 4, 32, 256
MODES = ("team", "own threads", "one thread", "none")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--calls", type=int, default=64, help="steps timed per round (each calls every layer)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds per mode, interleaved")
    args = parser.parse_args(argv)
    library = native.library()
    if library is None:
        print("the C kernels are unavailable (see the warning above)")
        return 1
    generator = torch.Generator().manual_seed(0)
    count = torch.randint(48, 289, (args.rows,), generator=generator)
    per_row = -(-int(count.max()) // PAGE)
    blocks = args.rows * per_row
    table = torch.arange(blocks, dtype=torch.int32).view(per_row, args.rows).t().contiguous()
    shape = (blocks * PAGE, KV_HEADS, DIM)
    caches = [
        (torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)) for _ in range(args.layers)
    ]
    first = torch.zeros(args.rows, dtype=torch.long)
    query = torch.randn(args.rows, HEADS, DIM, generator=generator)
    # the step's other work between two layers' attention: a matrix product of W1's size
    hidden, weight = torch.randn(args.rows, 256), torch.randn(512, 256)
    openmp = native._openmp_entry_points()

    def round_ms(mode: str) -> float:
        library.aiocb_use_openmp(*(openmp if mode == "team" else (None, None, None)))
        threads = 1 if mode == "one thread" else torch.get_num_threads()
        start = time.perf_counter()
        for _ in range(args.calls):
            for key_cache, value_cache in caches:
                torch.nn.functional.linear(hidden, weight)
                if mode == "none":
                    continue
                library.aiocb_decode_attention(
                    query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), table.data_ptr(),
                    table.stride(0), None, first.data_ptr(), count.data_ptr(),
                    args.rows, HEADS, KV_HEADS, DIM, PAGE, 0, DIM**-0.5, 0.0, None, query.data_ptr(), threads,
                )  # fmt: skip
        return (time.perf_counter() - start) * 1e3 / (args.calls * args.layers)

    # (the kernel writes its output over the query: the inputs stay in range, no allocation)
    results: dict[str, list[float]] = {mode: [] for mode in MODES}
    round_ms("team")  # warm-up
    for _ in range(args.repeats):
        for mode in MODES:
            results[mode].append(round_ms(mode))
    library.aiocb_use_openmp(*openmp)
    keys = int(count.sum())
    print(f"{args.rows} rows, {keys} keys a layer ({keys * KV_HEADS * DIM * 8 / 2**20:.1f} MiB of K and V), "
          f"{args.layers} layers, torch threads {torch.get_num_threads()}")  # fmt: skip
    print("| kernel's threads | ms per layer, attention + matrix product (median, range of rounds) |")
    print("| :--- | :--- |")
    for mode, values in results.items():
        print(f"| {mode} | {statistics.median(values):.3f} ({min(values):.3f}–{max(values):.3f}) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
