"""The device check: GPU tests, then the GPU benchmark, in one call of under 10 minutes.

    AIOCB_COMMIT=$(git rev-parse --short HEAD) python bench/gpu_check.py

Every phase runs in a subprocess of its own with a time limit (its process group is
killed when the limit passes), and the limits add up to :data:`TOTAL_BUDGET_S`: a phase
that times out, raises or dies is recorded as such and the check goes on. A phase writes
what it measured to ``$OUT/phases/<phase>.json`` as it goes, and the check rewrites
``$OUT/gpu_check.json`` after every phase, so a killed run still leaves its numbers.

1. ``tests``: ``pytest -m gpu`` (the Triton kernels on CUDA, split-KV decode and
   verification of proposals against one pass and their speed, bf16 greedy as close to
   fp32 as transformers' own bf16, CUDA-graph replay against eager, async batching
   against synchronous steps, every graph captured before the first step and none after,
   a draft model under graphs and prompt lookup with the decode model compiled (steps
   that verify proposals replaying graphs of their own), no sampler compile once
   serving); log in ``gpu_tests.log``.
2. ``device``: the device and the memory bandwidth (a large device-to-device copy).
3. ``sampler``: the Triton sampler against ``draw_full`` at 1,024 rows x 151,936 tokens.
4. ``host_overhead``: ms per step of a near-zero-compute model (1 layer, hidden 16) at
   256 and 1,024 rows, aiocb (greedy, sampled) against static ``generate``; then a
   ``cProfile`` of 1,024 greedy rows: the functions with the most own time per step.
5. ``speculative``: prompt lookup, the early-exit draft and a copy of the model as draft
   (a check that the draft path works: nearly all accepted) against none, bundled model:
   copy-heavy prompts at batch 1, 8 and 64, and W1; a warm-up round, then two rounds.
6. ``decode_kernels``: Qwen3-0.6B's shape in bf16, decode graphs of up to 256 rows
   captured with the decode model eager: capture seconds, kernels per replay
   (``torch.profiler``) and ms per replay at 64 and 256 rows (padding rows of one key
   each: the weights and the head, not attention over long contexts). (The compiled
   decode model's compile alone outlasted the phase on 2026-12-04; the ``aiocb`` phase
   measures its steps.)
7. ``parity``: teacher-forced bf16 parity: aiocb generates greedily (graphs, compiled
   decode, async batching), then plain transformers scores the same sequences in one
   forward; per generated position, the log-probabilities of aiocb's tokens are compared
   (max and mean abs difference) and the exact argmax match rate is reported.
8. ``static``, ``aiocb_eager`` and ``aiocb``: a random-weight bf16 model with Qwen3-0.6B's
   shape (aiocb with the decode model eager first, then with its defaults) on two
   workloads, EOS disabled: (a) 256 requests, 512-token prompts, 256 new tokens; (b)
   1,024 requests, 128-token prompts, 128 new tokens. For aiocb: tokens/s, time to first
   token, inter-token latency, event-loop lag of a 1 ms heartbeat, decode step time
   against the bandwidth floor, graph capture seconds and captures during timed runs,
   the longest step intervals and the garbage collector's longest pauses (generation,
   thread: suspects for a loop stall);
   with the decode model eager, each workload sampled too (temperature 0.8, top-p 0.9);
   then, with the manager destroyed, whether its device memory came back (if not, the
   largest device tensors still alive and what holds them).
9. ``transformers_a``, ``transformers_b``: transformers' ``generate_batch`` on each
   workload; one cut off by its limit is recorded as a bound (at least so many seconds,
   at most so many tokens/s).

Prints a markdown table last. ``--dry-run`` runs the same plumbing on the CPU with a tiny
model (longer limits; CUDA-only measurements are recorded as skipped); ``--skip-tests``
leaves out phase 1; ``--phases a,b`` runs only those phases; ``--budget S`` ends the check
after S seconds of phases.

The lent H200's image has transformers 5.17.0 where CI pins 5.23.0; the pinned wheel
travels with the call, in ``.whl/`` (git-ignored through ``.git/info/exclude``)::

    # here
    pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl transformers==5.23.0
    # there, before the check
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site

``$OUT`` gets four files at most: ``gpu_check.json`` (rewritten after every phase),
``phases.tgz`` (every phase's results and log, likewise), ``gpu_tests.log`` and the log
the command writes, e.g. ``set -o pipefail; python3 bench/gpu_check.py 2>&1 | tee
$OUT/check.log`` (the summary then also comes back in the call's output). A phase's
process kills itself and what it started if the check dies.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import datetime as dt
import functools
import gc
import importlib.util
import inspect
import itertools
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import aiocb  # noqa: E402

QWEN3_0_6B = {
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": True,
    "rope_theta": 1_000_000.0,
}
TINY = {
    "vocab_size": 2048,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}
WORKLOADS = {"a": (256, 512, 256), "b": (1024, 128, 128)}  # requests, prompt tokens, new tokens
DRY_WORKLOADS = {"a": (8, 32, 8), "b": (16, 16, 8)}

#: (phase, device seconds it may take). The limits add up to at most TOTAL_BUDGET_S, and
#: every phase also stops at the budget's end, so the whole check fits one 10-minute
#: command with room for its setup and report, and with a machine's start (about 30 s on
#: 2026-12-04), a session's 15 device minutes. With less left, pass ``--budget`` (the
#: seconds left, less a minute).
PHASES: list[tuple[str, int]] = [
    ("tests", 165),
    ("device", 8),
    ("sampler", 16),
    ("host_overhead", 36),
    ("speculative", 75),
    ("decode_kernels", 25),
    ("parity", 40),
    ("static", 45),
    ("aiocb_eager", 45),
    ("aiocb", 75),
    # (cut off, as they were in both device runs, they give bounds: at most so many tokens/s)
    ("transformers_a", 15),
    ("transformers_b", 15),
]
TOTAL_BUDGET_S = 560
assert sum(limit for _, limit in PHASES) <= TOTAL_BUDGET_S < 10 * 60 - 30
#: On the CPU (--dry-run) the tiny model's phases get this many times longer.
DRY_SLOWDOWN = 4
#: Device memory the destroyed manager may leave allocated before it counts as not given
#: back: the cuBLAS workspaces torch keeps for the process (32 MiB each on Hopper, one per
#: cuBLAS handle and stream: the step thread's handle on its default stream and on the
#: stream that captures decode graphs; the baseline's GEMM covers only the main thread's),
#: allocator rounding and the sampler's small persistent tensors.
MEMORY_TOLERANCE_BYTES = 96 * 2**20
#: pytest-timeout's limit per GPU test, where the device has it (the slowest test, the
#: decode model compiled, took 32 s on 2026-12-04)
TEST_TIMEOUT_S = 75


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def build_model(dry: bool) -> Any:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    shape = TINY if dry else QWEN3_0_6B
    config = Qwen3Config(**shape, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    device = "cpu" if dry else "cuda"
    with torch.device(device):
        model = Qwen3ForCausalLM(config)
    return model.to(torch.float32 if dry else torch.bfloat16).eval()


def workload(name: str, dry: bool) -> tuple[list[list[int]], int]:
    requests, prompt_len, new = (DRY_WORKLOADS if dry else WORKLOADS)[name]
    rng = random.Random(name)
    vocab = (TINY if dry else QWEN3_0_6B)["vocab_size"]
    return [[rng.randrange(1, vocab) for _ in range(prompt_len)] for _ in range(requests)], new


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------- sections


class Recorder:
    """A phase's results, rewritten to its JSON file at every :meth:`put` (a phase killed
    by its time limit leaves what it had)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {}

    def put(self, key: str, value: Any) -> Any:
        self.data[key] = value
        partial = self.path.with_suffix(".tmp")
        partial.write_text(json.dumps(self.data, indent=2, default=str))
        os.replace(partial, self.path)
        return value


