"""The server's bounds on what one request may cost, and the checks that enforce them.

Every bound has a flag of ``aiocb serve`` and a default here; each refusal is an
OpenAI-shaped error that names the bound (and the flag that raises it), so a client knows
what to change and an operator knows what to tune. The checks run before the expensive
work they protect: the body size before the body is read whole, the nesting depth while
JSON is parsed, a prompt's character count before it is tokenized.
"""

from __future__ import annotations

import json
import json.scanner
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from aiocb.gil import yield_gil
from aiocb.server.protocol import APIError, SamplingRequest, bad_request

MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """What one request may cost the server. ``0`` turns a count bound off.

    Attributes:
        max_request_bytes: request body size; larger ones get 413, refused from their
            ``Content-Length`` before the body is read, or as soon as a body sent without
            one grows past it.
        max_json_depth: nesting of arrays and objects in a JSON body (400 beyond).
        max_stop_strings: stop strings per request (400 beyond).
        max_stop_string_chars: characters of one stop string (400 beyond).
        max_concurrent_requests: requests on the API routes in flight at once, streams
            counted until they end; one more gets 429 with ``Retry-After``. Each API
            worker process (``--api-workers``) counts its own.
        max_choices: choices one request may ask for, its prompts times ``n`` (400 beyond).
        max_token_ids: entries of each token-id list or map of a request: ``logit_bias``,
            ``allowed_token_ids``, ``stop_token_ids``, and ``bad_words`` (their words, and
            the tokens they make; 16 characters a token before they are tokenized) (400
            beyond; each prompt's choices carry them).
        max_echo_logprobs: echoed prompt logprobs one request may ask for: its prompts'
            tokens times one plus ``logprobs`` (the alternatives), times ``n`` (400 beyond:
            a body of a few megabytes could otherwise ask for gigabytes of them).
        body_timeout: seconds a client may take to send its body once its headers have
            arrived (408 beyond).
        send_timeout: seconds a response may wait for the client to take its next bytes;
            beyond, the client is taken to have stopped reading: its request is cancelled
            and the connection closed.
        retry_after: seconds a 429 or 503 response tells the client to wait.
    """

    max_request_bytes: int = 8 * MiB
    max_json_depth: int = 64
    max_stop_strings: int = 64
    max_stop_string_chars: int = 1024
    max_concurrent_requests: int = 1024
    max_choices: int = 1024
    max_token_ids: int = 4096
    max_echo_logprobs: int = 1 << 20
    body_timeout: float = 60.0
    send_timeout: float = 60.0
    retry_after: int = 1

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_json_depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        counts = (
            "max_stop_strings",
            "max_stop_string_chars",
            "max_concurrent_requests",
            "max_choices",
            "max_token_ids",
            "max_echo_logprobs",
            "retry_after",
        )
        for name in counts:
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: no bound), got {getattr(self, name)}")
        for name in ("body_timeout", "send_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {getattr(self, name)}")

    def too_large(self, size: int | None = None) -> APIError:
        """The 413 for a body over :attr:`max_request_bytes`."""
        said = f" ({size} bytes)" if size is not None else ""
        return APIError(
            413,
            f"the request body{said} is larger than the server's limit of {self.max_request_bytes} bytes "
            "(--max-request-bytes)",
            code="request_too_large",
        )

    def declared_too_large(self, content_length: str | None) -> APIError | None:
        """The 413 for a body whose ``Content-Length`` header declares more than
        :attr:`max_request_bytes`; None otherwise, also for a header that is not a count in
        ASCII digits (``str.isdigit`` takes superscripts too), whose body is bounded as it arrives."""
        if content_length is None or not (content_length.isascii() and content_length.isdigit()):
            return None
        size = int(content_length)
        return self.too_large(size) if size > self.max_request_bytes else None

    def check_stop(self, stop: tuple[str, ...]) -> None:
        """Refuse too many or too long stop strings."""
        if self.max_stop_strings and len(stop) > self.max_stop_strings:
            raise bad_request(
                f"'stop' has {len(stop)} strings; the server allows at most {self.max_stop_strings} "
                "(--max-stop-strings)",
                "stop",
            )
        longest = max(map(len, stop), default=0)
        if self.max_stop_string_chars and longest > self.max_stop_string_chars:
            raise bad_request(
                f"a 'stop' string has {longest} characters; the server allows at most "
                f"{self.max_stop_string_chars} (--max-stop-string-chars)",
                "stop",
            )

    def check_token_ids(self, sampling: SamplingRequest) -> None:
        """Refuse a token-id list or map (``logit_bias``, ``allowed_token_ids``,
        ``stop_token_ids``, ``bad_words``: its words, before they are tokenized) of more
        than :attr:`max_token_ids` entries."""
        lists = {
            "stop_token_ids": sampling.stop_token_ids,
            "bad_words": sampling.bad_words,
            "logit_bias": sampling.controls.get("logit_bias", ()),
            "allowed_token_ids": sampling.controls.get("allowed_token_ids", ()),
        }
        for name, ids in lists.items():
            if self.max_token_ids and len(ids) > self.max_token_ids:
                raise bad_request(
                    f"'{name}' has {len(ids)} entries; the server allows at most {self.max_token_ids} "
                    "(--max-token-ids)",
                    name,
                )

    def check_echo_logprobs(self, prompt_tokens: int, alternatives: int, n: int) -> None:
        """Refuse an echo of more prompt logprobs than :attr:`max_echo_logprobs`:
        ``prompt_tokens`` (all prompts') times ``1 + alternatives``, times ``n``."""
        asked = prompt_tokens * (1 + alternatives) * n
        if self.max_echo_logprobs and asked > self.max_echo_logprobs:
            raise bad_request(
                f"echoing the prompts' logprobs asks for {asked} of them ({prompt_tokens} prompt tokens times "
                f"{1 + alternatives} (the token and its logprobs = {alternatives} alternatives) times n = {n}); "
                f"the server allows at most {self.max_echo_logprobs} (--max-echo-logprobs)",
                "logprobs",
            )

    def check_choices(self, prompts: int, n: int, max_queue_size: int = 0) -> None:
        """Refuse a request for more choices (prompts times ``n``) than :attr:`max_choices`,
        or than the engine's admission queue holds (``max_queue_size``, 0: no bound): they
        are queued together, without waiting for room, so such a request could never be
        taken (429 for ever)."""
        choices = prompts * n
        said = f"{prompts} prompts times n = {n}" if prompts > 1 else f"n = {n}"
        param = "prompt" if prompts > 1 else "n"
        if self.max_choices and choices > self.max_choices:
            raise bad_request(
                f"the request asks for {choices} choices ({said}); the server allows at most "
                f"{self.max_choices} (--max-choices)",
                param,
            )
        if max_queue_size and choices > max_queue_size:
            raise bad_request(
                f"the request asks for {choices} choices ({said}), more than the engine's admission queue "
                f"holds: {max_queue_size} (--max-queue-size)",
                param,
            )


