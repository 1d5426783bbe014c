"""The app over ASGI with httpx: formats, sampling fields, logprobs, errors, tokenizer routes."""

from __future__ import annotations

import asyncio
import copy
import json
import math
import threading
from typing import Any

import httpx
import pytest
from transformers import GenerationConfig, PreTrainedModel

import aiocb
from aiocb.prompts import bad_words_ids
from aiocb.server import build_app
from tests.conftest import arm_failure
from tests.server.conftest import (
    API_KEY,
    MODEL_NAME,
    build_byte_fallback_tokenizer,
    serve_config,
    serve_model,
    wait_until_idle,
    wait_until_running,
)

PROMPT = "Once upon a time"


def sse_events(body: str) -> list[Any]:
    """The ``data:`` payloads of an event stream, ``[DONE]`` as the string."""
    blocks = [b for b in body.split("\n\n") if b]
    assert all(b.startswith("data: ") for b in blocks), body
    return [b[len("data: ") :] if b == "data: [DONE]" else json.loads(b[len("data: ") :]) for b in blocks]


async def greedy(manager: aiocb.Manager, ids: list[int], n: int, **params: Any) -> aiocb.GenerationOutput:
    return await manager.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=[], **params)


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param
    return dict(error)


# --------------------------------------------------------------------------- completions


