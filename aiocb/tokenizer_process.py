"""Long prompts tokenized in a child process, so that the event loop's process never
holds the GIL for them.

The tokenizers library lets the GIL go while it encodes, but not while it hands the
result over or frees it: a 6-million-character prompt (within the server's default body
limit) held the event loop for 70-240 ms from a worker thread, mostly in building and
freeing its two million tokens' Python lists and Rust strings. A prompt is only
generated from when it fits the model's context, and a cut one keeps its last few
tokens, so the child sends back just those tokens and the count: what crosses into the
loop's process is bounded by the context, whatever the text's length.

The child runs this module (``python -m aiocb.tokenizer_process``): the standard library
and ``tokenizers``, no torch nor transformers (a start of about 0.1 s). It reads frames on
its standard input and answers each on its standard output:

- first, the tokenizer as its JSON (a ``<Q`` length, then the UTF-8 text), answered by
  :data:`_READY` (its standard output is the protocol's alone from then on: what the
  interpreter printed before, a site's banner, is skipped, and later prints go to its
  standard error);
- then one request after another: ``<BqqQ`` (add special tokens; the tokens to keep, 0
  for all; the tokens beyond which, uncut, none are sent but the count, 0 for no bound;
  the text's UTF-8 length) and the text; the answer is ``<BQQ`` (0, the text's token
  count, the ids sent) and the ids as int64, or ``<BQ`` (1, the message's length) and the
  tokenizer's error message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import struct
import subprocess
import sys
import threading
import weakref
from array import array
from typing import IO, Any, NamedTuple

log = logging.getLogger(__name__)

_REQUEST = struct.Struct("<BqqQ")
_ANSWER = struct.Struct("<BQQ")
_ERROR = struct.Struct("<BQ")
_LENGTH = struct.Struct("<Q")
#: what the child writes once it has loaded the tokenizer, before its first answer
_READY = b"\x00aiocb-tokenizer-ready\x00"
#: bytes of other output a child may write before it is ready
_MAX_BANNER = 1 << 16
#: the largest ``keep`` or ``limit`` sent (the protocol's are signed 64-bit)
_MAX_COUNT = 1 << 62
#: the directory ``aiocb`` is imported from here, for the child to import the same
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: characters encoded to UTF-8 at a time when a text is sent (each a short hold of the GIL)
_SEND_CHARS = 1 << 16
#: Prompts longer than this many characters are worth the child (one of this length holds
#: the GIL well under a millisecond when tokenized in the loop's process).
PROCESS_PROMPT_CHARS = 1 << 15
#: texts the loop's tokenizer and the child's must tokenize alike before the child is used
_PROBES = (
    "Hello, world!",
    "  two leading spaces\n\n\tand a tab",
    "def f(x):\n    return x ** 2  # squares\n",
    "ünïcödé, 中文, emoji 🙂, and a zero-width\u200bspace",
    "1234567890 3.14159 -42",
)


class Tokenized(NamedTuple):
    """A prompt's token ids, perhaps cut, and how many tokens the whole text made."""

    ids: list[int]
    total: int


class TokenizerProcessError(RuntimeError):
    """The child process failed or went away (the caller tokenizes in its own process)."""


class _Refused(Exception):
    """The child's tokenizer refused the text (its message)."""


