"""The device check: GPU tests, then the GPU benchmark, in one call of under 8 minutes.

    AIOCB_COMMIT=$(git rev-parse --short HEAD) python bench/gpu_check.py

1. ``pytest -m gpu`` (the Triton kernels on CUDA, bf16 parity with ``model.generate``,
   CUDA-graph replay against eager, async batching against synchronous steps).
2. The device's memory bandwidth (a large device-to-device copy).
3. The Triton sampler against ``draw_full`` at 1,024 rows x 151,936 tokens: times, and
   how many picks differ.
3b. Host overhead per step: a near-zero-compute model (1 layer, hidden 16, vocab 4,096 and
   151,936) at 256 and 1,024 rows, 16-token prompts, 32 new tokens: aiocb's ms per step
   (greedy, and sampled at temperature 0.8, top-k 50, top-p 0.9) against static
   ``generate``'s, whose difference is the host work aiocb adds to a step.
4. A random-weight bf16 model with Qwen3-0.6B's shape on two workloads, EOS disabled:
   (a) 256 requests, 512-token prompts, 256 new tokens; (b) 1,024 requests, 128-token
   prompts, 128 new tokens; through aiocb, static ``model.generate`` and transformers'
   ``generate_batch`` (in a subprocess with a time limit). For aiocb: output tokens/s,
   time to first token, inter-token latency, event-loop lag of a 1 ms heartbeat, and the
   decode step time against the bandwidth floor ((weights + KV read) / bandwidth).
5. Speculative decoding (prompt lookup, and the bundled model's one-layer early-exit
   draft) against none on the bundled model in bf16: copy-heavy prompts at batch 1 and 8
   (``bench/speculative.py``'s), outputs checked identical; tokens/s of each and the
   acceptance rates.

Prints a markdown table last; writes ``gpu_check.json`` and ``gpu_tests.log`` to ``$OUT``
when it is set. ``--dry-run`` runs the same plumbing on the CPU with a tiny model.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import functools
import inspect
import json
import os
import random
import re
import statistics
import subprocess
import sys
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
TRANSFORMERS_TIME_LIMIT_S = 100


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


def run_tests(out: Path | None, dry: bool) -> dict[str, Any]:
    """pytest -m gpu in a subprocess (own config: the project's needs pytest-asyncio)."""
    env = dict(os.environ, AIOCB_GPU_TESTS="1", PYTHONPATH=str(REPO))
    command = [sys.executable, "-m", "pytest", "-c", str(REPO / "bench" / "gpu_pytest.ini"), "-m", "gpu", "-q"]
    command += ["-rA", "tests/gpu", "tests/runner/test_triton_attention.py", "tests/runner/test_triton_sampler.py"]
    started = time.perf_counter()
    try:
        done = subprocess.run(
            command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300 if not dry else 600
        )
        text, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as error:
        text, code = f"timed out after {error.timeout} s\n{error.stdout or ''}", -1
    if out is not None:
        (out / "gpu_tests.log").write_text(text)
    counts = re.compile(r"\d+ (passed|failed|error|skipped)")
    summary = next((line for line in reversed(text.splitlines()) if counts.search(line)), text[-300:])
    notes = [line for line in text.splitlines() if "parity:" in line or "graphs vs eager" in line]
    return {"exit_code": code, "summary": summary.strip("= "), "notes": notes, "seconds": time.perf_counter() - started}


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

    return draw_full(logits / temperature[:, None], seed, offset, top_k, top_p, None)


def bench_sampler(dry: bool) -> dict[str, Any]:
    """The Triton sampler (top-k thresholds included) against ``draw_full``, both on the
    device, on Zipf-shaped logits (a language model's) and on normal ones (flatter), with
    top-k 50 + top-p 0.9 and with the temperature alone, at temperature 0.8.

    Every case is caught on its own: a kernel that fails reports its error, the rest runs.
    """
    from aiocb.runner import triton_sampler

    rows, vocab = DRY_SAMPLER_SHAPE if dry else SAMPLER_SHAPE
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    results: dict[str, Any] = {"shape": [rows, vocab]}
    if not triton_sampler.is_available(device):
        results["error"] = f"the Triton sampler does not run on {device}"
        return results
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
        "temperature only": (None, None),
    }
    for shape, logits in (("zipf", zipf), ("normal", normal)):
        for name, (top_k, top_p) in filters.items():
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
                results[case] = row
                log(
                    f"sampler {case}: triton {row['triton_ms']:.3f} ms, draw_full {row['draw_full_ms']:.2f} ms, "
                    f"{row['mismatches']} mismatches"
                )
            except Exception as error:  # a kernel that does not compile must not cost the rest
                results[case] = {"error": repr(error)[:300]}
                log(f"sampler {case}: {results[case]['error']}")
    del normal, zipf
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return results


