"""Constrained decoding: outputs that follow a JSON schema, a regular expression, a choice
of strings, an EBNF grammar or a structural tag, through xgrammar (the ``aiocb[structured]`` extra).

A constraint is compiled once per ``(kind, text)`` against the tokenizer's vocabulary
(:class:`GrammarCompiler`, cached, the least recently used dropped beyond
:data:`CACHE_LIMIT_BYTES`; the manager's async methods compile off the event loop; one
longer than :data:`PROBED_ABOVE` characters is compiled in a child process first, under
the manager's deadline: see :mod:`aiocb.grammar_process`). Each
constrained request keeps a :class:`GrammarState` on the loop's thread: the plan's copy
for the device fills the request's row of the step's token bitmask (what the grammar
allows next), the sampler masks that row's logits with it, and the sampled token moves
the state on. Rows without a constraint are not touched, so their tokens are what
they would be alone. A constrained request is never planned while its last token is still
being sampled (the next mask depends on it), and it ends when its grammar is complete.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import os
import re
import threading
import typing
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from aiocb import grammar_process
from aiocb.errors import InvalidRequestError
from aiocb.grammar_process import CompileFailed, CompileTimeout, GrammarProcessError
from aiocb.params import MAX_LITERAL_CHARACTERS
from aiocb.python_regex import UnsupportedPattern, xgrammar_regex

logger = logging.getLogger(__name__)


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError:
        raise InvalidRequestError(
            "json_schema, regex, choice, grammar and structural_tag need xgrammar: pip install 'aiocb[structured]'"
        ) from None
    return xgrammar


#: Constraints longer than this many characters compile in a child process first, under
#: the manager's ``grammar_compile_timeout`` (a shorter one compiles in well under a second:
#: 33 levels of nested objects in 20 ms, 70 optional properties in less).
PROBED_ABOVE = 2048

#: What the compiled constraints of one manager may hold in memory: each distinct
#: constraint's grammar is kept (a quarter of a megabyte for a 4,096-token vocabulary, more
#: for larger ones), and clients may send as many distinct ones as they like.
CACHE_LIMIT_BYTES = 512 * 2**20


class GrammarCompiler:
    """Compiles constraints against one tokenizer's vocabulary, and caches them (the least
    recently used dropped once they hold more than :data:`CACHE_LIMIT_BYTES`)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        stop_token_ids: Collection[int] = (),
        compile_timeout: float | None = None,
    ) -> None:
        xgr = _xgrammar()
        self.vocab_size = vocab_size
        # The model's own end tokens end a complete grammar (a chat model's <|im_end|>, say,
        # which the tokenizer's eos_token need not be).
        stops = sorted(i for i in stop_token_ids if 0 <= i < vocab_size) or None
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stops)
        #: the tokens that end a complete grammar unless a request says otherwise
        self.stop_token_ids = frozenset(info.stop_token_ids)
        # (no cache of its own: this one's, bounded, holds every compiled grammar; at most
        # half the usable cores, from its 8: a long compile took every core of two from
        # the steps, which ran 10-20 times slower meanwhile)
        usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
        threads = max(1, min(8, usable // 2))
        self._compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self._info, self._threads = info, threads
        #: seconds a constraint may take to compile (in a child process first, stopped past
        #: it; None: compiled in this process alone, with no bound)
        self.compile_timeout = compile_timeout
        self._processes: grammar_process.GrammarProcesses | None = None
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._cached_bytes = 0
        self._lock = threading.Lock()  # (compiled on worker threads too)

    def is_cached(self, structure: tuple[str, str]) -> bool:
        """Whether ``structure`` was compiled already."""
        return structure in self._compiled

    def compile(self, structure: tuple[str, str]) -> Any:
        """The compiled grammar of ``(kind, text)``; InvalidRequestError naming what is wrong."""
        with self._lock:
            compiled = self._compiled.get(structure)
            if compiled is not None:
                self._compiled.move_to_end(structure)
                return compiled
        kind, text = structure
        if kind == "structural_tag":
            unknown = _unknown_format_key(json.loads(text).get("format"), "format")
            if unknown is not None:
                path, what = unknown
                raise InvalidRequestError(f"structural_tag.{path}: {what}", param=f"structural_tag.{path}")
            text = current_structural_tag(text)
        problem = _schema_problem(kind, text)
        if problem is not None:
            raise InvalidRequestError(f"{kind}: {problem}", param=kind)
        timeout = self.compile_timeout  # (None from now on where no child starts: read once)
        if timeout is not None and len(structure[1]) > PROBED_ABOVE:
            self._probe(kind, text, timeout)
        try:
            method, argument = compiler_input(kind, text)
            compiled = getattr(self._compiler, f"compile_{method}")(argument)
        except Exception as error:
            raise not_compiled(kind, error) from None
        with self._lock:
            if structure not in self._compiled:
                self._compiled[structure] = compiled
                self._cached_bytes += compiled.memory_size_bytes
                while self._cached_bytes > CACHE_LIMIT_BYTES and len(self._compiled) > 1:
                    _, dropped = self._compiled.popitem(last=False)
                    self._cached_bytes -= dropped.memory_size_bytes
        return compiled

    def _probe(self, kind: str, text: str, timeout: float) -> None:
        """Make and compile the constraint in a child process first (see
        :mod:`aiocb.grammar_process`): InvalidRequestError when it does not compile, or not
        within ``timeout`` seconds."""
        with self._lock:
            if self._processes is None:
                self._processes = grammar_process.shared(self._info.serialize_json(), self._threads)
            processes = self._processes
        try:
            message = processes.compiles(kind, text, timeout)
        except CompileTimeout:
            raise InvalidRequestError(
                f"{kind} does not compile within grammar_compile_timeout ({timeout:g} s; it was "
                "stopped): give a simpler one (fewer optional properties, less nesting), or raise the manager's "
                "ContinuousBatchingConfig.grammar_compile_timeout",
                param=kind,
            ) from None
        except CompileFailed as error:
            raise InvalidRequestError(f"{kind} cannot be compiled: {error}", param=kind) from None
        except GrammarProcessError as error:
            logger.warning("%s; constraints compile in this process alone, with no deadline", error)
            with self._lock:
                self.compile_timeout = None
            return
        if message is not None:
            raise InvalidRequestError(message, param=kind)

    def state(self, structure: tuple[str, str], ends: frozenset[int] | None = None) -> GrammarState:
        """A fresh matcher for one request (or one sample of it), whose complete output ends
        with one of ``ends`` (None: :attr:`stop_token_ids`; empty: a request with no end
        tokens, ``ignore_eos``, goes on while its grammar allows more, and ends with one of
        :attr:`stop_token_ids` only when its grammar allows nothing else)."""
        matcher = _xgrammar().GrammarMatcher(self.compile(structure))
        if ends is None or ends == self.stop_token_ids:
            return GrammarState(matcher)
        return GrammarState(matcher, ends - self.stop_token_ids, self.stop_token_ids - ends)


#: JSON Schema keywords that constrain (not annotate) an instance, which xgrammar may leave
#: out of the grammar it builds: each one a schema holds is checked (:func:`_unenforced_keyword`)
_CHECKED_KEYWORDS = frozenset(
    {
        "not",
        "if",
        "then",
        "else",
        "uniqueItems",
        "contains",
        "minContains",
        "maxContains",
        "propertyNames",
        "dependentRequired",
        "dependentSchemas",
        "dependencies",
        "unevaluatedProperties",
        "unevaluatedItems",
        "multipleOf",
    }
)


def _schema_problem(kind: str, text: str) -> str | None:
    """What the JSON schemas of the constraint ``(kind, text)`` hold that is refused (a
    ``json_schema``, or a ``structural_tag``'s ``json_schema`` contents, named by the tag
    they are in): a keyword its grammar leaves out (:func:`_unenforced_keyword`), a
    pattern too slow to compile (:func:`_slow_pattern`), or more literal values than
    compile in good time, all its schemas' together (:func:`_many_literals`); None if none."""
    if kind not in ("json_schema", "structural_tag"):
        return None
    try:
        parsed = json.loads(text)
    except ValueError:
        return None  # (compiling reports it)
    if kind == "json_schema":
        return _problem_of(parsed) or _many_literals(_literal_characters(parsed))
    literals = 0  # (of all the tag's schemas: its grammar holds them all)

    def walk(node: Any, tag: Any) -> str | None:
        nonlocal literals
        if isinstance(node, dict):
            if node.get("type") == "json_schema" and "json_schema" in node:
                problem = _problem_of(node["json_schema"])
                if problem is not None:
                    where = "" if tag is None else f" of the tag beginning {tag!r}"
                    return f"the json_schema{where}: {problem}"
                literals += _literal_characters(node["json_schema"])
            tag = node.get("begin", tag) if node.get("type") == "tag" else tag
            children: Collection[Any] = node.values()
        elif isinstance(node, list):
            children = node
        else:
            return None
        for child in children:
            found = walk(child, tag)
            if found is not None:
                return found
        return None

    problem = walk(parsed, None)
    return problem if problem is not None else _many_literals(literals, "its schemas'")


def _problem_of(schema: Any) -> str | None:
    ignored = _left_out(schema) or _unenforced_keyword(schema)
    if ignored is not None:
        return f"{ignored}, which constrained decoding cannot enforce; leave it out (and check the output yourself)"
    return _slow_pattern(schema) or _pattern_problem(schema)


def _pattern_problem(schema: Any) -> str | None:
    """``the pattern at PATH: why`` for the first ``pattern`` (or ``patternProperties``
    name) of ``schema`` (parsed) that :func:`~aiocb.python_regex.xgrammar_regex` refuses;
    None if none."""
    for path, key, text in _patterns(schema):
        try:
            xgrammar_regex(text)
        except UnsupportedPattern as error:
            where = "/".join(str(step) for step in (*path, key))
            return f"the {key} {text!r} at /{where}: {error}"
    return None


def _patterns(schema: Any) -> Iterator[tuple[tuple[str | int, ...], str, str]]:
    """``(path, key, pattern)`` for every regular expression of ``schema`` (parsed): a
    ``pattern`` (key ``"pattern"``) and each name of a ``patternProperties`` (key
    ``"patternProperties"``)."""
    for path, node in _schemas(schema):
        pattern, names = node.get("pattern"), node.get("patternProperties")
        if isinstance(pattern, str):
            yield path, "pattern", pattern
        if isinstance(names, dict):
            yield from ((path, "patternProperties", name) for name in names if isinstance(name, str))


def _literal_characters(schema: Any) -> int:
    """The characters of the ``enum`` and ``const`` values of ``schema`` (parsed), as JSON."""
    characters = 0
    for _, node in _schemas(schema):
        for key in ("enum", "const"):
            if key in node:
                characters += len(json.dumps(node[key], ensure_ascii=False))
    return characters


def _many_literals(characters: int, whose: str = "its") -> str | None:
    """Why a constraint's ``enum`` and ``const`` values of ``characters`` are too long to
    compile in good time (:data:`~aiocb.params.MAX_LITERAL_CHARACTERS`); None if they are not."""
    if characters <= MAX_LITERAL_CHARACTERS:
        return None
    return (
        f"{whose} enum and const values hold {characters} characters as JSON, more than the "
        f"{MAX_LITERAL_CHARACTERS} that compile in good time"
    )


#: The most times a JSON schema's ``pattern`` may repeat a piece through bounded
#: quantifiers (``{m,n}``, a product where one is inside another). The grammar xgrammar
#: builds for a pattern grows with it, and its compile time faster: 900 took 2.8 s, one
#: bound of 50,000 four minutes (to fail: a single bound past about 150 never compiles).
MAX_PATTERN_REPEATS = 128


def _slow_pattern(schema: Any) -> str | None:
    """``the pattern at PATH ...`` for the first ``pattern`` of ``schema`` (parsed), or key
    of its ``patternProperties``, that repeats a piece more than :data:`MAX_PATTERN_REPEATS`
    times; None if none does."""
    for path, key, pattern in _patterns(schema):
        if (repeats := pattern_repeats(pattern)) > MAX_PATTERN_REPEATS:
            what = "pattern" if key == "pattern" else "patternProperties key"
            return (
                f"the {what} at /{'/'.join(str(step) for step in path)} repeats a piece {repeats} times through "
                f"bounded quantifiers, more than the {MAX_PATTERN_REPEATS} that compile in good time (a "
                "quantifier inside another counts their product); use a smaller bound, or * and + (unbounded "
                "repetition is cheap)"
            )
    return None


#: a bounded quantifier: ``{m}``, ``{m,}``, ``{m,n}`` or ``{,n}`` (Python's 0 to n; ``{}`` is
#: no quantifier)
_BOUNDED = re.compile(r"\{(?:([0-9]+)(?:,([0-9]*))?|,([0-9]*))\}")


def pattern_repeats(pattern: str) -> int:
    """The most times ``pattern`` (a regular expression) repeats one piece through bounded
    quantifiers ``{m}``, ``{m,}``, ``{m,n}``, nested ones multiplied (1 without any)."""
    stack = [1]  # per open group: the most repeats of a piece inside it so far
    i, last = 0, 1  # (the repeats of the atom just read, which a quantifier multiplies)
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            i, last = i + 2, 1
            continue
        if char == "[":
            i = _class_end(pattern, i)
            last = 1
            continue
        if char == "(":
            stack.append(1)
            i += 1
            continue
        if char == ")" and len(stack) > 1:
            last = stack.pop()
            stack[-1] = max(stack[-1], last)
            i += 1
            continue
        quantifier = _BOUNDED.match(pattern, i) if char == "{" else None
        if quantifier is not None:
            last *= max(*(int(bound or 0) for bound in quantifier.groups()), 1)
            stack[-1] = max(stack[-1], last)
            i = quantifier.end()
            continue
        last = 1
        i += 1
    return max(stack)


def _class_end(pattern: str, start: int) -> int:
    """The index after the character class that opens at ``start``."""
    i = start + 1
    if i < len(pattern) and pattern[i] == "^":
        i += 1
    if i < len(pattern) and pattern[i] == "]":  # (a leading ] is a member)
        i += 1
    while i < len(pattern) and pattern[i] != "]":
        i += 2 if pattern[i] == "\\" else 1
    return i + 1


#: Keywords whose value maps names to schemas (its keys are names, not keywords).
_NAME_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies"})
#: Keywords whose value is data (an instance, not a schema): never looked into.
_DATA = frozenset({"const", "enum", "default", "examples", "example"})


def _schemas(
    node: Any, path: tuple[str | int, ...] = (), *, names: bool = False
) -> Iterator[tuple[tuple[str | int, ...], dict[str, Any]]]:
    """Every object within a parsed JSON schema that is a schema (not a map of names to
    schemas, ``names``: ``properties``, ``$defs``, ...; nothing inside ``const``, ``enum``
    and the other keywords whose values are data), with its path."""
    if isinstance(node, dict):
        if not names:
            yield path, node
        for key, value in node.items():
            if names:  # (a name: its value is a schema, whatever the name)
                yield from _schemas(value, (*path, key))
            elif key not in _DATA:
                yield from _schemas(value, (*path, key), names=key in _NAME_MAPS)
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _schemas(value, (*path, index))


#: Checked keywords xgrammar never enforces, whatever their form: a grammar built with one
#: may still be written differently (``not`` changes how the root rule is inlined; a
#: ``contains`` without ``items`` leaves only ``[]``, which it forbids).
_NEVER_ENFORCED = frozenset({"not", "contains", "minContains", "maxContains"})


#: What a schema with a ``$ref`` may hold beside it: annotations, and the definitions it
#: may name (xgrammar's grammar follows the reference alone, leaving out any constraint).
_BESIDE_A_REF = frozenset(
    {"$ref", "$defs", "definitions", "$schema", "$comment", "title", "description", "default", "examples"}
    | {"deprecated", "readOnly", "writeOnly"}
)


def _pointed(root: Any, ref: Any) -> Any:
    """What the reference ``ref`` (``#`` or ``#/a/b``, a JSON pointer into ``root``) names;
    None for one that names nothing in it, or that is not of that form."""
    if ref == "#":
        return root
    if not isinstance(ref, str) or not ref.startswith("#/"):
        return None
    target = root
    for step in ref[2:].split("/"):
        step = step.replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and step in target:
            target = target[step]
        elif isinstance(target, list) and step.isdigit() and int(step) < len(target):
            target = target[int(step)]
        else:
            return None
    return target


def _left_out(schema: Any) -> str | None:
    """``'KEYWORD' at PATH (why)`` for the first keyword of ``schema`` (parsed) in a form
    xgrammar's grammar is known to leave out, though the grammar it builds is written
    differently without it (so :func:`_unenforced_keyword` cannot tell); None if none is.
    Each was seen letting through outputs the schema forbids."""
    nodes = list(_schemas(schema))
    for path, node in nodes:
        for key in _NEVER_ENFORCED.intersection(node):
            if not _says_nothing(key, node):
                return f"{key!r} at /{'/'.join(str(step) for step in path)}"
    for path, node in nodes:
        where = f"at /{'/'.join(str(step) for step in path)}"
        ref = node.get("$ref")
        if ref is not None and _pointed(schema, ref) is None:
            local = isinstance(ref, str) and ref.startswith("#/")
            why = "it names nothing in the schema" if local else "only one within the schema, '#/...', is followed"
            return f"'$ref' {where} ({ref!r}: {why})"
        beside = sorted(set(node) - _BESIDE_A_REF) if ref is not None else []
        if beside:
            return f"{beside[0]!r} {where} (beside a '$ref', which the grammar follows alone)"
        if node.get("type") == []:
            return f"'type' {where} (an empty list, which no value is of)"
        types = _types(node)
        listed = [key for key in ("enum", "const") if key in node]
        if listed:
            problem = _beside_values(node, listed[0], types)
            if problem is not None:
                return f"{problem[0]!r} {where} ({problem[1]})"
            continue  # (its values are all the grammar takes: what else it holds was checked against them)
        multiple = node.get("multipleOf")
        if multiple is not None and (types is None or "number" in types or not _is_integer(multiple)):
            return f"'multipleOf' {where} (enforced only for integers, by an integer)"
        all_of = node.get("allOf")
        if isinstance(all_of, list) and len(all_of) > 1:
            return f"'allOf' {where} (of more than one schema, the grammar takes any value)"
        one_of = node.get("oneOf")
        if isinstance(one_of, list) and len(one_of) > 1 and not _disjoint(one_of, schema):
            return f"'oneOf' {where} (its schemas may overlap: the grammar takes any of them, not exactly one)"
        required, properties = node.get("required"), node.get("properties")
        if isinstance(required, list):
            undefined = [name for name in required if not isinstance(properties, dict) or name not in properties]
            if undefined:
                return f"'required' {where} (its {undefined[0]!r}, which 'properties' does not define)"
        if "pattern" in node and "format" in node:
            return f"'pattern' {where} (beside a 'format', which the grammar follows alone)"
        bounded = [key for key in ("minLength", "maxLength") if key in node]
        if bounded and ("pattern" in node or "format" in node):
            return f"{bounded[0]!r} {where} (beside a 'pattern' or 'format')"
    return None


#: Keywords beside an ``enum`` or ``const`` (whose values xgrammar's grammar takes alone)
#: that are checked against the values: each value must pass them.
_VALUE_CHECKS: dict[str, Callable[[Any, Any], bool]] = {
    "minimum": lambda value, bound: not _is_number(value) or value >= bound,
    "maximum": lambda value, bound: not _is_number(value) or value <= bound,
    "exclusiveMinimum": lambda value, bound: not _is_number(value) or value > bound,
    "exclusiveMaximum": lambda value, bound: not _is_number(value) or value < bound,
    "minLength": lambda value, bound: not isinstance(value, str) or len(value) >= bound,
    "maxLength": lambda value, bound: not isinstance(value, str) or len(value) <= bound,
}
#: Keywords beside an ``enum`` or ``const`` that constrain its values in ways not checked
#: here: refused (the grammar would let through the values they forbid). Other keys
#: (annotations, ``x-`` extensions, ``enumDescriptions``) are no constraint.
_BESIDE_VALUES_REFUSED = frozenset(
    {
        "format",
        "pattern",  # (an ECMA regex: Python's re reads $, \d or \w otherwise)
        "items",
        "prefixItems",
        "minItems",
        "maxItems",
        "properties",
        "patternProperties",
        "additionalProperties",
        "required",
        "minProperties",
        "maxProperties",
        "anyOf",
        "oneOf",
        "allOf",
    }
    | _CHECKED_KEYWORDS
)


def _beside_values(node: dict[str, Any], listed: str, types: frozenset[str] | None) -> tuple[str, str] | None:
    """``(keyword, why)`` for the first keyword beside ``node``'s ``enum`` or ``const``
    (``listed``) that a value it lists breaks, or that cannot be checked so; None if none."""
    values = node["enum"] if isinstance(node.get("enum"), list) else []
    values = [*values, node["const"]] if "const" in node else values
    other = next((value for value in values if types is not None and not types & _json_types(value)), _NO_VALUE)
    if other is not _NO_VALUE:
        return listed, f"its {other!r} is not of its 'type', which the grammar leaves out"
    for key in sorted(_BESIDE_VALUES_REFUSED.intersection(node)):
        return key, f"beside {listed!r}, whose values the grammar takes alone"
    for key in sorted(_VALUE_CHECKS.keys() & node.keys()):
        for value in values:
            bound = node[key]
            try:  # (a bound that is no number, draft 4's boolean exclusive bounds too: refused)
                passes = _is_number(bound) and _VALUE_CHECKS[key](value, bound)
            except (TypeError, ValueError, OverflowError):
                passes = False
            if not passes:
                return key, f"beside {listed!r}, whose value {value!r} it forbids: the grammar takes the values alone"
    return None


#: a value no schema lists
_NO_VALUE = object()


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _json_types(value: Any) -> frozenset[str]:
    """The JSON types ``value`` is of (an integer is a number too)."""
    if isinstance(value, bool):
        return frozenset({"boolean"})
    if _is_integer(value):
        return frozenset({"integer", "number"})
    if isinstance(value, float):
        return frozenset({"number"})
    names = {str: "string", type(None): "null", list: "array", dict: "object"}
    return frozenset({names[type(value)]}) if type(value) in names else frozenset()


def _says_nothing(key: str, node: dict[str, Any]) -> bool:
    """Whether ``key`` of ``node`` constrains nothing (its grammar is rightly the same
    without it): ``uniqueItems`` false, an empty ``dependentRequired``, a ``propertyNames``
    any name passes, ``unevaluatedProperties`` true, ``minContains`` without ``contains``."""
    value: object = node[key]
    if key == "uniqueItems":
        return value is False
    if key in ("dependentRequired", "dependentSchemas", "dependencies"):
        return value == {}
    if key == "propertyNames":
        return value in (True, {}, {"type": "string"})
    if key in ("unevaluatedProperties", "unevaluatedItems"):
        return value in (True, {})
    if key in ("minContains", "maxContains"):
        return "contains" not in node  # (``contains`` itself is refused)
    return False


def _types(node: dict[str, Any]) -> frozenset[str] | None:
    """The JSON types a schema's ``type`` allows (None: it does not say)."""
    kind = node.get("type")
    if isinstance(kind, str):
        return frozenset({kind})
    if isinstance(kind, list) and all(isinstance(k, str) for k in kind):
        return frozenset(kind)
    return None


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) or (isinstance(value, float) and value.is_integer())


#: The most schemas of a ``oneOf`` compared two by two (:func:`_apart`), where no one trait
#: keeps them all apart: the pairs grow as their square (1,000 took seconds, holding the GIL).
MOST_ONE_OF_PAIRS_COMPARED = 64


def _disjoint(branches: list[Any], root: Any) -> bool:
    """Whether no instance can match two of ``branches`` (a ``oneOf``'s), as :func:`_apart`
    shows it for each two (local ``$ref`` followed): at once where one trait (their types,
    their own values, the values of a property all of them require) keeps every two apart,
    else two by two for at most :data:`MOST_ONE_OF_PAIRS_COMPARED` schemas."""
    resolved = [_resolved(branch, root) for branch in branches]
    if not all(isinstance(branch, dict) for branch in resolved):
        return False
    kinds = [_types(branch) for branch in resolved]
    widened = [k | {"number"} if k is not None and "integer" in k else k for k in kinds]
    if _all_apart(widened) or _all_apart([_values(branch) for branch in resolved]):
        return True
    if all(kind == _OBJECTS for kind in kinds):
        common = set.intersection(*(set(branch.get("required") or ()) for branch in resolved))
        named = [branch.get("properties") or {} for branch in resolved]
        for name in sorted(common):
            if _all_apart([_values(_resolved(properties.get(name), root)) for properties in named]):
                return True
    if len(resolved) > MOST_ONE_OF_PAIRS_COMPARED:
        return False
    return all(_apart(a, b, root) for i, a in enumerate(resolved) for b in resolved[i + 1 :])


def _all_apart(sets: list[frozenset[str] | None]) -> bool:
    """Whether every set is known (not None) and no two share a member (in one pass: their
    sizes add up to their union's)."""
    known = [s for s in sets if s is not None]
    return len(known) == len(sets) and sum(map(len, known)) == len(frozenset().union(*known))


def _apart(a: dict[str, Any], b: dict[str, Any], root: Any) -> bool:
    """Whether no instance matches both schemas, as far as it is easily shown: their types
    differ (an integer is a number too), their own values (``const``, ``enum``) do, a
    property both require takes values that differ, or one requires a property the other
    cannot have (not among its ``properties``, where no others are allowed: xgrammar's strict
    mode leaves them out unless ``additionalProperties`` or ``patternProperties`` say). The
    last two only where one takes objects alone: ``required`` says nothing of any other value."""
    kinds = [_types(a), _types(b)]
    widened = [k | {"number"} if k is not None and "integer" in k else k for k in kinds]
    if _all_apart(widened) or _all_apart([_values(a), _values(b)]):
        return True
    if _OBJECTS not in kinds:
        return False
    named = [a.get("properties") or {}, b.get("properties") or {}]
    for name in set(a.get("required") or ()) & set(b.get("required") or ()):
        if _all_apart([_values(_resolved(properties.get(name), root)) for properties in named]):
            return True
    return _excludes(a, b) or _excludes(b, a)


#: The ``type`` of a schema of objects alone.
_OBJECTS = frozenset({"object"})


def _excludes(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether ``a`` requires a property that ``b`` cannot have (of an object)."""
    closed = b.get("additionalProperties", False) is False and not b.get("patternProperties")
    defined = b.get("properties") or {}
    return closed and isinstance(defined, dict) and any(name not in defined for name in a.get("required") or ())


def _values(node: Any) -> frozenset[str] | None:
    """The values a schema allows, as canonical JSON, when it lists them (``const``, ``enum``)."""
    if not isinstance(node, dict):
        return None
    if "const" in node:
        return frozenset({json.dumps(node["const"], sort_keys=True)})
    if isinstance(node.get("enum"), list):
        return frozenset(json.dumps(value, sort_keys=True) for value in node["enum"])
    return None


def _resolved(node: Any, root: Any) -> Any:
    """``node``, or the schema its local ``$ref`` (``#/$defs/Name``) points to, followed a
    few times at most (anything else: ``node`` itself)."""
    for _ in range(8):
        ref = node.get("$ref") if isinstance(node, dict) else None
        target = _pointed(root, ref) if isinstance(ref, str) and ref.startswith("#/") else None
        if target is None:
            return node
        node = target
    return node


def _unenforced_keyword(schema: Any) -> str | None:
    """``'KEYWORD' at PATH`` for the first constraining keyword of ``schema`` (parsed) that
    the grammar xgrammar builds leaves out (the grammar is the same without it); None if
    there is none. A grammar that ignored it would let through outputs the schema forbids."""
    found = [
        (path, key)
        for path, node in _schemas(schema)
        for key in node
        if key in _CHECKED_KEYWORDS and not _says_nothing(key, node)
    ]
    if not found:
        return None
    grammar = _xgrammar().Grammar.from_json_schema
    # Each keyword is tried in the schema that holds it (with the root's definitions, which
    # its references may name), not in the whole: a schema of hundreds of checked keywords
    # was built anew for each (seconds). Schemas alike are built once. In the whole where
    # the holder alone says nothing: below a `$ref` (xgrammar drops its siblings, which the
    # holder alone would enforce), or where it does not build alone (a reference it cannot
    # follow from there).
    built: dict[str, str | None] = {}

    def build(value: Any) -> str | None:
        text = json.dumps(value)
        if text not in built:
            try:
                built[text] = str(grammar(text, any_whitespace=False))
            except Exception:  # (compiling reports it)
                built[text] = None
        return built[text]

    if build(schema) is None:
        return None
    definitions = {key: schema[key] for key in ("$defs", "definitions") if isinstance(schema, dict) and key in schema}
    for path, key in found:
        holder, referenced = schema, False
        for step in path:
            referenced = referenced or "$ref" in holder
            holder = holder[step]
        alone = {**definitions, **holder} if path and not referenced else None
        kept = None if alone is None else build(alone)
        if alone is not None and kept is not None:
            ignored = build({name: value for name, value in alone.items() if name != key}) == kept
        else:
            without = copy.deepcopy(schema)
            node = without
            for step in path:
                node = node[step]
            del node[key]
            ignored = build(without) == build(schema)
        if ignored:
            return f"{key!r} at /{'/'.join(str(step) for step in path)}"
    return None


class GrammarState:
    """Where one request stands in its grammar (event-loop thread).

    The compiled grammar ends with the compiler's stop tokens; a request whose own end
    tokens differ (its ``eos_token_id``, its ``stop_token_ids``) is given ``ends``, those of
    its own the compiled grammar lacks, wherever the grammar is complete, and ``unended``,
    the compiled ones the request lacks, are taken away there (allowed still where the
    grammar allows nothing else: a request with no end tokens).
    """

    __slots__ = ("_ends", "_forced", "_matcher", "_unended", "rejected")

    def __init__(self, matcher: Any, ends: frozenset[int] = frozenset(), unended: frozenset[int] = frozenset()) -> None:
        self._matcher = matcher
        self._ends = ends
        self._unended = unended
        #: whether the last fill gave back the compiled ends, the only tokens left
        self._forced = False
        #: whether a token the grammar did not allow came (every token was masked: the
        #: request's other controls left none of those the grammar allows)
        self.rejected = False

    def accept(self, token: int) -> bool:
        """Take the request's next token; whether the request ends here (its grammar is
        complete, or the token was not one it allowed: :attr:`rejected`)."""
        if token in self._ends and self._matcher.is_completed():
            return True  # (one of the request's own ends, which the compiled grammar may not know)
        if (token in self._unended and not self._forced) or not self._matcher.accept_token(token):
            self.rejected = True
            return True
        return bool(self._matcher.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row ``row`` of ``bitmask``."""
        self._matcher.fill_next_token_bitmask(bitmask, row)
        self._forced = False
        if not (self._unended or self._ends) or not self._matcher.is_completed():
            return
        words = bitmask[row].numpy().view(np.uint32)  # (a view: written through)
        before = words.copy()
        for token in self._unended:
            if token // 32 < len(words):
                words[token // 32] &= ~np.uint32(1 << (token % 32))
        for token in self._ends:
            if token // 32 < len(words):
                words[token // 32] |= np.uint32(1 << (token % 32))
        # (no end tokens of its own, and the grammar allows nothing more: it ends as compiled)
        self._forced = not words.any()
        if self._forced:
            words[:] = before

    def only_ends(self, bitmask: torch.Tensor, row: int, ends: Collection[int]) -> bool:
        """Whether row ``row`` of ``bitmask``, just filled, allows nothing but ``ends`` (the
        grammar is complete and can only stop)."""
        if not self._matcher.is_completed():
            return False
        words = bitmask[row].numpy().view(np.uint32).copy()
        for token in ends:
            if token // 32 < len(words):
                words[token // 32] &= ~np.uint32(1 << (token % 32))
        return not words.any()


@functools.cache
def _format_keys() -> dict[str, frozenset[str]]:
    """The keys of each kind of structural tag format, by its ``type``, as xgrammar's
    models of them declare."""
    from xgrammar import structural_tag

    union = typing.get_args(typing.get_args(structural_tag.Format)[0])
    return {
        model.model_fields["type"].default: frozenset(f.alias or name for name, f in model.model_fields.items())
        for model in union
    }


#: The ``type`` a format has where it may leave it out, by the key that holds it.
_IMPLIED_TYPES = {"tags": "tag", "begin": "token", "end": "token"}


def _unknown_format_key(node: Any, path: str, implied: str | None = None) -> tuple[str, str] | None:
    """``(path of the key, problem)`` for the first key of a structural tag's format
    (``node``, at ``path``) that its kind of format does not have; None if none. xgrammar
    reads past such a key, so a misspelt one (``max_token``, ``stop_after_frist``) would
    silently change nothing. A format's JSON schemas are not formats: not looked into."""
    if isinstance(node, list):
        for i, item in enumerate(node):
            found = _unknown_format_key(item, f"{path}[{i}]", implied)
            if found is not None:
                return found
        return None
    if not isinstance(node, dict):
        return None
    kind = node.get("type", implied)
    known = _format_keys().get(kind) if isinstance(kind, str) else None
    if known is None:
        return None  # (an unknown type: compiling names it)
    for key, value in node.items():
        if key not in known:
            return f"{path}.{key}", f"the {kind!r} format has no key {key!r}; it takes {', '.join(sorted(known))}"
        if key not in ("json_schema", "type"):
            found = _unknown_format_key(value, f"{path}.{key}", _IMPLIED_TYPES.get(key))
            if found is not None:
                return found
    return None


def answer_format(structure: tuple[str, str]) -> dict[str, Any]:
    """The constraint ``(kind, text)`` (:meth:`~aiocb.SamplingParams.structure`) as an
    element of a structural tag's format, which holds the output as the constraint alone
    would (a JSON schema's grammar is the one :meth:`GrammarCompiler.compile` builds,
    after the same checks); InvalidRequestError naming what is wrong."""
    kind, text = structure
    problem = _schema_problem(kind, text)
    if problem is not None:
        raise InvalidRequestError(f"{kind}: {problem}", param=kind)
    if kind == "structural_tag":
        format_: dict[str, Any] = json.loads(current_structural_tag(text))["format"]
        return format_
    try:
        method, argument = compiler_input(kind, text)
    except Exception as error:
        raise not_compiled(kind, error) from None
    if method == "regex":
        return {"type": "regex", "pattern": argument}
    return {"type": "grammar", "grammar": str(argument)}


#: The time and source position xgrammar's C++ errors begin with (``[08:20:44] /x/y.cc:4944: ``).
_SOURCE_POSITION = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")


def _xgrammar_text(error: Exception) -> str:
    """An xgrammar error's message without the time and source file its C++ code gives it."""
    return _SOURCE_POSITION.sub("", str(error).strip(), count=1) or type(error).__name__


def not_compiled(kind: str, error: Exception) -> InvalidRequestError:
    """The refusal of a constraint that xgrammar (or the translation of its patterns) refused."""
    message = str(error) if isinstance(error, UnsupportedPattern) else _xgrammar_text(error)
    return InvalidRequestError(f"{kind} cannot be compiled: {message}", param=kind)


def compiler_input(kind: str, text: str) -> tuple[str, Any]:
    """What xgrammar's compiler is given for a constraint: ``(method, argument)``, the
    compiler's ``compile_<method>`` and its argument (a grammar, or text; its ``str`` is
    text the same method takes)."""
    if kind == "json_schema":
        # No free whitespace: a weak model could otherwise pad its JSON without end.
        return "grammar", json_schema_grammar(text, any_whitespace=False)
    if kind == "regex":
        return "regex", xgrammar_regex(text)
    if kind == "structural_tag":
        return "structural_tag", _mended_json_elements(text)
    return "grammar", _mended_grammar(text)


#: A string literal or a character class of the EBNF text xgrammar prints (read whole, so
#: that neither is mistaken for the other).
_EBNF_ATOMS = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]')
#: The class xgrammar (0.2.8 and 0.2.9) writes for the characters of a JSON string with a
#: length bound (``minLength``, ``maxLength``), which takes raw control characters, which no
#: JSON text holds (``json.loads`` refuses them), where its strings without a bound take none.
_BOUNDED_CHARACTERS = r"[^\"\\\r\n]"
_JSON_CHARACTERS = r"[^\0-\x1f\"\\\r\n]"
#: What a negated class leaves out besides its own: the UTF-8 bytes of UTF-16 surrogates,
#: which xgrammar's negated classes take (``ED A0 80``...) and no text holds (they decode
#: to U+FFFD, a JSON string's length past its bound, a regex's class not matched).
_SURROGATES = r"\ud800-\udfff"


def _mended_classes(ebnf: str) -> str:
    """``ebnf`` (xgrammar's printed form) with each negated class leaving out surrogates,
    and a length-bounded JSON string's characters those of any JSON string."""

    def mend(atom: re.Match[str]) -> str:
        text = atom[0]
        if not text.startswith("[^"):
            return text
        if text == _BOUNDED_CHARACTERS:
            text = _JSON_CHARACTERS
        return text[:-1] + _SURROGATES + "]"

    return _EBNF_ATOMS.sub(mend, ebnf)


def _mended_grammar(text: str) -> Any:
    """A client's EBNF grammar, its negated classes leaving out surrogates (see
    :func:`_mended_classes`): the grammar, or the mended grammar's printed form."""
    grammar = _xgrammar().Grammar.from_ebnf(text)
    printed = str(grammar)
    mended = _mended_classes(printed)
    return grammar if mended == printed else mended


#: The keys of a structural tag's ``json_schema`` format that :func:`json_schema_grammar`
#: takes (one with other keys, or another ``style``, is left to xgrammar as it is)
_GRAMMAR_OPTIONS = frozenset({"type", "json_schema", "style", "max_whitespace_cnt", "any_order"})


def json_schema_grammar(schema: Any, **options: Any) -> Any:
    """xgrammar's grammar of a JSON schema (``schema``: its text, or parsed; ``options``:
    ``Grammar.from_json_schema``'s), its patterns read as Python's (:func:`_python_patterns`)
    and its strings' characters mended (:func:`_mended_classes`): the grammar, or the
    mended grammar's EBNF text."""
    parsed = json.loads(schema) if isinstance(schema, str) else copy.deepcopy(schema)
    text = json.dumps(_python_patterns(parsed))
    grammar = _xgrammar().Grammar.from_json_schema(text, **options)
    ebnf = str(grammar)
    mended = _mended_classes(ebnf)
    return grammar if mended == ebnf else mended


#: A calendar date (``YYYY-MM-DD``) as ``datetime.date.fromisoformat`` takes it, which is
#: how ``jsonschema`` checks the ``date`` format: each month's days, February's 29th in leap
#: years alone, no year 0 (xgrammar's grammar for the format takes any day up to 31).
_DATE = (
    "(?:(?:[0-9]{3}[1-9]|[0-9]{2}[1-9][0-9]|[0-9][1-9][0-9]{2}|[1-9][0-9]{3})-"
    "(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
    "|02-(?:0[1-9]|1[0-9]|2[0-8]))"
    "|(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)-02-29)"
)
#: The formats whose values xgrammar's grammar holds loosely, as patterns that hold them
#: exactly (a ``date-time``'s time as xgrammar writes it, less the leap second, which
#: ``rfc3339-validator``, the checker ``jsonschema`` uses, refuses).
_EXACT_FORMATS = {
    "date": _DATE,
    "date-time": _DATE
    + "T(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]+)?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])",
}


def _python_patterns(schema: Any) -> Any:
    """``schema`` (parsed; changed in place) with each ``pattern`` (and ``patternProperties`` name)
    written as xgrammar reads what Python's ``re`` does (:func:`~aiocb.python_regex.xgrammar_regex`;
    :func:`_pattern_problem` refused those it cannot write), and each format of
    :data:`_EXACT_FORMATS` without a pattern made that pattern."""
    for _, node in _schemas(schema):  # (each node changed as it comes, before its keys are walked)
        exact = _EXACT_FORMATS.get(node["format"]) if isinstance(node.get("format"), str) else None
        if exact is not None and "pattern" not in node:
            del node["format"]
            node["pattern"] = exact
        if isinstance(node.get("pattern"), str):
            node["pattern"] = xgrammar_regex(node["pattern"])
        names = node.get("patternProperties")
        if isinstance(names, dict):
            node["patternProperties"] = {xgrammar_regex(name): value for name, value in names.items()}
    return schema


def _mended_json_elements(text: str) -> str:
    """A structural tag (its text) whose ``json_schema`` formats are ``grammar`` ones where
    :func:`json_schema_grammar` mends their grammar."""

    def mend(node: Any) -> Any:
        if isinstance(node, list):
            return [mend(item) for item in node]
        if not isinstance(node, dict):
            return node
        if (
            node.get("type") == "json_schema"
            and "json_schema" in node  # (else xgrammar says what is missing)
            # (an empty ``excludes``, which xgrammar's own tags for tools write, excludes nothing)
            and node.keys() - {"excludes"} <= _GRAMMAR_OPTIONS
            and not node.get("excludes")
            and node.get("style", "json") == "json"
        ):
            options = {key: node[key] for key in ("max_whitespace_cnt", "any_order") if key in node}
            grammar = json_schema_grammar(node["json_schema"], **options)
            if isinstance(grammar, str):
                return {"type": "grammar", "grammar": grammar}
            return node
        return {key: mend(value) for key, value in node.items()}

    tag = json.loads(text)
    mended = mend(tag)
    return text if mended == tag else json.dumps(mended)


def current_structural_tag(text: str) -> str:
    """A structural tag in xgrammar's current form. The older form that vLLM and SGLang
    clients still send (``structures`` of ``begin``/``schema``/``end``, and ``triggers``) is
    a ``triggered_tags`` format; its JSON gets no runs of whitespace, as ``json_schema`` does."""
    tag = json.loads(text)
    structures = tag.get("structures")
    if "format" in tag or not isinstance(structures, list) or not all(isinstance(s, dict) for s in structures):
        return text  # (what is wrong with it, compiling reports)
    tags = []
    for structure in structures:
        content = {"type": "json_schema", "json_schema": structure.get("schema"), "max_whitespace_cnt": 1}
        tags.append({"type": "tag", "begin": structure.get("begin"), "content": content, "end": structure.get("end")})
    triggered = {"type": "triggered_tags", "triggers": tag.get("triggers", []), "tags": tags}
    return json.dumps({"type": "structural_tag", "format": triggered})


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A ``[rows, ceil(vocab / 32)]`` int32 bitmask (one bit per token) on the host."""
    bitmask: torch.Tensor = _xgrammar().allocate_token_bitmask(rows, vocab_size)
    return bitmask


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Set to -inf the logits of the tokens that row i of ``bitmask`` forbids, in row
    ``rows[i]`` of ``logits`` (in place)."""
    constrained = logits.index_select(0, rows)
    _xgrammar().apply_token_bitmask_inplace(constrained, bitmask.to(logits.device))
    logits.index_copy_(0, rows, constrained)
