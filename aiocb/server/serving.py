"""Requests to the manager and their outputs as text deltas, shared by both endpoints.

A *choice* is one request to the manager. :func:`submit_choices` queues all the choices of
an HTTP request at once, or none (``add_request_nowait``: a full admission queue is a
429, not a wait). :func:`choice_deltas` turns one choice's stream into
:class:`ChoiceDelta` values: new text (detokenized incrementally, stop strings held back
and trimmed), the tokens behind it with their logprobs, and at the end a finish reason.
Leaving the iteration early (a stop string, a client that went away) closes the stream,
which cancels the request and frees its blocks at once.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from aiocb.detokenize import IncrementalDetokenizer, StopStringMatcher
from aiocb.engine.requests import sample_ids
from aiocb.engine.turns import LoopTurn, release
from aiocb.errors import RequestAbortedError
from aiocb.outputs import FinishReason, GenerationOutput, RequestStatus
from aiocb.server.context import ServerContext
from aiocb.server.edge import AccessRecord
from aiocb.server.protocol import APIError, SamplingRequest, bad_request
from aiocb.server.remote import OutputStream, RemoteManager, RemoteStream, ServedEngine
from aiocb.stop_strings import prepare_stop_strings

_FINISH_REASONS = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.TIMEOUT: "length",
    FinishReason.CANCELLED: "abort",
    FinishReason.ABORTED: "abort",
}


@dataclass(frozen=True, slots=True)
class ChoiceSpec:
    """One request to submit."""

    index: int
    prompt_ids: list[int]
    #: tokens to generate; 0 scores the prompt only (one token is generated and dropped)
    max_tokens: int
    params: dict[str, Any]
    stop: tuple[str, ...]
    skip_special_tokens: bool
    #: stop strings are looked for once this many tokens were generated
    min_tokens: int = 0
    include_stop_str_in_output: bool = False


@dataclass(slots=True)
class ChoiceDelta:
    """What one choice adds in one step; the last one carries ``finish_reason``."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    #: logprob of each of ``token_ids`` (when asked for)
    logprobs: list[float] = field(default_factory=list)
    #: most likely alternatives at each of ``token_ids`` (when asked for)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    #: character offset of each of ``token_ids`` in the choice's generated text
    text_offsets: list[int] = field(default_factory=list)
    #: set on the first delta when prompt logprobs were asked for
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[dict[int, float] | None] | None = None
    finish_reason: str | None = None
    #: with ``finish_reason`` "stop": the stop string or the requested stop token id that
    #: ended the choice (None: an end-of-sequence token, or another reason), as vLLM says
    stop_reason: int | str | None = None
    #: tokens generated so far by the choice (usage)
    num_generated: int = 0
    #: prompt tokens the choice found in the prefix cache (usage)
    num_cached_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        """Whether the delta carries nothing worth sending."""
        return not self.text and not self.token_ids and self.finish_reason is None and self.prompt_logprobs is None

    def extend(self, later: ChoiceDelta) -> None:
        """Append what a later delta of the same choice adds (a whole choice from its deltas)."""
        self.text += later.text
        self.token_ids += later.token_ids
        self.logprobs += later.logprobs
        self.top_logprobs += later.top_logprobs
        self.text_offsets += later.text_offsets
        if later.prompt_logprobs is not None:
            self.prompt_logprobs = later.prompt_logprobs
            self.prompt_top_logprobs = later.prompt_top_logprobs
        self.finish_reason = later.finish_reason or self.finish_reason
        self.stop_reason = later.stop_reason if later.stop_reason is not None else self.stop_reason
        self.num_generated = later.num_generated
        self.num_cached_tokens = later.num_cached_tokens


def engine_params(
    sampling: SamplingRequest,
    *,
    seed: int | None,
    logprobs: bool,
    top_logprobs: int,
    prompt_logprobs: bool,
    score_only: bool,
) -> dict[str, Any]:
    """``Manager.add_request`` keyword arguments for one choice."""
    greedy = sampling.temperature == 0.0
    params: dict[str, Any] = {
        "do_sample": not greedy,
        "temperature": 0.0 if greedy else sampling.temperature,
        "return_logprobs": logprobs,
        "top_logprobs": top_logprobs if logprobs else 0,
        "prompt_logprobs": prompt_logprobs,
    }
    if not greedy:  # (greedy takes the most likely token: the server's defaults for them filter nothing)
        params |= {"top_p": sampling.top_p, "top_k": sampling.top_k}
    if seed is not None:
        params["seed"] = seed
    if sampling.ignore_eos or score_only:
        params["eos_token_id"] = []
    elif sampling.eos_token_ids is not None:
        params["eos_token_id"] = list(sampling.eos_token_ids)
    if sampling.stop_token_ids:
        params["stop_token_ids"] = list(sampling.stop_token_ids)
    if sampling.min_tokens is not None:  # (an explicit 0 too: it overrides the model's min_new_tokens)
        params["min_tokens"] = sampling.min_tokens
    params.update(sampling.controls)
    return params


