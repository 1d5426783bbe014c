"""What the child processes aiocb starts (the tokenizer's, the grammar compiler's) share:
how one is ended, or let go of in a process forked from its parent."""

from __future__ import annotations

import contextlib
import os
import subprocess
import weakref
from typing import Any


def end(child: subprocess.Popen[bytes], pid: int) -> None:
    """Kill the child made by process ``pid`` and close its pipes (only close them in a
    process forked from that one: the child is not its to end)."""
    if os.getpid() == pid and child.poll() is None:
        child.kill()
        child.wait()
    close_pipes(child)


def let_go(child: subprocess.Popen[bytes] | None, ending: weakref.finalize[Any, Any] | None) -> None:
    """In a process forked from the one that made ``child``: let go of it without ending it
    (``ending``, the finalizer that would, detached; this process's ends of its pipes closed)."""
    if ending is not None:
        ending.detach()
    if child is not None:
        close_pipes(child)


def close_pipes(child: subprocess.Popen[bytes]) -> None:
    """Close this process's ends of the child's standard input and output."""
    for stream in (child.stdin, child.stdout):
        if stream is not None:
            with contextlib.suppress(OSError, ValueError):
                stream.close()
