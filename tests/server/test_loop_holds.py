"""Large requests never hold the event loop: their bodies are parsed, tokenized, built and
written a slice at a time (or in the tokenizer thread), so that a heartbeat on the same loop
keeps beating while they run.

The bounds are generous against a loaded 2-core runner (idle lags reach ~10 ms); each
request here held the loop for hundreds of milliseconds when its work was done in one go.
"""

from __future__ import annotations

import asyncio
import gc
import random
import string
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import httpx

import aiocb
from aiocb.server import build_app
from aiocb.server.limits import ServerLimits
from tests.server.conftest import MODEL_NAME, serve_config, serve_model, wait_until_idle

T = TypeVar("T")

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
#: The longest the loop may be held while a large request runs (seconds).
MAX_HOLD = 0.06


class Heartbeat:
    """A task on the loop that sleeps a millisecond at a time and records how late it wakes."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _beat(self) -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(0.001)
            self.lags.append(time.perf_counter() - before - 0.001)

    @property
    def longest(self) -> float:
        """The longest lateness seen, seconds."""
        return max(self.lags, default=0.0)

    async def during(self, work: Awaitable[T]) -> T:
        """``work``'s result, the heartbeat running while it is awaited.

        The cyclic collector is off meanwhile: its pauses grow with every object of the
        test process, not with the request's work (bench/loop_watch.py measures them apart).
        """
        self._task = asyncio.create_task(self._beat())
        await asyncio.sleep(0.005)
        gc.disable()
        try:
            return await work
        finally:
            # (the beat the work delayed wakes after it: a work that ends without giving
            # the loop back would end the heartbeat before the beat records its lateness)
            await asyncio.sleep(0.005)
            self._task.cancel()
            gc.enable()


@asynccontextmanager
async def app_client(manager: aiocb.Manager, tokenizer: Any, **limits: Any) -> AsyncIterator[httpx.AsyncClient]:
    app = build_app(manager, tokenizer, MODEL_NAME, limits=ServerLimits(**limits))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as client:
        yield client


def token_prompt(length: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]


# --------------------------------------------------------------------------- responses


async def test_echoed_logprobs_of_many_choices_are_written_a_slice_at_a_time(
    manager: aiocb.Manager, tokenizer: Any
) -> None:
    # 48 choices each echo a 600-token prompt with 20 alternatives a token: a 20 MB body,
    # built and rendered in one go it held the loop for about half a second.
    prompt = token_prompt(600, len(tokenizer), seed=1)
    body = {"model": MODEL_NAME, "prompt": prompt, "n": 48, "echo": True, "logprobs": 20, "max_tokens": 1}
    beat = Heartbeat()
    async with app_client(manager, tokenizer) as client:
        response = await beat.during(client.post(COMPLETIONS, json={**body, "temperature": 1.0}))
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert len(choices) == 48
    assert all(len(c["logprobs"]["top_logprobs"]) == 601 for c in choices)
    assert beat.longest < MAX_HOLD, beat.longest
    await wait_until_idle(manager)


async def test_a_chat_response_with_many_choices_and_alternatives_is_written_a_slice_at_a_time(
    manager: aiocb.Manager, tokenizer: Any
) -> None:
    # 64 choices of 96 tokens with 20 alternatives each: a 25 MB body.
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Once upon a time"}],
        "n": 64,
        "max_tokens": 96,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 20,
        "temperature": 1.0,
    }
    beat = Heartbeat()
    async with app_client(manager, tokenizer) as client:
        response = await beat.during(client.post(CHAT, json=body))
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert [len(c["logprobs"]["content"]) for c in choices] == [96] * 64
    assert beat.longest < MAX_HOLD, beat.longest
    await wait_until_idle(manager)


async def test_streamed_echoes_are_built_a_slice_at_a_time(tokenizer: Any) -> None:
    # Each choice's first chunk echoes the 12,000-token prompt with 20 alternatives a token:
    # built in one go, each held the loop for about 100 ms.
    model = serve_model(tokenizer, max_position_embeddings=12288)
    prompt = token_prompt(12000, len(tokenizer), seed=2)
    body = {"model": MODEL_NAME, "prompt": prompt, "n": 2, "echo": True, "logprobs": 20, "max_tokens": 1}
    beat = Heartbeat()
    async with (
        aiocb.Manager(model, continuous_batching_config=serve_config(num_blocks=3072, max_batch_tokens=256)) as manager,
        app_client(manager, tokenizer) as client,
    ):
        stream = client.post(COMPLETIONS, json={**body, "temperature": 1.0, "stream": True})
        response = await beat.during(stream)
    assert response.status_code == 200, response.text
    echoes = [line for line in response.text.split("\n\n") if '"top_logprobs":[null,' in line]
    assert len(echoes) == 2
    assert beat.longest < MAX_HOLD, beat.longest


# --------------------------------------------------------------------------- requests


def text_prompt(rng: random.Random) -> str:
    """About 1,250 characters of made-up words: a small prompt, tokenized inline alone."""
    words = []
    while sum(map(len, words)) + len(words) < 1250:
        words.append("".join(rng.choices(string.ascii_letters + "()[]{}.,:=+-*/", k=rng.randrange(2, 9))))
    return " ".join(words)[:1250]


async def test_many_small_text_prompts_are_tokenized_off_the_loop(manager: aiocb.Manager, tokenizer: Any) -> None:
    # 1,024 prompts small enough to tokenize inline one by one; the last one too long for
    # the context, so the request ends in a 400 once all are tokenized.
    rng = random.Random(3)
    prompts = [text_prompt(rng) for _ in range(1023)] + ["z " * 2100]
    beat = Heartbeat()
    async with app_client(manager, tokenizer) as client:
        response = await beat.during(client.post(COMPLETIONS, json={"prompt": prompts, "max_tokens": 1}))
    assert response.status_code == 400, response.text
    assert "4200 tokens" in response.json()["error"]["message"]
    assert beat.longest < MAX_HOLD, beat.longest
    await wait_until_idle(manager)