HOST_SHAPE = {
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "max_position_embeddings": 512,
}


def bench_host_overhead(dry: bool) -> dict[str, Any]:
    """ms per step of static generate and of aiocb (greedy, sampled) on a model whose compute
    is near zero; each case catches its own errors."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    device = "cpu" if dry else "cuda"
    new = 4 if dry else 32
    results: dict[str, Any] = {}
    for vocab in (4096,) if dry else (4096, 151936):
        config = Qwen3Config(**HOST_SHAPE, vocab_size=vocab, bos_token_id=None, eos_token_id=None, pad_token_id=0)
        torch.manual_seed(0)
        with torch.device(device):
            static_model = Qwen3ForCausalLM(config).eval()
            engine_model = Qwen3ForCausalLM(config).eval()
        for rows in (8, 16) if dry else (256, 1024):
            case = f"vocab {vocab}, {rows} rows"
            try:
                results[case] = _host_case(static_model, engine_model, vocab, rows, new)
                log(f"host overhead {case}: {results[case]}")
            except Exception as error:
                results[case] = {"error": repr(error)[:300]}
    return results


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
        max_requests_per_batch=rows, max_batch_tokens=rows * 16, num_blocks=2 * rows + 8, page_size=64
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


def bench_speculative(dry: bool) -> dict[str, Any]:
    """bench/speculative.py's copy-heavy comparison on the device, one round per batch size."""
    from aiocb.default_model import load_default_model
    from bench.speculative import compare, copy_prompts

    device = "cpu" if dry else "cuda"
    model, tokenizer = load_default_model(device, None if dry else torch.bfloat16)
    new = 16 if dry else 96
    prompts = copy_prompts(tokenizer, 16, model.config.max_position_embeddings - new - 8)
    results: dict[str, Any] = {}
    for batch in (1, 8):
        chosen = prompts[: 4 if dry else 8] if batch == 1 else prompts[: 8 if dry else 16]
        try:
            row = compare(f"batch {batch}", model, chosen, new, batch, 1)
            results[f"copy-heavy, batch {batch}"] = {k: v for k, v in row.items() if k != "label"}
        except Exception as error:
            results[f"copy-heavy, batch {batch}"] = {"error": repr(error)[:300]}
        log(f"speculative batch {batch}: {results[f'copy-heavy, batch {batch}']}")
    return results


def sampler_lines(results: dict[str, Any]) -> list[str]:
    """One line per case of :func:`bench_sampler`."""
    rows, vocab = results.get("shape", ["?", "?"])
    if "error" in results:
        return [f"sampler {rows}x{vocab}: {results['error']}"]
    lines = []
    for case, row in results.items():
        if case == "shape":
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


async def _aiocb_run(manager: aiocb.Manager, prompts: list[list[int]], new: int) -> dict[str, Any]:
    lags: list[float] = []
    running = True

    async def heartbeat() -> None:
        while running:
            before = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(time.perf_counter() - before - 0.001)

    beat = asyncio.create_task(heartbeat())
    steps = manager._steps
    assert steps is not None
    # The step log is a bounded deque: count this run's steps, then take the last ones.
    first_step = steps.num_steps
    started = time.perf_counter()
    outputs = await manager.generate_batch(prompts, max_new_tokens=new)
    seconds = time.perf_counter() - started
    running = False
    await beat
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
    return {
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "ttft_p50_ms": 1000 * statistics.median(ttft),
        "ttft_p99_ms": 1000 * ttft[int(0.99 * (len(ttft) - 1))],
        "itl_p50_ms": 1000 * statistics.median(itl) if itl else float("nan"),
        "loop_lag_p50_ms": 1000 * statistics.median(lags) if lags else float("nan"),
        "loop_lag_p99_ms": 1000 * sorted(lags)[int(0.99 * (len(lags) - 1))] if lags else float("nan"),
        "loop_lag_max_ms": 1000 * max(lags) if lags else float("nan"),
        "decode_step_ms": 1000 * statistics.median(intervals) if intervals else float("nan"),
        "decode_steps_measured": len(intervals),
        "all_full_length": all(len(o.generated_tokens) == new for o in results),
    }


