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

- first, the tokenizer: ``<BQ`` (0 for its JSON, 1 for the path of a ``tokenizer.json``
  file; the length) and the UTF-8 text, answered by :data:`_READY` and ``<Q`` (its
  vocabulary's size, added tokens included); its standard output is the protocol's alone
  from then on: what the interpreter printed before, a site's banner, is skipped, and
  later prints go to its standard error;
- then one request after another: ``<BqqQ`` (add special tokens; the tokens to keep, 0
  for all; the tokens beyond which, uncut, none are sent but the count, 0 for no bound;
  the text's UTF-8 length) and the text; the answer is ``<BQQ`` (0, the text's token
  count, the ids sent) and the ids as int64, or ``<BQ`` (1, the message's length) and the
  tokenizer's error message.
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import subprocess
import sys
import threading
import weakref
from array import array
from typing import IO, Any, NamedTuple

from aiocb import child_processes
from aiocb.gil import yield_gil

log = logging.getLogger(__name__)

_REQUEST = struct.Struct("<BqqQ")
_ANSWER = struct.Struct("<BQQ")
_ERROR = struct.Struct("<BQ")
_LENGTH = struct.Struct("<Q")
_SOURCE = struct.Struct("<BQ")
#: what the child writes once it has loaded the tokenizer, before its first answer
_READY = b"\x00aiocb-tokenizer-ready\x00"
#: the longest error message an answer may carry
_MAX_MESSAGE = 1 << 16
#: the largest ``keep`` or ``limit`` sent (the protocol's are signed 64-bit)
_MAX_COUNT = 1 << 62
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

    The child loads the tokenizer from ``tokenizer_json`` (its serialised form) or, when
    that is None, from the file ``tokenizer_file``.
    """

    def __init__(
        self, tokenizer_json: str | None, fingerprint: tuple[Any, ...], *, tokenizer_file: str | None = None
    ) -> None:
        if (tokenizer_json is None) == (tokenizer_file is None):
            raise ValueError("give the tokenizer's JSON or its file, one of them")
        #: the file the child loads (None: it loads the JSON it is sent)
        self.tokenizer_file = tokenizer_file
        data = tokenizer_json.encode() if tokenizer_json is not None else os.fsencode(tokenizer_file or "")
        self._source = _SOURCE.pack(int(tokenizer_json is None), len(data)) + data
        #: the child's vocabulary size, added tokens included (None until it started)
        self.vocab_size: int | None = None
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
        """A process for ``tokenizer`` when it is a tokenizers-library tokenizer that a child
        reproduces; else None (the tokenizer runs in this process, as a slow one must).

        The child loads the ``tokenizer.json`` the tokenizer was loaded from, when one is
        found (its folder, or the hub's cache), and else a copy of the tokenizer (``to_str``:
        it holds the GIL, some 90-150 ms for a vocabulary of 151,000). Either is used only
        once it tokenizes a few probe texts, special tokens included, as ``tokenizer`` does,
        with the same vocabulary size: neither a file nor a copy keeps a setting made on the
        tokenizer object, such as ``split_special_tokens``. Blocks the calling thread while
        the child starts and loads (not the GIL): call it from a worker thread.
        """
        backend = getattr(tokenizer, "_tokenizer", None)
        if backend is None or not hasattr(backend, "to_str"):
            return None
        try:
            stamp = fingerprint(tokenizer)
            file = _tokenizer_file(tokenizer)
            if file is not None:
                process = cls(None, stamp, tokenizer_file=file)
                if process.tokenizes_as(tokenizer):
                    return process
                process.close()
            process = cls(backend.to_str(), stamp)
            if process.tokenizes_as(tokenizer):
                return process
            process.close()
            log.info("long prompts are tokenized in-process: the tokenizer differs from its copy")
        except Exception as exc:  # (a tokenizer that cannot be serialised or probed)
            log.info("long prompts are tokenized in-process: %s", exc)
        return None

    def tokenizes_as(self, tokenizer: Any) -> bool:
        """Whether the child (started now if need be) has ``tokenizer``'s vocabulary size and
        tokenizes the probe texts as it does, with and without special tokens."""
        probes = [*_PROBES, "".join(getattr(tokenizer, "all_special_tokens", ())) + " after the specials"]
        try:
            for text in probes:
                for special in (True, False):
                    ids = self.encode(text, add_special_tokens=special, keep=None, limit=None).ids
                    if tokenizer.encode(text, add_special_tokens=special) != ids:
                        return False
        except (TokenizerProcessError, ValueError) as exc:  # (a file it cannot load, a probe refused)
            log.info("the tokenizer process cannot stand in for the tokenizer: %s", exc)
            return False
        return bool(self.vocab_size == tokenizer._tokenizer.get_vocab_size(with_added_tokens=True))

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
        try:
            child = child_processes.launch(__name__, bufsize=1 << 16)
            self._ending = weakref.finalize(self, child_processes.end, child, self._pid)
            assert child.stdin is not None and child.stdout is not None
            child.stdin.write(self._source)
            child.stdin.flush()
            stdout = child.stdout
            child_processes.await_ready(lambda: _read(stdout, 1), _READY, "tokenizer process")
            (self.vocab_size,) = _LENGTH.unpack(_read(stdout, _LENGTH.size))
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
        child_processes.let_go(self._child, self._ending)
        self._child = self._ending = None
        self._lock = threading.Lock()
        self._pid = os.getpid()


class TokenizerProcessHolder:
    """The tokenizer process of one tokenizer: made on first use (off the event loop, by
    :func:`encode_kept`; nothing happens while the holder is made, which may be on a
    running loop: the server's or the manager's construction), made again once the
    tokenizer tokenizes a probe otherwise (a token added, a setting changed: the child's
    tokenizer is stale then), never again once closed."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._lock = threading.Lock()
        self._process: TokenizerProcess | None = None
        self._probed = False
        self._closed = False
        self._pid = os.getpid()

    def get(self) -> TokenizerProcess | None:
        """The process, or None for a tokenizer that cannot have one, or once closed
        (thread-safe; the first call, and the first after the tokenizer changed, waits
        for a child to start: not from an event loop's thread)."""
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


def _tokenizer_file(tokenizer: Any) -> str | None:
    """The ``tokenizer.json`` that ``tokenizer`` was loaded from, when one is found: the
    file named at its construction, its folder's, or the hub's cached copy of its
    repository's (the probes tell a file that no longer matches it)."""
    named = tokenizer.init_kwargs.get("tokenizer_file") if hasattr(tokenizer, "init_kwargs") else None
    source = str(getattr(tokenizer, "name_or_path", "") or "")
    candidates = [named, os.path.join(source, "tokenizer.json") if source and os.path.isdir(source) else None]
    for candidate in candidates:
        if isinstance(candidate, str) and os.path.isfile(candidate):
            return candidate
    if not source or os.path.exists(source):
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(source, "tokenizer.json")
    except Exception:  # (not a repository's name)
        return None
    return cached if isinstance(cached, str) and os.path.isfile(cached) else None


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


def _answer(stdout: IO[bytes], bound: int) -> Tokenized:
    """The child's answer; ``bound``: the most ids it may send (0: any number up to the
    count). Raises _Refused with the tokenizer's message, and ValueError for an answer
    out of step."""
    status = _read(stdout, 1)[0]
    if status == 1:
        (length,) = _LENGTH.unpack(_read(stdout, _LENGTH.size))
        if length > _MAX_MESSAGE:
            raise ValueError(f"an error message of {length} bytes")
        raise _Refused(_read(stdout, length).decode(errors="replace"))
    if status != 0:
        raise ValueError(f"an answer with status {status}")
    total, count = struct.unpack("<QQ", _read(stdout, _ANSWER.size - 1))
    if count > total or (bound and count > bound):
        raise ValueError(f"an answer of {count} ids for {total} tokens")
    ids = array("q")
    ids.frombytes(_read(stdout, 8 * count))
    return Tokenized(_as_list(ids), total)


#: Ids made a list in one call (a fraction of a millisecond).
_LIST_SLICE = 1 << 16


def _as_list(ids: array[int]) -> list[int]:
    """``ids`` as a list, a slice at a time with pauses for the event loop's thread (made in
    one call, 2.2 million of them held the GIL some 20 ms)."""
    if len(ids) <= _LIST_SLICE:
        return ids.tolist()
    listed: list[int] = []
    for start in range(0, len(ids), _LIST_SLICE):
        listed += ids[start : start + _LIST_SLICE].tolist()
        yield_gil()
    return listed


def _read(stream: IO[bytes], size: int) -> bytes:
    data = stream.read(size)
    if len(data) != size:
        raise EOFError(f"the tokenizer process ended ({len(data)} of {size} bytes read)")
    return data


def _serve(stdin: IO[bytes], stdout: IO[bytes]) -> None:
    """The child: tokenize each text it is sent, until its input ends."""
    from tokenizers import Tokenizer

    kind, length = _SOURCE.unpack(_read(stdin, _SOURCE.size))
    source = _read(stdin, length)
    tokenizer = Tokenizer.from_file(os.fsdecode(source)) if kind == 1 else Tokenizer.from_str(source.decode())
    stdout.write(_READY + _LENGTH.pack(tokenizer.get_vocab_size(with_added_tokens=True)))
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
    _serve(sys.stdin.buffer, child_processes.protocol_output())