def run_tests(rec: Recorder, out: Path, dry: bool) -> None:
    """pytest -m gpu in a subprocess (own config: the project's needs pytest-asyncio); the
    phase's time limit kills it with this process."""
    # (the repository first, then any path the caller set: packages carried to the device)
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, AIOCB_GPU_TESTS="1", PYTHONPATH=path)
    command = [sys.executable, "-m", "pytest", "-c", str(REPO / "bench" / "gpu_pytest.ini"), "-m", "gpu", "-q"]
    # The kernels' tests first (the engine's compile and capture), and prints in the log as
    # they come (--capture=tee-sys), so a run cut off by the limit keeps what it printed.
    command += ["-rA", "--capture=tee-sys"]
    if importlib.util.find_spec("pytest_timeout") is not None:
        # (a hung test fails alone instead of taking the rest of the phase's time)
        command += [f"--timeout={TEST_TIMEOUT_S}"]
    command += ["tests/runner/test_triton_attention.py", "tests/runner/test_triton_sampler.py", "tests/gpu"]
    log_path = out / "gpu_tests.log"
    rec.put("log", str(log_path))
    with log_path.open("w") as stream:
        code = subprocess.run(command, cwd=REPO, env=env, stdout=stream, stderr=subprocess.STDOUT).returncode
    for key, value in test_summary(log_path).items():
        rec.put(key, value)
    rec.put("exit_code", code)


#: Lines of the tests' log worth keeping in the results (their own prints, and failures).
TEST_NOTES = (
    "bf16 parity",
    "graphs vs eager",
    "captures:",
    "triton paged decode",
    "triton paged verification",
    "draft model on the device",
    "prompt lookup under graphs",
    "sliding layers",
    "gpt-oss sinks",
    "verify_cost",
    "FAILED ",
    "ERROR ",
)


def test_summary(log_path: Path) -> dict[str, Any]:
    """The pytest summary line and the noted lines (each once: ``-rA`` repeats the
    captured prints) of the tests' log, also of a run the phase's limit cut off."""
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    counts = re.compile(r"\d+ (passed|failed|error|skipped)")
    lines = text.splitlines()
    summary = next((line for line in reversed(lines) if counts.search(line)), None)
    notes = list(dict.fromkeys(line for line in lines if any(key in line for key in TEST_NOTES)))
    progress = [line for line in lines if re.fullmatch(r"[.FEsxX]+(\s+\[\s*\d+%\])?", line.strip())]
    return {
        "summary": summary.strip("= ") if summary else f"cut off; progress {''.join(progress)!r}",
        "notes": notes,
    }


