"""Shared helpers for aiocb benchmarks.

* :func:`build_model` - the benchmark's tiny seeded Qwen3 (fp32, CPU, no EOS);
* :func:`make_workload` - seeded prompts with uniformly drawn lengths;
* :func:`timed` - wall-clock timing of one call;
* :class:`PeakRSS` - peak resident-memory growth of the process during a block;
* :func:`machine_info` - what ran the benchmark (CPU, cores, versions, date).

Nothing here imports aiocb, so the helpers can time any engine.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import datetime as _dt
import gc
import os
import platform
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import psutil
import torch

T = TypeVar("T")

REPO_ROOT = Path(__file__).resolve().parent.parent

#: The benchmark model of the issue: tiny Qwen3, diverse greedy outputs.
MODEL_CONFIG: dict[str, Any] = {
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "max_position_embeddings": 4096,
    "initializer_range": 0.3,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": 0,
}
PAD_TOKEN_ID = 0


# --------------------------------------------------------------------------- model and workload


def build_model(seed: int = 0, attn_implementation: str = "sdpa", **overrides: Any) -> Any:
    """The benchmark's tiny Qwen3 with seeded random weights: fp32, CPU, eval mode, no EOS."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(**{**MODEL_CONFIG, **overrides})
    config._attn_implementation = attn_implementation
    model = Qwen3ForCausalLM(config).to(torch.float32).eval()
    model.set_attn_implementation(attn_implementation)
    return model


def make_workload(
    num_requests: int,
    min_len: int = 16,
    max_len: int = 256,
    *,
    vocab_size: int = MODEL_CONFIG["vocab_size"],
    seed: int = 0,
) -> list[list[int]]:
    """``num_requests`` seeded prompts, lengths uniform in ``[min_len, max_len]``.

    Token ids are drawn from ``1 .. vocab_size-1`` so that the pad id 0 never appears in a prompt.
    """
    rng = random.Random(seed)
    lengths = [rng.randint(min_len, max_len) for _ in range(num_requests)]
    return [[rng.randrange(1, vocab_size) for _ in range(n)] for n in lengths]


