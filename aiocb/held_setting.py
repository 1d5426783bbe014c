"""A process-wide interpreter setting held at one value while blocks of work run."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

_T = TypeVar("_T")


class HeldSetting(Generic[_T]):
    """A process-wide setting (the collector's full threshold, the switch interval) held
    at ``value`` while any block of :meth:`held` runs, in any thread.

    The first block to begin sets it, the last to end puts back what it replaced (unless
    it was set to another value meanwhile); a child forked inside a block begins with none
    (the blocks it inherits end in the parent), so the setting goes back there at once.
    """

    def __init__(self, read: Callable[[], _T], write: Callable[[_T], None], value: _T) -> None:
        self._read, self._write, self.value = read, write, value
        self._lock = threading.Lock()
        #: the blocks running, the value they replaced, and since when (``time.monotonic()``)
        #: the setting has held
        self._blocks = 0
        self._replaced: _T | None = None
        self._since = 0.0
        os.register_at_fork(after_in_child=self._forked)

    @contextmanager
    def held(self) -> Iterator[None]:
        """The setting at :attr:`value` while the block runs."""
        pid = os.getpid()
        with self._lock:
            if self._blocks == 0:
                self._replaced = self._read()
                self._write(self.value)
                self._since = time.monotonic()
            self._blocks += 1
        try:
            yield
        finally:
            if os.getpid() == pid:  # (a child forked inside began with no block)
                self._release()

    def overdue(self, longest_s: float) -> bool:
        """Whether blocks back to back have held the setting for more than ``longest_s``
        (then it counts as held from now)."""
        with self._lock:
            now = time.monotonic()
            if self._blocks and now - self._since > longest_s:
                self._since = now
                return True
            return False

    def _release(self) -> None:
        with self._lock:
            self._blocks -= 1
            if self._blocks == 0:
                self._put_back()

    def _forked(self) -> None:
        # (a new lock: a thread of the parent may have held its lock)
        self._lock = threading.Lock()
        self._blocks = 0
        self._put_back()

    def _put_back(self) -> None:
        """The value the blocks replaced back (none is held when no block runs), unless the
        setting was changed meanwhile."""
        if self._replaced is not None and self._read() == self.value:
            self._write(self._replaced)
        self._replaced = None