def phase_device(rec: Recorder) -> None:
    rec.put("device", torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    rec.put("torch", torch.__version__)
    import transformers

    rec.put("transformers_version", transformers.__version__)
    rec.put("bandwidth_gb_s", measure_bandwidth() / 1e9)


def measure_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read plus written)."""
    if not torch.cuda.is_available():
        return float("nan")
    source = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    sync()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        target.copy_(source)
    end.record()
    sync()
    seconds = start.elapsed_time(end) / 1000 / 10
    del source, target
    torch.cuda.empty_cache()
    return 2 * 2 * 2**30 / seconds


SAMPLER_SHAPE = (1024, 151936)  # rows, vocabulary (Qwen3's)
DRY_SAMPLER_SHAPE = (8, 2048)


def _device_ms(run: Callable[[], object], repeats: int = 10) -> float:
    """Median milliseconds of ``run()`` after two warm-up calls (the first compiles)."""
    for _ in range(2):
        run()
    times = []
    for _ in range(repeats):
        sync()
        started = time.perf_counter()
        run()
        sync()
        times.append(1000 * (time.perf_counter() - started))
    return statistics.median(times)


def _draw_full_scaled(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    offset: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
) -> torch.Tensor:
    """``draw_full`` as ``sample()`` calls it without Triton (the division included)."""
    from aiocb.runner.draw import draw_full

    return draw_full(logits.float() / temperature[:, None], seed, offset, top_k, top_p, None)


def bench_sampler(dry: bool, rec: Recorder) -> None:
    """The Triton sampler (top-k thresholds included) against ``draw_full``, both on the
    device, on Zipf-shaped logits (a language model's) and on normal ones (flatter), with
    top-k 50 + top-p 0.9, top-p 0.9 alone and the temperature alone, at temperature 0.8.

    Every case is caught on its own: a kernel that fails reports its error, the rest runs.
    Each case is recorded as soon as it is measured.
    """
    from aiocb.runner import triton_sampler

    rows, vocab = DRY_SAMPLER_SHAPE if dry else SAMPLER_SHAPE
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rec.put("shape", [rows, vocab])
    if not triton_sampler.is_available(device):
        rec.put("error", f"the Triton sampler does not run on {device}")
        return
    gen = torch.Generator(device=device).manual_seed(0)
    normal = torch.randn(rows, vocab, device=device, generator=gen) * 3
    ranks = torch.rand(rows, vocab, device=device, generator=gen).argsort(dim=-1) + 1
    zipf = -ranks.float().log() + 0.3 * torch.randn(rows, vocab, device=device, generator=gen)
    del ranks
    temperature = torch.full((rows,), 0.8, device=device)
    seed = torch.arange(rows, device=device)
    offset = torch.zeros(rows, dtype=torch.long, device=device)
    filters = {
        "top-k 50 + top-p 0.9": (torch.full((rows,), 50, device=device), torch.full((rows,), 0.9, device=device)),
        "top-p 0.9": (None, torch.full((rows,), 0.9, device=device)),  # (the sampled workloads')
        "temperature only": (None, None),
    }
    # (shape, filters, logits): and a model's bfloat16 logits, which the kernel reads as they are
    cases = [(shape, name, logits) for shape, logits in (("zipf", zipf), ("normal", normal)) for name in filters]
    cases.insert(2, ("zipf", "top-p 0.9, bfloat16", zipf.bfloat16()))
    for shape, name, logits in cases:
        top_k, top_p = filters[name.split(",")[0]]
        case = f"{shape}, {name}"
        try:
            kernel = functools.partial(
                triton_sampler.triton_draw, logits, temperature, seed, offset, top_k, top_p, None, 50
            )
            reference = functools.partial(_draw_full_scaled, logits, temperature, seed, offset, top_k, top_p)
            row: dict[str, Any] = {
                "mismatches": int((kernel() != reference()).sum()),
                "triton_ms": _device_ms(kernel),
                "draw_full_ms": _device_ms(reference),
            }
            if top_k is not None:
                thresholds = functools.partial(triton_sampler.top_k_thresholds, logits, top_k, 50)
                row["top_k_thresholds_ms"] = _device_ms(thresholds)
            row["speedup"] = row["draw_full_ms"] / row["triton_ms"]
            rec.put(case, row)
            log(
                f"sampler {case}: triton {row['triton_ms']:.3f} ms, draw_full {row['draw_full_ms']:.2f} ms, "
                f"{row['mismatches']} mismatches"
            )
        except Exception as error:  # a kernel that does not compile must not cost the rest
            rec.put(case, {"error": repr(error)[:300]})
            log(f"sampler {case}: {error!r}")
    del normal, zipf
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


HOST_SHAPE = {
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "max_position_embeddings": 512,
}


def bench_host_overhead(dry: bool, rec: Recorder) -> None:
    """ms per step of static generate and of aiocb (greedy, sampled) on a model whose compute
    is near zero; each case catches its own errors and is recorded when measured. The
    decode model is left eager (its compile fuses next to nothing here and would cost the
    phase's time)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    device = "cpu" if dry else "cuda"
    new = 4 if dry else 32
    for vocab in (4096,) if dry else (4096, 151936):
        config = Qwen3Config(**HOST_SHAPE, vocab_size=vocab, bos_token_id=None, eos_token_id=None, pad_token_id=0)
        torch.manual_seed(0)
        with torch.device(device):
            static_model = Qwen3ForCausalLM(config).eval()
            engine_model = Qwen3ForCausalLM(config).eval()
        for rows in (8, 16) if dry else (256, 1024):
            case = f"vocab {vocab}, {rows} rows"
            try:
                log(f"host overhead {case}: {rec.put(case, _host_case(static_model, engine_model, vocab, rows, new))}")
            except Exception as error:
                rec.put(case, {"error": repr(error)[:300]})
        if vocab == 4096:
            rows = 16 if dry else 1024
            try:
                rec.put(f"profile, vocab {vocab}, {rows} rows", _host_profile(engine_model, vocab, rows, new))
            except Exception as error:
                rec.put(f"profile, vocab {vocab}, {rows} rows", {"error": repr(error)[:300]})


def _host_profile(model: Any, vocab: int, rows: int, new: int, top: int = 25) -> dict[str, Any]:
    """Where a greedy step's host time goes: ``cProfile`` over one ``generate_batch`` (after
    a warm-up one), the functions with the most own time, in ms per step. From Python 3.12
    ``cProfile`` sees every thread (it is built on ``sys.monitoring``), so the step loop's
    thread and the device worker's are both in it, but on one call stack: where the two
    interleave, time can land on the wrong function (rough attribution; the call counts
    hold). Before 3.12, the loop's thread alone."""
    import cProfile
    import pstats

    rng = random.Random(rows)
    prompts = [[rng.randrange(1, vocab) for _ in range(16)] for _ in range(rows)]
    config = aiocb.ContinuousBatchingConfig(
        max_requests_per_batch=rows, max_batch_tokens=rows * 16, num_blocks=2 * rows + 8, page_size=64,
        decode_compile_config={"disable": True},
    )  # fmt: skip
    profiler = cProfile.Profile()

    async def main() -> float:
        async with aiocb.Manager(model, continuous_batching_config=config) as manager:
            await manager.generate_batch(prompts, max_new_tokens=new)
            steps = manager.statistics().steps
            profiler.enable()
            await manager.generate_batch(prompts, max_new_tokens=new)
            profiler.disable()
            return manager.statistics().steps - steps

    steps = asyncio.run(main())
    stats = pstats.Stats(profiler)
    rows_out = []
    for (file, line, name), (_, calls, own, total, _) in stats.stats.items():  # type: ignore[attr-defined]
        where = f"{Path(file).name}:{line}:{name}"
        rows_out.append((own, f"{where} calls/step {calls / steps:.1f} own {1000 * own / steps:.3f} ms/step "
                              f"total {1000 * total / steps:.3f}"))  # fmt: skip
    rows_out.sort(reverse=True)
    return {"python": sys.version.split()[0], "steps": steps, "top_own_time": [text for _, text in rows_out[:top]]}


def _host_case(static_model: Any, engine_model: Any, vocab: int, rows: int, new: int) -> dict[str, float]:
    rng = random.Random(rows)
    prompts = [[rng.randrange(1, vocab) for _ in range(16)] for _ in range(rows)]
    input_ids = torch.tensor(prompts, device=static_model.device)

    def static() -> None:
        with torch.inference_mode():
            static_model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new, min_new_tokens=new,
                do_sample=False, pad_token_id=0, eos_token_id=None,
            )  # fmt: skip
        sync()

    def best(run: Callable[[], object]) -> float:
        run()  # warm-up
        times = []
        for _ in range(3):
            started = time.perf_counter()
            run()
            times.append(time.perf_counter() - started)
        return min(times) * 1e3 / new

    out = {"generate_ms": best(static)}
    sampled = aiocb.SamplingParams(do_sample=True, temperature=0.8, top_k=50, top_p=0.9, seed=0)
    config = aiocb.ContinuousBatchingConfig(
        max_requests_per_batch=rows,
        max_batch_tokens=rows * 16,
        num_blocks=2 * rows + 8,
        page_size=64,
        decode_compile_config={"disable": True},
    )

    async def main() -> None:
        async with aiocb.Manager(engine_model, continuous_batching_config=config) as manager:
            loop = asyncio.get_running_loop()
            for name, params in (("greedy_ms", None), ("sampled_ms", sampled)):

                def run(params: aiocb.SamplingParams | None = params) -> None:
                    future = asyncio.run_coroutine_threadsafe(
                        manager.generate_batch(prompts, max_new_tokens=new, sampling_params=params), loop
                    )
                    future.result()

                out[name] = await asyncio.to_thread(best, run)

    asyncio.run(main())
    out["host_overhead_ms"] = out["greedy_ms"] - out["generate_ms"]
    out["sampled_over_greedy"] = out["sampled_ms"] / out["greedy_ms"]
    return {k: round(v, 3) for k, v in out.items()}


def bench_speculative(dry: bool, rec: Recorder) -> None:
    """bench/speculative.py's comparison on the device: copy-heavy prompts at batch 1, 8 and
    64, and W1 (nothing to copy, 64 at once), after an untimed round that compiles every
    configuration's kernels (Triton compiles once per process: without it the first
    speculating run pays them); two interleaved rounds at batch 1 and 8, one at 64 and W1
    (every run is a manager of its own, which captures its graphs: batches of up to 8 rows
    capture fewer). The decode model eager (no compile in the phase's time); requests whose
    outputs differ from no speculation (bf16: verification runs other kernels) are
    counted, not fatal.

    Besides the early-exit draft (which proposes little that is taken, so it cannot tell a
    working draft path from a broken one), a copy of the model as draft at batch 1 and 8:
    it must have nearly every proposal accepted ("copy draft check"). The bundled model is
    small, so the ratios show speculation's overhead on the device more than what it gains
    on a large one.
    """
    from aiocb.default_model import load_default_model
    from bench.common import build_model, make_workload
    from bench.speculative import compare, copy_prompts, methods

    device = "cpu" if dry else "cuda"
    dtype = torch.float32 if dry else torch.bfloat16
    model, tokenizer = load_default_model(device, None if dry else dtype)
    new = 16 if dry else 64
    prompts = copy_prompts(tokenizer, 64, model.config.max_position_embeddings - new - 8)

    def config(rows: int) -> aiocb.ContinuousBatchingConfig:
        # (no more decode graphs than the batch needs: each run's manager captures its own)
        return aiocb.ContinuousBatchingConfig(max_requests_per_batch=rows, decode_compile_config={"disable": True})

    copy_draft = aiocb.SpeculativeConfig(method="draft", draft_model=copy.deepcopy(model))
    configs = {**methods(model), "copy draft": copy_draft}
    w1_model = build_model(seed=0).to(device, dtype)
    w1 = make_workload(16 if dry else 64, 16, 256, seed=0)
    warm_ups = (("warm-up", model, prompts, configs), ("warm-up W1", w1_model, w1, methods(w1_model)))
    for case, target, chosen, compared in warm_ups:
        try:
            compare(case, target, chosen[:2], 8, 2, 1, config=config(8), exact=False, configs=compared)
        except Exception as error:  # (the timed cases say more; they go on)
            rec.put(case, {"error": repr(error)[:300]})
    cases = [
        ("copy-heavy, batch 1", model, prompts[: 2 if dry else 4], new, 1, 2, configs),
        ("copy-heavy, batch 8", model, prompts[: 8 if dry else 16], new, 8, 2, configs),
        ("copy-heavy, batch 64", model, prompts[: 16 if dry else 64], new, 64, 1, methods(model)),
        ("W1, 64 at once", w1_model, w1, new, 64, 1, methods(w1_model)),
    ]
    for case, target, chosen, tokens, batch, rounds, compared in cases:
        try:
            row = compare(
                case, target, chosen, tokens, batch, rounds, config=config(max(8, batch)), exact=False, configs=compared
            )
            if "copy draft" in compared:
                accepted = row.get("copy draft acceptance")
                row["copy draft check"] = "ok" if accepted is not None and accepted >= 0.9 else "LOW ACCEPTANCE"
            rec.put(case, {k: v for k, v in row.items() if k != "label"})
        except Exception as error:
            rec.put(case, {"error": repr(error)[:300]})
        log(f"speculative {case}: {rec.data[case]}")


def sampler_lines(results: dict[str, Any]) -> list[str]:
    """One line per case of :func:`bench_sampler`."""
    rows, vocab = results.get("shape", ["?", "?"])
    if "error" in results:
        return [f"sampler {rows}x{vocab}: {results['error']}"]
    lines = []
    for case, row in results.items():
        if not isinstance(row, dict):  # (the shape, and the phase's status and times)
            continue
        if "error" in row:
            lines.append(f"sampler {rows}x{vocab} {case}: {row['error']}")
            continue
        thresholds = f" (top-k thresholds {row['top_k_thresholds_ms']:.3f})" if "top_k_thresholds_ms" in row else ""
        lines.append(
            f"sampler {rows}x{vocab} {case}: triton {row['triton_ms']:.3f} ms{thresholds}, "
            f"draw_full {row['draw_full_ms']:.2f} ms ({row['speedup']:.1f}x), {row['mismatches']} picks differ"
        )
    return lines


def bench_static(model: Any, prompts: list[list[int]], new: int) -> dict[str, Any]:
    """Static batched generate: the whole batch at once, greedy, to the full length."""
    device = next(model.parameters()).device
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)
    sync()
    started = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0
        )
    sync()
    seconds = time.perf_counter() - started
    generated = (out.shape[1] - ids.shape[1]) * out.shape[0]
    del out, ids, mask
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return {"seconds": seconds, "tokens": generated, "tokens_per_s": generated / seconds}


