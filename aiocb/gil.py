"""Letting the event loop's thread have the GIL from a worker thread's long Python work."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

_T = TypeVar("_T")

#: How long work inside :func:`pausing` holds the GIL between two chances for the event
#: loop's thread to take it (seconds).
PAUSE_EVERY = 0.0005

#: The interpreter's switch interval while :func:`switching_often` blocks run (seconds).
OFTEN = 0.0005
_switching_lock = threading.Lock()
#: the blocks inside :func:`switching_often` now, and the interval they replaced
_switching = 0
_replaced_interval: float | None = None

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
    global _switching, _replaced_interval
    pid = os.getpid()
    with _switching_lock:
        if _switching == 0:
            _replaced_interval = sys.getswitchinterval()
            sys.setswitchinterval(OFTEN)
        _switching += 1
    try:
        yield
    finally:
        if os.getpid() == pid:  # (a child forked inside began with no block: see _forked)
            _end_switching()


def _end_switching() -> None:
    global _switching, _replaced_interval
    with _switching_lock:
        _switching -= 1
        if _switching == 0 and _replaced_interval is not None:
            if sys.getswitchinterval() == OFTEN:
                sys.setswitchinterval(_replaced_interval)
            _replaced_interval = None


def _forked() -> None:
    """In a child forked inside a :func:`switching_often` block: no block runs there, so
    the interval goes back (and the lock is new: another thread may have held it)."""
    global _switching_lock, _switching, _replaced_interval
    _switching_lock = threading.Lock()
    if _switching and _replaced_interval is not None and sys.getswitchinterval() == OFTEN:
        sys.setswitchinterval(_replaced_interval)
    _switching, _replaced_interval = 0, None


os.register_at_fork(after_in_child=_forked)


def pausing_call(function: Callable[..., _T], *args: object) -> _T:
    """``function(*args)`` inside :func:`pausing` (for ``asyncio.to_thread``)."""
    with pausing():
        return function(*args)
