"""Python regular expressions written for xgrammar: the language Python's ``re`` matches,
or a refusal naming what no grammar can hold.

Clients check a constrained output with ``re.fullmatch`` (or a JSON schema's ``pattern``
with Python's ``jsonschema``), so a ``regex`` constraint must mean what it means to
Python. xgrammar reads its own dialect: ``.`` takes a line break, ``\\d``, ``\\w`` and
``\\s`` are ASCII, ``\\A`` and ``\\Z`` are the letters A and Z, a ``^`` or ``$`` inside the
pattern is ignored, ``[^]...]`` opens an empty class, and every negated class takes the
bytes of UTF-16 surrogates, which no UTF-8 text holds. So the pattern is parsed by Python's
own parser (its syntax, errors and categories exactly) and written again: every set of
characters as explicit ranges (Python's Unicode categories computed by ``re`` itself),
surrogates left out, anchors kept only where they can hold (at the start or the end),
and what changes the language in ways a grammar cannot follow (look-arounds,
back-references, word boundaries, case folding, ``MULTILINE``, possessive repeats) refused.
"""

from __future__ import annotations

import functools
import re
import re._constants as sre  # type: ignore[import-not-found]  # (Python's own parser: its syntax exactly)
import re._parser as sre_parse  # type: ignore[import-not-found]
from typing import Any

from aiocb.gil import pause

#: The last code point, and the surrogates, which no valid text holds.
_LAST = 0x10FFFF
_SURROGATES = ((0xD800, 0xDFFF),)

Ranges = tuple[tuple[int, int], ...]

#: The flags a pattern may carry: Unicode (every ``str`` pattern's), ``ASCII``, ``DOTALL``
#: and ``VERBOSE`` (whose whitespace and comments the parser drops).
_TAKEN_FLAGS = sre.SRE_FLAG_UNICODE | sre.SRE_FLAG_ASCII | sre.SRE_FLAG_DOTALL | sre.SRE_FLAG_VERBOSE
_FLAG_NAMES = {sre.SRE_FLAG_IGNORECASE: "IGNORECASE (?i)", sre.SRE_FLAG_MULTILINE: "MULTILINE (?m)"}


class UnsupportedPattern(ValueError):
    """A pattern Python refuses, or one whose language no grammar holds."""


@functools.lru_cache(maxsize=256)
def xgrammar_regex(pattern: str) -> str:
    """``pattern`` (Python's syntax) as an xgrammar regular expression of the same
    language under ``re.fullmatch``; :class:`UnsupportedPattern` saying why not."""
    try:
        parsed = sre_parse.parse(pattern)
        return _Writer(_flags(parsed.state.flags)).sequence(list(parsed), start=True, end=True)
    except re.error as error:
        raise UnsupportedPattern(f"not a regular expression: {error}") from None
    except RecursionError:
        raise UnsupportedPattern("nested too deeply") from None


def _flags(flags: int) -> int:
    refused = flags & ~_TAKEN_FLAGS
    if refused:
        names = [name for flag, name in _FLAG_NAMES.items() if refused & flag] or [f"flags {refused:#x}"]
        raise UnsupportedPattern(f"{names[0]} changes what it matches in ways constrained decoding cannot follow")
    return flags


