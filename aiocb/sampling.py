"""A request's parameters resolved: its :class:`~aiocb.SamplingParams`, then the manager's
``GenerationConfig``, then transformers' defaults, checked against the model and the cache.

The checks that need the model (token ids within the vocabulary, a prompt that fits the
context and the cache) live here, the others in :class:`~aiocb.SamplingParams`, so a bad
request is refused with an :class:`~aiocb.InvalidRequestError` naming the problem before
anything is queued.
"""

from __future__ import annotations

import copy
import itertools
import logging
import math
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from transformers import GenerationConfig

from aiocb.core.params import ResolvedParams, c_array
from aiocb.core.sequences import SequenceBias
from aiocb.errors import InvalidRequestError
from aiocb.gil import pause
from aiocb.params import SLICE, STRUCTURE_FIELDS, SamplingParams, all_ints, token_id

logger = logging.getLogger(__name__)

#: transformers' own defaults for fields a GenerationConfig leaves unset.
_DEFAULT_TEMPERATURE = 1.0
_DEFAULT_TOP_K = 50
_DEFAULT_TOP_P = 1.0
_DEFAULT_MAX_NEW_TOKENS = 20
#: the smallest temperature a sampled request may ask for (0 is greedy)
MIN_TEMPERATURE = 1e-6
#: the largest: float32's (the logits are divided by it in float32, where more is infinite)
MAX_TEMPERATURE = 3.4028234663852886e38


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What the model and the cache can hold."""

    vocab_size: int
    #: the model's context length, if it has one
    max_model_len: int | None
    #: tokens one request may occupy in the cache when it is alone
    cache_capacity: int


def merged_generation_config(model: Any, given: GenerationConfig | None) -> GenerationConfig:
    """The GenerationConfig a manager's requests default to: ``given``, its unset fields
    taken from ``model.generation_config``, as ``model.generate(generation_config=...)``
    merges them (a model's own EOS, such as an instruct model's end-of-turn, is kept)."""
    own: GenerationConfig = model.generation_config
    if given is None:
        return copy.deepcopy(own)
    merged = copy.deepcopy(given)
    merged.update(**own.to_dict(), defaults_only=True, allow_custom_entries=True)  # type: ignore[no-untyped-call]
    return merged


def check_truncation(keep: int | None, max_model_len: int | None) -> None:
    """Refuse a ``truncate_prompt_tokens`` beyond the model's context length (as vLLM does)."""
    if keep is not None and max_model_len is not None and keep > max_model_len:
        raise InvalidRequestError(
            f"truncate_prompt_tokens ({keep}) is more than the model's context length ({max_model_len})",
            param="truncate_prompt_tokens",
        )


def truncated_prompt(prompt: list[int], keep: int | None, max_model_len: int | None) -> list[int]:
    """``prompt`` cut to its last ``keep`` tokens (``truncate_prompt_tokens``; -1: the model's
    context length, ``max_model_len``; None: all of it)."""
    check_truncation(keep, max_model_len)
    if keep == -1:
        keep = max_model_len
    if keep is None or len(prompt) <= keep:
        return prompt
    return prompt[len(prompt) - keep :]


#: Prompts of more token ids than this are checked on a worker thread, a slice at a time
#: (:func:`checked_long_prompt`): in one go, 100,000 ids held the event loop 6-7 ms.
LONG_ID_PROMPT = 16_384


@dataclass(frozen=True, slots=True)
class CheckedPrompt:
    """A long prompt's token ids checked against a vocabulary of ``vocab_size`` tokens, and
    cut to those kept, on a worker thread (:func:`checked_long_prompt`): :func:`normalize_prompt`
    takes them as they are."""

    ids: list[int]
    vocab_size: int


def is_long_id_prompt(prompt: Any) -> bool:
    """Whether ``prompt`` is a list, tuple or one-dimensional array of more than
    :data:`LONG_ID_PROMPT` token ids (anything else is checked as it always was)."""
    if type(prompt) in (list, tuple):
        return len(prompt) > LONG_ID_PROMPT
    if hasattr(prompt, "tolist") and getattr(prompt, "ndim", 1) == 1:
        try:
            return len(prompt) > LONG_ID_PROMPT
        except TypeError:  # (a 0-dimensional array has no length)
            return False
    return False


