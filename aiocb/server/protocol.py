"""OpenAI request bodies parsed into typed values, and errors in OpenAI's shape.

Parsing is lenient where real clients need it (``null`` means "not given") and strict
everywhere a value would otherwise change the result without a word: a field the server
does not implement, a negative ``max_tokens``, a ``temperature`` that is a string. Those
are refused with an :class:`APIError` of status 400 that names the field.
"""

from __future__ import annotations

import re
import reprlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiocb.errors import (
    EngineDeadError,
    InvalidRequestError,
    ManagerClosedError,
    RequestAbortedError,
    WouldBlock,
)
from aiocb.gil import yield_gil
from aiocb.params import STRUCTURE_FIELDS, SamplingParams

#: ``max_tokens`` of a completion that does not say (OpenAI's default).
DEFAULT_COMPLETION_MAX_TOKENS = 16
#: The most alternatives per token (``logprobs`` / ``top_logprobs``) a request may ask for.
MAX_TOP_LOGPROBS = 20
#: The most choices per prompt (``n``).
MAX_N = 128


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def to_dict(self) -> dict[str, Any]:
        """The JSON body of the error response."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    """A 400 error about the request body."""
    return APIError(400, message, param=param)


def without_unset(fields: Mapping[str, Any], known: Iterable[str]) -> dict[str, Any]:
    """``fields`` less the keys not ``known`` that were sent as null: none given."""
    known = frozenset(known)
    return {key: value for key, value in fields.items() if key in known or value is not None}


def refuse_unknown_keys(keys: Iterable[str], known: tuple[str, ...], where: str, what: str = "") -> None:
    """Refuse the ``keys`` of the object at ``where`` (a body path such as ``tools[0]``) that
    are not ``known``: a 400 whose ``param`` is the first one's path, as OpenAI names a nested
    field. ``what`` describes the object in the message (default: its path). Given the
    object itself, a key whose value is null is one not given, as at the top level."""
    if isinstance(keys, Mapping):
        keys = without_unset(keys, known)
    unknown = sorted(set(keys) - set(known))
    if unknown:
        paths = [f"{where}.{key}" for key in unknown]
        raise bad_request(
            f"unsupported field(s) {', '.join(map(repr, paths))}; {what or where} takes {', '.join(known)}",
            paths[0],
        )


#: The engine's names of parameters (``aiocb.SamplingParams`` fields) that a request body
#: calls otherwise; a chat body's prompt is its ``messages``.
COMPLETION_PARAMS = {"input_ids": "prompt", "max_new_tokens": "max_tokens", "top_logprobs": "logprobs"}
CHAT_PARAMS = {"input_ids": "messages", "max_new_tokens": "max_tokens", "return_logprobs": "logprobs"}


def error_from_exception(exc: BaseException, params: Mapping[str, str] | None = None) -> APIError:
    """Map an exception from the engine (or anything else) to the error a client should see;
    ``params`` renames the engine's parameter names to the body's."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, WouldBlock):
        return APIError(
            429,
            "the server's admission queue is full; retry later",
            type="rate_limit_exceeded",
            code="rate_limit_exceeded",
        )
    if isinstance(exc, InvalidRequestError):
        if params is None:
            return bad_request(str(exc), exc.param)
        message = _renamed_text(str(exc), params)
        return bad_request(message, None if exc.param is None else _renamed(exc.param, params))
    if isinstance(exc, ManagerClosedError):
        return APIError(503, f"the server is not accepting requests: {exc}", type="service_unavailable")
    if isinstance(exc, RequestAbortedError):  # (the server stopping: a retry elsewhere may succeed)
        return APIError(503, f"the server stopped before the request finished: {exc}", type="service_unavailable")
    if isinstance(exc, EngineDeadError):
        return APIError(500, f"the engine failed: {exc}", type="internal_server_error")
    return APIError(500, f"internal error: {exc!r}", type="internal_server_error")


#: a quoted part of a message (the request's own text: a schema's names, a stop string)
_QUOTED = re.compile(r"""('[^']*'|"[^"]*")""")
#: a name in a message, not within a path (``/properties/input_ids``) or a dotted name
_NAME = re.compile(r"(?<![\w/.])\w+(?![\w/])")


