"""A real uvicorn server on 127.0.0.1, driven by the official ``openai`` client and by httpx."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI
from transformers import PreTrainedModel

import aiocb
from tests.conftest import arm_failure
from tests.server.conftest import (
    API_KEY,
    MODEL_NAME,
    LiveServer,
    live_server,
    serve_config,
    serve_model,
    wait_until_idle,
    wait_until_running,
)

PROMPT = "Once upon a time"
NO_EOS = {"ignore_eos": True}


@pytest.fixture
async def openai_client(server: LiveServer) -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60) as client:
        yield client


async def test_completions(openai_client: AsyncOpenAI, server: LiveServer, tokenizer: Any) -> None:
    completion = await openai_client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0, extra_body=NO_EOS
    )
    reference = await server.manager.generate(
        tokenizer.encode(PROMPT), max_new_tokens=8, do_sample=False, eos_token_id=[]
    )
    assert completion.choices[0].text == tokenizer.decode(reference.generated_tokens, skip_special_tokens=True)
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 8
    assert completion.usage.prompt_tokens == len(tokenizer.encode(PROMPT))

    stream = await openai_client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=NO_EOS,
    )
    texts: list[str] = []
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        texts.extend(choice.text for choice in chunk.choices)
    assert "".join(texts) == completion.choices[0].text
    assert usage is not None
    assert usage.total_tokens == completion.usage.total_tokens


async def test_completions_logprobs_and_echo(openai_client: AsyncOpenAI, tokenizer: Any) -> None:
    ids = tokenizer.encode("Question: How many legs does a spider have? Answer: eight.")
    completion = await openai_client.completions.create(
        model=MODEL_NAME, prompt=ids, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.token_logprobs is not None
    assert logprobs.top_logprobs is not None
    assert len(logprobs.token_logprobs) == len(ids)
    assert logprobs.token_logprobs[0] is None
    assert all(lp is not None and lp < 0 for lp in logprobs.token_logprobs[1:])


async def test_chat(openai_client: AsyncOpenAI) -> None:
    messages: list[Any] = [{"role": "user", "content": "Tell me a story."}]
    chat = await openai_client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_completion_tokens=8, temperature=0, extra_body=NO_EOS
    )
    message = chat.choices[0].message
    assert message.role == "assistant"
    assert message.content
    assert chat.usage is not None
    assert chat.usage.completion_tokens == 8

    stream = await openai_client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=NO_EOS,
    )
    pieces: list[str] = []
    finish = []
    usage = None
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish.append(choice.finish_reason)
    assert "".join(pieces) == message.content
    assert finish[-1] == "length"
    assert usage is not None
    assert usage.completion_tokens == 8


async def test_error_mapping(openai_client: AsyncOpenAI, server: LiveServer) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        await openai_client.completions.create(model=MODEL_NAME, prompt=PROMPT, temperature=5)
    assert bad.value.param == "temperature"
    with pytest.raises(openai.NotFoundError) as missing:
        await openai_client.completions.create(model="gpt-9", prompt=PROMPT)
    assert missing.value.code == "model_not_found"
    image: list[Any] = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(openai.BadRequestError):
        await openai_client.chat.completions.create(model=MODEL_NAME, messages=image)
    async with AsyncOpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0) as intruder:
        with pytest.raises(openai.AuthenticationError):
            await intruder.models.list()
    models = await openai_client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]


async def test_rate_limit_and_engine_failure(tokenizer: Any) -> None:
    model = serve_model(tokenizer)
    failing = arm_failure(model)
    manager = aiocb.Manager(model, continuous_batching_config=serve_config(max_queue_size=1, max_requests_per_batch=1))
    async with live_server(manager, tokenizer) as server:  # the server's lifespan starts the manager
        assert manager.is_running
        async with AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
            ids = tokenizer.encode(PROMPT)
            running = await manager.add_request(ids, max_new_tokens=500, eos_token_id=[])
            await wait_until_running(manager, 1)
            queued = await manager.add_request(ids, max_new_tokens=5)
            with pytest.raises(openai.RateLimitError):
                await client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2)
            manager.cancel_request(running)
            manager.cancel_request(queued)
            failing["fail"] = True
            with pytest.raises(openai.InternalServerError):
                await client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2)
    assert not manager.is_running
    await manager.destroy()


async def test_the_lifespan_stops_the_manager_it_started(model: PreTrainedModel, tokenizer: Any) -> None:
    manager = aiocb.Manager(model, continuous_batching_config=serve_config())
    async with live_server(manager, tokenizer) as server, httpx.AsyncClient(base_url=server.url) as http:
        assert manager.is_running
        assert (await http.get("/health")).status_code == 200
    assert not manager.is_running
    await manager.destroy()


async def test_local_server_serves_an_app_on_a_free_port(model: PreTrainedModel, tokenizer: Any) -> None:
    from aiocb.server import build_app
    from aiocb.server.connections import local_server

    manager = aiocb.Manager(model, continuous_batching_config=serve_config())
    async with local_server(build_app(manager, tokenizer, "m")) as url, httpx.AsyncClient(base_url=url) as http:
        assert url.startswith("http://127.0.0.1:")
        body = {"prompt": "hi", "max_tokens": 3, "ignore_eos": True}  # (sampled: an EOS may come early)
        assert (await http.post("/v1/completions", json=body)).json()["usage"]["completion_tokens"] == 3
    assert not manager.is_running  # (the app's lifespan stopped the manager it started)
    await manager.destroy()


# --------------------------------------------------------------------------- disconnects


async def _read_chunks(response: httpx.Response, count: int) -> list[Any]:
    chunks: list[Any] = []
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            chunks.append(json.loads(line[len("data: ") :]))
            if len(chunks) >= count:
                break
    return chunks


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
async def test_a_client_that_disconnects_mid_stream_frees_its_request(server: LiveServer, route: str) -> None:
    body: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 1000, "stream": True, "n": 2, **NO_EOS}
    body.update({"prompt": PROMPT} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]})
    headers = {"Authorization": f"Bearer {API_KEY}"}
    manager = server.manager
    async with httpx.AsyncClient(base_url=server.url, headers=headers) as http:
        async with http.stream("POST", route, json=body) as response:
            assert response.status_code == 200
            chunks = await _read_chunks(response, 4)
            assert len(chunks) == 4
            assert manager.statistics().running_requests == 2
        # The response is closed: the connection is gone.
        steps = manager.statistics().steps
        stats = await wait_until_idle(manager)
    assert stats.running_requests == 0
    assert stats.waiting_requests == 0
    assert stats.free_blocks == stats.total_blocks
    assert stats.steps <= steps + 2, "the requests ended within a step of the disconnect"
    assert await _clients_gone(server) == 1


async def test_closing_an_openai_stream_frees_its_request(openai_client: AsyncOpenAI, server: LiveServer) -> None:
    stream = await openai_client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=1000, stream=True, extra_body=NO_EOS
    )
    seen = 0
    async for _ in stream:
        seen += 1
        if seen == 3:
            break
    await stream.close()
    stats = await wait_until_idle(server.manager)
    assert stats.running_requests == 0
    assert stats.free_blocks == stats.total_blocks


async def test_a_client_that_gives_up_on_a_whole_response_frees_its_request(server: LiveServer) -> None:
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 1000, **NO_EOS}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=0.5) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post("/v1/completions", json=body)
    stats = await wait_until_idle(server.manager)
    assert stats.running_requests == 0
    assert stats.free_blocks == stats.total_blocks
    assert await _clients_gone(server) == 1


async def _clients_gone(server: LiveServer) -> float:
    """The server's count of responses whose client went first (status 499)."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=server.url, headers=headers) as http:
        for _ in range(50):  # (counted when the server sees the connection gone)
            text = (await http.get("/metrics")).text
            for line in text.splitlines():
                if line.startswith("aiocb_http_errors_total{") and 'status="499"' in line:
                    return float(line.rsplit(" ", 1)[1])
            await asyncio.sleep(0.02)
    return 0.0


async def test_many_concurrent_streams(server: LiveServer) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=server.url, headers=headers, limits=limits, timeout=60) as http:

        async def one(i: int) -> str:
            body = {"prompt": f"{PROMPT} {i}", "max_tokens": 6, "stream": True, "seed": i, **NO_EOS}
            async with http.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
            assert lines[-1] == "data: [DONE]"
            return "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1])

        texts = await asyncio.gather(*(one(i) for i in range(40)))
    assert len(texts) == 40
    stats = await wait_until_idle(server.manager)
    assert stats.free_blocks == stats.total_blocks