async def read_body(chunks: AsyncIterator[bytes], limits: ServerLimits) -> bytes:
    """The whole body from ``chunks``, refused with 413 as soon as it outgrows the limit."""
    parts: list[bytes] = []
    size = 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limits.max_request_bytes:
            raise limits.too_large()
        parts.append(chunk)
    return b"".join(parts)


def parse_json(body: bytes, max_depth: int) -> Any:
    """The JSON value of ``body``; a 400 when it is not JSON or nests deeper than ``max_depth``.

    A large body is parsed a bounded piece at a time (:class:`_SlicedParser`): parsed in one
    call, seven megabytes of small values held the GIL, and so the event loop, for a third
    of a second, though the parsing ran in the tokenizer thread.
    """
    if not body:
        raise bad_request("the request has no body; send a JSON object")
    try:
        if len(body) > _WHOLE_BYTES:
            text = body.decode(json.detect_encoding(body), "surrogatepass")  # (as json.loads does)
            return _SlicedParser(text, max_depth).parse()
        value = json.loads(body)
    except RecursionError:
        raise _too_deep(max_depth) from None
    except ValueError as exc:  # not JSON, not UTF-8, or an integer of more digits than Python converts
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    # No body with fewer brackets than the bound can nest deeper than it: the common case
    # (a prompt, even a list of a million token ids) skips the walk.
    if body.count(b"[") + body.count(b"{") > max_depth and _depth_exceeds(value, max_depth):
        raise _too_deep(max_depth)
    return value


