"""transformers' ``no_repeat_ngram_size`` for one request, on the host.

``NoRepeatNGramLogitsProcessor`` bans, at each step, every token that would complete an
n-gram the sequence (prompt and output) already holds: the tokens that followed each earlier
occurrence of its last ``n - 1`` tokens (transformers matches that suffix against every
window of the sequence). Here the row's sequence is kept as int64 bytes, extended by its new
tokens only, and each step searches it for the last ``n - 1`` tokens with
``bytearray.find``: about 45 µs a step at 8,000 random tokens and 170 µs at 32,000 on the
project's CPU machine (``bench/ngram_bans.py``), and no index to build when a long prompt joins. A suffix
that occurs hundreds of times (one token over and over) has the rest of its occurrences
found in one vectorised pass, so that no history costs a Python loop turn per token.
"""

from __future__ import annotations

from array import array

import torch


class RepeatedNgrams:
    """One request's tokens (as bytes), and the tokens that would repeat one of its n-grams."""

    __slots__ = ("_bytes", "_known", "_seen")

    def __init__(self) -> None:
        self._bytes = bytearray()
        #: how many of the request's tokens were taken in
        self._known = 0
        #: every token so far: what ``size`` 1 bans
        self._seen: set[int] = set()

    def bans(self, tokens: list[int], size: int) -> list[int]:
        """The tokens that must not follow ``tokens`` (the request's prompt and output so
        far, which only ever grow; ``size`` the same at every call) so that no n-gram of
        ``size`` tokens occurs twice."""
        length = len(tokens)
        if length + 1 < size:
            return []
        new, self._known = tokens[self._known :], length
        if size == 1:
            self._seen.update(new)
            return list(self._seen)
        hay = self._bytes
        hay += array("q", new).tobytes()
        width = (size - 1) * 8
        needle = bytes(hay[len(hay) - width :])
        # An occurrence of the last n - 1 tokens counts when a token follows it: it ends at
        # the last token's start at the latest (the suffix itself is not one).
        end = (length - 1) * 8
        found: list[int] = []
        at = hay.find(needle, 0, end)
        while at >= 0:
            if at & 7:  # (straddles two tokens: go on from the next token's start)
                at = hay.find(needle, (at | 7) + 1, end)
                continue
            if len(found) == _SEARCHED:
                # A history that repeats its suffix thousands of times (hostile, or one
                # token over and over): the rest in one pass, at C speed.
                return list(dict.fromkeys(found + _following(hay, length, size, at >> 3)))
            found.append(tokens[(at + width) >> 3])
            at = hay.find(needle, at + 8, end)
        return list(dict.fromkeys(found))


#: occurrences of the suffix found one at a time before the rest are found in one pass
#: (each costs a loop turn in Python, a few tenths of a microsecond)
_SEARCHED = 256


def _following(hay: bytearray, length: int, size: int, start: int) -> list[int]:
    """The distinct tokens that follow an occurrence of the last ``size - 1`` of the
    ``length`` tokens in ``hay`` at a token index from ``start`` on."""
    history = torch.frombuffer(hay, dtype=torch.int64)  # (a view of the bytes: no copy)
    windows = history[start : length - 1].unfold(0, size - 1, 1)  # (each start, up to length - size)
    matches = (windows == history[length - size + 1 :]).all(dim=1)
    following: list[int] = torch.unique(history[start + size - 1 : length][matches]).tolist()
    del history, windows  # (a view keeps the bytes from growing)
    return following