def checked_long_prompt(input_ids: Any, vocab_size: int, keep: int | None, max_model_len: int | None) -> CheckedPrompt:
    """:func:`normalize_prompt` of a long prompt (:func:`is_long_id_prompt`), a slice of
    :data:`LONG_ID_PROMPT` ids at a time with a :func:`~aiocb.gil.pause` between slices (on
    a worker thread inside :func:`~aiocb.gil.pausing`), then :func:`truncated_prompt`: the
    ids not kept are freed here, not on the loop."""
    ids: list[int] = []
    for start in range(0, len(input_ids), LONG_ID_PROMPT):
        if start:
            pause()
        ids += normalize_prompt(input_ids[start : start + LONG_ID_PROMPT], vocab_size, offset=start)
    return CheckedPrompt(truncated_prompt(ids, keep, max_model_len), vocab_size)


def normalize_prompt(input_ids: Any, vocab_size: int, *, offset: int = 0) -> list[int]:
    """The prompt as a list of ints within a vocabulary of ``vocab_size`` tokens, or an
    InvalidRequestError saying what is wrong (positions counted from ``offset``:
    ``input_ids`` is a slice of the prompt there)."""
    if type(input_ids) is CheckedPrompt and input_ids.vocab_size == vocab_size:
        return input_ids.ids  # (a list of its own, made on the worker thread)
    if hasattr(input_ids, "tolist") and not isinstance(input_ids, list):
        if getattr(input_ids, "ndim", 1) != 1:
            raise InvalidRequestError(
                f"input_ids must be one-dimensional (one prompt), got shape {tuple(input_ids.shape)}",
                param="input_ids",
            )
        try:
            input_ids = input_ids.tolist()
        except Exception as exc:  # (a tensor with no data: on the meta device, say)
            raise InvalidRequestError(f"input_ids cannot be read as token ids: {exc}", param="input_ids") from None
    if isinstance(input_ids, (str, bytes)) or not isinstance(input_ids, Sequence):
        raise InvalidRequestError(
            f"input_ids must be a list of token ids, got {type(input_ids).__name__}; "
            "tokenize text with the model's tokenizer first",
            param="input_ids",
        )
    if not input_ids:
        raise InvalidRequestError("input_ids is empty: a prompt needs at least one token", param="input_ids")
    # The usual prompt, a list (or tuple) of plain ints, checked by loops that run in C: a
    # Python loop over a long prompt would hold the event loop for milliseconds.
    if type(input_ids) in (list, tuple) and all_ints(input_ids):
        low, high = min(input_ids), max(input_ids)
        if low >= 0 and high < vocab_size:
            return list(input_ids)
        token = high if high >= vocab_size else low
        raise InvalidRequestError(
            f"input_ids[{offset + input_ids.index(token)}] = {token} is outside the vocabulary [0, {vocab_size})",
            param="input_ids",
        )
    # Anything else, token by token, to name the first offending position.
    prompt: list[int] = []
    for position, given in enumerate(input_ids, start=offset):
        token = token_id(given)  # (a NumPy integer too: list(array) makes those)
        if token is None:
            raise InvalidRequestError(
                f"input_ids[{position}] is {given!r} ({type(given).__name__}); token ids must be ints",
                param="input_ids",
            )
        if not 0 <= token < vocab_size:
            raise InvalidRequestError(
                f"input_ids[{position}] = {token} is outside the vocabulary [0, {vocab_size})",
                param="input_ids",
            )
        prompt.append(token)
    return prompt


def eos_ids(value: int | Iterable[int] | None) -> frozenset[int]:
    """EOS ids as a set; negative ids (transformers' "no EOS") are dropped."""
    if value is None:
        return frozenset()
    if isinstance(value, int):
        value = [value]
    return frozenset(int(v) for v in value if int(v) >= 0)


