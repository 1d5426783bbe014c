"""Host overhead per step: aiocb against static ``generate`` on a near-zero-compute model.

The model is a seeded Qwen3 with hidden size 16 (one attention head of dim 16, intermediate
32, fp32, CPU, no EOS) and 1 or 28 layers, so that a forward pass costs almost nothing
beyond the embedding, the LM head over the vocabulary and the per-layer dispatch. Whatever
aiocb's step takes beyond static ``model.generate``'s on the same batch is then the host
work of continuous batching: scheduling, input preparation, sampling, bookkeeping and
delivery.

For every (layers, vocab, batch) cell, ``batch`` 16-token prompts each generate the same
number of new tokens (every row runs to the full length: there is no EOS) through:

* ``generate``  - static ``model.generate``, greedy, the whole batch at once (no padding:
                  all prompts have 16 tokens), transformers' default dynamic cache;
* ``greedy``    - ``Manager.generate_batch``, greedy;
* ``sampled``   - ``Manager.generate_batch`` at temperature 0.8, top-k 50, top-p 0.9
                  (seeded through ``ContinuousBatchingConfig.seed``);
* ``streamed``  - every request added with ``Manager.add_request`` and read to its end
                  through ``async for chunk in manager.stream(request_id)``, greedy;
* ``lag``       - ``greedy`` again with a 1 ms heartbeat on the same event loop, which
                  records how late it wakes (at the batches of ``--lag-batches`` only);
* ``forward``   - (only when asked for in ``--modes``) the bare model in a loop: one
                  forward pass per token over a dynamic cache, the last position's logits
                  only, argmax. The compute floor of both engines: at a large vocabulary
                  ``generate``'s own per-step work over the logits (it copies them to a
                  fresh fp32 tensor each step) can make it slower than aiocb, and then
                  only the floor says what aiocb's host work costs.

aiocb runs on a deep copy of the model in one warm ``Manager`` per cell, sized so that every
row fits in one batch (``max_requests_per_batch`` = batch, ``max_batch_tokens`` = batch x 16,
cache blocks for every row's full length above the scheduler's safety margin): a copy,
because a running manager routes its model's attention through the paged cache, which
static ``generate`` must not use. Each mode is warmed up once at the full batch, then the
modes run in turn (generate, greedy, sampled, streamed, lag, generate, greedy, ...) for
``--repeats`` rounds, so that all of them see the same phases of a noisy machine.

"ms per step" is the wall time of a whole run divided by the number of new tokens, in
both engines: the prefill forward pass (which yields the first token) and every decode
step are included, and the prompt work is the same in both. aiocb's own step count is
reported beside it. Above 64 rows it is a step or two more than the new tokens:
``generate_batch`` and ``add_request`` hand the loop back every 64 requests, so the first
step may start with the first 64 rows and the rest join in the next. Host overhead =
aiocb greedy's ms per step minus ``generate``'s, taken per round (adjacent runs) and then
summarised; the ratios likewise. Every cell prints the median and the range over the
rounds.

Targets (from the issue, on this machine): at batch 256, host overhead at most 1.0 ms per
step, sampled at most 1.3x greedy, streamed at most 1.2x ``generate``; at batch 1,024,
host overhead at most 3 ms per step and heartbeat lag p99 at most 2 ms.

    python bench/overhead.py                      # 1 and 28 layers, batch 64/256/1024, vocab 4096/151936
    python bench/overhead.py --quick              # 1 layer, batch 256/1024, 2 rounds, fewer tokens
    python bench/overhead.py --layers 1 --batches 256 --vocabs 4096 --modes generate,greedy
    python bench/overhead.py --json overhead.json # also write every run's numbers
    python bench/overhead.py --loop uvloop        # aiocb on uvloop (what `aiocb serve` runs on)
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import math
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/overhead.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import aiocb
from bench.common import CpuContention, build_model, machine_info, make_workload, markdown_table
from bench.loop_watch import Heartbeat

MODES = ("generate", "greedy", "sampled", "streamed", "lag", "forward")
DEFAULT_MODES = MODES[:-1]
PROMPT_LEN = 16
#: the near-zero-compute shape; the layers and the vocabulary vary per cell
TINY_SHAPE: dict[str, Any] = {
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "max_position_embeddings": 4096,
}
#: vocabularies at least this large use ``--large-vocab-new-tokens``: their steps are slower
LARGE_VOCAB = 32_768
SAMPLED = aiocb.SamplingParams(do_sample=True, temperature=0.8, top_k=50, top_p=0.9)
HEARTBEAT_S = 0.001
#: the scheduler's default (fifo) safety margin: the cache is sized above it
SAFETY_MARGIN = 0.15
#: above this many cores used by other processes during a run, the report warns
BUSY_CORES = 0.25
TARGET_BATCH = 256
TARGET_BIG_BATCH = 1024
TARGET_OVERHEAD_MS = 1.0
TARGET_BIG_OVERHEAD_MS = 3.0
TARGET_SAMPLED_RATIO = 1.3
TARGET_STREAMED_RATIO = 1.2
TARGET_LAG_P99_MS = 2.0


@dataclass
class Run:
    """One timed run of one mode."""

    mode: str
    round: int
    wall_s: float
    new_tokens: int
    #: aiocb steps during the run (0 for generate and forward)
    steps: int
    other_cores: float
    #: streamed: outputs received per request (mean); fewer than the new tokens when merged
    chunks_per_request: float | None = None
    #: lag: the heartbeat's lateness in ms
    lag_p50_ms: float | None = None
    lag_p99_ms: float | None = None
    lag_max_ms: float | None = None
    beats: int | None = None

    @property
    def ms_per_step(self) -> float:
        return 1e3 * self.wall_s / self.new_tokens


@dataclass
class Cell:
    layers: int
    vocab: int
    batch: int
    new_tokens: int
    num_blocks: int
    runs: list[Run] = field(default_factory=list)

    def of(self, mode: str) -> list[Run]:
        return sorted((r for r in self.runs if r.mode == mode), key=lambda r: r.round)

    def per_round(self, a: str, b: str, combine: Callable[[float, float], float]) -> list[float]:
        """``combine(a's ms/step, b's ms/step)`` for every round that ran both modes."""
        bs = {r.round: r for r in self.of(b)}
        return [combine(r.ms_per_step, bs[r.round].ms_per_step) for r in self.of(a) if r.round in bs]

    def overhead(self) -> list[float]:
        return self.per_round("greedy", "generate", lambda x, y: x - y)

    def sampled_ratio(self) -> list[float]:
        return self.per_round("sampled", "greedy", lambda x, y: x / y)

    def streamed_ratio(self) -> list[float]:
        return self.per_round("streamed", "generate", lambda x, y: x / y)


# --------------------------------------------------------------------------- workload


def tiny_model(layers: int, vocab: int, seed: int) -> Any:
    return build_model(seed=seed, vocab_size=vocab, num_hidden_layers=layers, **TINY_SHAPE)


def cache_blocks(batch: int, new_tokens: int, page_size: int) -> int:
    """Blocks for every row at its full length, with the safety margin still free."""
    needed = batch * math.ceil((PROMPT_LEN + new_tokens) / page_size)
    return math.ceil(needed / (1.0 - SAFETY_MARGIN)) + 8


def check_lengths(outputs: Sequence[Sequence[int]], new_tokens: int, mode: str) -> None:
    bad = [i for i, tokens in enumerate(outputs) if len(tokens) != new_tokens]
    if bad:
        raise RuntimeError(f"{mode}: {len(bad)} rows did not make {new_tokens} tokens (first: row {bad[0]})")


# --------------------------------------------------------------------------- the modes


def run_generate(model: Any, input_ids: torch.Tensor, new_tokens: int) -> None:
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    check_lengths(out[:, input_ids.shape[1] :].tolist(), new_tokens, "generate")


def run_forward(model: Any, input_ids: torch.Tensor, new_tokens: int) -> None:
    from transformers import DynamicCache

    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        tokens = input_ids
        generated = []
        for _ in range(new_tokens):
            logits = model(tokens, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            tokens = logits[:, -1].argmax(-1, keepdim=True)
            generated.append(tokens)
    check_lengths(torch.cat(generated, dim=1).tolist(), new_tokens, "forward")


async def run_batch(
    manager: aiocb.Manager, prompts: list[list[int]], new_tokens: int, params: aiocb.SamplingParams | None, mode: str
) -> None:
    outputs = await manager.generate_batch(prompts, max_new_tokens=new_tokens, sampling_params=params)
    check_lengths([o.generated_tokens for o in outputs.values()], new_tokens, mode)


async def run_streamed(manager: aiocb.Manager, prompts: list[list[int]], new_tokens: int) -> float:
    """Stream every request to its end; returns the mean number of outputs per request."""

    async def one(prompt: list[int]) -> tuple[list[int], int]:
        request_id = await manager.add_request(prompt, max_new_tokens=new_tokens)
        tokens: list[int] = []
        chunks = 0
        async for chunk in manager.stream(request_id):
            tokens = chunk.generated_tokens
            chunks += 1
        return tokens, chunks

    results = await asyncio.gather(*(one(p) for p in prompts))
    check_lengths([tokens for tokens, _ in results], new_tokens, "streamed")
    return sum(chunks for _, chunks in results) / len(results)


# --------------------------------------------------------------------------- one cell


async def measure_cell(
    layers: int,
    vocab: int,
    batch: int,
    new_tokens: int,
    modes: Sequence[str],
    repeats: int,
    page_size: int,
    seed: int,
) -> Cell:
    static_model = tiny_model(layers, vocab, seed)
    engine_model = copy.deepcopy(static_model)
    prompts = make_workload(batch, PROMPT_LEN, PROMPT_LEN, vocab_size=vocab, seed=seed)
    input_ids = torch.tensor(prompts, dtype=torch.long)
    num_blocks = cache_blocks(batch, new_tokens, page_size)
    config = aiocb.ContinuousBatchingConfig(
        page_size=page_size,
        num_blocks=num_blocks,
        max_requests_per_batch=batch,
        max_batch_tokens=batch * PROMPT_LEN,
        seed=seed,
    )
    cell = Cell(layers, vocab, batch, new_tokens, num_blocks)
    async with aiocb.Manager(engine_model, continuous_batching_config=config, num_requests_hint=batch) as manager:

        async def once(mode: str, tokens: int, round_: int) -> Run:
            steps_before = manager.statistics().steps
            extra: dict[str, Any] = {}
            # Static generate (and the bare loop) blocks the event loop while it runs; the
            # manager is idle meanwhile.
            with CpuContention() as cpu:
                started = time.perf_counter()
                if mode == "generate":
                    run_generate(static_model, input_ids, tokens)
                elif mode == "forward":
                    run_forward(static_model, input_ids, tokens)
                elif mode == "greedy":
                    await run_batch(manager, prompts, tokens, None, mode)
                elif mode == "sampled":
                    await run_batch(manager, prompts, tokens, SAMPLED, mode)
                elif mode == "streamed":
                    extra["chunks_per_request"] = await run_streamed(manager, prompts, tokens)
                else:  # lag
                    async with Heartbeat(HEARTBEAT_S) as beat:
                        await run_batch(manager, prompts, tokens, None, mode)
                    extra.update(
                        lag_p50_ms=beat.percentile_ms(0.5),
                        lag_p99_ms=beat.percentile_ms(0.99),
                        lag_max_ms=beat.percentile_ms(1.0),
                        beats=len(beat.lags),
                    )
                wall = time.perf_counter() - started
            return Run(mode, round_, wall, tokens, manager.statistics().steps - steps_before, cpu.other_cores, **extra)

        # First calls allocate (caches, sampler buffers, the dynamic cache's growth): one
        # discarded run of each mode, of two tokens (the prefill and one decode step).
        for mode in modes:
            await once(mode, min(2, new_tokens), -1)
        for round_ in range(repeats):
            for mode in modes:
                run = await once(mode, new_tokens, round_)
                cell.runs.append(run)
                extra_note = ""
                if run.lag_p99_ms is not None:
                    extra_note = f", lag p99 {run.lag_p99_ms:.2f} ms"
                if run.chunks_per_request is not None:
                    extra_note = f", {run.chunks_per_request:.1f} outputs per request"
                print(
                    f"  round {round_ + 1}/{repeats} {mode:9s} {run.wall_s:7.2f} s  {run.ms_per_step:8.2f} ms/step"
                    f"  steps {run.steps:3d}  other load {run.other_cores:.2f}{extra_note}",
                    file=sys.stderr,
                )
        stats = manager.statistics()
        if stats.preemptions:
            print(f"  WARNING: {stats.preemptions} preemptions: the cache was too small", file=sys.stderr)
    return cell


# --------------------------------------------------------------------------- report


def spread(values: Sequence[float], fmt: str = "{:.2f}", suffix: str = "") -> str:
    """``median (min–max)``, or the single value, or ``n/a``."""
    if not values:
        return "n/a"
    med = fmt.format(statistics.median(values)) + suffix
    if len(values) == 1:
        return med
    return f"{med} ({fmt.format(min(values))}–{fmt.format(max(values))})"


def ms(cell: Cell, mode: str) -> list[float]:
    return [r.ms_per_step for r in cell.of(mode)]


def per_row_us(cell: Cell, mode: str) -> list[float]:
    return [1e3 * r.ms_per_step / cell.batch for r in cell.of(mode)]


def main_table(cells: Sequence[Cell]) -> str:
    headers = [
        "layers",
        "vocab",
        "batch",
        "new tokens",
        "generate ms/step",
        "greedy ms/step",
        "host overhead ms/step",
        "sampled ms/step",
        "sampled / greedy",
        "streamed ms/step",
        "streamed / generate",
        "aiocb steps",
        "other load (max cores)",
    ]
    rows = []
    for c in cells:
        steps = sorted({r.steps for r in c.runs if r.mode not in ("generate", "forward")})
        other = max((r.other_cores for r in c.runs), default=0.0)
        rows.append(
            [
                str(c.layers),
                f"{c.vocab:,}",
                f"{c.batch:,}",
                str(c.new_tokens),
                spread(ms(c, "generate")),
                spread(ms(c, "greedy")),
                spread(c.overhead()),
                spread(ms(c, "sampled")),
                spread(c.sampled_ratio(), suffix="x"),
                spread(ms(c, "streamed")),
                spread(c.streamed_ratio(), suffix="x"),
                "/".join(map(str, steps)) or "n/a",
                f"{other:.2f}",
            ]
        )
    return markdown_table(headers, rows)


def per_token_table(cells: Sequence[Cell]) -> str:
    headers = ["layers", "vocab", "batch", "generate", "greedy", "sampled", "streamed", "host overhead"]
    rows = [
        [
            str(c.layers),
            f"{c.vocab:,}",
            f"{c.batch:,}",
            spread(per_row_us(c, "generate"), "{:.1f}"),
            spread(per_row_us(c, "greedy"), "{:.1f}"),
            spread(per_row_us(c, "sampled"), "{:.1f}"),
            spread(per_row_us(c, "streamed"), "{:.1f}"),
            spread([1e3 * v / c.batch for v in c.overhead()], "{:.2f}"),
        ]
        for c in cells
    ]
    return markdown_table(headers, rows)


def lag_table(cells: Sequence[Cell]) -> str:
    headers = ["layers", "vocab", "batch", "lag p50 ms", "lag p99 ms", "lag max ms", "beats", "ms/step with heartbeat"]
    rows = []
    for c in cells:
        runs = c.of("lag")
        if not runs:
            continue
        rows.append(
            [
                str(c.layers),
                f"{c.vocab:,}",
                f"{c.batch:,}",
                spread([r.lag_p50_ms for r in runs if r.lag_p50_ms is not None]),
                spread([r.lag_p99_ms for r in runs if r.lag_p99_ms is not None]),
                spread([r.lag_max_ms for r in runs if r.lag_max_ms is not None], "{:.1f}"),
                spread([float(r.beats) for r in runs if r.beats is not None], "{:.0f}"),
                spread(ms(c, "lag")),
            ]
        )
    return markdown_table(headers, rows) if rows else ""


def floor_table(cells: Sequence[Cell]) -> str:
    headers = ["layers", "vocab", "batch", "forward ms/step", "generate - forward", "greedy - forward"]
    rows = [
        [
            str(c.layers),
            f"{c.vocab:,}",
            f"{c.batch:,}",
            spread(ms(c, "forward")),
            spread(c.per_round("generate", "forward", lambda x, y: x - y)),
            spread(c.per_round("greedy", "forward", lambda x, y: x - y)),
        ]
        for c in cells
        if c.of("forward")
    ]
    return markdown_table(headers, rows) if rows else ""


def verdict(values: Sequence[float], limit: float) -> str:
    """PASS/FAIL on the median; says so when the range crosses the limit."""
    med = statistics.median(values)
    mark = "PASS" if med <= limit else "FAIL"
    if min(values) <= limit < max(values):
        mark += " (range crosses the limit)"
    return mark


def targets(cells: Sequence[Cell]) -> list[str]:
    lines: list[str] = []

    def check(cell: Cell, what: str, values: Sequence[float], limit: float, unit: str) -> None:
        where = f"{cell.layers} layer{'s' if cell.layers != 1 else ''}, vocab {cell.vocab:,}, batch {cell.batch:,}"
        if not values:
            lines.append(f"- {where}: {what} <= {limit:g}{unit}: not measured")
            return
        note = ""
        if what == "host overhead" and statistics.median(values) < 0:
            note = " (generate's step is the slower one, so this says nothing of aiocb's host work; see `forward`)"
        lines.append(
            f"- {where}: {what} {spread(values, suffix=unit)} <= {limit:g}{unit}: {verdict(values, limit)}{note}"
        )

    for c in cells:
        if c.batch == TARGET_BATCH:
            check(c, "host overhead", c.overhead(), TARGET_OVERHEAD_MS, " ms")
            check(c, "sampled / greedy", c.sampled_ratio(), TARGET_SAMPLED_RATIO, "x")
            check(c, "streamed / generate", c.streamed_ratio(), TARGET_STREAMED_RATIO, "x")
        if c.batch == TARGET_BIG_BATCH:
            check(c, "host overhead", c.overhead(), TARGET_BIG_OVERHEAD_MS, " ms")
            lag = [r.lag_p99_ms for r in c.of("lag") if r.lag_p99_ms is not None]
            check(c, "heartbeat lag p99", lag, TARGET_LAG_P99_MS, " ms")
    return lines


# --------------------------------------------------------------------------- main


def int_list(text: str) -> list[int]:
    return [int(x.replace("_", "")) for x in text.split(",") if x.strip()]


def run_loop(coroutine: Coroutine[Any, Any, Cell], loop: str) -> Cell:
    """Run ``coroutine`` to its end on a new event loop of the kind asked for."""
    if loop == "uvloop":
        import uvloop

        return uvloop.run(coroutine)
    return asyncio.run(coroutine)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 layer, batch 256 and 1024, 2 rounds, fewer tokens")
    parser.add_argument("--layers", type=int_list, default=None, help="comma-separated layer counts [1,28]")
    parser.add_argument("--batches", type=int_list, default=None, help="comma-separated batch sizes [64,256,1024]")
    parser.add_argument("--vocabs", type=int_list, default=None, help="comma-separated vocab sizes [4096,151936]")
    parser.add_argument(
        "--new-tokens", type=int, default=None, help="new tokens per row below the large vocab [64; quick 32]"
    )
    parser.add_argument(
        "--large-vocab-new-tokens",
        type=int,
        default=None,
        help=f"new tokens per row at vocab >= {LARGE_VOCAB:,} (slower steps) [8]",
    )
    parser.add_argument("--repeats", type=int, default=None, help="rounds of all modes per cell [3; quick 2]")
    parser.add_argument(
        "--modes",
        default=",".join(DEFAULT_MODES),
        help=f"comma-separated subset of {','.join(MODES)} [all but forward]",
    )
    parser.add_argument(
        "--lag-batches",
        type=int_list,
        default=[TARGET_BIG_BATCH],
        help=f"batches whose cells also run the heartbeat (lag) mode; empty: none [{TARGET_BIG_BATCH}]",
    )
    default_page = aiocb.ContinuousBatchingConfig().page_size
    parser.add_argument("--page-size", type=int, default=default_page, help=f"aiocb page size [{default_page}]")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights, the prompts and the sampling [0]")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's own)")
    parser.add_argument(
        "--loop",
        choices=("asyncio", "uvloop"),
        default="asyncio",
        help="the event loop aiocb runs on: asyncio's own, or uvloop (what `aiocb serve` uses) [asyncio]",
    )
    parser.add_argument("--json", metavar="PATH", help="write every run's numbers (and machine info) as JSON")
    args = parser.parse_args(argv)

    quick = args.quick
    layers = args.layers or ([1] if quick else [1, 28])
    batches = args.batches or ([256, 1024] if quick else [64, 256, 1024])
    vocabs = args.vocabs or [4096, 151_936]
    new_tokens = args.new_tokens or (32 if quick else 64)
    large_new_tokens = args.large_vocab_new_tokens or 8
    repeats = args.repeats or (2 if quick else 3)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown mode(s) {unknown}; choose from {list(MODES)}")
    if args.threads:
        torch.set_num_threads(args.threads)

    info = machine_info()
    command = "python " + shlex.join(["bench/overhead.py", *(sys.argv[1:] if argv is None else argv)])
    print(info.describe(), file=sys.stderr)
    started = time.perf_counter()
    cells: list[Cell] = []
    for n_layers in layers:
        for vocab in vocabs:
            tokens = large_new_tokens if vocab >= LARGE_VOCAB else new_tokens
            for batch in batches:
                cell_modes = [m for m in modes if m != "lag" or batch in args.lag_batches]
                print(
                    f"[{n_layers} layers, vocab {vocab}, batch {batch}, {tokens} new tokens] {', '.join(cell_modes)}",
                    file=sys.stderr,
                )
                cell = run_loop(
                    measure_cell(n_layers, vocab, batch, tokens, cell_modes, repeats, args.page_size, args.seed),
                    args.loop,
                )
                cells.append(cell)
    total_s = time.perf_counter() - started

    print(f"## aiocb host overhead per step (`{command}`)\n")
    print(info.describe())
    print(
        f"model: Qwen3, hidden 16, 1 head of dim 16, intermediate 32, fp32, seed {args.seed}, no EOS; "
        f"{PROMPT_LEN}-token prompts; aiocb page size {args.page_size}; {repeats} rounds; {args.loop} event loop; "
        f"total {total_s:.0f} s\n"
    )
    print("ms per step = run wall / new tokens (prefill + every decode step); median (min–max) over the rounds\n")
    print(main_table(cells))
    print("\nper generated token of one row (µs = ms per step / batch x 1000)\n")
    print(per_token_table(cells))
    floor = floor_table(cells)
    if floor:
        print("\nthe bare forward loop (compute floor), and each engine's ms per step above it\n")
        print(floor)
    lags = lag_table(cells)
    if lags:
        print(f"\nevent-loop lag: a {HEARTBEAT_S * 1e3:g} ms heartbeat during a greedy run\n")
        print(lags)
    print("\ntargets (median over the rounds):\n")
    print("\n".join(targets(cells)) or "- no cell at batch 256 or 1,024")
    busy = [c for c in cells if any(r.other_cores > BUSY_CORES for r in c.runs)]
    if busy:
        print(
            f"\nWARNING: other processes used more than {BUSY_CORES} cores during {len(busy)} cell(s): "
            "those timings and ratios are unreliable"
        )
    if args.json:
        payload = {
            "benchmark": "overhead",
            "command": command,
            "machine": info.as_dict(),
            "settings": {
                "model": {"architecture": "Qwen3ForCausalLM", "dtype": "float32", "seed": args.seed, **TINY_SHAPE},
                "prompt_len": PROMPT_LEN,
                "page_size": args.page_size,
                "repeats": repeats,
                "modes": modes,
                "sampled": {"temperature": 0.8, "top_k": 50, "top_p": 0.9},
                "heartbeat_s": HEARTBEAT_S,
                "event_loop": args.loop,
            },
            "total_s": total_s,
            "cells": [
                {
                    **{k: v for k, v in asdict(c).items() if k != "runs"},
                    "runs": [{**asdict(r), "ms_per_step": r.ms_per_step} for r in c.runs],
                    "host_overhead_ms": c.overhead(),
                    "sampled_over_greedy": c.sampled_ratio(),
                    "streamed_over_generate": c.streamed_ratio(),
                }
                for c in cells
            ],
        }
        Path(args.json).write_text(json.dumps(payload, indent=2))
        print(f"\nwrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
