"""The engine behind a process boundary (``--api-workers``): :class:`EngineService` and
:class:`RemoteManager` over a real Unix socket, both on the test's loop."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import aiocb
from aiocb.server import build_app
from aiocb.server import remote as remote_module
from aiocb.server.remote import EngineService, RemoteManager, encode_frame, read_frame
from tests.conftest import random_prompts
from tests.server.conftest import MODEL_NAME, wait_until_idle, wait_until_running

PROMPTS = random_prompts(4, 6, 30, seed=5)


@pytest.fixture
async def service(manager: aiocb.Manager, tmp_path: Path) -> AsyncIterator[tuple[EngineService, str]]:
    engine = EngineService(manager)
    path = str(tmp_path / "engine.sock")
    await engine.start(path)
    try:
        yield engine, path
    finally:
        await engine.close()


@pytest.fixture
async def remote(service: tuple[EngineService, str], manager: aiocb.Manager) -> AsyncIterator[RemoteManager]:
    connected = await RemoteManager.connect(service[1], manager.model.config)
    try:
        yield connected
    finally:
        await connected.close()


async def _last(stream: AsyncIterator[aiocb.GenerationOutput]) -> tuple[aiocb.GenerationOutput, int]:
    """The final output and how many outputs came."""
    count = 0
    last = None
    async for output in stream:
        count += 1
        last = output
    assert last is not None
    return last, count


PARAMS: list[dict[str, Any]] = [
    {"do_sample": False},
    {"do_sample": True, "temperature": 0.9, "top_k": 20, "top_p": 0.9, "seed": 3},
    {"do_sample": False, "return_logprobs": True, "top_logprobs": 3, "prompt_logprobs": True},
]


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "sampled", "logprobs"])
async def test_remote_outputs_equal_the_managers(manager: aiocb.Manager, remote: RemoteManager, params: Any) -> None:
    for prompt in PROMPTS:
        local, _ = await _last(manager.stream(manager.add_request_nowait(prompt, max_new_tokens=12, **params)))
        far, count = await _last(await remote.open_stream(prompt, 12, **params))
        assert count > 1, "streamed, not only the final output"
        assert far.generated_tokens == local.generated_tokens
        assert far.logprobs == local.logprobs
        assert far.top_logprobs == local.top_logprobs
        assert far.prompt_logprobs == local.prompt_logprobs
        assert far.prompt_top_logprobs == local.prompt_top_logprobs
        assert (far.status, far.finish_reason) == (local.status, local.finish_reason)


async def test_refusals_arrive_as_the_managers_errors(manager: aiocb.Manager, remote: RemoteManager) -> None:
    with pytest.raises(aiocb.InvalidRequestError, match="no_such_param"):
        await remote.open_stream(PROMPTS[0], 4, no_such_param=1)
    with pytest.raises(aiocb.InvalidRequestError, match="max_new_tokens"):
        await remote.open_stream(PROMPTS[0], -3)
    # and the connection still serves
    output, _ = await _last(await remote.open_stream(PROMPTS[0], 3))
    assert len(output.generated_tokens) == 3


async def test_closing_a_remote_stream_cancels_the_request(manager: aiocb.Manager, remote: RemoteManager) -> None:
    stream = await remote.open_stream(PROMPTS[1], 500, eos_token_id=[])
    await stream.__anext__()
    await stream.aclose()
    stats = await wait_until_idle(manager)
    assert (stats.running_requests, stats.waiting_requests) == (0, 0)
    assert stats.free_blocks == stats.total_blocks


async def test_a_dropped_worker_connection_cancels_its_requests(
    manager: aiocb.Manager, service: tuple[EngineService, str]
) -> None:
    worker = await RemoteManager.connect(service[1], manager.model.config)
    streams = [await worker.open_stream(p, 500, eos_token_id=[]) for p in PROMPTS]
    await streams[0].__anext__()
    await worker.close()
    with pytest.raises(aiocb.EngineDeadError):
        await streams[1].__anext__()
    stats = await wait_until_idle(manager)
    assert stats.free_blocks == stats.total_blocks and stats.running_requests == 0


async def test_an_engine_that_goes_away_fails_every_open_stream(
    service: tuple[EngineService, str], remote: RemoteManager
) -> None:
    stream = await remote.open_stream(PROMPTS[2], 500, eos_token_id=[])
    await stream.__anext__()
    assert remote.is_running and not remote.is_dead
    await service[0].close()
    with pytest.raises(aiocb.EngineDeadError):
        await asyncio.wait_for(_last(stream), 10)
    assert remote.is_dead and not remote.is_running
    with pytest.raises(aiocb.EngineDeadError):
        await remote.open_stream(PROMPTS[0], 2)


async def test_a_worker_drain_waits_for_its_requests(manager: aiocb.Manager, remote: RemoteManager) -> None:
    streams = [await remote.open_stream(p, 4) for p in PROMPTS]
    await remote.stop(timeout=120)
    for stream in streams:
        assert (await _last(stream))[0].finish_reason is aiocb.FinishReason.LENGTH


async def test_a_worker_drain_aborts_what_outlasts_it(manager: aiocb.Manager, remote: RemoteManager) -> None:
    long = await remote.open_stream(PROMPTS[1], 2048 - len(PROMPTS[1]), eos_token_id=[])
    await remote.stop(timeout=0.05)
    with pytest.raises(aiocb.RequestAbortedError):
        await asyncio.wait_for(_last(long), 10)
    stats = await wait_until_idle(manager)
    assert stats.free_blocks == stats.total_blocks


async def test_the_app_over_a_remote_engine_answers_as_over_the_manager(
    manager: aiocb.Manager, remote: RemoteManager, tokenizer: Any
) -> None:
    body = {"prompt": ["Once upon a time", "The quick brown"], "max_tokens": 12, "n": 2, "seed": 1, "stop": ["e"]}
    requests = [body, {**body, "stream": True}, {**body, "logprobs": 2, "temperature": 0, "echo": True}]
    answers = []
    for engine in (manager, remote):
        app = build_app(engine, tokenizer, MODEL_NAME)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            answers.append([_choices(await http.post("/v1/completions", json=request)) for request in requests])
            # refused in the engine (beyond the context): a 400 naming the problem, as in one process
            refused = await http.post("/v1/completions", json={**body, "max_tokens": 100_000})
            answers[-1].append((refused.status_code, refused.json()["error"]["message"]))
    # The same tokens and text; logprobs equal but for float rounding: a request's logits
    # differ in their last bits with the shape of the batch it ran in, which timing decides.
    assert _close(answers[0], answers[1]), (answers[0], answers[1])
    assert answers[1][-1][0] == 400 and "context length" in answers[1][-1][1]


def _close(a: Any, b: Any) -> bool:
    """Equal through dicts, lists and tuples, floats within 1e-4."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-4)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _choices(response: httpx.Response) -> dict[int, Any]:
    """``{index: (text, logprobs, finish_reason)}`` of a whole or streamed completion."""
    assert response.status_code == 200, response.text
    if not response.headers["content-type"].startswith("text/event-stream"):
        return {c["index"]: (c["text"], c["logprobs"], c["finish_reason"]) for c in response.json()["choices"]}
    texts: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    for line in response.text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[len("data: ") :])["choices"]:
                texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
                reasons[choice["index"]] = choice["finish_reason"] or reasons.get(choice["index"])
    return {index: (text, None, reasons[index]) for index, text in texts.items()}