class _Writer:
    def __init__(self, flags: int) -> None:
        self.flags = flags

    def sequence(self, items: list[tuple[Any, Any]], *, start: bool, end: bool) -> str:
        """``items`` written in turn; ``start``, ``end``: whether nothing can come before
        (after) them, where an anchor holds."""
        anchors = [op is sre.AT for op, _ in items]
        first = anchors.index(False) if False in anchors else len(items)
        last = len(items) - 1 - anchors[::-1].index(False) if False in anchors else -1
        out = []
        for index, (op, value) in enumerate(items):
            out.append(self.item(op, value, start=start and index <= first, end=end and index >= last))
        return "".join(out)

    def item(self, op: Any, value: Any, *, start: bool, end: bool) -> str:
        if op is sre.LITERAL:
            return _written(((value, value),))
        if op is sre.NOT_LITERAL:
            return _written(_complement(((value, value),)))
        if op is sre.ANY:
            return _written(_ANYTHING if self.flags & sre.SRE_FLAG_DOTALL else _NO_LINE_BREAK)
        if op is sre.IN:
            return _written(self.members(value))
        if op is sre.BRANCH:
            return "(" + "|".join(self.sequence(list(alt), start=start, end=end) for alt in value[1]) + ")"
        if op is sre.SUBPATTERN:
            _, added, removed, inner = value
            saved = self.flags
            self.flags = (_flags(saved | added) if added else saved) & ~removed
            try:
                return "(" + self.sequence(list(inner), start=start, end=end) + ")"
            finally:
                self.flags = saved
        if op in (sre.MAX_REPEAT, sre.MIN_REPEAT):  # (a lazy repeat matches the same strings)
            low, high, inner = value
            return "(" + self.sequence(list(inner), start=False, end=False) + ")" + _quantifier(low, high)
        if op is sre.AT:
            return self.anchor(value, start=start, end=end)
        raise UnsupportedPattern(_REFUSED.get(op, f"{str(op).lower()}, which constrained decoding cannot follow"))

    def anchor(self, where: Any, *, start: bool, end: bool) -> str:
        if where in (sre.AT_BEGINNING, sre.AT_BEGINNING_STRING) and start:
            return ""
        if where in (sre.AT_END, sre.AT_END_STRING) and end:
            return ""
        if where in (sre.AT_BOUNDARY, sre.AT_NON_BOUNDARY):
            raise UnsupportedPattern("a word boundary (\\b, \\B), which constrained decoding cannot follow")
        raise UnsupportedPattern(
            "an anchor (^, $, \\A, \\Z) inside the pattern, where it holds for no string; anchor only its start and end"
        )

    def members(self, items: list[tuple[Any, Any]]) -> Ranges:
        negated = bool(items) and items[0][0] is sre.NEGATE
        ranges: list[tuple[int, int]] = []
        for op, value in items[negated:]:
            if op is sre.LITERAL:
                ranges.append((value, value))
            elif op is sre.RANGE:
                ranges.append(value)
            elif op is sre.CATEGORY:
                ascii_only = bool(self.flags & sre.SRE_FLAG_ASCII)
                ranges.extend(_category(value, ascii_only=ascii_only, wide=negated))
            else:
                raise UnsupportedPattern(
                    f"{str(op).lower()} in a character class, which constrained decoding cannot follow"
                )
        members = _normal(ranges)
        return _complement(members) if negated else members


_REFUSED = {
    sre.ASSERT: "a lookahead or lookbehind, which constrained decoding cannot follow",
    sre.ASSERT_NOT: "a lookahead or lookbehind, which constrained decoding cannot follow",
    sre.GROUPREF: "a back-reference, which constrained decoding cannot follow",
    sre.GROUPREF_EXISTS: "a conditional group, which constrained decoding cannot follow",
    sre.POSSESSIVE_REPEAT: "a possessive repeat, which constrained decoding cannot follow",
    sre.ATOMIC_GROUP: "an atomic group, which constrained decoding cannot follow",
}


def _quantifier(low: int, high: int) -> str:
    unbounded = high == sre.MAXREPEAT
    if (low, unbounded) == (0, True):
        return "*"
    if (low, unbounded) == (1, True):
        return "+"
    if unbounded:
        return f"{{{low},}}"
    if (low, high) == (0, 1):
        return "?"
    return f"{{{low}}}" if low == high else f"{{{low},{high}}}"


def _normal(ranges: list[tuple[int, int]]) -> Ranges:
    """``ranges`` sorted and merged, surrogates left out."""
    return _without(_merged(ranges), _SURROGATES)


def _merged(ranges: list[tuple[int, int]]) -> Ranges:
    """``ranges`` sorted, those that touch or overlap made one."""
    merged: list[list[int]] = []
    for low, high in sorted(ranges):
        if merged and low <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], high)
        else:
            merged.append([low, high])
    return tuple((low, high) for low, high in merged)