async def test_greedy_completion_matches_the_engine(
    client: httpx.AsyncClient, manager: aiocb.Manager, tokenizer: Any
) -> None:
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    ids = tokenizer.encode(PROMPT)
    reference = await greedy(manager, ids, 12)
    assert data["object"] == "text_completion"
    assert data["id"].startswith("cmpl-")
    assert data["model"] == MODEL_NAME
    (choice,) = data["choices"]
    assert choice["index"] == 0
    assert choice["finish_reason"] == "length"
    assert choice["logprobs"] is None
    assert choice["text"] == tokenizer.decode(reference.generated_tokens, skip_special_tokens=True)
    assert data["usage"] == {
        "prompt_tokens": len(ids),
        "completion_tokens": 12,
        "total_tokens": len(ids) + 12,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_prompt_forms_give_one_choice_per_prompt(client: httpx.AsyncClient, tokenizer: Any) -> None:
    texts = ["Once upon a time", "Question: What is the capital of France?"]
    ids = [tokenizer.encode(t) for t in texts]
    common = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    by_text = (await client.post("/v1/completions", json={"prompt": texts, **common})).json()
    by_ids = (await client.post("/v1/completions", json={"prompt": ids, **common})).json()
    single = (await client.post("/v1/completions", json={"prompt": ids[1], **common})).json()
    assert [c["index"] for c in by_text["choices"]] == [0, 1]
    assert [c["text"] for c in by_text["choices"]] == [c["text"] for c in by_ids["choices"]]
    assert single["choices"][0]["text"] == by_text["choices"][1]["text"]
    assert by_text["usage"]["prompt_tokens"] == sum(len(i) for i in ids)
    assert by_text["usage"]["completion_tokens"] == 12


async def test_n_samples_with_derived_seeds(client: httpx.AsyncClient) -> None:
    body = {
        "prompt": ["Once", "Numbers:"],
        "n": 3,
        "max_tokens": 10,
        "temperature": 1.0,
        "seed": 11,
        "ignore_eos": True,
    }
    first = (await client.post("/v1/completions", json=body)).json()
    again = (await client.post("/v1/completions", json=body)).json()
    assert [c["index"] for c in first["choices"]] == list(range(6))
    texts = [c["text"] for c in first["choices"]]
    assert texts == [c["text"] for c in again["choices"]], "a seed makes the samples reproducible"
    assert len(set(texts[:3])) == 3, "each choice has its own seed"
    assert len(set(texts[3:])) == 3
    assert first["usage"]["completion_tokens"] == 60


async def test_stop_strings_are_trimmed_and_free_the_request(
    client: httpx.AsyncClient, manager: aiocb.Manager, tokenizer: Any
) -> None:
    ids = tokenizer.encode(PROMPT)
    reference = await greedy(manager, ids, 40)
    text = tokenizer.decode(reference.generated_tokens)
    middle = len(text) // 2
    stop = next(text[i : i + 2] for i in range(middle, len(text)) if "\ufffd" not in text[i : i + 2])
    expected = text[: text.find(stop)]
    body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stop": [stop, "never seen"]}
    data = (await client.post("/v1/completions", json=body)).json()
    (choice,) = data["choices"]
    assert choice["text"] == expected
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    assert data["usage"]["completion_tokens"] < 40
    streamed = (await client.post("/v1/completions", json={**body, "stream": True})).text
    chunks = [e for e in sse_events(streamed) if e != "[DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    assert (chunks[-1]["choices"][0]["finish_reason"], chunks[-1]["choices"][0]["stop_reason"]) == ("stop", stop)
    stats = await wait_until_idle(manager)
    assert stats.free_blocks == stats.total_blocks


async def test_a_kept_stop_tokens_text_is_whole_though_a_stop_string_ends_in_it(
    model: PreTrainedModel, tokenizer: Any
) -> None:
    ids = tokenizer.encode(PROMPT)
    async with aiocb.Manager(model, continuous_batching_config=serve_config()) as manager:
        reference = (await greedy(manager, ids, 30)).generated_tokens

        def fits(i: int) -> bool:
            piece = tokenizer.decode(reference[i : i + 1])
            return (
                len(piece) > 1
                and reference[i] not in reference[:i]
                and piece[:-1] not in tokenizer.decode(reference[:i])
            )

        at = next(i for i in range(2, 30) if fits(i))
        stop = tokenizer.decode(reference[at : at + 1])[:-1]
        app = build_app(manager, tokenizer, MODEL_NAME)
        body = {
            "prompt": PROMPT,
            "max_tokens": 30,
            "temperature": 0,
            "ignore_eos": True,
            "stop_token_ids": [reference[at]],
            "stop": [stop],
            "include_stop_str_in_output": True,
        }
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            data = (await http.post("/v1/completions", json=body)).json()
            streamed = (await http.post("/v1/completions", json={**body, "stream": True})).text
    (choice,) = data["choices"]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (
        tokenizer.decode(reference[: at + 1]),
        "stop",
        reference[at],
    )
    chunks = [e["choices"][0] for e in sse_events(streamed) if e != "[DONE]" and e["choices"]]
    assert "".join(c["text"] for c in chunks) == choice["text"]
    assert chunks[-1]["stop_reason"] == reference[at]


async def test_a_models_generation_config_gives_what_a_request_leaves_out(
    model: PreTrainedModel, tokenizer: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As vLLM's server: the sampling fields the model's generation config sets fill a
    request's left-out ones, its max_new_tokens caps a chat's default length; and its
    num_return_sequences and min_new_tokens never outdo what the request says, nor its
    EOS ids the tokenizer's. A greedy request is not warned of the config's top_p and
    top_k, which it did not give."""
    from aiocb import sampling

    monkeypatch.setattr(sampling, "_WARNED_FILTERS", set())
    caplog.set_level("WARNING", logger="aiocb")
    shipped = copy.deepcopy(model)
    shipped.generation_config = GenerationConfig(
        do_sample=True,
        temperature=0.6,
        top_p=0.95,
        top_k=20,
        max_new_tokens=7,
        num_return_sequences=3,
        min_new_tokens=6,
        eos_token_id=5,
        pad_token_id=0,
    )
    assert tokenizer.eos_token_id not in (5, None)
    async with aiocb.Manager(shipped, continuous_batching_config=serve_config()) as manager:
        app = build_app(manager, tokenizer, MODEL_NAME)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            base = {"prompt": PROMPT, "max_tokens": 12, "ignore_eos": True, "seed": 3}
            left_out = (await http.post("/v1/completions", json=base)).json()["choices"][0]["text"]
            shipped_values = {**base, "temperature": 0.6, "top_p": 0.95, "top_k": 20}
            given = (await http.post("/v1/completions", json=shipped_values)).json()["choices"][0]["text"]
            plain = {**base, "temperature": 1.0, "top_p": 1.0, "top_k": -1}
            openai_defaults = (await http.post("/v1/completions", json=plain)).json()["choices"][0]["text"]
            chat = {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True, "min_tokens": 0}
            capped = (await http.post("/v1/chat/completions", json=chat)).json()
            longer = (await http.post("/v1/chat/completions", json={**chat, "min_tokens": 10})).json()
            before = manager.statistics().tokens_generated
            one = (await http.post("/v1/completions", json={**base, "n": 1, "max_tokens": 4})).json()
            generated = manager.statistics().tokens_generated - before
            eos = {str(tokenizer.eos_token_id): 100}
            body = {"prompt": PROMPT, "max_tokens": 8, "min_tokens": 0, "logit_bias": eos}
            ended = (await http.post("/v1/completions", json=body)).json()
            # A stop string in the first tokens waits for the config's min_new_tokens as EOS does.
            greedy = {**base, "temperature": 0, "n": 1}
            text = (await http.post("/v1/completions", json=greedy)).json()["choices"][0]["text"]
            stop = {**greedy, "stop": text[1:3]}
            waited = (await http.post("/v1/completions", json=stop)).json()["choices"][0]["text"]
            asked = (await http.post("/v1/completions", json={**stop, "min_tokens": 6})).json()["choices"][0]["text"]
            early = (await http.post("/v1/completions", json={**stop, "min_tokens": 0})).json()["choices"][0]["text"]
            chat_greedy = {"messages": chat["messages"], "ignore_eos": True, "temperature": 0, "max_tokens": 12}
            reply = (await http.post("/v1/chat/completions", json=chat_greedy)).json()["choices"][0]["message"]
            chat_stop = {**chat_greedy, "stop": reply["content"][1:3]}
            chat_waited = (await http.post("/v1/chat/completions", json=chat_stop)).json()
            chat_early = (await http.post("/v1/chat/completions", json={**chat_stop, "min_tokens": 0})).json()
    assert waited == asked != early == text[:1]
    assert "greedy decoding" not in caplog.text
    assert chat_waited["choices"][0]["message"] == reply != chat_early["choices"][0]["message"]
    assert left_out == given != openai_defaults
    assert capped["usage"]["completion_tokens"] == 7
    assert longer["usage"]["completion_tokens"] == 10, "the cap gives way to the request's min_tokens"
    assert len(one["choices"]) == 1 and generated == 4, "one sample computed, not the config's three"
    assert (ended["usage"]["completion_tokens"], ended["choices"][0]["finish_reason"]) == (1, "stop")


async def test_a_models_max_length_caps_a_default_length_with_the_prompt_counted(
    model: PreTrainedModel, tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """As ``model.generate`` reads it: a generation config's ``max_length`` (no
    ``max_new_tokens``) caps what a request that gives no ``max_tokens`` gets, the prompt
    counted; one the prompt fills is a 400. Its sampling fields beside ``do_sample`` false
    are warned of: the server samples with them, as vLLM's."""
    caplog.set_level("WARNING", logger="aiocb")
    shipped = copy.deepcopy(model)
    shipped.generation_config = GenerationConfig(max_length=30, temperature=0.7, pad_token_id=0)
    prompt_len = len(tokenizer.encode(PROMPT))
    async with aiocb.Manager(shipped, continuous_batching_config=serve_config()) as manager:
        app = build_app(manager, tokenizer, MODEL_NAME)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            base = {"prompt": PROMPT, "ignore_eos": True, "temperature": 0}
            short = (await http.post("/v1/completions", json=base)).json()
            given = (await http.post("/v1/completions", json={**base, "max_tokens": 20})).json()
            near = {**base, "prompt": [7] * 25}
            capped = (await http.post("/v1/completions", json=near)).json()
            full = await http.post("/v1/completions", json={**base, "prompt": [[7] * 3, [7] * 30]})
            # (a length the client never gave gives way to its own min_tokens)
            asked = (await http.post("/v1/completions", json={**base, "prompt": [7] * 30, "min_tokens": 3})).json()
            longer = (await http.post("/v1/completions", json={**base, "min_tokens": 20})).json()
            chat = {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True, "temperature": 0}
            reply = (await http.post("/v1/chat/completions", json=chat)).json()
    assert short["usage"]["completion_tokens"] == 16 < 30 - prompt_len, "OpenAI's 16 within the cap"
    assert given["usage"]["completion_tokens"] == 20, "the request's own length is not capped"
    assert capped["usage"]["completion_tokens"] == 5
    assert_error(full, 400, "prompt[1]")
    assert "max_length (30" in full.json()["error"]["message"]
    assert asked["usage"]["completion_tokens"] == 3
    assert longer["usage"]["completion_tokens"] == 20
    usage = reply["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 30
    assert "sets temperature with do_sample false" in caplog.text


async def test_stop_token_ids_and_ignore_eos(model: PreTrainedModel, tokenizer: Any) -> None:
    ids = tokenizer.encode(PROMPT)
    async with aiocb.Manager(model, continuous_batching_config=serve_config()) as plain:
        reference = (await greedy(plain, ids, 20)).generated_tokens
    eos = reference[4]
    first = reference.index(eos)
    config = GenerationConfig(eos_token_id=eos, pad_token_id=0)
    async with aiocb.Manager(model, generation_config=config, continuous_batching_config=serve_config()) as manager:
        app = build_app(manager, tokenizer, MODEL_NAME)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            body = {"prompt": PROMPT, "max_tokens": 20, "temperature": 0}
            stopped = (await http.post("/v1/completions", json=body)).json()
            ignored = (await http.post("/v1/completions", json={**body, "ignore_eos": True})).json()
            by_id_body = {**body, "ignore_eos": True, "stop_token_ids": [eos]}
            by_id = (await http.post("/v1/completions", json=by_id_body)).json()
            kept = (await http.post("/v1/completions", json={**by_id_body, "include_stop_str_in_output": True})).json()
            streamed = (await http.post("/v1/completions", json={**by_id_body, "stream": True})).text
            chat_body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "temperature": 0}
            chat = (await http.post("/v1/chat/completions", json={**chat_body, "stop_token_ids": [eos]})).json()
    before_stop = tokenizer.decode(reference[:first])
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] == first + 1
    # As vLLM: the stop token's text is left out unless kept; stop_reason names a requested
    # stop token, not an end-of-sequence one.
    assert (stopped["choices"][0]["text"], stopped["choices"][0]["stop_reason"]) == (before_stop, None)
    assert ignored["choices"][0]["finish_reason"] == "length"
    assert ignored["usage"]["completion_tokens"] == 20
    assert ignored["choices"][0]["stop_reason"] is None
    assert by_id["usage"]["completion_tokens"] == first + 1
    assert (by_id["choices"][0]["text"], by_id["choices"][0]["stop_reason"]) == (before_stop, eos)
    assert kept["choices"][0]["text"] == tokenizer.decode(reference[: first + 1])
    chunks = [e for e in sse_events(streamed) if e != "[DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == before_stop
    assert chunks[-1]["choices"][0]["stop_reason"] == eos
    (chat_choice,) = chat["choices"]
    assert chat_choice["stop_reason"] == (eos if chat_choice["finish_reason"] == "stop" else None)


async def test_logprobs_with_alternatives(client: httpx.AsyncClient, manager: aiocb.Manager, tokenizer: Any) -> None:
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 3}
    data = (await client.post("/v1/completions", json=body)).json()
    logprobs = data["choices"][0]["logprobs"]
    reference = await greedy(manager, tokenizer.encode(PROMPT), 6, return_logprobs=True)
    assert reference.logprobs is not None
    assert len(logprobs["tokens"]) == 6
    assert logprobs["token_logprobs"] == pytest.approx(reference.logprobs, abs=1e-5)
    for token_logprob, top in zip(logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True):
        assert 1 <= len(top) <= 4
        assert token_logprob == pytest.approx(max(top.values()))  # greedy: the chosen one is the best
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0
    assert offsets == sorted(offsets)
    assert all(isinstance(t, str) for t in logprobs["tokens"])


async def test_echo_scores_the_prompt_for_loglikelihood(
    client: httpx.AsyncClient, manager: aiocb.Manager, tokenizer: Any
) -> None:
    ids = tokenizer.encode("Question: Which planet is known as the red planet? Answer: Mars.")
    scored = await manager.generate(ids, max_new_tokens=1, prompt_logprobs=True, top_logprobs=1, do_sample=False)
    assert scored.prompt_logprobs is not None
    assert scored.prompt_top_logprobs is not None
    body = {"prompt": [ids], "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
    data = (await client.post("/v1/completions", json=body)).json()
    (choice,) = data["choices"]
    assert choice["text"] == tokenizer.decode(ids)
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(ids)
    assert logprobs["token_logprobs"][0] is None
    assert logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:] == pytest.approx(scored.prompt_logprobs[1:], abs=1e-5)
    for position in range(1, len(ids)):
        best = scored.prompt_top_logprobs[position]
        assert best is not None
        is_greedy = ids[position] in best
        top = logprobs["top_logprobs"][position]
        assert (logprobs["token_logprobs"][position] == max(top.values())) == is_greedy
    assert data["usage"]["completion_tokens"] == 0
    # lm-eval's own payload: max_tokens=1, the generated token last.
    body = {**body, "max_tokens": 1}
    logprobs = (await client.post("/v1/completions", json=body)).json()["choices"][0]["logprobs"]
    assert len(logprobs["token_logprobs"]) == len(ids) + 1
    assert logprobs["token_logprobs"][1:-1] == pytest.approx(scored.prompt_logprobs[1:], abs=1e-5)


async def test_echoed_offsets_and_tokens_of_a_sentencepiece_tokenizer_with_a_bos() -> None:
    """The echoed text holds no BOS: the prompt's offsets point into it (the BOS at 0), the
    generated ones follow it; a token that starts a word shows its space, as the text has it."""
    tokenizer = build_byte_fallback_tokenizer(bos=True)
    prompt = "the cat sat on the mat and"
    ids = tokenizer.encode(prompt)
    assert tokenizer.convert_ids_to_tokens(ids[0]) == "<s>"
    async with aiocb.Manager(serve_model(tokenizer), continuous_batching_config=serve_config()) as manager:
        app = build_app(manager, tokenizer, MODEL_NAME)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            body = {
                "prompt": prompt,
                "max_tokens": 6,
                "echo": True,
                "logprobs": 1,
                "temperature": 0,
                "ignore_eos": True,
            }
            (choice,) = (await http.post("/v1/completions", json=body)).json()["choices"]
    text, logprobs = choice["text"], choice["logprobs"]
    offsets, tokens = logprobs["text_offset"], logprobs["tokens"]
    assert text.startswith(prompt) and len(tokens) == len(ids) + 6
    assert offsets == sorted(offsets) and offsets[0] == offsets[1] == 0
    assert all(0 <= at <= len(text) for at in offsets)
    assert offsets[len(ids)] >= len(prompt)
    for token, at in zip(tokens[2 : len(ids)], offsets[2 : len(ids)], strict=True):
        assert text[at : at + len(token)] == token, (token, at)
    assert sum(token.startswith(" ") for token in tokens[2 : len(ids)]) >= 3  # (the spaces shown)


async def test_streaming_completion_matches_the_whole_one(client: httpx.AsyncClient) -> None:
    body = {
        "prompt": ["Emoji: 😀", "你好"],
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 2,
        "echo": True,
    }
    whole = (await client.post("/v1/completions", json=body)).json()
    events = sse_events(
        (
            await client.post(
                "/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}
            )
        ).text
    )
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == []
    assert usage["usage"] == whole["usage"]
    for index in (0, 1):
        chunks = [e["choices"][0] for e in events[:-2] if e["choices"][0]["index"] == index]
        expected = whole["choices"][index]
        assert "".join(c["text"] for c in chunks) == expected["text"]
        assert [t for c in chunks for t in c["logprobs"]["tokens"]] == expected["logprobs"]["tokens"]
        assert [t for c in chunks for t in c["logprobs"]["text_offset"]] == expected["logprobs"]["text_offset"]
        assert chunks[-1]["finish_reason"] == "length"
        assert all(c["finish_reason"] is None for c in chunks[:-1])


async def test_stream_without_usage_has_no_usage_chunk(client: httpx.AsyncClient) -> None:
    body = {"prompt": PROMPT, "max_tokens": 4, "stream": True, "ignore_eos": True}
    response = await client.post("/v1/completions", json=body)
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    assert all(e["choices"] for e in events[:-1])


# --------------------------------------------------------------------------- chat


async def test_chat_completion(client: httpx.AsyncClient, manager: aiocb.Manager, tokenizer: Any) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}]
    body = {
        "model": MODEL_NAME,
        "messages": messages,
        "max_completion_tokens": 10,
        "temperature": 0,
        "ignore_eos": True,
    }
    data = (await client.post("/v1/chat/completions", json=body)).json()
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    reference = await greedy(manager, ids, 10)
    assert data["object"] == "chat.completion"
    assert data["id"].startswith("chatcmpl-")
    (choice,) = data["choices"]
    content = tokenizer.decode(reference.generated_tokens, skip_special_tokens=True)
    assert choice["message"] == {"role": "assistant", "content": content}
    assert choice["finish_reason"] == "length"
    assert data["usage"] == {
        "prompt_tokens": len(ids),
        "completion_tokens": 10,
        "total_tokens": len(ids) + 10,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    parts = [{"type": "text", "text": "Tell me a story."}]
    as_parts = {**body, "messages": [messages[0], {"role": "user", "content": parts}]}
    assert (await client.post("/v1/chat/completions", json=as_parts)).json()["choices"] == data["choices"]


async def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(
    client: httpx.AsyncClient, manager: aiocb.Manager, tokenizer: Any
) -> None:
    """vLLM's ``truncate_prompt_tokens``: the model sees the prompt's (or the rendered
    conversation's) last k tokens; usage counts those, an echo shows them, and a token-id
    prompt longer than the context passes once cut."""
    ids = tokenizer.encode("Question: Which planet is known as the red planet? Answer: Mars.")
    kept = ids[-6:]
    reference = await greedy(manager, kept, 4)
    body = {"prompt": "Question: Which planet is known as the red planet? Answer: Mars.", "max_tokens": 4}
    body |= {"temperature": 0, "ignore_eos": True, "truncate_prompt_tokens": 6, "echo": True, "logprobs": 0}
    data = (await client.post("/v1/completions", json=body)).json()
    (choice,) = data["choices"]
    generated = tokenizer.decode(reference.generated_tokens, skip_special_tokens=True)
    assert choice["text"] == tokenizer.decode(kept) + generated
    assert len(choice["logprobs"]["tokens"]) == 6 + 4 and choice["logprobs"]["token_logprobs"][0] is None
    assert data["usage"]["prompt_tokens"] == 6
    assert manager.model.config.max_position_embeddings == 2048
    long = [ids[1]] * 2100
    too_long = await client.post("/v1/completions", json={"prompt": long, "max_tokens": 2})
    assert too_long.status_code == 400, too_long.text
    body = {"prompt": long, "max_tokens": 2, "truncate_prompt_tokens": 2000, "temperature": 0, "ignore_eos": True}
    cut = await client.post("/v1/completions", json=body)
    assert cut.status_code == 200, cut.text
    assert cut.json()["usage"]["prompt_tokens"] == 2000
    beyond = await client.post("/v1/completions", json={**body, "prompt": "x" * 10**6, "truncate_prompt_tokens": 2049})
    assert beyond.status_code == 400 and beyond.json()["error"]["param"] == "truncate_prompt_tokens"

    messages = [{"role": "user", "content": "Tell me a story about the red planet."}]
    chat_ids = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    reference = await greedy(manager, chat_ids[-5:], 4)
    body = {"messages": messages, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "truncate_prompt_tokens": 5}
    data = (await client.post("/v1/chat/completions", json=body)).json()
    assert data["choices"][0]["message"]["content"] == tokenizer.decode(
        reference.generated_tokens, skip_special_tokens=True
    )
    assert data["usage"]["prompt_tokens"] == 5


async def test_continue_final_message_continues_the_last_message(client: httpx.AsyncClient, tokenizer: Any) -> None:
    """``continue_final_message`` renders the conversation to end inside its last message
    (transformers' option); a new message after it (``add_generation_prompt``) is refused."""
    messages = [{"role": "user", "content": "Name a planet."}, {"role": "assistant", "content": "The red one is"}]
    body = {
        "messages": messages,
        "max_tokens": 2,
        "temperature": 0,
        "chat_template_kwargs": {"continue_final_message": True},
    }
    error = assert_error(await client.post("/v1/chat/completions", json=body), 400, "add_generation_prompt")
    assert "continue_final_message" in error["message"]
    data = (await client.post("/v1/chat/completions", json={**body, "add_generation_prompt": False})).json()
    rendered = tokenizer.apply_chat_template(messages, continue_final_message=True, tokenize=False)
    assert rendered.endswith("The red one is")
    assert data["usage"]["prompt_tokens"] == len(tokenizer.encode(rendered))
    # vLLM's top-level field says the same
    top = {**body, "chat_template_kwargs": None, "continue_final_message": True, "add_generation_prompt": False}
    same = (await client.post("/v1/chat/completions", json=top)).json()
    assert same["usage"]["prompt_tokens"] == data["usage"]["prompt_tokens"]
    assert same["choices"][0]["message"] == data["choices"][0]["message"]
    assert_error(await client.post("/v1/chat/completions", json={**top, "add_generation_prompt": True}), 400)
    tokenize = {"messages": messages, "continue_final_message": True, "add_generation_prompt": False}
    tokenized = (await client.post("/tokenize", json=tokenize)).json()
    assert tokenized["tokens"] == tokenizer.encode(rendered)
    clash = {**top, "chat_template_kwargs": {"continue_final_message": False}}
    error = assert_error(await client.post("/v1/chat/completions", json=clash), 400, "continue_final_message")
    assert "differ" in error["message"]
    assert_error(
        await client.post("/v1/chat/completions", json={**top, "continue_final_message": "yes"}),
        400,
        "continue_final_message",
    )
    assert_error(await client.post("/tokenize", json={"prompt": "x", "continue_final_message": True}), 400)


async def test_chat_stream_and_logprobs(client: httpx.AsyncClient) -> None:
    body = {
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 2,
        "n": 2,
    }
    whole = (await client.post("/v1/chat/completions", json=body)).json()
    content = whole["choices"][0]["logprobs"]["content"]
    assert len(content) == 8
    assert all(len(entry["top_logprobs"]) == 2 and isinstance(entry["bytes"], list) for entry in content)
    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    events = sse_events((await client.post("/v1/chat/completions", json=stream_body)).text)
    assert events[-1] == "[DONE]"
    streamed = dict(events[-2]["usage"])
    # the second request of the same prompt found its first full block in the prefix cache
    assert streamed.pop("prompt_tokens_details") == {"cached_tokens": 16}
    assert streamed == {k: v for k, v in whole["usage"].items() if k != "prompt_tokens_details"}
    chunks = events[:-2]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(c["delta"].get("content", "") for c in mine)
        assert text == whole["choices"][index]["message"]["content"]
        assert mine[-1]["finish_reason"] == "length"
        streamed = [e for c in mine if c["logprobs"] for e in c["logprobs"]["content"]]
        expected = whole["choices"][index]["logprobs"]["content"]
        assert [e["token"] for e in streamed] == [e["token"] for e in expected]
        assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in expected], abs=1e-4)


