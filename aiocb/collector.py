"""Keeping long-lived objects out of the cyclic garbage collector's view.

Torch, transformers, a model and a compiled decode model are hundreds of thousands of
objects that live as long as the process. While the collector sees them, every full
collection rescans them: a pause of 90-365 ms (measured on the development CPU) that
holds the GIL, so the event loop and the step thread stall with it.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

from aiocb.held_setting import HeldSetting

#: a full collection's threshold that is never reached (the largest the collector takes)
_NEVER = 2**31 - 1
#: blocks back to back put full collections off at most this long (seconds): then one runs
LONGEST_DEFERRAL_S = 30.0


def _set_full_threshold(full: int) -> None:
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, full)


_FULL_THRESHOLD = HeldSetting(lambda: gc.get_threshold()[2], _set_full_threshold, _NEVER)


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
    if _FULL_THRESHOLD.overdue(LONGEST_DEFERRAL_S):
        gc.collect()
    with _FULL_THRESHOLD.held():
        yield


def thaw_frozen_objects() -> None:
    """Undo :func:`freeze_alive_objects`: everything frozen back in the collector's view,
    then a full collection (the cycles among them that died while frozen are freed)."""
    gc.unfreeze()
    gc.collect()