def _renamed_text(message: str, params: Mapping[str, str]) -> str:
    """``message`` naming the body's fields where it names the engine's ("max_tokens (5)",
    not "max_new_tokens (5)"), outside what it quotes of the request and outside paths."""
    parts = _QUOTED.split(message)
    for i in range(0, len(parts), 2):  # (the odd parts are quoted)
        parts[i] = _NAME.sub(lambda name: params.get(name[0], name[0]), parts[i])
    return "".join(parts)


def _renamed(param: str, params: Mapping[str, str]) -> str:
    """``param`` (``field`` or a path within one: ``field.key``) with ``field`` as ``params`` renames it."""
    field_name, dot, inside = param.partition(".")
    return params[field_name] + dot + inside if field_name in params else param


@dataclass(frozen=True, slots=True)
class ServedDefaults:
    """What a request that leaves a field out gets, from the served model's generation
    config (as vLLM's server: the sampling fields it sets; else OpenAI's defaults)."""

    temperature: float = 1.0
    top_p: float = 1.0
    #: 0: off
    top_k: int = 0
    #: what caps a request's default ``max_tokens`` (one it gives none; None: nothing) ...
    max_new_tokens: int | None = None
    #: ... or, where that is None, what caps it with the prompt counted (as ``model.generate``
    #: reads a generation config's ``max_length``; None: nothing)
    max_length: int | None = None
    #: what makes a request's ``min_tokens`` when it gives none (as the engine resolves it:
    #: the server's stop strings wait for it too)
    min_new_tokens: int | None = None
    min_length: int | None = None
    #: the EOS ids to stop at where the tokenizer's EOS is not among the model's (None: the model's)
    eos_token_ids: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class SamplingRequest:
    """The sampling and streaming fields shared by completions and chat completions."""

    model: str | None
    #: None: the endpoint's default
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    n: int
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    skip_special_tokens: bool
    stream: bool
    include_usage: bool
    #: vLLM's ``stream_options.continuous_usage_stats``: each chunk carries its choice's
    #: usage so far (with ``include_usage`` alone)
    continuous_usage: bool = False
    #: no stop token or stop string before this many tokens (None: not given, the model's
    #: generation config says)
    min_tokens: int | None = None
    include_stop_str_in_output: bool = False
    #: vLLM's: the prompt is cut to its last this many tokens (-1: the model's context), None: not
    truncate_prompt_tokens: int | None = None
    #: vLLM's: words never generated (made token sequences with the server's tokenizer)
    bad_words: tuple[str, ...] = ()
    #: the logits controls (penalties, biases, allow-lists), as ``aiocb.SamplingParams`` fields
    controls: Mapping[str, Any] = field(default_factory=dict)
    #: the body field ``max_tokens`` came from (errors about it name that one)
    max_tokens_field: str = "max_tokens"
    #: where in the body the output constraint came from, if any (errors about it name that)
    constraint_field: str | None = None
    #: vLLM's: the response's id is made from it (None: from the X-Request-Id header, or fresh)
    request_id: str | None = None
    #: the EOS ids to stop at (None: the model's)
    eos_token_ids: tuple[int, ...] | None = None

    def body_params(self) -> dict[str, str]:
        """The body's names of the engine's parameters that this request renames."""
        named = {"max_new_tokens": self.max_tokens_field}
        for name in STRUCTURE_FIELDS:
            if name in self.controls and self.constraint_field is not None:
                named[name] = self.constraint_field
        return named


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """A ``POST /v1/completions`` body."""

    #: one entry per prompt: text, or token ids
    prompts: list[str | list[int]]
    sampling: SamplingRequest
    #: alternatives per token (0 to 20), or None for no logprobs
    logprobs: int | None
    echo: bool


@dataclass(frozen=True, slots=True)
class ChatCompletionRequest:
    """A ``POST /v1/chat/completions`` body; message contents are flattened to strings."""

    messages: list[dict[str, Any]]
    sampling: SamplingRequest
    logprobs: bool
    top_logprobs: int
    add_generation_prompt: bool
    chat_template_kwargs: dict[str, Any]
    #: vLLM's: the reply's content starts with the last message's, where that is the assistant's
    echo: bool = False


