"""Choosing how each cache group's attention runs, and the in-place paged kernels.

* ``reference``: torch ops gather each request's keys (any device, any layer type).
* ``cpu``: aiocb's C kernels read single-token rows' keys in place through block tables,
  and those of multi-token rows of up to 32 tokens in layers without a sliding window;
  longer multi-token rows as ``reference`` (CPU, float32, when the kernels build).
* ``triton``: aiocb's Triton kernel reads the cache in place through block tables (CUDA).
* ``flash``: flash-attn's varlen kernel with a block table (CUDA, when importable and
  ``auto_switch_to_flash`` is on).

Sliding-window groups keep a ring of blocks per request, which a long chunk overwrites
while its first queries still need what it held. ``triton`` reads them in place in steps
whose rows bring few enough tokens (:func:`~aiocb.core.kv_cache.ring_safe_tokens`:
decode steps and verified proposals), a step with longer rows attending them as
``reference`` does; ``flash`` cannot read a ring, so with it they use ``reference``
(transformers turns its decode fast path off for any sliding layer); ``cpu`` reads
sliding layers' multi-token rows as ``reference`` does.
"""

from __future__ import annotations

import enum
import importlib.util
import logging
import os
from collections.abc import Callable

import torch

from aiocb.config import ContinuousBatchingConfig
from aiocb.errors import InvalidConfigError

logger = logging.getLogger(__name__)


class Backend(enum.StrEnum):
    """How a cache group's attention runs; the values are the names logs and ``AIOCB_ATTENTION_BACKEND`` use."""

    #: torch ops gather each request's keys (any device, any layer)
    REFERENCE = "reference"
    #: C kernels for single-token and short multi-token rows, ``reference`` for the others (CPU, float32)
    CPU = "cpu"
    #: in-place paged kernels, which read the cache through block tables
    TRITON = "triton"
    FLASH = "flash"

    def __repr__(self) -> str:
        # Lists of backends are logged with %s, which shows each item's repr: keep the plain string's.
        return repr(self.value)


#: flash-attn's paged KV needs blocks of a multiple of this many tokens.
FLASH_PAGE_MULTIPLE = 256

#: ``kernel(query, key_cache, value_cache, block_table, query_start, seq_lens,
#: max_query_len, max_seq_len, scale, softcap, window, ring_blocks, sinks) -> [T, Hq, D]``
PagedKernel = Callable[..., torch.Tensor]

_logged: set[tuple[str, ...]] = set()


def select_backends(
    device: torch.device,
    config: ContinuousBatchingConfig,
    windows: list[int | None],
    page_size: int,
    *,
    dtype: torch.dtype,
    head_dim: int,
    sinks: bool = False,
) -> list[str]:
    """The attention backend of each cache group (a cache of ``dtype``, heads of
    ``head_dim``; ``sinks``: the model's attention has sinks, which flash-attn does not
    take); logs the choice once per distinct result."""
    paged = _paged_backend(device, config, page_size, dtype, head_dim, sinks)
    ring_readers = (Backend.CPU, Backend.TRITON)
    chosen = [paged if window is None or paged in ring_readers else Backend.REFERENCE for window in windows]
    key = (device.type, *chosen)
    if key not in _logged:
        _logged.add(key)
        logger.info("aiocb attention backends per cache group: %s (device %s)", chosen, device)
    return chosen


def _paged_backend(
    device: torch.device,
    config: ContinuousBatchingConfig,
    page_size: int,
    dtype: torch.dtype,
    head_dim: int,
    sinks: bool,
) -> str:
    if config.max_blocks_per_request == 0:
        return Backend.REFERENCE  # transformers' switch for the in-place (decode fast path) kernels
    forced = os.environ.get("AIOCB_ATTENTION_BACKEND")
    if forced:
        return forced  # unchecked, so backends are typed str: an unknown name fails at the first forward
    if device.type == "cpu":
        return Backend.CPU if cpu_kernel_fits(dtype, head_dim) else Backend.REFERENCE
    if device.type != "cuda":
        return Backend.REFERENCE
    if config.auto_switch_to_flash and page_size % FLASH_PAGE_MULTIPLE == 0 and not sinks and _flash_available():
        return Backend.FLASH
    from aiocb.runner import triton_attention

    return Backend.TRITON if triton_attention.is_available(device) else Backend.REFERENCE


def cpu_kernel_fits(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the ``cpu`` backend's C kernels take a cache of ``dtype`` with heads of
    ``head_dim`` and are not known to be unavailable here. Whether they build is learnt when
    they are loaded (:meth:`~aiocb.runner.model_runner.ModelRunner.load_kernels`, before the
    first step and off the event loop: the first build on a machine takes a second or more)."""
    from aiocb.runner import native

    return dtype == torch.float32 and head_dim <= native.MOST_HEAD_DIM and native.may_load()


def _flash_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def paged_kernel(backend: str) -> PagedKernel:
    """The in-place kernel of a ``triton`` or ``flash`` backend (the others attend in
    :func:`aiocb.runner.attention.reference_paged_attention`)."""
    if backend == Backend.TRITON:
        return _triton_kernel
    if backend == Backend.FLASH:
        return _flash_kernel
    raise ValueError(f"no in-place kernel for attention backend {backend!r}")


def _triton_kernel(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    softcap: float | None,
    window: int | None,
    ring_blocks: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    from aiocb.runner.triton_attention import triton_paged_attention

    return triton_paged_attention(
        query,
        key_cache,
        value_cache,
        block_table,
        query_start,
        seq_lens,
        max_query_len,
        scale,
        softcap,
        window,
        ring_blocks=ring_blocks,
        max_seq_len=max_seq_len,  # (bounds the decode split: a host int, no device sync)
        sinks=sinks,
    )


def _flash_kernel(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    softcap: float | None,
    window: int | None,
    ring_blocks: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    from flash_attn import flash_attn_varlen_func

    assert window is None and ring_blocks is None  # (select_backends: sliding groups are reference's with flash)
    if sinks is not None:  # (select_backends never picks flash for them: AIOCB_ATTENTION_BACKEND named it)
        raise InvalidConfigError(
            "flash-attn's kernel takes no attention sinks (the model's s_aux): AIOCB_ATTENTION_BACKEND=flash cannot "
            "run this model; leave it unset"
        )

    cu_seqlens_k = torch.nn.functional.pad(seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
    return flash_attn_varlen_func(  # type: ignore[no-any-return]
        query,
        key_cache,
        value_cache,
        cu_seqlens_q=query_start,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_query_len,
        max_seqlen_k=max_seq_len,
        softmax_scale=scale,
        causal=True,
        softcap=softcap or 0.0,
        block_table=block_table,
    )
