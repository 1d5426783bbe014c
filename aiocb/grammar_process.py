"""Constraints compiled first in a child process, under a deadline, so that no constraint
compiles in the engine's process for longer than it.

xgrammar's compile cannot be stopped, and its time grows fast with a constraint's shape: a
JSON schema of 1,000 optional properties (28 KB) took 12 s on a 2-core machine, 400 levels
of nesting (24 KB) 18 s, 2,000 objects of 10 optional properties minutes. A client could otherwise keep
a core busy for as long as it liked, and the compile lane of every other constraint with
it. A compiled grammar cannot be brought back cheaply (xgrammar's serialised form of a
3 MB grammar is 400 MB of JSON), so the child makes and compiles the constraint's grammar
exactly as the engine's process does (``aiocb.structured.compiler_input``, then the
compile) to learn whether it does so within the deadline, and is killed, with its compile,
where it does not; one that did is made and compiled again in the engine's process, in
about the same time.

The child runs this module (``python -m aiocb.grammar_process``; xgrammar imports torch and
transformers: a start of some 3 s and 260 MiB). The children of a vocabulary are shared by
every manager of the process (:func:`shared`): one is started whenever a constraint finds
none idle (each compile lane of each manager holds at most one at a time), and one idle
for :data:`IDLE_EXIT_S` is ended by a watcher thread. A child ends with its parent (it
watches its parent's id). It reads frames on its standard input and answers each on its
standard output:

- first, the vocabulary: ``<BQ`` (the compiler's threads; the length) and the UTF-8 JSON of
  xgrammar's ``TokenizerInfo``, answered by :data:`_READY`; its standard output is the
  protocol's alone from then on;
- then one constraint after another: ``<BQ`` (its kind's index in :data:`KINDS`; the
  length) and its UTF-8 text, answered ``<BQ`` (0, 0) when it compiled, or (1, the
  message's length) and the refusal's message.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import select
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections import OrderedDict
from typing import IO, Any

from aiocb import child_processes

_FRAME = struct.Struct("<BQ")
#: what the child writes once it has its compiler, before its first answer
_READY = b"\x00aiocb-grammar-ready\x00"
#: the longest refusal message an answer may carry
_MAX_MESSAGE = 1 << 20
#: how long a child may take to start (the imports of torch and transformers)
START_TIMEOUT_S = 120.0
#: the kinds of constraint, by their index in the protocol
KINDS = ("json_schema", "regex", "structural_tag", "grammar")
#: constraints remembered as past a deadline (refused again at once under one no longer)
_REMEMBERED = 1024
#: seconds an idle child is kept
IDLE_EXIT_S = 900.0
#: how often a child looks for its parent
_PARENT_CHECK_S = 1.0


class CompileTimeout(Exception):
    """A constraint did not compile within the deadline (its compile was stopped)."""


class GrammarProcessError(RuntimeError):
    """The child did not start (the caller compiles in its own process)."""


class CompileFailed(RuntimeError):
    """The child ended, or answered out of step, while it compiled a constraint (one that
    crashed it would crash the engine's process too)."""


class GrammarProcess:
    """One child: one constraint at a time, from any thread but an event loop's (a call
    blocks its thread, not the GIL, while the child works)."""

    def __init__(self, tokenizer_info_json: str, max_threads: int) -> None:
        self._info = tokenizer_info_json.encode()
        self._threads = max_threads
        self._child: subprocess.Popen[bytes] | None = None
        self._ending: weakref.finalize[Any, Any] | None = None
        #: when the child last answered
        self.last_used = time.monotonic()

    def compiles(self, kind: str, text: str, timeout_s: float) -> str | None:
        """None if the constraint ``(kind, text)`` compiles within ``timeout_s`` seconds,
        else the message of its refusal. Raises :class:`CompileTimeout` past the deadline
        (the child is killed; the next call starts another), :class:`GrammarProcessError`
        when no child starts and :class:`CompileFailed` when the child fails."""
        child = self._started()
        data = text.encode()
        try:
            assert child.stdin is not None and child.stdout is not None
            child.stdin.write(_FRAME.pack(KINDS.index(kind), len(data)))
            child.stdin.write(data)
            child.stdin.flush()
            status, length = _FRAME.unpack(_read(child.stdout, _FRAME.size, time.monotonic() + timeout_s))
            self.last_used = time.monotonic()
            if status == 0 and length == 0:
                return None
            if status != 1 or length > _MAX_MESSAGE:
                raise ValueError(f"an answer ({status}, {length}) out of step")
            return _read(child.stdout, length, time.monotonic() + START_TIMEOUT_S).decode(errors="replace")
        except TimeoutError:
            self.close()
            raise CompileTimeout from None
        except Exception as exc:  # (a pipe closed, an answer out of step: the child goes)
            try:
                code: int | None = child.wait(timeout=1.0)  # (its output closed as it ended)
            except subprocess.TimeoutExpired:
                code = None
            self.close()
            ended = f"it ended with status {code}" if code is not None else repr(exc)
            raise CompileFailed(f"the process compiling it failed ({ended})") from None
        except BaseException:  # (interrupted mid-answer: the stream is out of step)
            self.close()
            raise

    def close(self) -> None:
        """End the child at once (a compile it is running with it)."""
        ending, self._ending, self._child = self._ending, None, None
        if ending is not None:
            ending()

    def forget(self) -> None:
        """Let go of the child without ending it (in a process forked from its parent's:
        only this process's ends of its pipes are closed)."""
        child_processes.let_go(self._child, self._ending)
        self._child = self._ending = None

    def _started(self) -> subprocess.Popen[bytes]:
        if self._child is not None and self._child.poll() is None:
            return self._child
        self.close()  # (one that died: its pipes closed)
        try:
            child = child_processes.launch(__name__)
            self._ending = weakref.finalize(self, child_processes.end, child, os.getpid())
            assert child.stdin is not None and child.stdout is not None
            child.stdin.write(_FRAME.pack(self._threads, len(self._info)) + self._info)
            child.stdin.flush()
            deadline, stdout = time.monotonic() + START_TIMEOUT_S, child.stdout
            child_processes.await_ready(lambda: _read(stdout, 1, deadline), _READY, "grammar process")
        except Exception as exc:  # (no interpreter, no xgrammar there, a child that died or babbled)
            self.close()
            raise GrammarProcessError(f"the grammar process did not start: {exc!r}") from None
        self._child = child
        return child


class GrammarProcesses:
    """The children of one vocabulary, and the constraints found past a deadline."""

    def __init__(self, tokenizer_info_json: str, max_threads: int) -> None:
        self._info = tokenizer_info_json
        self._threads = max_threads
        self._lock = threading.Lock()
        self._idle: list[GrammarProcess] = []
        #: the longest deadline each constraint was found past (by its digest)
        self._too_slow: OrderedDict[bytes, float] = OrderedDict()
        self._pid = os.getpid()
        self._watcher: threading.Thread | None = None
        self._closed = False

    def compiles(self, kind: str, text: str, timeout_s: float) -> str | None:
        """:meth:`GrammarProcess.compiles` in an idle child, or a new one; raises
        :class:`CompileTimeout` at once for a constraint found past a deadline as long."""
        key = hashlib.sha256(f"{kind}\0{text}".encode()).digest()
        with self._lock:
            if self._pid != os.getpid():  # (forked: the parent's children are not this process's)
                for process in self._idle:
                    process.forget()
                self._idle, self._watcher, self._pid = [], None, os.getpid()
            if self._closed:
                raise GrammarProcessError("the grammar processes were closed")
            failed_under = self._too_slow.get(key)
            if failed_under is not None and timeout_s <= failed_under:
                self._too_slow.move_to_end(key)
                raise CompileTimeout
            process = self._idle.pop() if self._idle else GrammarProcess(self._info, self._threads)
            if self._watcher is None:
                self._watcher = threading.Thread(target=self._end_idle, name="aiocb-grammar-idle", daemon=True)
                self._watcher.start()
        try:
            return process.compiles(kind, text, timeout_s)
        except CompileTimeout:
            with self._lock:
                self._too_slow[key] = max(timeout_s, self._too_slow.get(key, 0.0))
                self._too_slow.move_to_end(key)
                while len(self._too_slow) > _REMEMBERED:
                    self._too_slow.popitem(last=False)
            raise
        finally:
            with self._lock:
                if self._closed:
                    process.close()
                else:
                    self._idle.append(process)

    def close(self) -> None:
        """End every idle child (one compiling ends as its compile does; later calls are
        refused)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for process in idle:
            process.close()

    def _end_idle(self) -> None:
        """The watcher: end the children idle for :data:`IDLE_EXIT_S` (their processes kept
        for later constraints, which start new ones)."""
        pid = os.getpid()
        while not self._closed and self._pid == pid:
            time.sleep(min(IDLE_EXIT_S / 4, 60.0))
            with self._lock:
                stale = [p for p in self._idle if time.monotonic() - p.last_used > IDLE_EXIT_S]
            for process in stale:  # (a stale one taken meanwhile restarts its child when used)
                process.close()


#: the children of each vocabulary, by its digest and the compiler's threads (see :func:`shared`)
_SHARED: dict[tuple[bytes, int], GrammarProcesses] = {}
_SHARED_LOCK = threading.Lock()


def shared(tokenizer_info_json: str, max_threads: int) -> GrammarProcesses:
    """The children of this vocabulary (xgrammar's ``TokenizerInfo`` as JSON) and number of
    compiler threads, made on first use and shared by the process's managers."""
    key = (hashlib.sha256(tokenizer_info_json.encode()).digest(), max_threads)
    with _SHARED_LOCK:
        processes = _SHARED.get(key)
        if processes is None:
            processes = _SHARED[key] = GrammarProcesses(tokenizer_info_json, max_threads)
        return processes


def _read(stream: IO[bytes], size: int, deadline: float) -> bytes:
    """``size`` bytes of the child's output by ``deadline`` (TimeoutError), read from its
    file descriptor (never through the stream's buffer, which ``select`` does not see)."""
    data = b""
    while len(data) < size:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([stream], [], [], left)[0]:
            raise TimeoutError
        chunk = os.read(stream.fileno(), size - len(data))
        if not chunk:
            raise EOFError(f"the grammar process ended ({len(data)} of {size} bytes read)")
        data += chunk
    return data


def _watch_parent(parent: int) -> None:
    """End this process once its parent is gone (it is then another's child), even while it
    compiles (xgrammar lets the GIL go)."""
    while os.getppid() == parent:
        time.sleep(_PARENT_CHECK_S)
    os._exit(0)


def _serve(stdin: IO[bytes], stdout: IO[bytes]) -> None:
    """The child: make and compile each constraint it is sent, until its input ends."""
    import xgrammar

    from aiocb.errors import InvalidRequestError
    from aiocb.structured import compiler_input, not_compiled

    threads, length = _FRAME.unpack(stdin.read(_FRAME.size))
    info = xgrammar.TokenizerInfo.deserialize_json(stdin.read(length).decode())
    compiler = xgrammar.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
    stdout.write(_READY)
    stdout.flush()
    while len(header := stdin.read(_FRAME.size)) == _FRAME.size:
        index, length = _FRAME.unpack(header)
        kind, text = KINDS[index], stdin.read(length).decode()
        try:
            method, argument = compiler_input(kind, text)
            getattr(compiler, f"compile_{method}")(argument)
        except Exception as exc:  # (its refusal's message goes back to the request)
            refusal = exc if isinstance(exc, InvalidRequestError) else not_compiled(kind, exc)
            message = str(refusal.args[0]).encode()[:_MAX_MESSAGE]
            stdout.write(_FRAME.pack(1, len(message)) + message)
        else:
            stdout.write(_FRAME.pack(0, 0))
        stdout.flush()


if __name__ == "__main__":
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    # A constraint that takes all memory: the kernel's out-of-memory killer takes this
    # process first, not the engine's.
    with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "w") as adjust:
        adjust.write("1000")
    _serve(sys.stdin.buffer, child_processes.protocol_output())  # (xgrammar's warnings to stderr)
    os._exit(0)  # (nothing to tear down: torch's teardown took a second)