#: The sampled runs' parameters (issue 17's target: sampled throughput at least 0.9x greedy).
SAMPLED = {"do_sample": True, "temperature": 0.8, "top_p": 0.9}


async def _aiocb_run(
    manager: aiocb.Manager, prompts: list[list[int]], new: int, params: aiocb.SamplingParams | None = None
) -> dict[str, Any]:
    from bench.loop_watch import GCPauses, Heartbeat

    beat = Heartbeat()
    beat.start()
    steps = manager._steps
    assert steps is not None
    # The step log is a bounded deque: count this run's steps, then take the last ones.
    first_step = steps.num_steps
    # (the collector's pauses: a loop stall's suspects, where a full collection rescans
    # objects a compile made after the first manager froze the long-lived ones)
    with GCPauses() as pauses:
        started = time.perf_counter()
        outputs = await manager.generate_batch(prompts, max_new_tokens=new, sampling_params=params)
    seconds = time.perf_counter() - started
    await beat.stop()
    results = list(outputs.values())
    tokens = sum(len(o.generated_tokens) for o in results)
    ttft = sorted((o.first_token_time or 0.0) - o.created_time for o in results)
    itl = sorted(
        ((o.finished_time or 0.0) - (o.first_token_time or 0.0)) / (len(o.generated_tokens) - 1)
        for o in results
        if len(o.generated_tokens) > 1
    )
    log_entries = list(steps.step_log)[-(steps.num_steps - first_step) :] if steps.num_steps > first_step else []
    # Decode-only steps at full batch: rows == query tokens == number of requests.
    full = [i for i, (_, rows, toks) in enumerate(log_entries) if rows == toks == len(prompts)]
    intervals = [log_entries[i][0] - log_entries[i - 1][0] for i in full if i > 0 and (i - 1) in full]
    every_interval = [b[0] - a[0] for a, b in itertools.pairwise(log_entries)]
    return {
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "ttft_p50_ms": 1000 * statistics.median(ttft),
        "ttft_p99_ms": 1000 * ttft[int(0.99 * (len(ttft) - 1))],
        "itl_p50_ms": 1000 * statistics.median(itl) if itl else float("nan"),
        "loop_lag_p50_ms": beat.percentile_ms(0.5),
        "loop_lag_p99_ms": beat.percentile_ms(0.99),
        "loop_lag_max_ms": beat.percentile_ms(1.0),
        "decode_step_ms": 1000 * statistics.median(intervals) if intervals else float("nan"),
        "decode_steps_measured": len(intervals),
        "longest_step_intervals_ms": sorted((round(1000 * t, 1) for t in every_interval), reverse=True)[:3],
        "gc_collections": pauses.collections,
        "gc_longest_ms": [[round(1000 * t, 1), f"gen{gen}", thread] for t, gen, thread, _ in pauses.longest],
        "all_full_length": all(len(o.generated_tokens) == new for o in results),
    }


