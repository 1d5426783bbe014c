"""Keeping long-lived objects out of the cyclic garbage collector's view.

Torch, transformers, a model and a compiled decode model are hundreds of thousands of
objects that live as long as the process. While the collector sees them, every full
collection rescans them: a pause of 90-365 ms (measured on the development CPU) that
holds the GIL, so the event loop and the step thread stall with it.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import time
from collections.abc import Iterator

#: a full collection's threshold that is never reached (the largest the collector takes)
_NEVER = 2**31 - 1
#: blocks back to back put full collections off at most this long (seconds): then one runs
LONGEST_DEFERRAL_S = 30.0
_deferral_lock = threading.Lock()
#: the blocks deferring full collections now, the threshold they took, and since when
#: (``time.monotonic()``) full collections are off
_deferring = 0
_deferred_threshold: int | None = None
_deferred_since = 0.0


def freeze_alive_objects() -> None:
    """A full collection, then everything alive moved out of the collector's view.

    A frozen object is still freed by reference counting, but never by the cyclic
    collector: nothing that forms reference cycles and should die (a manager's step loop,
    runner and cache) may be alive when this runs. The collection comes first, so that
    no garbage is frozen."""
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def full_collections_deferred() -> Iterator[None]:
    """No full collection while the block runs (young ones go on): for work that makes
    millions of objects and keeps them to its end (a large request body parsed and
    rendered). Each full collection in the middle walks all of them, holding the GIL, and
    so the event loop, for 100-250 ms. One that came due meanwhile runs when the
    collector next finds it due, once the last block is done; should blocks overlap
    without a break for :data:`LONGEST_DEFERRAL_S`, the next to begin runs one first (so
    that a stream of large bodies never puts them off for good).

    Process-wide (the collector's thresholds are), nested and thread-safe: the last
    block to end puts the threshold back.
    """
    global _deferring, _deferred_threshold, _deferred_since
    pid = os.getpid()
    overdue = False
    with _deferral_lock:
        now = time.monotonic()
        if _deferring == 0:
            young, middle, _deferred_threshold = gc.get_threshold()
            gc.set_threshold(young, middle, _NEVER)
            _deferred_since = now
        elif now - _deferred_since > LONGEST_DEFERRAL_S:
            overdue, _deferred_since = True, now
        _deferring += 1
    if overdue:
        gc.collect()
    try:
        yield
    finally:
        if os.getpid() == pid:  # (a child forked inside began with no block: see _forked)
            _end_deferral()


def _end_deferral() -> None:
    global _deferring, _deferred_threshold
    with _deferral_lock:
        _deferring -= 1
        if _deferring == 0 and _deferred_threshold is not None:
            young, middle, full = gc.get_threshold()
            if full == _NEVER:  # (unless someone set thresholds of their own meanwhile)
                gc.set_threshold(young, middle, _deferred_threshold)
            _deferred_threshold = None


def _forked() -> None:
    """In a child forked inside a block: no block runs there, so the threshold goes back
    (and the lock is new: the parent's may have been held by another thread)."""
    global _deferral_lock, _deferring, _deferred_threshold
    _deferral_lock = threading.Lock()
    if _deferring and _deferred_threshold is not None and gc.get_threshold()[2] == _NEVER:
        young, middle, _ = gc.get_threshold()
        gc.set_threshold(young, middle, _deferred_threshold)
    _deferring, _deferred_threshold = 0, None


os.register_at_fork(after_in_child=_forked)


def thaw_frozen_objects() -> None:
    """Undo :func:`freeze_alive_objects`: everything frozen back in the collector's view,
    then a full collection (the cycles among them that died while frozen are freed)."""
    gc.unfreeze()
    gc.collect()