@dataclass(frozen=True, slots=True)
class ConfigDefaults:
    """What a manager's ``GenerationConfig`` contributes to every request."""

    #: the fields it gives, as request parameters
    params: SamplingParams
    max_length: int | None = None
    min_length: int | None = None
    suppress_tokens: tuple[int, ...] = ()
    begin_suppress_tokens: tuple[int, ...] = ()
    #: its ``stop_strings``, which follow transformers' rules (see ``ResolvedParams.config_stop``)
    stop_strings: tuple[str, ...] = ()


#: GenerationConfig fields that ask ``generate`` for more than tokens.
_OUTPUT_FIELDS = (
    "output_scores",
    "output_logits",
    "output_attentions",
    "output_hidden_states",
    "return_dict_in_generate",
)
#: GenerationConfig fields aiocb cannot honour, with the values that mean "off".
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "num_beams": (1,),
    "num_beam_groups": (1,),
    "diversity_penalty": (0.0,),
    "penalty_alpha": (),
    "guidance_scale": (1.0,),
    "encoder_no_repeat_ngram_size": (0,),
    "encoder_repetition_penalty": (1.0,),
    "forced_bos_token_id": (),
    "forced_eos_token_id": (),
    "exponential_decay_length_penalty": (),
    "watermarking_config": (),
    "remove_invalid_values": (False,),
    "constraints": (),
    "force_words_ids": (),
    "dola_layers": (),
    "token_healing": (False,),
    "assistant_early_exit": (),
    "prompt_lookup_num_tokens": (),
    "use_mtp": (False,),
    "speculation_type": (),
    # (what generate returns besides tokens: aiocb's outputs carry logprobs instead)
    **dict.fromkeys(_OUTPUT_FIELDS, (False,)),
}


def config_defaults(
    generation_config: GenerationConfig, *, has_tokenizer: bool, drop_unsupported: bool
) -> ConfigDefaults:
    """The request defaults a ``GenerationConfig`` sets: every field aiocb honours is
    honoured; any other field that would change outputs raises InvalidRequestError
    naming it, or with ``drop_unsupported`` is dropped with one warning naming it."""
    gen = generation_config
    unsupported = [name for name, off in _UNSUPPORTED.items() if getattr(gen, name, None) not in (None, *off)]
    top_h, typical_p, epsilon_cutoff, eta_cutoff = _rare_filters(gen, unsupported)
    stop_strings = gen.stop_strings
    if stop_strings is not None and not has_tokenizer:
        unsupported.append("stop_strings (stop strings need the Manager's tokenizer=)")
        stop_strings = None
    if unsupported:
        message = f"the GenerationConfig sets fields aiocb does not support: {', '.join(unsupported)}"
        if set(_OUTPUT_FIELDS).intersection(unsupported):
            message += " (outputs carry log-probabilities instead: return_logprobs, top_logprobs, logprobs_mode)"
        if not drop_unsupported:
            raise InvalidRequestError(f"{message}; unset them, or pass drop_unsupported_processors=True to drop them")
        logger.warning("%s; they are dropped (drop_unsupported_processors=True)", message)
    sequence_bias = gen.sequence_bias
    if isinstance(sequence_bias, list):  # transformers' JSON form: [[ids, bias], ...]
        sequence_bias = [(tuple(ids), bias) for ids, bias in sequence_bias]
    params = SamplingParams(
        max_new_tokens=gen.max_new_tokens,
        min_tokens=gen.min_new_tokens,
        do_sample=gen.do_sample,
        temperature=gen.temperature,
        top_k=gen.top_k,
        top_p=gen.top_p,
        min_p=gen.min_p,
        top_h=top_h,
        typical_p=typical_p,
        epsilon_cutoff=epsilon_cutoff,
        eta_cutoff=eta_cutoff,
        repetition_penalty=gen.repetition_penalty,
        sequence_bias=sequence_bias,
        bad_words_ids=gen.bad_words_ids,
        no_repeat_ngram_size=gen.no_repeat_ngram_size,
        eos_token_id=gen.eos_token_id,
        timeout=gen.max_time,
        n=gen.num_return_sequences,
    )
    return ConfigDefaults(
        params=params,
        max_length=gen.max_length,
        min_length=gen.min_length,
        suppress_tokens=tuple(gen.suppress_tokens or ()),
        begin_suppress_tokens=tuple(gen.begin_suppress_tokens or ()),
        stop_strings=_config_stop_strings(stop_strings),
    )


