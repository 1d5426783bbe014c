"""The engine behind a process boundary (``--api-workers``): :class:`EngineService` and
:class:`RemoteManager` over a real Unix socket, both on the test's loop."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import math
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import aiocb
from aiocb.server import build_app
from aiocb.server import remote as remote_module
from aiocb.server.remote import (
    EngineInfo,
    EngineService,
    OutputDelta,
    RemoteManager,
    RemoteStream,
    _WorkerConnection,
    encode_frame,
    read_frame,
)
from tests.conftest import LoopTurns, random_prompts
from tests.server.conftest import MODEL_NAME, wait_until_idle, wait_until_running

PROMPTS = random_prompts(4, 6, 30, seed=5)


def _info(manager: aiocb.Manager) -> EngineInfo:
    """What a fake engine says when a worker connects."""
    return EngineInfo(manager.config, manager.statistics(), False, manager.generation_config)


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


def test_an_error_crosses_as_the_nearest_class_the_worker_knows() -> None:
    """A subclass of a refusal (a config error met while adding a request) crossed as a
    dead engine: a 500 for a bad request."""
    from aiocb.server.remote import error_from_wire, error_to_wire

    wire = error_to_wire(aiocb.InvalidConfigError("bad value", param="seed"))
    assert wire == ("InvalidRequestError", "bad value", "seed")
    again = error_from_wire(wire)
    assert isinstance(again, aiocb.InvalidRequestError) and again.param == "seed"
    assert error_to_wire(KeyError("x"))[0] == "EngineDeadError"


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


async def test_a_drain_that_runs_out_refuses_a_request_the_engine_is_still_adding(
    manager: aiocb.Manager, remote: RemoteManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request whose add has not been answered yet (its constraint compiling, say) when
    the drain runs out is refused as the others are aborted, not left waiting for ever."""
    add_request = manager.add_request

    async def slow(*args: Any, **kwargs: Any) -> str:
        await asyncio.sleep(0.5)
        return await add_request(*args, **kwargs)

    monkeypatch.setattr(manager, "add_request", slow)
    adding = asyncio.create_task(remote.open_streams(PROMPTS[0], 4, 16))  # (samples: the awaited add)
    await asyncio.sleep(0.05)
    await remote.stop(timeout=0.05)
    with pytest.raises(aiocb.RequestAbortedError, match="drain ran out"):
        await asyncio.wait_for(adding, 5)
    await asyncio.sleep(0.6)  # (the engine adds it, finds it cancelled, and ends it)
    stats = await wait_until_idle(manager)
    assert stats.free_blocks == stats.total_blocks
    assert not manager._router._handles and not manager._router._results


