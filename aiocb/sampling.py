"""Per-request generation parameters: a transformers ``GenerationConfig`` plus overrides.

Every check of a request's input lives here, so a bad request is refused with an
:class:`~aiocb.InvalidRequestError` naming the problem before anything is queued.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from transformers import GenerationConfig

from aiocb.core.params import SamplingParams
from aiocb.errors import InvalidRequestError

#: transformers' own defaults for fields a GenerationConfig leaves unset.
_DEFAULT_TEMPERATURE = 1.0
_DEFAULT_TOP_K = 50
_DEFAULT_TOP_P = 1.0
_DEFAULT_MAX_LENGTH = 20


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What the model and the cache can hold."""

    vocab_size: int
    #: the model's context length, if it has one
    max_model_len: int | None
    #: tokens one request may occupy in the cache when it is alone
    cache_capacity: int


def normalize_prompt(input_ids: Any, limits: RequestLimits) -> list[int]:
    """The prompt as a list of ints, or an InvalidRequestError saying what is wrong."""
    if hasattr(input_ids, "tolist") and not isinstance(input_ids, list):
        if getattr(input_ids, "ndim", 1) != 1:
            raise InvalidRequestError(
                f"input_ids must be one-dimensional (one prompt), got shape {tuple(input_ids.shape)}"
            )
        input_ids = input_ids.tolist()
    if isinstance(input_ids, (str, bytes)) or not isinstance(input_ids, Sequence):
        raise InvalidRequestError(
            f"input_ids must be a list of token ids, got {type(input_ids).__name__}; "
            "tokenize text with the model's tokenizer first"
        )
    if not input_ids:
        raise InvalidRequestError("input_ids is empty: a prompt needs at least one token")
    prompt: list[int] = []
    for position, token in enumerate(input_ids):
        if isinstance(token, bool) or not isinstance(token, int):
            raise InvalidRequestError(
                f"input_ids[{position}] is {token!r} ({type(token).__name__}); token ids must be ints"
            )
        if not 0 <= token < limits.vocab_size:
            raise InvalidRequestError(
                f"input_ids[{position}] = {token} is outside the vocabulary [0, {limits.vocab_size})"
            )
        prompt.append(int(token))
    return prompt


def eos_ids(value: int | Iterable[int] | None) -> frozenset[int]:
    """EOS ids as a set; negative ids (transformers' "no EOS") are dropped."""
    if value is None:
        return frozenset()
    if isinstance(value, int):
        value = [value]
    return frozenset(int(v) for v in value if int(v) >= 0)


def build_params(
    generation_config: GenerationConfig,
    prompt_len: int,
    limits: RequestLimits,
    *,
    default_eos: frozenset[int],
    default_logprobs: bool,
    default_seed: int,
    max_new_tokens: int | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    do_sample: bool | None = None,
    seed: int | None = None,
    eos_token_id: int | list[int] | None = None,
    stop_token_ids: Iterable[int] | None = None,
    return_logprobs: bool | None = None,
    top_logprobs: int | None = None,
    prompt_logprobs: bool | None = None,
) -> SamplingParams:
    """Resolve a request's parameters: explicit values, then the GenerationConfig, then
    transformers' defaults; check them against the model and the cache.

    A request samples when ``do_sample`` says so; if ``do_sample`` is not given, passing
    any of ``temperature``, ``top_k`` or ``top_p`` asks for sampling, otherwise the
    GenerationConfig decides. ``temperature=0`` is always greedy.
    """
    gen = generation_config
    if max_new_tokens is None:
        max_new_tokens = gen.max_new_tokens
    if max_new_tokens is None:
        max_length = gen.max_length if gen.max_length is not None else _DEFAULT_MAX_LENGTH
        max_new_tokens = max(1, max_length - prompt_len)
    _require_int("max_new_tokens", max_new_tokens, minimum=1)

    if do_sample is None:
        explicit = temperature is not None or top_k is not None or top_p is not None
        do_sample = explicit or bool(gen.do_sample)
    temperature = _pick(temperature, gen.temperature, _DEFAULT_TEMPERATURE)
    top_k = _pick(top_k, gen.top_k, _DEFAULT_TOP_K)
    top_p = _pick(top_p, gen.top_p, _DEFAULT_TOP_P)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature < 0:
        raise InvalidRequestError(f"temperature must be a number >= 0, got {temperature!r}")
    _require_int("top_k", top_k, minimum=0)
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
        raise InvalidRequestError(f"top_p must be in (0, 1], got {top_p!r}")
    if seed is not None:
        _require_int("seed", seed, minimum=None)
    if top_logprobs is not None:
        _require_int("top_logprobs", top_logprobs, minimum=0)
        if top_logprobs > limits.vocab_size:
            raise InvalidRequestError(f"top_logprobs ({top_logprobs}) exceeds the vocabulary size {limits.vocab_size}")

    if eos_token_id is None:
        stops = eos_ids(gen.eos_token_id) if gen.eos_token_id is not None else default_eos
    else:
        stops = _checked_ids("eos_token_id", eos_token_id, limits.vocab_size)
    if stop_token_ids is not None:
        stops = stops | _checked_ids("stop_token_ids", stop_token_ids, limits.vocab_size)

    total = prompt_len + max_new_tokens
    if limits.max_model_len is not None and total > limits.max_model_len:
        raise InvalidRequestError(
            f"prompt ({prompt_len} tokens) plus max_new_tokens ({max_new_tokens}) is {total} tokens, "
            f"beyond the model's context length of {limits.max_model_len}"
        )
    if prompt_len > limits.cache_capacity:
        raise InvalidRequestError(
            f"the prompt ({prompt_len} tokens) cannot fit the whole KV cache ({limits.cache_capacity} tokens); "
            "raise num_blocks or max_memory_percent"
        )
    if total > limits.cache_capacity:
        raise InvalidRequestError(
            f"prompt plus max_new_tokens ({total} tokens) cannot fit the whole KV cache "
            f"({limits.cache_capacity} tokens); lower max_new_tokens or enlarge the cache"
        )
    return SamplingParams(
        max_new_tokens=int(max_new_tokens),
        temperature=float(temperature) if do_sample else 0.0,
        top_k=int(top_k),
        top_p=float(top_p),
        seed=int(seed) if seed is not None else default_seed,
        stop_token_ids=stops,
        return_logprobs=bool(top_logprobs) or (default_logprobs if return_logprobs is None else bool(return_logprobs)),
        top_logprobs=int(top_logprobs or 0),
        prompt_logprobs=bool(prompt_logprobs),
    )


def _pick(explicit: Any, configured: Any, default: Any) -> Any:
    if explicit is not None:
        return explicit
    return configured if configured is not None else default


def _require_int(name: str, value: Any, *, minimum: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise InvalidRequestError(f"{name} must be >= {minimum}, got {value}")


def _checked_ids(name: str, value: int | Iterable[int], vocab_size: int) -> frozenset[int]:
    values = [value] if isinstance(value, int) else list(value)
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            raise InvalidRequestError(f"{name} must hold token ids (ints), got {v!r}")
        if v >= vocab_size:
            raise InvalidRequestError(f"{name} {v} is outside the vocabulary [0, {vocab_size})")
    return frozenset(v for v in values if v >= 0)
