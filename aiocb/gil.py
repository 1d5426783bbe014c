"""Letting the event loop's thread have the GIL from a worker thread's long Python work."""

from __future__ import annotations

import time


def yield_gil() -> None:
    """Let another thread (the event loop's) take the GIL now, rather than when this one
    has held it for the interpreter's switch interval (5 ms). A sleep of 0.1 ms: one of 0 s
    lets the GIL go, but this thread mostly takes it back before the waiting one wakes."""
    time.sleep(0.0001)
