"""Python regular expressions as xgrammar reads them: a ``regex`` constraint (or a JSON
schema's ``pattern``) takes only outputs that Python's ``re.fullmatch`` matches."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

import aiocb
from aiocb.python_regex import UnsupportedPattern, xgrammar_regex
from aiocb.structured import answer_format, json_schema_grammar

xgr = pytest.importorskip("xgrammar")

#: the UTF-8 bytes of a lone surrogate (U+D800), which no text holds
SURROGATE = b"\xed\xa0\x80"


def accepts(grammar: Any, text: str | bytes) -> bool:
    return bool(xgr.testing._is_grammar_accept_string(grammar, text))


def regex_accepts(pattern: str, text: str | bytes) -> bool:
    return accepts(xgr.Grammar.from_regex(xgrammar_regex(pattern)), text)


@pytest.mark.parametrize(
    ("pattern", "texts"),
    [
        ("a.b", ["axb", "a\nb", "a\u00e9b"]),  # (. takes no line break)
        ("(?s)a.b", ["a\nb", "axb"]),
        ("[^]a]+", ["bc", "]", "a", "b]"]),  # (a ] first in a class is a member)
        ("[]a]", ["]", "a", "b"]),
        (r"ab\Z", ["ab", "abZ"]),
        (r"\Aab$", ["ab", "Aab"]),
        (r"^(ab|cd)$", ["ab", "cd", "abcd"]),
        (r"\D", ["\u07c3", "x", "7"]),  # (NKo digit three: a digit to Python)
        (r"\S", ["\x1e", "x", " "]),  # (a record separator: Python's whitespace)
        (r"\W+", ["\u00ca", "!!", "_"]),
        (r"[^\d\s]", ["\u0663", "\u3000", "x"]),
        (r"[^\D]", ["7", "x"]),
        (r"\012", ["\n", "\x0012"]),  # (octal, as Python reads it)
        (r"a{2,}", ["a", "aa", "aaaaa"]),
        (r"(a|)b", ["ab", "b", "a"]),
        (r"a\ b\#\u00e9", ["a b#\u00e9"]),
        (r"[\u00e0-\u00e5]{2}x*?", ["\u00e0\u00e5", "\u00e0\u00e5xx", "\u00e6\u00e0"]),
    ],
)
def test_a_pattern_takes_what_python_matches(pattern: str, texts: list[str]) -> None:
    for text in texts:
        assert regex_accepts(pattern, text) == bool(re.fullmatch(pattern, text)), (pattern, text)


@pytest.mark.parametrize(("pattern", "text"), [(r"\d", "\u0663"), (r"\w", "\u00e9"), (r"\s", "\u3000")])
def test_the_categories_take_their_ascii_members(pattern: str, text: str) -> None:
    """As every other engine reads them: a subset of Python's members, so every output still
    matches (``\\D``, ``\\W``, ``\\S`` and negated classes leave out all of Python's)."""
    assert re.fullmatch(pattern, text) and not regex_accepts(pattern, text)
    assert not regex_accepts(f"(?a){pattern}", text)


@pytest.mark.parametrize("pattern", [".", "(?s).", "[^a]", r"\D", r"\W", r"\S", r"[\s\S]"])
def test_no_class_takes_the_bytes_of_a_surrogate(pattern: str) -> None:
    """xgrammar's negated classes take them (no text holds them: they decode to U+FFFD)."""
    assert not regex_accepts(pattern, SURROGATE)
    assert regex_accepts(pattern, "\u00e9") == bool(re.fullmatch(pattern, "\u00e9"))


@pytest.mark.parametrize(
    ("pattern", "why"),
    [
        ("(?=a)a", "lookahead or lookbehind"),
        ("(?<!a)b", "lookahead or lookbehind"),
        (r"(a)\1", "back-reference"),
        (r"\bx", "word boundary"),
        ("a$b", "anchor"),
        ("a^", "anchor"),
        ("(?i)a", "IGNORECASE"),
        ("(?i:a)b", "IGNORECASE"),
        ("(?m)^a", "MULTILINE"),
        ("a*+", "possessive"),
        ("(?>a)", "atomic group"),
        (r"[^\s\S]", "matches no character"),
        ("(", "not a regular expression: missing \\)"),
        ("(" * 3000 + "a" + ")" * 3000, "nested too deeply"),
    ],
)
def test_what_no_grammar_holds_is_refused_naming_it(pattern: str, why: str) -> None:
    with pytest.raises(UnsupportedPattern, match=why):
        xgrammar_regex(pattern)


def test_an_answer_after_the_thinking_reads_its_regex_as_python_does() -> None:
    """The element of a structural tag a reasoning parser's answer is held to (its ``.``
    took a line break there)."""
    element = answer_format(("regex", "a.b"))
    assert element == {"type": "regex", "pattern": xgrammar_regex("a.b")}
    with pytest.raises(aiocb.InvalidRequestError, match="lookahead") as caught:
        answer_format(("regex", "(?=a)a"))
    assert caught.value.param == "regex"


def test_a_schemas_patterns_are_read_as_python_does_or_refused() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^x.y$"}}, "required": ["a"]}
    grammar = json_schema_grammar(schema, any_whitespace=False)
    assert accepts(grammar, '{"a": "xzy"}') and not accepts(grammar, '{"a": "x\\ny"}')
    for pattern in ["^(?=.*[0-9])[a-z0-9]{3,6}$", "^(?!admin)[a-z]{2,5}$", r"(a)\1"]:
        bad = {"type": "string", "pattern": pattern}
        with pytest.raises(aiocb.InvalidRequestError, match=r"the pattern .* at /pattern: ") as caught:
            answer_format(("json_schema", json.dumps(bad)))  # (checked as a request's schema is)
        assert caught.value.param == "json_schema"
    # (xgrammar's grammar follows the format alone)
    beside = {"type": "string", "format": "date", "pattern": "^x+$"}
    with pytest.raises(aiocb.InvalidRequestError, match="'pattern' at / \\(beside a 'format'"):
        answer_format(("json_schema", json.dumps(beside)))


def test_no_json_string_takes_the_bytes_of_a_surrogate() -> None:
    for schema in ({"type": "string"}, {"type": "string", "maxLength": 3}, {"type": "object"}):
        grammar = json_schema_grammar(schema, any_whitespace=False)
        text = b'"\xed\xa0\x80"' if schema["type"] == "string" else b'{"k\xed\xa0\x80": 1}'
        assert not accepts(grammar, text), schema
        assert accepts(grammar, '"\u00e9"' if schema["type"] == "string" else '{"\u00e9": 1}')


def test_a_choice_with_a_lone_surrogate_is_refused_naming_choice() -> None:
    with pytest.raises(aiocb.InvalidRequestError, match="choice\\[1\\] holds '\\\\ud800', a lone surrogate") as caught:
        aiocb.SamplingParams(choice=["a", "b\ud800"])
    assert caught.value.param == "choice"


def test_no_class_of_a_clients_grammar_takes_the_bytes_of_a_surrogate() -> None:
    grammar = answer_format(("grammar", 'root ::= "<" [^a>]+ ">"'))["grammar"]
    assert accepts(grammar, "<\u00e9>") and not accepts(grammar, "<a>")
    assert not accepts(grammar, b"<" + SURROGATE + b">")


def test_a_date_format_takes_calendar_dates_alone() -> None:
    """As ``jsonschema`` checks the format (``datetime.date.fromisoformat``): xgrammar's
    grammar took any day up to 31 in any month (``2023-02-30``)."""
    import datetime

    date = json_schema_grammar({"type": "string", "format": "date"}, any_whitespace=False)
    stamp = json_schema_grammar({"type": "string", "format": "date-time"}, any_whitespace=False)
    for year in ("0000", "0004", "1900", "2000", "2023", "2024"):
        for month in range(1, 13):
            for day in (1, 28, 29, 30, 31):
                text = f"{year}-{month:02}-{day:02}"
                try:
                    valid = datetime.date.fromisoformat(text) is not None
                except ValueError:
                    valid = False
                assert accepts(date, f'"{text}"') == valid, text
                assert accepts(stamp, f'"{text}T23:59:59.5+01:00"') == valid, text
    assert not accepts(stamp, '"2024-01-01T23:59:60Z"')  # (rfc3339-validator refuses a leap second)