async def test_chat_echo_puts_the_last_assistant_messages_content_first(client: httpx.AsyncClient) -> None:
    """vLLM's chat ``echo``: each choice's content starts with the last message's where that
    is the assistant's (the message continued, or one the reply follows); else nothing."""
    messages = [{"role": "user", "content": "Name a planet."}, {"role": "assistant", "content": "The red one is"}]
    body = {"messages": messages, "max_tokens": 3, "temperature": 0, "n": 2, "ignore_eos": True}
    body |= {"continue_final_message": True, "add_generation_prompt": False}
    plain = (await client.post("/v1/chat/completions", json=body)).json()
    echoed = (await client.post("/v1/chat/completions", json={**body, "echo": True})).json()
    for mine, theirs in zip(echoed["choices"], plain["choices"], strict=True):
        assert mine["message"]["content"] == "The red one is" + theirs["message"]["content"]
    assert echoed["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]
    events = sse_events((await client.post("/v1/chat/completions", json={**body, "echo": True, "stream": True})).text)
    for index in (0, 1):
        deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"][0]["index"] == index]
        assert deltas[1] == {"content": "The red one is"}
        assert "".join(d.get("content") or "" for d in deltas) == echoed["choices"][index]["message"]["content"]
    # a reply after a user's message echoes nothing (the roles differ)
    user_last = {"messages": messages[:1], "max_tokens": 3, "temperature": 0}
    without, with_echo = [
        (await client.post("/v1/chat/completions", json={**user_last, "echo": echo})).json() for echo in (False, True)
    ]
    assert with_echo["choices"][0]["message"] == without["choices"][0]["message"]
    assert_error(await client.post("/v1/chat/completions", json={**body, "echo": 1}), 400, "echo")


async def test_continuous_usage_stats_give_each_chunk_its_choices_usage(client: httpx.AsyncClient) -> None:
    """vLLM's ``stream_options.continuous_usage_stats``: every chunk carries its choice's
    prompt tokens and the tokens it has generated so far; the last chunk the whole usage."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    completion = {"prompt": ["Hello there", "A"], "max_tokens": 5, "n": 2, "temperature": 0, "ignore_eos": True}
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "n": 2, "ignore_eos": True}
    for path, body in [("/v1/completions", completion), ("/v1/chat/completions", chat)]:
        whole = (await client.post(path, json=body)).json()
        stream = {**body, "stream": True, "stream_options": options}
        events = sse_events((await client.post(path, json=stream)).text)
        assert events[-1] == "[DONE]" and events[-2]["choices"] == []
        assert events[-2]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
        chunks = events[:-2]
        per_choice: dict[int, list[dict[str, int]]] = {}
        for chunk in chunks:
            per_choice.setdefault(chunk["choices"][0]["index"], []).append(chunk["usage"])
        assert sorted(per_choice) == list(range(len(whole["choices"])))
        for usages in per_choice.values():
            counts = [u["completion_tokens"] for u in usages]
            assert counts == sorted(counts) and counts[-1] == body["max_tokens"]
            assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
            assert len({u["prompt_tokens"] for u in usages}) == 1
        if path == "/v1/chat/completions":
            assert [u[0]["completion_tokens"] for u in per_choice.values()] == [0, 0]  # (the role chunks)
            assert per_choice[0][0]["prompt_tokens"] == whole["usage"]["prompt_tokens"]  # (one prompt, n of 2)
        else:
            for index, text in [(0, "Hello there"), (2, "A")]:
                tokens = (await client.post("/tokenize", json={"prompt": text})).json()["count"]
                assert per_choice[index][0]["prompt_tokens"] == tokens
    # (without include_usage there is no usage to give: refused, not ignored)
    alone = {**chat, "stream": True, "stream_options": {"continuous_usage_stats": True}}
    error = assert_error(await client.post("/v1/chat/completions", json=alone), 400)
    assert error["param"] == "stream_options.continuous_usage_stats" and "include_usage" in error["message"]


# --------------------------------------------------------------------------- errors


async def test_bad_input_is_a_400(client: httpx.AsyncClient, tokenizer: Any) -> None:
    response = await client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert_error(response, 400)
    assert_error(await client.post("/v1/completions", json={"prompt": "x", "temperature": -1}), 400, "temperature")
    assert_error(await client.post("/v1/completions", json={"prompt": [[len(tokenizer) + 5]]}), 400)
    assert_error(await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 10**6}), 400)
    assert_error(await client.post("/v1/chat/completions", json={"messages": "hi"}), 400, "messages")


async def test_unknown_fields_are_refused_and_bookkeeping_ones_accepted(client: httpx.AsyncClient) -> None:
    body = {"prompt": "x", "max_tokens": 2, "user": "me", "metadata": {"a": "b"}, "store": False}
    body |= {"service_tier": "auto", "request_id": "mine"}
    assert (await client.post("/v1/completions", json=body)).status_code == 200
    error = assert_error(await client.post("/v1/completions", json={**body, "some_new_field": [1]}), 400)
    assert error["param"] == "some_new_field" and "some_new_field" in error["message"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert_error(await client.post("/v1/chat/completions", json={**chat, "use_beam_search": True}), 400)
    assert_error(await client.post("/v1/chat/completions", json={**chat, "store": True}), 400, "store")
    # This fixture's manager was given no vocabulary for grammars: a constraint is refused.
    fmt = {**chat, "response_format": {"type": "json_object"}}
    error = assert_error(await client.post("/v1/chat/completions", json=fmt), 400)
    assert "response_format needs a tokenizer" in error["message"]


async def test_unknown_model_route_and_method(client: httpx.AsyncClient) -> None:
    error = assert_error(await client.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404, "model")
    assert error["code"] == "model_not_found"
    assert_error(await client.get("/v1/models/gpt-9"), 404)
    assert_error(await client.get("/v1/nothing"), 404)
    assert_error(await client.get("/v1/completions"), 405)


async def test_api_key(manager: aiocb.Manager, tokenizer: Any) -> None:
    app = build_app(manager, tokenizer, MODEL_NAME, api_key=API_KEY)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
        body = {"prompt": "x", "max_tokens": 1}
        error = assert_error(await http.post("/v1/completions", json=body), 401)
        assert error["code"] == "invalid_api_key"
        wrong = {"Authorization": "Bearer nope"}
        assert_error(await http.post("/v1/completions", json=body, headers=wrong), 401)
        assert_error(await http.get("/v1/models", headers=wrong), 401)
        right = {"Authorization": f"Bearer {API_KEY}"}
        assert (await http.post("/v1/completions", json=body, headers=right)).status_code == 200
        assert (await http.get("/health")).status_code == 200
        assert (await http.get("/metrics")).status_code == 200


async def test_a_full_admission_queue_is_a_429(model: PreTrainedModel, tokenizer: Any) -> None:
    config = serve_config(max_queue_size=1, max_requests_per_batch=1)
    async with aiocb.Manager(model, continuous_batching_config=config) as manager:
        app = build_app(manager, tokenizer, MODEL_NAME)
        ids = tokenizer.encode(PROMPT)
        running = await manager.add_request(ids, max_new_tokens=500, eos_token_id=[])
        await wait_until_running(manager, 1)
        queued = await manager.add_request(ids, max_new_tokens=5)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            error = assert_error(await http.post("/v1/completions", json={"prompt": PROMPT, "n": 1}), 429)
            assert error["type"] == "rate_limit_exceeded"
            manager.cancel_request(running)
            manager.cancel_request(queued)
            assert (await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})).status_code == 200


async def test_n_choices_are_queued_all_or_none(model: PreTrainedModel, tokenizer: Any) -> None:
    config = serve_config(max_queue_size=2, max_requests_per_batch=1)
    async with aiocb.Manager(model, continuous_batching_config=config) as manager:
        app = build_app(manager, tokenizer, MODEL_NAME)
        running = await manager.add_request(tokenizer.encode(PROMPT), max_new_tokens=500, eos_token_id=[])
        await wait_until_running(manager, 1)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            # n samples are one request: they are queued together or refused together
            assert_error(await http.post("/v1/completions", json={"prompt": PROMPT, "n": 3}), 400)
            queued = await manager.add_request(tokenizer.encode(PROMPT), max_new_tokens=1)
            assert_error(await http.post("/v1/completions", json={"prompt": PROMPT, "n": 2}), 429)
            assert manager.statistics().waiting_requests == 1, "nothing of the refused request was queued"
            manager.cancel_request(queued)
        manager.cancel_request(running)


async def test_more_choices_than_the_queue_holds_are_a_400_not_a_429_for_ever(
    model: PreTrainedModel, tokenizer: Any
) -> None:
    """A batch of prompts is queued at once: more of them than ``max_queue_size`` was a 429
    on an idle server, every time (a client that obeys Retry-After retried for ever)."""
    config = serve_config(max_queue_size=2)
    async with aiocb.Manager(model, continuous_batching_config=config) as manager:
        app = build_app(manager, tokenizer, MODEL_NAME)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            for body, param in (
                ({"prompt": ["a b", "c d", "e f"]}, "prompt"),
                ({"prompt": ["a b"] * 2, "n": 2}, "prompt"),
            ):
                error = assert_error(await http.post("/v1/completions", json={**body, "max_tokens": 2}), 400)
                assert error["param"] == param and "--max-queue-size" in error["message"], error
            chat = {"messages": [{"role": "user", "content": "hi"}], "n": 3, "max_tokens": 2}
            error = assert_error(await http.post("/v1/chat/completions", json=chat), 400)
            assert error["param"] == "n" and "--max-queue-size" in error["message"], error
            taken = await http.post("/v1/completions", json={"prompt": ["a b", "c d"], "max_tokens": 2})
            assert taken.status_code == 200, taken.text
        stats = manager.statistics()
        assert stats.free_blocks == stats.total_blocks
    ids = tokenizer.encode(PROMPT)
    config = serve_config(max_queued_tokens=len(ids) + 2)
    async with aiocb.Manager(model, continuous_batching_config=config) as manager:
        app = build_app(manager, tokenizer, MODEL_NAME)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            # (two prompts past the bound in all: the first fits the empty queue, the second never with it)
            error = assert_error(await http.post("/v1/completions", json={"prompt": [ids, ids], "max_tokens": 2}), 400)
            assert error["param"] == "prompt" and "--max-queued-tokens" in error["message"], error
            one = await http.post("/v1/completions", json={"prompt": ids, "n": 3, "max_tokens": 2})
            assert one.status_code == 200, one.text  # (one prompt always fits an empty queue)
        stats = manager.statistics()
        assert stats.free_blocks == stats.total_blocks


async def test_an_engine_failure_is_a_500(tokenizer: Any) -> None:
    model = serve_model(tokenizer)
    failing = arm_failure(model)
    manager = aiocb.Manager(model, continuous_batching_config=serve_config())
    app = build_app(manager, tokenizer, MODEL_NAME)
    manager.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            assert (await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})).status_code == 200
            failing["fail"] = True
            error = assert_error(await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}), 500)
            assert error["type"] == "internal_server_error"
            streamed = await http.post("/v1/completions", json={"prompt": PROMPT, "stream": True})
            assert streamed.status_code == 500
            assert_error(await http.get("/health"), 503)
    finally:
        await manager.destroy()


# --------------------------------------------------------------------------- other routes


async def test_models_health_and_tokenizer_routes(client: httpx.AsyncClient, tokenizer: Any) -> None:
    models = (await client.get("/v1/models")).json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [MODEL_NAME]
    assert (await client.get(f"/v1/models/{MODEL_NAME}")).json()["id"] == MODEL_NAME
    assert (await client.get("/health")).status_code == 200
    text = "Héllo wörld 🚀"
    tokens = (await client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})).json()
    assert tokens["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert tokens["count"] == len(tokens["tokens"])
    assert (await client.post("/detokenize", json={"tokens": tokens["tokens"]})).json() == {"prompt": text}
    chat = (await client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})).json()
    assert tokenizer.decode(chat["tokens"]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    info = (await client.get("/tokenizer_info")).json()
    assert info["eos_token"] == tokenizer.eos_token
    assert info["eos_token_id"] == tokenizer.eos_token_id
    assert info["chat_template"] == tokenizer.chat_template
    assert_error(await client.post("/detokenize", json={"tokens": [len(tokenizer)]}), 400)


async def test_metrics_export_the_offloaded_and_restored_blocks() -> None:
    """The manager counted them; /metrics left them out."""
    from prometheus_client.parser import text_string_to_metric_families

    from aiocb.engine.manager import ManagerStatistics
    from aiocb.server.metrics import ServerMetrics

    class Engine:
        is_running = True

        def statistics(self) -> ManagerStatistics:
            return ManagerStatistics(True, 1, 2, 3, 4, 0.25, 5, 6, 7, 8, 9, 10, offloaded_blocks=11, restored_blocks=12)

    text = (await ServerMetrics(Engine(), MODEL_NAME).render()).decode()  # type: ignore[arg-type]
    value = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert value["aiocb_kv_offloaded_blocks_total"] == 11 and value["aiocb_kv_restored_blocks_total"] == 12
    assert value["aiocb_num_preemptions_total"] == 8


async def test_metrics(client: httpx.AsyncClient) -> None:
    body = {"prompt": PROMPT, "max_tokens": 5, "ignore_eos": True, "stream": True}
    await client.post("/v1/completions", json=body)
    await client.post("/v1/completions", json={"prompt": "x", "model": "nope"})
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families((await client.get("/metrics")).text)}
    value = {f"{s.name}{dict(s.labels).get('le', '')}": s.value for f in families.values() for s in f.samples}
    for name in ("aiocb_num_requests_running", "aiocb_num_requests_waiting", "aiocb_kv_cache_usage_perc"):
        assert name in families
    assert value["aiocb_num_requests_running"] == 0
    assert value["aiocb_kv_cache_free_blocks"] == value["aiocb_kv_cache_total_blocks"]
    assert value["aiocb_time_to_first_token_seconds_count"] == 1
    assert value["aiocb_inter_token_latency_seconds_count"] == 4
    assert value["aiocb_generation_tokens_total"] == 5
    assert value["aiocb_engine_generated_tokens_total"] >= 5
    assert "aiocb_prefix_cache_hit_tokens_total" in value
    assert not math.isnan(value["aiocb_e2e_request_latency_seconds_sum"])
    errors = [s for s in families["aiocb_http_errors"].samples if s.name.endswith("_total")]
    assert [(s.labels["status"], s.value) for s in errors] == [("404", 1.0)]
    finished = [s for s in families["aiocb_request_success"].samples if s.name.endswith("_total")]
    assert [(s.labels["finished_reason"], s.value) for s in finished] == [("length", 1.0)]


async def test_choices_a_hard_stop_aborts_are_counted_as_aborted(
    manager: aiocb.Manager, client: httpx.AsyncClient
) -> None:
    body = {"prompt": PROMPT, "max_tokens": 500, "ignore_eos": True, "stream": True, "n": 2}

    async def stream() -> list[str]:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            return [line async for line in response.aiter_lines() if line]

    streaming = asyncio.create_task(stream())
    while manager.statistics().steps < 3:  # noqa: ASYNC110 (polling the statistics is the point)
        await asyncio.sleep(0.01)
    await manager.stop(hard_stop=True)
    lines = await streaming
    assert "stop(hard_stop=True) aborted the request" in lines[-2]
    manager.start()
    text = (await client.get("/metrics")).text
    finished = [line for line in text.splitlines() if line.startswith("aiocb_request_success_total")]
    assert finished == ['aiocb_request_success_total{finished_reason="abort",model_name="tiny-qwen3"} 2.0']


async def test_probes_answered_503_are_not_counted_as_errors(model: PreTrainedModel, tokenizer: Any) -> None:
    manager = aiocb.Manager(model, continuous_batching_config=serve_config())  # (never started)
    app = build_app(manager, tokenizer, MODEL_NAME)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        for path in ("/health", "/ready"):
            response = await client.get(path)
            assert response.status_code == 503 and response.headers["Retry-After"] == "1"
            assert "the engine is" in response.json()["error"]["message"]
        assert "aiocb_http_errors_total{" not in (await client.get("/metrics")).text
        assert (await client.get("/nowhere")).status_code == 404
        assert 'status="404"' in (await client.get("/metrics")).text


async def test_metrics_count_a_prompt_once_and_only_the_tokens_clients_get(client: httpx.AsyncClient) -> None:
    """``n`` choices share one prompt: its tokens count once (latencies once per choice); a
    choice cut short by a stop string counts the tokens it returned, not those after."""
    from prometheus_client.parser import text_string_to_metric_families

    async def values() -> dict[str, float]:
        text = (await client.get("/metrics")).text
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}

    before = await values()
    body = {"prompt": PROMPT, "max_tokens": 12, "n": 3, "temperature": 1.0, "seed": 4, "stop": [" ", "e"]}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    after = await values()

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert grew("aiocb_prompt_tokens_total") == usage["prompt_tokens"]
    assert grew("aiocb_generation_tokens_total") == usage["completion_tokens"]
    assert grew("aiocb_time_to_first_token_seconds_count") == 3
    assert grew("aiocb_e2e_request_latency_seconds_count") == 3


async def test_every_token_after_a_choices_first_is_an_inter_token_observation(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A choice whose first read found several tokens (the loop busy before it) observed the
    time to first token alone: the others of that read were no inter-token observation."""
    from prometheus_client.parser import text_string_to_metric_families

    from aiocb.server import serving

    async def values() -> dict[str, float]:
        text = (await client.get("/metrics")).text
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}

    prepare = serving.prepare_stop_strings

    async def late(*args: Any) -> Any:
        await asyncio.sleep(0.3)  # (the tokens come meanwhile: the first read takes them all)
        return await prepare(*args)

    monkeypatch.setattr(serving, "prepare_stop_strings", late)
    before = await values()
    response = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 10, "ignore_eos": True})
    assert response.status_code == 200, response.text
    after = await values()
    assert response.json()["usage"]["completion_tokens"] == 10
    grew = {name: after[name] - before.get(name, 0.0) for name in after}
    assert grew["aiocb_time_to_first_token_seconds_count"] == 1
    assert grew["aiocb_inter_token_latency_seconds_count"] == 9


