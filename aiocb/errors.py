"""The exceptions aiocb raises.

One tree, so ``except aiocb.AiocbError`` catches everything the runtime raises on
purpose::

    AiocbError
    ├── InvalidRequestError (also ValueError)   bad input; nothing was queued
    │   └── InvalidConfigError                  a ContinuousBatchingConfig field or value is wrong
    ├── WouldBlock                              a *_nowait call found no room
    ├── ManagerClosedError (also RuntimeError)  the manager is stopped, stopping or destroyed
    ├── RequestAbortedError (also RuntimeError) a hard stop ended the request
    ├── EngineDeadError (also RuntimeError)     the step loop died; ``__cause__`` is why
    ├── WrongEventLoopError (also RuntimeError) used from another event loop than its own
    └── DistributedError (also RuntimeError)    a tensor-parallel peer failed or timed out
"""

from __future__ import annotations


class AiocbError(Exception):
    """Base class of every exception aiocb raises on purpose."""


class InvalidRequestError(AiocbError, ValueError):
    """Bad input was rejected before anything was queued; the message names the problem.

    :attr:`param` is the name of the parameter at fault, when one is (the server maps it
    to the request body's field).
    """

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class InvalidConfigError(InvalidRequestError):
    """A :class:`~aiocb.ContinuousBatchingConfig` field is unknown or holds an invalid value."""


class WouldBlock(AiocbError):
    """A ``*_nowait`` call could not complete without waiting (the admission queue is full)."""


class ManagerClosedError(AiocbError, RuntimeError):
    """The manager does not accept this call in its current state (stopped or destroyed)."""


class RequestAbortedError(AiocbError, RuntimeError):
    """The request was aborted by ``stop(hard_stop=True)`` before it completed."""


class EngineDeadError(AiocbError, RuntimeError):
    """The step loop failed; every pending request gets this error.

    The exception that killed the loop is attached as ``__cause__`` and as :attr:`cause`.
    """

    def __init__(self, message: str, cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.cause = cause
        self.__cause__ = cause


class WrongEventLoopError(AiocbError, RuntimeError):
    """A manager bound to one event loop was used from another one."""


class DistributedError(AiocbError, RuntimeError):
    """A tensor-parallel rank failed, or a collective operation timed out."""
