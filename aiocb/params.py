"""``aiocb.SamplingParams``: every control of one request, typed and checked in one place.

A field left at ``None`` is "not given": the manager's ``GenerationConfig`` decides, and
then transformers' own defaults (see :mod:`aiocb.sampling`). The checks here need no
model (types and ranges); the ones that do (token ids within the vocabulary, a prompt
that fits the context) happen when a request is built. Every error is an
:class:`~aiocb.InvalidRequestError` that names the field.

The README's table of request parameters is generated from this class
(:func:`parameter_table`), and a test keeps the two equal.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import json
import math
import numbers
import operator
import re
import reprlib
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiocb.core.sequences import SequenceBias
from aiocb.errors import InvalidRequestError
from aiocb.gil import pause


def _doc(text: str, default: str = "") -> dict[str, str]:
    return {"doc": text, "default": default}


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """Which tokens one request produces, when it stops and what it reports.

    Pass one to ``Manager.add_request(..., sampling_params=...)`` (and ``generate``,
    ``add_requests``, ``generate_batch``), or give the same fields as keyword arguments.
    Values are normalised on construction: ``stop`` becomes a tuple of strings,
    ``logit_bias`` a tuple of ``(token id, bias)`` pairs sorted by id, ``sequence_bias``
    a tuple of ``(token ids, bias)``, id lists tuples.
    """

    max_new_tokens: int | None = field(
        default=None,
        metadata=_doc(
            "tokens to generate at most; with the prompt, within the model's context (beyond it the request is "
            "refused, as vLLM does, where `generate` only warns)",
            "GenerationConfig (its `max_length` counts the prompt), else 20",
        ),
    )
    min_tokens: int | None = field(
        default=None,
        metadata=_doc(
            "no EOS or stop token before this many tokens, and no stop string that ends before (`min_new_tokens`)", "0"
        ),
    )
    do_sample: bool | None = field(
        default=None,
        metadata=_doc(
            "sample instead of greedy; when not given, passing `temperature`, `top_k`, `top_p` or another "
            "sampling filter (`min_p`, `typical_p`, `epsilon_cutoff`, `eta_cutoff`, `top_h`) samples",
            "GenerationConfig",
        ),
    )
    temperature: float | None = field(
        default=None, metadata=_doc("softmax temperature; 0 is greedy, else at least 1e-6", "1.0")
    )
    top_k: int | None = field(default=None, metadata=_doc("keep the k most likely tokens (0: off)", "50"))
    top_p: float | None = field(default=None, metadata=_doc("keep the smallest set with this mass (1: off)", "1.0"))
    min_p: float | None = field(
        default=None, metadata=_doc("drop tokens below `min_p` times the top probability (0: off)", "0")
    )
    top_h: float | None = field(
        default=None,
        metadata=_doc(
            "of the 100 most likely tokens, keep the most likely while their entropy is at most `top_h` times "
            "the 100's (applied before `top_k`; 0: off)",
            "0",
        ),
    )
    typical_p: float | None = field(
        default=None,
        metadata=_doc("locally typical sampling: keep the tokens nearest the entropy with this mass (1: off)", "1.0"),
    )
    epsilon_cutoff: float | None = field(
        default=None, metadata=_doc("drop tokens below this probability, in [0, 1) (0: off)", "0")
    )
    eta_cutoff: float | None = field(
        default=None,
        metadata=_doc("drop tokens below `min(eta, sqrt(eta) * exp(-entropy))`, in [0, 1) (0: off)", "0"),
    )
    seed: int | None = field(
        default=None,
        metadata=_doc(
            (
                "the request's own random stream (an int in [-2**63, 2**64)): same seed, same samples;"
                " with `n`, sample i (from 0: `<id>`, then `<id>__child#<i-1>`) draws from `seed + i`'s (as vLLM's do)"
            ),
            "random",
        ),
    )
    repetition_penalty: float | None = field(
        default=None,
        metadata=_doc("transformers' penalty on prompt and output tokens (> 1 discourages repeats; 1: off)", "1.0"),
    )
    presence_penalty: float | None = field(
        default=None, metadata=_doc("OpenAI's: subtracted once from every token already generated", "0")
    )
    frequency_penalty: float | None = field(
        default=None, metadata=_doc("OpenAI's: subtracted per occurrence in the output", "0")
    )
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] | None = field(
        default=None, metadata=_doc("`{token id: bias}` added to the logits (-100 bans, 100 forces)", "none")
    )
    sequence_bias: Mapping[tuple[int, ...], float] | tuple[SequenceBias, ...] | None = field(
        default=None,
        metadata=_doc(
            "transformers': bias a sequence's last token where the prompt and output so far end with the rest",
            "none",
        ),
    )
    bad_words_ids: Iterable[Iterable[int]] | None = field(
        default=None,
        metadata=_doc(
            "token sequences never generated (a sequence's start may end the prompt; as in transformers, a "
            "one-token EOS stays allowed, unless `ignore_eos`)",
            "none",
        ),
    )
    bad_words: str | Iterable[str] | None = field(
        default=None,
        metadata=_doc(
            "vLLM's: words never generated, each as the tokenizer writes it alone and after a space "
            "(needs a tokenizer; as `bad_words_ids`)",
            "none",
        ),
    )
    no_repeat_ngram_size: int | None = field(
        default=None,
        metadata=_doc("transformers': no n-gram of this many tokens occurs twice in prompt and output (0: off)", "0"),
    )
    allowed_token_ids: Iterable[int] | None = field(
        default=None, metadata=_doc("only these tokens may be generated", "all")
    )
    stop: str | Iterable[str] | None = field(
        default=None,
        metadata=_doc("stop strings, matched across tokens (needs a tokenizer); not in `text`", "none"),
    )
    include_stop_str_in_output: bool | None = field(
        default=None,
        metadata=_doc(
            "keep the stop string (or the text of the stop token) that ended the request at the end of `text` "
            "(needs a tokenizer)",
            "False",
        ),
    )
    stop_token_ids: Iterable[int] | None = field(
        default=None,
        metadata=_doc(
            "tokens that end the request, as EOS does (kept in `generated_tokens`; their text left out of `text`)",
            "none",
        ),
    )
    eos_token_id: int | Iterable[int] | None = field(
        default=None, metadata=_doc("replaces the EOS ids (`[]`: none)", "GenerationConfig, else the model's")
    )
    ignore_eos: bool | None = field(
        default=None, metadata=_doc("do not stop at EOS (`stop_token_ids` still stop)", "False")
    )
    skip_special_tokens: bool | None = field(
        default=None, metadata=_doc("leave special tokens out of `text` (needs a tokenizer)", "True")
    )
    return_logprobs: bool | None = field(
        default=None,
        metadata=_doc("each generated token's log-probability", "`ContinuousBatchingConfig.return_logprobs`"),
    )
    top_logprobs: int | None = field(
        default=None, metadata=_doc("the most likely alternatives per generated token, with theirs", "0")
    )
    prompt_logprobs: bool | None = field(
        default=None, metadata=_doc("each prompt token's log-probability given the ones before", "False")
    )
    logprobs_mode: str | None = field(
        default=None,
        metadata=_doc(
            '`"raw"`: logprobs of the model\'s distribution (a log-softmax of its logits); `"processed"`: of '
            "the distribution the token was drawn from (after the logits controls, a grammar's mask, temperature "
            "and the filters), as transformers gives them; for a request that returns logprobs (prompt logprobs are "
            "always the model's: no prompt token is drawn)",
            '`"raw"`',
        ),
    )
    record_timestamps: bool | None = field(
        default=None,
        metadata=_doc("when each generated token came (`time.perf_counter()`), in the output's `timestamps`", "False"),
    )
    truncate_prompt_tokens: int | None = field(
        default=None,
        metadata=_doc("vLLM's: keep only the prompt's last this many tokens (-1: the model's context length)", "none"),
    )
    n: int | None = field(
        default=None,
        metadata=_doc(
            "samples of the prompt, computed once; `generate` returns a list; the first sample keeps `<id>`, "
            "the others are `<id>__child#0`, `<id>__child#1`, ...",
            "1 (or the GenerationConfig's `num_return_sequences`)",
        ),
    )
    priority: int | None = field(
        default=None,
        metadata=_doc("lower runs first: admitted before, and may preempt, requests with a higher value", "0"),
    )
    timeout: float | None = field(
        default=None, metadata=_doc("seconds until the request ends with `timeout` (queue time included)", "none")
    )
    json_schema: Mapping[str, Any] | str | type | None = field(
        default=None,
        metadata=_doc(
            "the output is JSON valid under this schema: a dict, its JSON text or a pydantic model class "
            "(needs a tokenizer and `aiocb[structured]`)",
            "none",
        ),
    )
    regex: str | None = field(default=None, metadata=_doc("the output matches this regular expression", "none"))
    choice: Iterable[str] | None = field(default=None, metadata=_doc("the output is one of these strings", "none"))
    grammar: str | None = field(
        default=None, metadata=_doc("the output follows this EBNF grammar (start rule `root`)", "none")
    )
    structural_tag: Mapping[str, Any] | str | None = field(
        default=None,
        metadata=_doc(
            "the output follows this xgrammar structural tag (a dict or its JSON text): free text with "
            "constrained spans, such as tool calls",
            "none",
        ),
    )

    def __post_init__(self) -> None:
        self._check(None)

    def _check(self, names: Collection[str] | None) -> None:
        """Check and normalise the fields ``names`` (None: all; the others are as checked
        before), in one order whatever was given (the first fault is the one named), then
        the rule between fields."""
        for name in _CHECKS if names is None else sorted(names, key=_CHECK_ORDER.__getitem__):
            if getattr(self, name) is not None:
                _CHECKS[name](self, name)
        given = [name for name in STRUCTURE_FIELDS if getattr(self, name) is not None]
        if len(given) > 1:
            fields = ", ".join(STRUCTURE_FIELDS)
            raise InvalidRequestError(f"at most one of {fields} may be given, got {', '.join(given)}")

    def structure(self) -> tuple[str, str] | None:
        """The output's constraint as ``(kind, text)``: ``("json_schema", schema JSON)``,
        ``("regex", pattern)`` or ``("grammar", EBNF)`` (a ``choice`` becomes a grammar)."""
        if self.json_schema is not None:
            return ("json_schema", str(self.json_schema))
        if self.regex is not None:
            return ("regex", self.regex)
        if self.grammar is not None:
            return ("grammar", self.grammar)
        if self.structural_tag is not None:
            return ("structural_tag", str(self.structural_tag))
        if self.choice is not None:
            alternatives = " | ".join(json.dumps(text, ensure_ascii=False) for text in self.choice)
            return ("grammar", f"root ::= {alternatives}")
        return None

    def given(self) -> dict[str, Any]:
        """The fields that were given (not ``None``), by name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}

    def updated(self, **fields: Any) -> SamplingParams:
        """A copy with ``fields`` given (``None`` values are left out); unknown names are refused."""
        check_names(fields)
        changes = {k: v for k, v in fields.items() if v is not None}
        # Field by field, only the given ones checked: dataclasses.replace checks every field
        # again (a logit_bias over the vocabulary, already checked, took 100 ms again).
        copy = object.__new__(SamplingParams)
        for name in SamplingParams.__slots__:
            object.__setattr__(copy, name, changes[name] if name in changes else getattr(self, name))
        copy._check(changes)
        return copy