async def test_large_checks_run_off_the_engines_loop(
    manager: aiocb.Manager, remote: RemoteManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Controls over thousands of ids and a prompt of tens of thousands are checked as the
    manager's awaited add checks them (on a worker thread), not on the engine's loop; the
    answers are the manager's."""
    nowait: list[int] = []
    add_request_nowait = manager.add_request_nowait

    def spied(input_ids: Any, *args: Any, **kwargs: Any) -> str:
        nowait.append(len(input_ids))
        return add_request_nowait(input_ids, *args, **kwargs)

    monkeypatch.setattr(manager, "add_request_nowait", spied)
    allowed = [token for token in range(1, 101) for _ in range(50)]  # (5,000 ids)
    added = await manager.add_request(PROMPTS[0], max_new_tokens=4, allowed_token_ids=allowed)
    local, _ = await _last(manager.stream(added))
    far, _ = await _last(await remote.open_stream(PROMPTS[0], 4, allowed_token_ids=allowed))
    assert far.generated_tokens == local.generated_tokens and set(far.generated_tokens) <= set(allowed)
    with pytest.raises(aiocb.InvalidRequestError, match="context"):
        await remote.open_stream([5] * 20_000, 2)
    await remote.open_stream(PROMPTS[1], 2)  # (an ordinary request: the quick way)
    assert nowait == [len(PROMPTS[1])]


async def test_a_long_prompts_scores_come_a_slice_a_frame(
    manager: aiocb.Manager, remote: RemoteManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An echoed prompt's scores leave the engine in frames of a bounded size (one frame of
    a 40,000-token prompt's held its loop 57 ms), and arrive whole, as the manager's."""
    monkeypatch.setattr(remote_module, "PROMPT_ENTRIES_PER_FRAME", 8)
    kinds: list[str] = []
    queue = _WorkerConnection._queue

    def spied(self: _WorkerConnection, key: int, event: tuple[Any, ...]) -> None:
        kinds.append(event[0])
        queue(self, key, event)

    monkeypatch.setattr(_WorkerConnection, "_queue", spied)
    params = {"prompt_logprobs": True, "top_logprobs": 3, "return_logprobs": True}
    prompt = PROMPTS[1]
    local, _ = await _last(manager.stream(manager.add_request_nowait(prompt, max_new_tokens=3, **params)))
    far, _ = await _last(await remote.open_stream(prompt, 3, **params))
    assert kinds.count("prompt") == math.ceil(len(prompt) / 2) - 1  # (2 positions of 4 entries a frame)
    assert far.prompt_logprobs == local.prompt_logprobs and far.prompt_top_logprobs == local.prompt_top_logprobs
    assert far.generated_tokens == local.generated_tokens and far.logprobs == local.logprobs


async def test_slices_queued_together_leave_in_frames_of_a_bounded_size(
    manager: aiocb.Manager, remote: RemoteManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several streams' prompt slices queued in one turn of the loop went out as one frame
    (a worker read such frames for up to 5 ms): each frame holds one slice's worth."""
    monkeypatch.setattr(remote_module, "PROMPT_ENTRIES_PER_FRAME", 8)
    frames: list[int] = []  # (each batch's events that carry a slice of a prompt's scores)
    encode = remote_module.encode_frame

    def spied(message: Any) -> bytes:
        if message[0] == "batch":
            slices = [e for _, e in message[1] if e[0] == "prompt" or (e[0] == "output" and e[1][3] is not None)]
            frames.append(len(slices))
        return encode(message)

    monkeypatch.setattr(remote_module, "encode_frame", spied)
    params = {"prompt_logprobs": True, "top_logprobs": 3, "return_logprobs": True}
    streams = [await remote.open_stream(prompt, 2, **params) for prompt in PROMPTS[:3]]
    outputs = await asyncio.gather(*(_last(stream) for stream in streams))
    assert sum(frames) > 2 * len(streams) and max(frames) == 1, frames  # (a slice is the 8 entries a frame takes)
    for prompt, (far, _) in zip(PROMPTS[:3], outputs, strict=True):
        local, _ = await _last(manager.stream(manager.add_request_nowait(prompt, max_new_tokens=2, **params)))
        assert far.prompt_logprobs == local.prompt_logprobs and far.prompt_top_logprobs == local.prompt_top_logprobs


async def test_a_worker_refuses_what_comes_after_its_drain_began(manager: aiocb.Manager, remote: RemoteManager) -> None:
    """A request still being prepared when the drain began (a long prompt tokenizing, say)
    is refused as the manager refuses it after its stop: it would outlive the drain."""
    await remote.stop(timeout=1)
    with pytest.raises(aiocb.ManagerClosedError, match="shutting down"):
        await remote.open_stream(PROMPTS[0], 2)


async def test_a_silent_engine_is_taken_for_hung(
    manager: aiocb.Manager, tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine that stops answering (its loop stuck) fails the worker's open streams,
    turns /health and /ready to 503 saying so, and has new requests refused, until it is
    heard from again."""
    monkeypatch.setattr(remote_module, "ENGINE_SILENCE_S", 0.3)
    speak = asyncio.Event()
    cancelled: list[int] = []

    async def fake_engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(encode_frame(("hello", _info(manager))))
        _, keys, *_ = await read_frame(reader)
        writer.write(encode_frame(("batch", [(key, ("added",)) for key in keys])))
        cancelled.append((await read_frame(reader))[1])  # (silent meanwhile: the worker gives up)
        await speak.wait()
        writer.write(encode_frame(("stats", manager.statistics(), False)))
        with contextlib.suppress(ConnectionError):
            await reader.read()
        writer.close()

    path = str(tmp_path / "silent-engine.sock")
    server = await asyncio.start_unix_server(fake_engine, path)
    worker = await RemoteManager.connect(path, manager.model.config)
    app = build_app(worker, tokenizer, MODEL_NAME)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            stream = await worker.open_stream([1, 2, 3], 4)
            with pytest.raises(aiocb.EngineDeadError, match="has not answered for"):
                await asyncio.wait_for(_last(stream), 5)
            assert cancelled == [0]
            for path_ in ("/health", "/ready"):
                answer = await http.get(path_)
                assert answer.status_code == 503 and "has not answered" in answer.json()["error"]["message"]
            # (its statistics are a copy from before it fell silent: the gauge says what /health says,
            # and its counters, which another worker may have served later values of, are left out:
            # one that went back would read as a reset)
            scraped = (await http.get("/metrics")).text
            assert 'aiocb_engine_running{model_name="tiny-qwen3"} 0.0' in scraped
            assert "aiocb_kv_cache_usage_perc" in scraped and "aiocb_engine_steps_total" not in scraped
            assert not worker._asking, "a scrape asks a hung engine nothing (the questions piled up)"
            with pytest.raises(aiocb.ManagerClosedError, match="has not answered"):
                await worker.open_stream([1, 2, 3], 4)
            speak.set()
            for _ in range(100):
                if worker.silence() is None:
                    break
                await asyncio.sleep(0.01)
            assert (await http.get("/health")).status_code == 200
    finally:
        await worker.close()
        server.close()
        await server.wait_closed()


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


async def test_frames_that_arrive_together_are_handled_a_slice_at_a_time(
    manager: aiocb.Manager, service: tuple[EngineService, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A burst of frames already buffered was read and handled without a wait: a thousand
    # adds held the engine's loop for a tenth of a second.
    monkeypatch.setattr("aiocb.engine.turns.SLICE", 0.0)  # give the loop back after every unit
    turns = LoopTurns()
    handled_at: list[int] = []
    handle = remote_module._WorkerConnection.handle

    def recorded(self: Any, message: tuple[Any, ...]) -> None:
        handled_at.append(turns.turns)
        handle(self, message)

    monkeypatch.setattr(remote_module._WorkerConnection, "handle", recorded)
    reader, writer = await asyncio.open_unix_connection(service[1])
    assert (await read_frame(reader))[0] == "hello"
    frames = [encode_frame(("add", [key], PROMPTS[key % 4], 2, {})) for key in range(64)]
    async with turns:
        writer.write(b"".join(frames))
        for _ in range(400):
            if len(handled_at) == len(frames):
                break
            await asyncio.sleep(0.005)
    assert len(handled_at) == len(frames)
    assert turns.gave_back(handled_at) >= len(frames) - 4, "the loop was not given back between frames"
    stats = await wait_until_idle(manager, within_s=30)
    assert stats.free_blocks == stats.total_blocks
    writer.close()


async def test_remote_samples_fork_in_the_engine(manager: aiocb.Manager, remote: RemoteManager) -> None:
    """n samples opened from a worker are one request in the engine: the prompt is computed once."""
    before = manager.statistics().prefix_hit_tokens
    streams = await remote.open_streams(PROMPTS[0], 4, 3, temperature=1.0, seed=3)
    outputs = [(await _last(stream))[0] for stream in streams]
    assert manager.statistics().prefix_hit_tokens - before == 2 * (len(PROMPTS[0]) - 1)
    local = await manager.generate(PROMPTS[0], n=3, max_new_tokens=4, temperature=1.0, seed=3)
    assert [o.generated_tokens for o in outputs] == [o.generated_tokens for o in local]


@pytest.mark.parametrize("new_tokens", [1, 4])
async def test_many_samples_are_added_a_slice_at_a_time_and_stay_exact(
    manager: aiocb.Manager, remote: RemoteManager, monkeypatch: pytest.MonkeyPatch, new_tokens: int
) -> None:
    """A request with many samples is made in the engine over several loop turns; its
    samples equal the manager's own (one token: some end before their streams exist)."""
    monkeypatch.setattr("aiocb.engine.turns.SLICE", 0.0)  # give the loop back after every sample
    n = remote_module._SLICED_SAMPLES + 8
    streams = await remote.open_streams(PROMPTS[1], new_tokens, n, temperature=1.0, seed=11)
    outputs = [(await _last(stream))[0] for stream in streams]
    local = await manager.generate(PROMPTS[1], n=n, max_new_tokens=new_tokens, temperature=1.0, seed=11)
    assert [o.generated_tokens for o in outputs] == [o.generated_tokens for o in local]
    assert {len(o.generated_tokens) for o in outputs} == {new_tokens}


async def test_samples_cancelled_while_being_added_end_in_the_engine(
    manager: aiocb.Manager, remote: RemoteManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("aiocb.engine.turns.SLICE", 0.0)
    n = remote_module._SLICED_SAMPLES + 8
    opening = asyncio.create_task(remote.open_streams(PROMPTS[2], 500, n, temperature=1.0, eos_token_id=[]))
    await asyncio.sleep(0)  # the add is on its way: cancel it before its samples are all made
    await asyncio.sleep(0)
    opening.cancel()
    with pytest.raises(asyncio.CancelledError):
        await opening
    stats = await wait_until_idle(manager)
    assert (stats.running_requests, stats.waiting_requests) == (0, 0)
    assert stats.free_blocks == stats.total_blocks
    assert not remote._streams
    # Nothing of them waits in the engine's shared results, which nobody there reads.
    assert not manager._router._handles and not manager._router._results


async def test_a_request_cancelled_while_the_engine_adds_it_leaves_nothing_there(
    manager: aiocb.Manager, remote: RemoteManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled while the engine awaits its add (many samples, or a constraint compiling),
    each of its samples ends and is let go of: they waited in the engine's shared results,
    which nobody there reads."""
    add_request = manager.add_request

    async def slow(*args: Any, **kwargs: Any) -> str:
        await asyncio.sleep(0.2)
        return await add_request(*args, **kwargs)

    monkeypatch.setattr(manager, "add_request", slow)
    opening = asyncio.create_task(remote.open_streams(PROMPTS[0], 8, 16))
    await asyncio.sleep(0.05)
    opening.cancel()
    with pytest.raises(asyncio.CancelledError):
        await opening
    await asyncio.sleep(0.4)  # (the engine adds it, finds it cancelled, and ends it)
    stats = await wait_until_idle(manager)
    assert stats.free_blocks == stats.total_blocks
    assert not manager._router._handles and not manager._router._results


async def test_one_frame_of_outputs_wakes_its_consumers_a_few_at_a_time(manager: aiocb.Manager, tmp_path: Path) -> None:
    """A frame carrying outputs for 200 streams: their consumers (slow, as a server's are)
    resume a loop iteration's budget at a time, not all in the same iteration."""
    count = 200
    everything_added = asyncio.Event()
    send_outputs = asyncio.Event()

    engine_done = asyncio.Event()

    async def fake_engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            writer.write(encode_frame(("hello", _info(manager))))
            keys: list[int] = []
            while len(keys) < count:
                _, added, *_ = await read_frame(reader)
                keys += added
                writer.write(encode_frame(("batch", [(key, ("added",)) for key in added])))
            everything_added.set()
            await send_outputs.wait()
            delta = OutputDelta([7], None, None, None, None, 3, "length", None, 0.0, None, None, None, None, 0)
            writer.write(encode_frame(("batch", [(key, ("output", tuple(delta))) for key in keys])))
            await writer.drain()
            await reader.read()  # (until the worker hangs up)
        finally:
            writer.close()
            engine_done.set()

    path = str(tmp_path / "fake-engine.sock")
    server = await asyncio.start_unix_server(fake_engine, path)
    worker = await RemoteManager.connect(path, manager.model.config)
    loop = asyncio.get_running_loop()
    iteration = 0
    ticking = True

    def tick() -> None:  # once a loop iteration
        nonlocal iteration
        iteration += 1
        if ticking:
            loop.call_soon(tick)

    resumed_in: list[int] = []

    async def consume(stream: RemoteStream) -> list[int]:
        output = await stream.__anext__()
        resumed_in.append(iteration)
        started = time.perf_counter()
        while time.perf_counter() - started < 2e-4:  # a server's consumer formats a chunk
            pass
        return output.generated_tokens

    try:
        streams = [await worker.open_stream([1, 2, 3], 1) for _ in range(count)]
        await everything_added.wait()
        consumers = [asyncio.create_task(consume(stream)) for stream in streams]
        for _ in range(3):
            await asyncio.sleep(0)  # every consumer asleep on its stream
        tick()
        send_outputs.set()
        assert await asyncio.gather(*consumers) == [[7]] * count
    finally:
        ticking = False
        await worker.close()
        await engine_done.wait()
        server.close()
        await server.wait_closed()
    per_iteration = collections.Counter(resumed_in)
    assert max(per_iteration.values()) <= 16, per_iteration


async def test_metrics_scraped_through_any_worker_never_go_back(
    manager: aiocb.Manager,
    service: tuple[EngineService, str],
    tokenizer: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each worker's copy of the engine's statistics is sent a few times a second, out of
    step with the others': a scrape takes them fresh from the engine instead, so a scraper
    whose scrapes land on different workers sees every counter as the engine has it."""
    from prometheus_client.parser import text_string_to_metric_families

    monkeypatch.setattr(remote_module, "STATS_INTERVAL_S", 3600.0)  # (no copies sent meanwhile)
    workers = [await RemoteManager.connect(service[1], manager.model.config) for _ in range(2)]
    try:
        clients = [
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app=build_app(w, tokenizer, MODEL_NAME)), base_url="http://t"
            )
            for w in workers
        ]
        for round_ in range(3):
            await _last(await workers[round_ % 2].open_stream(PROMPTS[round_], 6))
            for client in clients:
                text = (await client.get("/metrics")).text
                value = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
                assert value["aiocb_engine_steps_total"] == manager.statistics().steps > 0
        for client in clients:
            await client.aclose()
    finally:
        for worker in workers:
            await worker.close()


async def test_a_constrained_request_compiles_off_the_engines_loop(
    model: Any, tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An output constraint (a large one compiles for seconds) is compiled on a worker
    thread, as the manager's awaited add does, not on the engine's loop, whose steps feed
    every worker's streams; the output keeps to it."""
    pytest.importorskip("xgrammar")
    import threading

    from aiocb.structured import GrammarCompiler
    from tests.server.conftest import serve_config

    compiled_on: list[bool] = []
    compile_ = GrammarCompiler.compile

    def spied(self: GrammarCompiler, structure: tuple[str, str]) -> Any:
        if not self.is_cached(structure):  # (a compile, not a lookup)
            compiled_on.append(threading.current_thread() is threading.main_thread())
        return compile_(self, structure)

    monkeypatch.setattr(GrammarCompiler, "compile", spied)
    config = serve_config()
    async with aiocb.Manager(model, continuous_batching_config=config, grammar_tokenizer=tokenizer) as manager:
        engine = EngineService(manager)
        path = str(tmp_path / "engine.sock")
        await engine.start(path)
        remote = await RemoteManager.connect(path, model.config)
        try:
            prompt = tokenizer.encode("digits: ")
            output, _ = await _last(await remote.open_stream(prompt, 8, regex="[0-9]{3}", temperature=1.0, seed=1))
        finally:
            await remote.close()
            await engine.close()
    assert compiled_on == [False], "compiled once, off the loop's thread"
    assert re.fullmatch("[0-9]{3}", tokenizer.decode(output.generated_tokens, skip_special_tokens=True))


async def test_streams_opened_when_their_submission_is_cancelled_are_closed_then() -> None:
    """Cancelled while other prompts' streams were still opening (a forced shutdown, say),
    the submission left those already open to the garbage collector to cancel."""
    from aiocb.server.serving import ChoiceSpec, _submit_remote

    closed: list[int] = []
    second_asked = asyncio.Event()

    class Stream:
        def __init__(self, key: int) -> None:
            self.key = key

        async def aclose(self) -> None:
            closed.append(self.key)

    class Opening:
        async def open_streams(self, prompt: list[int], *_: Any, **__: Any) -> list[Stream]:
            if prompt == [2]:
                second_asked.set()
                await asyncio.Event().wait()  # (never opens)
            return [Stream(prompt[0])]

    specs = [ChoiceSpec(i, [i + 1], 4, {}, (), True) for i in range(2)]
    submission = asyncio.create_task(_submit_remote(Opening(), specs))  # type: ignore[arg-type]
    await second_asked.wait()
    await asyncio.sleep(0)
    submission.cancel()
    with pytest.raises(asyncio.CancelledError):
        await submission
    assert closed == [1]