def choice_seed(sampling: SamplingRequest, choice: int) -> int | None:
    """The seed of the ``choice``-th sample of a prompt: distinct, derived from the request's seed."""
    if sampling.seed is None:
        return None
    return sampling.seed + choice


async def submit_choices(manager: ServedEngine, specs: Sequence[ChoiceSpec]) -> list[OutputStream]:
    """Queue every choice without waiting for room, or none of them (the error is raised)."""
    if isinstance(manager, RemoteManager):
        return await _submit_remote(manager, specs)
    streams: list[OutputStream] = []
    turn = LoopTurn()  # (a thousand prompts take about 75 ms to queue: given a slice at a time)
    try:
        # The choices of one prompt are one request with n samples: the prompt is computed once.
        for group in _by_prompt(specs):
            await turn.give()
            first = group[0]
            # (n always: a model's generation config may give num_return_sequences)
            params = {**first.params, "n": len(group)}
            # (a constraint compiled off the loop, many samples made a slice at a time)
            rid = await manager.add_request(
                first.prompt_ids, max_new_tokens=max(first.max_tokens, 1), wait=False, **params
            )
            streams += [manager.stream(sample) for sample in sample_ids(rid, len(group))]
    except BaseException:
        for stream in streams:
            await stream.aclose()  # cancels the request
        raise
    return streams


def _by_prompt(specs: Sequence[ChoiceSpec]) -> list[list[ChoiceSpec]]:
    """Consecutive choices of one prompt (they differ only by their seeds: ``seed + i``)."""
    groups: list[list[ChoiceSpec]] = []
    for spec in specs:
        if groups and groups[-1][0].prompt_ids is spec.prompt_ids:
            groups[-1].append(spec)
        else:
            groups.append([spec])
    return groups


async def _submit_remote(manager: RemoteManager, specs: Sequence[ChoiceSpec]) -> list[OutputStream]:
    """The choices queued in the engine process, a frame a prompt, started 16 a loop turn
    (each first step pickles and writes its frame: 3,000 at once held the loop)."""
    groups = _by_prompt(specs)
    openings: list[asyncio.Task[list[RemoteStream]]] = []
    try:
        for start in range(0, len(groups), _STARTED_PER_TURN):
            for g in groups[start : start + _STARTED_PER_TURN]:
                opening = manager.open_streams(g[0].prompt_ids, max(g[0].max_tokens, 1), len(g), **g[0].params)
                openings.append(asyncio.create_task(opening))
            await asyncio.sleep(0)
        opened = await asyncio.gather(*openings, return_exceptions=True)
    except BaseException:
        # (cancelled while they open, say by a forced shutdown: those open already are
        # closed now, which cancels their requests, not when the garbage is collected)
        for task in openings:
            task.cancel()
        for remote in await _opened(openings):
            await remote.aclose()
        raise
    streams: list[OutputStream] = list(_succeeded(opened))
    errors = [error for error in opened if isinstance(error, BaseException)]
    if errors:
        for stream in streams:
            await stream.aclose()
        raise errors[0]
    return streams


async def _opened(openings: Sequence[asyncio.Task[list[RemoteStream]]]) -> list[RemoteStream]:
    """The streams of the openings that succeeded (waiting for the others to end)."""
    return _succeeded(await asyncio.gather(*openings, return_exceptions=True))


def _succeeded(opened: Sequence[list[RemoteStream] | BaseException]) -> list[RemoteStream]:
    """The streams of the openings that did not fail."""
    return [stream for group in opened if not isinstance(group, BaseException) for stream in group]


def name_response(sampling: SamplingRequest, record: AccessRecord) -> str:
    """The request's name, which its response's id is made from, as vLLM makes it: the
    client's ``X-Request-Id`` when it sent a sane one, else the body's ``request_id`` (which
    then names the request in the ``X-Request-Id`` response header and the access log
    too: ``record`` is changed), else the fresh id the record has."""
    if not record.from_client and sampling.request_id is not None:
        record.request_id = sampling.request_id
    if not record.request_id:  # (a record made outside the edge middleware)
        record.request_id = uuid.uuid4().hex
    return record.request_id