def bench_aiocb(model: Any, runs: dict[str, tuple[list[list[int]], int]]) -> dict[str, Any]:
    async def main() -> dict[str, Any]:
        results: dict[str, Any] = {}
        async with aiocb.Manager(model) as manager:
            runner = manager._runner
            assert runner is not None
            results["setup"] = {
                "backends": runner.backends,
                "cuda_graphs": runner.graphs is not None,
                "async_batching": runner.async_batching,
                "num_blocks": runner.plan.num_blocks,
                "page_size": runner.plan.page_size,
                "max_batch_tokens": runner.plan.max_batch_tokens,
                "max_requests_per_batch": runner.plan.max_requests_per_batch,
            }
            for name, (prompts, new) in runs.items():
                # Warm-up at the same batch size: Triton compilation and graph capture.
                await manager.generate_batch([p[:64] for p in prompts], max_new_tokens=4)
                log(f"aiocb {name}: warm")
                results[name] = await _aiocb_run(manager, prompts, new)
                log(f"aiocb {name}: {results[name]['tokens_per_s']:.0f} tok/s")
            stats = manager.statistics()
            results["leaked_blocks"] = stats.total_blocks - stats.free_blocks
        return results

    return asyncio.run(main())


def bench_transformers_subprocess(name: str, dry: bool, out: Path | None) -> dict[str, Any]:
    command = [sys.executable, __file__, "--transformers-only", name] + (["--dry-run"] if dry else [])
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=TRANSFORMERS_TIME_LIMIT_S, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {"error": f"did not finish within {TRANSFORMERS_TIME_LIMIT_S} s"}
    if out is not None:
        (out / f"transformers_{name}.log").write_text(done.stdout[-20000:] + done.stderr[-20000:])
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("RESULT "):
            return dict(json.loads(line[len("RESULT ") :]))
    return {"error": f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:] or ['no output']}"}


def transformers_only(name: str, dry: bool) -> None:
    """transformers' own continuous batching on one workload (run in a subprocess)."""
    import transformers
    from transformers import GenerationConfig

    model = build_model(dry)
    prompts, new = workload(name, dry)
    generation = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    kwargs: dict[str, Any] = {"generation_config": generation}
    accepted = inspect.signature(model.generate_batch).parameters
    if "progress_bar" in accepted:
        kwargs["progress_bar"] = False
    if hasattr(transformers, "ContinuousBatchingConfig") and "continuous_batching_config" in accepted:
        kwargs["continuous_batching_config"] = transformers.ContinuousBatchingConfig()
    model.generate_batch(inputs=[p[:16] for p in prompts[:8]], **kwargs)  # warm-up
    sync()
    started = time.perf_counter()
    outputs = model.generate_batch(inputs=prompts, **kwargs)
    sync()
    seconds = time.perf_counter() - started
    tokens = sum(len(o.generated_tokens) for o in outputs.values())
    result = {
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "version": transformers.__version__,
    }
    print("RESULT " + json.dumps(result), flush=True)


def decode_floor_ms(model: Any, prompts: list[list[int]], new: int, bandwidth: float) -> float:
    """Bandwidth floor of a decode step at full batch, at the workload's mean context."""
    config = model.config
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    weight_bytes -= config.vocab_size * config.hidden_size * 2 if not config.tie_word_embeddings else 0
    context = len(prompts[0]) + new / 2
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2
    kv_bytes = len(prompts) * context * kv_per_token
    return 1000 * (weight_bytes + kv_bytes) / bandwidth


# ---------------------------------------------------------------------------- report


