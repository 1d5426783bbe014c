"""aiocb: asyncio-native continuous batching for transformers causal LMs."""

from aiocb.batch import generate_batch
from aiocb.config import ContinuousBatchingConfig
from aiocb.engine.manager import Manager, ManagerStatistics, RequestStream
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

__version__ = "0.1.0"

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
    "WouldBlock",
    "WrongEventLoopError",
    "__version__",
    "generate_batch",
]
