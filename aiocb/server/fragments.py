"""What a chat choice's text is made of once parsed: content, reasoning and tool calls."""

from __future__ import annotations

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


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One complete call: ``arguments`` is JSON text."""

    index: int
    id: str
    name: str
    arguments: str


Fragment = Content | Reasoning | ToolCall


def partial_suffix(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``marker``."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class HiddenTexts:
    """Removes the texts of special tokens kept in a stream of text that the client asked
    to skip (a parser needed them): text that may begin one is held until it is known."""

    __slots__ = ("_held", "texts")

    def __init__(self, texts: Collection[str]) -> None:
        self.texts = tuple(t for t in texts if t)
        self._held = ""

    def feed(self, text: str) -> str:
        """``text`` without the hidden texts, less an end that may begin one (held)."""
        if not self.texts:
            return text
        text = self._held + text
        for hidden in self.texts:
            text = text.replace(hidden, "")
        keep = max(partial_suffix(text, hidden) for hidden in self.texts)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep]

    def finish(self) -> str:
        """The text held at the end (it began no hidden text)."""
        held, self._held = self._held, ""
        return held