#: Bodies up to this size are parsed in one call (about a millisecond at most).
_WHOLE_BYTES = 1 << 16
#: Characters a sliced parse hands the C parser in one call (a fraction of a millisecond).
_PIECE_CHARS = 1 << 14
#: The C scanner: the value at an index of a text, and where it ends (typeshed types the
#: scanner's class as its own argument).
_scan: Callable[[str, int], tuple[Any, int]] = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[arg-type]
_WHITESPACE = re.compile(r"[ \t\n\r]*")
#: The C decoder of a JSON string's contents (its text, the index after its opening quote).
_scan_string: Callable[[str, int], tuple[str, int]] = json.decoder.scanstring  # type: ignore[attr-defined]
#: A run of a JSON string's contents: characters other than quotes and backslashes, and
#: escapes (a backslash and the character after it).
_STRING_RUN = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*', re.DOTALL)


class _SlicedParser:
    """Parses a JSON text as ``json.loads`` does, never more than :data:`_PIECE_CHARS` of it
    in one call of the C parser, so that the GIL can pass to another thread between calls.

    Arrays and objects too large for one call are walked here: runs of their elements (or
    members) are parsed a piece at a time, each piece cut at a comma; a piece cut inside
    an element is no valid JSON, and the elements are then parsed one by one for a while.
    Nesting deeper than ``max_depth`` is refused as it is met.
    """

    def __init__(self, text: str, max_depth: int) -> None:
        self.text = text
        self.max_depth = max_depth

    def parse(self) -> Any:
        """The text's value."""
        value, end = self._value(_skip(self.text, 0), 1)
        end = _skip(self.text, end)
        if end != len(self.text):
            raise json.JSONDecodeError("Extra data", self.text, end)
        return value

    def _value(self, start: int, depth: int) -> tuple[Any, int]:
        """The value at ``start`` (a container there at ``depth``) and where it ends."""
        opener = self.text[start : start + 1]
        if opener not in ("[", "{"):
            return self._scalar(start)
        size = 64
        while size <= _PIECE_CHARS and start + size < len(self.text):
            piece = self.text[start : start + size]
            try:
                value, end = _scan(piece, 0)
            except (StopIteration, ValueError, RecursionError):
                end = len(piece)  # (cut short by the piece's end, or wrong: looked at closer)
            if end < len(piece):
                self._check_depth(value, piece[:end], depth - 1)
                return value, start + end
            size *= 4
        if depth > self.max_depth:
            raise _too_deep(self.max_depth)
        return self._array(start, depth) if opener == "[" else self._object(start, depth)

    def _scalar(self, start: int) -> tuple[Any, int]:
        if self.text.startswith('"', start):
            decoded = _long_string(self.text, start)
            if decoded is not None:
                return decoded
        try:
            value, end = _scan(self.text, start)
        except StopIteration:
            raise json.JSONDecodeError("Expecting value", self.text, start) from None
        return value, end

    def _array(self, start: int, depth: int) -> tuple[list[Any], int]:
        items: list[Any] = []
        at = _skip(self.text, start + 1)
        if self.text[at : at + 1] == "]":
            return items, at + 1
        one_by_one_until = at
        while True:
            if at >= one_by_one_until:
                run = self._run(at, "[]", depth)
                if run is not None:
                    chunk, at = run
                    items += chunk
                    yield_gil()
                    continue
                one_by_one_until = at + _PIECE_CHARS  # (a failed run costs no more than this)
            value, at = self._value(at, depth + 1)
            items.append(value)
            at, done = self._after_item(at, "]")
            if done:
                return items, at

    def _object(self, start: int, depth: int) -> tuple[dict[str, Any], int]:
        members: dict[str, Any] = {}
        at = _skip(self.text, start + 1)
        if self.text[at : at + 1] == "}":
            return members, at + 1
        one_by_one_until = at
        while True:
            if at >= one_by_one_until:
                run = self._run(at, "{}", depth)
                if run is not None:
                    chunk, at = run
                    members.update(chunk)  # (a repeated key keeps its first place, its last value)
                    yield_gil()
                    continue
                one_by_one_until = at + _PIECE_CHARS
            if self.text[at : at + 1] != '"':
                raise json.JSONDecodeError("Expecting property name enclosed in double quotes", self.text, at)
            key, at = _scan(self.text, at)
            at = _skip(self.text, at)
            if self.text[at : at + 1] != ":":
                raise json.JSONDecodeError("Expecting ':' delimiter", self.text, at)
            members[key], at = self._value(_skip(self.text, at + 1), depth + 1)
            at, done = self._after_item(at, "}")
            if done:
                return members, at

    def _run(self, start: int, brackets: str, depth: int) -> tuple[Any, int] | None:
        """The elements (or members) from ``start`` to a comma within a piece's reach,
        parsed in one call, and where the next one starts; None when no cut is found
        between two of them (a cut inside one leaves no valid JSON).

        The cut is tried first at the last comma before what the first element starts
        with (elements of one array are mostly alike: ``,[`` ends a list of lists' piece
        between two lists), then at the last comma."""
        end = start + _PIECE_CHARS
        cuts = {self.text.rfind("," + self.text[start : start + 1], start, end), self.text.rfind(",", start, end)}
        for cut in sorted(cuts, reverse=True):
            if cut <= start:  # (none, or one where an element should be: no valid JSON)
                continue
            piece = brackets[0] + self.text[start:cut] + brackets[1]
            try:
                chunk = json.loads(piece)
            except (ValueError, RecursionError):
                continue
            self._check_depth(chunk, piece, depth - 1)
            return chunk, _skip(self.text, cut + 1)
        return None

    def _after_item(self, at: int, closer: str) -> tuple[int, bool]:
        """Past the comma after an element (False) or the container's closer (True)."""
        at = _skip(self.text, at)
        found = self.text[at : at + 1]
        if found == closer:
            return at + 1, True
        if found != ",":
            raise json.JSONDecodeError("Expecting ',' delimiter", self.text, at)
        return _skip(self.text, at + 1), False

    def _check_depth(self, value: Any, text: str, depth: int) -> None:
        """Refuse ``value``, parsed whole from ``text``, if as a container at ``depth + 1``
        it nests past the limit (its text's brackets bound how deep it can)."""
        room = self.max_depth - depth
        if text.count("[") + text.count("{") > room and _depth_exceeds(value, room):
            raise _too_deep(self.max_depth)