def _runner_setup(manager: aiocb.Manager) -> dict[str, Any]:
    runner = manager._runner
    assert runner is not None
    graphs = runner.graphs
    return {
        "backends": runner.backends,
        "cuda_graphs": graphs is not None,
        "graph_buckets": None if graphs is None else len(graphs.buckets),
        "decode_compiled": runner._decode_model is not runner.model,
        "async_batching": runner.async_batching,
        # (a verifying step against a decode step: what speculation's back-off charges)
        "verify_cost": round(runner.verify_cost, 2),
        "num_blocks": runner.plan.num_blocks,
        "page_size": runner.plan.page_size,
        "max_batch_tokens": runner.plan.max_batch_tokens,
        "max_requests_per_batch": runner.plan.max_requests_per_batch,
    }


def _captures(manager: aiocb.Manager) -> tuple[int, float | None]:
    runner = manager._runner
    graphs = None if runner is None else runner.graphs
    return (0, None) if graphs is None else (graphs.captures, graphs.capture_seconds)


def bench_aiocb(
    rec: Recorder, model: Any, runs: dict[str, tuple[list[list[int]], int]], *, sampled: bool, **config: Any
) -> None:
    """Each workload after a warm-up at its batch size (the session's start captures the
    graphs, compiling the decode model first), greedy, then sampled (:data:`SAMPLED`) if
    asked; then whether the memory came back, and if not, which tensors are still alive."""
    if torch.cuda.is_available():
        # (the main thread's cuBLAS workspace on the default stream into the baseline)
        square = torch.ones(64, 64, device="cuda", dtype=torch.bfloat16)
        product = square @ square
        del square, product
        torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0

    async def main() -> None:
        cb = aiocb.ContinuousBatchingConfig(**config)
        async with aiocb.Manager(model, continuous_batching_config=cb) as manager:
            rec.put("setup", {**_runner_setup(manager), "config": config})
            for name, (prompts, new) in runs.items():
                try:  # (a failed workload is recorded; the next one still runs)
                    await _workload(manager, name, prompts, new)
                except Exception as error:  # (the report's table shows it in the run's row)
                    rec.put(f"{name}_sampled" if name in rec.data else name, {"error": repr(error)})
                    log(f"aiocb {name} failed: {error!r}")
            stats = manager.statistics()
            rec.put("leaked_blocks", stats.total_blocks - stats.free_blocks)

    async def _workload(manager: aiocb.Manager, name: str, prompts: list[list[int]], new: int) -> None:
        started = time.perf_counter()
        await manager.generate_batch([p[:64] for p in prompts], max_new_tokens=4)
        captures, capture_s = _captures(manager)
        rec.put(f"{name}_warm_up", {"seconds": time.perf_counter() - started, "capture_seconds": capture_s})
        log(f"aiocb {name}: warm (graph capture {capture_s} s)")
        row = await _aiocb_run(manager, prompts, new)
        row["captures_during_run"] = _captures(manager)[0] - captures
        rec.put(name, row)
        log(f"aiocb {name}: {row['tokens_per_s']:.0f} tok/s")
        if sampled:
            params = aiocb.SamplingParams(**SAMPLED, seed=0)
            row = await _aiocb_run(manager, prompts, new, params)
            row["over_greedy"] = row["tokens_per_s"] / rec.data[name]["tokens_per_s"]
            rec.put(f"{name}_sampled", row)
            log(f"aiocb {name} sampled {SAMPLED}: {row['tokens_per_s']:.0f} tok/s")

    try:  # (the memory check below runs whatever happened)
        asyncio.run(main())
    except Exception as error:
        rec.put("session_error", repr(error))
        log(f"aiocb session failed: {error!r}")
    # A warm-up that compiled froze what was alive then (the manager among it): frozen
    # objects are invisible to gc.get_objects() and to _alive_tensors' referrers, and their
    # cycles uncollectable. The phase's process ends after this check.
    gc.unfreeze()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    after = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    given_back = after - baseline <= MEMORY_TOLERANCE_BYTES
    rec.put(
        "memory_after_destroy",
        {
            "model_bytes": baseline,
            "allocated_bytes": after,
            "left_bytes": after - baseline,
            "given_back": given_back,
            "tolerance_bytes": MEMORY_TOLERANCE_BYTES,
        },
    )
    if not given_back:
        rec.put("alive_after_destroy", _alive_tensors(model))


def _end_group(pgid: int, within_s: float = 30.0) -> None:
    """Kill process group ``pgid`` and wait (at most ``within_s``) until none of it runs."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    deadline = time.monotonic() + within_s
    while _group_runs(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)


def _group_runs(pgid: int) -> bool:
    """Whether a process of group ``pgid`` is still there, other than as a zombie (an
    orphan's, which a container's first process may never reap, holds no memory)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


def _alive_tensors(model: Any, top: int = 8) -> list[str]:
    """The largest device tensors still reachable that are not the model's own, each with
    the types of the objects that refer to it (what kept memory from coming back)."""
    own = {id(t) for t in model.parameters()} | {id(t) for t in model.buffers()}
    # (plain tensors only: the compiler's caches keep fake tensors, of the parameters' sizes,
    # which hold no memory)
    alive = [
        o
        for o in gc.get_objects()
        if type(o) in (torch.Tensor, torch.nn.Parameter)
        and o.device.type == "cuda"
        and id(o) not in own
        and o.numel() > 2**16
    ]
    alive.sort(key=lambda t: t.numel() * t.element_size(), reverse=True)
    chosen = alive[:top]
    del alive
    rows = []
    for tensor in chosen:
        holders = sorted({type(r).__qualname__ for r in gc.get_referrers(tensor) if r is not chosen})
        rows.append(f"{tuple(tensor.shape)} {tensor.dtype} held by {holders}")
    return rows


