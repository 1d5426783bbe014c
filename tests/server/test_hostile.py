"""Hostile and malformed requests: each refused with a 400 naming the field (never a 500, a
stall, a leak, or a parameter that silently does nothing), and the loop kept responsive
while a request brings many prompts."""

from __future__ import annotations

import asyncio
import copy
import gc
import json
import sys
import threading
import time
from typing import Any

import httpx
import pytest

import aiocb
from aiocb import collector, gil
from aiocb.server import build_app, context
from aiocb.server.context import ServerContext
from aiocb.server.limits import ServerLimits
from aiocb.tokenizer_process import Tokenized
from tests.server.conftest import MODEL_NAME, serve_config, wait_until_idle
from tests.server.test_asgi import assert_error

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


def body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 4, **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, **fields}


async def still_serves(client: httpx.AsyncClient, manager: aiocb.Manager) -> None:
    """A plain request still completes and every block is free again."""
    response = await client.post(COMPLETIONS, json=body())
    assert response.status_code == 200, response.text
    stats = await wait_until_idle(manager)
    assert stats.free_blocks == stats.total_blocks


# --------------------------------------------------------------------------- templates


async def test_chat_template_kwargs_cannot_replace_the_template_or_do_nothing(
    client: httpx.AsyncClient, manager: aiocb.Manager, tokenizer: Any
) -> None:
    # A client's own template would run its Jinja code in the server (nested loops: seconds).
    slow = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
    for key, value in (("chat_template", slow), ("tokenize", True), ("tools", []), ("add_generation_prompt", False)):
        error = assert_error(await client.post(CHAT, json=chat(chat_template_kwargs={key: value})), 400)
        assert error["param"] == "chat_template_kwargs" and repr(key) in error["message"]
    # The test template reads no variable of its own: any other key would change nothing.
    for key, value in (("enable_thinking", False), ("documents", [{"title": "t", "text": "x"}])):
        error = assert_error(await client.post(CHAT, json=chat(chat_template_kwargs={key: value})), 400)
        assert "does not use" in error["message"] and repr(key) in error["message"]
    await still_serves(client, manager)

    thinking = copy.deepcopy(tokenizer)
    thinking.chat_template = (
        "{% for message in messages %}{{ message['content'] }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    )
    app = build_app(manager, thinking, MODEL_NAME)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as other:
        request = {
            "messages": [{"role": "user", "content": "Hello"}],
            "chat_template_kwargs": {"enable_thinking": False},
        }
        tokens = (await other.post("/tokenize", json=request)).json()["tokens"]
        assert thinking.decode(tokens).endswith("<think></think>")
        response = await other.post(CHAT, json={**request, "max_tokens": 2})
        assert response.status_code == 200, response.text


# --------------------------------------------------------------------------- no 500s


@pytest.mark.parametrize("bias", [[1, 2], "x", 5, [[1]], [[1, 2, 3]]])
async def test_logit_bias_of_the_wrong_shape_is_a_400(client: httpx.AsyncClient, bias: Any) -> None:
    for path, request in ((COMPLETIONS, body(logit_bias=bias)), (CHAT, chat(logit_bias=bias))):
        assert_error(await client.post(path, json=request), 400, "logit_bias")


def test_bias_maps_of_the_wrong_shape_raise_naming_the_parameter() -> None:
    for name, value in (("logit_bias", [1, 2]), ("sequence_bias", [1, 2]), ("sequence_bias", 7)):
        with pytest.raises(aiocb.InvalidRequestError, match=name) as raised:
            aiocb.SamplingParams(**{name: value})
        assert raised.value.param == name
    assert aiocb.SamplingParams(sequence_bias=[[[3, 4], -2.0]]).sequence_bias == (((3, 4), -2.0),)


async def post_escaped(client: httpx.AsyncClient, path: str, value: Any) -> httpx.Response:
    """``value`` sent as JSON with every non-ASCII character escaped (a lone surrogate too)."""
    return await client.post(path, content=json.dumps(value).encode(), headers={"content-type": "application/json"})


async def test_text_that_is_not_unicode_is_a_400(client: httpx.AsyncClient, manager: aiocb.Manager) -> None:
    # "\ud800" is valid JSON and a lone surrogate in Python: no tokenizer takes it.
    assert_error(await post_escaped(client, COMPLETIONS, body(prompt="abc\ud800")), 400, "prompt")
    assert_error(await post_escaped(client, COMPLETIONS, body(prompt=["ok", "\ud800"])), 400, "prompt")
    message = {"role": "user", "content": "\ud800"}
    assert_error(await post_escaped(client, CHAT, chat(messages=[message])), 400, "messages")
    assert_error(await post_escaped(client, "/tokenize", {"prompt": "\ud800"}), 400, "prompt")
    # A stop string no decoded output can hold would never stop anything.
    assert_error(await post_escaped(client, COMPLETIONS, body(stop=["ok", "a\ud800"])), 400, "stop")
    with pytest.raises(aiocb.InvalidRequestError, match="not Unicode text") as raised:
        aiocb.SamplingParams(stop="\udc00")
    assert raised.value.param == "stop"
    # Errors that quote it back are still JSON (escaped), not a plain-text 500.
    error = assert_error(await post_escaped(client, COMPLETIONS, body(model="m\ud800")), 404, "model")
    assert "\ud800" in error["message"]
    assert_error(await post_escaped(client, COMPLETIONS, {**body(), "\ud800": 1}), 400, "\ud800")
    await still_serves(client, manager)


async def test_an_integer_too_long_to_convert_is_a_400(client: httpx.AsyncClient) -> None:
    raw = b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}"
    error = assert_error(await client.post(COMPLETIONS, content=raw, headers={"content-type": "application/json"}), 400)
    assert "not valid JSON" in error["message"]


