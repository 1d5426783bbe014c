"""Large requests never hold the event loop: their bodies are parsed, tokenized, built and
written a slice at a time (or in the tokenizer thread), so that a heartbeat on the same loop
keeps beating while they run.

The bounds are generous against a loaded 2-core runner (idle lags reach ~10 ms, and
tens of milliseconds when other processes take the cores); each request here held the
loop for half a second or more when its work was done in one go. Where the work is
smaller, the slices are counted instead (the loop given back after each unit of work).
"""

from __future__ import annotations

import asyncio
import gc
import json
import random
import string
import time
import weakref
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import httpx
import pytest
from starlette.responses import JSONResponse

import aiocb
from aiocb.server import bodies, build_app, chat, completions, limits, serving
from aiocb.server.bodies import Chain, Lazy, Uneven, encode
from aiocb.server.limits import ServerLimits, parse_json
from aiocb.server.protocol import APIError
from tests.conftest import LoopTurns
from tests.server.conftest import MODEL_NAME, wait_until_idle

T = TypeVar("T")

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
#: The longest the loop may be held while a large request runs (seconds): the requests
#: below held it for half a second or more.
MAX_HOLD = 0.15


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
    # 64 choices each echo a 600-token prompt with 20 alternatives a token: a 25 MB body,
    # built and rendered in one go it held the loop for about 0.7 s.
    prompt = token_prompt(600, len(tokenizer), seed=1)
    body = {"model": MODEL_NAME, "prompt": prompt, "n": 64, "echo": True, "logprobs": 20, "max_tokens": 1}
    beat = Heartbeat()
    async with app_client(manager, tokenizer) as client:
        response = await beat.during(client.post(COMPLETIONS, json={**body, "temperature": 1.0}))
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert len(choices) == 64
    assert all(len(c["logprobs"]["top_logprobs"]) == 601 for c in choices)
    assert beat.longest < MAX_HOLD, beat.longest
    await wait_until_idle(manager)


async def test_a_chat_response_with_many_choices_and_alternatives_is_written_a_slice_at_a_time(
    manager: aiocb.Manager, tokenizer: Any
) -> None:
    # 128 choices of 96 tokens with 20 alternatives each: a 50 MB body, rendered in one go
    # it held the loop for about half a second.
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Once upon a time"}],
        "n": 128,
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
    assert [len(c["logprobs"]["content"]) for c in choices] == [96] * 128
    assert beat.longest < MAX_HOLD, beat.longest
    await wait_until_idle(manager)


async def test_a_chat_response_makes_its_logprob_entries_as_it_is_written(
    manager: aiocb.Manager, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A chat body's entries (a dict a token, twenty more for its alternatives) were all
    # made before the body was written: millions of objects alive at once made each of the
    # collector's full passes hold the loop (368 ms for 64 choices of 2,048 tokens).
    live, peak = 0, 0

    class Counted(dict[str, Any]):
        def __init__(self, entry: dict[str, Any]) -> None:
            nonlocal live, peak
            super().__init__(entry)
            live += 1
            peak = max(peak, live)

        def __del__(self) -> None:
            nonlocal live
            live -= 1

    entry = chat.ChatCompletion._logprob_entry
    monkeypatch.setattr(chat.ChatCompletion, "_logprob_entry", lambda self, token: Counted(entry(self, token)))
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Once upon a time"}],
        "n": 8,
        "max_tokens": 64,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 20,
        "temperature": 1.0,
    }
    async with app_client(manager, tokenizer) as client:
        response = await client.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert [len(c["logprobs"]["content"]) for c in choices] == [64] * 8
    assert all(len(entry["top_logprobs"]) == 20 for c in choices for entry in c["logprobs"]["content"])
    assert 0 < peak <= 8, f"{peak} of 512 entries were alive at once"
    await wait_until_idle(manager)


