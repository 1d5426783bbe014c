"""The CPU sampler's C kernels (``native_draw.c``): built on first use, loaded with ctypes.

torch's CPU ``topk`` costs about 20 µs per row of 4,096 logits on the development machine,
four times a whole greedy pick, and a filtered draw in torch ops is some twenty small
operations more (a top-p row without a top-k also a softmax over the whole row, and a
sort of the whole row when its nucleus is wide); the whole-vocabulary draw (temperature
alone) hashes and takes two logarithms for every logit. The kernels draw a row in a few
passes over its logits: :func:`draw_filtered` from its k largest, or over the tokens its
nucleus keeps; :func:`draw_whole` over the vocabulary (temperature alone, or a min-p). Both take the noise's logarithms
only for the few tokens whose bound on the noise lets them win.

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
from collections.abc import Callable
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
    for function, pointers in ((library.aiocb_draw_filtered, 7), (library.aiocb_draw_whole, 5)):
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


def _rows_of_floats(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` as the kernels read them: float32 on the CPU, each row contiguous."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32:
        raise ValueError(f"the C kernels take float32 CPU logits, not {logits.dtype} on {logits.device}")
    return logits if logits.stride(-1) == 1 else logits.contiguous()


def _column(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return values.to(dtype).contiguous()


def _run(function: Callable[..., object], logits: torch.Tensor, *columns: torch.Tensor | None) -> torch.Tensor:
    """Call a kernel on ``logits`` and the rows' columns (in its order; None passes NULL):
    the tokens it draws, one per row, on this process's torch threads."""
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.long)
    pointers = (None if column is None else column.data_ptr() for column in columns)
    function(logits.data_ptr(), rows, vocab, logits.stride(0), *pointers, tokens.data_ptr(), torch.get_num_threads())
    return tokens


def draw_filtered(
    library: ctypes.CDLL,
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    log_min_p: torch.Tensor | None,
    seed: torch.Tensor,
    offset: torch.Tensor,
) -> torch.Tensor:
    """Each row's pick of CPU ``logits [R, V]`` (float32) as :func:`aiocb.runner.draw.draw`
    makes it, for rows with a top-k (``1 <= top_k < V``), a top-p (``top_p < 1``) or both;
    ``seed`` (32-bit values) and ``offset`` are the rows' noise (:mod:`aiocb.runner.noise`),
    ``log_min_p`` the log of min-p or None."""
    logits = _rows_of_floats(logits)
    temperature, top_p = (_column(t, torch.float32) for t in (temperature, top_p))
    top_k, seed, offset = (_column(t, torch.int64) for t in (top_k, seed, offset))
    if log_min_p is not None:
        log_min_p = _column(log_min_p, torch.float32)
    tokens = _run(library.aiocb_draw_filtered, logits, temperature, top_k, top_p, log_min_p, seed, offset)
    if bool((tokens < 0).any()):
        raise MemoryError("the CPU sampler's C kernel could not allocate its scratch memory")
    return tokens


def draw_whole(
    library: ctypes.CDLL,
    logits: torch.Tensor,
    temperature: torch.Tensor,
    log_min_p: torch.Tensor | None,
    seed: torch.Tensor,
    offset: torch.Tensor,
) -> torch.Tensor:
    """Each row's pick of CPU ``logits [R, V]`` (float32) over the whole vocabulary at
    ``temperature``, with ``log_min_p`` the log of min-p or None (no top-k or top-p), the
    noise of ``seed`` at ``offset``, as :func:`aiocb.runner.draw.draw_full` makes it."""
    logits = _rows_of_floats(logits)
    temperature = _column(temperature, torch.float32)
    seed, offset = _column(seed, torch.int64), _column(offset, torch.int64)
    if log_min_p is not None:
        log_min_p = _column(log_min_p, torch.float32)
    return _run(library.aiocb_draw_whole, logits, temperature, log_min_p, seed, offset)
