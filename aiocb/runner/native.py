"""The CPU sampler's C kernels (``native_draw.c``): built on first use, loaded with ctypes.

torch's CPU ``topk`` costs about 20 µs per row of 4,096 logits on the development machine,
four times a whole greedy pick, and a top-k draw in torch ops is some twenty small
operations more; the whole-vocabulary draw (temperature alone) hashes and takes two
logarithms for every logit. The kernels draw a row in one pass or two over its logits:
:func:`draw_top_k` from its k largest, :func:`draw_whole` over the vocabulary, taking the
logarithms only for the few tokens whose bound on the noise lets them win.

They are compiled with the system's C compiler (``$CC``, else ``cc``) into a cache
directory (``$AIOCB_CACHE_DIR``, else ``$XDG_CACHE_HOME/aiocb``, else ``~/.cache/aiocb``),
once per source, compiler and machine; where that fails (no compiler, a read-only home)
the sampler keeps its torch path, which picks the same tokens. ``AIOCB_NATIVE=0`` turns
the kernels off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("native_draw.c")
# (no -march=native: a cache directory may be shared by machines of one architecture)
_FLAGS = ("-O3", "-shared", "-fPIC", "-pthread", "-std=c11", "-fno-math-errno")

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_tried = False


def _cache_dir() -> Path:
    if explicit := os.environ.get("AIOCB_CACHE_DIR"):
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "aiocb"


def _compiler_identity(compiler: str) -> str:
    done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30, check=True)
    return done.stdout


def _build() -> ctypes.CDLL:
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C compiler {compiler!r} on PATH")
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(
        b"\0".join(
            (source, " ".join(_FLAGS).encode(), _compiler_identity(compiler).encode(), platform.machine().encode())
        )
    ).hexdigest()[:20]
    directory = _cache_dir()
    target = directory / f"native_draw-{key}.so"
    if not target.exists():
        directory.mkdir(parents=True, exist_ok=True)
        # Built beside its final name and renamed into place: processes that build at the
        # same time each load a whole library.
        fd, partial = tempfile.mkstemp(suffix=".so", dir=directory)
        os.close(fd)
        try:
            subprocess.run(
                [compiler, *_FLAGS, "-o", partial, str(_SOURCE), "-lm"],
                capture_output=True,
                text=True,
                timeout=120,
                check=True,
            )
            os.replace(partial, target)
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
    library = ctypes.CDLL(str(target))
    for function, pointers in ((library.aiocb_draw_top_k, 7), (library.aiocb_draw_whole, 4)):
        function.restype = None
        # (logits, rows, vocab, row stride, the rows' columns and outputs, threads)
        function.argtypes = [ctypes.c_void_p, *[ctypes.c_int64] * 3, *[ctypes.c_void_p] * pointers, ctypes.c_int]
    return library


def library() -> ctypes.CDLL | None:
    """The loaded kernels, built on the first call; None where they cannot be (logged once)."""
    global _library, _tried
    if _tried:
        return _library
    with _lock:
        if not _tried:
            if os.environ.get("AIOCB_NATIVE", "1") != "0":
                try:
                    _library = _build()
                except (OSError, RuntimeError, subprocess.SubprocessError) as error:
                    detail = getattr(error, "stderr", None) or error
                    logger.warning("the CPU sampler's C kernels are unavailable (%s); sampling with torch ops", detail)
            _tried = True
    return _library


def draw_top_k(
    library: ctypes.CDLL,
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    log_min_p: torch.Tensor | None,
    key1: torch.Tensor,
    key2: torch.Tensor,
) -> torch.Tensor:
    """Each row's pick of CPU ``logits [R, V]`` (float32) as :func:`aiocb.runner.draw.draw`
    makes it, for rows with ``1 <= top_k < V``; ``key1``, ``key2`` are the rows' noise keys
    (int32, :func:`aiocb.runner.noise.row_keys`), ``log_min_p`` the log of min-p or None."""
    rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    columns = [t.contiguous() for t in (temperature, top_k, top_p, key1, key2)]
    temperature, top_k, top_p, key1, key2 = columns
    if log_min_p is not None:
        log_min_p = log_min_p.contiguous()
    tokens = torch.empty(rows, dtype=torch.long)
    library.aiocb_draw_top_k(
        logits.data_ptr(),
        rows,
        vocab,
        logits.stride(0),
        temperature.data_ptr(),
        top_k.data_ptr(),
        top_p.data_ptr(),
        None if log_min_p is None else log_min_p.data_ptr(),
        key1.data_ptr(),
        key2.data_ptr(),
        tokens.data_ptr(),
        torch.get_num_threads(),
    )
    if bool((tokens < 0).any()):
        raise MemoryError("the CPU sampler's C kernel could not allocate its scratch memory")
    return tokens


def draw_whole(
    library: ctypes.CDLL, logits: torch.Tensor, temperature: torch.Tensor, key1: torch.Tensor, key2: torch.Tensor
) -> torch.Tensor:
    """Each row's pick of CPU ``logits [R, V]`` (float32) over the whole vocabulary at
    ``temperature`` (no top-k, top-p or min-p), as :func:`aiocb.runner.draw.draw_full` makes it."""
    rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    temperature, key1, key2 = (t.contiguous() for t in (temperature, key1, key2))
    tokens = torch.empty(rows, dtype=torch.long)
    library.aiocb_draw_whole(
        logits.data_ptr(),
        rows,
        vocab,
        logits.stride(0),
        temperature.data_ptr(),
        key1.data_ptr(),
        key2.data_ptr(),
        tokens.data_ptr(),
        torch.get_num_threads(),
    )
    return tokens
