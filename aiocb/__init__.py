"""aiocb: asyncio-native continuous batching for transformers causal LMs.

The engine (and with it torch and transformers) is imported on first use of
:class:`Manager`, :class:`RequestStream`, :class:`ManagerStatistics` or
:func:`generate_batch`, so the configuration, errors and output types stay cheap to
import and ``aiocb.core`` stays free of torch and asyncio.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from aiocb.config import ContinuousBatchingConfig, WorkloadHints
from aiocb.errors import (
    AiocbError,
    DistributedError,
    EngineDeadError,
    InvalidConfigError,
    InvalidRequestError,
    ManagerClosedError,
    RequestAbortedError,
    WouldBlock,
    WrongEventLoopError,
)
from aiocb.outputs import FinishReason, GenerationOutput, RequestStatus
from aiocb.params import SamplingParams
from aiocb.speculative import SpeculativeConfig

if TYPE_CHECKING:
    from aiocb.batch import generate_batch
    from aiocb.engine.manager import Manager, ManagerStatistics
    from aiocb.engine.stream import RequestStream

__version__ = "0.1.0"

_LAZY = {
    "Manager": "aiocb.engine.manager",
    "ManagerStatistics": "aiocb.engine.manager",
    "RequestStream": "aiocb.engine.stream",
    "generate_batch": "aiocb.batch",
}

__all__ = [
    "AiocbError",
    "ContinuousBatchingConfig",
    "DistributedError",
    "EngineDeadError",
    "FinishReason",
    "GenerationOutput",
    "InvalidConfigError",
    "InvalidRequestError",
    "Manager",
    "ManagerClosedError",
    "ManagerStatistics",
    "RequestAbortedError",
    "RequestStatus",
    "RequestStream",
    "SamplingParams",
    "SpeculativeConfig",
    "WorkloadHints",
    "WouldBlock",
    "WrongEventLoopError",
    "__version__",
    "generate_batch",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'aiocb' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