def _without(ranges: Ranges, removed: Ranges) -> Ranges:
    kept: list[tuple[int, int]] = []
    for low, high in ranges:
        for cut_low, cut_high in removed:
            if cut_high < low or cut_low > high:
                continue
            if cut_low > low:
                kept.append((low, cut_low - 1))
            low = cut_high + 1
            if low > high:
                break
        if low <= high:
            kept.append((low, high))
    return tuple(kept)


def _complement(ranges: Ranges) -> Ranges:
    """Every character but ``ranges`` (surrogates left out)."""
    out: list[tuple[int, int]] = []
    next_low = 0
    for low, high in _normal(list(ranges)):
        if low > next_low:
            out.append((next_low, low - 1))
        next_low = high + 1
    if next_low <= _LAST:
        out.append((next_low, _LAST))
    return _without(tuple(out), _SURROGATES)


_ANYTHING = _complement(())
_NO_LINE_BREAK = _complement(((10, 10),))


def _written(ranges: Ranges) -> str:
    """A set of characters in xgrammar's syntax: one character alone, else a class (a
    negated one where shorter, surrogates then among what it leaves out)."""
    if not ranges:
        raise UnsupportedPattern("a character class that matches no character")
    if len(ranges) == 1 and ranges[0][0] == ranges[0][1]:
        return _char(ranges[0][0])
    outside = _complement(ranges)
    if len(outside) < len(ranges):
        return "[^" + _class_body(_merged([*outside, *_SURROGATES])) + "]"
    return "[" + _class_body(ranges) + "]"


def _class_body(ranges: Ranges) -> str:
    return "".join(_char(low) if low == high else f"{_char(low)}-{_char(high)}" for low, high in ranges)


def _char(code: int) -> str:
    """A character as xgrammar reads it anywhere: ASCII letters and digits as themselves,
    any other by its code point (no metacharacter, no bare control character)."""
    if code < 128 and chr(code).isalnum():
        return chr(code)
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


#: Python's own names of its categories, and the class each is the complement of (if any)
_CATEGORIES = {
    sre.CATEGORY_DIGIT: (r"\d", False),
    sre.CATEGORY_NOT_DIGIT: (r"\d", True),
    sre.CATEGORY_SPACE: (r"\s", False),
    sre.CATEGORY_NOT_SPACE: (r"\s", True),
    sre.CATEGORY_WORD: (r"\w", False),
    sre.CATEGORY_NOT_WORD: (r"\w", True),
}


def _category(category: Any, *, ascii_only: bool, wide: bool) -> Ranges:
    """The members of a category (``\\d``, ``\\D``, ...) as written for a grammar whose
    every output Python's pattern matches: in a class that takes them (not ``wide``) its
    narrowest reading (``\\d``, ``\\w``, ``\\s`` their ASCII members, as every other
    engine reads them; ``\\D``, ``\\W``, ``\\S`` everything but Python's Unicode
    members), and in a negated class, which leaves them out, its widest."""
    if category not in _CATEGORIES:
        raise UnsupportedPattern(f"{str(category).lower()}, which constrained decoding cannot follow")
    escape, negated = _CATEGORIES[category]
    # (the ASCII members of a category are the fewest; all of Python's Unicode ones, the most)
    members = _members(escape, ascii_only or (wide == negated))
    return _complement(members) if negated else members


#: Code points read at once (a slice's ranges end at its end: merged after)
_SLICE = 0x1000


@functools.cache
def _members(escape: str, ascii_only: bool) -> Ranges:
    """The code points Python's ``re`` matches with ``escape`` (``\\d``, ``\\s``, ``\\w``),
    found by ``re`` itself a slice of code points at a time (under 1 ms each, a pause between
    for the event loop's thread: some 140 ms in all, once a process)."""
    found = re.compile(("(?a)" if ascii_only else "") + escape + "+")
    ranges: list[tuple[int, int]] = []
    for base in range(0, _LAST + 1, _SLICE):
        text = "".join(map(chr, range(base, base + _SLICE)))
        ranges.extend((base + match.start(), base + match.end() - 1) for match in found.finditer(text))
        pause()
    return _normal(ranges)
