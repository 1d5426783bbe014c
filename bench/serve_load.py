"""Load test of ``aiocb serve``: many concurrent streaming clients on loopback.

The benchmark's tiny seeded Qwen3 (see ``bench/common.py``; its vocabulary set to that of
a byte-level BPE tokenizer trained here, so nothing is downloaded) is saved to a
temporary directory and served by ``python -m aiocb.cli.serve`` in a subprocess on
127.0.0.1 (uvloop when installed). Then ``--clients`` clients (500 by default) open
streaming ``/v1/completions`` requests all at once, with ``httpx.AsyncClient`` on one
event loop, each asking for ``--max-tokens`` tokens with EOS ignored, and record:

* errors (a status other than 200, a stream without ``[DONE]``, a short completion);
* time to first token (request sent -> first text chunk), and the whole request;
* throughput: generated tokens (from the usage chunks) over the wall time of the burst;
* leaked blocks: after the burst, ``/metrics`` must show every KV block free and no
  request running or waiting;
* the server's responsiveness: a thread of its own probes ``/health`` every 20 ms during
  the burst on a connection of its own, and reports the answers' latency (a server whose
  event loop is held answers late).

    python bench/serve_load.py                  # 500 clients x 32 tokens
    python bench/serve_load.py --quick          # 50 clients x 8 tokens, smoke test
    python bench/serve_load.py --json out.json  # also write the numbers
    python bench/serve_load.py --frontend-cost  # server CPU per token against Manager.stream

``--frontend-cost`` serves a near-zero-compute model (one layer, hidden size 16), so that
what is measured is the host work around the forward pass. It streams the same requests
(``--clients`` x ``--max-tokens``, token-id prompts, sampled, EOS ignored) through the
server and, in a fresh process, through ``Manager.stream`` directly, ``--repeats`` times
each, interleaved, and compares the CPU time of the process that serves them per
generated token. With ``--api-workers N`` the server runs N HTTP processes in front of
its engine process: the engine process's CPU is compared (the loop that owns the cache),
and the CPU of all the server's processes is reported beside it. The ratio is printed last.

The markdown table is printed last. The run is bounded: every request has a timeout and
the server is stopped at the end, whatever happens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/serve_load.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil

from bench.common import REPO_ROOT, CpuContention, build_model, machine_info, markdown_table

MODEL_NAME = "tiny-qwen3-bench"
#: Words the prompts (and the tokenizer's training text) are made of.
_VOCABULARY = """
the a model token stream server client request batch cache block prefix step loop event async await time first
latency throughput queue memory page kv attention layer head sample greedy seed text word one two three four five
six seven eight nine ten red blue green fast slow small large old new
"""
_WORDS = tuple(_VOCABULARY.split())


@dataclass
class ClientResult:
    ok: bool
    error: str | None = None
    ttft_s: float | None = None
    latency_s: float = 0.0
    completion_tokens: int = 0


@dataclass
class Report:
    clients: int
    max_tokens: int
    prompt_tokens_min: int
    prompt_tokens_max: int
    errors: int
    error_samples: list[str]
    wall_s: float
    generated_tokens: int
    tokens_per_s: float
    requests_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    latency_p50_ms: float
    latency_p99_ms: float
    leaked_blocks: int
    total_blocks: int
    running_after: int
    waiting_after: int
    server_ttft_count: int
    #: ``GET /health`` latency during the burst (milliseconds), and how many probes
    health_p50_ms: float
    health_p99_ms: float
    health_max_ms: float
    health_probes: int
    #: average cores busy during the burst: the clients (this process), everything else (server included)
    client_cores: float
    other_cores: float
    machine: dict[str, Any] = field(default_factory=dict)
    command: str = ""


# --------------------------------------------------------------------------- model and server


def build_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE tokenizer trained on generated text (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    corpus = [" ".join(rng.choice(_WORDS) for _ in range(200)) for _ in range(50)]
    corpus.append("Héllo wörld café 你好世界 こんにちは 😀🚀 0123456789 ()[]{}.,;:!?")
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def save_model(directory: Path) -> Any:
    """Save the benchmark model and its tokenizer to ``directory``; returns the tokenizer."""
    tokenizer = build_tokenizer(vocab_size=2048)
    model = build_model(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return tokenizer


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def start_server(model_dir: Path, port: int, extra: list[str], log: Any) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "aiocb.cli.serve", str(model_dir), "--port", str(port)]
    command += ["--served-model-name", MODEL_NAME, "--log-level", "warning", *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)


async def wait_healthy(http: Any, process: subprocess.Popen[bytes], within_s: float = 180.0) -> None:
    import httpx

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with status {process.returncode}")
        try:
            if (await http.get("/health", timeout=2)).status_code == 200:
                return
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.2)
    raise TimeoutError("the server did not become healthy")


# --------------------------------------------------------------------------- clients


async def one_client(http: Any, prompt: list[int], max_tokens: int, seed: int, limit_s: float) -> ClientResult:
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "seed": seed,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    result = ClientResult(ok=False)
    try:
        async with asyncio.timeout(limit_s):
            async with http.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    result.error = f"status {response.status_code}: {(await response.aread())[:200]!r}"
                    return result
                done = False
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    payload = line[len("data: ") :]
                    if payload == "[DONE]":
                        done = True
                        break
                    chunk = json.loads(payload)
                    if "error" in chunk:
                        result.error = f"stream error: {chunk['error']['message']}"
                        return result
                    if chunk.get("usage"):
                        result.completion_tokens = chunk["usage"]["completion_tokens"]
                    if result.ttft_s is None and any(c.get("text") for c in chunk["choices"]):
                        result.ttft_s = time.perf_counter() - started
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency_s = time.perf_counter() - started
    if not done:
        result.error = "the stream ended without [DONE]"
    elif result.completion_tokens != max_tokens:
        result.error = f"{result.completion_tokens} tokens instead of {max_tokens}"
    else:
        result.ok = True
    return result


class HealthProbe:
    """While open, a thread that sends ``GET /health`` every 20 ms on its own connection and
    keeps each answer's latency (:attr:`latencies`, seconds)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.latencies: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._probe, name="health-probe", daemon=True)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    def _probe(self) -> None:
        import httpx

        with httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=30) as http:
            while not self._stop.wait(0.02):
                before = time.perf_counter()
                if http.get("/health").status_code == 200:
                    self.latencies.append(time.perf_counter() - before)


