"""OpenAI request bodies parsed into typed values, and errors in OpenAI's shape.

Parsing is lenient where real clients need it (``null`` means "not given") and strict
everywhere a value would otherwise change the result without a word: a field the server
does not implement, a negative ``max_tokens``, a ``temperature`` that is a string. Those
are refused with an :class:`APIError` of status 400 that names the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aiocb.errors import (
    EngineDeadError,
    InvalidRequestError,
    ManagerClosedError,
    RequestAbortedError,
    WouldBlock,
)
from aiocb.params import SamplingParams

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
        param = exc.param if params is None or exc.param is None else params.get(exc.param, exc.param)
        return bad_request(str(exc), param)
    if isinstance(exc, ManagerClosedError):
        return APIError(503, f"the server is not accepting requests: {exc}", type="service_unavailable")
    if isinstance(exc, RequestAbortedError):  # (the server stopping: a retry elsewhere may succeed)
        return APIError(503, f"the server stopped before the request finished: {exc}", type="service_unavailable")
    if isinstance(exc, EngineDeadError):
        return APIError(500, f"the engine failed: {exc}", type="internal_server_error")
    return APIError(500, f"internal error: {exc!r}", type="internal_server_error")


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
    #: no stop token or stop string before this many tokens
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    #: the logits controls (penalties, biases, allow-lists), as ``aiocb.SamplingParams`` fields
    controls: Mapping[str, Any] = field(default_factory=dict)
    #: the body field ``max_tokens`` came from (errors about it name that one)
    max_tokens_field: str = "max_tokens"


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


def parse_completion_request(body: Any) -> CompletionRequest:
    """Validate a completions body."""
    body = _object(body)
    if "prompt" not in body or body["prompt"] is None:
        raise bad_request("'prompt' is required", "prompt")
    prompts = _prompts(body["prompt"])
    logprobs = _opt_int(body, "logprobs", minimum=0, maximum=MAX_TOP_LOGPROBS)
    _refuse_unknown(body, COMPLETION_FIELDS)
    _refuse_unsupported(body)
    return CompletionRequest(
        prompts=prompts,
        sampling=_sampling(body, max_tokens_keys=("max_tokens",)),
        logprobs=logprobs,
        echo=_bool(body, "echo", False),
    )


def parse_chat_request(body: Any) -> ChatCompletionRequest:
    """Validate a chat completions body."""
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
        sampling=_sampling(body, max_tokens_keys=("max_completion_tokens", "max_tokens")),
        logprobs=logprobs,
        top_logprobs=top_logprobs or 0,
        add_generation_prompt=_bool(body, "add_generation_prompt", True),
        chat_template_kwargs=kwargs,
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
    if kwargs and messages is None:
        raise bad_request("'chat_template_kwargs' is for 'messages'", "chat_template_kwargs")
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
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(_is_int(t) and t >= 0 for t in tokens):
        raise bad_request("'tokens' must be a list of token ids", "tokens")
    _refuse_unknown(body, DETOKENIZE_FIELDS)
    return DetokenizeRequest(model=_opt_str(body, "model"), tokens=list(tokens))


# --------------------------------------------------------------------------- fields


def _sampling(body: Mapping[str, Any], *, max_tokens_keys: tuple[str, ...]) -> SamplingRequest:
    max_tokens = None
    max_tokens_field = max_tokens_keys[0]
    for key in max_tokens_keys:
        max_tokens = _opt_int(body, key, minimum=0)
        if max_tokens is not None:
            max_tokens_field = key
            break
    top_k = _opt_int(body, "top_k", minimum=-1)
    stream = _bool(body, "stream", False)
    stream_options = body.get("stream_options")
    if stream_options is not None:
        if not isinstance(stream_options, dict):
            raise bad_request("'stream_options' must be an object", "stream_options")
        if not stream:
            raise bad_request(
                "'stream_options' is for streamed responses; give it with 'stream': true", "stream_options"
            )
        unknown = sorted(set(stream_options) - {"include_usage"})
        if unknown:
            raise bad_request(f"unsupported 'stream_options' key(s) {unknown}; known: include_usage", "stream_options")
    return SamplingRequest(
        model=_opt_str(body, "model"),
        max_tokens=max_tokens,
        temperature=_float(body, "temperature", 1.0, minimum=0.0, maximum=2.0),
        top_p=_float(body, "top_p", 1.0, minimum=0.0, maximum=1.0, exclusive_minimum=True),
        top_k=max(top_k or 0, 0),  # -1 (vLLM) and 0 both mean "off"
        seed=_opt_int(body, "seed", minimum=-(2**63), maximum=2**63 - 1),
        n=_opt_int(body, "n", minimum=1, maximum=MAX_N) or 1,
        stop=_stop(body.get("stop")),
        stop_token_ids=tuple(_token_ids(body.get("stop_token_ids") or [], "stop_token_ids")),
        ignore_eos=_bool(body, "ignore_eos", False),
        skip_special_tokens=_bool(body, "skip_special_tokens", True),
        stream=stream,
        include_usage=bool(stream_options and _bool(stream_options, "include_usage", False)),
        min_tokens=_opt_int(body, "min_tokens", minimum=0) or 0,
        include_stop_str_in_output=_bool(body, "include_stop_str_in_output", False),
        controls={**_controls(body), **_structure(body)},
        max_tokens_field=max_tokens_field,
    )


#: Body fields that become ``aiocb.SamplingParams`` fields of the same name, checked there.
_CONTROLS = (
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
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
            SamplingParams(**{key: value})
        except InvalidRequestError as exc:
            raise bad_request(str(exc), key) from None
        controls[key] = value
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


def _structure(body: Mapping[str, Any]) -> dict[str, Any]:
    """The output constraint of a body (OpenAI's ``response_format``, vLLM's
    ``structured_outputs`` and ``guided_*``) as a ``SamplingParams`` field; at most one.
    A ``structural_tag`` response format is the tag itself (xgrammar's form, or the older
    ``structures`` and ``triggers``)."""
    found: list[tuple[str, str, Any]] = []  # (body field, SamplingParams field, value)
    response_format = body.get("response_format")
    if response_format is not None:
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind == "json_object":
            found.append(("response_format", "json_schema", {"type": "object"}))
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                message = "'response_format.json_schema.schema' must be a JSON schema object"
                raise bad_request(message, "response_format")
            found.append(("response_format", "json_schema", spec["schema"]))
        elif kind == "structural_tag":
            found.append(("response_format", "structural_tag", response_format))
        elif kind != "text":
            raise bad_request(
                "'response_format' must be an object whose 'type' is text, json_object, json_schema or structural_tag",
                "response_format",
            )
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise bad_request("'structured_outputs' must be an object", "structured_outputs")
        unknown = sorted(set(outputs) - set(_STRUCTURED_OUTPUTS))
        if unknown:
            message = f"unsupported 'structured_outputs' key(s) {unknown}; known: {', '.join(_STRUCTURED_OUTPUTS)}"
            raise bad_request(message, "structured_outputs")
        found += [(f"structured_outputs.{k}", _STRUCTURED_OUTPUTS[k], v) for k, v in outputs.items() if v is not None]
    found += [(key, name, body[key]) for key, name in _GUIDED.items() if body.get(key) is not None]
    if not found:
        return {}
    if len(found) > 1:
        raise bad_request(f"give one output constraint, got {', '.join(f for f, _, _ in found)}", found[1][0])
    where, name, value = found[0]
    try:
        SamplingParams(**{name: value})
    except InvalidRequestError as exc:
        raise bad_request(f"{where}: {exc}", where.split(".")[0]) from None
    return {name: value}


#: Fields that do not change what is generated (identifiers, bookkeeping): accepted as they are.
_NO_EFFECT = frozenset({"user", "metadata", "store", "service_tier", "request_id"})
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
        "best_of",
        "response_format",
        "structured_outputs",
        *_GUIDED,
        *_CONTROLS,
    }
)
#: Every field each endpoint honours; any other one is refused with a 400 naming it.
COMPLETION_FIELDS = _SAMPLING_FIELDS | _NO_EFFECT | {"prompt", "logprobs", "echo", "suffix"}
CHAT_FIELDS = (
    _SAMPLING_FIELDS
    | _NO_EFFECT
    | {
        "messages",
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
        "add_generation_prompt",
        "chat_template_kwargs",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
    }
)


TOKENIZE_FIELDS = frozenset(
    {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt", "chat_template_kwargs"}
)
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


def _refuse_unknown(body: Mapping[str, Any], known: frozenset[str]) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise bad_request(
            f"unsupported field(s): {', '.join(repr(k) for k in unknown)}; this server does not implement them",
            unknown[0],
        )


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    """Refuse known OpenAI fields whose non-default values this server cannot honour."""
    suffix = body.get("suffix")
    if suffix is not None and not isinstance(suffix, str):
        raise bad_request("'suffix' must be a string", "suffix")
    if suffix:
        raise bad_request("'suffix' is not supported by this server", "suffix")
    best_of = body.get("best_of")
    n = body.get("n") or 1
    if best_of is not None and best_of != n:
        raise bad_request("'best_of' is not supported by this server (only best_of == n)", "best_of")


def _template_kwargs(body: Mapping[str, Any]) -> dict[str, Any]:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise bad_request("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    return dict(kwargs or {})


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
    if all(_is_int(v) for v in value):
        return [_token_ids(value, "prompt")]
    if all(isinstance(v, list) for v in value):
        prompts: list[str | list[int]] = [_token_ids(v, "prompt") for v in value]
        return prompts
    raise bad_request("'prompt' mixes strings and token ids; send one kind", "prompt")


def _token_ids(value: Any, param: str) -> list[int]:
    if not isinstance(value, list) or not all(_is_int(v) for v in value):
        raise bad_request(f"'{param}' must be a list of token ids (ints)", param)
    if any(v < 0 for v in value):
        raise bad_request(f"'{param}' holds a negative token id", param)
    return list(value)


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


#: A chat message's fields, all passed to the chat template (``reasoning_content``: an
#: earlier turn's reasoning, which templates such as Qwen3's render or drop by turn).
MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content"})
#: Fields of assistant messages that OpenAI's responses carry, accepted while empty (a client
#: sends a response's message back as it came).
_UNSET_OK = frozenset({"refusal", "function_call", "audio", "annotations"})


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise bad_request("'messages' must be a non-empty list of messages", "messages")
    messages: list[dict[str, Any]] = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a string 'role'", "messages")
        unknown = sorted(k for k in set(message) - MESSAGE_FIELDS if not (k in _UNSET_OK and not message[k]))
        if unknown:
            raise bad_request(
                f"messages[{i}] has unsupported field(s) {unknown}; known: {sorted(MESSAGE_FIELDS)}", "messages"
            )
        flat = dict(message)
        flat["content"] = _content(message.get("content"), i)
        messages.append(flat)
    return messages


def _content(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad_request(f"messages[{index}].content: only text parts are supported, got {kind!r}", "messages")
        return "\n".join(texts)
    raise bad_request(f"messages[{index}].content must be a string or a list of text parts", "messages")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _opt_int(body: Mapping[str, Any], key: str, *, minimum: int | None, maximum: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not _is_int(value):
        raise bad_request(f"'{key}' must be an integer, got {value!r}", key)
    if minimum is not None and value < minimum:
        raise bad_request(f"'{key}' must be >= {minimum}, got {value}", key)
    if maximum is not None and value > maximum:
        raise bad_request(f"'{key}' must be <= {maximum}, got {value}", key)
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


def _bool(body: Mapping[str, Any], key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{key}' must be true or false, got {value!r}", key)
    return value


def _opt_str(body: Mapping[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise bad_request(f"'{key}' must be a string", key)
    return value
