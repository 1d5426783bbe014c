"""What the child processes aiocb starts (the tokenizer's, the grammar compiler's) share:
how one is started and waited for, how it answers, and how one is ended, or let go of in
a process forked from its parent."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import weakref
from collections.abc import Callable
from typing import IO, Any


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


#: the directory ``aiocb`` is imported from here, for a child to import the same
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: bytes of other output a child may write before it is ready
MAX_BANNER = 1 << 16


def launch(module: str, bufsize: int = -1) -> subprocess.Popen[bytes]:
    """A child running ``module`` as its main module (the same aiocb as this process's,
    whatever the working directory holds), its standard input and output piped."""
    start = (
        f"import sys, runpy; sys.path.insert(0, {_PACKAGE_ROOT!r}); runpy.run_module({module!r}, run_name='__main__')"
    )
    return subprocess.Popen(
        [sys.executable, "-c", start], stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=bufsize
    )


def await_ready(read_byte: Callable[[], bytes], ready: bytes, what: str) -> None:
    """Read a child's output a byte at a time (``read_byte``) up to ``ready``: what came
    before it (a site's banner) is no answer."""
    seen = b""
    while not seen.endswith(ready):
        if len(seen) > MAX_BANNER:
            raise EOFError(f"the {what} wrote too much before it was ready")
        seen += read_byte()


def protocol_output() -> IO[bytes]:
    """In a child: its answers' stream, a copy of its standard output, which from now on
    goes to its standard error (what anything prints stays out of the protocol's way); a
    Ctrl-C in the parent's terminal, sent to the child as well, is not its to act on (its
    parent ends it, closing its input or killing it)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    return answers