@dataclass(frozen=True, slots=True)
class TokenizeRequest:
    """A ``POST /tokenize`` body: a text prompt or chat messages."""

    model: str | None
    prompt: str | None
    messages: list[dict[str, Any]] | None
    add_special_tokens: bool
    add_generation_prompt: bool
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class DetokenizeRequest:
    """A ``POST /detokenize`` body."""

    model: str | None
    tokens: list[int]


# --------------------------------------------------------------------------- bodies


def parse_completion_request(body: Any, defaults: ServedDefaults = ServedDefaults()) -> CompletionRequest:
    """Validate a completions body; ``defaults`` fill the sampling fields it leaves out."""
    body = _object(body)
    if "prompt" not in body or body["prompt"] is None:
        raise bad_request("'prompt' is required", "prompt")
    prompts = _prompts(body["prompt"])
    logprobs = _opt_int(body, "logprobs", minimum=0, maximum=MAX_TOP_LOGPROBS)
    _refuse_unknown(body, COMPLETION_FIELDS)
    _refuse_unsupported(body)
    return CompletionRequest(
        prompts=prompts,
        sampling=_sampling(body, defaults, max_tokens_keys=("max_tokens",), least_max_tokens=0),
        logprobs=logprobs,
        echo=_bool(body, "echo", False),
    )


def parse_chat_request(body: Any, defaults: ServedDefaults = ServedDefaults()) -> ChatCompletionRequest:
    """Validate a chat completions body; ``defaults`` fill the sampling fields it leaves out."""
    body = _object(body)
    messages = _messages(body.get("messages"))
    logprobs = _bool(body, "logprobs", False)
    top_logprobs = _opt_int(body, "top_logprobs", minimum=0, maximum=MAX_TOP_LOGPROBS)
    if top_logprobs and not logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    kwargs = _template_kwargs(body)
    _refuse_unknown(body, CHAT_FIELDS)
    _refuse_unsupported(body)
    return ChatCompletionRequest(
        messages=messages,
        sampling=_sampling(body, defaults, max_tokens_keys=("max_completion_tokens", "max_tokens"), least_max_tokens=1),
        logprobs=logprobs,
        top_logprobs=top_logprobs or 0,
        add_generation_prompt=_bool(body, "add_generation_prompt", True),
        chat_template_kwargs=kwargs,
        echo=_bool(body, "echo", False),
    )


