"""aiocb's CPU C kernels, built on first use and loaded with ctypes: the sampler's draws
(``native_draw.c``) and attention over the paged cache (``native_attention.c``).

torch's CPU ``topk`` costs about 20 µs per row of 4,096 logits on the development machine,
four times a whole greedy pick, and a filtered draw in torch ops is some twenty small
operations more (a top-p row without a top-k also a softmax over the whole row, and a
sort of the whole row when its nucleus is wide); the whole-vocabulary draw (temperature
alone) hashes and takes two logarithms for every logit. The kernels draw a row in a few
passes over its logits: :func:`draw_filtered` from its k largest, or over the tokens its
nucleus keeps; :func:`draw_whole` over the vocabulary (temperature alone, or a min-p). Both take the noise's logarithms
only for the few tokens whose bound on the noise lets them win.

Decode attention (:func:`decode_attention`) reads each single-token row's keys where the
paged cache holds them, through its block table, where the torch path first gathers them
into a padded batch and then reads that copy (the ``cpu`` attention backend);
:func:`prefill_attention` does the same for a step's short multi-token rows, in one call
where the torch path makes one per row.

The kernels are compiled with the system's C compiler (``$CC``, else ``cc``) into a cache
directory (``$AIOCB_CACHE_DIR``, else ``$XDG_CACHE_HOME/aiocb``, else ``~/.cache/aiocb``),
once per source, compiler and machine; where that fails (no compiler, a read-only home)
the sampler keeps its torch path, which picks the same tokens, and attention its
``reference`` backend. ``AIOCB_NATIVE=0`` turns the kernels off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCES = tuple(
    Path(__file__).with_name(name) for name in ("native_parallel.c", "native_draw.c", "native_attention.c")
)
#: what the sources include (part of what a build is keyed by)
_HEADERS = (Path(__file__).with_name("native_parallel.h"),)
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
    sources = [source.read_bytes() for source in (*_SOURCES, *_HEADERS)]
    key = hashlib.sha256(
        b"\0".join(
            (*sources, " ".join(_FLAGS).encode(), _compiler_identity(compiler).encode(), platform.machine().encode())
        )
    ).hexdigest()[:20]
    directory = _cache_dir()
    target = directory / f"aiocb-native-{key}.so"
    if not target.exists():
        directory.mkdir(parents=True, exist_ok=True)
        # Built beside its final name and renamed into place: processes that build at the
        # same time each load a whole library.
        fd, partial = tempfile.mkstemp(suffix=".so", dir=directory)
        os.close(fd)
        try:
            subprocess.run(
                [compiler, *_FLAGS, "-o", partial, *map(str, _SOURCES), "-lm"],
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
    library.aiocb_use_openmp.restype = None
    library.aiocb_use_openmp.argtypes = [ctypes.c_void_p] * 3
    library.aiocb_use_openmp(*_openmp_entry_points())
    library.aiocb_decode_attention.restype = None
    library.aiocb_decode_attention.argtypes = [
        *[ctypes.c_void_p] * 4,  # query, key, value, table
        ctypes.c_int64,  # table stride
        *[ctypes.c_void_p] * 3,  # table rows, first, count
        *[ctypes.c_int64] * 6,  # rows, heads, kv heads, dim, page, ring
        *[ctypes.c_float] * 2,  # scale, softcap
        *[ctypes.c_void_p] * 2,  # sinks, out
        ctypes.c_int,  # threads
    ]
    library.aiocb_prefill_attention.restype = None
    library.aiocb_prefill_attention.argtypes = [
        ctypes.c_void_p,  # query
        *[ctypes.c_int64] * 2,  # its token and head strides
        *[ctypes.c_void_p] * 3,  # key, value, table
        ctypes.c_int64,  # table stride
        *[ctypes.c_void_p] * 4,  # table rows, first token, start, length
        *[ctypes.c_int64] * 5,  # rows, heads, kv heads, dim, page
        *[ctypes.c_float] * 2,  # scale, softcap
        *[ctypes.c_void_p] * 2,  # sinks, out
        ctypes.c_int,  # threads
    ]
    return library


def _openmp_entry_points() -> tuple[int | None, int | None, int | None]:
    """``GOMP_parallel``, ``omp_get_thread_num`` and ``omp_get_num_threads`` of the OpenMP
    runtime torch runs its CPU operations on (Nones where it has none, or it cannot be found).

    The kernels run their threads as that runtime's team: the threads torch's operations
    use, which wait (spinning) for the next operation. Threads of their own would compete
    with those for the cores; on the development machine that made decode attention on two
    threads slower than on one.
    """
    none = (None, None, None)
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return none
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return none
    paths = {line.split()[-1] for line in maps.splitlines() if re.search(r"/lib(gomp|iomp5|omp)[^/]*\.so", line)}
    torch_lib = str(Path(torch.__file__).parent / "lib")
    for path in sorted(paths, key=lambda p: not p.startswith(torch_lib)):  # torch's own first
        try:
            runtime = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            points = [ctypes.cast(getattr(runtime, name), ctypes.c_void_p).value for name in _OPENMP_NAMES]
        except (OSError, AttributeError):
            continue
        return points[0], points[1], points[2]
    return none


_OPENMP_NAMES = ("GOMP_parallel", "omp_get_thread_num", "omp_get_num_threads")


def _turned_off() -> bool:
    return os.environ.get("AIOCB_NATIVE", "1") == "0"


def may_load() -> bool:
    """Whether the kernels are not turned off and not known to have failed to build (a
    cheap test: nothing is built or loaded)."""
    return not _turned_off() and (not _tried or _library is not None)


def library() -> ctypes.CDLL | None:
    """The loaded kernels, built on the first call; None where they cannot be (logged once)."""
    global _library, _tried
    if _tried:
        return _library
    with _lock:
        if not _tried:
            if not _turned_off():
                try:
                    _library = _build()
                except (OSError, RuntimeError, subprocess.SubprocessError) as error:
                    detail = getattr(error, "stderr", None) or error
                    logger.warning(
                        "aiocb's CPU C kernels are unavailable (%s); sampling and decode attention use torch ops",
                        detail,
                    )
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


#: The widest head the decode attention kernel takes (``LANES`` in ``native_attention.c``).
MOST_HEAD_DIM = 4096


def decode_attention(
    library: ctypes.CDLL,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    table: torch.Tensor,
    table_rows: torch.Tensor | None,
    first: torch.Tensor,
    count: torch.Tensor,
    page: int,
    ring: int | None,
    scale: float,
    softcap: float | None = None,
    *,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of single-token rows ``query [R, Hq, D]`` over the paged cache in place.

    ``key_cache`` / ``value_cache`` are a layer's ``[slots, Hkv, D]`` (float32, CPU); row
    ``r`` attends over positions ``first[r] .. first[r] + count[r] - 1`` (``count >= 1``),
    whose blocks are in row ``table_rows[r]`` (None: row ``r``) of the int32 block table
    ``table``, modulo ``ring`` blocks where the layer keeps a sliding window's ring. Scores
    are scaled by ``scale`` and capped with tanh at ``softcap`` when given; ``sinks [Hq]``
    (float32), when given, join each head's softmax denominator. Returns ``[R, Hq, D]``.
    """
    _check_attention(query, key_cache, value_cache)
    sinks = _check_sinks(sinks, query.shape[1])
    rows, heads, dim = query.shape
    kv_heads = key_cache.shape[1]
    query = query.contiguous()
    table = _column(table, torch.int32)  # (no copy when it already is)
    first, count = _column(first, torch.int64), _column(count, torch.int64)
    if table_rows is not None:
        table_rows = _column(table_rows, torch.int64)
    out = torch.empty_like(query)
    library.aiocb_decode_attention(
        query.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        table.data_ptr(),
        table.stride(0),
        None if table_rows is None else table_rows.data_ptr(),
        first.data_ptr(),
        count.data_ptr(),
        rows,
        heads,
        kv_heads,
        dim,
        page,
        ring or 0,
        scale,
        softcap or 0.0,
        None if sinks is None else sinks.data_ptr(),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def prefill_attention(
    library: ctypes.CDLL,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    table: torch.Tensor,
    table_rows: torch.Tensor | None,
    token: torch.Tensor,
    start: torch.Tensor,
    length: torch.Tensor,
    page: int,
    scale: float,
    softcap: float | None,
    out: torch.Tensor,
    *,
    sinks: torch.Tensor | None = None,
) -> None:
    """Causal attention of multi-token rows over the paged cache in place, into ``out``.

    ``query`` and ``out`` are a step's ``[T, Hq, D]`` (float32, CPU; ``out`` contiguous,
    ``query`` possibly a transposed ``[Hq, T, D]``, as the model hands it over); row ``r``'s
    queries are tokens ``token[r] .. token[r] + length[r] - 1`` at positions ``start[r] ..``,
    each attending over the keys at positions ``0 ..`` its own, which ``key_cache`` /
    ``value_cache`` (a layer's ``[slots, Hkv, D]``, without a sliding window) already hold,
    in row ``table_rows[r]`` (None: row ``r``) of the int32 block table ``table``. Scores are
    scaled by ``scale`` and capped with tanh at ``softcap`` when given; ``sinks [Hq]``
    (float32), when given, join each head's softmax denominator. Writes those tokens' rows
    of ``out``; the others are left as they are.
    """
    _check_attention(query, key_cache, value_cache)
    sinks = _check_sinks(sinks, query.shape[1])
    if not (out.is_contiguous() and out.shape == query.shape and out.dtype == query.dtype):
        raise ValueError("the C prefill attention writes a contiguous output shaped as the query")
    rows, (_, heads, dim) = len(length), query.shape
    if query.stride(2) != 1:
        query = query.contiguous()
    table = _column(table, torch.int32)
    token, start, length = (_column(t, torch.int64) for t in (token, start, length))
    if table_rows is not None:
        table_rows = _column(table_rows, torch.int64)
    library.aiocb_prefill_attention(
        query.data_ptr(),
        query.stride(0),
        query.stride(1),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        table.data_ptr(),
        table.stride(0),
        None if table_rows is None else table_rows.data_ptr(),
        token.data_ptr(),
        start.data_ptr(),
        length.data_ptr(),
        rows,
        heads,
        key_cache.shape[1],
        dim,
        page,
        scale,
        softcap or 0.0,
        None if sinks is None else sinks.data_ptr(),
        out.data_ptr(),
        torch.get_num_threads(),
    )


def _check_sinks(sinks: torch.Tensor | None, heads: int) -> torch.Tensor | None:
    """The sinks as the kernels read them: ``heads`` contiguous float32 values on the CPU."""
    if sinks is None:
        return None
    if sinks.shape != (heads,):
        raise ValueError(f"the C attention kernels take one sink per query head ({heads}), not {tuple(sinks.shape)}")
    return sinks.detach().to("cpu", torch.float32).contiguous()


def _check_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """Refuse, by name, what the C attention kernels cannot read."""
    _, heads, dim = query.shape
    kv_heads = key_cache.shape[1]
    for name, tensor in (("query", query), ("key cache", key_cache), ("value cache", value_cache)):
        if tensor.device.type != "cpu" or tensor.dtype != torch.float32:
            raise ValueError(
                f"the C attention kernels take float32 CPU tensors, not a {tensor.dtype} {name} on {tensor.device}"
            )
    if dim > MOST_HEAD_DIM or heads % kv_heads or key_cache.shape[2] != dim:
        raise ValueError(f"the C attention kernels cannot take {heads} heads of {dim} over {kv_heads} KV heads")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("the C attention kernels read the cache in place: it must be contiguous")