FIELD_NAMES: frozenset[str] = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def check_sampling_params(value: object) -> None:
    """InvalidRequestError unless ``value`` is a :class:`SamplingParams` or None."""
    if value is not None and not isinstance(value, SamplingParams):
        raise InvalidRequestError(
            f"sampling_params must be an aiocb.SamplingParams, got {type(value).__name__}", param="sampling_params"
        )


def check_names(fields: Mapping[str, Any]) -> None:
    """Refuse names that are not :class:`SamplingParams` fields, naming them."""
    unknown = sorted(set(fields) - FIELD_NAMES)
    if unknown:
        raise InvalidRequestError(
            f"unknown request parameter(s): {', '.join(unknown)}; known: {', '.join(sorted(FIELD_NAMES))}",
            param=unknown[0],
        )


#: The fields that constrain the output's form; one at most.
STRUCTURE_FIELDS: tuple[str, ...] = ("json_schema", "regex", "choice", "grammar", "structural_tag")


def asks_for_structure(sampling_params: Any, params: Mapping[str, Any]) -> bool:
    """Whether a request's parameters (a ``SamplingParams`` and keyword fields) carry an
    output constraint, whose compile belongs off the event loop."""
    return not params.keys().isdisjoint(STRUCTURE_FIELDS) or (
        isinstance(sampling_params, SamplingParams) and sampling_params.structure() is not None
    )


