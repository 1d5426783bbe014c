"""Where aiocb's time goes on the throughput workload (the aiocb engine only).

    python bench/profile_aiocb.py                  # cProfile of both threads + step timings
    python bench/profile_aiocb.py --torch          # also the torch profiler's op table
    python bench/profile_aiocb.py --quick

aiocb runs the forward pass on a worker thread (``ModelRunner.execute``) while the event
loop thread schedules and delivers. ``cProfile`` only sees the thread that enables it, so
this script profiles the loop thread as a whole and, separately, every ``execute`` call on
the worker thread, and prints the two reports.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import build_model, make_workload


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--torch", action="store_true", help="also run the torch profiler (separate run)")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args(argv)

    import aiocb
    from aiocb.runner import attention, model_runner

    n, new = (8, 8) if args.quick else (64, 64)
    model = build_model()
    prompts = make_workload(n)
    run = lambda: aiocb.generate_batch(  # noqa: E731
        model, prompts, max_new_tokens=new, continuous_batching_config=aiocb.ContinuousBatchingConfig()
    )
    aiocb.generate_batch(model, make_workload(4, 16, 64, seed=1), max_new_tokens=8)  # warmup

    # Per-phase wall time of the worker's execute(), and a worker-thread cProfile.
    worker_prof = cProfile.Profile()
    phases: dict[str, float] = {"prepare_inputs": 0.0, "sample": 0.0, "attention fn": 0.0}
    steps = {"n": 0, "decode_only": 0}
    orig_execute = model_runner.ModelRunner.execute
    orig_prepare = model_runner.prepare_inputs
    orig_sample = model_runner.sample
    orig_attn = attention.reference_paged_attention

    def timed_prepare(*a, **k):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        try:
            return orig_prepare(*a, **k)
        finally:
            phases["prepare_inputs"] += time.perf_counter() - t

    def timed_sample(*a, **k):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        try:
            return orig_sample(*a, **k)
        finally:
            phases["sample"] += time.perf_counter() - t

    def timed_attn(*a, **k):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        try:
            return orig_attn(*a, **k)
        finally:
            phases["attention fn"] += time.perf_counter() - t

    def profiled_execute(self, batch):  # type: ignore[no-untyped-def]
        steps["n"] += 1
        if batch.num_single_token_rows == batch.num_rows:
            steps["decode_only"] += 1
        worker_prof.enable()
        t = time.perf_counter()
        try:
            return orig_execute(self, batch)
        finally:
            phases["execute total"] = phases.get("execute total", 0.0) + time.perf_counter() - t
            worker_prof.disable()

    model_runner.ModelRunner.execute = profiled_execute  # type: ignore[method-assign]
    model_runner.prepare_inputs = timed_prepare  # type: ignore[assignment]
    model_runner.sample = timed_sample  # type: ignore[assignment]
    attention.reference_paged_attention = timed_attn  # type: ignore[assignment]
    loop_prof = cProfile.Profile()
    t0 = time.perf_counter()
    loop_prof.enable()
    run()
    loop_prof.disable()
    wall = time.perf_counter() - t0
    model_runner.ModelRunner.execute = orig_execute  # type: ignore[method-assign]
    model_runner.prepare_inputs = orig_prepare  # type: ignore[assignment]
    model_runner.sample = orig_sample  # type: ignore[assignment]
    attention.reference_paged_attention = orig_attn  # type: ignore[assignment]

    print(f"## aiocb profile: {n} requests x {new} tokens, wall {wall:.2f} s (under cProfile: inflated)")
    print(f"steps: {steps['n']} ({steps['decode_only']} decode-only)")
    for k, v in phases.items():
        print(f"  {k:16s} {v:7.3f} s")
    for title, prof in (("worker thread (ModelRunner.execute)", worker_prof), ("event-loop thread", loop_prof)):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.top)
        print(f"\n### {title}: top {args.top} by tottime\n")
        print(s.getvalue())

    if args.torch:
        # The torch profiler records the thread that opens it, so open one around every
        # execute() on the worker thread and add the per-op self times up.
        from torch.profiler import ProfilerActivity, profile

        totals: dict[str, list[float]] = {}
        phase = {"name": "decode"}

        def torch_profiled_execute(self, batch):  # type: ignore[no-untyped-def]
            phase["name"] = "decode" if batch.num_single_token_rows == batch.num_rows else "prefill/mixed"
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                result = orig_execute(self, batch)
            for evt in prof.key_averages():
                entry = totals.setdefault(f"{phase['name']:13s} {evt.key}", [0.0, 0])
                entry[0] += evt.self_cpu_time_total / 1e6
                entry[1] += evt.count
            return result

        model_runner.ModelRunner.execute = torch_profiled_execute  # type: ignore[method-assign]
        try:
            run()
        finally:
            model_runner.ModelRunner.execute = orig_execute  # type: ignore[method-assign]
        grand = sum(v[0] for v in totals.values())
        print(f"\n### torch profiler (worker thread), top ops by self CPU time; total {grand:.3f} s\n")
        for key, (secs, count) in sorted(totals.items(), key=lambda kv: -kv[1][0])[: args.top]:
            print(f"{secs:8.3f} s  {100 * secs / grand:5.1f}%  {count:6d} calls  {key}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