def _config_stop_strings(value: Any) -> tuple[str, ...]:
    """A GenerationConfig's ``stop_strings`` (a string or strings; None for none)."""
    if value is None:
        return ()
    strings = [value] if isinstance(value, str) else list(value)
    if not all(isinstance(s, str) and s for s in strings):
        raise InvalidRequestError(f"the GenerationConfig's stop_strings must be non-empty strings, got {value!r}")
    return tuple(strings)


def _rare_filters(gen: GenerationConfig, unsupported: list[str]) -> list[float | None]:
    """The GenerationConfig's top-h, typical-p, epsilon and eta cutoffs as transformers uses
    them: a value it builds no processor for (``typical_p`` 1 or more, a cutoff outside
    (0, 1)) is off, and one its processor refuses (``typical_p`` 0 or less, ``top_h``
    outside (0, 1]) joins ``unsupported``."""
    rare: list[float | None] = []
    for name in ("top_h", "typical_p", "epsilon_cutoff", "eta_cutoff"):
        value = getattr(gen, name, None)
        rare.append(None)
        if value is None:
            continue
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or (name == "top_h" and not 0 < value <= 1)
            or (name == "typical_p" and value <= 0)
        ):
            unsupported.append(f"{name} ({value!r}, which transformers refuses)")
        elif 0 < value < 1 or (name == "top_h" and value == 1):
            rare[-1] = float(value)
    return rare


def config_min_tokens(min_new_tokens: int | None, min_length: int | None, prompt_len: int) -> int:
    """The ``min_tokens`` of a request that gives none, from its GenerationConfig's
    ``min_new_tokens``, else its ``min_length`` less the prompt (as ``generate``: a
    ``min_new_tokens`` wins over ``min_length``)."""
    if min_new_tokens is not None:
        return min_new_tokens
    return max(min_length - prompt_len, 0) if min_length else 0


#: the filters of a draw, and the values at which each filters nothing (transformers' defaults)
_FILTERS_OFF: dict[str, tuple[float, ...]] = {
    "top_k": (0, 50),
    "top_p": (1.0,),
    "min_p": (0.0,),
    "typical_p": (1.0,),
    "epsilon_cutoff": (0.0,),
    "eta_cutoff": (0.0,),
    "top_h": (0.0,),
}
#: the sets of filters a greedy request was warned of (once each: a server's requests repeat)
_WARNED_FILTERS: set[tuple[str, ...]] = set()


def _warn_unused_filters(request: SamplingParams, do_sample: bool) -> None:
    """Warn once of the draw's filters a greedy request gave, which greedy decoding does not
    use (as transformers' generate, which warns likewise): it takes the most likely token."""
    given = [name for name, off in _FILTERS_OFF.items() if getattr(request, name) not in (None, *off)]
    if not do_sample and request.temperature not in (None, 0.0, 1.0):  # (0 asks for greedy itself)
        given.insert(0, "temperature")
    if given and tuple(given) not in _WARNED_FILTERS:
        _WARNED_FILTERS.add(tuple(given))
        why = "do_sample=False" if not do_sample else "temperature=0"
        logger.warning(
            "%s is greedy decoding, which does not use %s (as transformers' generate): the most likely token "
            "is taken; give do_sample=True and a temperature above 0 to sample with them (said once)",
            why,
            ", ".join(f"{name}={getattr(request, name)!r}" for name in given),
        )