def _long_string(text: str, start: int) -> tuple[str, int] | None:
    """The JSON string at ``start`` (its opening quote) decoded a piece at a time, and
    where it ends; None for one within a piece, or one that is not valid (a single call
    then decodes it, or says what is wrong and where). A prompt is mostly one string:
    decoded in one call, five megabytes of it held the GIL for 7-9 ms."""
    close = _string_end(text, start)
    if close - start <= _PIECE_CHARS:  # (short, or not closed: -1)
        return None
    parts: list[str] = []
    at = start + 1
    while at < close:
        cut = _escape_free_cut(text, at, close)
        try:
            part, _ = _scan_string('"' + text[at:cut] + '"', 1)
        except ValueError:
            return None
        parts.append(part)
        at = cut
        yield_gil()
    return "".join(parts), close + 1


def _string_end(text: str, start: int) -> int:
    """Where the JSON string opened at ``start`` closes (its quote), found a piece at a
    time; -1 when it does not close."""
    at, size = start + 1, len(text)
    while at < size:
        end = min(at + _PIECE_CHARS, size)
        match = _STRING_RUN.match(text, at, end)
        assert match is not None  # (it matches nothing too)
        stop = match.end()
        if stop < end and text[stop] == '"':
            return stop
        if stop == end - 1 and end == size:
            return -1  # (a backslash that ends the text)
        at = stop  # (the window's end, or a backslash it cut from what it escapes)
        yield_gil()
    return -1


def _escape_free_cut(text: str, at: int, close: int) -> int:
    """Where to end a piece of a string's contents that starts at ``at`` (before its
    closing quote, ``close``): at most a piece's length on, and with no backslash in the
    12 characters before, so that no escape (``\\uXXXX``), nor a surrogate pair of them,
    is cut. ``close`` when no such place is within the piece's second half."""
    cut = at + _PIECE_CHARS
    if cut >= close:
        return close
    while cut > at + _PIECE_CHARS // 2:
        backslash = text.rfind("\\", cut - 12, cut)
        if backslash < 0:
            return cut
        cut = backslash
    return close


def _skip(text: str, at: int) -> int:
    """Where the whitespace from ``at`` on ends."""
    match = _WHITESPACE.match(text, at)
    assert match is not None  # (it matches nothing too)
    return match.end()


def _depth_exceeds(value: Any, max_depth: int) -> bool:
    stack: list[tuple[Any, int]] = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        node, depth = stack.pop()
        if depth > max_depth:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def _too_deep(max_depth: int) -> APIError:
    return bad_request(
        f"the request body nests JSON arrays and objects deeper than the server's limit of {max_depth} "
        "levels (--max-json-depth)"
    )