class Submission:
    """The choices of one HTTP request: queued together, iterated together, closed together."""

    def __init__(self, ctx: ServerContext, specs: Sequence[ChoiceSpec], received: float) -> None:
        self.ctx = ctx
        self.specs = list(specs)
        self.received = received
        #: the access log's record of the HTTP request: the token counts go there
        self.record = AccessRecord("")
        self._streams: list[OutputStream] = []
        #: per choice, the prompt tokens it found in the prefix cache
        self._cached = [0] * len(self.specs)

    async def submit(self) -> None:
        """Queue every choice, or raise (nothing queued) when one is refused."""
        self._streams = await submit_choices(self.ctx.manager, self.specs)
        prompts = {id(spec.prompt_ids): len(spec.prompt_ids) for spec in self.specs}
        self.record.prompt_tokens = sum(prompts.values())
        self.ctx.metrics.prompt_tokens.inc(self.record.prompt_tokens)  # (a prompt once, whatever its choices)

    async def deltas(self) -> AsyncGenerator[ChoiceDelta]:
        """The deltas of all choices as they come (see :func:`choice_deltas`)."""
        iterators = [
            choice_deltas(self.ctx, spec, stream, self.received)
            for spec, stream in zip(self.specs, self._streams, strict=True)
        ]
        record = self.record
        async with aclosing(merge_deltas(iterators)) as merged:
            async for delta in merged:
                record.completion_tokens += len(delta.token_ids)
                self._cached[delta.index] = delta.num_cached_tokens
                yield delta

    def usage(self, completion_tokens: int) -> dict[str, Any]:
        """The response's ``usage``. A prompt's cached tokens are those its least lucky choice
        found in the prefix cache: the others of an ``n`` > 1 request may reuse its blocks."""
        cached: dict[int, int] = {}
        prompts: dict[int, int] = {}
        for spec in self.specs:
            key = id(spec.prompt_ids)
            prompts[key] = len(spec.prompt_ids)
            cached[key] = min(cached.get(key, self._cached[spec.index]), self._cached[spec.index])
        prompt_tokens = sum(prompts.values())
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(cached.values())},
        }

    def choice_usage(self, index: int, completion_tokens: int) -> dict[str, int]:
        """Choice ``index``'s usage so far, as vLLM's ``continuous_usage_stats`` gives it in
        each chunk: its prompt's tokens and the ``completion_tokens`` it has generated."""
        prompt_tokens = len(self.specs[index].prompt_ids)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    async def aclose(self) -> None:
        """Cancel whatever has not finished, and let go of the streams (idempotent).

        All are closed first (a cancellation of this coroutine never leaves one running),
        then let go of one at a time, a slice of the loop at a time: each holds its request,
        whose logprobs (a long prompt's, twenty alternatives a token) are millions of
        objects across a request's choices, freed all at once in tens of milliseconds.
        """
        for stream in self._streams:
            await stream.aclose()
        await release(self._streams)

    async def closing(self, chunks: AsyncGenerator[dict[str, Any]]) -> AsyncGenerator[dict[str, Any]]:
        """Yield a response's ``chunks``, then close them and cancel whatever has not finished
        (also when the client goes away mid-stream)."""
        try:
            async with aclosing(chunks) as stream:
                async for chunk in stream:
                    yield chunk
        finally:
            await self.aclose()


async def choice_deltas(
    ctx: ServerContext, spec: ChoiceSpec, stream: OutputStream, received: float
) -> AsyncGenerator[ChoiceDelta]:
    """The deltas of one choice; ``received`` is when the HTTP request arrived (perf_counter)."""
    detokenizer = IncrementalDetokenizer(
        ctx.tokenizer, spec.prompt_ids, skip_special_tokens=spec.skip_special_tokens, release_ahead=bool(spec.stop)
    )
    prepared = await prepare_stop_strings(spec.stop)
    stopper = StopStringMatcher(spec.stop, min_tokens=spec.min_tokens, include=spec.include_stop_str_in_output)
    del prepared  # (held until the matcher holds it)
    metrics = ctx.metrics
    score_only = spec.max_tokens == 0
    seen = 0
    first = True
    last_time = received
    counted = False
    try:
        async with stream:
            async for output in stream:
                now = time.perf_counter()
                delta = ChoiceDelta(spec.index)
                if first:
                    delta.prompt_logprobs = output.prompt_logprobs
                    delta.prompt_top_logprobs = output.prompt_top_logprobs
                new = [] if score_only else output.tokens_since(seen)
                _add_tokens(delta, output, new, seen, detokenizer, stopper, spec.include_stop_str_in_output)
                returned = len(delta.token_ids)  # (tokens past a stop string are not)
                if returned:
                    metrics.generation_tokens.inc(returned)
                    if seen == 0:
                        metrics.time_to_first_token.observe(now - received)
                        metrics.observe_inter_token(returned - 1, 0.0)  # (the rest came with it)
                    else:
                        metrics.observe_inter_token(returned, now - last_time)
                    last_time = now
                seen += returned
                delta.num_generated = seen
                delta.num_cached_tokens = output.num_cached_tokens
                first = False
                if stopper.matched is not None:
                    delta.finish_reason = "stop"
                    delta.stop_reason = stopper.matched
                elif output.is_finished():
                    _check_failed(output, ctx.manager.is_dead)
                    delta.text += stopper.feed(detokenizer.flush())
                    delta.text += stopper.flush()
                    delta.finish_reason = "stop" if stopper.matched is not None else _finish_reason(output, score_only)
                    delta.stop_reason = stopper.matched or _stop_token(spec, output)
                if delta.finish_reason is not None:
                    metrics.e2e_latency.observe(now - received)
                    metrics.observe_finished(delta.finish_reason)
                    counted = True
                    yield delta
                    return  # leaving `async with stream` cancels a request cut short by a stop string
                if not delta.is_empty:
                    yield delta
    except (GeneratorExit, asyncio.CancelledError, RequestAbortedError):
        # Closed, cancelled or aborted before it finished (its client gone, a sibling choice
        # failed, the server stopping): counted as finished for "abort", as vLLM counts it.
        if not counted:
            metrics.observe_finished("abort")
        raise


