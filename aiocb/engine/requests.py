"""Building a :class:`~aiocb.core.request.Request` from what a caller gives.

This is the one place where a request's input is checked and its parameters resolved:
the prompt (token ids, or a text or chat messages with a tokenizer), the
:class:`~aiocb.SamplingParams` and keyword arguments over the manager's
``GenerationConfig``, its id, its deadline, and the samples (``n``) forked from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import threading
import time
from collections.abc import Callable, Container, Iterator, Mapping, Sized
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from transformers import GenerationConfig, PreTrainedTokenizerBase

from aiocb.config import ContinuousBatchingConfig
from aiocb.core.params import ResolvedParams
from aiocb.core.request import Request
from aiocb.detokenize import TextTracker
from aiocb.errors import InvalidRequestError
from aiocb.gil import pausing_call
from aiocb.params import SamplingParams, as_strings, check_sampling_params, token_id
from aiocb.prompts import Prompt, bad_words_ids, encode_prompt, is_chat, is_large
from aiocb.runner.step_batch import token_history
from aiocb.sampling import (
    RequestLimits,
    check_truncation,
    checked_long_prompt,
    config_defaults,
    eos_ids,
    is_long_id_prompt,
    normalize_prompt,
    resolve_params,
    truncated_prompt,
)
from aiocb.stop_strings import prepare_stop_strings
from aiocb.structured import GrammarCompiler, GrammarState
from aiocb.tokenizer_process import TokenizerProcessHolder

#: a request that gives no parameter: everything from the GenerationConfig
_NO_PARAMS = SamplingParams()
#: ``bad_words`` lists whose token sequences are kept (the cache is emptied when full)
_BAD_WORDS_KEPT = 256
#: ``bad_words`` tokenized on the loop when a request is built; more, on a worker thread first
_BAD_WORDS_ON_THE_LOOP = 16
#: constraints (their text) up to this many characters compile in the short lane
_SHORT_CONSTRAINT = 16_384
#: token ids in a request's controls (the fields below) beyond which it is checked on a
#: worker thread: about 2 ms of checks on the loop
LARGE_CONTROLS = 4096
#: what a token id written as a JSON object key (a ``logit_bias`` from a request body)
#: counts for against :data:`LARGE_CONTROLS`: read as a decimal first, its check costs
#: about three times an int's (3,997 of them held the loop 4.2-4.7 ms)
_KEY_COST = 3
_ID_CONTROLS = ("logit_bias", "stop_token_ids", "allowed_token_ids", "bad_words_ids", "sequence_bias", "eos_token_id")


@dataclass(frozen=True, slots=True)
class CheckedRequest:
    """A request's parameters (merged with its keyword arguments, then resolved) and prompt,
    checked against ``limits``."""

    requested: SamplingParams
    prompt: list[int]
    resolved: ResolvedParams
    limits: RequestLimits
    #: whether it was checked on a worker thread: its draw from the manager's seeds is made
    #: when it is built, on the loop, in the order requests are (its default seed, if it
    #: takes one)
    off_the_loop: bool = False


def _given(name: str, sampling_params: SamplingParams | None, params: dict[str, Any]) -> Any:
    """A request's ``name`` as its build will merge it: the keyword's, unless None (a keyword
    of None leaves the SamplingParams' value)."""
    value = params.get(name)
    return getattr(sampling_params, name, None) if value is None else value


def has_large_controls(sampling_params: SamplingParams | None, params: dict[str, Any]) -> bool:
    """Whether a request's controls list more token ids than :data:`LARGE_CONTROLS` (a
    ``logit_bias`` or ``allowed_token_ids`` over much of the vocabulary, say): checking
    them costs about 0.4 µs an id, so such a request is checked on a worker thread
    (:meth:`RequestFactory.check` there, a slice at a time with pauses for the loop)."""
    total = 0
    for name in _ID_CONTROLS:
        value = _given(name, sampling_params, params)
        if isinstance(value, Sized) and not isinstance(value, (str, bytes)) and token_id(value) is None:
            with contextlib.suppress(TypeError):  # (an array without a length: its check refuses it)
                keyed = isinstance(value, Mapping) and value and type(next(iter(value))) is str
                total += len(value) * (_KEY_COST if keyed else 1)
    return total > LARGE_CONTROLS


def sample_ids(request_id: str, n: int) -> list[str]:
    """The ids of a request's ``n`` samples: its own, then its children's
    (``<id>__child#<i>``, transformers' names for them)."""
    return [request_id, *(f"{request_id}__child#{i}" for i in range(n - 1))]


class RequestFactory:
    """Checks requests and builds them, with the manager's defaults."""

    def __init__(
        self,
        generation_config: GenerationConfig,
        config: ContinuousBatchingConfig,
        tokenizer: PreTrainedTokenizerBase | None,
        default_eos: frozenset[int],
        grammar_tokenizer: PreTrainedTokenizerBase | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        #: whose vocabulary output constraints are compiled against
        self.grammar_tokenizer = grammar_tokenizer or tokenizer
        # Checked once, here: a GenerationConfig field aiocb cannot honour is refused (or
        # dropped with one warning) when the manager is built, not per request.
        self.defaults = config_defaults(
            generation_config, has_tokenizer=tokenizer is not None, drop_unsupported=config.drop_unsupported_processors
        )
        self._default_eos = default_eos
        self._default_logprobs = config.return_logprobs
        self._max_queue_size = config.max_queue_size
        self._compile_timeout = config.grammar_compile_timeout
        self._seeds = random.Random(config.seed)
        self._ids = itertools.count()
        self._grammar_compiler: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()
        #: the threads constraints compile on: short ones, long ones (made on first use)
        self._compilers: list[ThreadPoolExecutor | None] = [None, None]
        #: the token sequences of recent requests' ``bad_words`` (tokenized once each)
        self._bad_words: dict[tuple[str, ...], list[list[int]]] = {}
        #: the last merge of a SamplingParams with a max_new_tokens: (given, max_new_tokens, merged)
        self._last_merge: tuple[SamplingParams, int, SamplingParams] | None = None
        #: where very long prompts are tokenized
        self._processes = TokenizerProcessHolder(tokenizer) if tokenizer is not None else None

    def encode_now(self, prompt: Prompt) -> Any:
        """Token ids of a text or chat prompt, tokenized on the calling thread."""
        return encode_prompt(prompt, self.tokenizer)

    async def encode(self, prompt: Prompt, *, keep: int | None, limit: int | None, vocab_size: int) -> Any:
        """Token ids of a text or chat prompt; a long one is tokenized on a worker thread,
        a very long one in a child process (:mod:`aiocb.tokenizer_process`) that sends back
        only the last ``keep`` tokens (``truncate_prompt_tokens``, -1: ``limit``) or, past
        ``limit`` (the model's context) uncut, refuses the prompt by its count. A long
        prompt of token ids is checked against the vocabulary, and cut, on a worker thread."""
        if not is_large(prompt):
            if is_long_id_prompt(prompt) and not is_chat(prompt):
                return await asyncio.to_thread(pausing_call, checked_long_prompt, prompt, vocab_size, keep, limit)
            return encode_prompt(prompt, self.tokenizer)
        check_truncation(keep, limit)  # (before a long text is tokenized)
        return await asyncio.to_thread(self._encode_large, prompt, keep, limit)

    def _encode_large(self, prompt: Prompt, keep: int | None, limit: int | None) -> Any:
        return encode_prompt(prompt, self.tokenizer, self._processes, keep=keep, limit=limit)

    def close(self) -> None:
        """End the tokenizer process, if long prompts started one (for good: the manager's end)."""
        if self._processes is not None:
            self._processes.close()

    def check(
        self,
        input_ids: Any,
        max_new_tokens: int | None,
        sampling_params: SamplingParams | None,
        params: dict[str, Any],
        limits: RequestLimits,
        off_the_loop: bool = False,
    ) -> CheckedRequest:
        """A request's prompt and parameters checked and resolved, or InvalidRequestError
        naming the problem: all of building it that needs no id (and may run on a worker
        thread, ``off_the_loop``: see :func:`has_large_controls`)."""
        requested = self.merged(sampling_params, max_new_tokens, params)
        if requested.bad_words:
            requested = self._with_bad_words_ids(requested)
        keep = requested.truncate_prompt_tokens
        prompt = truncated_prompt(normalize_prompt(input_ids, limits.vocab_size), keep, limits.max_model_len)
        resolved = resolve_params(
            requested,
            self.defaults,
            len(prompt),
            limits,
            default_eos=self._default_eos,
            default_logprobs=self._default_logprobs,
            default_seed=0 if off_the_loop else self._seeds.getrandbits(32),
            has_tokenizer=self.tokenizer is not None,
            can_constrain=self.grammar_tokenizer is not None,
        )
        return CheckedRequest(requested, prompt, resolved, limits, off_the_loop)

    def build(
        self, checked: CheckedRequest, request_id: str | None, *, in_use: Container[str]
    ) -> tuple[Request, Iterator[Request]]:
        """The request made of ``checked``, with its id (or InvalidRequestError naming the
        problem), and its other samples (``n``), which the iterator makes (each checked as
        it is made) for the caller to append to ``children``: a thousand of them take
        milliseconds, which an ``await``ing caller spreads over several loop turns."""
        requested, prompt, resolved, limits = checked.requested, checked.prompt, checked.resolved, checked.limits
        if checked.off_the_loop:
            seed = self._seeds.getrandbits(32)  # (drawn for every request, as on the loop)
            if requested.seed is None and self.defaults.params.seed is None:
                resolved = resolved.with_seed(seed)
        if request_id is None:
            request_id = self._fresh_id(in_use)
        elif not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError(f"request_id must be a non-empty str, got {request_id!r}", param="request_id")
        elif request_id in in_use:
            raise InvalidRequestError(
                f"request id {request_id!r} is already in use by a live request", param="request_id"
            )
        n = requested.n if requested.n is not None else (self.defaults.params.n or 1)
        if self._max_queue_size and n > self._max_queue_size:
            raise InvalidRequestError(
                f"n ({n}) is more samples than the admission queue holds (max_queue_size {self._max_queue_size})",
                param="n",
            )
        timeout = requested.timeout if requested.timeout is not None else self.defaults.params.timeout
        now = time.perf_counter()
        deadline = None if timeout is None else now + timeout
        grammar = None if resolved.structure is None else self._grammars(limits.vocab_size).state
        request = Request(request_id, prompt, resolved, now, deadline=deadline, text=self._text(prompt, resolved))
        if grammar is not None:
            assert resolved.structure is not None
            request.grammar = grammar(resolved.structure, resolved.stop_token_ids)
        if resolved.penalizes:
            token_history(request)  # its prompt copied now, not in the step that admits it
        return request, self._samples(request, n, grammar, in_use)

    def _samples(
        self,
        request: Request,
        n: int,
        grammar: Callable[[tuple[str, str], frozenset[int]], GrammarState] | None,
        in_use: Container[str],
    ) -> Iterator[Request]:
        """The other ``n - 1`` samples of ``request``, forked from it."""
        resolved = request.params
        for i, child_id in enumerate(sample_ids(request.request_id, n)[1:], 1):
            if child_id in in_use:
                raise InvalidRequestError(
                    f"request id {child_id!r} (a sample of {request.request_id!r}) is already in use",
                    param="request_id",
                )
            # Each sample draws from its own stream: the request's seed plus its index.
            child_params = resolved.with_seed(resolved.seed + i)
            text = self._text(request.prompt_ids, resolved)
            child = Request(
                child_id, request.prompt_ids, child_params, request.arrival_time, deadline=request.deadline, text=text
            )
            child.sample_of = request.request_id
            if grammar is not None:
                assert resolved.structure is not None
                child.grammar = grammar(resolved.structure, resolved.stop_token_ids)
            yield child

    async def precompile(self, requested: SamplingParams, vocab_size: int) -> None:
        """Compile a request's constraint on a worker thread, so that :meth:`build` (on the
        loop) finds it compiled; InvalidRequestError when it does not compile."""
        structure = requested.structure()
        if structure is None or self.grammar_tokenizer is None:
            return  # (build refuses a constraint without a tokenizer)
        if self._grammar_compiler is None:  # (the vocabulary's tables: milliseconds, the import more)
            await asyncio.to_thread(self._grammars, vocab_size)
        grammars = self._grammars(vocab_size)
        if not grammars.is_cached(structure):
            # Long constraints (a schema with an enum of thousands) can take minutes to
            # compile: they queue on a thread of their own, never ahead of a short one nor
            # on the loop's default executor (which tokenizes long prompts).
            lane = 1 if len(structure[1]) > _SHORT_CONSTRAINT else 0
            if self._compilers[lane] is None:
                self._compilers[lane] = ThreadPoolExecutor(1, thread_name_prefix=f"aiocb-grammar-{lane}")
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self._compilers[lane], pausing_call, grammars.compile, structure)

    def _grammars(self, vocab_size: int) -> GrammarCompiler:
        """The compiler of constraints for the model's vocabulary (built on first use, on a
        worker thread by :meth:`precompile`, or here)."""
        assert self.grammar_tokenizer is not None  # (resolve_params refuses a constraint without one)
        with self._grammar_lock:
            if self._grammar_compiler is None:
                # (ended as a request that does not say otherwise ends: the GenerationConfig's
                # EOS tokens, a chat model's <|im_end|> among them, else the model config's)
                configured = self.defaults.params.eos_token_id
                ends = self._default_eos if configured is None else eos_ids(configured)
                self._grammar_compiler = GrammarCompiler(
                    self.grammar_tokenizer, vocab_size, ends, compile_timeout=self._compile_timeout
                )
            return self._grammar_compiler

    def merged(
        self, sampling_params: SamplingParams | None, max_new_tokens: int | None, params: dict[str, Any]
    ) -> SamplingParams:
        """A request's :class:`SamplingParams` with its keyword arguments (which take precedence)."""
        check_sampling_params(sampling_params)
        requested = sampling_params or _NO_PARAMS
        if params:
            return requested.updated(max_new_tokens=max_new_tokens, **params)
        if max_new_tokens is None:
            return requested
        # Callers that add many requests one by one nearly always repeat the last call's
        # parameters (``add_request(prompt, max_new_tokens=n)``): the last merge is kept,
        # as a merge costs about 30 µs (a SamplingParams made and checked). SamplingParams
        # is frozen, so the same object always merges the same way.
        last = self._last_merge
        if last is not None and last[0] is requested and type(max_new_tokens) is int and last[1] == max_new_tokens:
            return last[2]
        merged = requested.updated(max_new_tokens=max_new_tokens)
        self._last_merge = (requested, max_new_tokens, merged)
        return merged

    async def tokenize_bad_words(self, sampling_params: SamplingParams | None, params: dict[str, Any]) -> None:
        """Tokenize a request's ``bad_words`` on a worker thread when there are many (two
        encodes a word: some 40 µs each), so that :meth:`build` finds them tokenized."""
        words = _given("bad_words", sampling_params, params)
        if self.tokenizer is None or not isinstance(words, (list, tuple)) or len(words) <= _BAD_WORDS_ON_THE_LOOP:
            return
        if not all(isinstance(word, str) for word in words):
            return  # (refused by name when the request is built)
        key = tuple(words)
        if key not in self._bad_words:
            try:
                sequences = await asyncio.to_thread(bad_words_ids, key, self.tokenizer)
            except InvalidRequestError:
                return  # (the same refusal when the request is built)
            self._remember_bad_words(key, sequences)

    async def prepare_stops(self, sampling_params: SamplingParams | None, params: dict[str, Any]) -> object:
        """Build the automaton of a request's stop strings on a worker thread when they are
        long (64 of 1,024 characters take some 60 ms); returns it (or None), for the caller
        to hold until it has built the requests that use it (:meth:`build` then finds it)."""
        stop = _given("stop", sampling_params, params)
        if self.tokenizer is None or stop is None or isinstance(stop, Iterator):
            return None  # (none, or an iterator that only the request's build may consume)
        try:
            stops = as_strings(stop, "stop")
        except InvalidRequestError:
            return None  # (the same refusal when the request is built)
        return await prepare_stop_strings(stops)

    def _remember_bad_words(self, words: tuple[str, ...], sequences: list[list[int]]) -> None:
        if len(self._bad_words) >= _BAD_WORDS_KEPT:
            self._bad_words.clear()
        self._bad_words[words] = sequences

    def _with_bad_words_ids(self, requested: SamplingParams) -> SamplingParams:
        """``requested`` with its ``bad_words`` as token sequences, after its ``bad_words_ids``."""
        assert requested.bad_words is not None
        if self.tokenizer is None:
            raise InvalidRequestError(
                "bad_words need a tokenizer: pass tokenizer=... (to aiocb.Manager or aiocb.generate_batch), "
                "or give bad_words_ids",
                param="bad_words",
            )
        words = tuple(requested.bad_words)
        sequences = self._bad_words.get(words)
        if sequences is None:
            sequences = bad_words_ids(words, self.tokenizer)
            self._remember_bad_words(words, sequences)
        return requested.updated(bad_words_ids=[*(requested.bad_words_ids or ()), *sequences])

    def _text(self, prompt: list[int], params: ResolvedParams) -> TextTracker | None:
        if self.tokenizer is None:
            return None
        return TextTracker(
            self.tokenizer,
            prompt,
            stop=params.stop,
            include_stop_str=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens,
            min_tokens=params.min_tokens,
            config_stop=params.config_stop,
        )

    def _fresh_id(self, in_use: Container[str]) -> str:
        while (request_id := f"req_{next(self._ids)}") in in_use:
            pass
        return request_id
