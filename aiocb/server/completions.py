"""``POST /v1/completions``: prompts in, text completions out (whole or streamed)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence, Sized
from contextlib import aclosing, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import orjson

from aiocb.collector import full_collections_deferred
from aiocb.detokenize import IncrementalDetokenizer
from aiocb.engine.turns import LoopTurn, release
from aiocb.sampling import check_truncation, truncated_prompt
from aiocb.server import sse
from aiocb.server.bodies import Chain, Uneven, array_items
from aiocb.server.context import INLINE_BODY_BYTES, LARGE_BODY_BYTES, ServerContext, finite
from aiocb.server.edge import AccessRecord
from aiocb.server.limits import parse_json
from aiocb.server.protocol import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    CompletionRequest,
    bad_request,
    parse_completion_request,
)
from aiocb.server.serving import (
    ChoiceDelta,
    ChoiceSpec,
    Submission,
    choice_seed,
    engine_params,
    name_response,
)


@dataclass(slots=True)
class Prompt:
    """One prompt of a completions request, tokenized."""

    ids: list[int]
    #: what ``echo`` puts before the completion
    text: str
    #: where each of ``ids`` starts in ``text``, for echoed logprobs of a text prompt (None:
    #: found by decoding ``ids``, which ``text`` then is)
    offsets: list[int] | None = None


@dataclass(frozen=True, slots=True)
class PreparedCompletion:
    """A completions body parsed, checked and tokenized (see :func:`prepare_completion`)."""

    request: CompletionRequest
    prompts: list[Prompt]
    #: one per choice: the prompts' ``n`` choices in turn
    specs: list[ChoiceSpec]


#: Choices whose specs are made on the event loop (a few microseconds each); more are made
#: in the tokenizer thread.
_INLINE_CHOICES = 128
#: How an echoed array is made of the prompt's part and the generated tokens' part.
_Join = Callable[[list[Any], list[Any], LoopTurn], Awaitable[Any]]
#: Characters (or token ids) of prompts tokenized in one job of the tokenizer thread: a few
#: milliseconds' work, so that another request's job never waits long behind it.
_JOB_SIZE = 4096


def completion_specs(ctx: ServerContext, request: CompletionRequest, prompts: list[Prompt]) -> list[ChoiceSpec]:
    """What each choice asks of the engine."""
    sampling = request.sampling
    want_logprobs = request.logprobs is not None
    specs: list[ChoiceSpec] = []
    for p, prompt in enumerate(prompts):
        field = f"prompt[{p}]" if len(prompts) > 1 else "prompt"
        max_tokens = sampling.max_tokens
        if max_tokens is None:
            # (OpenAI's default, within the model's cap; a length the client never gave gives
            # way to its own min_tokens, as a chat's does)
            max_tokens = DEFAULT_COMPLETION_MAX_TOKENS
            capped = ctx.config_max_tokens(len(prompt.ids), field, sampling.min_tokens)
            if capped is not None:
                max_tokens = min(max_tokens, capped)
            max_tokens = max(max_tokens, sampling.min_tokens or 0)
        if max_tokens == 0:
            _check_scored_length(ctx, len(prompt.ids), field)
        for j in range(sampling.n):
            params = engine_params(
                sampling,
                seed=choice_seed(sampling, j),
                logprobs=want_logprobs,
                top_logprobs=request.logprobs or 0,
                prompt_logprobs=want_logprobs and request.echo,
                score_only=max_tokens == 0,
            )
            specs.append(
                ChoiceSpec(
                    index=p * sampling.n + j,
                    prompt_ids=prompt.ids,
                    max_tokens=max_tokens,
                    params=params,
                    stop=sampling.stop,
                    skip_special_tokens=sampling.skip_special_tokens,
                    min_tokens=ctx.min_tokens(sampling, len(prompt.ids)),
                    include_stop_str_in_output=sampling.include_stop_str_in_output,
                )
            )
    return specs


def _check_scored_length(ctx: ServerContext, length: int, where: str) -> None:
    """Refuse a prompt that ``max_tokens`` 0 cannot score: the engine samples a token after
    every prompt (which the choice leaves out), so the prompt must leave it a position."""
    limit = ctx.max_model_len
    if limit is not None and length >= limit:
        raise bad_request(
            f"{where} ({length} tokens) fills the model's context length of {limit}: max_tokens 0 scores "
            f"prompts of at most {limit - 1} tokens",
            "prompt",
        )


def parse_completion(ctx: ServerContext, body: bytes) -> CompletionRequest:
    """Parse and check a completions body, its prompts' sizes included (thread-safe: runs
    off the loop when large)."""
    request = parse_completion_request(parse_json(body, ctx.limits.max_json_depth), ctx.defaults)
    ctx.check_model(request.sampling.model)
    ctx.limits.check_stop(request.sampling.stop)
    ctx.limits.check_token_ids(request.sampling)
    request = dataclasses.replace(request, sampling=ctx.with_bad_words(request.sampling))
    ctx.check_choices(len(request.prompts), request.sampling.n)
    many = len(request.prompts) > 1
    keep = request.sampling.truncate_prompt_tokens
    check_truncation(keep, ctx.max_model_len)  # (before a long text is tokenized)
    for i, prompt in enumerate(request.prompts):
        where = f"prompt[{i}]" if many else "prompt"
        if isinstance(prompt, str):
            if keep is None:  # (else cut once tokenized; the body's size bounds the work)
                ctx.check_prompt_chars(prompt, "prompt", where)
        else:
            ctx.check_prompt_ids(truncated_prompt(prompt, keep, ctx.max_model_len), "prompt", where)
    return request


async def prepare_completion(ctx: ServerContext, body: bytes) -> PreparedCompletion:
    """Parse, check and tokenize a completions body; a large body's work runs in a
    tokenizer thread."""
    large = len(body) > LARGE_BODY_BYTES
    # (a large body's value lives from its parsing to its last job: no full collection walks it between)
    with full_collections_deferred() if large else nullcontext():
        request = await ctx.prepare(body, partial(parse_completion, ctx))
        prompts = await tokenize_prompts(ctx, request, large=large)
        ctx.check_queued_tokens([len(prompt.ids) for prompt in prompts])
        if request.echo and request.logprobs is not None:
            ctx.limits.check_echo_logprobs(sum(len(p.ids) for p in prompts), request.logprobs, request.sampling.n)
        choices = len(prompts) * request.sampling.n
        inline = choices <= _INLINE_CHOICES
        specs = (
            completion_specs(ctx, request, prompts)
            if inline
            else await ctx.in_thread(completion_specs, ctx, request, prompts, large=large)
        )
    return PreparedCompletion(request, prompts, specs)


async def tokenize_prompts(ctx: ServerContext, request: CompletionRequest, *, large: bool) -> list[Prompt]:
    """The request's prompts, tokenized (or decoded, to echo them): on the loop when all of
    them together are small, else in a tokenizer thread (that of large bodies when
    ``large``), a job per few kilobytes of prompts so that other requests' jobs come
    between them (a thousand small prompts tokenized on the loop one after another held
    it for over half a second)."""
    if sum(map(len, request.prompts)) <= INLINE_BODY_BYTES:
        return _tokenize(ctx, request, 0, len(request.prompts))
    prompts: list[Prompt] = []
    for start, stop in _jobs(request.prompts):
        prompts += await ctx.in_thread(_tokenize, ctx, request, start, stop, large=large)
    return prompts


def _jobs(prompts: Sequence[Sized]) -> list[tuple[int, int]]:
    """``prompts`` cut into runs of at most :data:`_JOB_SIZE` in all (a larger prompt alone)."""
    jobs: list[tuple[int, int]] = []
    start = size = 0
    for i, prompt in enumerate(prompts):
        if i > start and size + len(prompt) > _JOB_SIZE:
            jobs.append((start, i))
            start, size = i, 0
        size += len(prompt)
    if start < len(prompts):
        jobs.append((start, len(prompts)))
    return jobs


def _tokenize(ctx: ServerContext, request: CompletionRequest, start: int, stop: int) -> list[Prompt]:
    """Prompts ``start`` to ``stop`` of the request, tokenized (thread-safe)."""
    many = len(request.prompts) > 1
    keep = request.sampling.truncate_prompt_tokens
    prompts: list[Prompt] = []
    for i in range(start, stop):
        prompt = request.prompts[i]
        if isinstance(prompt, str):
            where = f"prompt[{i}]" if many else "prompt"
            ids, total = ctx.encode_prompt(prompt, add_special_tokens=True, param="prompt", where=where, keep=keep)
            if len(ids) < total:  # (the echo is of the tokens kept)
                prompts.append(Prompt(ids, ctx.decode(ids) if request.echo else ""))
                continue
            offsets = None
            if request.echo and request.logprobs is not None:
                # (the text holds no BOS the tokenizer added, and may hold what decodes otherwise)
                offsets = ctx.char_offsets(prompt, len(ids))
            prompts.append(Prompt(ids, prompt, offsets))
        else:
            kept = truncated_prompt(prompt, keep, ctx.max_model_len)
            prompts.append(Prompt(kept, ctx.decode(kept) if request.echo else ""))
    return prompts


class Completion:
    """One completions request from submission to its response or stream."""

    def __init__(self, ctx: ServerContext, prepared: PreparedCompletion, received: float, record: AccessRecord) -> None:
        self.ctx = ctx
        self.request = prepared.request
        self.received = received
        self.id = f"cmpl-{name_response(prepared.request.sampling, record)}"
        self.created = int(time.time())
        self.prompts = prepared.prompts
        self.submission = Submission(ctx, prepared.specs, received)
        self.submission.record = record
        #: the echoed logprobs last made for each prompt, by its index
        self._echoes: dict[int, _Echo] = {}
        #: the echoed arrays written for the event stream, by id (kept: no id is reused)
        self._event_parts: dict[int, tuple[list[Any], bytes]] = {}

    async def submit(self) -> None:
        """Queue every choice (or none: the error is raised)."""
        await self.submission.submit()

    async def response(self) -> dict[str, Any]:
        """Run every choice to its end; the whole response body (its arrays of echoed
        logprobs are :class:`Chain` values: a prompt's part is shared by its choices)."""
        choices = [ChoiceDelta(i) for i in range(len(self.submission.specs))]
        turn = LoopTurn()
        try:
            async with aclosing(self.submission.deltas()) as deltas:
                async for delta in deltas:
                    choices[delta.index].extend(delta)
                    await turn.give()  # (deltas that came together are taken without a wait)
        finally:
            await self.submission.aclose()
        # (a comprehension's variables go with it: nothing here holds a choice after the release)
        body_choices = Uneven([await self._body_choice(index, choice, turn) for index, choice in enumerate(choices)])
        completion_tokens = sum(c.num_generated for c in choices)
        await release(choices)  # (what the body was made of: freed a slice of the loop at a time)
        return {**self._header(), "choices": body_choices, "usage": self._usage(completion_tokens)}

    async def _body_choice(self, index: int, choice: ChoiceDelta, turn: LoopTurn) -> dict[str, Any]:
        prompt = self.prompts[index // self.request.sampling.n]
        return {
            "index": index,
            "text": (prompt.text if self.request.echo else "") + choice.text,
            "logprobs": await self._logprobs(choice, turn, echo=self.request.echo, join=_chain),
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
        }

    def chunks(self) -> AsyncIterator[dict[str, Any]]:
        """The stream's chunks (after :meth:`submit`)."""
        return self.submission.closing(self._chunks())

    async def _chunks(self) -> AsyncGenerator[dict[str, Any]]:
        n = self.request.sampling.n
        echoed: set[int] = set()
        generated = [0] * len(self.submission.specs)
        want_logprobs = self.request.logprobs is not None
        continuous_usage = self.request.sampling.continuous_usage
        turn = LoopTurn()
        async with aclosing(self.submission.deltas()) as deltas:
            async for delta in deltas:
                await turn.give()  # (deltas that came together are taken without a wait)
                generated[delta.index] = delta.num_generated
                prompt = self.prompts[delta.index // n]
                text = delta.text
                echo = self.request.echo and delta.index not in echoed
                if echo:
                    echoed.add(delta.index)
                    text = prompt.text + text
                elif not text and delta.finish_reason is None and not (want_logprobs and delta.token_ids):
                    continue
                chunk = {
                    **self._header(),
                    "choices": [
                        {
                            "index": delta.index,
                            "text": text,
                            "logprobs": await self._logprobs(delta, turn, echo=echo, join=self._event_array),
                            "finish_reason": delta.finish_reason,
                            "stop_reason": delta.stop_reason,
                        }
                    ],
                }
                if continuous_usage:  # (vLLM's continuous_usage_stats: the choice's usage so far)
                    chunk["usage"] = self.submission.choice_usage(delta.index, delta.num_generated)
                yield chunk
        if self.request.sampling.include_usage:
            yield {**self._header(), "choices": [], "usage": self._usage(sum(generated))}

    def _header(self) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.ctx.model_name}

    def _usage(self, completion_tokens: int) -> dict[str, Any]:
        return self.submission.usage(completion_tokens)

    async def _logprobs(self, choice: ChoiceDelta, turn: LoopTurn, *, echo: bool, join: _Join) -> dict[str, Any] | None:
        """Completions-style logprobs: the prompt's first when ``echo`` (each array the
        prompt's part and the generated tokens' put together by ``join``), then the
        generated tokens'."""
        if self.request.logprobs is None:
            return None
        ctx = self.ctx
        top_n = self.request.logprobs
        prompt_index = choice.index // self.request.sampling.n
        base = len(self.prompts[prompt_index].text) if self.request.echo else 0
        generated = _Logprobs()
        for token_id, score, top, at in zip(
            choice.token_ids, choice.logprobs, choice.top_logprobs, choice.text_offsets, strict=False
        ):
            generated.tokens.append(ctx.token_text(token_id))
            generated.token_logprobs.append(finite(score))
            generated.top_logprobs.append(_top_dict(ctx, top, token_id, score, top_n))
            generated.text_offset.append(base + at)
            await turn.give()
        if not echo:
            return generated.as_dict()
        echoed = await self._echoed(prompt_index, choice, turn)
        return {name: await join(getattr(echoed, name), part, turn) for name, part in generated.as_dict().items()}

    async def _event_array(self, prompt_part: list[Any], generated: list[Any], turn: LoopTurn) -> orjson.Fragment:
        """The array of a streamed chunk that echoes the prompt, as the event stream writes
        it: the prompt's part is written once, a slice of the loop at a time, for all its
        choices (a prompt of thousands of tokens with twenty alternatives each is megabytes
        of JSON: written whole with each chunk, it held the loop for tens of milliseconds)."""
        written = self._event_parts.get(id(prompt_part))
        if written is None:
            written = (prompt_part, b"".join(await array_items(prompt_part, sse.dumps, turn)))
            self._event_parts[id(prompt_part)] = written
        items = [written[1]] if prompt_part else []
        if generated:
            items.append(sse.dumps(generated)[1:-1])
        return orjson.Fragment(b"[" + b",".join(items) + b"]")

    async def _echoed(self, prompt_index: int, choice: ChoiceDelta, turn: LoopTurn) -> _Echo:
        """The prompt's echoed logprobs for ``choice``: those made for an earlier choice of the
        prompt when its prompt logprobs are the same (as they are for the ``n`` choices of a
        prompt, each of which scores it), made a slice of the loop at a time otherwise."""
        made = self._echoes.get(prompt_index)
        scores, tops = choice.prompt_logprobs, choice.prompt_top_logprobs
        if made is not None and await _same(made.scores, scores, turn) and await _same(made.tops, tops, turn):
            return made
        prompt = self.prompts[prompt_index]
        echo = _Echo(scores=scores, tops=tops)
        await self._score(echo, prompt.ids, turn)
        if made is not None:  # (the tokens and their offsets are the prompt's alone)
            echo.tokens, echo.text_offset = made.tokens, made.text_offset
        else:
            echo.tokens = await self._token_texts(prompt.ids, turn)
            echo.text_offset = prompt.offsets if prompt.offsets is not None else await self._offsets(prompt, turn)
        self._echoes[prompt_index] = echo
        return echo

    async def _token_texts(self, ids: list[int], turn: LoopTurn) -> list[str]:
        texts: list[str] = []
        for token_id in ids:
            texts.append(self.ctx.token_text(token_id))
            await turn.give()
        return texts

    async def _offsets(self, prompt: Prompt, turn: LoopTurn) -> list[int]:
        """Where each of the prompt's tokens starts in the text they decode to."""
        offsets: list[int] = []
        detokenizer = IncrementalDetokenizer(self.ctx.tokenizer, skip_special_tokens=False)
        for token_id in prompt.ids:
            detokenizer.add(token_id)
            offsets.append(detokenizer.last_start)
            await turn.give()
        return offsets

    async def _score(self, echo: _Echo, ids: list[int], turn: LoopTurn) -> None:
        """Fill ``echo``'s logprobs of the prompt's tokens from the engine's."""
        scores = echo.scores or [None] * len(ids)
        tops = echo.tops or [None] * len(ids)
        top_n = self.request.logprobs or 0
        for position, token_id in enumerate(ids):
            score = scores[position] if position < len(scores) else None
            echo.token_logprobs.append(None if score is None else finite(score))
            top = tops[position] if position < len(tops) else None
            echo.top_logprobs.append(None if score is None else _top_dict(self.ctx, top, token_id, score, top_n))
            await turn.give()


@dataclass(slots=True)
class _Logprobs:
    """The four arrays of completions-style logprobs."""

    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, list[Any]]:
        """The arrays by name, in the format's order."""
        names = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
        return {name: getattr(self, name) for name in names}


@dataclass(slots=True)
class _Echo(_Logprobs):
    """A prompt's echoed logprobs, made of the engine's prompt logprobs ``scores`` and ``tops``."""

    scores: list[float | None] | None = None
    tops: list[dict[int, float] | None] | None = None


async def _chain(prompt_part: list[Any], generated: list[Any], turn: LoopTurn) -> Chain:
    return Chain((prompt_part, generated))


#: Positions of two choices' prompt logprobs compared in one go.
_COMPARED = 256


async def _same(a: list[Any] | None, b: list[Any] | None, turn: LoopTurn) -> bool:
    """Whether ``a == b``, compared a slice of the loop at a time (thousands of positions
    with twenty alternatives each take milliseconds)."""
    if a is b:
        return True
    if a is None or b is None or len(a) != len(b):
        return False
    for start in range(0, len(a), _COMPARED):
        if a[start : start + _COMPARED] != b[start : start + _COMPARED]:
            return False
        await turn.give()
    return True


def _top_dict(
    ctx: ServerContext, alternatives: dict[int, float] | None, token_id: int, logprob: float, top_n: int
) -> dict[str, float]:
    """``{token text: logprob}`` of the alternatives plus the chosen token (as vLLM does).

    Two ids with the same text keep the higher logprob, so ``max(values)`` is the greedy
    choice's and lm-eval's ``is_greedy`` check stays right.
    """
    result: dict[str, float] = {}
    items = list((alternatives or {}).items())[:top_n]
    for tid, score in [*items, (token_id, logprob)]:
        text = ctx.token_text(tid)
        if text not in result or score > result[text]:
            result[text] = finite(score)
    return result