def parse_tokenize_request(body: Any) -> TokenizeRequest:
    """Validate a tokenize body: ``prompt`` (text) or ``messages`` (chat)."""
    body = _object(body)
    prompt = body.get("prompt")
    messages = body.get("messages")
    if (prompt is None) == (messages is None):
        raise bad_request("give exactly one of 'prompt' (a string) or 'messages'", "prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise bad_request("'prompt' must be a string", "prompt")
    _refuse_unknown(body, TOKENIZE_FIELDS)
    kwargs = _template_kwargs(body)
    for name in ("chat_template_kwargs", "tools", "continue_final_message"):
        if body.get(name) and messages is None:
            raise bad_request(f"'{name}' is for 'messages'", name)
    return TokenizeRequest(
        model=_opt_str(body, "model"),
        prompt=prompt,
        messages=None if messages is None else _messages(messages),
        add_special_tokens=_bool(body, "add_special_tokens", prompt is not None),
        add_generation_prompt=_bool(body, "add_generation_prompt", True),
        chat_template_kwargs=kwargs,
    )


def parse_detokenize_request(body: Any) -> DetokenizeRequest:
    """Validate a detokenize body."""
    body = _object(body)
    tokens = _token_ids(body.get("tokens"), "tokens")
    _refuse_unknown(body, DETOKENIZE_FIELDS)
    return DetokenizeRequest(model=_opt_str(body, "model"), tokens=list(tokens))


# --------------------------------------------------------------------------- fields


def _sampling(
    body: Mapping[str, Any], defaults: ServedDefaults, *, max_tokens_keys: tuple[str, ...], least_max_tokens: int
) -> SamplingRequest:
    """The sampling fields of a body; ``least_max_tokens``: 0 where no new token scores the
    prompt (completions), 1 where nothing would (chat, as vLLM's)."""
    max_tokens_field = _max_tokens_field(body, max_tokens_keys)
    top_k = _opt_int(body, "top_k", minimum=-1)
    stream = _bool(body, "stream", False)
    include_usage, continuous_usage = _usage_options(body, stream)
    constraint, constraint_field = _structure(body)
    max_tokens = _opt_int(body, max_tokens_field, minimum=least_max_tokens)
    min_tokens = _opt_int(body, "min_tokens", minimum=0)
    # (max_tokens 0 scores the prompt: the engine sees 1)
    if max_tokens is not None and min_tokens is not None and min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({min_tokens}) is more than {max_tokens_field} ({max_tokens})", "min_tokens")
    return SamplingRequest(
        model=_opt_str(body, "model"),
        max_tokens=max_tokens,
        temperature=_float(body, "temperature", defaults.temperature, minimum=0.0, maximum=2.0),
        top_p=_float(body, "top_p", defaults.top_p, minimum=0.0, maximum=1.0, exclusive_minimum=True),
        top_k=defaults.top_k if top_k is None else max(top_k, 0),  # -1 (vLLM) and 0 both mean "off"
        seed=_opt_int(body, "seed", minimum=-(2**63), maximum=2**63 - 1),
        n=_opt_int(body, "n", minimum=1, maximum=MAX_N) or 1,
        stop=_stop(body.get("stop")),
        stop_token_ids=tuple(_stop_token_ids(body.get("stop_token_ids"))),
        ignore_eos=_bool(body, "ignore_eos", False),
        skip_special_tokens=_bool(body, "skip_special_tokens", True),
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        request_id=_request_id(body),
        min_tokens=min_tokens,
        include_stop_str_in_output=_bool(body, "include_stop_str_in_output", False),
        truncate_prompt_tokens=_truncate_prompt_tokens(body),
        bad_words=_bad_words(body),
        controls={**_controls(body), **constraint},
        max_tokens_field=max_tokens_field,
        constraint_field=constraint_field,
        eos_token_ids=defaults.eos_token_ids,
    )


def _truncate_prompt_tokens(body: Mapping[str, Any]) -> int | None:
    value = body.get("truncate_prompt_tokens")
    if value is not None:
        try:
            SamplingParams(truncate_prompt_tokens=value)
        except InvalidRequestError as exc:
            raise bad_request(str(exc), "truncate_prompt_tokens") from None
    return value


def _bad_words(body: Mapping[str, Any]) -> tuple[str, ...]:
    value = body.get("bad_words")
    if value is None:
        return ()
    try:
        words = SamplingParams(bad_words=value).bad_words
    except InvalidRequestError as exc:
        raise bad_request(str(exc), "bad_words") from None
    return tuple(words or ())


def _max_tokens_field(body: Mapping[str, Any], keys: tuple[str, ...]) -> str:
    """The one of ``keys`` (names of the output's length bound) that the body gives, or the first."""
    given = [key for key in keys if body.get(key) is not None]
    if len(given) > 1:
        # As OpenAI answers it: the two names are one bound (``max_tokens`` the older), so
        # which one wins would be a guess (vLLM takes max_completion_tokens without a word).
        raise APIError(
            400,
            f"setting {' and '.join(repr(key) for key in given)} at the same time is not supported; give one",
            param="max_tokens",
            code="invalid_parameter_combination",
        )
    return given[0] if given else keys[0]


def _usage_options(body: Mapping[str, Any], stream: bool) -> tuple[bool, bool]:
    """``stream_options``' ``include_usage`` and ``continuous_usage_stats`` (vLLM's: each
    chunk carries its choice's usage so far, where the stream's last one carries the whole)."""
    options = body.get("stream_options")
    if options is None:
        return False, False
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    if not stream:
        raise bad_request("'stream_options' is for streamed responses; give it with 'stream': true", "stream_options")
    refuse_unknown_keys(options, ("include_usage", "continuous_usage_stats"), "stream_options")
    include = _bool(options, "include_usage", False, path="stream_options.include_usage")
    continuous = _bool(options, "continuous_usage_stats", False, path="stream_options.continuous_usage_stats")
    if continuous and not include:
        raise bad_request(
            "stream_options.continuous_usage_stats needs stream_options.include_usage true",
            "stream_options.continuous_usage_stats",
        )
    return include, continuous


#: Body fields that become ``aiocb.SamplingParams`` fields of the same name, checked there.
_CONTROLS = (
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "top_h",
    "typical_p",
    "epsilon_cutoff",
    "eta_cutoff",
    "no_repeat_ngram_size",
    "logit_bias",
    "allowed_token_ids",
    "priority",
)


def _controls(body: Mapping[str, Any]) -> dict[str, Any]:
    controls: dict[str, Any] = {}
    for key in _CONTROLS:
        value = body.get(key)
        if value is None:
            continue
        try:
            checked = SamplingParams(**{key: value})
        except InvalidRequestError as exc:
            raise bad_request(str(exc), key) from None
        # (a logit_bias's JSON keys read here, off the loop for a large body: the engine
        # then checks ints in order, some 0.25 µs an id, on the loop)
        controls[key] = dict(checked.logit_bias or ()) if key == "logit_bias" else value
    return controls


#: vLLM's fields for constrained decoding, and the ``aiocb.SamplingParams`` field each becomes.
_GUIDED = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
#: The keys of vLLM's ``structured_outputs`` object, likewise.
_STRUCTURED_OUTPUTS = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "structural_tag": "structural_tag",
}


