"""Keeping long-lived objects out of the cyclic garbage collector's view.

Torch, transformers, a model and a compiled decode model are hundreds of thousands of
objects that live as long as the process. While the collector sees them, every full
collection rescans them: a pause of 90-365 ms (measured on the development CPU) that
holds the GIL, so the event loop and the step thread stall with it.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

#: a full collection's threshold that is never reached (the largest the collector takes)
_NEVER = 2**31 - 1
_deferral_lock = threading.Lock()
#: the blocks deferring full collections now, and the threshold they took
_deferring = 0
_deferred_threshold: int | None = None


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
    collector next finds it due, or first thing in the next such block, when the last
    one's objects are freed and it walks only what lives on (so that blocks back to back
    never put full collections off for good).

    Process-wide (the collector's thresholds are), nested and thread-safe: the last
    block to end puts the threshold back.
    """
    global _deferring, _deferred_threshold
    with _deferral_lock:
        if _deferring == 0:
            young, middle, full = gc.get_threshold()
            if young > 0 and gc.isenabled() and gc.get_count()[2] > full:
                gc.collect()
            _deferred_threshold = full
            gc.set_threshold(young, middle, _NEVER)
        _deferring += 1
    try:
        yield
    finally:
        with _deferral_lock:
            _deferring -= 1
            if _deferring == 0 and _deferred_threshold is not None:
                young, middle, full = gc.get_threshold()
                if full == _NEVER:  # (unless someone set thresholds of their own meanwhile)
                    gc.set_threshold(young, middle, _deferred_threshold)
                _deferred_threshold = None


def thaw_frozen_objects() -> None:
    """Undo :func:`freeze_alive_objects`: everything frozen back in the collector's view,
    then a full collection (the cycles among them that died while frozen are freed)."""
    gc.unfreeze()
    gc.collect()
