"""``POST /v1/chat/completions``: messages through the tokenizer's chat template."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from aiocb.server.context import ServerContext, finite
from aiocb.server.limits import parse_json
from aiocb.server.protocol import ChatCompletionRequest, parse_chat_request
from aiocb.server.serving import (
    ChoiceDelta,
    ChoiceSpec,
    Submission,
    choice_seed,
    engine_params,
)


@dataclass(frozen=True, slots=True)
class PreparedChat:
    """A chat completions body parsed, checked, rendered and tokenized (see :func:`prepare_chat`)."""

    request: ChatCompletionRequest
    prompt_ids: list[int]


def prepare_chat(ctx: ServerContext, body: bytes) -> PreparedChat:
    """Parse, check, render and tokenize a chat body (thread-safe: runs off the loop when large)."""
    request = parse_chat_request(parse_json(body, ctx.limits.max_json_depth))
    ctx.check_model(request.sampling.model)
    ctx.limits.check_stop(request.sampling.stop)
    text = ctx.render_chat(
        request.messages, add_generation_prompt=request.add_generation_prompt, kwargs=request.chat_template_kwargs
    )
    ctx.check_prompt_chars(text, "messages")
    return PreparedChat(request, ctx.encode(text, add_special_tokens=False))


class ChatCompletion:
    """One chat completions request from submission to its response or stream."""

    def __init__(self, ctx: ServerContext, prepared: PreparedChat, received: float) -> None:
        self.ctx = ctx
        self.request = request = prepared.request
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.prompt_ids = prepared.prompt_ids
        sampling = request.sampling
        max_tokens = sampling.max_tokens
        if max_tokens is None:
            max_tokens = ctx.default_max_tokens(len(self.prompt_ids))
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
                    score_only=max_tokens == 0,
                ),
                stop=sampling.stop,
                skip_special_tokens=sampling.skip_special_tokens,
                min_tokens=sampling.min_tokens,
                include_stop_str_in_output=sampling.include_stop_str_in_output,
            )
            for j in range(sampling.n)
        ]
        self.submission = Submission(ctx, specs, received)

    async def submit(self) -> None:
        """Queue every choice (or none: the error is raised)."""
        await self.submission.submit()

    async def response(self) -> dict[str, Any]:
        """Run every choice to its end; the whole response body."""
        n = self.request.sampling.n
        texts = [""] * n
        logprobs: list[list[dict[str, Any]]] = [[] for _ in range(n)]
        finish: list[str | None] = [None] * n
        generated = [0] * n
        try:
            async with aclosing(self.submission.deltas()) as deltas:
                async for delta in deltas:
                    texts[delta.index] += delta.text
                    logprobs[delta.index] += self._logprob_entries(delta)
                    finish[delta.index] = delta.finish_reason or finish[delta.index]
                    generated[delta.index] = delta.num_generated
        finally:
            await self.submission.aclose()
        choices = [
            {
                "index": j,
                "message": {"role": "assistant", "content": texts[j]},
                "logprobs": {"content": logprobs[j]} if self.request.logprobs else None,
                "finish_reason": finish[j],
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
        for j in range(n):
            yield self._chunk(j, {"role": "assistant", "content": ""}, None, None)
        generated = [0] * n
        async with aclosing(self.submission.deltas()) as deltas:
            async for delta in deltas:
                generated[delta.index] = delta.num_generated
                entries = self._logprob_entries(delta)
                if not delta.text and not entries and delta.finish_reason is None:
                    continue
                logprobs = {"content": entries} if self.request.logprobs else None
                content = {"content": delta.text} if delta.text or delta.finish_reason is None else {}
                yield self._chunk(delta.index, content, logprobs, delta.finish_reason)
        if self.request.sampling.include_usage:
            yield {**self._header(), "choices": [], "usage": self._usage(sum(generated))}

    def _header(self) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.ctx.model_name}

    def _chunk(
        self, index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None, finish_reason: str | None
    ) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return {**self._header(), "choices": [choice]}

    def _usage(self, completion_tokens: int) -> dict[str, Any]:
        return self.submission.usage(completion_tokens)

    def _logprob_entries(self, delta: ChoiceDelta) -> list[dict[str, Any]]:
        if not self.request.logprobs:
            return []
        entries = []
        top_n = self.request.top_logprobs
        for token_id, score, top in zip(delta.token_ids, delta.logprobs, delta.top_logprobs, strict=False):
            alternatives = [self._token_entry(t, s) for t, s in list(top.items())[:top_n]]
            entries.append({**self._token_entry(token_id, score), "top_logprobs": alternatives})
        return entries

    def _token_entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.ctx.token_text(token_id)
        raw = self.ctx.token_bytes(token_id) if text.startswith("bytes:") else None
        return {"token": text, "logprob": finite(logprob), "bytes": list(raw if raw is not None else text.encode())}