async def test_a_finished_requests_outputs_are_freed_a_slice_at_a_time(
    manager: aiocb.Manager, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each choice's stream holds its request, and with it the logprobs of its prompt:
    # 64 choices echoing 600 tokens with 20 alternatives each were freed at once, holding
    # the loop for 25-30 ms once the body was written.
    monkeypatch.setattr("aiocb.engine.turns.SLICE", 0.0)  # give the loop back after every unit
    turns = LoopTurns()
    freed_at: list[int] = []
    submit_choices = serving.submit_choices

    async def watched(*args: Any) -> list[Any]:
        streams = await submit_choices(*args)
        for stream in streams:
            weakref.finalize(stream, lambda: freed_at.append(turns.turns))
        return streams

    monkeypatch.setattr(serving, "submit_choices", watched)
    prompt = token_prompt(50, len(tokenizer), seed=3)
    body = {"model": MODEL_NAME, "prompt": prompt, "n": 16, "echo": True, "logprobs": 5, "max_tokens": 2}
    async with app_client(manager, tokenizer) as client, turns:
        response = await client.post(COMPLETIONS, json={**body, "temperature": 1.0})
    assert response.status_code == 200, response.text
    assert len(freed_at) == 16
    assert turns.gave_back(freed_at) >= 16 - 2, f"freed at turns {freed_at}"
    await wait_until_idle(manager)


async def test_a_streamed_echo_is_made_a_slice_at_a_time(
    manager: aiocb.Manager, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each choice's first chunk echoes the 2,000-token prompt with 20 alternatives a token:
    # made in one go, each held the loop for about 20 ms (and 100 ms at 12,000 tokens).
    monkeypatch.setattr("aiocb.engine.turns.SLICE", 0.0)  # give the loop back after every unit
    turns = LoopTurns()
    made_at: list[int] = []
    top_dict = completions._top_dict

    def recorded(*args: Any) -> dict[str, float]:
        made_at.append(turns.turns)
        return top_dict(*args)

    monkeypatch.setattr(completions, "_top_dict", recorded)
    prompt = token_prompt(2000, len(tokenizer), seed=2)
    body = {"model": MODEL_NAME, "prompt": prompt, "n": 4, "echo": True, "logprobs": 20, "max_tokens": 1}
    async with app_client(manager, tokenizer) as client, turns:
        response = await client.post(COMPLETIONS, json={**body, "temperature": 1.0, "stream": True})
    assert response.status_code == 200, response.text
    echoes = [line for line in response.text.split("\n\n") if '"top_logprobs":[null,' in line]
    assert len(echoes) == 4
    # Each choice's token and the prompt's 1,999 scored positions: once for all choices
    # when they scored the prompt alike, else once each (their scores may differ in the
    # last bits: each scored it in batches of its own).
    assert len(made_at) in (1999 + 4, 4 * 2000)
    assert turns.gave_back(made_at) >= len(made_at) - 8, "the loop was not given back between positions"
    await wait_until_idle(manager)


def test_bodies_are_written_as_a_json_response_renders_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bodies, "_SMALL", 2)  # (nearly every container walked, arrays batched)
    shared = [{"a": -1.5e-05, "b": None}, [1, 2, 3], "é\u2028😀"] * 40
    value = {
        "x": [1, 2.5, "é", True, None, (3, 4)],
        7: {"k": [[], {}], None: 1e300, 2.5: [[{"q": list(range(100))}]]},
        "once": Chain((shared, [])),
        "twice": [Chain(([], shared, ["z"] * 50)), Chain((shared, [{"c": 1}]))],
        "empty": Chain(([], [])),
        "lazy": [Lazy(range(300), lambda i: {"i": i, "s": [str(i)] * 3}), Lazy([], str)],
    }

    def as_list(array: Chain | Lazy) -> list[Any]:
        return [x for part in array.parts for x in part] if isinstance(array, Chain) else list(array)

    plain = json.loads(json.dumps(value, default=as_list))
    assert b"".join(asyncio.run(encode(value))) == JSONResponse(plain).body
    with pytest.raises(ValueError, match="not JSON compliant"):
        asyncio.run(encode({"a": [float("nan")] * 300}))


def test_an_uneven_array_of_small_then_large_elements_writes_each_as_its_size_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A completion's choices (:class:`Uneven`): some stopped at their first token, the next
    ones long with their alternatives. None of the long ones is written in a batch sized by
    the short ones (which wrote ten of them in one call: 113 ms of the loop)."""
    calls: list[int] = []
    dumps = bodies._dumps

    def counted(value: Any) -> str:
        text = dumps(value)
        calls.append(len(text))
        return text

    monkeypatch.setattr(bodies, "_dumps", counted)
    short = {"text": "a", "logprobs": {"tokens": ["a"], "top_logprobs": [{"a": -0.1}]}}
    long = {"text": "b" * 1000, "logprobs": {"tokens": ["b"] * 1000, "top_logprobs": [{"b": -0.1, "c": -2.0}] * 1000}}
    choices = [short] * 18 + [long] * 10
    written = b"".join(asyncio.run(encode({"choices": Uneven(choices)})))
    assert json.loads(written) == {"choices": choices}
    assert max(calls) < 2 * len(dumps(long["logprobs"]["top_logprobs"])), "two long choices written in one call"


def random_json(rng: random.Random, depth: int = 0) -> Any:
    """A value with the scalars, keys and nesting JSON bodies have (commas and brackets
    inside strings included)."""
    roll = rng.random()
    if depth > 3 or roll < 0.4:
        words = ["", "a,b", "[x]", '{"y":', "é😀", "\\", "\u2028"]
        # (a string longer than a piece: decoded a piece at a time, never cutting an escape)
        pieces = [*words, '"', "\n", "\x01", "😀😀", "abcdefghijklmnop", " " * 13]
        long = "".join(rng.choice(pieces) for _ in range(rng.randrange(60)))
        return rng.choice([None, True, 7, -(10**20), 1.5e-7, float("inf"), rng.choice(words), long])
    if roll < 0.7:
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(12))]
    return {f"{rng.choice(['k', ',', ']'])}{rng.randrange(4)}": random_json(rng, depth + 1) for _ in range(6)}


def test_a_large_body_parses_as_json_loads_does(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "_WHOLE_BYTES", 0)  # (every body parsed a piece at a time)
    monkeypatch.setattr(limits, "_PIECE_CHARS", 24)
    rng = random.Random(4)
    for _ in range(150):
        value = random_json(rng)
        text = json.dumps(value, indent=rng.choice([None, 1]), ensure_ascii=rng.random() < 0.5)
        assert json.dumps(parse_json(text.encode(), 64)) == json.dumps(json.loads(text)), text
        cut = rng.randrange(len(text)) + 1  # (a text cut short or with a character more is no JSON)
        for broken in (text[:cut], text[:cut] + rng.choice(",]}:1") + text[cut:]):
            try:
                json.loads(broken)
            except ValueError:
                with pytest.raises(APIError, match=r"not valid JSON|deeper than"):
                    parse_json(broken.encode(), 64)
    assert parse_json(b'{"a": 1, "b": 2, "a": [3]}', 64) == {"a": [3], "b": 2}
    assert list(parse_json(b'{"a": 1, "b": 2, "a": [3]}', 64)) == ["a", "b"]
    with pytest.raises(APIError, match="not valid JSON"):
        parse_json(b'{"max_tokens": ' + b"9" * 5000 + b"}", 64)
    nested = b'{"a": [[[{"b": [1, 2, 3, [4]]}]]]}'
    assert parse_json(nested, 7) == json.loads(nested)
    with pytest.raises(APIError, match="deeper than the server's limit of 6 levels"):
        parse_json(nested, 6)
    with pytest.raises(APIError, match="64 levels"):
        parse_json(b"[" * 100_000 + b"]" * 100_000, 64)


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


@pytest.mark.parametrize(
    ("field", "status"),
    [
        # (4 million token ids: a prompt refused by its length once parsed)
        pytest.param(b'"prompt":[' + b",".join([b"7"] * 4_000_000) + b"]", 400, id="array"),
        pytest.param(
            b'"prompt":"hi","metadata":{' + b",".join(b'"%d":""' % i for i in range(600_000)) + b"}", 200, id="object"
        ),
    ],
)
async def test_a_large_json_body_is_parsed_a_slice_at_a_time(
    manager: aiocb.Manager, tokenizer: Any, field: bytes, status: int
) -> None:
    # 7 to 8 MiB of small values: parsed in one call, the tokenizer thread held the GIL (and
    # so the loop) for 0.2 to 0.8 s, as long as the call takes here (the baseline).
    raw = b'{"max_tokens":1,' + field + b"}"
    gc.disable()
    began = time.perf_counter()
    json.loads(raw)
    whole = time.perf_counter() - began
    gc.enable()
    beat = Heartbeat()
    async with app_client(manager, tokenizer) as client:
        headers = {"content-type": "application/json"}
        response = await beat.during(client.post(COMPLETIONS, content=raw, headers=headers))
    assert response.status_code == status, response.text
    assert beat.longest < whole / 2, (beat.longest, whole)
    await wait_until_idle(manager)