def scrape(text: str) -> dict[str, float]:
    """``{sample name: value}`` of the Prometheus text (labels dropped, histograms' count kept)."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "le" not in sample.labels:
                values[sample.name] = sample.value
    return values


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


async def run_load(args: argparse.Namespace, model_dir: Path, tokenizer: Any, server_log: Any) -> Report:
    import httpx

    port = free_port()
    extra = ["--torch-threads", str(args.server_threads)] if args.server_threads else []
    if args.max_batch_requests:
        extra += ["--max-requests-per-batch", str(args.max_batch_requests)]
    process = start_server(model_dir, port, extra, server_log)
    rng = random.Random(0)
    prompts = []
    for _ in range(args.clients):
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(args.prompt_words // 2, args.prompt_words)))
        prompts.append(tokenizer.encode(words))
    limits = httpx.Limits(max_connections=args.clients + 16, max_keepalive_connections=args.clients + 16)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", limits=limits, timeout=None) as http:
            await wait_healthy(http, process)
            # Warm up: the first forward passes pay one-time costs.
            await asyncio.gather(*(one_client(http, p, 4, i, 120) for i, p in enumerate(prompts[:8])))
            started = time.perf_counter()
            with CpuContention() as cpu, HealthProbe(port) as health:  # this process is the clients
                results = await asyncio.gather(
                    *(one_client(http, p, args.max_tokens, i, args.timeout) for i, p in enumerate(prompts))
                )
            wall = time.perf_counter() - started
            after: dict[str, float] = {}
            for _ in range(100):  # let the last cancellations land, then read the cache state
                after = scrape((await http.get("/metrics")).text)
                idle = after["aiocb_num_requests_running"] == 0 and after["aiocb_num_requests_waiting"] == 0
                if idle and after["aiocb_kv_cache_free_blocks"] == after["aiocb_kv_cache_total_blocks"]:
                    break
                await asyncio.sleep(0.05)
    finally:
        stop_server(process)
    errors = [r.error for r in results if not r.ok and r.error is not None]
    ttfts = [r.ttft_s for r in results if r.ok and r.ttft_s is not None]
    latencies = [r.latency_s for r in results if r.ok]
    generated = sum(r.completion_tokens for r in results)
    lengths = [len(p) for p in prompts]
    return Report(
        clients=args.clients,
        max_tokens=args.max_tokens,
        prompt_tokens_min=min(lengths),
        prompt_tokens_max=max(lengths),
        errors=len(errors),
        error_samples=sorted(set(errors))[:5],
        wall_s=wall,
        generated_tokens=generated,
        tokens_per_s=generated / wall,
        requests_per_s=sum(r.ok for r in results) / wall,
        ttft_p50_ms=percentile(ttfts, 50) * 1000,
        ttft_p99_ms=percentile(ttfts, 99) * 1000,
        latency_p50_ms=percentile(latencies, 50) * 1000,
        latency_p99_ms=percentile(latencies, 99) * 1000,
        leaked_blocks=int(after["aiocb_kv_cache_total_blocks"] - after["aiocb_kv_cache_free_blocks"]),
        total_blocks=int(after["aiocb_kv_cache_total_blocks"]),
        running_after=int(after["aiocb_num_requests_running"]),
        waiting_after=int(after["aiocb_num_requests_waiting"]),
        server_ttft_count=int(after.get("aiocb_time_to_first_token_seconds_count", 0)),
        health_p50_ms=percentile(health.latencies, 50) * 1000,
        health_p99_ms=percentile(health.latencies, 99) * 1000,
        health_max_ms=max(health.latencies, default=float("nan")) * 1000,
        health_probes=len(health.latencies),
        client_cores=cpu.own_cores,
        other_cores=cpu.other_cores,
    )


#: The near-zero-compute model of ``--frontend-cost``: what it measures is the host's work.
_TINY_COMPUTE = {"num_hidden_layers": 1, "hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2,
                 "num_key_value_heads": 1, "head_dim": 8}  # fmt: skip


@dataclass
class FrontendCost:
    clients: int
    max_tokens: int
    repeats: int
    #: CPU microseconds of the serving process per generated token, one value per repeat
    #: (with API workers: of the engine process)
    server_us_per_token: list[float]
    in_process_us_per_token: list[float]
    ratio_median: float
    api_workers: int = 0
    #: CPU microseconds per generated token of all the server's processes (engine and workers)
    server_total_us_per_token: list[float] = field(default_factory=list)
    machine: dict[str, Any] = field(default_factory=dict)
    command: str = ""


def save_tiny_compute_model(directory: Path) -> Any:
    """Save the near-zero-compute model and its tokenizer; returns the tokenizer."""
    tokenizer = build_tokenizer(vocab_size=2048)
    model = build_model(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, **_TINY_COMPUTE)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return tokenizer


def frontend_prompts(tokenizer: Any, count: int) -> list[list[int]]:
    rng = random.Random(1)
    return [tokenizer.encode(" ".join(rng.choice(_WORDS) for _ in range(12))) for _ in range(count)]


def cpu_seconds(pid: int | None = None) -> float:
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


async def in_process_cost(model_dir: Path, clients: int, max_tokens: int, threads: int) -> float:
    """CPU microseconds per token of this process streaming the requests through ``Manager.stream``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import aiocb

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompts = frontend_prompts(tokenizer, clients)

    async def one(manager: aiocb.Manager, prompt: list[int], seed: int, tokens: int) -> int:
        rid = await manager.add_request(prompt, max_new_tokens=tokens, temperature=0.8, seed=seed, eos_token_id=[])
        count = 0
        async for output in manager.stream(rid):
            count = len(output.generated_tokens)
        return count

    async with aiocb.Manager(model) as manager:
        await asyncio.gather(*(one(manager, p, i, 4) for i, p in enumerate(prompts[:8])))  # warm-up
        before = cpu_seconds()
        counts = await asyncio.gather(*(one(manager, p, i, max_tokens) for i, p in enumerate(prompts)))
        spent = cpu_seconds() - before
    return spent / sum(counts) * 1e6