def left_pad(prompts: list[list[int]], pad_id: int = PAD_TOKEN_ID) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` ``[B, Lmax]`` int64, left-padded with ``pad_id``."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        if p:
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = 1
    return ids, mask


# --------------------------------------------------------------------------- timing


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    """Call ``fn()`` and return ``(result, wall seconds)`` (``time.perf_counter``)."""
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


# --------------------------------------------------------------------------- memory


def _libc() -> Any:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


_LIBC = _libc()


def release_memory() -> None:
    """Collect garbage and ask glibc to give free heap pages back to the OS.

    Without the trim, memory freed by an earlier engine stays in the process and a later
    engine can reuse it without the RSS growing, which would make its peak look smaller.
    """
    gc.collect()
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        with contextlib.suppress(Exception):  # best effort only
            _LIBC.malloc_trim(0)


def _read_status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_hwm() -> bool:
    """Reset the kernel's peak-RSS counter (VmHWM) of this process; False if not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakRSS:
    """Peak growth of this process's resident memory (RSS) while the block runs.

    ``with PeakRSS() as mem: ...`` then ``mem.peak_delta_bytes``. Before the block it
    collects garbage and trims the heap, and takes the RSS as the baseline. During the
    block the peak comes from two sources, and the larger is kept:

    * the kernel's high-water mark ``VmHWM`` from ``/proc/self/status``, reset at entry
      through ``/proc/self/clear_refs`` (exact, when the kernel allows the reset);
    * a background thread sampling ``psutil`` RSS every ``interval`` seconds.

    It measures the whole process (model weights excluded, as they are in the baseline):
    KV caches, masks, activations, Python objects, allocator slack. Memory that is
    reserved but never touched (a ``torch.empty`` cache whose pages are never written)
    does not count, because it is not resident.
    """

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self._proc = psutil.Process()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.baseline_bytes = 0
        self.sampled_peak_bytes = 0
        self.hwm_peak_bytes: int | None = None
        self.hwm_reset = False
        self.num_samples = 0

    def _sample(self) -> None:
        while not self._stop.is_set():
            rss = self._proc.memory_info().rss
            self.num_samples += 1
            if rss > self.sampled_peak_bytes:
                self.sampled_peak_bytes = rss
            self._stop.wait(self.interval)

    def __enter__(self) -> PeakRSS:
        release_memory()
        self.baseline_bytes = self._proc.memory_info().rss
        self.sampled_peak_bytes = self.baseline_bytes
        self.hwm_reset = _reset_hwm()
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, name="bench-rss-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        rss = self._proc.memory_info().rss
        self.sampled_peak_bytes = max(self.sampled_peak_bytes, rss)
        if self.hwm_reset:
            hwm_kib = _read_status_kib("VmHWM")
            self.hwm_peak_bytes = None if hwm_kib is None else hwm_kib * 1024

    @property
    def peak_bytes(self) -> int:
        """The peak RSS during the block."""
        return max(self.sampled_peak_bytes, self.hwm_peak_bytes or 0)

    @property
    def peak_delta_bytes(self) -> int:
        """Peak RSS during the block minus the RSS just before it."""
        return max(0, self.peak_bytes - self.baseline_bytes)

    @property
    def method(self) -> str:
        """How the peak was measured, in words."""
        how = f"psutil RSS sampled every {self.interval * 1000:g} ms"
        if self.hwm_reset:
            how = "kernel VmHWM (reset via /proc/self/clear_refs) and " + how
        return how


class CpuContention:
    """How busy the rest of the machine was while the block ran.

    ``with CpuContention() as cpu: ...`` then ``cpu.other_cores``: the CPU seconds every
    other process used (system-wide busy time from ``/proc/stat`` minus this process's
    own CPU time), divided by the wall time: 0.0 on a quiet machine, 1.0 when another
    process kept one core busy throughout. ``cpu.own_cores`` is this process's average.
    """

    def __init__(self) -> None:
        self._proc = psutil.Process()
        self.wall_s = 0.0
        self.own_cpu_s = 0.0
        self.other_cpu_s = 0.0

    @staticmethod
    def _busy() -> float:
        t = psutil.cpu_times()
        return sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)

    def _own(self) -> float:
        t = self._proc.cpu_times()
        return t.user + t.system

    def __enter__(self) -> CpuContention:
        self._t0 = time.perf_counter()
        self._busy0 = self._busy()
        self._own0 = self._own()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.wall_s = time.perf_counter() - self._t0
        self.own_cpu_s = self._own() - self._own0
        self.other_cpu_s = max(0.0, self._busy() - self._busy0 - self.own_cpu_s)

    @property
    def other_cores(self) -> float:
        return self.other_cpu_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def own_cores(self) -> float:
        return self.own_cpu_s / self.wall_s if self.wall_s > 0 else 0.0


# --------------------------------------------------------------------------- machine


@dataclass
class MachineInfo:
    """What ran the benchmark."""

    date_utc: str
    cpu_model: str
    logical_cores: int | None
    usable_cores: int | None
    torch_threads: int
    python: str
    platform: str
    torch: str
    transformers: str
    aiocb: str | None
    git_commit: str | None
    git_dirty: bool | None
    total_memory_gib: float
    load_average: tuple[float, float, float] | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        """One line per fact, for a report header."""
        cores = f"{self.usable_cores} usable / {self.logical_cores} logical, torch threads {self.torch_threads}"
        load = "n/a" if self.load_average is None else ", ".join(f"{x:.2f}" for x in self.load_average)
        commit = "n/a" if self.git_commit is None else self.git_commit[:12] + (" (dirty)" if self.git_dirty else "")
        return "\n".join(
            [
                f"date (UTC):    {self.date_utc}",
                f"CPU:           {self.cpu_model} ({cores})",
                f"memory:        {self.total_memory_gib:.1f} GiB total; load average at start {load}",
                f"software:      python {self.python}, torch {self.torch}, transformers {self.transformers}, "
                f"aiocb {self.aiocb or 'n/a'}",
                f"platform:      {self.platform}",
                f"repo commit:   {commit}",
            ]
        )


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (falls back to ``platform.processor()``)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "Hardware", "cpu model"):
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def machine_info() -> MachineInfo:
    """Describe this machine and the software versions."""
    import transformers

    try:
        import aiocb

        aiocb_version: str | None = aiocb.__version__
    except Exception:
        aiocb_version = None
    try:
        usable: int | None = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    try:
        load: tuple[float, float, float] | None = os.getloadavg()
    except OSError:
        load = None
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain") if commit else None
    return MachineInfo(
        date_utc=_dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M:%S"),
        cpu_model=cpu_model(),
        logical_cores=os.cpu_count(),
        usable_cores=usable,
        torch_threads=torch.get_num_threads(),
        python=sys.version.split()[0],
        platform=platform.platform(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        aiocb=aiocb_version,
        git_commit=commit,
        git_dirty=None if status is None else bool(status),
        total_memory_gib=psutil.virtual_memory().total / 2**30,
        load_average=load,
    )


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    """A GitHub-flavoured markdown table (first column left-aligned, the rest right)."""
    align = [":---"] + ["---:"] * (len(headers) - 1)
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)