def resolve_params(
    request: SamplingParams,
    defaults: ConfigDefaults,
    prompt_len: int,
    limits: RequestLimits,
    *,
    default_eos: frozenset[int],
    default_logprobs: bool,
    default_seed: int,
    has_tokenizer: bool,
    can_constrain: bool,
) -> ResolvedParams:
    """Resolve a request's parameters: its own values, then the GenerationConfig's, then
    transformers' defaults; check them against the model and the cache.

    ``has_tokenizer``: text is available (stop strings); ``can_constrain``: output
    constraints can be compiled (a tokenizer's vocabulary is known).

    A request samples when ``do_sample`` says so; if ``do_sample`` is not given, passing
    any of ``temperature``, ``top_k`` or ``top_p`` asks for sampling, otherwise the
    GenerationConfig decides. ``temperature=0`` is always greedy.
    """
    config = defaults.params

    def pick(name: str, default: Any) -> Any:
        value = getattr(request, name)
        if value is None:
            value = getattr(config, name)
        return default if value is None else value

    max_new_tokens = pick("max_new_tokens", None)
    if max_new_tokens is None:
        if defaults.max_length is not None:  # a length set in the GenerationConfig counts the prompt
            if prompt_len >= defaults.max_length:
                raise InvalidRequestError(
                    f"the prompt ({prompt_len} tokens) leaves no room under the GenerationConfig's max_length "
                    f"({defaults.max_length}, which counts the prompt); give max_new_tokens",
                    param="input_ids",
                )
            max_new_tokens = defaults.max_length - prompt_len
        else:  # as generate: 20 new tokens
            max_new_tokens = _DEFAULT_MAX_NEW_TOKENS
    if request.max_new_tokens is None and limits.max_model_len is not None:
        # (a default, the GenerationConfig's or generate's, within the served context, as
        # vLLM's is: a config's length may pass a max_model_len the manager was given)
        max_new_tokens = max(1, min(max_new_tokens, limits.max_model_len - prompt_len))
    min_tokens = request.min_tokens
    if min_tokens is None:
        min_tokens = config_min_tokens(config.min_tokens, defaults.min_length, prompt_len)
    if request.min_tokens is not None and request.min_tokens > max_new_tokens:
        raise InvalidRequestError(
            f"min_tokens ({request.min_tokens}) is more than max_new_tokens ({max_new_tokens}): the request "
            "would end at max_new_tokens before min_tokens were reached",
            param="min_tokens",
        )
    do_sample = request.do_sample
    if do_sample is None:
        # (a filter of the draw asks for one: on a greedy request it would go unused)
        filters = ("temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "top_h")
        do_sample = any(getattr(request, name) is not None for name in filters) or bool(config.do_sample)
    temperature = pick("temperature", _DEFAULT_TEMPERATURE)
    if not do_sample or temperature == 0.0:
        _warn_unused_filters(request, do_sample)
    if do_sample and 0.0 < temperature < MIN_TEMPERATURE:
        # (logits / temperature would run far past where float32 tells tokens apart, or
        # leave its range: the draw would not be the softmax's)
        raise InvalidRequestError(
            f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, got {temperature}", param="temperature"
        )
    if do_sample and temperature > MAX_TEMPERATURE:
        raise InvalidRequestError(
            f"temperature must be at most {MAX_TEMPERATURE:.4g} (float32's largest), got {temperature}",
            param="temperature",
        )
    top_k = pick("top_k", _DEFAULT_TOP_K)
    if top_k >= limits.vocab_size:
        top_k = 0  # (every token: what 0 says, in a form the device takes whatever was asked)
    top_logprobs = pick("top_logprobs", 0)
    if top_logprobs > limits.vocab_size:
        raise InvalidRequestError(
            f"top_logprobs ({top_logprobs}) exceeds the vocabulary size {limits.vocab_size}", param="top_logprobs"
        )
    vocab = limits.vocab_size

    eos = request.eos_token_id if request.eos_token_id is not None else config.eos_token_id
    eos_set = default_eos if eos is None else _checked_ids("eos_token_id", eos, vocab)
    ignore_eos = pick("ignore_eos", False)
    stops = frozenset() if ignore_eos else eos_set
    if request.stop_token_ids:
        stops = _checked_ids("stop_token_ids", request.stop_token_ids, vocab, more=stops)
    stop = pick("stop", ())
    if stop and not has_tokenizer:
        raise InvalidRequestError(
            "stop strings need a tokenizer: pass tokenizer=... (to aiocb.Manager or aiocb.generate_batch)", param="stop"
        )
    if not has_tokenizer:  # (asked of ``text``, which only a tokenizer makes)
        for name in ("skip_special_tokens", "include_stop_str_in_output"):
            if getattr(request, name) is not None:
                raise InvalidRequestError(
                    f"{name} shapes text, which needs a tokenizer: pass tokenizer=... (to aiocb.Manager or "
                    "aiocb.generate_batch)",
                    param=name,
                )
    structure = request.structure()
    if structure is not None and not can_constrain:
        given = next(name for name in STRUCTURE_FIELDS if getattr(request, name) is not None)
        raise InvalidRequestError(
            f"{given} needs a tokenizer: pass tokenizer=... (to aiocb.Manager or aiocb.generate_batch)", param=given
        )

    # (an EOS the request ignores is a token as any other: nothing keeps it reachable)
    words = _sequence_controls(
        pick("sequence_bias", ()), pick("bad_words_ids", ()), frozenset() if ignore_eos else eos_set, vocab
    )
    biased, sequences, bad_sequences, word_bans = words
    logit_bias = pick("logit_bias", ())
    if logit_bias and logit_bias[-1][0] >= vocab:  # (SamplingParams sorts them by id)
        message = f"logit_bias {logit_bias[-1][0]} is outside the vocabulary [0, {vocab})"
        raise InvalidRequestError(message, param="logit_bias")
    bias_ids = c_array("q", map(_FIRST, itertools.chain(biased, logit_bias)))
    bias_values = c_array("f", map(_SECOND, itertools.chain(biased, logit_bias)))
    bans: list[int] = [*_checked_ids("suppress_tokens", defaults.suppress_tokens, vocab), *word_bans]
    allowed = pick("allowed_token_ids", None)
    if allowed is not None:
        allowed = c_array("q", sorted(_checked_ids("allowed_token_ids", allowed, vocab)))
    begin_bans = _checked_ids("begin_suppress_tokens", defaults.begin_suppress_tokens, vocab)
    distinct_bans = _distinct(bans)
    _refuse_nothing_allowed(allowed, distinct_bans, begin_bans, stops if min_tokens > 0 else frozenset(), vocab)

    total = prompt_len + max_new_tokens
    if limits.max_model_len is not None and total > limits.max_model_len:
        raise InvalidRequestError(
            f"prompt ({prompt_len} tokens) plus max_new_tokens ({max_new_tokens}) is {total} tokens, "
            f"beyond the model's context length of {limits.max_model_len}",
            param="input_ids" if prompt_len >= limits.max_model_len else "max_new_tokens",
        )
    if prompt_len > limits.cache_capacity:
        raise InvalidRequestError(
            f"the prompt ({prompt_len} tokens) cannot fit the whole KV cache ({limits.cache_capacity} tokens); "
            "raise num_blocks or max_memory_percent",
            param="input_ids",
        )
    if total - 1 > limits.cache_capacity:  # (the last token is sampled, never attended to: no slot)
        raise InvalidRequestError(
            f"prompt plus max_new_tokens less the last token ({total - 1} tokens) cannot fit the whole KV cache "
            f"({limits.cache_capacity} tokens); lower max_new_tokens or enlarge the cache",
            param="max_new_tokens",
        )
    return_logprobs = request.return_logprobs
    if return_logprobs is False and request.top_logprobs:
        raise InvalidRequestError(
            f"top_logprobs={request.top_logprobs} asks for log-probabilities, which return_logprobs=False refuses: "
            "give one of them",
            param="top_logprobs",
        )
    if return_logprobs is None:
        return_logprobs = bool(top_logprobs) or default_logprobs
    if request.logprobs_mode is not None and not return_logprobs:
        raise InvalidRequestError(
            f"logprobs_mode={request.logprobs_mode!r} says which log-probabilities the generated tokens carry, "
            "which this request does not ask for (return_logprobs, top_logprobs)",
            param="logprobs_mode",
        )
    seed = pick("seed", None)
    return ResolvedParams(
        max_new_tokens=max_new_tokens,
        temperature=temperature if do_sample else 0.0,
        top_k=top_k,
        top_p=pick("top_p", _DEFAULT_TOP_P),
        min_p=pick("min_p", 0.0),
        top_h=pick("top_h", 0.0),
        typical_p=pick("typical_p", 1.0),
        epsilon_cutoff=pick("epsilon_cutoff", 0.0),
        eta_cutoff=pick("eta_cutoff", 0.0),
        seed=default_seed if seed is None else seed,
        stop_token_ids=stops,
        min_tokens=min_tokens,
        return_logprobs=return_logprobs,
        top_logprobs=top_logprobs,
        prompt_logprobs=pick("prompt_logprobs", False),
        record_timestamps=pick("record_timestamps", False),
        processed_logprobs=pick("logprobs_mode", "raw") == "processed",
        repetition_penalty=pick("repetition_penalty", 1.0),
        presence_penalty=pick("presence_penalty", 0.0),
        frequency_penalty=pick("frequency_penalty", 0.0),
        bias_ids=bias_ids,
        bias_values=bias_values,
        sequence_biases=sequences,
        bad_sequences=bad_sequences,
        bans=c_array("q", distinct_bans),
        begin_bans=tuple(begin_bans),
        no_repeat_ngram_size=pick("no_repeat_ngram_size", 0),
        allowed_token_ids=allowed,
        stop=stop,
        include_stop_str_in_output=pick("include_stop_str_in_output", False),
        # (a request's own stop strings replace the config's, as its other fields do)
        config_stop=defaults.stop_strings if request.stop is None else (),
        skip_special_tokens=pick("skip_special_tokens", True),
        priority=pick("priority", 0),
        structure=structure,
    )


def _refuse_nothing_allowed(
    allowed: tuple[int, ...] | None,
    bans: tuple[int, ...],
    begin_bans: frozenset[int],
    held_stops: frozenset[int],
    vocab_size: int,
) -> None:
    """InvalidRequestError when a request's controls ban every token its first step could
    pick (transformers' greedy search would give token 0 there, a token it forbade).
    Bans that grow as it generates (multi-token bad words, n-grams) are caught at the step
    that leaves nothing: the request fails there (``Scheduler``'s ``_NOTHING_ALLOWED``)."""
    if len(bans) + len(begin_bans) + len(held_stops) < (vocab_size if allowed is None else len(allowed)):
        return  # (too few to ban them all; no set made: a union of large ones takes milliseconds)
    banned = set(begin_bans)
    banned.update(held_stops)
    for start in range(0, len(bans), SLICE):  # (bans holds each id once)
        banned.update(bans[start : start + SLICE])
        pause()
    if allowed is None:
        left = vocab_size - len(banned)
    else:  # (allowed holds each id once)
        left = len(allowed) if not banned else len(allowed) - len(banned.intersection(allowed))
    if left > 0:
        return
    by = [
        name
        for name, ids in (
            ("bad_words_ids (or the generation config's suppress_tokens)", bans),
            ("the generation config's begin_suppress_tokens", begin_bans),
            ("min_tokens, which holds off the stop tokens (stop_token_ids, eos_token_id)", held_stops),
        )
        if ids
    ]
    subject = "every token in allowed_token_ids" if allowed is not None else "every token of the vocabulary"
    # (the request's own field at fault: the config's bans are no field of the request)
    param = "allowed_token_ids" if allowed is not None else "min_tokens" if held_stops else "bad_words_ids"
    raise InvalidRequestError(f"no token is left to generate: {subject} is banned by {' and '.join(by)}", param=param)


_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)
_Item = TypeVar("_Item")