async def server_cost(
    model_dir: Path, tokenizer: Any, args: argparse.Namespace, server_log: Any
) -> tuple[float, float]:
    """CPU microseconds per token of the server process streaming the requests over HTTP,
    and of all its processes (the same without API workers)."""
    import httpx

    port = free_port()
    extra = ["--torch-threads", str(args.server_threads or 1), "--api-workers", str(args.api_workers)]
    process = start_server(model_dir, port, extra, server_log)
    prompts = frontend_prompts(tokenizer, args.clients)
    limits = httpx.Limits(max_connections=args.clients + 16, max_keepalive_connections=args.clients + 16)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", limits=limits, timeout=None) as http:
            await wait_healthy(http, process)
            await asyncio.gather(*(one_client(http, p, 4, i, 120) for i, p in enumerate(prompts[:8])))
            family = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
            before = [cpu_seconds(p.pid) for p in family]
            results = await asyncio.gather(
                *(one_client(http, p, args.max_tokens, i, args.timeout) for i, p in enumerate(prompts))
            )
            spent = [cpu_seconds(p.pid) - b for p, b in zip(family, before, strict=True)]
    finally:
        stop_server(process)
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0]}")
    tokens = sum(r.completion_tokens for r in results)
    return spent[0] / tokens * 1e6, sum(spent) / tokens * 1e6


