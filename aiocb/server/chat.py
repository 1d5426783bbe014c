"""``POST /v1/chat/completions``: messages through the tokenizer's chat template, and the
output back as an assistant message (content, ``reasoning_content``, ``tool_calls``)."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from aiocb.engine.turns import LoopTurn
from aiocb.errors import InvalidRequestError
from aiocb.params import STRUCTURE_FIELDS
from aiocb.sampling import check_truncation
from aiocb.server.bodies import Lazy
from aiocb.server.chat_output import ChoiceOutput, MessageBuilder
from aiocb.server.chat_output import delta as message_delta
from aiocb.server.context import ServerContext, finite
from aiocb.server.edge import AccessRecord
from aiocb.server.harmony import HarmonyOutput, harmony_constraint
from aiocb.server.limits import parse_json
from aiocb.server.protocol import ChatCompletionRequest, bad_request, error_from_exception, parse_chat_request
from aiocb.server.reasoning import REASONING_FIELDS, ReasoningSplitter, after_thinking, prompt_opens_thinking
from aiocb.server.serving import (
    ChoiceDelta,
    ChoiceSpec,
    Submission,
    choice_seed,
    engine_params,
    name_response,
)
from aiocb.server.tools import ToolRequest, parse_tools, structural_tag, template_messages


@dataclass(frozen=True, slots=True)
class PreparedChat:
    """A chat completions body parsed, checked, rendered and tokenized (see :func:`prepare_chat`)."""

    request: ChatCompletionRequest
    prompt_ids: list[int]
    #: the tools the model may call (None: none offered, or ``tool_choice`` none)
    tools: ToolRequest | None = None
    #: the constraint that enforces ``tools`` (``SamplingParams`` fields), if any
    constraint: dict[str, Any] = field(default_factory=dict)
    #: whether the prompt ends inside a ``<think>`` block that the template opened
    opens_thinking: bool = False
    #: the output constraint (a ``SamplingParams`` field and its value) that holds for the
    #: answer after the thinking, with a reasoning parser, or for a harmony output's final
    #: message: made into :attr:`constraint` by :func:`constrain_answer`
    answer: tuple[str, Any] | None = None
    #: the kinds of harmony message whose bodies the constraint holds to JSON ("call",
    #: "content"; see :class:`~aiocb.server.harmony.HarmonyOutput`)
    json_kinds: frozenset[str] = frozenset()


def prepare_chat(ctx: ServerContext, body: bytes) -> PreparedChat:
    """Parse, check, render and tokenize a chat body (thread-safe: runs off the loop when large)."""
    parsed = parse_json(body, ctx.limits.max_json_depth)
    request = parse_chat_request(parsed, ctx.defaults)
    tools = parse_tools(parsed)
    ctx.check_model(request.sampling.model)
    ctx.limits.check_stop(request.sampling.stop)
    ctx.limits.check_token_ids(request.sampling)
    request = dataclasses.replace(request, sampling=ctx.with_bad_words(request.sampling))
    ctx.check_choices(1, request.sampling.n)
    # Under "none" the template still shows the tools (as vLLM's default: a conversation
    # with earlier calls reads as it did), but no call is parsed or enforced.
    shown = tools
    if tools is not None and tools.choice == "none":
        tools = None
    parser = ctx.tool_parser
    if tools is not None and parser is None and not ctx.harmony_calls:
        raise bad_request(
            "this server has no tool-call parser for its model's chat template; start it with --tool-call-parser",
            "tools",
        )
    given = [name for name in STRUCTURE_FIELDS if name in request.sampling.controls]
    # (a harmony output's final message takes the constraint, which calls alone leave out)
    if tools is not None and tools.enforced and given and (tools.calls_only or not ctx.harmony):
        message = (
            f"the tools' tool_choice {tools.choice!r} constrains the output; it cannot be combined with "
            f"another output constraint (response_format or structured outputs: {given[0]})"
        )
        raise bad_request(message, "tool_choice")
    if ctx.harmony and tools is not None and tools.calls_only and harmony_inside(request) == "content":
        raise bad_request(
            f"tool_choice {tools.choice!r} asks for a call, which cannot follow the final message that "
            "continue_final_message continues",
            "tool_choice",
        )
    if request.echo and tools is not None and tools.calls_only:
        raise bad_request(
            f"echo puts the last message's content before the reply's, which tool_choice {tools.choice!r} makes "
            "tool calls alone (no content)",
            "echo",
        )
    if request.chat_template_kwargs.get("continue_final_message") and request.add_generation_prompt:
        raise bad_request(
            "continue_final_message continues the last message, which add_generation_prompt "
            "(true by default) would follow with a new one: send add_generation_prompt false with it",
            "add_generation_prompt",
        )
    text = ctx.render_chat(
        template_messages(request.messages, None if ctx.tool_parser is None else ctx.tool_parser.template_id),
        add_generation_prompt=request.add_generation_prompt,
        kwargs=request.chat_template_kwargs,
        tools=None if shown is None else list(shown.tools),
    )
    keep = request.sampling.truncate_prompt_tokens
    check_truncation(keep, ctx.max_model_len)
    if keep is None:  # (else cut once tokenized; the body's size bounds the work)
        ctx.check_prompt_chars(text, "messages")
    # The message continued (``continue_final_message``): its content, or the field named
    # (one of transformers' reasoning fields: the prompt then ends inside the thinking).
    continues = request.chat_template_kwargs.get("continue_final_message")
    field = continues if isinstance(continues, str) else "content"
    continued = request.messages[-1].get(field) if continues else None
    opens_thinking = ctx.reasoning and (
        (bool(continues) and field in REASONING_FIELDS)
        or prompt_opens_thinking(text, continued if isinstance(continued, str) else None)
    )
    constraint: dict[str, Any] = {}
    if tools is not None and tools.enforced and not ctx.harmony:
        assert parser is not None
        mode = "disabled" if not ctx.reasoning else "enabled" if opens_thinking else "auto"
        constraint["structural_tag"] = structural_tag(tools, parser.xgrammar_format, mode, parser.separator)
    ids = ctx.encode_prompt(text, add_special_tokens=False, param="messages", keep=keep).ids
    answer = None
    if (ctx.reasoning or ctx.harmony) and not constraint and given:
        # (the constraint holds for the answer: after the thinking, or harmony's final message)
        (name,) = given
        answer = (name, request.sampling.controls[name])
    return PreparedChat(request, ids, tools, constraint, opens_thinking, answer)


def harmony_inside(request: ChatCompletionRequest) -> str | None:
    """The kind of harmony message the prompt ends inside ("content", "reasoning"): a
    message continued (``continue_final_message``), whose field says which; None if none."""
    continued = request.chat_template_kwargs.get("continue_final_message")
    if not continued:
        return None
    return "reasoning" if isinstance(continued, str) and continued in REASONING_FIELDS else "content"


async def constrain_answer(ctx: ServerContext, prepared: PreparedChat) -> PreparedChat:
    """``prepared`` with its :attr:`~PreparedChat.answer` constraint after a free
    ``<think>`` block (for harmony: in the final message, with its enforced tools' calls;
    :func:`~aiocb.server.harmony.harmony_constraint`), made off the loop
    (:meth:`ServerContext.building`): a JSON schema's grammar, checked, takes tens of
    milliseconds for a body of a kilobyte or two (sixty properties, 84 ms)."""
    build: functools.partial[dict[str, Any]]
    if ctx.harmony:
        enforced = prepared.tools is not None and prepared.tools.enforced
        if prepared.answer is None and not enforced:
            return prepared
        inside = harmony_inside(prepared.request)
        build = functools.partial(harmony_constraint, prepared.answer, prepared.tools, inside)
    elif prepared.answer is None:
        return prepared
    else:
        build = functools.partial(after_thinking, *prepared.answer, opened=prepared.opens_thinking)
    try:
        tag = await ctx.building(build)
    except InvalidRequestError as exc:
        raise error_from_exception(exc, prepared.request.sampling.body_params()) from None
    replaced = {} if prepared.answer is None else {prepared.answer[0]: None}
    json_kinds: frozenset[str] = frozenset()
    if ctx.harmony:  # (every call's arguments are JSON under it; the answer, where it is JSON)
        json_kinds = frozenset(
            {"call"} | ({"content"} if prepared.answer and prepared.answer[0] == "json_schema" else set())
        )
    constraint = {**replaced, "structural_tag": tag}
    return dataclasses.replace(prepared, constraint=constraint, answer=None, json_kinds=json_kinds)


class ChatCompletion:
    """One chat completions request from submission to its response or stream."""

    def __init__(self, ctx: ServerContext, prepared: PreparedChat, received: float, record: AccessRecord) -> None:
        self.ctx = ctx
        self.request = request = prepared.request
        self.id = f"chatcmpl-{name_response(request.sampling, record)}"
        self.created = int(time.time())
        self.prompt_ids = prepared.prompt_ids
        self.tools = prepared.tools
        self.opens_thinking = prepared.opens_thinking
        self.json_kinds = prepared.json_kinds
        last = request.messages[-1]
        #: what ``echo`` puts before each choice's content: the last message's, where the
        #: reply (an assistant message) continues or follows one of its own role (as vLLM's)
        self.echoed = (last.get("content") or "") if request.echo and last.get("role") == "assistant" else ""
        sampling = request.sampling
        # (harmony's markers are special tokens too)
        keep_special = ctx.harmony or (
            self.tools is not None and ctx.tool_parser is not None and ctx.tool_parser.needs_special_tokens
        )
        #: whether the text keeps special tokens the client asked to skip (the parser drops them)
        self.hides_special = keep_special and sampling.skip_special_tokens
        max_tokens = sampling.max_tokens
        if max_tokens is None:
            # (the model's cap gives way to the request's own min_tokens, not refused naming
            # a length the client never gave)
            max_tokens = max(
                ctx.default_max_tokens(len(self.prompt_ids), sampling.min_tokens), sampling.min_tokens or 0
            )
        specs = [
            ChoiceSpec(
                index=j,
                prompt_ids=self.prompt_ids,
                max_tokens=max_tokens,
                params=engine_params(
                    sampling,
                    seed=choice_seed(sampling, j),
                    logprobs=request.logprobs,
                    top_logprobs=request.top_logprobs,
                    prompt_logprobs=False,
                    score_only=False,  # (a chat asks for a token at least)
                )
                | prepared.constraint,
                stop=sampling.stop,
                # A format whose markers are special tokens ([TOOL_CALLS]) needs them in the text.
                skip_special_tokens=sampling.skip_special_tokens and not keep_special,
                min_tokens=ctx.min_tokens(sampling, len(self.prompt_ids)),
                include_stop_str_in_output=sampling.include_stop_str_in_output,
            )
            for j in range(sampling.n)
        ]
        self.submission = Submission(ctx, specs, received)
        self.submission.record = record

    async def submit(self) -> None:
        """Queue every choice (or none: the error is raised)."""
        await self.submission.submit()

    async def response(self) -> dict[str, Any]:
        """Run every choice to its end; the whole response body."""
        n = self.request.sampling.n
        outputs = [self._output() for _ in range(n)]
        reasoning = self.ctx.reasoning or self.ctx.harmony
        messages = [MessageBuilder(reasoning=reasoning, calls_only=self._calls_only) for _ in range(n)]
        #: each choice's tokens with their logprobs, made into entries as the body is written
        scored: list[list[_Scored]] = [[] for _ in range(n)]
        finish: list[str | None] = [None] * n
        stop_reasons: list[int | str | None] = [None] * n
        generated = [0] * n
        turn = LoopTurn()
        try:
            async with aclosing(self.submission.deltas()) as deltas:
                async for delta in deltas:
                    await turn.give()  # (deltas that came together are taken without a wait)
                    j = delta.index
                    messages[j].add(outputs[j].feed(delta.text))
                    scored[j] += _scored(delta)
                    if delta.finish_reason is not None:
                        messages[j].add(outputs[j].finish(cut=delta.finish_reason == "length"))
                        finish[j] = self._finish_reason(delta.finish_reason, outputs[j])
                        stop_reasons[j] = delta.stop_reason
                    generated[j] = delta.num_generated
        finally:
            await self.submission.aclose()
        choices = [
            {
                "index": j,
                "message": self._echoed(messages[j].message()),
                "logprobs": {"content": Lazy(scored[j], self._logprob_entry)} if self.request.logprobs else None,
                "finish_reason": finish[j],
                "stop_reason": stop_reasons[j],
            }
            for j in range(n)
        ]
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.ctx.model_name,
            "choices": choices,
            "usage": self._usage(sum(generated)),
        }

    def chunks(self) -> AsyncIterator[dict[str, Any]]:
        """The stream's chunks (after :meth:`submit`): the role first, then content deltas."""
        return self.submission.closing(self._chunks())

    async def _chunks(self) -> AsyncGenerator[dict[str, Any]]:
        n = self.request.sampling.n
        generated = [0] * n
        for j in range(n):
            role = {"role": "assistant", "content": None if self._calls_only else ""}
            yield self._usage_so_far(self._chunk(j, role, None, None), generated)
            if self.echoed:
                yield self._usage_so_far(self._chunk(j, {"content": self.echoed}, None, None), generated)
        outputs = [self._output() for _ in range(n)]
        turn = LoopTurn()
        async with aclosing(self.submission.deltas()) as deltas:
            async for delta in deltas:
                await turn.give()  # (deltas that came together are taken without a wait)
                j = delta.index
                generated[j] = delta.num_generated
                fragments = outputs[j].feed(delta.text)
                finish_reason = None
                if delta.finish_reason is not None:
                    fragments += outputs[j].finish(cut=delta.finish_reason == "length")
                    finish_reason = self._finish_reason(delta.finish_reason, outputs[j])
                entries = await self._logprob_entries(delta, turn)
                logprobs = {"content": entries} if self.request.logprobs else None
                parts = [message_delta(fragment) for fragment in fragments]
                if not parts and (entries or finish_reason is not None):
                    parts = [{}]
                for k, part in enumerate(parts):
                    last = k == len(parts) - 1
                    chunk = self._chunk(
                        j,
                        part,
                        logprobs if k == 0 else None,
                        finish_reason if last else None,
                        delta.stop_reason if last else None,
                    )
                    yield self._usage_so_far(chunk, generated)
        if self.request.sampling.include_usage:
            yield {**self._header(), "choices": [], "usage": self._usage(sum(generated))}

    def _echoed(self, message: dict[str, Any]) -> dict[str, Any]:
        """``message`` with :attr:`echoed` before its content (``echo``)."""
        if self.echoed:
            message["content"] = self.echoed + (message["content"] or "")
        return message

    def _output(self) -> ChoiceOutput | HarmonyOutput:
        """A parser of one choice's text: reasoning split off, tool calls found."""
        ctx = self.ctx
        hidden = ctx.special_texts if self.hides_special else ()
        if ctx.harmony:  # (a continued message's body goes on)
            functions = None if self.tools is None else self.tools.names
            forced = self.tools.choice if self.tools is not None and self.tools.forced else None
            return HarmonyOutput(functions, hidden, harmony_inside(self.request), self.json_kinds, forced)
        reasoning = ReasoningSplitter(starts_inside=self.opens_thinking) if ctx.reasoning else None
        tools = None
        if self.tools is not None:
            assert ctx.tool_parser is not None  # (prepare_chat refuses tools without one)
            forced = self.tools.choice if self.tools.forced else None
            tools = ctx.tool_parser(
                self.tools.names,
                parallel=self.tools.parallel,
                hidden=hidden,
                calls_only=self.tools.calls_only,
                forced=forced,
            )
        return ChoiceOutput(reasoning, tools, hidden)

    @property
    def _calls_only(self) -> bool:
        """Whether the answer is tool calls alone (its ``content`` null)."""
        return self.tools is not None and self.tools.calls_only

    def _finish_reason(self, reason: str, output: ChoiceOutput | HarmonyOutput) -> str:
        """``tool_calls`` when the model stopped after calling tools it chose to call."""
        chose = self.tools is not None and not self.tools.forced
        return "tool_calls" if reason == "stop" and output.calls and chose else reason

    def _header(self) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.ctx.model_name}

    def _chunk(
        self,
        index: int,
        delta: dict[str, Any],
        logprobs: dict[str, Any] | None,
        finish_reason: str | None,
        stop_reason: int | str | None = None,
    ) -> dict[str, Any]:
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }
        return {**self._header(), "choices": [choice]}

    def _usage(self, completion_tokens: int) -> dict[str, Any]:
        return self.submission.usage(completion_tokens)

    def _usage_so_far(self, chunk: dict[str, Any], generated: list[int]) -> dict[str, Any]:
        """``chunk``, with its choice's usage so far where the request asks for it in each
        chunk (``continuous_usage_stats``)."""
        if self.request.sampling.continuous_usage:
            index = chunk["choices"][0]["index"]
            chunk["usage"] = self.submission.choice_usage(index, generated[index])
        return chunk

    async def _logprob_entries(self, delta: ChoiceDelta, turn: LoopTurn) -> list[dict[str, Any]]:
        """The delta's tokens' logprobs entries, a slice of the loop at a time (a delta may
        bring hundreds of tokens with twenty alternatives each)."""
        if not self.request.logprobs:
            return []
        entries = []
        for token in _scored(delta):
            entries.append(self._logprob_entry(token))
            await turn.give()
        return entries

    def _logprob_entry(self, token: _Scored) -> dict[str, Any]:
        """One token's entry: its logprob and its alternatives'."""
        token_id, score, top = token
        alternatives = [self._token_entry(t, s) for t, s in list(top.items())[: self.request.top_logprobs]]
        return {**self._token_entry(token_id, score), "top_logprobs": alternatives}

    def _token_entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.ctx.token_text(token_id)
        raw = self.ctx.token_bytes(token_id) if text.startswith("bytes:") else None
        return {"token": text, "logprob": finite(logprob), "bytes": list(raw if raw is not None else text.encode())}


#: A generated token, its logprob and its alternatives' (by token id).
_Scored = tuple[int, float, dict[int, float]]


def _scored(delta: ChoiceDelta) -> list[_Scored]:
    return list(zip(delta.token_ids, delta.logprobs, delta.top_logprobs, strict=False))