#: one-token sequence biases, the longer ones, the bad words of several tokens (each with a
#: bias of 0.0, unused), and the bad words' one-token bans
_SequenceControls = tuple[
    tuple[tuple[int, float], ...], tuple[SequenceBias, ...], tuple[SequenceBias, ...], tuple[int, ...]
]
#: What :func:`_sequence_controls` made last, and of what (its arguments, held: the
#: sequences are tuples, and a request's are nearly always the last one's, the same objects)
_last_sequence_controls: tuple[tuple[Any, ...], _SequenceControls] | None = None


def _sequence_controls(
    given_sequences: Sequence[SequenceBias], bad_words: Sequence[tuple[int, ...]], eos: frozenset[int], vocab: int
) -> _SequenceControls:
    """A request's ``sequence_bias`` and ``bad_words_ids`` checked and split by length (as
    transformers: a bad word that is one of ``eos``, the ids that end the request as EOS,
    stays allowed). Made again only when they are not the last request's: a thousand bad
    words cost 0.7 ms a request on the loop, and new tuples for the collector, for each
    prompt of a batch."""
    global _last_sequence_controls
    key = (given_sequences, bad_words, eos, vocab)
    last = _last_sequence_controls
    if last is not None and all(a is b or a == b for a, b in zip(last[0], key, strict=True)):
        return last[1]
    biased: list[tuple[int, float]] = []  # (one-token sequence biases)
    sequences: list[SequenceBias] = []
    _checked_ids("sequence_bias", itertools.chain.from_iterable(ids for ids, _ in given_sequences), vocab)
    for ids, bias in given_sequences:
        pause()
        if len(ids) == 1:
            biased.append((ids[0], bias))
        else:
            sequences.append((ids, bias))
    bans: list[int] = []
    bad: list[tuple[int, ...]] = []
    _checked_ids("bad_words_ids", itertools.chain.from_iterable(bad_words), vocab)
    for start in range(0, len(bad_words), SLICE):  # (in C passes: a list of 100,000 words took 100 ms)
        words = bad_words[start : start + SLICE]
        one = list(map((1).__eq__, map(len, words)))
        bans += itertools.filterfalse(eos.__contains__, map(_FIRST, itertools.compress(words, one)))
        bad += itertools.compress(words, map(operator.not_, one))
        pause()
    made = (tuple(biased), tuple(sequences), tuple(zip(_distinct(bad), itertools.repeat(0.0))), tuple(bans))
    _last_sequence_controls = (key, made)
    return made