def _structure(body: Mapping[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The output constraint of a body (OpenAI's ``response_format``, vLLM's
    ``structured_outputs`` and ``guided_*``) as a ``SamplingParams`` field, at most one, and
    where in the body it is."""
    found: list[tuple[str, str, Any]] = []  # (body path, SamplingParams field, value)
    response_format = _response_format(body.get("response_format"))
    if response_format is not None:
        found.append(response_format)
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise bad_request("'structured_outputs' must be an object", "structured_outputs")
        refuse_unknown_keys(outputs, tuple(_STRUCTURED_OUTPUTS), "structured_outputs")
        found += [(f"structured_outputs.{k}", _STRUCTURED_OUTPUTS[k], v) for k, v in outputs.items() if v is not None]
    found += [(key, name, body[key]) for key, name in _GUIDED.items() if body.get(key) is not None]
    if not found:
        return {}, None
    if len(found) > 1:
        raise bad_request(f"give one output constraint, got {', '.join(f for f, _, _ in found)}", found[1][0])
    where, name, value = found[0]
    try:
        SamplingParams(**{name: value})
    except InvalidRequestError as exc:
        # A structural tag's error names the key at fault inside the tag: the same path below ``where``.
        inside = exc.param[len(name) :] if exc.param and exc.param.startswith(f"{name}.") else ""
        raise bad_request(f"{where + inside}: {exc}", where + inside) from None
    return {name: value}, where


#: The keys of each ``response_format`` type beside ``type`` (a ``structural_tag`` response
#: format is the tag itself, xgrammar's form or the older one, checked as ``SamplingParams``
#: checks one).
_RESPONSE_FORMAT_KEYS: dict[str, tuple[str, ...]] = {"text": (), "json_object": (), "json_schema": ("json_schema",)}
#: OpenAI's ``json_schema`` object. The schema is enforced, which is all ``strict`` asks (and
#: ``strict: false`` allows); ``name`` and ``description`` label it and change no output.
_JSON_SCHEMA_KEYS = ("name", "description", "schema", "strict")


def _response_format(value: Any) -> tuple[str, str, Any] | None:
    """OpenAI's ``response_format`` as (body path, ``SamplingParams`` field, value); None
    when not given or ``text``."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request("'response_format' must be an object with a 'type'", "response_format")
    kind = value.get("type")
    if kind == "structural_tag":
        return ("response_format", "structural_tag", value)
    if not isinstance(kind, str) or kind not in _RESPONSE_FORMAT_KEYS:
        raise bad_request(
            f"'response_format.type' must be text, json_object, json_schema or structural_tag, got {kind!r}",
            "response_format.type",
        )
    refuse_unknown_keys(value, ("type", *_RESPONSE_FORMAT_KEYS[kind]), "response_format", f"a {kind} response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return ("response_format", "json_schema", {"type": "object"})
    return ("response_format.json_schema.schema", "json_schema", _json_schema_spec(value.get("json_schema")))


def _json_schema_spec(spec: Any) -> dict[str, Any]:
    """The schema of a ``json_schema`` response format, its other keys checked."""
    where = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise bad_request(f"'{where}' must be an object with the JSON schema under 'schema'", where)
    refuse_unknown_keys(spec, _JSON_SCHEMA_KEYS, where)
    for key in ("name", "description"):
        _opt_str(spec, key, path=f"{where}.{key}")
    _bool(spec, "strict", False, path=f"{where}.strict")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise bad_request(f"'{where}.schema' must be a JSON schema object", f"{where}.schema")
    return schema


#: Fields that do not change what is generated (identifiers, bookkeeping, a cache hint):
#: accepted when of their type (``store`` only when false, ``service_tier`` only auto or
#: default: :func:`_check_no_effect`).
_NO_EFFECT = frozenset({"user", "safety_identifier", "prompt_cache_key", "metadata", "store", "service_tier"})
_SAMPLING_FIELDS = frozenset(
    {
        "model",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "n",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "skip_special_tokens",
        "stream",
        "stream_options",
        "min_tokens",
        "include_stop_str_in_output",
        "truncate_prompt_tokens",
        "bad_words",
        "best_of",
        "response_format",
        "structured_outputs",
        *_GUIDED,
        *_CONTROLS,
    }
)
#: Every field each endpoint honours; any other one is refused with a 400 naming it.
COMPLETION_FIELDS = _SAMPLING_FIELDS | _NO_EFFECT | {"prompt", "logprobs", "echo", "suffix", "request_id"}
CHAT_FIELDS = (
    _SAMPLING_FIELDS
    | _NO_EFFECT
    | {
        "messages",
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template_kwargs",
        "echo",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "request_id",
    }
)


TOKENIZE_FIELDS = frozenset(
    {
        "model",
        "prompt",
        "messages",
        "add_special_tokens",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template_kwargs",
        "tools",
    }
)
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


def _refuse_unknown(body: Mapping[str, Any], known: frozenset[str]) -> None:
    """A 400 naming the first field given that the endpoint does not honour (one sent as
    null asks for nothing: clients that write out every field send their unset ones so)."""
    unknown = sorted(key for key, value in body.items() if value is not None and key not in known)
    if unknown:
        raise bad_request(
            f"unsupported field(s): {', '.join(repr(k) for k in unknown)}; this server does not implement them",
            unknown[0],
        )
    _check_no_effect(body)


def _check_no_effect(body: Mapping[str, Any]) -> None:
    """The bookkeeping fields' types, as OpenAI's API (and vLLM's) checks them; ``store``
    true asks to keep the completion, and a ``service_tier`` other than the default one
    asks for a tier, which this server cannot do."""
    for name in ("user", "safety_identifier", "prompt_cache_key", "service_tier"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise bad_request(f"'{name}' must be a string", name)
    if body.get("service_tier") not in (None, "auto", "default"):
        raise bad_request(
            f"'service_tier' {body['service_tier']!r}: this server has one tier; leave it out, or send 'auto' or "
            "'default'",
            "service_tier",
        )
    metadata = body.get("metadata")
    if metadata is not None and (
        not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values())
    ):
        raise bad_request("'metadata' must be an object of string values", "metadata")
    store = body.get("store")
    if store is not None and not isinstance(store, bool):
        raise bad_request("'store' must be a boolean", "store")
    if store:
        raise bad_request("'store': this server does not store completions; leave it out or false", "store")


_MAX_REQUEST_ID_CHARS = 128


def sane_request_id(value: str) -> bool:
    """Whether a client's request id (``X-Request-Id``, a body's ``request_id``) is 1 to
    128 visible ASCII characters: it goes into headers and the access log as it is."""
    return 0 < len(value) <= _MAX_REQUEST_ID_CHARS and all("!" <= char <= "~" for char in value)


def _request_id(body: Mapping[str, Any]) -> str | None:
    """vLLM's ``request_id`` (it names the request and its response), checked."""
    value = body.get("request_id")
    if value is None:
        return None
    if not isinstance(value, str) or not sane_request_id(value):
        raise bad_request("'request_id' must be a string of 1 to 128 visible ASCII characters", "request_id")
    return value


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    """Refuse known OpenAI fields whose non-default values this server cannot honour."""
    suffix = body.get("suffix")
    if suffix is not None and not isinstance(suffix, str):
        raise bad_request("'suffix' must be a string", "suffix")
    if suffix:
        raise bad_request("'suffix' is not supported by this server", "suffix")
    best_of = _opt_int(body, "best_of", minimum=1)
    n = body.get("n") or 1
    if best_of is not None and best_of != n:
        raise bad_request("'best_of' is not supported by this server (only best_of == n)", "best_of")


def _template_kwargs(body: Mapping[str, Any]) -> dict[str, Any]:
    """The body's ``chat_template_kwargs``, with its top-level ``continue_final_message``
    (vLLM's field; transformers' template argument, which the kwargs may give too)."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise bad_request("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    kwargs = dict(kwargs or {})
    continues = _bool(body, "continue_final_message", False)
    if body.get("continue_final_message") is not None:
        if kwargs.get("continue_final_message", continues) != continues:
            raise bad_request(
                "'continue_final_message' and chat_template_kwargs.continue_final_message differ; give it once",
                "continue_final_message",
            )
        if continues:
            kwargs["continue_final_message"] = True
    return kwargs


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def _prompts(value: Any) -> list[str | list[int]]:
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise bad_request("'prompt' must be a string, a list of strings, token ids or lists of token ids", "prompt")
    if all(isinstance(v, str) for v in value):
        return list(value)
    if _is_int(value[0]):
        return [_token_ids(value, "prompt")]
    if all(isinstance(v, list) for v in value):
        prompts: list[str | list[int]] = [_token_ids(v, "prompt") for v in value]
        return prompts
    odd = [v for v in value if not (isinstance(v, (str, list)) or _is_int(v))]
    if not odd:
        raise bad_request("'prompt' mixes strings and token ids; send one kind", "prompt")
    raise bad_request(
        f"'prompt' must be a string, a list of strings, token ids (integers) or lists of token ids; "
        f"it holds {reprlib.repr(odd[0])}",
        "prompt",
    )


def _token_ids(value: Any, param: str) -> list[int]:
    """``value`` (a list parsed from the body) when it holds token ids; a 400 naming
    ``param`` if not. A slice at a time, the GIL let go between slices: a prompt of millions
    of ids checked one by one held it, and so the event loop, 5 ms at a time for 0.6 s."""
    if not isinstance(value, list):
        raise bad_request(f"'{param}' must be a list of token ids (ints)", param)
    for start in range(0, len(value), _IDS_AT_ONCE):
        if start:
            yield_gil()
        ids = value[start : start + _IDS_AT_ONCE]
        if not set(map(type, ids)) <= {int}:  # (a JSON body's ints are ints: a bool is not one)
            raise bad_request(f"'{param}' must be a list of token ids (ints)", param)
        if min(ids) < 0:
            raise bad_request(f"'{param}' holds a negative token id", param)
    return value


def _stop_token_ids(value: Any) -> list[int]:
    return [] if value is None else _token_ids(value, "stop_token_ids")


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise bad_request("'stop' must be a string or a list of strings", "stop")
    if "" in value:
        raise bad_request("'stop' holds an empty string, which would match everywhere", "stop")
    try:
        SamplingParams(stop=value)  # (the engine's checks: no stop string it could never match)
    except InvalidRequestError as exc:
        raise bad_request(str(exc), "stop") from None
    return tuple(value)  # as sent, so that the server's bound counts what the client sent


#: The fields of a chat message by role, all passed to the chat template: OpenAI's, an
#: assistant's ``reasoning_content`` (an earlier turn's reasoning, which templates such as
#: Qwen3's render or drop by turn) and ``parsed`` (the openai client's parse of the content,
#: which a parsed message sent back holds: a copy that says nothing new). Other roles (a
#: template's own too, such as Llama 3's ``ipython``) take the fields every message has.
_MESSAGE_FIELDS = ("role", "content", "name")
_ROLE_FIELDS = {
    "assistant": (*_MESSAGE_FIELDS, "tool_calls", "reasoning_content", "parsed"),
    "tool": (*_MESSAGE_FIELDS, "tool_call_id"),
}
#: The fields some role takes, and those of them whose value must be text when given.
_ROLE_SPECIFIC = frozenset(name for names in _ROLE_FIELDS.values() for name in names)
_TEXT_FIELDS = ("name", "tool_call_id", "reasoning_content")
#: The fields OpenAI's API requires of a message of each of its roles (an assistant's
#: content may be left out: its tool calls, or the message a reply continues, say enough).
_REQUIRED_FIELDS = {
    "system": ("content",),
    "developer": ("content",),
    "user": ("content",),
    "tool": ("content", "tool_call_id"),
}
#: Fields of assistant messages that OpenAI's responses carry, accepted while empty (a client
#: sends a response's message back as it came).
_UNSET_OK = frozenset({"refusal", "function_call", "audio", "annotations"})


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise bad_request("'messages' must be a non-empty list of messages", "messages")
    return [_message(message, f"messages[{i}]") for i, message in enumerate(value)]


def _message(message: Any, where: str) -> dict[str, Any]:
    """A message checked against its role's fields, its content flattened to a string."""
    if not isinstance(message, dict):
        raise bad_request(f"{where} must be an object with a string 'role'", where)
    role = message.get("role")
    if not isinstance(role, str):
        raise bad_request(f"{where}.role must be a string", f"{where}.role")
    # A null field that some role takes is one not given (clients send one shape for every
    # role), and an empty response field is one a client sent back as it came.
    given = [k for k, v in message.items() if not ((v is None and k in _ROLE_SPECIFIC) or (k in _UNSET_OK and not v))]
    refuse_unknown_keys(given, _ROLE_FIELDS.get(role, _MESSAGE_FIELDS), where, f"a message of role {role!r}")
    for key in _TEXT_FIELDS:
        _opt_str(message, key, path=f"{where}.{key}")
    for key in _REQUIRED_FIELDS.get(role, ()):
        if message.get(key) is None:
            raise bad_request(f"{where}.{key} is required in a message of role {role!r}", f"{where}.{key}")
    return {**message, "content": _content(message.get("content"), f"{where}.content")}


def _content(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text parts", where)
    return "\n".join(_text_part(part, f"{where}[{j}]") for j, part in enumerate(content))


def _text_part(part: Any, where: str) -> str:
    """The text of a content part: OpenAI's ``{"type": "text", "text": ...}``, or a string."""
    if isinstance(part, str):
        return part
    if not isinstance(part, dict):
        raise bad_request(f"{where} must be a text part, got {type(part).__name__}", where)
    if part.get("type") != "text":
        raise bad_request(f"{where}.type: only text parts are supported, got {part.get('type')!r}", f"{where}.type")
    refuse_unknown_keys(part, ("type", "text"), where, "a text part")
    text = part.get("text")
    if not isinstance(text, str):
        raise bad_request(f"{where}.text must be a string", f"{where}.text")
    return text


#: token ids checked in one go (well under a millisecond)
_IDS_AT_ONCE = 1 << 15


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _opt_int(body: Mapping[str, Any], key: str, *, minimum: int | None, maximum: int | None = None) -> int | None:
    given = value = body.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    # (as sent, shortened: 1e308 as an int is 309 digits)
    if not _is_int(value):
        raise bad_request(f"'{key}' must be an integer, got {reprlib.repr(given)}", key)
    if minimum is not None and value < minimum:
        raise bad_request(f"'{key}' must be >= {minimum}, got {reprlib.repr(given)}", key)
    if maximum is not None and value > maximum:
        raise bad_request(f"'{key}' must be <= {maximum}, got {reprlib.repr(given)}", key)
    return int(value)


def _float(
    body: Mapping[str, Any],
    key: str,
    default: float,
    *,
    minimum: float,
    maximum: float,
    exclusive_minimum: bool = False,
) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"'{key}' must be a number, got {value!r}", key)
    low_ok = value > minimum if exclusive_minimum else value >= minimum
    if not low_ok or value > maximum:
        bracket = "(" if exclusive_minimum else "["
        raise bad_request(f"'{key}' must be in {bracket}{minimum}, {maximum}], got {value}", key)
    return float(value)


def _bool(body: Mapping[str, Any], key: str, default: bool, *, path: str = "") -> bool:
    """``body[key]``, a bool; ``path`` names it in errors (default: ``key``)."""
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{path or key}' must be true or false, got {value!r}", path or key)
    return value


def _opt_str(body: Mapping[str, Any], key: str, *, path: str = "") -> str | None:
    """``body[key]``, a string or None; ``path`` names it in errors (default: ``key``)."""
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise bad_request(f"'{path or key}' must be a string", path or key)
    return value
