"""Stress: thousands of concurrent ``Manager.generate`` tasks, half of them cancelled at random moments.

Workload: the core benchmark's tiny Qwen3 (``bench.common.build_model``: vocab 2048, hidden 256,
4 layers, 8 heads, 4 KV heads, head_dim 32, intermediate 512, fp32, seeded,
initializer_range 0.3, EOS disabled); 2,000 prompts of 16..64 tokens (seeded), 16 new tokens
each, greedy, all submitted at once as ``manager.generate`` tasks awaited with
``asyncio.gather``; half of the tasks, drawn at random, are cancelled after a random delay
(uniform in ``[0, --cancel-window]``, through ``loop.call_later(delay, task.cancel)``).

Measured:

* completed / cancelled / failed tasks, and *hung* ones: still pending when no task has
  completed for ``--hang-deadline`` seconds;
* leaked blocks: ``total_blocks - free_blocks`` once every task is done (manager idle);
* wall time, generated tokens/s (every token the engine generated, those of requests
  cancelled later included) and delivered tokens/s (tokens of completed tasks only);
* peak RSS of the process (``bench.common.PeakRSS``: psutil sampling and the kernel's VmHWM);
* event-loop lag: a heartbeat task sleeps 1 ms in a loop; its extra delay, p50/p99/max;
  also the longest garbage-collector pause (``gc.callbacks``), a usual suspect for lag.

With ``--profile-loop`` a second, instrumented run follows: every callback the event loop
runs is timed (``asyncio.events.Handle._run``, what debug mode's ``slow_callback_duration``
measures, without debug mode's per-call tracebacks), with the loop thread's own CPU time,
and so is every loop iteration (a heartbeat is late by the callbacks of the iteration
before it, many small ones run back to back as much as one slow one); the loop thread
also runs under ``cProfile``. The slowest callbacks and iterations, grouped by where their
task resumed, and the top functions are printed. The forward pass runs on aiocb's worker
thread, which ``cProfile`` (per thread) does not see. ``--gc-freeze`` calls
``gc.freeze()`` after the warm-up, so that full collections skip the objects of torch,
transformers and the model: with it, the effect of garbage collection on the lag shows.

    python bench/stress.py --quick             # 200 tasks, smoke run
    python bench/stress.py                     # 2,000 tasks
    python bench/stress.py --json out.json     # also save the numbers
    python bench/stress.py --profile-loop      # then explain the loop lag
    python bench/stress.py --gc-freeze         # without the full collections' pauses

The markdown table is printed last.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import io
import json
import os
import pstats
import random
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/stress.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import PeakRSS, build_model, machine_info, make_workload, markdown_table
from bench.loop_watch import GCPauses, Heartbeat

#: transformers' own continuous-batching manager driven from asyncio the way ``transformers serve``
#: drives it, on this workload and machine (measured separately): the throughput target is 4x this.
HF_SERVE_TOKENS_PER_S = 154.0
TARGETS = {"rss_bytes": 2**30, "loop_lag_max_ms": 20.0, "speedup": 4.0}


@dataclass
class StressResult:
    """The numbers of one stress run."""

    tasks: int
    cancel_targets: int
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    hung: int = 0
    wrong_outputs: int = 0  # completed, but not FINISHED with exactly max_new_tokens tokens
    cancels_too_late: int = 0  # task.cancel() found the task already done
    leaked_blocks: int = 0
    total_blocks: int = 0
    idle_running: int = 0  # requests the scheduler still held once every task was done
    idle_waiting: int = 0
    wall_s: float = 0.0
    generated_tokens: int = 0  # by the engine, cancelled requests' tokens included
    delivered_tokens: int = 0  # in the outputs of completed tasks
    steps: int = 0
    preemptions: int = 0
    peak_rss_bytes: int = 0
    baseline_rss_bytes: int = 0
    rss_method: str = ""
    lag_samples: int = 0
    lag_p50_ms: float = 0.0
    lag_p99_ms: float = 0.0
    lag_max_ms: float = 0.0
    gc_max_pause_ms: float = 0.0
    gc_collections: int = 0
    gc_tracked_objects: int = 0  # objects the collector tracked before the run
    gc_frozen: bool = False
    #: the longest collections: (ms, generation, thread, objects collected)
    gc_longest: list[tuple[float, int, str, int]] = field(default_factory=list)
    other_cores: float | None = None  # CPU other processes used meanwhile, in cores
    errors: dict[str, int] = field(default_factory=dict)

    @property
    def generated_tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def delivered_tokens_per_s(self) -> float:
        return self.delivered_tokens / self.wall_s if self.wall_s > 0 else float("nan")


# --------------------------------------------------------------------------- instruments


def _cpu_contention() -> Any:
    """``bench.common.CpuContention()`` when that helper exists, else a no-op context."""
    try:
        from bench.common import CpuContention
    except ImportError:
        return None
    return CpuContention()


def _where(callback: Any) -> str:
    """Where a loop callback goes: for a task step, the coroutine and the line it resumes at."""
    owner = getattr(callback, "__self__", None)
    if isinstance(owner, asyncio.Task):
        outer = owner.get_coro()
        inner: Any = outer
        while (awaited := getattr(inner, "cr_await", None)) is not None and getattr(awaited, "cr_frame", None):
            inner = awaited  # the innermost coroutine: where the work resumes
        frame = getattr(inner, "cr_frame", None)
        name = getattr(outer, "__qualname__", repr(outer))
        if frame is None:
            return f"task {name} (first step)"
        code = frame.f_code
        return f"task {name} resuming in {code.co_qualname} ({os.path.basename(code.co_filename)}:{frame.f_lineno})"
    return f"callback {getattr(callback, '__qualname__', None) or repr(callback)}"


@dataclass
class LoopTrace:
    """What :func:`trace_loop` found: slow callbacks, and slow loop iterations broken down by origin."""

    threshold: float
    #: (wall seconds, loop-thread CPU seconds, origin) of each callback over the threshold
    callbacks: list[tuple[float, float, str]] = field(default_factory=list)
    #: (iteration's callback time, callbacks run, [(origin, count, seconds)] largest first)
    iterations: list[tuple[float, int, list[tuple[str, int, float]]]] = field(default_factory=list)


@contextmanager
def trace_loop(trace: LoopTrace) -> Iterator[None]:
    """Time every callback the (pure-Python) asyncio loop runs, and every loop iteration.

    A heartbeat is late by the time the loop spends in the callbacks of the iteration
    before it wakes up: one slow callback, or many small ones run back to back.
    """
    run_handle: Callable[[asyncio.Handle], None] = asyncio.events.Handle._run  # type: ignore[attr-defined]
    run_once: Callable[[Any], None] = asyncio.base_events.BaseEventLoop._run_once  # type: ignore[attr-defined]
    current: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])

    def flush() -> None:
        total = sum(v[1] for v in current.values())
        if total > trace.threshold and Heartbeat.running:
            parts = sorted(((k, int(v[0]), v[1]) for k, v in current.items()), key=lambda p: -p[2])
            trace.iterations.append((total, sum(p[1] for p in parts), parts))
        current.clear()

    def timed_run(handle: asyncio.Handle) -> None:
        where = _where(handle._callback)  # type: ignore[attr-defined]
        measured = Heartbeat.running  # callbacks that started before the heartbeat do not count
        start = time.perf_counter()
        cpu = time.thread_time()
        try:
            run_handle(handle)
        finally:
            took = time.perf_counter() - start
            entry = current[where]
            entry[0] += 1
            entry[1] += took
            if took > trace.threshold and measured:
                trace.callbacks.append((took, time.thread_time() - cpu, where))

    def timed_run_once(loop: Any) -> None:
        flush()
        run_once(loop)

    asyncio.events.Handle._run = timed_run  # type: ignore[attr-defined,method-assign]
    asyncio.base_events.BaseEventLoop._run_once = timed_run_once  # type: ignore[attr-defined,method-assign]
    try:
        yield
    finally:
        asyncio.events.Handle._run = run_handle  # type: ignore[attr-defined,method-assign]
        asyncio.base_events.BaseEventLoop._run_once = run_once  # type: ignore[attr-defined,method-assign]
        flush()


# --------------------------------------------------------------------------- the run


async def stress(
    model: Any,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    cancel_fraction: float,
    cancel_window: float,
    hang_deadline: float,
    seed: int,
    heartbeat_s: float,
    gc_freeze: bool = False,
) -> StressResult:
    """One stress run on a fresh manager; see the module docstring."""
    import aiocb

    rng = random.Random(seed)
    result = StressResult(tasks=len(prompts), cancel_targets=int(len(prompts) * cancel_fraction))
    async with aiocb.Manager(model) as manager:
        # Warm-up (first forward passes, lazy allocations), not timed.
        warm = make_workload(8, 16, 64, seed=seed + 1)
        await asyncio.gather(*(manager.generate(p, max_new_tokens=4) for p in warm))
        before = manager.statistics()
        result.gc_tracked_objects = len(gc.get_objects())
        if gc_freeze:
            gc.collect()
            gc.freeze()  # what is alive now (imports, model, manager) is never scanned again

        heartbeat = Heartbeat(heartbeat_s)
        loop = asyncio.get_running_loop()
        too_late = 0
        timers: list[asyncio.TimerHandle] = []

        def cancel(task: asyncio.Task[Any]) -> None:
            nonlocal too_late
            if not task.cancel():
                too_late += 1

        contention = _cpu_contention()
        # PeakRSS collects garbage on entry: the heartbeat starts after that.
        with PeakRSS(interval=0.01) as memory, GCPauses() as pauses:
            heartbeat.start()
            await asyncio.sleep(0.05)  # a few idle beats: the baseline lag
            if contention is not None:
                contention.__enter__()
            start = time.perf_counter()
            tasks = [asyncio.ensure_future(manager.generate(p, max_new_tokens=max_new_tokens)) for p in prompts]
            for index in rng.sample(range(len(tasks)), result.cancel_targets):
                timers.append(loop.call_later(rng.uniform(0.0, cancel_window), cancel, tasks[index]))
            gathered = asyncio.gather(*tasks, return_exceptions=True)
            # Hung: still pending after hang_deadline seconds without any task completing. A done
            # callback keeps the books (asyncio.wait() on 2,000 tasks would itself load the loop).
            last_done = start
            remaining = len(tasks)
            all_done = asyncio.Event()

            def on_done(_: asyncio.Future[Any]) -> None:
                nonlocal last_done, remaining
                last_done = time.perf_counter()
                remaining -= 1
                if not remaining:
                    all_done.set()

            for task in tasks:
                task.add_done_callback(on_done)
            while not all_done.is_set() and time.perf_counter() - last_done <= hang_deadline:
                with suppress(TimeoutError):
                    await asyncio.wait_for(all_done.wait(), timeout=1.0)
            wall = last_done - start
            for timer in timers:  # cancels due after every task ended come too late as well
                if timer.when() > loop.time():
                    timer.cancel()
                    too_late += 1
            if contention is not None:
                contention.__exit__(None, None, None)
            pending = [task for task in tasks if not task.done()]
            result.hung = len(pending)
            for task in pending:
                task.cancel()
            outcomes = await gathered
            await heartbeat.stop()

        for outcome in outcomes:
            if isinstance(outcome, asyncio.CancelledError):
                result.cancelled += 1
            elif isinstance(outcome, BaseException):
                result.failed += 1
                name = type(outcome).__name__
                result.errors[name] = result.errors.get(name, 0) + 1
            else:
                result.completed += 1
                result.delivered_tokens += len(outcome.generated_tokens)
                if (
                    outcome.status is not aiocb.RequestStatus.FINISHED
                    or len(outcome.generated_tokens) != max_new_tokens
                ):
                    result.wrong_outputs += 1
        result.cancelled -= result.hung  # the hung ones were cancelled by us, at the end

        await asyncio.sleep(0.01)  # let the step loop notice it is idle
        after = manager.statistics()
        result.leaked_blocks = after.total_blocks - after.free_blocks
        result.total_blocks = after.total_blocks
        result.idle_running = after.running_requests
        result.idle_waiting = after.waiting_requests
        result.generated_tokens = after.tokens_generated - before.tokens_generated
        result.steps = after.steps - before.steps
        result.preemptions = after.preemptions - before.preemptions

    result.cancels_too_late = too_late
    result.wall_s = wall
    result.peak_rss_bytes = memory.peak_bytes
    result.baseline_rss_bytes = memory.baseline_bytes
    result.rss_method = memory.method
    result.lag_samples = len(heartbeat.lags)
    result.lag_p50_ms = heartbeat.percentile_ms(0.50)
    result.lag_p99_ms = heartbeat.percentile_ms(0.99)
    result.lag_max_ms = heartbeat.percentile_ms(1.0)
    result.gc_max_pause_ms = 1000.0 * pauses.max_pause
    result.gc_collections = pauses.collections
    result.gc_frozen = gc_freeze
    if gc_freeze:
        gc.unfreeze()
    result.gc_longest = [(1000 * t, gen, thread, n) for t, gen, thread, n in pauses.longest]
    result.other_cores = getattr(contention, "other_cores", None)
    return result


def _stress_run(args: argparse.Namespace, model: Any, prompts: list[list[int]]) -> Any:
    """The stress coroutine with the command line's settings."""
    return stress(
        model,
        prompts,
        args.new_tokens,
        cancel_fraction=args.cancel_fraction,
        cancel_window=args.cancel_window,
        hang_deadline=args.hang_deadline,
        seed=args.seed,
        heartbeat_s=args.heartbeat_ms / 1000.0,
        gc_freeze=args.gc_freeze,
    )


