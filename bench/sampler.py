"""The sampler alone: the CPU's ``sample()`` against the whole-vocabulary pick.

Random logits (normal, times ``--scale``) at two vocabulary sizes, every row sampled with
top-k 50 + top-p 0.9, with top-p 0.9 alone, and with the temperature alone; and top-k 50
over rows a grammar masked down to three tokens (the rest -inf), as a constrained
request's rows are. The
whole-vocabulary draw (``draw_full``: a sort for top-k and top-p) is what a GPU runs
without Triton; ``sample()`` on a CPU takes a top-k or top-p row's largest logits where
they suffice, and the whole-vocabulary draw for the rest and for rows without those
filters; where its C kernels are built (:mod:`aiocb.runner.native`, the default;
``AIOCB_NATIVE=0`` for the torch ops) they draw every row of these. Both give the same
tokens (checked). Random logits are flatter than a language model's, so the torch ops'
top-p rows without top-k mostly fall back to the whole vocabulary.
A greedy step's pick is timed beside them: torch's ``argmax`` and the chunked
:func:`~aiocb.runner.argmax.argmax_rows` that greedy rows take on a CPU (same indices,
checked).
Then the rarer filters (top-h, typical-p, epsilon and eta cutoffs) at the larger
vocabulary: 64 rows of top-k 50 and top-p 0.9, none, one or eight of them with one of
those filters, drawn over the top-k's candidates (the CPU's way) and over the sorted
vocabulary (the same tokens, checked).

    python bench/sampler.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/sampler.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from aiocb.runner import sampler
from aiocb.runner.argmax import argmax_rows
from aiocb.runner.draw import draw_full
from aiocb.runner.sampler import SamplingTensors, sample


@dataclass
class _Row:
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 0.9
    min_p: float = 0.0
    seed: int = 0
    offset: int = 0
    logprobs: bool = False
    top_logprobs: int = 0
    filters: tuple[float, float, float, float] | None = None


def _full(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    filtered = params.any_top_k or params.any_top_p
    top_k, top_p = (params.top_k, params.top_p) if filtered else (None, None)
    return draw_full(logits / params.temperature[:, None], params.seed, params.offset, top_k, top_p, params.min_p)


def _ms(run: Callable[..., object], repeats: int, *args: object) -> float:
    run(*args)
    started = time.perf_counter()
    for _ in range(repeats):
        run(*args)
    return (time.perf_counter() - started) / repeats * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scale", type=float, default=3.0)
    args = parser.parse_args(argv)
    print("| vocab | rows | filters | whole vocabulary ms | sample() ms | torch argmax ms | chunked argmax ms |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    kinds: dict[str, dict[str, float]] = {
        "top-k 50, top-p 0.9": {},
        "top-p 0.9": {"top_k": 0},
        "temperature only": {"top_k": 0, "top_p": 1.0},
        "top-k 50, 3 tokens unmasked": {"top_p": 1.0},
    }
    for vocab, rows in ((4096, 256), (151_936, 64)):
        generator = torch.Generator().manual_seed(vocab)
        random_logits = torch.randn(rows, vocab, generator=generator) * args.scale
        assert torch.equal(argmax_rows(random_logits), random_logits.argmax(-1))
        masked = torch.full_like(random_logits, float("-inf"))
        kept = torch.randint(0, vocab, (rows, 3), generator=generator)
        masked.scatter_(1, kept, random_logits.gather(1, kept))
        for name, fields in kinds.items():
            logits = masked if "unmasked" in name else random_logits
            params = SamplingTensors.from_rows([_Row(seed=i, **fields) for i in range(rows)], logits.device)  # type: ignore[arg-type]
            assert torch.equal(_full(logits, params), sample(logits, params).tokens)
            full = _ms(_full, args.repeats, logits, params)
            sampled = _ms(sample, args.repeats, logits, params)
            argmax = _ms(torch.argmax, args.repeats, logits, -1)
            chunked = _ms(argmax_rows, args.repeats, logits)
            print(f"| {vocab} | {rows} | {name} | {full:.1f} | {sampled:.1f} | {argmax:.2f} | {chunked:.2f} |")
    _rare_filters(args.repeats, args.scale)
    return 0


def _rare_filters(repeats: int, scale: float) -> None:
    """``sample()`` with rows of the rarer filters among 64, over candidates and not."""
    print()
    print("| vocab | rows | rows with a rarer filter | over candidates ms | over the sorted vocabulary ms |")
    print("|---:|---:|---|---:|---:|")
    vocab, rows = 151_936, 64
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(1)) * scale
    kinds: dict[str, tuple[int, tuple[float, float, float, float] | None]] = {
        "none": (0, None),
        "1 epsilon 3e-4": (1, (0.0, 1.0, 3e-4, 0.0)),
        "1 typical 0.9": (1, (0.0, 0.9, 0.0, 0.0)),
        "1 top-h 0.5": (1, (0.5, 1.0, 0.0, 0.0)),
        "8 eta 2e-3": (8, (0.0, 1.0, 0.0, 2e-3)),
    }
    for name, (count, filters) in kinds.items():
        rows_ = [_Row(seed=i, filters=filters if i < count else None) for i in range(rows)]
        params = SamplingTensors.from_rows(rows_, logits.device)  # type: ignore[arg-type]
        fast = _ms(sample, repeats, logits, params)
        tokens = sample(logits, params).tokens
        with _without_candidates():
            slow = _ms(sample, repeats, logits, params)
            assert torch.equal(sample(logits, params).tokens, tokens)
        print(f"| {vocab} | {rows} | {name} | {fast:.1f} | {slow:.1f} |")


@contextmanager
def _without_candidates() -> Iterator[None]:
    """``sample()`` drawing rows of the rarer filters over the sorted vocabulary."""
    original = sampler.candidates
    sampler.candidates = lambda *args: None
    try:
        yield
    finally:
        sampler.candidates = original


if __name__ == "__main__":
    sys.exit(main())