def phase_aiocb(rec: Recorder, dry: bool, *, eager_decode: bool) -> None:
    """aiocb on both workloads: with its defaults (the decode model compiled inside the
    graphs), or with the decode model left eager. The eager phase runs first, so that the
    workloads have aiocb numbers even if the compile fails or overruns its phase."""
    model = build_model(dry)
    log("model built")
    runs = {name: workload(name, dry) for name in WORKLOADS}
    config = {"decode_compile_config": {"disable": True}} if eager_decode else {}
    # (the sampled runs with the eager decode model: the compiled phase has the compile's cost)
    bench_aiocb(rec, model, runs, sampled=eager_decode, **config)


def phase_static(rec: Recorder, dry: bool) -> None:
    model = build_model(dry)
    log("model built")
    for name in WORKLOADS:
        prompts, new = workload(name, dry)
        try:
            rec.put(name, bench_static(model, prompts, new))
            log(f"static {name}: {rec.data[name]['tokens_per_s']:.0f} tok/s")
        except Exception as error:  # an OOM must not cost the other workload
            rec.put(name, {"error": repr(error)[:300]})


def phase_transformers(rec: Recorder, name: str, dry: bool) -> None:
    """transformers' own continuous batching on one workload. Before the timed call it
    records when it started and how many tokens it asks for: a run the time limit cuts
    off becomes a bound."""
    import transformers
    from transformers import GenerationConfig

    rec.put("version", transformers.__version__)
    model = build_model(dry)
    log("model built")
    prompts, new = workload(name, dry)
    kwargs: dict[str, Any] = {}
    accepted = inspect.signature(model.generate_batch).parameters
    if "progress_bar" in accepted:
        kwargs["progress_bar"] = False
    if hasattr(transformers, "ContinuousBatchingConfig") and "continuous_batching_config" in accepted:
        kwargs["continuous_batching_config"] = transformers.ContinuousBatchingConfig()

    def generation(tokens: int) -> Any:
        return GenerationConfig(max_new_tokens=tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)

    # (a short warm-up: the kernels and the allocator, not a whole workload's decode)
    model.generate_batch(inputs=[p[:16] for p in prompts[:8]], generation_config=generation(4), **kwargs)
    sync()
    log("warmed up")
    kwargs["generation_config"] = generation(new)
    rec.put("tokens_planned", len(prompts) * new)
    rec.put("timed_run_started", time.time())
    started = time.perf_counter()
    outputs = model.generate_batch(inputs=prompts, **kwargs)
    sync()
    seconds = time.perf_counter() - started
    tokens = sum(len(o.generated_tokens) for o in outputs.values())
    rec.put("seconds", seconds)
    rec.put("tokens", tokens)
    rec.put("tokens_per_s", tokens / seconds)


def _bound_if_cut_off(row: dict[str, Any], ended: float) -> None:
    """A transformers run killed during its timed call: at least this long, at most this fast."""
    if row.get("status") == "timeout" and "timed_run_started" in row and "seconds" not in row:
        at_least = ended - float(row["timed_run_started"])
        row["seconds_at_least"] = at_least
        row["tokens_per_s_at_most"] = row["tokens_planned"] / at_least
        row["bound"] = f">= {at_least:.1f} s, <= {row['tokens_per_s_at_most']:.0f} tok/s"


def _kernels_per_call(run: Callable[[], object]) -> tuple[int, str]:
    """Kernels one call launches (CUDA), or operators it runs (CPU), by torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    run()
    sync()
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        run()
        sync()
    if cuda:
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        return len(kernels), "CUDA kernels"
    return len([e for e in prof.events() if e.cpu_parent is None]), "top-level CPU operators"


def phase_decode_kernels(rec: Recorder, dry: bool) -> None:
    """Decode graphs of up to 256 rows, the decode model eager: capture seconds, kernels
    per replay and ms per replay at 64 and 256 rows."""
    from aiocb.runner.model_runner import ModelRunner

    model = build_model(dry)
    rows = 16 if dry else 256
    probes = (8, 16) if dry else (64, 256)
    if not torch.cuda.is_available():
        # No graphs on the CPU: count the operators of one eager one-row forward instead
        # (the profiler plumbing), and say so.
        rec.put("skipped", "decode CUDA graphs need CUDA")
        ids = torch.ones(1, 1, dtype=torch.long)
        with torch.inference_mode():
            count, unit = _kernels_per_call(lambda: model(input_ids=ids, use_cache=False))
        rec.put("eager_one_row_forward", {"count": count, "unit": unit})
        return
    label = "eager"
    # (the default page size, so the backend is the one the workloads use)
    config = aiocb.ContinuousBatchingConfig(
        max_requests_per_batch=rows, num_blocks=rows + 8, decode_compile_config={"disable": True}
    )
    runner = ModelRunner(model, config)
    graphs = runner.graphs
    if graphs is None:
        rec.put(label, {"error": f"no decode graphs (backends {runner.backends})"})
        return
    runner.attach()
    try:
        with torch.inference_mode():
            graphs.capture_all()
        row: dict[str, Any] = {"capture_seconds": graphs.capture_seconds, "buckets": len(graphs.buckets)}
        rec.put(label, row)
        for bucket in probes:
            # After capture_all every static input holds padding: a replay is a valid step.
            graph = graphs._graphs[(bucket, 1)][0]  # (one query token a row: decode)
            count, unit = _kernels_per_call(graph.replay)
            row[f"{bucket}_rows"] = {"kernels": count, "unit": unit, "replay_ms": _device_ms(graph.replay)}
            rec.put(label, row)
            log(f"decode graph {label}, {bucket} rows: {row[f'{bucket}_rows']}")
    finally:
        runner.detach()


PARITY_SHAPE = {
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "initializer_range": 0.3,  # (diverse greedy outputs; 0.02 falls into 1-2 token loops)
}


def phase_parity(rec: Recorder, dry: bool) -> None:
    """Teacher-forced parity in the model's dtype (bf16 on the device): aiocb generates, then
    transformers scores prompt + aiocb's tokens in one forward; per generated position,
    aiocb's log-probability of its token against transformers', and whether transformers'
    argmax is aiocb's token."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    device = "cpu" if dry else "cuda"
    dtype = torch.float32 if dry else torch.bfloat16
    torch.manual_seed(0)
    config = Qwen3Config(**PARITY_SHAPE, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    model = Qwen3ForCausalLM(config).to(device, dtype).eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 4096) for _ in range(rng.randint(8, 300))] for _ in range(16 if dry else 64)]
    new = 8 if dry else 32

    async def generate() -> tuple[list[Any], dict[str, Any]]:
        # (batches of at most 64 rows: 64 prompts, and fewer graphs to compile and capture)
        cb = aiocb.ContinuousBatchingConfig(max_memory_percent=0.3, max_requests_per_batch=64)
        params = aiocb.SamplingParams(return_logprobs=True)
        async with aiocb.Manager(model, continuous_batching_config=cb) as manager:
            outputs = await manager.generate_batch(prompts, max_new_tokens=new, sampling_params=params)
            return list(outputs.values()), _runner_setup(manager)

    outputs, setup = asyncio.run(generate())
    rec.put("setup", setup)
    log("generated")
    diffs: list[float] = []
    matches = 0
    for prompt, output in zip(prompts, outputs, strict=True):
        tokens, logprobs = output.generated_tokens, output.logprobs
        assert logprobs is not None and len(tokens) == new
        sequence = torch.tensor([prompt + tokens[:-1]], device=device)
        with torch.inference_mode():
            logits = model(input_ids=sequence).logits[0, len(prompt) - 1 :].float()
        reference = logits.log_softmax(-1)
        chosen = torch.tensor(tokens, device=device)
        theirs = reference.gather(1, chosen[:, None])[:, 0].tolist()
        diffs += [abs(a - b) for a, b in zip(logprobs, theirs, strict=True)]
        matches += int((reference.argmax(-1) == chosen).sum())
    positions = len(diffs)
    rec.put(
        "teacher_forced",
        {
            "dtype": str(dtype),
            "positions": positions,
            "logprob_max_abs_diff": max(diffs),
            "logprob_mean_abs_diff": sum(diffs) / positions,
            "argmax_match_rate": matches / positions,
        },
    )
    log(f"parity: {rec.data['teacher_forced']}")