def _checked_ids(
    name: str, value: int | Iterable[int], vocab_size: int, more: frozenset[int] = frozenset()
) -> frozenset[int]:
    """The ids of ``value``, each checked to be within the vocabulary, a slice at a time
    (see :data:`~aiocb.params.SLICE`), with ``more``; negative ones (a config's way of
    saying none) left out."""
    values = iter([value] if isinstance(value, int) else value)
    ids = set(more)
    negative = False
    while part := list(itertools.islice(values, SLICE)):
        # (a few C-level passes first: a long list checked one id at a time holds the loop)
        if all_ints(part) and max(part) < vocab_size:
            negative = negative or min(part) < 0
        else:
            for v in part:
                if isinstance(v, bool) or not isinstance(v, int):
                    raise InvalidRequestError(f"{name} must hold token ids (ints), got {v!r}", param=name)
                if v >= vocab_size:
                    raise InvalidRequestError(f"{name} {v} is outside the vocabulary [0, {vocab_size})", param=name)
        ids.update(part)
        pause()
    return frozenset(v for v in ids if v >= 0) if negative else frozenset(ids)


def _distinct(values: Iterable[_Item]) -> tuple[_Item, ...]:
    """``values`` without repeats, in the order of their first coming, a slice at a time."""
    kept: dict[_Item, None] = {}
    values = list(values)
    for start in range(0, len(values), SLICE):
        kept.update(dict.fromkeys(values[start : start + SLICE]))
        pause()
    return tuple(kept)
