"""``torch.compile`` levels, as transformers' continuous batching defines them, and the
decode compile aiocb turns on by itself when decode steps replay CUDA graphs."""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers import PreTrainedModel

from aiocb.config import ContinuousBatchingConfig
from aiocb.errors import InvalidConfigError

logger = logging.getLogger(__name__)

#: ``default_compile_level`` -> ``torch.compile`` arguments (0: no compilation).
COMPILE_LEVELS: dict[int, dict[str, Any] | None] = {
    0: None,
    1: {"mode": "default", "dynamic": True},
    2: {"mode": "max-autotune-no-cudagraphs", "dynamic": True},
    3: {"mode": "max-autotune-no-cudagraphs", "dynamic": False},
}

#: The decode model's compile when the config asks for none and decode steps replay CUDA
#: graphs on one process: inductor fuses the small element-wise kernels (norms, RoPE,
#: casts, activations) that otherwise make up most of a replayed graph. ``mode="default"``
#: leaves CUDA graphs to aiocb (inductor's own would be captured inside ours), and
#: ``dynamic=True`` compiles once for every bucket above one row (and once for one row):
#: static shapes would compile once per bucket, past dynamo's recompile limit of 8.
GRAPHED_DECODE_COMPILE: dict[str, Any] = {"mode": "default", "dynamic": True}

#: ``torch.compile`` modes that capture CUDA graphs of their own.
_GRAPH_MODES = frozenset({"reduce-overhead", "max-autotune"})


def compile_configs(
    config: ContinuousBatchingConfig, *, decode_graphs: bool = False, tensor_parallel: bool = False
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """``torch.compile`` arguments for (mixed/prefill steps, decode steps), or None.

    An explicit ``varlen_compile_config`` / ``decode_compile_config`` takes precedence
    over ``default_compile_level`` for its path. When neither is set for the decode path
    (level 0, no decode config) and ``decode_graphs`` says decode steps replay aiocb's
    CUDA graphs, the decode model is compiled with :data:`GRAPHED_DECODE_COMPILE` on a
    single process; under ``tensor_parallel`` only an explicit config compiles it (dynamo
    would trace the sharded layers' collectives, a combination not exercised yet).
    ``decode_compile_config={"disable": True}`` (``torch.compile``'s own switch) turns
    the decode compile off.

    Raises:
        InvalidConfigError: the decode config asks for inductor's CUDA graphs while aiocb
            captures decode steps in its own.
    """
    level = COMPILE_LEVELS[config.default_compile_level]
    varlen = config.varlen_compile_config if config.varlen_compile_config is not None else level
    decode = config.decode_compile_config if config.decode_compile_config is not None else level
    if decode is None and decode_graphs and not tensor_parallel:
        decode = dict(GRAPHED_DECODE_COMPILE)
    if decode_graphs and decode is not None and not decode.get("disable", False) and _captures_graphs(decode):
        raise InvalidConfigError(
            f"decode_compile_config={decode!r} makes torch.compile capture CUDA graphs, but aiocb already "
            "captures decode steps in its own: use mode='default' or 'max-autotune-no-cudagraphs', "
            "or use_cuda_graph=False to leave CUDA graphs to torch.compile"
        )
    return varlen, decode


def _captures_graphs(arguments: dict[str, Any]) -> bool:
    options = arguments.get("options") or {}
    return arguments.get("mode") in _GRAPH_MODES or bool(options.get("triton.cudagraphs", False))


def compiled(model: PreTrainedModel, arguments: dict[str, Any] | None) -> Any:
    """The model, compiled with ``arguments`` (the model itself when None or when they say
    ``disable=True``).

    The attention function is excluded from compilation (it reads per-step Python
    metadata); the layers around it compile. ``torch.compile`` is lazy: the first call
    compiles, so for graphed decode steps that is the warm-up pass before the capture.
    """
    if arguments is None or arguments.get("disable", False):
        return model
    logger.info("compiling the model forward with torch.compile(%s)", arguments)
    return torch.compile(model, **arguments)