class TokenizerProcess:
    """The parent's side of the child: one text at a time (a lock), from any thread.

    The child starts on first use, and again after it fails or in a process forked from
    this one (which must not share the parent's). A call blocks its thread (not the GIL)
    while the child works: it is made from a worker thread, never an event loop's.
    """

    def __init__(self, tokenizer_json: str, fingerprint: tuple[Any, ...]) -> None:
        self._json = tokenizer_json.encode()
        #: what the tokenizer made of a probe when it was copied (otherwise since: a token
        #: added, a setting changed, and the copy is stale)
        self.fingerprint = fingerprint
        self._lock = threading.Lock()
        self._child: subprocess.Popen[bytes] | None = None
        #: ends the child when this object goes without being closed
        self._ending: weakref.finalize[Any, Any] | None = None
        self._pid = os.getpid()
        self._closed = False

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> TokenizerProcess | None:
        """A process for ``tokenizer`` when it is a tokenizers-library tokenizer whose own
        ``encode`` the copy the child loads reproduces (on a few probe texts, special tokens
        included: a copy keeps no setting made on the tokenizer object, such as
        ``split_special_tokens``); else None (the tokenizer runs in this process, as a slow
        one must)."""
        backend = getattr(tokenizer, "_tokenizer", None)
        if backend is None or not hasattr(backend, "to_str"):
            return None
        probes = [*_PROBES, "".join(getattr(tokenizer, "all_special_tokens", ())) + " after the specials"]
        try:
            from tokenizers import Tokenizer

            copied = backend.to_str()
            copy = Tokenizer.from_str(copied)
            for text in probes:
                for special in (True, False):
                    ids = copy.encode(text, add_special_tokens=special).ids
                    if tokenizer.encode(text, add_special_tokens=special) != ids:
                        log.info("long prompts are tokenized in-process: the tokenizer differs from its copy")
                        return None
            return cls(copied, fingerprint(tokenizer))
        except Exception as exc:  # (a tokenizer that cannot be serialised or probed)
            log.info("long prompts are tokenized in-process: %s", exc)
            return None

    def encode(self, text: str, *, add_special_tokens: bool, keep: int | None, limit: int | None) -> Tokenized:
        """``text``'s token ids: the last ``keep`` of them when given, else all of them, or
        none when there are more than ``limit`` (the caller refuses the prompt by its count).

        Raises UnicodeEncodeError for text that is not Unicode (a lone surrogate), ValueError
        with the tokenizer's message when it refuses the text, and TokenizerProcessError
        when the child fails or the process was closed.
        """
        pieces = [text[i : i + _SEND_CHARS].encode() for i in range(0, len(text), _SEND_CHARS)]
        size = sum(map(len, pieces))
        keep, limit = (max(0, min(bound or 0, _MAX_COUNT)) for bound in (keep, limit))
        header = _REQUEST.pack(add_special_tokens, keep, limit, size)
        if self._pid != os.getpid():
            self._forked()
        with self._lock:
            child = self._started()
            try:
                assert child.stdin is not None and child.stdout is not None
                child.stdin.write(header)
                for piece in pieces:
                    child.stdin.write(piece)
                child.stdin.flush()
                return _answer(child.stdout, keep or limit)
            except _Refused as exc:  # (the child is in step, and kept)
                raise ValueError(str(exc)) from None
            except Exception as exc:  # (a pipe closed, an answer out of step: the child goes)
                self._stop()
                raise TokenizerProcessError(f"the tokenizer process failed: {exc!r}") from None
            except BaseException:  # (interrupted mid-answer: the stream is out of step)
                self._stop()
                raise

    def close(self) -> None:
        """End the child at once (at shutdown: without waiting for a text it is tokenizing,
        whose caller then tokenizes in its own process); later calls are refused, and a
        child a call was starting meanwhile is ended as soon as it is made."""
        self._closed = True
        self._stop()

    def _started(self) -> subprocess.Popen[bytes]:
        if self._closed:
            raise TokenizerProcessError("the tokenizer process was closed")
        if self._child is not None and self._child.poll() is None:
            return self._child
        self._stop()  # (a child that died: its pipes closed now, not when this object goes)
        # The same aiocb as this process's, whatever the working directory holds.
        start = (
            f"import sys, runpy; sys.path.insert(0, {_PACKAGE_ROOT!r}); "
            f"runpy.run_module({__name__!r}, run_name='__main__')"
        )
        try:
            child = subprocess.Popen(
                [sys.executable, "-c", start], stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=1 << 16
            )
            self._ending = weakref.finalize(self, _end, child, self._pid)
            assert child.stdin is not None and child.stdout is not None
            child.stdin.write(_LENGTH.pack(len(self._json)) + self._json)
            child.stdin.flush()
            _await_ready(child.stdout)
        except Exception as exc:  # (no interpreter to start, no pipe, a child that died or babbled)
            self._stop()
            raise TokenizerProcessError(f"the tokenizer process did not start: {exc!r}") from None
        self._child = child
        if self._closed:  # (closed while it started)
            self._stop()
            raise TokenizerProcessError("the tokenizer process was closed")
        return child

    def _stop(self) -> None:
        ending, self._ending, self._child = self._ending, None, None
        if ending is not None:
            ending()

    def _forked(self) -> None:
        """In a process forked from the one that made the child: let go of the parent's
        child (it is not this process's to end) and of a lock a parent's thread may have
        held at the fork."""
        if self._ending is not None:
            self._ending.detach()
        for stream in (self._child.stdin, self._child.stdout) if self._child is not None else ():
            if stream is not None:
                with contextlib.suppress(OSError, ValueError):
                    stream.close()
        self._child = self._ending = None
        self._lock = threading.Lock()
        self._pid = os.getpid()