# --------------------------------------------------------------------------- nothing silently ignored


async def test_parameters_that_would_do_nothing_are_refused(client: httpx.AsyncClient, manager: aiocb.Manager) -> None:
    assert_error(await client.post(COMPLETIONS, json=body(stop=[""])), 400, "stop")
    assert_error(await client.post(COMPLETIONS, json=body(stop=["a", ""])), 400, "stop")
    error = assert_error(await client.post(COMPLETIONS, json=body(min_tokens=10, max_tokens=4)), 400, "min_tokens")
    assert "is more than max_tokens (4)" in error["message"]
    # the engine's refusals name the body's fields too
    error = assert_error(await client.post(COMPLETIONS, json=body(max_tokens=5000)), 400, "max_tokens")
    assert "plus max_tokens (5000)" in error["message"] and "max_new_tokens" not in error["message"]
    options = {"include_usage": True}
    assert_error(await client.post(COMPLETIONS, json=body(stream_options=options)), 400, "stream_options")
    streamed = body(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": 1})
    error = assert_error(await client.post(COMPLETIONS, json=streamed), 400, "stream_options.continuous_usage_stats")
    assert "must be true or false" in error["message"]
    for value in (0, [], False):
        assert_error(await client.post(COMPLETIONS, json=body(suffix=value)), 400, "suffix")
    for value in ({}, "", False):
        assert_error(await client.post(CHAT, json=chat(tools=value)), 400, "tools")
    assert_error(await client.post(COMPLETIONS, json=body(seed=2**63)), 400, "seed")
    assert_error(await client.post(COMPLETIONS, json=body(seed=-(2**63) - 1)), 400, "seed")
    assert (await client.post(COMPLETIONS, json=body(seed=2**63 - 1, n=3, temperature=1.0))).status_code == 200
    await still_serves(client, manager)


async def test_empty_stop_token_ids_of_another_type_are_refused(
    client: httpx.AsyncClient, manager: aiocb.Manager
) -> None:
    for value in (0, False, "", {}):
        error = assert_error(await client.post(COMPLETIONS, json=body(stop_token_ids=value)), 400, "stop_token_ids")
        assert "list of token ids" in error["message"]
    for value in ([], None):
        assert (await client.post(COMPLETIONS, json=body(stop_token_ids=value))).status_code == 200
    await still_serves(client, manager)


async def test_a_conversation_that_fills_the_kv_cache_gets_a_one_token_reply(model: Any, tokenizer: Any) -> None:
    """A chat that gives no length gets what the cache leaves: its last token needs no slot,
    so a conversation of the cache's size gets one token; one past it, a 400."""
    config = serve_config(num_blocks=2)  # (32 tokens, far below the model's context)
    async with aiocb.Manager(model, continuous_batching_config=config) as manager:
        app = build_app(manager, tokenizer, MODEL_NAME)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:

            async def rendered(content: str) -> int:
                counted = await client.post("/tokenize", json={"messages": [{"role": "user", "content": content}]})
                return int(counted.json()["count"])

            words = 32 - await rendered("")
            while await rendered("a " * words) > 32:
                words -= 1
            assert await rendered("a " * words) == 32 and await rendered("a " * (words + 1)) > 32
            messages = [{"role": "user", "content": "a " * words}]
            response = await client.post(CHAT, json=chat(messages=messages, max_tokens=None))
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == 1
            messages = [{"role": "user", "content": "a " * (words + 1)}]
            error = assert_error(
                await client.post(CHAT, json=chat(messages=messages, max_tokens=None)), 400, "messages"
            )
            assert "leaves no room for a reply in the KV cache (32 tokens)" in error["message"]
        assert (await wait_until_idle(manager)).free_blocks == 2


async def test_a_prompt_that_fills_the_context_is_refused_naming_what_the_client_sent(
    client: httpx.AsyncClient, manager: aiocb.Manager, tokenizer: Any
) -> None:
    ctx: ServerContext = client._transport.app.state.aiocb  # type: ignore[attr-defined]
    assert ctx.max_model_len is not None
    full = ctx.max_model_len

    # A conversation that fills the context, with no length given: no length is blamed.
    async def rendered(content: str) -> int:
        counted = await client.post("/tokenize", json={"messages": [{"role": "user", "content": content}]})
        return int(counted.json()["count"])

    words = full - await rendered("")
    while await rendered("a " * words) > full:
        words -= 1
    content = "a " * words
    assert await rendered(content) == full
    error = assert_error(
        await client.post(CHAT, json=chat(messages=[{"role": "user", "content": content}], max_tokens=None)),
        400,
        "messages",
    )
    assert f"leaves no room for a reply in the model's context length of {full}" in error["message"]
    assert "max_completion_tokens" not in error["message"]
    # Scoring alone (max_tokens 0) takes prompts a token short of the context, and says so.
    scored = body(prompt=[5] * (full - 1), max_tokens=0, echo=True, logprobs=0)
    response = await client.post(COMPLETIONS, json=scored)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"][0]["logprobs"]["tokens"]) == full - 1
    for prompt in ([5] * full, [[5, 6], [5] * full]):
        error = assert_error(await client.post(COMPLETIONS, json={**scored, "prompt": prompt}), 400, "prompt")
        where = "prompt[1]" if len(prompt) == 2 else "prompt"
        assert error["message"].startswith(f"{where} ({full} tokens) fills the model's context length of {full}")
        assert "max_tokens (1)" not in error["message"]
    await still_serves(client, manager)


async def test_max_model_len_bounds_the_served_lengths(model: Any, tokenizer: Any) -> None:
    async with aiocb.Manager(model, continuous_batching_config=serve_config(max_model_len=64)) as manager:
        app = build_app(manager, tokenizer, MODEL_NAME)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            card = (await client.get(f"/v1/models/{MODEL_NAME}")).json()
            assert card["max_model_len"] == 64
            hello = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hello"}], "ignore_eos": True}
            prompt = (await client.post("/tokenize", json={"messages": hello["messages"]})).json()["count"]
            reply = (await client.post(CHAT, json=hello)).json()  # (no length: up to the bound)
            assert reply["usage"] == {
                "prompt_tokens": prompt,
                "completion_tokens": 64 - prompt,
                "total_tokens": 64,
                **{
                    k: v
                    for k, v in reply["usage"].items()
                    if k not in ("prompt_tokens", "completion_tokens", "total_tokens")
                },
            }
            error = assert_error(
                await client.post(COMPLETIONS, json=body(prompt=[5] * 60, max_tokens=5)), 400, "max_tokens"
            )
            assert "context length of 64" in error["message"]
            await still_serves(client, manager)


async def test_chat_messages_bring_only_fields_the_template_takes(client: httpx.AsyncClient) -> None:
    extra = {"role": "user", "content": "Hello", "colour": "blue"}
    error = assert_error(await client.post(CHAT, json=chat(messages=[extra])), 400, "messages[0].colour")
    assert "colour" in error["message"]
    # A response's message sent back as it came: empty OpenAI fields are accepted.
    echoed = {"role": "assistant", "content": "Hi", "refusal": None, "annotations": [], "function_call": None}
    messages = [{"role": "user", "content": "Hello"}, echoed, {"role": "user", "content": "Again"}]
    assert (await client.post(CHAT, json=chat(messages=messages))).status_code == 200
    refused = {**echoed, "refusal": "I cannot"}
    assert_error(await client.post(CHAT, json=chat(messages=[refused, messages[2]])), 400, "messages[0].refusal")
    for arguments in (3, [1, 2]):
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
        calls = [{"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "user", "content": "ok"}]
        where = "messages[0].tool_calls[0].function.arguments"
        error = assert_error(await client.post(CHAT, json=chat(messages=calls)), 400, where)
        assert where in error["message"]


async def test_tokenize_and_detokenize_refuse_unknown_fields_and_unbounded_input(
    client: httpx.AsyncClient, tokenizer: Any
) -> None:
    assert_error(await client.post("/tokenize", json={"prompt": "hi", "return_token_strs": True}), 400)
    assert_error(await client.post("/detokenize", json={"tokens": [1, 2], "skip_special_tokens": True}), 400)
    error = assert_error(await client.post("/tokenize", json={"prompt": "z" * 10_000_000}), 413)
    assert "--max-request-bytes" in error["message"]
    ctx: ServerContext = client._transport.app.state.aiocb  # type: ignore[attr-defined]
    assert ctx.max_prompt_chars is not None
    too_long = "z" * (ctx.max_prompt_chars + 1)
    error = assert_error(await client.post("/tokenize", json={"prompt": too_long}), 400, "prompt")
    assert "cannot fit" in error["message"]
    error = assert_error(await client.post("/detokenize", json={"tokens": [5] * (4 * ctx.max_prompt_chars + 1)}), 400)
    assert error["param"] == "tokens" and "more than /tokenize gives" in error["message"]
    # What /tokenize gives, /detokenize takes, past the context too (long ids decode off the
    # loop through the tokenizers library's batch call): the same text.
    assert ctx.max_model_len is not None
    text = "Héllo wörld, 你好，世界！ The quick brown fox. " * 200
    ids = (await client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})).json()["tokens"]
    assert len(ids) > ctx.max_model_len
    response = await client.post("/detokenize", json={"tokens": ids})
    assert response.json()["prompt"] == tokenizer.decode(ids) == text


# --------------------------------------------------------------------------- names and bounds


async def test_engine_refusals_name_the_body_field(client: httpx.AsyncClient) -> None:
    prompts = [[5, 6], [7, 8], [9, 10**6]]
    error = assert_error(await client.post(COMPLETIONS, json=body(prompt=prompts)), 400, "prompt")
    assert error["message"].startswith("prompt[2][1] = 1000000")
    assert_error(await client.post(COMPLETIONS, json=body(max_tokens=10**6)), 400, "max_tokens")
    assert_error(await client.post(CHAT, json=chat(max_tokens=10**6)), 400, "max_tokens")
    request = {**chat(max_tokens=None), "max_completion_tokens": 10**6}
    assert_error(await client.post(CHAT, json=request), 400, "max_completion_tokens")
    assert_error(await client.post(COMPLETIONS, json=body(temperature=1e-30)), 400, "temperature")
    assert_error(await client.post(COMPLETIONS, json=body(logit_bias={"99999": 1})), 400, "logit_bias")


async def test_choices_per_request_are_bounded(manager: aiocb.Manager, tokenizer: Any) -> None:
    app = build_app(manager, tokenizer, MODEL_NAME, limits=ServerLimits(max_choices=4))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        error = assert_error(await client.post(COMPLETIONS, json=body(prompt=["a", "b", "c"], n=2)), 400, "prompt")
        assert "--max-choices" in error["message"] and "6 choices" in error["message"]
        assert_error(await client.post(CHAT, json=chat(n=5)), 400, "n")
        response = await client.post(COMPLETIONS, json=body(prompt=["a", "b"], n=2, temperature=1.0))
        assert response.status_code == 200 and len(response.json()["choices"]) == 4


async def test_many_prompts_are_queued_a_slice_of_the_loop_at_a_time(manager: aiocb.Manager, tokenizer: Any) -> None:
    app = build_app(manager, tokenizer, MODEL_NAME, limits=ServerLimits(max_choices=4096))
    lags: list[float] = []

    async def heartbeat() -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(time.perf_counter() - before - 0.001)

    # The objects earlier tests left (modules of other models among them) out of the
    # collector's view, as aiocb's first import moves torch's and transformers' (not moved
    # back: that would undo aiocb's): a full collection of them in the middle took 90-120 ms
    # by the end of the whole suite, 20 ms in this test alone. The request's own stay in it.
    gc.collect()
    gc.freeze()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        beat = asyncio.create_task(heartbeat())
        await asyncio.sleep(0.01)
        # About 75 us each to queue: 3,000 in one go held the loop for a quarter of a second.
        response = await client.post(
            COMPLETIONS, json=body(prompt=[[5, i % 50 + 6] for i in range(3000)], max_tokens=1)
        )
        beat.cancel()
    assert response.status_code == 200 and len(response.json()["choices"]) == 3000
    assert max(lags) < 0.08, max(lags)
    await wait_until_idle(manager)


async def test_a_request_with_many_prompts_lets_others_tokenize_between_them(
    client: httpx.AsyncClient, manager: aiocb.Manager
) -> None:
    ctx: ServerContext = client._transport.app.state.aiocb  # type: ignore[attr-defined]
    order: list[str] = []
    first_started = threading.Event()
    encode = ctx.encode_prompt

    def slow_encode(text: str, **kwargs: Any) -> Tokenized:
        order.append(text[0])
        first_started.set()
        time.sleep(0.05)
        return encode(text, **kwargs)

    ctx.encode_prompt = slow_encode  # type: ignore[method-assign]
    prompts = [letter + " the quick brown fox" * 150 for letter in "ABCD"]  # each about 3 KB: off the loop
    many = asyncio.create_task(client.post(COMPLETIONS, json=body(prompt=prompts, max_tokens=1)))
    await asyncio.get_running_loop().run_in_executor(None, first_started.wait)
    other = await client.post(COMPLETIONS, json=body(prompt="Z" + " the quick brown fox" * 150, max_tokens=1))
    assert other.status_code == 200 and (await many).status_code == 200
    assert order[0] == "A" and order.index("Z") < 4, order  # not behind every prompt of the other request
    await wait_until_idle(manager)


async def test_a_large_body_does_not_hold_up_an_ordinary_one_off_the_loop(
    client: httpx.AsyncClient, manager: aiocb.Manager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bodies over 256 KiB are worked on in a tokenizer thread of their own: one that takes
    seconds (8 MiB of chat messages or tools to render) leaves the thread of the others free;
    full collections wait while it works (each would walk its millions of values), and the
    threads waiting for the GIL get it sooner."""
    ctx: ServerContext = client._transport.app.state.aiocb  # type: ignore[attr-defined]
    large_started, ordinary_done = threading.Event(), threading.Event()
    waited: list[bool] = []
    deferred: dict[str, tuple[bool, bool]] = {}
    encode = ctx.encode_prompt

    def slow_encode(text: str, **kwargs: Any) -> Tokenized:
        deferred[text[0]] = (gc.get_threshold()[2] == collector._NEVER, sys.getswitchinterval() == gil.OFTEN)
        if text.startswith("L"):  # the large body's prompt: working until the other is done
            large_started.set()
            waited.append(ordinary_done.wait(timeout=10))
        return encode(text, **kwargs)

    holders: dict[str, object] = {}
    encode_kept = context.encode_kept

    def recording(text: str, tokenizer: Any, processes: Any, **kwargs: Any) -> Tokenized:
        holders[text[0]] = processes
        return encode_kept(text, tokenizer, processes, **kwargs)

    monkeypatch.setattr(context, "encode_kept", recording)
    ctx.encode_prompt = slow_encode  # type: ignore[method-assign]
    padding = " " * (300 * 1024)  # (a body's size, whatever makes it up)
    large = json.dumps(body(prompt="L" + " the quick brown fox" * 150, max_tokens=1)) + padding
    headers = {"content-type": "application/json"}
    task = asyncio.create_task(client.post(COMPLETIONS, content=large, headers=headers))
    await asyncio.get_running_loop().run_in_executor(None, large_started.wait, 10)
    ordinary = await client.post(COMPLETIONS, json=body(prompt="O" + " the quick brown fox" * 150, max_tokens=1))
    ordinary_done.set()
    assert ordinary.status_code == 200 and (await task).status_code == 200
    assert waited == [True], "the ordinary body waited behind the large one"
    assert deferred == {"L": (True, True), "O": (True, True)}  # (the large body's work was still going on)
    assert gc.get_threshold()[2] != collector._NEVER and sys.getswitchinterval() != gil.OFTEN
    # (each lane's long prompts go to a tokenizer process of its own)
    assert holders == {"L": ctx._large_processes, "O": ctx._processes}
    await wait_until_idle(manager)


# --------------------------------------------------------------------------- seeds


async def test_seeds_beyond_32_bits_give_their_own_streams(manager: aiocb.Manager) -> None:
    async def sample(seed: int) -> list[int]:
        output = await manager.generate([5, 6, 7], max_new_tokens=12, temperature=1.0, top_k=0, seed=seed)
        return list(output.generated_tokens)

    base = await sample(3)
    assert await sample(3) == base
    assert await sample(3 + 2**32) != base and await sample(3 - 2**32) != base
    with pytest.raises(aiocb.InvalidRequestError, match="seed") as raised:
        await manager.generate([5], max_new_tokens=1, seed=2**64)
    assert raised.value.param == "seed"