def run_once(args: argparse.Namespace, model: Any, prompts: list[list[int]]) -> StressResult:
    """One stress run in its own event loop (uvloop with ``--uvloop``)."""
    coro = _stress_run(args, model, prompts)
    if args.uvloop:
        import uvloop

        return uvloop.run(coro)
    return asyncio.run(coro)


def profile_loop(args: argparse.Namespace, model: Any, prompts: list[list[int]], top: int = 25) -> dict[str, Any]:
    """An instrumented run: slow loop callbacks and iterations by origin, and the loop thread's cProfile."""
    trace = LoopTrace(args.slow_callback_ms / 1000.0)
    profiler = cProfile.Profile()
    with trace_loop(trace):
        profiler.enable()
        try:
            result = asyncio.run(_stress_run(args, model, prompts))
        finally:
            profiler.disable()
    out = sys.stderr
    ms = args.slow_callback_ms
    print(f"\n## instrumented run: loop lag p99 {result.lag_p99_ms:.1f} ms, max {result.lag_max_ms:.1f} ms", file=out)
    groups: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for took, cpu, where in trace.callbacks:
        groups[where].append((took, cpu))
    ranked = sorted(groups.items(), key=lambda kv: -sum(t for t, _ in kv[1]))
    print(f"\n## single callbacks over {ms:g} ms, by origin (cpu: the loop thread's own CPU time)", file=out)
    print(f"{'count':>6} {'total ms':>9} {'cpu ms':>8} {'max ms':>8}  origin", file=out)
    for where, times in ranked[:top]:
        total, cpu, worst = sum(t for t, _ in times), sum(c for _, c in times), max(t for t, _ in times)
        print(f"{len(times):>6} {1000 * total:>9.1f} {1000 * cpu:>8.1f} {1000 * worst:>8.1f}  {where}", file=out)
    slowest = sorted(trace.iterations, key=lambda it: -it[0])[:top]
    print(
        f"\n## loop iterations whose callbacks took over {ms:g} ms ({len(trace.iterations)}), slowest first", file=out
    )
    for total, count, parts in slowest:
        detail = "; ".join(f"{n} x {where} = {1000 * t:.1f} ms" for where, n, t in parts[:3])
        print(f"{1000 * total:8.1f} ms, {count} callbacks: {detail}", file=out)
    stream = io.StringIO()
    stats = pstats.Stats(profiler, stream=stream)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats("aiocb", top)
    print("\n## cProfile of the loop thread: by own time, then aiocb's functions by cumulative time", file=out)
    print(stream.getvalue(), file=out)
    return {
        "profiled_lag_max_ms": result.lag_max_ms,
        "profiled_lag_p99_ms": result.lag_p99_ms,
        "slow_callbacks": [
            {
                "origin": where,
                "count": len(times),
                "total_ms": 1000 * sum(t for t, _ in times),
                "cpu_ms": 1000 * sum(c for _, c in times),
                "max_ms": 1000 * max(t for t, _ in times),
            }
            for where, times in ranked[:top]
        ],
        "slow_iterations": [
            {"total_ms": 1000 * total, "callbacks": count, "top": [[w, n, 1000 * t] for w, n, t in parts[:5]]}
            for total, count, parts in slowest
        ],
    }