async def test_a_long_texts_ids_come_from_the_tokenizer_process_whole(
    client: httpx.AsyncClient, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``/tokenize`` counts a text however long: its ids come from the tokenizer process,
    made a list a slice at a time, and are written a slice of the loop at a time."""
    from aiocb import tokenizer_process

    answered: list[int] = []
    encode = tokenizer_process.TokenizerProcess.encode

    def spied(self: Any, text: str, **kwargs: Any) -> Any:
        tokenized = encode(self, text, **kwargs)
        answered.append(len(tokenized.ids))
        return tokenized

    monkeypatch.setattr(tokenizer_process.TokenizerProcess, "encode", spied)
    monkeypatch.setattr(tokenizer_process, "_LIST_SLICE", 1000)
    text = "Héllo wörld 🚀, " * 3000  # (more characters than the context's tokens could hold)
    answer = (await client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})).json()
    expected = tokenizer.encode(text, add_special_tokens=False)
    assert answer["tokens"] == expected and answer["count"] == len(expected) > 2048
    assert answered[-1] == len(expected)  # (after the probes that check the process tokenizes alike)


async def test_speculation_metrics(model: PreTrainedModel, tokenizer: Any) -> None:
    speculative = aiocb.SpeculativeConfig(prompt_lookup_min=1, disable_by_batch_size=None)
    async with aiocb.Manager(model, continuous_batching_config=serve_config(), speculative_config=speculative) as m:
        app = build_app(m, tokenizer, MODEL_NAME)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            body = {"prompt": "the cat and the dog " * 6, "max_tokens": 80, "temperature": 0, "ignore_eos": True}
            returned = 0
            # (the second ends at a stop string inside a run of accepted proposals: the tiny model repeats
            # " vVYа", which prompt lookup proposes)
            for fields in ({}, {"stop": "Yа vVYа"}):
                response = await http.post("/v1/completions", json={**body, **fields})
                assert response.status_code == 200
                returned += response.json()["usage"]["completion_tokens"]
            from prometheus_client.parser import text_string_to_metric_families

            text = (await http.get("/metrics")).text
    value = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert value["aiocb_generation_tokens_total"] == returned
    stats = m.statistics()
    assert value["aiocb_spec_decode_draft_tokens_total"] == stats.draft_tokens > 0
    assert value["aiocb_spec_decode_accepted_tokens_total"] == stats.accepted_draft_tokens
    assert value["aiocb_spec_decode_acceptance_rate"] == pytest.approx(stats.acceptance_rate)


async def test_generation_controls_are_honoured(
    client: httpx.AsyncClient, manager: aiocb.Manager, tokenizer: Any
) -> None:
    """Penalties, biases, min_p and the rarer filters, min_tokens and allow-lists reach the engine: the text equals
    the library's for the same parameters, and differs from the plain greedy text."""
    ids = tokenizer.encode(PROMPT)
    plain = await greedy(manager, ids, 16)
    allowed = sorted(set(plain.generated_tokens))[:3]
    cases: list[dict[str, Any]] = [
        {"repetition_penalty": 1.8},
        {"presence_penalty": 1.5, "frequency_penalty": 1.0},
        {"logit_bias": {str(plain.generated_tokens[0]): -100}},
        {"allowed_token_ids": allowed},
        {"min_p": 0.2, "temperature": 1.0, "seed": 3},
        {"typical_p": 0.5, "eta_cutoff": 0.01, "temperature": 1.0, "top_k": 40, "seed": 4},
        {"top_h": 0.6, "epsilon_cutoff": 0.001, "temperature": 1.0, "top_k": 40, "seed": 5},
        {"no_repeat_ngram_size": 1},
        {"bad_words": [word for word in map(tokenizer.decode, plain.generated_tokens) if word.strip().isalpha()][:1]},
    ]
    for controls in cases:
        body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True, **controls}
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        library = dict(controls)
        if "logit_bias" in library:
            library["logit_bias"] = {int(k): v for k, v in library["logit_bias"].items()}
        if "bad_words" in library:  # (this manager works in token ids)
            assert library["bad_words"], "no word to ban in the plain text"
            library["bad_words_ids"] = bad_words_ids(library.pop("bad_words"), tokenizer)
        expected = await manager.generate(ids, max_new_tokens=16, ignore_eos=True, **{"temperature": 0.0, **library})
        text = response.json()["choices"][0]["text"]
        assert text == tokenizer.decode(expected.generated_tokens, skip_special_tokens=True), controls
        if "temperature" not in controls:
            assert expected.generated_tokens != plain.generated_tokens, controls