async def test_a_worker_that_stops_reading_is_dropped(
    manager: aiocb.Manager, service: tuple[EngineService, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    reader, writer = await asyncio.open_unix_connection(service[1])
    assert (await read_frame(reader))[0] == "hello"
    (connection,) = service[0]._connections
    for key, prompt in enumerate(PROMPTS):  # then never read again
        writer.write(encode_frame(("add", [key], prompt, 2000, {"eos_token_id": []})))
    await wait_until_running(manager, len(PROMPTS))
    # What the engine's transport reports once the kernel's buffer is full too.
    transport = connection.writer.transport
    monkeypatch.setattr(transport, "get_write_buffer_size", lambda: remote_module.MAX_UNREAD_BYTES + 1)
    for _ in range(1200):  # a minute at most
        if not service[0].connections:
            break
        await asyncio.sleep(0.05)
    assert service[0].connections == 0, "the engine dropped the worker"
    assert transport.is_closing()
    stats = await wait_until_idle(manager)
    assert stats.free_blocks == stats.total_blocks and stats.running_requests == 0
    writer.close()


async def test_remote_samples_fork_in_the_engine(manager: aiocb.Manager, remote: RemoteManager) -> None:
    """n samples opened from a worker are one request in the engine: the prompt is computed once."""
    before = manager.statistics().prefix_hit_tokens
    streams = await remote.open_streams(PROMPTS[0], 4, 3, temperature=1.0, seed=3)
    outputs = [(await _last(stream))[0] for stream in streams]
    assert manager.statistics().prefix_hit_tokens - before == 2 * (len(PROMPTS[0]) - 1)
    local = await manager.generate(PROMPTS[0], n=3, max_new_tokens=4, temperature=1.0, seed=3)
    assert [o.generated_tokens for o in outputs] == [o.generated_tokens for o in local]
