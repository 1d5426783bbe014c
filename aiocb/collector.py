"""Keeping long-lived objects out of the cyclic garbage collector's view.

Torch, transformers, a model and a compiled decode model are hundreds of thousands of
objects that live as long as the process. While the collector sees them, every full
collection rescans them: a pause of 90-365 ms (measured on the development CPU) that
holds the GIL, so the event loop and the step thread stall with it.
"""

from __future__ import annotations

import gc


def freeze_alive_objects() -> None:
    """A full collection, then everything alive moved out of the collector's view.

    A frozen object is still freed by reference counting, but never by the cyclic
    collector: nothing that forms reference cycles and should die (a manager's step loop,
    runner and cache) may be alive when this runs. The collection comes first, so that
    no garbage is frozen."""
    gc.collect()
    gc.freeze()


def thaw_frozen_objects() -> None:
    """Undo :func:`freeze_alive_objects`: everything frozen back in the collector's view,
    then a full collection (the cycles among them that died while frozen are freed)."""
    gc.unfreeze()
    gc.collect()