async def test_stop_strings_give_the_library_text(
    client: httpx.AsyncClient, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One stop-string implementation: for stop strings that span tokens, sit inside a
    multi-byte character's bytes, are held back by min_tokens, or are many and long (their
    automaton built off the loop), the server's text equals the library's ``output.text``
    (a Manager with the tokenizer, on an identical model)."""
    from aiocb import stop_strings

    built_large: list[str] = []  # the threads that built automata of more than BUILT_ON_THE_LOOP characters

    class Recorded(stop_strings.StopStrings):
        def __init__(self, stops: Any, *args: Any) -> None:
            if sum(map(len, stops)) > stop_strings.BUILT_ON_THE_LOOP:
                built_large.append(threading.current_thread().name)
            super().__init__(stops, *args)

    monkeypatch.setattr(stop_strings, "StopStrings", Recorded)
    unused = [f"{i:02} not in any output " * 40 for i in range(63)]
    prompts = ["Once upon a time", "Привет, мир", "你好，世界", "Emoji: 😀"]
    library_model = serve_model(tokenizer)  # the same seeded weights as the server's model
    async with aiocb.Manager(library_model, tokenizer=tokenizer) as library:
        plain = [await library.generate(p, max_new_tokens=24, ignore_eos=True) for p in prompts]
        cases: list[tuple[str, dict[str, Any]]] = []
        for prompt, output in zip(prompts, plain, strict=True):
            text = output.text or ""
            tokens = output.generated_tokens
            start = len(tokenizer.decode(tokens[:2])) - 1
            cases.append((prompt, {"stop": [text[start : start + 4]]}))  # spans tokens 2 and 3
            cases.append((prompt, {"stop": text[start : start + 3], "include_stop_str_in_output": True}))
            cases.append((prompt, {"stop": [text[start : start + 2]], "min_tokens": 6}))
            cases.append((prompt, {"stop": [*unused[:32], text[start : start + 4], *unused[32:]], "n": 2}))
            wide = [c for c in text if len(c.encode()) > 1 and c != "\ufffd"]
            if wide:
                cases.append((prompt, {"stop": wide[0]}))
        assert any(len(c["stop"][0].encode()) > 1 for _, c in cases if len(c["stop"]) == 1), "no multi-byte stop"
        for prompt, params in cases:
            expected = await library.generate(prompt, max_new_tokens=24, ignore_eos=True, **params)
            body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, **params}
            if "n" in params:  # (in another order: the server's request builds its own automaton)
                body["stop"] = [params["stop"][32], *unused]
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            texts = [e.text for e in expected] if isinstance(expected, list) else [expected.text]
            assert [c["text"] for c in response.json()["choices"]] == texts, (prompt, params)
    # Once for each prompt's long stop strings in the library (shared by the samples), once
    # in the server (shared by the choices), each off the loop.
    assert len(built_large) == 2 * len(prompts) and threading.current_thread().name not in built_large


async def test_usage_reports_cached_prompt_tokens(client: httpx.AsyncClient, tokenizer: Any) -> None:
    """A prompt whose full blocks are in the prefix cache reports them as cached_tokens;
    with n > 1, the choices reusing the first one's blocks do not count as cached."""
    prompt = "Question: What is the capital of France? Answer: Paris. " * 3
    ids = tokenizer.encode(prompt)
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    first = (await client.post("/v1/completions", json={**body, "n": 3})).json()["usage"]
    second = (await client.post("/v1/completions", json=body)).json()["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    page = 16  # serve_config's page size: the cache holds whole blocks
    assert second["prompt_tokens_details"]["cached_tokens"] == (len(ids) - 1) // page * page > 0


async def test_a_replica_s_metrics_carry_its_name(manager: aiocb.Manager, tokenizer: Any) -> None:
    """Replicas of one model behind one route: a scrape answered by either keeps their
    series apart (each counter would seem to jump back and forth otherwise)."""
    from prometheus_client.parser import text_string_to_metric_families

    app = build_app(manager, tokenizer, MODEL_NAME, replica="r7")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
        await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        await http.post("/v1/completions", json={"prompt": PROMPT, "model": "nope"})
        text = (await http.get("/metrics")).text
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples if s.name.startswith("aiocb_")]
    assert {"aiocb_engine_steps_total", "aiocb_prompt_tokens_total", "aiocb_http_errors_total"} <= {
        s.name for s in samples
    }
    assert all(s.labels["replica"] == "r7" and s.labels["model_name"] == MODEL_NAME for s in samples)


