"""Letting the event loop's thread have the GIL from a worker thread's long Python work."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from aiocb.held_setting import HeldSetting

_T = TypeVar("_T")

#: How long work inside :func:`pausing` holds the GIL between two chances for the event
#: loop's thread to take it (seconds).
PAUSE_EVERY = 0.0005

#: The interpreter's switch interval while :func:`switching_often` blocks run (seconds).
OFTEN = 0.0005
_INTERVAL = HeldSetting(sys.getswitchinterval, sys.setswitchinterval, OFTEN)

#: when each thread inside :func:`pausing` last let the GIL go (a dictionary by thread id:
#: looked up several times faster than a ``threading.local``'s attribute)
_last_pause: dict[int, float] = {}


def yield_gil() -> None:
    """Let another thread (the event loop's) take the GIL now, rather than when this one
    has held it for the interpreter's switch interval (5 ms). A sleep of 0.1 ms: one of 0 s
    lets the GIL go, but this thread mostly takes it back before the waiting one wakes."""
    time.sleep(0.0001)


@contextmanager
def pausing() -> Iterator[None]:
    """Within this block (on a worker thread), :func:`pause` lets the GIL go once this
    thread has held it for :data:`PAUSE_EVERY` seconds."""
    thread = threading.get_ident()
    _last_pause[thread] = time.perf_counter()
    try:
        yield
    finally:
        del _last_pause[thread]


def pause() -> None:
    """A chance for the event loop's thread to take the GIL, for long work done a slice (or
    an item) at a time: taken inside :func:`pausing` once it is due; on any other thread
    (the loop's own, where the same work is short) nothing."""
    thread = threading.get_ident()
    last = _last_pause.get(thread)
    if last is not None and time.perf_counter() - last >= PAUSE_EVERY:
        yield_gil()
        _last_pause[thread] = time.perf_counter()


@contextmanager
def switching_often() -> Iterator[None]:
    """While the block runs, a thread waiting for the GIL gets it within :data:`OFTEN` of
    asking rather than the interpreter's 5 ms: for long Python work on a worker thread
    that cannot :func:`pause` (a chat template rendering megabytes of messages). The step
    thread lets the GIL go at every torch operation, the loop's at every select, and
    each took it back only when the worker's 5 ms were up: a prefill beside such work
    took ten times as long.

    Process-wide (the interval is), nested and thread-safe: the last block to end puts
    the interval back, unless it was set to another meanwhile.
    """
    with _INTERVAL.held():
        yield


def pausing_call(function: Callable[..., _T], *args: object) -> _T:
    """``function(*args)`` inside :func:`pausing` (for ``asyncio.to_thread``)."""
    with pausing():
        return function(*args)