def build_model_config(dry: bool) -> dict[str, Any]:
    """The benchmark model's shape (the parent process sizes the floor from it, no model built)."""
    return TINY if dry else QWEN3_0_6B


def decode_floor_ms(shape: dict[str, Any], prompts: list[list[int]], new: int, bandwidth: float) -> float:
    """Bandwidth floor of a decode step at full batch, at the workload's mean context, in
    bf16: the weights once (the tied embedding's lookup reads next to nothing) plus the KV."""
    hidden, heads, kv_heads, dim = (
        shape[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    )
    per_layer = 2 * hidden * heads * dim + 2 * hidden * kv_heads * dim + 3 * hidden * shape["intermediate_size"]
    weights = shape["num_hidden_layers"] * per_layer + shape["vocab_size"] * hidden
    if not shape["tie_word_embeddings"]:
        weights += shape["vocab_size"] * hidden
    context = len(prompts[0]) + new / 2
    kv_per_token = 2 * shape["num_hidden_layers"] * kv_heads * dim * 2
    kv_bytes = len(prompts) * context * kv_per_token
    return 1000 * (2 * weights + kv_bytes) / bandwidth


# ---------------------------------------------------------------------------- report


def _fmt(value: Any, digits: int) -> str:
    return f"{value:.{digits}f}" if isinstance(value, int | float) else "n/a"


def table(results: dict[str, Any]) -> str:
    lines = [
        "| workload | engine | tokens/s | vs transformers | wall s | TTFT p50 ms | ITL p50 ms | loop lag p99 / max ms |"
        " decode step ms (floor) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    phases = results["phases"]
    for name in WORKLOADS:
        hf = phases.get(f"transformers_{name}", {})
        # (a run cut off by its limit gives an upper bound on its rate: a lower one on the ratio)
        hf_rate = hf.get("tokens_per_s") or hf.get("tokens_per_s_at_most")
        at_least = ">= " if "tokens_per_s" not in hf else ""
        rows = {
            "aiocb": phases.get("aiocb", {}).get(name, {}),
            "aiocb_eager": phases.get("aiocb_eager", {}).get(name, {}),
            "aiocb_eager sampled": phases.get("aiocb_eager", {}).get(f"{name}_sampled", {}),
            "static": phases.get("static", {}).get(name, {}),
            "transformers": hf,
        }
        for engine, row in rows.items():
            if "bound" in row:
                lines.append(f"| {name} | {engine} | {row['bound']} (cut off) | | | | | | |")
                continue
            if "tokens_per_s" not in row:
                why = row.get("error") or row.get("status") or "not run"
                lines.append(f"| {name} | {engine} | {why} | | | | | | |")
                continue
            ratio = f"{at_least}{row['tokens_per_s'] / hf_rate:.2f}x" if hf_rate else "n/a"
            extra = ["", "", "", ""]
            if engine.startswith("aiocb"):
                floor = results.get("floor_ms", {}).get(name, float("nan"))
                extra = [
                    _fmt(row.get("ttft_p50_ms"), 0),
                    _fmt(row.get("itl_p50_ms"), 2),
                    f"{_fmt(row.get('loop_lag_p99_ms'), 2)} / {_fmt(row.get('loop_lag_max_ms'), 2)}",
                    f"{_fmt(row.get('decode_step_ms'), 2)} ({_fmt(floor, 2)})",
                ]
            lines.append(
                f"| {name} | {engine} | {row['tokens_per_s']:.0f} | {ratio} | {row['seconds']:.1f} | "
                + " | ".join(extra)
                + " |"
            )
    return "\n".join(lines)


def run_phase(name: str, result: Path, out: Path, dry: bool) -> None:
    """The body of one phase, in its own process; results go to ``result`` as they come."""
    rec = Recorder(result)
    if name == "tests":
        run_tests(rec, out, dry)
    elif name == "device":
        phase_device(rec)
    elif name == "sampler":
        bench_sampler(dry, rec)
    elif name == "host_overhead":
        bench_host_overhead(dry, rec)
    elif name == "speculative":
        bench_speculative(dry, rec)
    elif name == "decode_kernels":
        phase_decode_kernels(rec, dry)
    elif name == "parity":
        phase_parity(rec, dry)
    elif name == "static":
        phase_static(rec, dry)
    elif name in ("aiocb", "aiocb_eager"):
        phase_aiocb(rec, dry, eager_decode=name == "aiocb_eager")
    elif name.startswith("transformers_"):
        phase_transformers(rec, name.removeprefix("transformers_"), dry)
    else:
        raise SystemExit(f"unknown phase {name!r}")
    rec.put("done", True)


def _die_with_the_check() -> None:
    """In a phase's process: kill the phase's process group (pytest, compile workers) once
    the check that started it is gone (killed by the command's limit), so that nothing
    goes on using the device behind a rerun."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, name="gpu-check-watchdog", daemon=True).start()


def launch_phase(name: str, limit: float, phases: Path, out: Path, dry: bool) -> dict[str, Any]:
    """Run one phase in a new process group, killed (with anything it started) after
    ``limit`` seconds; returns what it recorded (in ``phases``), with its status and
    seconds. A phase killed after it recorded ``done`` (in its teardown) is "ok"."""
    result = phases / f"{name}.json"
    result.unlink(missing_ok=True)
    command = [sys.executable, __file__, "--phase", name, "--result", str(result), "--out", str(out)]
    command += ["--dry-run"] if dry else []
    started = time.perf_counter()
    ended = time.time()
    with (phases / f"{name}.log").open("w") as stream:
        process = subprocess.Popen(command, cwd=REPO, stdout=stream, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = process.wait(timeout=limit)
            ended = time.time()
            status = "ok" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            ended = time.time()  # (before the kill: a cut-off run's bound counts from here)
            os.killpg(process.pid, signal.SIGKILL)
            # (a process stuck in the driver may not die at once: the next phase goes on)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=30)
            status = "timeout"
        # (whatever the phase left running, e.g. compile workers or pytest, goes with it,
        # before the next phase plans its memory against what they held)
        _end_group(process.pid)
    row: dict[str, Any] = json.loads(result.read_text(errors="replace")) if result.exists() else {}
    if status == "timeout" and row.get("done"):
        status = "ok (killed in its teardown)"
    row["status"] = status
    row["limit_s"] = round(limit, 1)
    row["phase_seconds"] = round(time.perf_counter() - started, 2)
    if name == "tests" and "summary" not in row:
        row.update(test_summary(out / "gpu_tests.log"))
    if not status.startswith("ok"):
        tail = (phases / f"{name}.log").read_text(errors="replace")[-1500:]
        row["log_tail"] = tail
    if name.startswith("transformers_"):
        _bound_if_cut_off(row, ended)
    return row


def pack_phases(phases: Path, out: Path) -> None:
    """``$OUT/phases.tgz``: every phase's results and log in one file (a call brings back
    at most 8 files), rewritten after each phase so that a killed check leaves it."""
    partial = out / "phases.tgz.tmp"
    with tarfile.open(partial, "w:gz") as archive:
        archive.add(phases, arcname="phases")
    os.replace(partial, out / "phases.tgz")


def report(results: dict[str, Any]) -> None:
    """The summary printed at the end."""
    print()
    phases = results["phases"]
    print(json.dumps({k: results[k] for k in ("date", "commit", "dry_run")} | phases.get("device", {}), default=str))
    for name, row in phases.items():
        print(f"phase {name}: {row['status']} in {row.get('phase_seconds')} s (limit {row['limit_s']} s)")
    if "tests" in phases:
        print(f"gpu tests: {phases['tests'].get('summary')} {phases['tests'].get('notes')}")
    for phase in ("aiocb_eager", "aiocb"):
        print(f"{phase} setup {phases.get(phase, {}).get('setup')}")
        print(f"{phase} memory after destroy: {phases.get(phase, {}).get('memory_after_destroy')}")
        print(f"{phase} leaked blocks: {phases.get(phase, {}).get('leaked_blocks')}")
        for case, row in phases.get(phase, {}).items():
            if isinstance(row, dict) and "tokens_per_s" in row:
                # (issue 17's targets and a loop stall's suspects, beside the table's columns)
                keys = ("decode_vs_floor", "over_greedy", "captures_during_run", "longest_step_intervals_ms")
                picked = {key: row[key] for key in (*keys, "gc_longest_ms") if key in row}
                print(f"{phase} {case}: {picked}")
            elif case.endswith("_warm_up"):
                print(f"{phase} {case}: {row}")
    if "sampler" in phases:
        print("\n".join(sampler_lines(phases["sampler"])))
    for phase in ("host_overhead", "speculative", "decode_kernels", "parity"):
        for case, row in phases.get(phase, {}).items():
            if case not in ("status", "limit_s", "phase_seconds", "log_tail", "done"):
                print(f"{phase} {case}: {row}")
    for name in WORKLOADS:
        row = phases.get(f"transformers_{name}", {})
        if "bound" in row:
            print(f"transformers {name}: cut off by its limit: {row['bound']}")
    print(table(results))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny model on the CPU (plumbing check)")
    parser.add_argument("--skip-tests", action="store_true", help="leave out the pytest phase")
    parser.add_argument("--phases", help="comma-separated phases to run (all by default)")
    parser.add_argument(
        "--budget", type=float, default=TOTAL_BUDGET_S, help="seconds the phases may take in all (the device time left)"
    )
    parser.add_argument("--phase", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        _die_with_the_check()
        run_phase(args.phase, Path(args.result), Path(args.out), args.dry_run)
        # (its results are written: no device time for the interpreter's and CUDA's teardown)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(tempfile.mkdtemp(prefix="gpu_check_"))
    # (outside $OUT: two files a phase are more than a call brings back; phases.tgz holds them)
    phases_dir = Path(tempfile.mkdtemp(prefix="gpu_check_phases_"))
    wanted = [name for name, _ in PHASES]
    if args.phases:
        asked = [name.strip() for name in args.phases.split(",") if name.strip()]
        unknown = [name for name in asked if name not in wanted]
        if unknown:
            raise SystemExit(f"unknown phases {unknown}; the phases are {wanted}")
        wanted = [name for name in wanted if name in asked]
    if args.skip_tests and "tests" in wanted:
        wanted.remove("tests")
    results: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "commit": os.environ.get("AIOCB_COMMIT", "unknown"),
        "dry_run": args.dry_run,
        "planned_device_seconds": sum(limit for name, limit in PHASES if name in wanted),
        "phases": {},
    }
    log(f"phases {wanted}: at most {results['planned_device_seconds']} s; results in {out}")
    scale = DRY_SLOWDOWN if args.dry_run else 1
    deadline = time.perf_counter() + args.budget * scale
    for name, limit in PHASES:
        if name not in wanted:
            continue
        left = deadline - time.perf_counter()
        if left < 5:
            results["phases"][name] = {"status": "not run: the budget was spent", "limit_s": 0}
            continue
        log(f"{name} ...")
        row = results["phases"][name] = launch_phase(name, min(limit * scale, left), phases_dir, out, args.dry_run)
        log(f"{name}: {row['status']} in {row['phase_seconds']} s")
        (out / "gpu_check.json").write_text(json.dumps(results, indent=2, default=str))
        pack_phases(phases_dir, out)
    phases = results["phases"]
    bandwidth = phases.get("device", {}).get("bandwidth_gb_s", float("nan"))
    model_shape = build_model_config(args.dry_run)
    results["floor_ms"] = {
        name: decode_floor_ms(model_shape, *workload(name, args.dry_run), bandwidth * 1e9) for name in WORKLOADS
    }
    for name in WORKLOADS:
        for phase in ("aiocb_eager", "aiocb"):
            row = phases.get(phase, {}).get(name, {})
            if "decode_step_ms" in row:
                row["decode_vs_floor"] = row["decode_step_ms"] / results["floor_ms"][name]
    (out / "gpu_check.json").write_text(json.dumps(results, indent=2, default=str))
    report(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
