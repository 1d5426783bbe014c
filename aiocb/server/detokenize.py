"""Text from a growing list of token ids, and stop strings found in it.

:class:`IncrementalDetokenizer` turns each new token into the text it adds. A token that
ends inside a multi-byte character (byte-level BPE splits UTF-8 freely) adds nothing until
the character is complete, so a delta never carries half a character or a stray U+FFFD.
It decodes a small window of recent tokens rather than the whole sequence, so the cost of
a token does not grow with the length of the output.

:class:`StopStringMatcher` finds stop strings in that text as it grows. Text that could be
the start of a stop string is held back until it is known not to be one; when a stop
string is found, the text before it is released and the stop string itself is dropped.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

#: Prompt tokens decoded with the first generated ones, so that a tokenizer that drops a
#: leading space at the start of a text (SentencePiece) puts it back where it belongs.
_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Text deltas for token ids added one by one (the TGI / vLLM "offsets" method).

    ``prefix`` is the text the last emitted window decodes to; a new token is decoded with
    that window, and what follows the prefix is the token's text, unless it ends in an
    incomplete character, in which case the token waits for the next one.
    """

    def __init__(self, tokenizer: Any, context_ids: Sequence[int] = (), *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(context_ids[-_CONTEXT_TOKENS:]) if context_ids else []
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        #: characters of text emitted so far (not counting the context)
        self.num_chars = 0

    def add(self, token_id: int) -> str:
        """Append one token; returns the text it completes (often all of its own text, maybe "")."""
        self._ids.append(token_id)
        prefix = self._decode(self._prefix_offset, self._read_offset)
        text = self._decode(self._prefix_offset, len(self._ids))
        if len(text) <= len(prefix) or text.endswith(_REPLACEMENT):
            return ""  # a special token skipped, or a character still incomplete
        delta = text[len(prefix) :]
        self._advance()
        self.num_chars += len(delta)
        return delta

    def add_many(self, token_ids: Iterable[int]) -> str:
        """Append several tokens; returns the text they complete."""
        return "".join(self.add(token_id) for token_id in token_ids)

    def flush(self) -> str:
        """The text of tokens still held (an incomplete character at the very end), as it decodes."""
        prefix = self._decode(self._prefix_offset, self._read_offset)
        text = self._decode(self._prefix_offset, len(self._ids))
        self._advance()
        delta = text[len(prefix) :] if len(text) > len(prefix) else ""
        self.num_chars += len(delta)
        return delta

    def _advance(self) -> None:
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        if self._prefix_offset > 64:  # keep the window small
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        text: str = self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip_special)
        return text


class StopStringMatcher:
    """Holds back text that may begin a stop string; trims the stop string when it appears."""

    def __init__(self, stop: Sequence[str]) -> None:
        self._stop = tuple(dict.fromkeys(s for s in stop if s))
        self._held = ""
        #: the stop string that was found, once one was
        self.matched: str | None = None

    @property
    def held(self) -> str:
        """Text received but not released yet."""
        return self._held

    def feed(self, text: str) -> str:
        """Add text; returns what can be released now.

        After a stop string is found (:attr:`matched` is set), returns the text before it
        and ignores everything fed later.
        """
        if self.matched is not None:
            return ""
        if not self._stop:
            return text
        buffer = self._held + text
        first: tuple[int, str] | None = None
        for stop in self._stop:
            at = buffer.find(stop)
            if at >= 0 and (first is None or at < first[0]):
                first = (at, stop)
        if first is not None:
            self.matched = first[1]
            self._held = ""
            return buffer[: first[0]]
        keep = self._longest_stop_prefix_suffix(buffer)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """Release the held text (the output ended without completing a stop string)."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held

    def _longest_stop_prefix_suffix(self, buffer: str) -> int:
        longest = min(len(buffer), max(len(s) for s in self._stop) - 1)
        for size in range(longest, 0, -1):
            tail = buffer[-size:]
            if any(stop.startswith(tail) for stop in self._stop):
                return size
        return 0