def run_frontend_cost(args: argparse.Namespace, tmp: Path, server_log: Any) -> FrontendCost:
    model_dir = tmp / "tiny-compute"
    tokenizer = save_tiny_compute_model(model_dir)
    server: list[float] = []
    total: list[float] = []
    in_process: list[float] = []
    for repeat in range(args.repeats):
        engine_cost, total_cost = _run_loop(server_cost(model_dir, tokenizer, args, server_log))
        server.append(engine_cost)
        total.append(total_cost)
        command = [sys.executable, __file__, "--in-process-baseline", str(model_dir), "--clients", str(args.clients)]
        command += ["--max-tokens", str(args.max_tokens), "--server-threads", str(args.server_threads or 1)]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT)}
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
        in_process.append(float(done.stdout.strip().splitlines()[-1]))
        all_processes = f" (all its processes {total[-1]:.0f})" if args.api_workers else ""
        print(
            f"repeat {repeat + 1}: server {server[-1]:.0f} us/token{all_processes}, "
            f"Manager.stream {in_process[-1]:.0f} us/token",
            flush=True,
        )
    ratios = sorted(s / i for s, i in zip(server, in_process, strict=True))
    median = ratios[len(ratios) // 2]
    return FrontendCost(
        args.clients, args.max_tokens, args.repeats, server, in_process, median, args.api_workers, total
    )


def stop_server(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _run_loop(coroutine: Any) -> Any:
    try:
        import uvloop

        return uvloop.run(coroutine)
    except ImportError:
        return asyncio.run(coroutine)


def table(report: Report) -> str:
    headers = ["clients", "tokens each", "errors", "leaked blocks", "TTFT p50", "TTFT p99", "latency p50",
               "latency p99", "tokens/s", "requests/s", "wall", "/health p50 / p99 / max"]  # fmt: skip
    row = [
        str(report.clients),
        str(report.max_tokens),
        str(report.errors),
        f"{report.leaked_blocks} / {report.total_blocks}",
        f"{report.ttft_p50_ms:.0f} ms",
        f"{report.ttft_p99_ms:.0f} ms",
        f"{report.latency_p50_ms:.0f} ms",
        f"{report.latency_p99_ms:.0f} ms",
        f"{report.tokens_per_s:.0f}",
        f"{report.requests_per_s:.1f}",
        f"{report.wall_s:.1f} s",
        f"{report.health_p50_ms:.1f} / {report.health_p99_ms:.1f} / {report.health_max_ms:.1f} ms",
    ]
    return markdown_table(headers, [row])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--clients", type=int, default=500, help="concurrent streaming clients (default 500)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per request (default 32)")
    parser.add_argument("--prompt-words", type=int, default=48, help="longest prompt, in words (default 48)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take (default 600)")
    parser.add_argument("--max-batch-requests", type=int, default=0, help="server --max-requests-per-batch")
    parser.add_argument(
        "--server-threads",
        type=int,
        default=1,
        help="server --torch-threads (default 1: the clients need the other core of a small machine; 0 = torch's)",
    )
    parser.add_argument("--quick", action="store_true", help="50 clients x 8 tokens, a smoke test")
    parser.add_argument("--json", type=Path, default=None, help="also write the report as JSON here")
    parser.add_argument(
        "--frontend-cost",
        action="store_true",
        help="server CPU per token against Manager.stream in-process, near-zero-compute model (256 x 64 by default)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="--frontend-cost: runs of each (default 3)")
    parser.add_argument(
        "--api-workers", type=int, default=0, help="--frontend-cost: the server's --api-workers (default 0)"
    )
    parser.add_argument("--in-process-baseline", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.in_process_baseline is not None:  # the baseline's own process (see run_frontend_cost)
        threads = args.server_threads or 1
        print(_run_loop(in_process_cost(args.in_process_baseline, args.clients, args.max_tokens, threads)))
        return 0
    if args.quick:
        args.clients, args.max_tokens = min(args.clients, 50), min(args.max_tokens, 8)
    machine = machine_info()
    print(machine.describe(), flush=True)
    command = " ".join(["python", "bench/serve_load.py", *(argv if argv is not None else sys.argv[1:])])
    if args.frontend_cost:
        if "--clients" not in (argv if argv is not None else sys.argv):
            args.clients = 256
        if "--max-tokens" not in (argv if argv is not None else sys.argv):
            args.max_tokens = 64
        with tempfile.TemporaryDirectory(prefix="aiocb-frontend-") as tmp, open(Path(tmp) / "log", "w+b") as log:
            cost = run_frontend_cost(args, Path(tmp), log)
        cost.machine, cost.command = machine.as_dict(), command
        if args.json is not None:
            args.json.write_text(json.dumps(asdict(cost), indent=2) + "\n")
        server_range = f"{min(cost.server_us_per_token):.0f}-{max(cost.server_us_per_token):.0f}"
        stream_range = f"{min(cost.in_process_us_per_token):.0f}-{max(cost.in_process_us_per_token):.0f}"
        where = f"engine process with {cost.api_workers} API workers" if cost.api_workers else "server"
        print(
            f"\n{cost.clients} streams x {cost.max_tokens} tokens, {cost.repeats} runs each: {where} "
            f"{server_range} us/token, Manager.stream {stream_range} us/token of CPU"
        )
        if cost.api_workers:
            totals = cost.server_total_us_per_token
            print(f"all the server's processes: {min(totals):.0f}-{max(totals):.0f} us/token")
        print(f"frontend cost ratio ({where} / Manager.stream, median): {cost.ratio_median:.2f}x")
        return 0
    with tempfile.TemporaryDirectory(prefix="aiocb-serve-load-") as tmp:
        model_dir = Path(tmp) / "model"
        tokenizer = save_model(model_dir)
        with open(Path(tmp) / "server.log", "w+b") as server_log:
            try:
                runner: Any = asyncio.run
                try:
                    import uvloop

                    runner = uvloop.run
                except ImportError:
                    pass
                report = runner(run_load(args, model_dir, tokenizer, server_log))
            finally:
                server_log.seek(0)
                log = server_log.read().decode(errors="replace").strip()
                if log:
                    print("server log (last lines):\n" + "\n".join(log.splitlines()[-20:]), file=sys.stderr)
    report.machine = machine.as_dict()
    report.command = command
    if report.error_samples:
        print("errors:", *report.error_samples, sep="\n  ")
    ok = report.errors == 0 and report.leaked_blocks == 0 and report.running_after == 0 and report.waiting_after == 0
    print(
        f"\n{report.clients} streaming clients, {report.max_tokens} tokens each, prompts of "
        f"{report.prompt_tokens_min}-{report.prompt_tokens_max} tokens; server saw {report.server_ttft_count} "
        f"first tokens; CPU during the burst: clients {report.client_cores:.2f} cores, server and everything "
        f"else {report.other_cores:.2f} cores; {'OK' if ok else 'FAILED'}\n"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(asdict(report), indent=2) + "\n")
    print(table(report))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