# --------------------------------------------------------------------------- report


def table(result: StressResult) -> str:
    """The markdown summary: metric, value, target."""
    mib = 2**20
    speedup = result.generated_tokens_per_s / HF_SERVE_TOKENS_PER_S

    def ok(flag: bool) -> str:
        return "yes" if flag else "**no**"

    healthy = not result.failed and not result.wrong_outputs
    fast = speedup >= TARGETS["speedup"]
    rss = f"{result.peak_rss_bytes / mib:.0f} MiB ({result.baseline_rss_bytes / mib:.0f} MiB)"
    lag = f"{result.lag_p50_ms:.2f} / {result.lag_p99_ms:.2f} / {result.lag_max_ms:.1f} ms"
    other = "n/a" if result.other_cores is None else f"{result.other_cores:.2f} cores"
    rows = [
        ["tasks (cancel targets)", f"{result.tasks} ({result.cancel_targets})", "", ""],
        ["completed", f"{result.completed}", "", ""],
        ["cancelled (cancel() too late)", f"{result.cancelled} ({result.cancels_too_late})", "", ""],
        ["failed / wrong outputs", f"{result.failed} / {result.wrong_outputs}", "0 / 0", ok(healthy)],
        ["hung", f"{result.hung}", "0", ok(result.hung == 0)],
        ["leaked blocks", f"{result.leaked_blocks} of {result.total_blocks}", "0", ok(result.leaked_blocks == 0)],
        ["wall time", f"{result.wall_s:.2f} s", "", ""],
        ["generated tokens/s", f"{result.generated_tokens_per_s:.0f}", f">= {4 * HF_SERVE_TOKENS_PER_S:.0f}", ok(fast)],
        ["delivered tokens/s (completed only)", f"{result.delivered_tokens_per_s:.0f}", "", ""],
        ["vs transformers serve-style (154 tok/s)", f"{speedup:.1f}x", f">= {TARGETS['speedup']:g}x", ok(fast)],
        ["peak RSS (baseline)", rss, "< 1024 MiB", ok(result.peak_rss_bytes < TARGETS["rss_bytes"])],
        ["loop lag p50 / p99 / max", lag, "max < 20 ms", ok(result.lag_max_ms < TARGETS["loop_lag_max_ms"])],
        ["heartbeat samples", f"{result.lag_samples}", "", ""],
        ["longest GC pause (collections)", f"{result.gc_max_pause_ms:.1f} ms ({result.gc_collections})", "", ""],
        ["objects tracked by the GC before the run", f"{result.gc_tracked_objects:,}", "", ""],
        ["gc.freeze() before the run", "yes" if result.gc_frozen else "no", "", ""],
        ["steps / preemptions", f"{result.steps} / {result.preemptions}", "", ""],
        ["other processes' CPU", other, "", ""],
    ]
    return markdown_table(["metric", "value", "target", "met"], rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="200 tasks (a smoke run)")
    parser.add_argument("--tasks", type=int, default=None, help="number of generate tasks (default 2000, 200 quick)")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=64)
    parser.add_argument("--cancel-fraction", type=float, default=0.5)
    parser.add_argument(
        "--cancel-window", type=float, default=None, help="cancel delays are uniform in [0, this] s (20, quick 6)"
    )
    parser.add_argument("--hang-deadline", type=float, default=60.0, help="seconds without progress that mean hung")
    parser.add_argument("--heartbeat-ms", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--uvloop", action="store_true", help="run on uvloop instead of asyncio's loop")
    parser.add_argument(
        "--gc-freeze", action="store_true", help="gc.freeze() after the warm-up: full collections skip older objects"
    )
    parser.add_argument("--profile-loop", action="store_true", help="then an instrumented run explaining the lag")
    parser.add_argument("--slow-callback-ms", type=float, default=5.0, help="--profile-loop's threshold")
    parser.add_argument("--json", type=Path, default=None, help="write the results to this file")
    args = parser.parse_args(argv)
    if args.tasks is None:
        args.tasks = 200 if args.quick else 2000
    if args.cancel_window is None:
        args.cancel_window = 6.0 if args.quick else 20.0

    info = machine_info()
    print(info.describe(), file=sys.stderr)
    model = build_model(seed=args.seed)
    prompts = make_workload(args.tasks, args.min_len, args.max_len, seed=args.seed)
    print(
        f"stress: {args.tasks} generate tasks, prompts {args.min_len}..{args.max_len} tokens, "
        f"{args.new_tokens} new tokens, {args.cancel_fraction:.0%} cancelled within {args.cancel_window:g} s, "
        f"loop {'uvloop' if args.uvloop else 'asyncio'}",
        file=sys.stderr,
    )
    result = run_once(args, model, prompts)
    report: dict[str, Any] = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": info.as_dict(),
        "result": asdict(result)
        | {
            "generated_tokens_per_s": result.generated_tokens_per_s,
            "delivered_tokens_per_s": result.delivered_tokens_per_s,
            "speedup_vs_hf_serve": result.generated_tokens_per_s / HF_SERVE_TOKENS_PER_S,
        },
    }
    if args.profile_loop:
        report["profile"] = profile_loop(args, model, prompts)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {args.json}", file=sys.stderr)
    for pause_ms, generation, thread, collected in result.gc_longest:
        print(
            f"GC pause {pause_ms:.1f} ms: generation {generation}, in thread {thread}, {collected} objects collected",
            file=sys.stderr,
        )
    print(table(result))
    healthy = result.hung == 0 and result.leaked_blocks == 0 and not result.failed and not result.wrong_outputs
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
