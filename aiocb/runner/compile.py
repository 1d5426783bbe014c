"""``torch.compile`` levels, as transformers' continuous batching defines them."""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers import PreTrainedModel

from aiocb.config import ContinuousBatchingConfig

logger = logging.getLogger(__name__)

#: ``default_compile_level`` -> ``torch.compile`` arguments (0: no compilation).
COMPILE_LEVELS: dict[int, dict[str, Any] | None] = {
    0: None,
    1: {"mode": "default", "dynamic": True},
    2: {"mode": "max-autotune-no-cudagraphs", "dynamic": True},
    3: {"mode": "max-autotune-no-cudagraphs", "dynamic": False},
}


def compile_configs(config: ContinuousBatchingConfig) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """``torch.compile`` arguments for (mixed/prefill steps, decode steps), or None.

    An explicit ``varlen_compile_config`` / ``decode_compile_config`` takes precedence
    over ``default_compile_level`` for its path.
    """
    level = COMPILE_LEVELS[config.default_compile_level]
    varlen = config.varlen_compile_config if config.varlen_compile_config is not None else level
    decode = config.decode_compile_config if config.decode_compile_config is not None else level
    return varlen, decode


def compiled(model: PreTrainedModel, arguments: dict[str, Any] | None) -> Any:
    """The model, compiled with ``arguments`` (the model itself when None).

    The attention function is excluded from compilation (it reads per-step Python
    metadata); the layers around it compile.
    """
    if arguments is None:
        return model
    logger.info("compiling the model forward with torch.compile(%s)", arguments)
    return torch.compile(model, **arguments)
