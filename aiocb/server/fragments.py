"""What a chat choice's text is made of once parsed: content, reasoning and tool calls."""

from __future__ import annotations

import functools
import re
import uuid
from collections.abc import Collection
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Content:
    """Text for the message's ``content``."""

    text: str


@dataclass(frozen=True, slots=True)
class Reasoning:
    """Text for the message's ``reasoning_content``."""

    text: str


def call_id() -> str:
    """A new id for a tool call, as OpenAI's look (``call_`` and 24 hex digits)."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call begins: its function's name and the first of its ``arguments`` (JSON text,
    :class:`ToolArguments` may carry on with more of it)."""

    index: int
    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ToolArguments:
    """More of the arguments of the call ``index``, as the model writes them."""

    index: int
    text: str


Fragment = Content | Reasoning | ToolCall | ToolArguments


def merged(fragments: list[Fragment]) -> list[Fragment]:
    """``fragments`` with neighbours of one kind (content, reasoning, one call's arguments) joined."""
    out: list[Fragment] = []
    for fragment in fragments:
        last = out[-1] if out else None
        if isinstance(fragment, Content) and isinstance(last, Content):
            out[-1] = Content(last.text + fragment.text)
        elif isinstance(fragment, Reasoning) and isinstance(last, Reasoning):
            out[-1] = Reasoning(last.text + fragment.text)
        elif isinstance(fragment, ToolArguments) and isinstance(last, ToolCall) and last.index == fragment.index:
            out[-1] = ToolCall(last.index, last.id, last.name, last.arguments + fragment.text)
        elif isinstance(fragment, ToolArguments) and isinstance(last, ToolArguments) and last.index == fragment.index:
            out[-1] = ToolArguments(last.index, last.text + fragment.text)
        else:
            out.append(fragment)
    return out


def partial_suffix(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``marker`` (tried
    only where its first character is: called for each marker on each delta of a stream)."""
    tail = text[len(text) - min(len(text), len(marker) - 1) :]
    at = tail.find(marker[:1]) if marker else -1
    while at >= 0:
        if marker.startswith(tail[at:]):
            return len(tail) - at
        at = tail.find(marker[0], at + 1)
    return 0


class HiddenTexts:
    """Removes the texts of special tokens kept in a stream of text that the client asked
    to skip (a parser needed them): text that may begin one is held until it is known.

    A tokenizer may have hundreds of special tokens (Mistral's 768 control tokens): they are
    found in one pass of a regular expression, and only in text that holds a character
    one begins with (searched for each, they took 0.64 ms a token)."""

    __slots__ = ("_held", "_known")

    def __init__(self, texts: Collection[str]) -> None:
        self._known = _hidden_texts(tuple(texts))
        self._held = ""

    def feed(self, text: str) -> str:
        """``text`` without the hidden texts, less an end that may begin one (held)."""
        known = self._known
        if known is None:
            return text
        if self._held:
            text, self._held = self._held + text, ""
        elif known.starts.isdisjoint(text):
            return text
        text = known.pattern.sub("", text)
        for size in range(min(len(text), known.longest - 1), 0, -1):
            if text[-size:] in known.prefixes:
                self._held = text[-size:]
                return text[:-size]
        return text

    def finish(self) -> str:
        """The text held at the end (it began no hidden text)."""
        held, self._held = self._held, ""
        return held


@dataclass(frozen=True, slots=True)
class _Known:
    """What :class:`HiddenTexts` finds its texts with."""

    pattern: re.Pattern[str]
    #: the characters they begin with
    starts: frozenset[str]
    #: the beginnings of each (not whole)
    prefixes: frozenset[str]
    longest: int


@functools.lru_cache(maxsize=16)
def _hidden_texts(texts: tuple[str, ...]) -> _Known | None:
    """The finder of ``texts`` (the longest found where several begin), made once a set of
    texts (a server's: it makes them as it starts): Mistral's 768 take 9 ms."""
    texts = tuple(sorted({text for text in texts if text}, key=lambda text: (-len(text), text)))
    if not texts:
        return None
    return _Known(
        pattern=re.compile("|".join(map(re.escape, texts))),
        starts=frozenset(text[0] for text in texts),
        prefixes=frozenset(text[:size] for text in texts for size in range(1, len(text))),
        longest=len(texts[0]),
    )