def _end(child: subprocess.Popen[bytes], pid: int) -> None:
    """End the child made by process ``pid`` and close its pipes (only close them in a
    process forked from that one: the child is not its to end)."""
    if os.getpid() == pid and child.poll() is None:
        child.kill()  # (idle, it holds nothing; busy, its caller tokenizes in its own process)
        child.wait()
    for stream in (child.stdin, child.stdout):
        if stream is not None:
            with contextlib.suppress(OSError, ValueError):
                stream.close()


class TokenizerProcessHolder:
    """The tokenizer process of one tokenizer: probed when the holder is made (the copy
    and the probe hold the GIL: with a large vocabulary, better while the server or the
    manager is built than under a request), its child started on first use, the process
    made again once the tokenizer tokenizes a probe otherwise (a token added, a setting
    changed: its copy is stale then), never again once closed."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._lock = threading.Lock()
        self._process: TokenizerProcess | None = None
        self._probed = False
        self._closed = False
        self._pid = os.getpid()
        self.get()

    def get(self) -> TokenizerProcess | None:
        """The process, or None for a tokenizer that cannot have one, or once closed
        (thread-safe)."""
        if self._pid != os.getpid():  # (forked: a lock a parent's thread held stays held here)
            self._lock, self._pid, self._process, self._probed = threading.Lock(), os.getpid(), None, False
        with self._lock:
            stale = self._process is not None and self._process.fingerprint != fingerprint(self.tokenizer)
            if (not self._probed or stale) and not self._closed:
                self._end()
                self._process = TokenizerProcess.for_tokenizer(self.tokenizer)
                self._probed = True
            if self._closed:  # (closed while the probe ran: its process goes too)
                self._end()
            return self._process

    def close(self) -> None:
        """End the process, if one was made, at once (without waiting for a probe or a
        text in progress: their callers tokenize in their own process)."""
        self._closed = True
        self._end()

    def _end(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            process.close()


def encode_kept(
    text: str,
    tokenizer: Any,
    processes: TokenizerProcessHolder | None,
    *,
    add_special_tokens: bool,
    keep: int | None,
    limit: int | None,
) -> Tokenized:
    """``text``'s token ids, the last ``keep`` of them when given (-1: ``limit`` of them;
    else all, or none when there are more than ``limit``), and how many the whole text
    made: from the tokenizer process when the text is long and ``tokenizer`` can have one,
    else from ``tokenizer`` itself (also when the process fails, with a warning). The process is not used from an
    event loop's thread (a small body whose template makes a long text: the loop must not
    wait for the child while a worker thread's long prompt holds it). Thread-safe; raises
    what either raises for text they cannot take.
    """
    keep = limit if keep == -1 else keep
    if processes is not None and len(text) > PROCESS_PROMPT_CHARS and not _on_a_loop():
        process = processes.get()
        if process is not None:
            try:
                return process.encode(text, add_special_tokens=add_special_tokens, keep=keep, limit=limit)
            except TokenizerProcessError as exc:
                log.warning("%s; tokenizing in this process", exc)
    ids: list[int] = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return Tokenized(ids[len(ids) - keep :] if keep and len(ids) > keep else ids, len(ids))


def _on_a_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def fingerprint(tokenizer: Any) -> tuple[Any, ...]:
    """What ``tokenizer`` makes of a probe with special tokens in it, with and without
    its own (and its length): a copy made when this was different is stale."""
    probe = "".join(getattr(tokenizer, "all_special_tokens", ())) + _PROBES[1]
    return (len(tokenizer), *(tuple(tokenizer.encode(probe, add_special_tokens=s)) for s in (True, False)))


def _await_ready(stdout: IO[bytes]) -> None:
    """Read the child's output up to :data:`_READY` (what came before it is no answer)."""
    seen = b""
    while not seen.endswith(_READY):
        if len(seen) > _MAX_BANNER:
            raise EOFError("the tokenizer process wrote too much before it was ready")
        seen += _read(stdout, 1)


