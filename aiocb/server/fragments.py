"""What a chat choice's text is made of once parsed: content, reasoning and tool calls."""

from __future__ import annotations

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