def _json_schema(value: Any) -> str | None:
    """A JSON schema given as a dict, JSON text or pydantic model class, as JSON text."""
    if isinstance(value, type):
        to_schema = getattr(value, "model_json_schema", None)
        if to_schema is None:
            raise InvalidRequestError(
                f"json_schema: {value.__name__} is not a pydantic model class", param="json_schema"
            )
        value = to_schema()
    return _json_object("json_schema", value)


def _json_object(name: str, value: Any) -> str | None:
    """A JSON object given as a dict or as JSON text, as JSON text."""
    mapping = _json_mapping(name, value)
    return None if mapping is None else _json_text(name, mapping)


#: A structural tag's keys in xgrammar's form, and in the older one that vLLM and SGLang
#: clients still send (``structures`` of ``begin``, ``schema`` and ``end``, and ``triggers``).
_TAG_KEYS = ("type", "format")
_LEGACY_TAG_KEYS = ("type", "structures", "triggers")
_LEGACY_STRUCTURE_KEYS = ("begin", "schema", "end")


def _structural_tag(value: Any) -> str | None:
    """A structural tag given as a dict or as JSON text, as JSON text. A key that neither
    form has is refused: xgrammar reads past it, so a misspelt one would change nothing.
    What ``format`` holds is checked when it is compiled (:mod:`aiocb.structured`)."""
    tag = _json_mapping("structural_tag", value)
    if tag is None:
        return None
    _refuse_tag_keys(tag, _TAG_KEYS if "format" in tag else _LEGACY_TAG_KEYS, "structural_tag")
    structures = tag.get("structures")
    if isinstance(structures, list):
        for i, structure in enumerate(structures):
            if isinstance(structure, Mapping):
                _refuse_tag_keys(structure, _LEGACY_STRUCTURE_KEYS, f"structural_tag.structures[{i}]")
    return _json_text("structural_tag", tag)


