"""Whole JSON response bodies, written and sent a slice of the event loop at a time.

A response with many choices, each with the logprobs of every token and their
alternatives, runs to tens of megabytes: rendered in one ``json.dumps`` call it held the
loop for seconds (a thread would not help: the encoder holds the GIL). :func:`encode`
writes the bytes a ``JSONResponse`` would (compact, non-ASCII kept, no NaN) a piece at a
time, giving the loop back between pieces, and :class:`JSONBody` sends them a few at a
time. A :class:`Chain` is written once per body however many choices share its parts (a
prompt's echoed logprobs, the same in each of its choices).
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from aiocb.engine.turns import SLICE, LoopTurn

#: ``JSONResponse``'s own encoding.
_dumps = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode
#: Values (nested ones included) a container may hold to be written in one call.
_SMALL = 256
#: What one call of the encoder should take: the elements of an array are written in
#: batches sized from what the last batch took.
_BATCH_SECONDS = SLICE / 2
#: Elements of an array looked at to tell whether they are small.
_SAMPLED = 16
#: Bytes sent in one body message.
_SEND_BYTES = 1 << 18


@dataclass(frozen=True, slots=True)
class Chain:
    """A JSON array of the elements of ``parts`` in turn, never copied into one list.

    Each part is written once per body, however many chains share it.
    """

    parts: tuple[Sequence[Any], ...]


class Uneven(list[Any]):
    """A JSON array whose elements may differ much in size (a response's choices, some
    stopped at their first token, the next a thousand tokens long with their alternatives):
    written an element at a time, each as its size says, never in batches sized by the
    first ones (which wrote ten long choices in one call: 113 ms of the loop)."""


class Lazy(Sequence[Any]):
    """A JSON array of ``make(item)`` for each of ``items``, made as it is written: a body's
    millions of small objects (a chat's logprobs entries, twenty alternatives a token)
    are never all alive at once, which made each of the collector's full passes, on the
    loop, take hundreds of milliseconds."""

    def __init__(self, items: Sequence[Any], make: Callable[[Any], Any]) -> None:
        self._items = items
        self._make = make

    def __len__(self) -> int:
        return len(self._items)

    @overload
    def __getitem__(self, index: int) -> Any: ...

    @overload
    def __getitem__(self, index: slice) -> list[Any]: ...

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return [self._make(item) for item in self._items[index]]
        return self._make(self._items[index])


async def encode(value: Any) -> list[bytes]:
    """``value`` as a ``JSONResponse`` writes it (``Chain`` and ``Lazy`` values as arrays), in pieces:
    the loop is given back whenever a slice of it has been used."""
    pieces: list[bytes] = []
    await _Writer().value(value, pieces)
    return pieces


class JSONBody(Response):
    """A JSON response whose body is :func:`encode`'s pieces, sent a few at a time (a body
    of tens of megabytes joined in one go holds the loop too)."""

    media_type = "application/json"

    def __init__(self, pieces: list[bytes]) -> None:
        self._pieces = pieces
        super().__init__(headers={"content-length": str(sum(map(len, pieces)))})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        turn = LoopTurn()
        for chunk in _joined(self._pieces, _SEND_BYTES):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await turn.give()
        await send({"type": "http.response.body", "body": b""})


def _joined(pieces: list[bytes], size: int) -> Iterator[bytes]:
    """``pieces`` joined into chunks of about ``size`` bytes (a larger piece alone)."""
    run: list[bytes] = []
    length = 0
    for piece in pieces:
        run.append(piece)
        length += len(piece)
        if length >= size:
            yield b"".join(run)
            run, length = [], 0
    if run:
        yield b"".join(run)


class _Writer:
    """Writes one body's pieces."""

    def __init__(self) -> None:
        self._turn = LoopTurn()
        #: each chain part written so far, by id (kept, so that no id is reused): its
        #: elements' pieces, without the brackets
        self._parts: dict[int, tuple[Sequence[Any], list[bytes]]] = {}

    async def value(self, value: Any, out: list[bytes]) -> None:
        """Append ``value``'s pieces to ``out``."""
        if isinstance(value, Chain):
            await self._chain(value, out)
        elif _small(value):
            out.append(_encode(value))
        elif isinstance(value, dict):
            await self._object(value, out)
        else:
            out.append(b"[")
            await self._elements(value, out)
            out.append(b"]")
        await self._turn.give()

    async def _object(self, value: dict[Any, Any], out: list[bytes]) -> None:
        out.append(b"{")
        small: dict[Any, Any] = {}  # (consecutive small members, written in one call)
        comma = b""
        for key, member in value.items():
            if _small(member):
                small[key] = member
                continue
            if small:
                out.append(comma + _encode(small)[1:-1])
                small, comma = {}, b","
            out.append(comma + _key(key))
            comma = b","
            await self.value(member, out)
        if small:
            out.append(comma + _encode(small)[1:-1])
        out.append(b"}")

    async def _chain(self, chain: Chain, out: list[bytes]) -> None:
        out.append(b"[")
        comma = False
        for part in chain.parts:
            if not part:
                continue
            written = self._parts.get(id(part))
            if written is None:
                written = (part, [])
                await self._elements(part, written[1])
                self._parts[id(part)] = written
            if comma:
                out.append(b",")
            out += written[1]
            comma = True
        out.append(b"]")

    async def _elements(self, items: Sequence[Any], out: list[bytes]) -> None:
        """Append ``items``' elements, comma-separated, to ``out``: in batches while they are
        small (the first container among the first few says), else (and for an
        :class:`Uneven` array) one by one."""
        # (arrays here are of one kind of element, often after a None: the first ones say)
        heads = itertools.islice(items, _SAMPLED)
        sample = next((item for item in heads if isinstance(item, (dict, list, tuple, Chain, Lazy))), None)
        if isinstance(items, Uneven) or (sample is not None and not _small(sample)):
            for i, item in enumerate(items):
                if i:
                    out.append(b",")
                await self.value(item, out)
            return
        out += await array_items(items, _encode, self._turn)


async def array_items(items: Sequence[Any], dumps: Callable[[Any], bytes], turn: LoopTurn) -> list[bytes]:
    """The elements of ``items`` as ``dumps`` writes a JSON array of them, comma-separated
    and without the brackets, written in batches sized so that each call takes a share of
    a slice of the loop (the loop is given back between them)."""
    out: list[bytes] = []
    start, batch = 0, 1
    while start < len(items):
        began = time.perf_counter()
        text = dumps(items[start : start + batch])[1:-1]
        spent = time.perf_counter() - began
        out.append(text if start == 0 else b"," + text)
        start += batch
        # (sized to the time one call should take, growing at most fourfold a batch)
        batch = max(1, min(4 * batch, int(batch * _BATCH_SECONDS / spent) if spent > 0 else 4 * batch))
        await turn.give()
    return out


def _encode(value: Any) -> bytes:
    return _dumps(value).encode()


def _key(key: Any) -> bytes:
    """``"key":`` as the encoder writes it (a key that is no string becomes one)."""
    return _dumps({key: None})[1:-5].encode()


def _small(value: Any) -> bool:
    """Whether ``value`` holds at most :data:`_SMALL` values, nested ones included (counted
    no further than that), and no chain or lazy array: small enough to write in one call."""
    left = _SMALL
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, (Chain, Lazy)):
            return False
        if not isinstance(node, (dict, list, tuple)):
            continue
        left -= len(node)
        if left < 0:
            return False
        stack += node.values() if isinstance(node, dict) else node
    return True