def _answer(stdout: IO[bytes], bound: int) -> Tokenized:
    """The child's answer; ``bound``: the most ids it may send (0: any number up to the
    count). Raises _Refused with the tokenizer's message, and ValueError for an answer
    out of step."""
    status = _read(stdout, 1)[0]
    if status == 1:
        (length,) = _LENGTH.unpack(_read(stdout, _LENGTH.size))
        if length > _MAX_BANNER:
            raise ValueError(f"an error message of {length} bytes")
        raise _Refused(_read(stdout, length).decode(errors="replace"))
    if status != 0:
        raise ValueError(f"an answer with status {status}")
    total, count = struct.unpack("<QQ", _read(stdout, _ANSWER.size - 1))
    if count > total or (bound and count > bound):
        raise ValueError(f"an answer of {count} ids for {total} tokens")
    ids = array("q")
    ids.frombytes(_read(stdout, 8 * count))
    return Tokenized(ids.tolist(), total)


def _read(stream: IO[bytes], size: int) -> bytes:
    data = stream.read(size)
    if len(data) != size:
        raise EOFError(f"the tokenizer process ended ({len(data)} of {size} bytes read)")
    return data


def _serve(stdin: IO[bytes], stdout: IO[bytes]) -> None:
    """The child: tokenize each text it is sent, until its input ends."""
    from tokenizers import Tokenizer

    (length,) = _LENGTH.unpack(_read(stdin, _LENGTH.size))
    tokenizer = Tokenizer.from_str(_read(stdin, length).decode())
    stdout.write(_READY)
    stdout.flush()
    while header := stdin.read(_REQUEST.size):
        if len(header) != _REQUEST.size:
            return
        special, keep, limit, size = _REQUEST.unpack(header)
        text = _read(stdin, size).decode()
        try:
            ids = tokenizer.encode(text, add_special_tokens=bool(special)).ids
        except Exception as exc:  # (its message goes back to the request)
            message = str(exc).encode()
            stdout.write(_ERROR.pack(1, len(message)) + message)
            stdout.flush()
            continue
        total = len(ids)
        if keep and total > keep:
            ids = ids[total - keep :]
        elif not keep and limit and total > limit:
            ids = []
        stdout.write(_ANSWER.pack(0, total, len(ids)) + array("q", ids).tobytes())
        stdout.flush()


if __name__ == "__main__":
    # Its parent ends it (closing its input, or killing it); a Ctrl-C in the parent's
    # terminal, sent to the child as well, is not its to act on.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The answers go out on a copy of the standard output; what anything prints from now
    # on goes to the standard error, out of the protocol's way.
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    _serve(sys.stdin.buffer, answers)
