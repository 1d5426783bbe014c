"""``POST /v1/completions``: prompts in, text completions out (whole or streamed)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence, Sized
from contextlib import aclosing
from dataclasses import dataclass
from functools import partial
from typing import Any

from aiocb.detokenize import IncrementalDetokenizer
from aiocb.server.context import INLINE_BODY_BYTES, ServerContext, finite
from aiocb.server.limits import parse_json
from aiocb.server.protocol import DEFAULT_COMPLETION_MAX_TOKENS, CompletionRequest, parse_completion_request
from aiocb.server.serving import (
    ChoiceDelta,
    ChoiceSpec,
    Submission,
    choice_seed,
    engine_params,
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
#: Characters (or token ids) of prompts tokenized in one job of the tokenizer thread: a few
#: milliseconds' work, so that another request's job never waits long behind it.
_JOB_SIZE = 4096


def completion_specs(request: CompletionRequest, prompts: list[Prompt]) -> list[ChoiceSpec]:
    """What each choice asks of the engine."""
    sampling = request.sampling
    max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if sampling.max_tokens is None else sampling.max_tokens
    want_logprobs = request.logprobs is not None
    specs: list[ChoiceSpec] = []
    for p, prompt in enumerate(prompts):
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
                    min_tokens=sampling.min_tokens,
                    include_stop_str_in_output=sampling.include_stop_str_in_output,
                )
            )
    return specs


def parse_completion(ctx: ServerContext, body: bytes) -> CompletionRequest:
    """Parse and check a completions body, its prompts' sizes included (thread-safe: runs
    off the loop when large)."""
    request = parse_completion_request(parse_json(body, ctx.limits.max_json_depth))
    ctx.check_model(request.sampling.model)
    ctx.limits.check_stop(request.sampling.stop)
    ctx.limits.check_choices(len(request.prompts), request.sampling.n)
    many = len(request.prompts) > 1
    for i, prompt in enumerate(request.prompts):
        where = f"prompt[{i}]" if many else "prompt"
        if isinstance(prompt, str):
            ctx.check_prompt_chars(prompt, "prompt", where)
        else:
            ctx.check_prompt_ids(prompt, "prompt", where)
    return request


async def prepare_completion(ctx: ServerContext, body: bytes) -> PreparedCompletion:
    """Parse, check and tokenize a completions body; a large body's work runs in the
    tokenizer thread."""
    request = await ctx.prepare(body, partial(parse_completion, ctx))
    prompts = await tokenize_prompts(ctx, request)
    choices = len(prompts) * request.sampling.n
    inline = choices <= _INLINE_CHOICES
    specs = completion_specs(request, prompts) if inline else await ctx.in_thread(completion_specs, request, prompts)
    return PreparedCompletion(request, prompts, specs)


async def tokenize_prompts(ctx: ServerContext, request: CompletionRequest) -> list[Prompt]:
    """The request's prompts, tokenized (or decoded, to echo them): on the loop when all of
    them together are small, else in the tokenizer thread, a job per few kilobytes of
    prompts so that other requests' jobs come between them (a thousand small prompts
    tokenized on the loop one after another held it for over half a second)."""
    if sum(map(len, request.prompts)) <= INLINE_BODY_BYTES:
        return _tokenize(ctx, request, 0, len(request.prompts))
    prompts: list[Prompt] = []
    for start, stop in _jobs(request.prompts):
        prompts += await ctx.in_thread(_tokenize, ctx, request, start, stop)
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
    prompts: list[Prompt] = []
    for i in range(start, stop):
        prompt = request.prompts[i]
        if isinstance(prompt, str):
            where = f"prompt[{i}]" if many else "prompt"
            ids = ctx.encode(prompt, add_special_tokens=True, param="prompt", where=where)
            offsets = None
            if request.echo and request.logprobs is not None:
                # (the text holds no BOS the tokenizer added, and may hold what decodes otherwise)
                offsets = ctx.char_offsets(prompt, len(ids))
            prompts.append(Prompt(ids, prompt, offsets))
        else:
            prompts.append(Prompt(prompt, ctx.decode(prompt) if request.echo else ""))
    return prompts


class Completion:
    """One completions request from submission to its response or stream."""

    def __init__(self, ctx: ServerContext, prepared: PreparedCompletion, received: float) -> None:
        self.ctx = ctx
        self.request = prepared.request
        self.received = received
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.prompts = prepared.prompts
        self.submission = Submission(ctx, prepared.specs, received)

    async def submit(self) -> None:
        """Queue every choice (or none: the error is raised)."""
        await self.submission.submit()

    async def response(self) -> dict[str, Any]:
        """Run every choice to its end; the whole response body."""
        n = self.request.sampling.n
        choices = [ChoiceDelta(i) for i in range(len(self.submission.specs))]
        try:
            async with aclosing(self.submission.deltas()) as deltas:
                async for delta in deltas:
                    choices[delta.index].extend(delta)
        finally:
            await self.submission.aclose()
        body_choices = []
        for index, choice in enumerate(choices):
            prompt = self.prompts[index // n]
            body_choices.append(
                {
                    "index": index,
                    "text": (prompt.text if self.request.echo else "") + choice.text,
                    "logprobs": self._logprobs(prompt, choice, echo=self.request.echo),
                    "finish_reason": choice.finish_reason,
                    "stop_reason": choice.stop_reason,
                }
            )
        completion_tokens = sum(c.num_generated for c in choices)
        return {**self._header(), "choices": body_choices, "usage": self._usage(completion_tokens)}

    def chunks(self) -> AsyncIterator[dict[str, Any]]:
        """The stream's chunks (after :meth:`submit`)."""
        return self.submission.closing(self._chunks())

    async def _chunks(self) -> AsyncGenerator[dict[str, Any]]:
        n = self.request.sampling.n
        echoed: set[int] = set()
        generated = [0] * len(self.submission.specs)
        want_logprobs = self.request.logprobs is not None
        async with aclosing(self.submission.deltas()) as deltas:
            async for delta in deltas:
                generated[delta.index] = delta.num_generated
                prompt = self.prompts[delta.index // n]
                text = delta.text
                echo = self.request.echo and delta.index not in echoed
                if echo:
                    echoed.add(delta.index)
                    text = prompt.text + text
                elif not text and delta.finish_reason is None and not (want_logprobs and delta.token_ids):
                    continue
                yield {
                    **self._header(),
                    "choices": [
                        {
                            "index": delta.index,
                            "text": text,
                            "logprobs": self._logprobs(prompt, delta, echo=echo),
                            "finish_reason": delta.finish_reason,
                            "stop_reason": delta.stop_reason,
                        }
                    ],
                }
        if self.request.sampling.include_usage:
            yield {**self._header(), "choices": [], "usage": self._usage(sum(generated))}

    def _header(self) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.ctx.model_name}

    def _usage(self, completion_tokens: int) -> dict[str, Any]:
        return self.submission.usage(completion_tokens)

    def _logprobs(self, prompt: Prompt, choice: ChoiceDelta, *, echo: bool) -> dict[str, Any] | None:
        """Completions-style logprobs: the prompt's first when ``echo``, then the generated tokens'."""
        if self.request.logprobs is None:
            return None
        ctx = self.ctx
        top_n = self.request.logprobs
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top_logprobs: list[dict[str, float] | None] = []
        text_offset: list[int] = []
        base = len(prompt.text) if self.request.echo else 0
        if echo:
            ids = prompt.ids
            scores = choice.prompt_logprobs or [None] * len(ids)
            tops = choice.prompt_top_logprobs or [None] * len(ids)
            if prompt.offsets is not None:
                text_offset += prompt.offsets
            else:
                detokenizer = IncrementalDetokenizer(ctx.tokenizer, skip_special_tokens=False)
                for token_id in ids:
                    text_offset.append(detokenizer.num_chars)
                    detokenizer.add(token_id)
            for position, token_id in enumerate(ids):
                tokens.append(ctx.token_text(token_id))
                score = scores[position] if position < len(scores) else None
                token_logprobs.append(None if score is None else finite(score))
                top = tops[position] if position < len(tops) else None
                top_logprobs.append(None if score is None else _top_dict(ctx, top, token_id, score, top_n))
        for token_id, score, top, at in zip(
            choice.token_ids, choice.logprobs, choice.top_logprobs, choice.text_offsets, strict=False
        ):
            tokens.append(ctx.token_text(token_id))
            token_logprobs.append(finite(score))
            top_logprobs.append(_top_dict(ctx, top, token_id, score, top_n))
            text_offset.append(base + at)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": text_offset,
        }


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