async def test_a_token_after_stray_bytes_is_offset_to_its_own_text(client: httpx.AsyncClient, tokenizer: Any) -> None:
    """Bytes that make no character come out as U+FFFD with the next token's text: that
    token's ``text_offset`` is after them, where its own text starts (echoed prompt tokens
    and generated ones, whole and streamed alike)."""
    stray = tokenizer.convert_tokens_to_ids("î")  # (a byte-level token: the lone byte 0xEE)
    ids = [tokenizer.convert_tokens_to_ids("0"), stray, tokenizer.convert_tokens_to_ids("ran"), stray, stray]
    ids.append(tokenizer.convert_tokens_to_ids("0"))
    body = {"prompt": ids, "max_tokens": 40, "temperature": 1.0, "seed": 0, "echo": True, "logprobs": 0}
    whole = (await client.post("/v1/completions", json={**body, "ignore_eos": True})).json()["choices"][0]
    events = sse_events((await client.post("/v1/completions", json={**body, "ignore_eos": True, "stream": True})).text)
    streamed = [t for e in events[:-1] for t in e["choices"][0]["logprobs"]["text_offset"]]
    text, tokens, offsets = whole["text"], whole["logprobs"]["tokens"], whole["logprobs"]["text_offset"]
    assert text.startswith("0\ufffdran\ufffd\ufffd0") and streamed == offsets
    assert [offsets[k] for k in (0, 1, 2, 5)] == [0, 1, 2, 7]
    after_stray = 0
    for k, (token, at) in enumerate(zip(tokens, offsets, strict=True)):
        if not token.startswith("bytes:") and token not in tokenizer.all_special_tokens:  # (skipped)
            assert text[at:].startswith(token), (k, token, text[at : at + 10])
            after_stray += k > 6 and tokens[k - 1].startswith("bytes:")
    assert after_stray >= 3  # (the sampled output has stray bytes too)