def _refuse_tag_keys(value: Mapping[str, Any], known: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise InvalidRequestError(
            f"{where} has the unknown key(s) {unknown}; it takes {', '.join(known)}",
            param=f"{where}.{unknown[0]}",
        )


def _json_mapping(name: str, value: Any) -> Mapping[str, Any] | None:
    """A JSON object given as a dict or as JSON text."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as error:
            raise InvalidRequestError(f"{name} is not valid JSON: {error}", param=name) from None
        except RecursionError:
            raise InvalidRequestError(f"{name} nests too deeply to read", param=name) from None
    if not isinstance(value, Mapping):
        raise InvalidRequestError(f"{name} must be a JSON object (a dict), got {type(value).__name__}", param=name)
    return value


def _json_text(name: str, value: Mapping[str, Any]) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError) as error:
        raise InvalidRequestError(f"{name} cannot be written as JSON: {error}", param=name) from None
    except RecursionError:
        raise InvalidRequestError(f"{name} nests too deeply to write as JSON", param=name) from None


def parameter_table() -> str:
    """The Markdown table of request parameters (the README's, kept equal by a test)."""
    lines = ["| parameter | default | meaning |", "|---|---|---|"]
    for f in dataclasses.fields(SamplingParams):
        lines.append(f"| `{f.name}` | {f.metadata['default']} | {f.metadata['doc']} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- checks


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _set(params: SamplingParams, name: str, value: Any) -> None:
    object.__setattr__(params, name, value)


def _check_int(params: SamplingParams, name: str, *, minimum: int | None, maximum: int | None = None) -> None:
    value = getattr(params, name)
    if value is None:
        return
    if not _is_int(value):
        number = token_id(value)  # (a NumPy integer, a one-element integer tensor: the int it holds)
        if number is None:
            raise InvalidRequestError(f"{name} must be an int, got {value!r}", param=name)
        value = number
        _set(params, name, value)
    if minimum is not None and value < minimum:
        raise InvalidRequestError(f"{name} must be >= {minimum}, got {_shown(value)}", param=name)
    if maximum is not None and value > maximum:
        raise InvalidRequestError(f"{name} must be <= {maximum}, got {_shown(value)}", param=name)


def _shown(value: Any) -> str:
    """``value`` for a message: its repr, or an int's size where it is too long for one
    (4,300 digits or more have none)."""
    if isinstance(value, int) and value.bit_length() > 13_000:  # (some 3,900 digits)
        return f"an integer of {value.bit_length()} bits"
    return reprlib.repr(value)


def _check_bool(params: SamplingParams, name: str) -> None:
    value = getattr(params, name)
    if value is not None and not isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be True or False, got {value!r}", param=name)


def _check_float(
    params: SamplingParams,
    name: str,
    *,
    low: float,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    value = getattr(params, name)
    if value is None:
        return
    # (a NumPy float is a real number too; a bool, NumPy's included, is none)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidRequestError(f"{name} must be a number (an int or a float), got {value!r}", param=name)
    try:
        value = float(value)
    except OverflowError:  # (an int past float's range)
        value = math.inf
    if not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be a finite number, got {_shown(getattr(params, name))}", param=name)
    above = high is not None and (value >= high if high_open else value > high)
    if (value <= low if low_open else value < low) or above:
        bracket = "(" if low_open else "["
        top = "inf)" if high is None else f"{high}{')' if high_open else ']'}"
        raise InvalidRequestError(f"{name} must be in {bracket}{low}, {top}, got {value}", param=name)
    _set(params, name, float(value))


def as_strings(value: Any, name: str) -> tuple[str, ...] | None:
    """``stop`` or ``bad_words`` (``name``) as a tuple of non-empty Unicode strings."""
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    if isinstance(value, Mapping) or not _listed(value):
        raise InvalidRequestError(
            f"{name} must be a string or a list of strings, got {type(value).__name__}", param=name
        )
    # A set has no order of its own: sorted, the request is the same in every process.
    strings = tuple(sorted(value, key=repr)) if isinstance(value, set | frozenset) else tuple(value)
    for s in strings:
        if not isinstance(s, str):
            raise InvalidRequestError(f"{name} must hold strings, got {s!r}", param=name)
        if not s:
            raise InvalidRequestError(f"{name} holds an empty string, which would match everywhere", param=name)
        if name == "bad_words" and not s.strip():
            raise InvalidRequestError(f"bad_words holds {s!r}, which holds no word", param=name)
        if not s.isascii() and not _is_unicode(s):
            raise InvalidRequestError(
                f"{name} holds {s!r}, which is not Unicode text (a lone surrogate): no output could match it",
                param=name,
            )
    return strings


def _is_unicode(text: str) -> bool:
    """Whether ``text`` is Unicode text: JSON's escapes can make strings that are not
    (a lone UTF-16 surrogate such as "\\ud800"), which no decoded output holds."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _listed(value: Any) -> bool:
    """Whether ``value`` is a collection to take items from: an iterable, but not a string,
    bytes, or a 0-d tensor or array (iterable by its type, refusing when iterated)."""
    return isinstance(value, Iterable) and not isinstance(value, str | bytes) and getattr(value, "ndim", None) != 0


def _ids(
    name: str,
    value: Any,
    *,
    empty_ok: bool = True,
    negative_ok: bool = False,
    empty: str = "no token could be generated",
) -> tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, Mapping) or not _listed(value):
        raise InvalidRequestError(f"{name} must be a list of token ids, got {type(value).__name__}", param=name)
    ids = tuple(value)
    if not _plain_ids(ids, negative_ok=negative_ok):  # (then this names the first wrong one)
        plain = []
        for v in ids:
            token = token_id(v)
            if token is None:
                raise InvalidRequestError(f"{name} must hold token ids (ints), got {v!r}", param=name)
            if token < 0 and not negative_ok:
                raise InvalidRequestError(f"{name} holds a negative token id ({v})", param=name)
            plain.append(token)
        ids = tuple(plain)
    if not ids and not empty_ok:
        raise InvalidRequestError(f"{name} is empty: {empty}", param=name)
    return ids


def token_id(value: Any) -> int | None:
    """``value`` as a token id: an int, or an integer that is not one (a NumPy integer, a
    one-element integer tensor: ``list(array)`` makes those); None for anything else, bools
    included."""
    if isinstance(value, bool) or str(getattr(value, "dtype", "")) in ("bool", "torch.bool"):
        return None
    try:
        return operator.index(value)
    except Exception:  # (not an integer; a tensor with no data, an __index__ that fails)
        return None


def _plain_ids(ids: Sequence[Any], *, negative_ok: bool = False) -> bool:
    """Whether ``ids`` are all ``int``s (negative ones only if ``negative_ok``), checked in
    a few C-level passes a slice at a time: a list of a hundred thousand ids checked one by
    one would hold the event loop for tens of milliseconds, and in one pass (on a worker
    thread) the GIL for a few."""
    for start in range(0, len(ids), SLICE):
        part = ids[start : start + SLICE]
        if not (all_ints(part) and (negative_ok or min(part) >= 0)):
            return False
        pause()
    return True


def all_ints(values: Iterable[Any]) -> bool:
    """Whether every one of ``values`` is an ``int`` (no subclass: no bool), in one C-level pass."""
    return set(map(type, values)) <= _INT


#: Items of a long collection checked at once (some 0.1 ms), with a :func:`~aiocb.gil.pause`
#: between slices: a request's controls may list the whole vocabulary, and are then checked
#: on a worker thread (see ``aiocb.engine.requests``).
SLICE = 8192

_INT = frozenset((int,))
_NUMBERS = frozenset((int, float))
_FLOAT = frozenset((float,))
_STR = frozenset((str,))
_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)


def _pairs(name: str, value: Any, example: str) -> Iterable[tuple[Any, Any]]:
    """``value``'s (key, value) pairs: a mapping's items, or an iterable of pairs."""
    if isinstance(value, Mapping):
        return value.items()
    if not _listed(value):
        raise InvalidRequestError(f"{name} must map {example}, got {type(value).__name__}", param=name)
    pairs = []
    for item in value:
        pause()
        pair = tuple(item) if _listed(item) and not isinstance(item, Mapping) else ()
        if len(pair) != 2:
            raise InvalidRequestError(f"{name} must map {example}, got the item {item!r}", param=name)
        pairs.append(pair)
    return pairs


#: A token id as a JSON object key: ASCII digits only (``str.isdigit`` is also true of
#: superscripts, which ``int`` refuses, and of other scripts' digits, which ``int`` reads),
#: at most 19 (no vocabulary is larger; past 4,300 ``int`` refuses the string).
_DECIMAL = re.compile(r"-?[0-9]{1,19}")
#: Past the largest token id any vocabulary has: an id from here on is refused as none.
_NO_TOKEN_ID = 2**63


def _decimal_ids(keys: list[Any]) -> list[int] | None:
    """``keys``, token ids written as JSON object keys, read in a few C-level passes (a
    pattern matched key by key cost 1 µs each: 4,000 of them held the loop for 4 ms); None
    unless each is one written as ``str(id)`` writes it (no sign, no leading zero: then no
    two name one id), which the key-by-key reading then reads or refuses."""
    if set(map(type, keys)) != _STR or not all(map(str.isdigit, keys)) or not "".join(keys).isascii():
        return None
    if max(map(len, keys)) > 19:
        return None
    ids = list(map(int, keys))
    return ids if list(map(str, ids)) == keys else None


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...] | None:
    if value is None:
        return None
    if isinstance(value, Mapping) and value:  # (the common form, checked a few C-level passes at a time)
        # A slice of the items at a time, kept as they are when their biases are floats: a
        # logit_bias over the vocabulary is then one list of pairs, not three (the
        # collector's passes over them held the GIL for milliseconds).
        items = iter(value.items())
        checked: list[tuple[int, float]] = []
        keys: type | None = None  # (ints, or JSON object keys: never both, which could name one id twice)
        while part := list(itertools.islice(items, SLICE)):
            tokens, biases = list(map(_FIRST, part)), list(map(_SECOND, part))
            if keys is not None and type(tokens[0]) is not keys:
                break
            keys = type(tokens[0])
            if keys is str:  # (JSON object keys: read in C passes too)
                read = _decimal_ids(tokens)
                if read is None:
                    break
                tokens, part = read, list(zip(read, biases, strict=True))
            kinds = set(map(type, biases))
            if not (
                all_ints(tokens)
                and kinds <= _NUMBERS
                and min(tokens) >= 0
                and max(tokens) < _NO_TOKEN_ID  # (the slow path names one that is not)
                and min(biases) >= -100
                and max(biases) <= 100
                and not math.isnan(sum(biases))  # (a NaN escapes min and max)
            ):
                break
            checked += part if kinds == _FLOAT else zip(tokens, map(float, biases), strict=True)
            pause()
        else:
            return tuple(_sorted(checked))
    pairs: dict[int, float] = {}
    for token, bias in _pairs("logit_bias", value, "token ids to biases, e.g. {42: -100}"):
        pause()
        given = token
        # (JSON object keys are strings)
        token = int(token) if isinstance(token, str) and _DECIMAL.fullmatch(token) else token_id(token)
        if token is None or not 0 <= token < _NO_TOKEN_ID:
            shown = _shown(given if token is None else token)
            raise InvalidRequestError(f"logit_bias keys must be token ids, got {shown}", param="logit_bias")
        number = _real(bias)
        if number is None or not -100 <= number <= 100:
            raise InvalidRequestError(
                f"logit_bias[{token}] must be a number in [-100, 100], got {_shown(bias)}", param="logit_bias"
            )
        pairs[token] = number
    return tuple(sorted(pairs.items()))


def _sorted(pairs: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """``pairs`` sorted by their distinct ids (by the ids alone, half the cost of comparing
    pairs; pairs in order already, as from a range, in one pass): slices sorted, then merged
    a slice at a time (a pause an item cost more than the sort: 4,000 pairs took 2 ms)."""
    if len(pairs) <= SLICE:
        return sorted(pairs, key=_FIRST)
    runs = []
    for start in range(0, len(pairs), SLICE):
        runs.append(sorted(pairs[start : start + SLICE], key=_FIRST))
        pause()
    merging = heapq.merge(*runs, key=_FIRST)
    merged: list[tuple[int, float]] = []
    while part := list(itertools.islice(merging, SLICE)):
        merged += part
        pause()
    return merged


#: float32's largest finite value: a bias past it is infinite on the device.
_FLOAT32_MAX = 3.4028234663852886e38


def _sequence_bias(value: Any) -> tuple[SequenceBias, ...] | None:
    if value is None:
        return None
    plain = _plain_sequence_bias(value)
    if plain is not None:
        return plain
    out: dict[tuple[int, ...], float] = {}  # as transformers: a sequence given twice keeps its last bias
    for sequence, bias in _pairs("sequence_bias", value, "token sequences to biases, e.g. [[[42, 7], -5.0]]"):
        pause()
        one = [sequence] if token_id(sequence) is not None else sequence
        ids = _ids("sequence_bias", one, empty_ok=False, empty="one of its sequences holds no token")
        assert ids is not None
        number = _real(bias)
        if number is None or math.isnan(number):
            raise InvalidRequestError(
                f"sequence_bias of {list(ids)} must be a number, got {_shown(bias)}", param="sequence_bias"
            )
        if isinstance(bias, numbers.Integral) and math.isinf(number):
            raise InvalidRequestError(
                f"sequence_bias of {list(ids)} must be within float32's range, got {_shown(bias)}",
                param="sequence_bias",
            )
        if number > _FLOAT32_MAX:  # (-inf bans a sequence; +inf, or a bias past float32's range, makes NaNs)
            raise InvalidRequestError(
                f"sequence_bias of {list(ids)} must be at most float32's largest ({_FLOAT32_MAX:.4g}), "
                f"got {_shown(bias)}",
                param="sequence_bias",
            )
        out[ids] = number
    return tuple(out.items())


def _real(value: Any) -> float | None:
    """``value`` as a float if it is a real number (NumPy's too; no bool), an int past a
    float's range as infinite; None if it is none."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except OverflowError:  # (an int: no other real number here overflows a float)
        return -math.inf if isinstance(value, int) and value < 0 else math.inf


def _float_range(biases: list[Any]) -> bool:
    """Whether ``biases`` (ints and floats) are numbers a float holds, none NaN nor past
    float32's largest (-inf may be: it bans)."""
    try:
        return not math.isnan(sum(map(float, biases))) and max(biases) <= _FLOAT32_MAX  # (a NaN escapes max)
    except OverflowError:  # (an int past a float's range)
        return False


def _plain_sequences(part: list[Any]) -> tuple[tuple[int, ...], ...] | None:
    """``part``'s token sequences as tuples, checked in a few C-level passes: None unless
    each is a non-empty list or tuple of non-negative ints (the item-by-item check then
    names the one that is not)."""
    if not set(map(type, part)) <= _LISTS:
        return None
    sequences = tuple(map(tuple, part))
    if not (min(map(len, sequences)) and _plain_ids(list(itertools.chain.from_iterable(sequences)))):
        return None
    return sequences


def _plain_sequence_bias(value: Any) -> tuple[SequenceBias, ...] | None:
    """A ``sequence_bias`` in its common forms (a mapping of id tuples, or a list of
    ``[ids, bias]`` pairs, with numbers), checked in a few C-level passes a slice at a time
    (item by item, 900 cost 2-3 ms); None where any is otherwise (then the item-by-item
    check names it)."""
    if isinstance(value, Mapping):
        items = list(value.items())
    elif _listed(value):
        items = list(value)
        if not set(map(type, items)) <= _LISTS or set(map(len, items)) != {2}:
            return None
    else:
        return None
    out: dict[tuple[int, ...], float] = {}  # (a sequence given twice keeps its last bias)
    for start in range(0, len(items), SLICE):
        part = items[start : start + SLICE]
        keys, biases = _plain_sequences(list(map(_FIRST, part))), list(map(_SECOND, part))
        if keys is None or not set(map(type, biases)) <= _NUMBERS or not _float_range(biases):
            return None
        out.update(zip(keys, map(float, biases), strict=True))
        pause()
    return tuple(out.items())


_LISTS = frozenset((list, tuple))


def _bad_words(value: Any) -> tuple[tuple[int, ...], ...] | None:
    if value is None:
        return None
    if not _listed(value):
        raise InvalidRequestError("bad_words_ids must be a list of lists of token ids", param="bad_words_ids")
    items = list(value)
    plain: list[tuple[int, ...]] = []
    for start in range(0, len(items), SLICE):  # (the common form, checked a few C-level passes at a time)
        some = _plain_sequences(items[start : start + SLICE])
        if some is None:
            break
        plain += some
        pause()
    else:
        return tuple(plain)
    words = []
    for word in items:
        pause()
        if token_id(word) is not None:
            raise InvalidRequestError(
                "bad_words_ids must be a list of lists of token ids, e.g. [[42], [7, 9]]", param="bad_words_ids"
            )
        ids = _ids("bad_words_ids", word, empty_ok=False, empty="one of its sequences holds no token")
        assert ids is not None
        words.append(ids)
    return tuple(words)


def _check_truncation(params: SamplingParams, name: str) -> None:
    _check_int(params, name, minimum=-1)
    if getattr(params, name) == 0:
        raise InvalidRequestError(f"{name} must be at least 1 (or -1: the model's context length), got 0", param=name)


def _check_logprobs_mode(params: SamplingParams, name: str) -> None:
    if getattr(params, name) not in ("raw", "processed"):
        raise InvalidRequestError(f'{name} must be "raw" or "processed", got {getattr(params, name)!r}', param=name)


def _check_text(params: SamplingParams, name: str) -> None:
    value = getattr(params, name)
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{name} must be a non-empty str, got {value!r}", param=name)


def _check_choice(params: SamplingParams, name: str) -> None:
    value: Any = params.choice
    listed = _listed(value) and not isinstance(value, Mapping)
    ordered = sorted(value, key=repr) if isinstance(value, set | frozenset) else value
    choices = tuple(ordered) if listed else ()
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise InvalidRequestError(f"choice must be a non-empty list of non-empty strings, got {value!r}", param=name)
    if (characters := sum(map(len, choices))) > MAX_LITERAL_CHARACTERS:
        raise InvalidRequestError(
            f"choice's strings hold {characters} characters, more than the {MAX_LITERAL_CHARACTERS} that compile in "
            "good time",
            param=name,
        )
    if not "".join(choices).isascii():  # (a lone surrogate is no text: no output could be it)
        for index, text in enumerate(choices):
            try:
                text.encode()
            except UnicodeEncodeError as error:
                raise InvalidRequestError(
                    f"choice[{index}] holds {text[error.start]!r}, a lone surrogate, which no text holds", param=name
                ) from None
    _set(params, name, choices)


#: The most characters of literal texts an output constraint may list (a ``choice``'s
#: strings; a JSON schema's ``enum`` and ``const`` values, as JSON): xgrammar's compile time
#: grows faster than their length, with shared prefixes most (8,000 strings of 50 characters
#: took 2.9 s, 50,000 minutes, on a thread that other requests' constraints wait for).
MAX_LITERAL_CHARACTERS = 131_072


def _check_eos(params: SamplingParams, name: str) -> None:
    value = params.eos_token_id
    _set(params, name, _ids(name, [value] if token_id(value) is not None else value, negative_ok=True))


def _normalised(make: Callable[[Any], Any]) -> Callable[[SamplingParams, str], None]:
    """A check that replaces a field's value by ``make(value)`` (which raises when it is wrong)."""

    def check(params: SamplingParams, name: str) -> None:
        _set(params, name, make(getattr(params, name)))

    return check


#: Each field's check (and normalisation), in the order they run; a field that is None
#: (not given) is not checked.
_CHECKS: dict[str, Callable[[SamplingParams, str], None]] = {
    "max_new_tokens": functools.partial(_check_int, minimum=1),
    "min_tokens": functools.partial(_check_int, minimum=0),
    "top_k": functools.partial(_check_int, minimum=0),
    "top_logprobs": functools.partial(_check_int, minimum=0),
    "seed": functools.partial(_check_int, minimum=-(2**63), maximum=2**64 - 1),
    "priority": functools.partial(_check_int, minimum=None),
    "n": functools.partial(_check_int, minimum=1),
    "no_repeat_ngram_size": functools.partial(_check_int, minimum=0),
    "truncate_prompt_tokens": _check_truncation,
    **dict.fromkeys(
        (
            "do_sample",
            "include_stop_str_in_output",
            "ignore_eos",
            "skip_special_tokens",
            "return_logprobs",
            "prompt_logprobs",
            "record_timestamps",
        ),
        _check_bool,
    ),
    "logprobs_mode": _check_logprobs_mode,
    "temperature": functools.partial(_check_float, low=0.0),
    "top_p": functools.partial(_check_float, low=0.0, low_open=True, high=1.0),
    "min_p": functools.partial(_check_float, low=0.0, high=1.0),
    "top_h": functools.partial(_check_float, low=0.0, high=1.0),
    "typical_p": functools.partial(_check_float, low=0.0, low_open=True, high=1.0),
    "epsilon_cutoff": functools.partial(_check_float, low=0.0, high=1.0, high_open=True),
    "eta_cutoff": functools.partial(_check_float, low=0.0, high=1.0, high_open=True),
    # (logits divided or multiplied by more stay finite in float32, as far as 1e8 of them)
    "repetition_penalty": functools.partial(_check_float, low=1e-30, high=1e30),
    "presence_penalty": functools.partial(_check_float, low=-2.0, high=2.0),
    "frequency_penalty": functools.partial(_check_float, low=-2.0, high=2.0),
    "timeout": functools.partial(_check_float, low=0.0, low_open=True),
    "stop": _normalised(lambda value: as_strings(value, "stop")),
    "bad_words": _normalised(lambda value: as_strings(value, "bad_words")),
    "stop_token_ids": _normalised(lambda value: _ids("stop_token_ids", value)),
    "allowed_token_ids": _normalised(lambda value: _ids("allowed_token_ids", value, empty_ok=False)),
    "eos_token_id": _check_eos,
    "logit_bias": _normalised(_logit_bias),
    "sequence_bias": _normalised(_sequence_bias),
    "bad_words_ids": _normalised(_bad_words),
    "json_schema": _normalised(_json_schema),
    "structural_tag": _normalised(_structural_tag),
    "regex": _check_text,
    "grammar": _check_text,
    "choice": _check_choice,
}
_CHECK_ORDER = {name: i for i, name in enumerate(_CHECKS)}