def _add_tokens(
    delta: ChoiceDelta,
    output: GenerationOutput,
    new: list[int],
    start: int,
    detokenizer: IncrementalDetokenizer,
    stopper: StopStringMatcher,
    include_stop_str: bool,
) -> None:
    logprobs = output.logprobs
    top = output.top_logprobs
    # The text of the stop token that ended the output is left out, as a stop string is;
    # or kept whole, with the text held, a stop string in it not ending the output first.
    last = len(output.generated_tokens) - 1 if _ended_by_token(output) else -1
    for position, token_id in enumerate(new, start=start):
        if position != last:
            text = detokenizer.add(token_id)
            delta.text_offsets.append(detokenizer.last_start)
            delta.text += stopper.feed(text, position + 1)
        elif include_stop_str:
            held = stopper.flush()
            text = detokenizer.add(token_id)
            delta.text_offsets.append(detokenizer.last_start)
            delta.text += held + text + detokenizer.flush()
        else:
            delta.text_offsets.append(detokenizer.num_chars)
        delta.token_ids.append(token_id)
        if logprobs is not None and position < len(logprobs):
            delta.logprobs.append(logprobs[position])
            delta.top_logprobs.append(top[position] if top is not None and position < len(top) else {})
        if stopper.matched is not None:
            return


def _ended_by_token(output: GenerationOutput) -> bool:
    """Whether ``output`` ended on a stop token (an EOS or a requested stop token id)."""
    return output.finish_reason is FinishReason.STOP and isinstance(output.stop_reason, int)


def _stop_token(spec: ChoiceSpec, output: GenerationOutput) -> int | None:
    """The requested stop token id that ended ``output`` (not an EOS, which vLLM leaves out)."""
    if _ended_by_token(output) and output.stop_reason in spec.params.get("stop_token_ids", ()):
        return output.stop_reason  # type: ignore[return-value]  # (an int: _ended_by_token)
    return None


def _check_failed(output: GenerationOutput, engine_dead: bool) -> None:
    if output.status is RequestStatus.FAILED or output.finish_reason is FinishReason.ERROR:
        if not engine_dead and output.finish_reason is FinishReason.ERROR:
            # The request's own failure (its controls left its grammar no token): a 400.
            raise bad_request(f"the request failed: {output.error}")
        raise APIError(500, f"the engine failed the request: {output.error}", type="internal_server_error")


def _finish_reason(output: GenerationOutput, score_only: bool) -> str:
    if score_only:
        return "length"
    assert output.finish_reason is not None
    return _FINISH_REASONS.get(output.finish_reason, "stop")


#: Choices whose delta pumps start in one loop iteration.
_STARTED_PER_TURN = 16


async def merge_deltas(iterators: Sequence[AsyncGenerator[ChoiceDelta]]) -> AsyncGenerator[ChoiceDelta]:
    """The deltas of several choices as they come; the first error cancels the others."""
    if len(iterators) == 1:
        async with aclosing(iterators[0]) as only:
            async for delta in only:
                yield delta
        return
    queue: asyncio.Queue[ChoiceDelta | BaseException | None] = asyncio.Queue()

    async def pump(iterator: AsyncGenerator[ChoiceDelta]) -> None:
        try:
            async with aclosing(iterator):
                async for delta in iterator:
                    queue.put_nowait(delta)
        except Exception as exc:
            queue.put_nowait(exc)
        else:
            queue.put_nowait(None)

    tasks: list[asyncio.Task[None]] = []
    try:
        for start in range(0, len(iterators), _STARTED_PER_TURN):
            # A pump's first step sets up its detokenizer: tens of microseconds. A thousand
            # started at once would all take it in the same loop iteration.
            tasks += [asyncio.create_task(pump(iterator)) for iterator in iterators[start : start + _STARTED_PER_TURN]]
            await asyncio.sleep(0)
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
