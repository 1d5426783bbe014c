"""Structured outputs through the server: OpenAI's ``response_format``, vLLM's
``structured_outputs`` and ``guided_*`` fields, and their refusals."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from transformers import PreTrainedModel

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

import aiocb  # noqa: E402
from aiocb.server import build_app  # noqa: E402
from tests.server.conftest import MODEL_NAME, serve_config  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
    "required": ["id", "ok"],
    "additionalProperties": False,
}


@pytest.fixture
async def client(model: PreTrainedModel, tokenizer: Any) -> AsyncIterator[httpx.AsyncClient]:
    """The server over a manager in token ids that knows the tokenizer's vocabulary for grammars."""
    config = serve_config()
    async with aiocb.Manager(model, continuous_batching_config=config, grammar_tokenizer=tokenizer) as manager:
        app = build_app(manager, tokenizer, MODEL_NAME)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            yield http
        stats = manager.statistics()
        assert stats.free_blocks == stats.total_blocks, "blocks leaked"


async def _completion(client: httpx.AsyncClient, *, ends: bool = True, **fields: Any) -> list[str]:
    """The texts of three samples; ``ends``: each ended by its constraint, not its length."""
    body = {"model": MODEL_NAME, "prompt": "data = ", "max_tokens": 48, "temperature": 1.0, "seed": 3, "n": 3}
    response = await client.post("/v1/completions", json={**body, **fields})
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert not ends or all(c["finish_reason"] == "stop" for c in choices), choices
    return [c["text"] for c in choices]


async def test_response_format_json_schema_and_json_object(client: httpx.AsyncClient) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA, "strict": True}}
    for text in await _completion(client, response_format=response_format):
        jsonschema.validate(json.loads(text), SCHEMA)
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "an object please"}],
        "max_tokens": 64,
        "temperature": 1.0,
        "seed": 1,
        "response_format": {"type": "json_object"},
    }
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    else:  # a random model may write a long object: what it wrote still opens one
        assert choice["message"]["content"].startswith("{")


async def test_vllm_fields(client: httpx.AsyncClient) -> None:
    for text in await _completion(client, structured_outputs={"regex": r"[a-c]{2}[0-9]"}):
        assert re.fullmatch(r"[a-c]{2}[0-9]", text)
    for text in await _completion(client, guided_choice=["yes", "no"]):
        assert text in ("yes", "no")
    for text in await _completion(client, guided_json=json.dumps(SCHEMA)):
        jsonschema.validate(json.loads(text), SCHEMA)
    for text in await _completion(client, guided_grammar='root ::= "(" [0-9] ")"'):
        assert re.fullmatch(r"\([0-9]\)", text)
    content = {"type": "json_schema", "json_schema": SCHEMA, "max_whitespace_cnt": 1}
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "[", "content": content, "end": "]"}}
    older = {"type": "structural_tag", "structures": [{"begin": "[", "schema": SCHEMA, "end": "]"}], "triggers": ["["]}
    for fields in ({"structured_outputs": {"structural_tag": json.dumps(tag)}}, {"response_format": tag}):
        for text in await _completion(client, **fields):
            jsonschema.validate(json.loads(text[1:-1]), SCHEMA)
            assert text[0] + text[-1] == "[]"
    for text in await _completion(client, ends=False, response_format=older):  # free text; "[" opens a span
        for span in re.findall(r"\[(.*?)\]", text):
            jsonschema.validate(json.loads(span), SCHEMA)


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema or structural_tag"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "the JSON schema under"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": []}}},
            "response_format.json_schema.schema",
            "must be a JSON schema object",
        ),
        ({"guided_json": {"type": "nonsense"}}, "guided_json", "guided_json cannot be compiled"),
        (  # (a name of the engine's in the request's own schema is not renamed)
            {"guided_json": {"type": "object", "properties": {"input_ids": {"not": {"type": "null"}}}}},
            "guided_json",
            "'not' at /properties/input_ids",
        ),
        ({"structured_outputs": {"regex": "("}}, "structured_outputs.regex", "regex cannot be compiled"),
        ({"guided_regex": "("}, "guided_regex", "regex cannot be compiled"),
        (
            {"response_format": {"type": "structural_tag", "format": {"type": "regex", "pattern": "a", "flags": "i"}}},
            "response_format.format.flags",
            "the 'regex' format has no key 'flags'",
        ),
        (
            {"structured_outputs": {"structural_tag": {"format": {"type": "any_text", "max_token": 3}}}},
            "structured_outputs.structural_tag.format.max_token",
            "the 'any_text' format has no key 'max_token'",
        ),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        (
            {"structured_outputs": {"xml": "<a/>"}},
            "structured_outputs.xml",
            "unsupported field(s) 'structured_outputs.xml'",
        ),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "give one output constraint"),
    ],
)
async def test_bad_constraints_are_400s_naming_the_field(
    client: httpx.AsyncClient, fields: dict[str, Any], param: str | None, message: str
) -> None:
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 4, **fields}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"]
    if param is not None:
        assert error["param"] == param


async def test_controls_that_leave_a_constraint_no_token_are_a_400(client: httpx.AsyncClient, tokenizer: Any) -> None:
    letter = tokenizer.convert_tokens_to_ids("a")
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 8, "structured_outputs": {"regex": r"\d+"}}
    response = await client.post("/v1/completions", json={**body, "allowed_token_ids": [letter]})
    assert response.status_code == 400, response.text
    assert "output constraint" in response.json()["error"]["message"]
    for text in await _completion(client, structured_outputs={"regex": r"\d+"}):  # (the server goes on)
        assert re.fullmatch(r"\d+", text)