def table(results: dict[str, Any]) -> str:
    lines = [
        "| workload | engine | tokens/s | vs transformers | wall s | TTFT p50 ms | ITL p50 ms | loop lag p99 / max ms |"
        " decode step ms (floor) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in WORKLOADS:
        hf = results.get("transformers", {}).get(name, {})
        hf_rate = hf.get("tokens_per_s")
        for engine in ("aiocb", "static", "transformers"):
            row = results.get(engine, {}).get(name, {})
            if "error" in row or not row:
                lines.append(f"| {name} | {engine} | {row.get('error', 'not run')} | | | | | | |")
                continue
            ratio = f"{row['tokens_per_s'] / hf_rate:.2f}x" if hf_rate else "n/a"
            extra = ["", "", "", ""]
            if engine == "aiocb":
                floor = results.get("floor_ms", {}).get(name, float("nan"))
                extra = [
                    f"{row['ttft_p50_ms']:.0f}",
                    f"{row['itl_p50_ms']:.2f}",
                    f"{row['loop_lag_p99_ms']:.2f} / {row['loop_lag_max_ms']:.2f}",
                    f"{row['decode_step_ms']:.2f} ({floor:.2f})",
                ]
            lines.append(
                f"| {name} | {engine} | {row['tokens_per_s']:.0f} | {ratio} | {row['seconds']:.1f} | "
                + " | ".join(extra)
                + " |"
            )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny model on the CPU (plumbing check)")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--transformers-only", metavar="WORKLOAD", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.transformers_only:
        transformers_only(args.transformers_only, args.dry_run)
        return 0
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    results: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "commit": os.environ.get("AIOCB_COMMIT", "unknown"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
    }
    import transformers

    results["transformers_version"] = transformers.__version__

    def save() -> None:
        if out is not None:
            (out / "gpu_check.json").write_text(json.dumps(results, indent=2, default=str))

    if not args.skip_tests:
        log("gpu tests ...")
        results["tests"] = run_tests(out, args.dry_run)
        log(f"gpu tests: {results['tests']['summary']}")
        save()
    results["bandwidth_gb_s"] = measure_bandwidth() / 1e9
    log(f"bandwidth: {results['bandwidth_gb_s']:.0f} GB/s")
    try:
        results["sampler"] = bench_sampler(args.dry_run)
    except Exception as error:  # (its setup: each case catches its own errors)
        results["sampler"] = {"error": repr(error)[:300]}
    save()
    try:
        results["host_overhead"] = bench_host_overhead(args.dry_run)
    except Exception as error:
        results["host_overhead"] = {"error": repr(error)[:300]}
    save()
    try:
        results["speculative"] = bench_speculative(args.dry_run)
    except Exception as error:
        results["speculative"] = {"error": repr(error)[:300]}
    save()
    model = build_model(args.dry_run)
    runs = {name: workload(name, args.dry_run) for name in WORKLOADS}
    results["floor_ms"] = {
        name: decode_floor_ms(model, prompts, new, results["bandwidth_gb_s"] * 1e9)
        for name, (prompts, new) in runs.items()
    }
    results["static"] = {}
    for name, (prompts, new) in runs.items():
        try:
            results["static"][name] = bench_static(model, prompts, new)
            log(f"static {name}: {results['static'][name]['tokens_per_s']:.0f} tok/s")
        except Exception as error:  # an OOM must not cost the other measurements
            results["static"][name] = {"error": repr(error)[:200]}
        save()
    try:
        results["aiocb"] = bench_aiocb(model, runs)
    except Exception as error:
        results["aiocb"] = {name: {"error": repr(error)[:300]} for name in WORKLOADS}
    save()
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    results["transformers"] = {}
    for name in WORKLOADS:
        log(f"transformers {name} ...")
        results["transformers"][name] = bench_transformers_subprocess(name, args.dry_run, out)
        save()
    for name in WORKLOADS:
        row = results["aiocb"].get(name, {})
        if "decode_step_ms" in row:
            row["decode_vs_floor"] = row["decode_step_ms"] / results["floor_ms"][name]
    save()
    print()
    print(json.dumps({k: results[k] for k in ("date", "commit", "device", "torch", "transformers_version")}))
    if "tests" in results:
        print(f"gpu tests: {results['tests']['summary']} {results['tests']['notes']}")
    print(f"bandwidth {results['bandwidth_gb_s']:.0f} GB/s; aiocb setup {results['aiocb'].get('setup')}")
    print("\n".join(sampler_lines(results["sampler"])))
    for case, row in results["host_overhead"].items():
        print(f"host overhead {case}: {row}")
    for case, row in results["speculative"].items():
        print(f"speculative {case}: {row}")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
