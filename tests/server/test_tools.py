"""Tool calling and reasoning through the chat endpoint: ``tools`` in the template,
``tool_choice`` none / auto / required / a named function, enforced calls that validate,
streams that reassemble to the response, conversation turns with tool results, and the
refusals."""

from __future__ import annotations

import copy
import json
import re
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from transformers import PreTrainedModel

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

import aiocb  # noqa: E402
from aiocb.server import build_app, chat  # noqa: E402
from aiocb.server.protocol import APIError  # noqa: E402
from aiocb.server.reasoning import after_thinking  # noqa: E402
from aiocb.server.tool_parsers import PARSERS, ToolCallParser  # noqa: E402
from aiocb.server.tools import parse_tools, structural_tag  # noqa: E402
from tests.server.conftest import MODEL_NAME, build_tokenizer, serve_config, serve_model  # noqa: E402

#: A Hermes-style (Qwen 2.5) template, reduced to what the tests need.
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>\n{%- for tool in tools %}\n{{ tool | tojson }}"
    "{%- endfor %}\n</tools>\nCall a function as <tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n{%- endif %}'
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{%- for call in message.tool_calls or [] %}\n<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% if think %}<think>\n{% endif %}{%- endif %}"
)
#: A Mistral-style (v0.3) template, reduced: as Mistral's own, it takes only call ids of
#: nine letters and digits, and writes them into the prompt.
MISTRAL_TEMPLATE = (
    "{%- set refuse = 'Tool call IDs should be alphanumeric strings with length 9!' %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}[INST] {{ message.content }}[/INST]"
    "{%- elif message.tool_calls %}[TOOL_CALLS] [{%- for call in message.tool_calls %}"
    "{%- if call.id | length != 9 %}{{ raise_exception(refuse) }}{%- endif %}"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}, '
    '"id": "{{ call.id }}"}{%- if not loop.last %}, {% endif %}{%- endfor %}]'
    "{%- elif message.role == 'tool' %}"
    "{%- if message.tool_call_id | length != 9 %}{{ raise_exception(refuse) }}{%- endif %}"
    '[TOOL_RESULTS] {"content": {{ message.content | tojson }}, "call_id": "{{ message.tool_call_id }}"}'
    "[/TOOL_RESULTS]{%- else %} {{ message.content }}{%- endif %}{%- endfor %}"
)
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "boolean"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
FLAG = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}


def _tools(*, strict: bool | None = None) -> list[dict[str, Any]]:
    tools = []
    for name, schema in SCHEMAS.items():
        function: dict[str, Any] = {"name": name, "description": f"the {name} tool", "parameters": schema}
        if strict is not None:
            function["strict"] = strict
        tools.append({"type": "function", "function": function})
    return tools


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    tokenizer = build_tokenizer()
    # As in Qwen's tokenizer: single tokens that stay in the text (not "special").
    tokenizer.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"])
    tokenizer.chat_template = TOOLS_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def model(tokenizer: Any) -> PreTrainedModel:
    return serve_model(tokenizer, seed=2)


@pytest.fixture
async def manager(model: PreTrainedModel, tokenizer: Any) -> AsyncIterator[aiocb.Manager]:
    config = serve_config()
    async with aiocb.Manager(model, continuous_batching_config=config, grammar_tokenizer=tokenizer) as manager:
        yield manager
        stats = manager.statistics()
        assert stats.free_blocks == stats.total_blocks, "blocks leaked"


async def _client(manager: aiocb.Manager, tokenizer: Any, **options: Any) -> httpx.AsyncClient:
    app = build_app(manager, tokenizer, MODEL_NAME, **options)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


@pytest.fixture
async def client(manager: aiocb.Manager, tokenizer: Any) -> AsyncIterator[httpx.AsyncClient]:
    async with await _client(manager, tokenizer) as http:
        yield http


def _body(**fields: Any) -> dict[str, Any]:
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": _tools(),
        "max_tokens": 160,
        "temperature": 1.0,
        "seed": 11,
    }
    return {**body, **fields}


async def _chat(client: httpx.AsyncClient, **fields: Any) -> dict[str, Any]:
    response = await client.post("/v1/chat/completions", json=_body(**fields))
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def _check_calls(message: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    calls = []
    for call in message["tool_calls"]:
        assert call["type"] == "function"
        assert call["id"].startswith("call_")
        name, arguments = call["function"]["name"], json.loads(call["function"]["arguments"])
        jsonschema.validate(arguments, SCHEMAS[name])
        calls.append((name, arguments))
    return calls


async def test_required_and_named_tool_choice_give_valid_calls(client: httpx.AsyncClient) -> None:
    result = await _chat(client, tool_choice="required", parallel_tool_calls=False, n=6)
    for choice in result["choices"]:
        assert choice["finish_reason"] == "tool_calls", choice
        assert choice["message"]["content"] is None
        assert len(_check_calls(choice["message"])) == 1
    named = {"type": "function", "function": {"name": "add"}}
    result = await _chat(client, tool_choice=named, n=6)
    for choice in result["choices"]:
        assert choice["finish_reason"] == "stop", choice  # (as OpenAI answers a forced function)
        ((name, _),) = _check_calls(choice["message"])
        assert name == "add"
    # Parallel calls allowed: one or more, every one valid.
    result = await _chat(client, tool_choice="required", n=4, max_tokens=400)
    for choice in result["choices"]:
        if choice["finish_reason"] == "tool_calls":
            assert len(_check_calls(choice["message"])) >= 1


def test_many_tools_names_are_checked_in_one_pass() -> None:
    """40,000 tools whose last repeats a name: refused naming it at once (each name looked
    for among the earlier ones in a list took 50 s)."""
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(40_000)]
    started = time.perf_counter()
    with pytest.raises(APIError, match=r"'tools\[40000\].function.name' is 'f7'"):
        parse_tools({"tools": [*tools, tools[7]]})
    assert time.perf_counter() - started < 10


def test_parameters_that_say_no_type_are_an_objects() -> None:
    """``"parameters": {}`` (any arguments): the call's arguments are still an object, which
    the parsers take (any JSON value, a number say, made the call vanish)."""
    xgrammar = pytest.importorskip("xgrammar")
    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo(["a"]))
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    request = parse_tools({"tools": tools, "tool_choice": "required", "parallel_tool_calls": False})
    assert request is not None
    compiled = compiler.compile_structural_tag(json.dumps(structural_tag(request, "qwen_3", "disabled", "\n")))

    def takes(arguments: str) -> bool:
        matcher = xgrammar.GrammarMatcher(compiled)
        text = f'<tool_call>\n{{"name": "f", "arguments": {arguments}}}\n</tool_call>'
        return bool(matcher.accept_string(text) and matcher.is_completed())

    assert takes('{"x": [1, 2]}') and takes("{}")
    assert not takes("1e-3") and not takes('"text"') and not takes("[1]")


@pytest.mark.parametrize("parser", list(PARSERS.values()), ids=list(PARSERS))
@pytest.mark.parametrize("choice", ["required", "named"])
@pytest.mark.parametrize("parallel", [True, False])
def test_calls_alone_are_enforced_with_no_text_around_them(
    parser: type[ToolCallParser], choice: str, parallel: bool
) -> None:
    """``required`` and a named function: the grammar takes one call (two, separated, when
    parallel calls are allowed and no function is named) and no text before or after."""
    xgrammar = pytest.importorskip("xgrammar")
    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo(["a"]))
    named = {"type": "function", "function": {"name": "get_weather"}}
    body = {"tools": _tools(), "tool_choice": named if choice == "named" else choice, "parallel_tool_calls": parallel}
    request = parse_tools(body)
    assert request is not None and request.calls_only
    tag = structural_tag(request, parser.xgrammar_format, "disabled", parser.separator)
    compiled = compiler.compile_structural_tag(json.dumps(tag))

    def takes(text: str) -> bool:
        matcher = xgrammar.GrammarMatcher(compiled)
        return bool(matcher.accept_string(text) and matcher.is_completed())

    call = {
        "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>',
        "llama3_json": '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}',
        "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}]',
    }[parser.name]
    assert takes(call)
    assert not takes(call + " It is sunny.") and not takes("Let me see. " + call)
    assert takes(call + parser.separator + call) == (parallel and choice == "required")


@pytest.mark.parametrize("parser", list(PARSERS.values()), ids=list(PARSERS))
def test_calls_alone_may_follow_a_reasoning_models_thinking(parser: type[ToolCallParser]) -> None:
    """With a reasoning parser the thinking comes first, free, then the calls: in every
    format (xgrammar builds it into its qwen_3 format alone)."""
    xgrammar = pytest.importorskip("xgrammar")
    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo(["a"]))
    request = parse_tools({"tools": _tools(), "tool_choice": "required"})
    assert request is not None
    call = {
        "hermes": '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": true}}\n</tool_call>',
        "llama3_json": '{"name": "add", "parameters": {"a": 1, "b": true}}',
        "mistral": '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": true}}]',
    }[parser.name]

    def takes(mode: str, text: str) -> bool:
        tag = structural_tag(request, parser.xgrammar_format, mode, parser.separator)
        matcher = xgrammar.GrammarMatcher(compiler.compile_structural_tag(json.dumps(tag)))
        return bool(matcher.accept_string(text) and matcher.is_completed())

    assert takes("enabled", "Adding.</think>\n\n" + call) and not takes("enabled", call)  # (the prompt opened it)
    assert takes("auto", "<think>Adding.</think>\n\n" + call) and takes("auto", call)
    assert not takes("auto", "<think>Adding.</think>\n\n" + call + " Done.")


def _call_text(parser: type[ToolCallParser], name: str, arguments: str) -> str:
    """One call of ``name`` in ``parser``'s format, its arguments the JSON text given."""
    return {
        "hermes": f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>',
        "llama3_json": f'{{"name": "{name}", "parameters": {arguments}}}',
        "mistral": f'[TOOL_CALLS][{{"name": "{name}", "arguments": {arguments}}}]',
    }[parser.name]


@pytest.mark.parametrize("parser", list(PARSERS.values()), ids=list(PARSERS))
def test_enforced_arguments_are_an_object_of_the_functions_parameters(parser: type[ToolCallParser]) -> None:
    """Where a call is enforced, its arguments follow the function's parameters, ``strict``
    false or not (``required``, a named function), and a function without parameters
    takes none; in ``auto``, a tool not marked strict beside one that is takes any object,
    whatever its schema holds (which the grammar need not take)."""
    xgrammar = pytest.importorskip("xgrammar")
    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo(["a"]))

    def takes(body: dict[str, Any], call: str) -> bool:
        request = parse_tools(body)
        assert request is not None
        tag = structural_tag(request, parser.xgrammar_format, "disabled", parser.separator)
        matcher = xgrammar.GrammarMatcher(compiler.compile_structural_tag(json.dumps(tag)))
        return bool(matcher.accept_string(call) and matcher.is_completed())

    bare = [{"type": "function", "function": {"name": "ping"}}]
    for choice in ("required", {"type": "function", "function": {"name": "ping"}}):
        body = {"tools": bare, "tool_choice": choice, "parallel_tool_calls": False}
        assert takes(body, _call_text(parser, "ping", "{}"))
        for arguments in ("2", '"x"', "[]", '{"x": 1}'):
            assert not takes(body, _call_text(parser, "ping", arguments)), arguments
    loose = {"tools": _tools(strict=False), "tool_choice": "required", "parallel_tool_calls": False}
    assert takes(loose, _call_text(parser, "get_weather", '{"city": "Oslo", "days": 2}'))
    assert not takes(loose, _call_text(parser, "get_weather", '{"city": "Rome", "days": 2}'))
    assert not takes(loose, _call_text(parser, "get_weather", "7"))
    mixed = _tools()
    mixed[0]["function"]["strict"] = True
    mixed[1]["function"]["parameters"] = {**ADD, "not": {"required": ["a"]}}  # (no grammar takes "not")
    body = {"tools": mixed, "tool_choice": "auto", "parallel_tool_calls": False}
    assert takes(body, _call_text(parser, "add", '{"anything": [1, 2]}'))
    assert not takes(body, _call_text(parser, "add", "7"))
    assert not takes(body, _call_text(parser, "get_weather", '{"city": "Rome", "days": 2}'))


async def test_required_parallel_calls_come_with_no_content(client: httpx.AsyncClient) -> None:
    """Sampled hot, with room for several calls: every choice is calls (the last maybe cut
    short by max_tokens, its arguments as far as they were written), never text."""
    for seed in (1, 2):
        result = await _chat(client, tool_choice="required", n=8, temperature=1.3, seed=seed, max_tokens=120)
        for choice in result["choices"]:
            message = choice["message"]
            assert message["content"] is None, choice
            calls = message["tool_calls"]
            assert calls and all(call["function"]["name"] in SCHEMAS for call in calls), choice
            if choice["finish_reason"] == "tool_calls":
                _check_calls(message)
            else:
                assert choice["finish_reason"] == "length"
                _check_calls({"tool_calls": calls[:-1]})


def _reassemble(events: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """Choices rebuilt from stream chunks, as an OpenAI client accumulates them."""
    messages: list[dict[str, Any]] = [{"content": "", "reasoning_content": "", "tool_calls": {}} for _ in range(n)]
    finish: list[str | None] = [None] * n
    for event in events:
        for choice in event["choices"]:
            message, piece = messages[choice["index"]], choice["delta"]
            message["content"] += piece.get("content") or ""
            message["reasoning_content"] += piece.get("reasoning_content") or ""
            for call in piece.get("tool_calls", []):
                whole = message["tool_calls"].setdefault(call["index"], {"arguments": ""})
                whole["name"] = call.get("function", {}).get("name", whole.get("name"))
                whole["arguments"] += call.get("function", {}).get("arguments", "")
            finish[choice["index"]] = choice["finish_reason"] or finish[choice["index"]]
    return [
        {
            "content": m["content"] or None,
            "reasoning_content": m["reasoning_content"] or None,
            "calls": [m["tool_calls"][i] for i in sorted(m["tool_calls"])],
            "finish_reason": finish[j],
        }
        for j, m in enumerate(messages)
    ]


async def _stream(client: httpx.AsyncClient, **fields: Any) -> list[dict[str, Any]]:
    events = []
    async with client.stream("POST", "/v1/chat/completions", json=_body(stream=True, **fields)) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: ") :]))
    return events


def _flat(choice: dict[str, Any]) -> dict[str, Any]:
    message = choice["message"]
    return {
        "content": message["content"] or None,
        "reasoning_content": message.get("reasoning_content"),
        "calls": [dict(c["function"]) for c in message.get("tool_calls", [])],
        "finish_reason": choice["finish_reason"],
    }


@pytest.mark.parametrize(
    "fields",
    [
        {"tool_choice": "required"},
        {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
        {"tools": _tools(strict=True)},  # auto, enforced: the bias makes the model call
    ],
    ids=["required", "named", "auto-strict"],
)
async def test_stream_reassembles_to_the_response(
    client: httpx.AsyncClient, tokenizer: Any, fields: dict[str, Any]
) -> None:
    bias = {str(tokenizer.convert_tokens_to_ids("<tool_call>")): 8}
    fields = {"n": 3, "logit_bias": bias, "parallel_tool_calls": False, **fields}
    whole = await _chat(client, **fields)
    events = await _stream(client, **fields)
    # The role first, with null content where the answer is calls alone (as the response's).
    calls_only = fields.get("tool_choice", "auto") != "auto"
    assert [e["choices"][0]["delta"] for e in events[:3]] == [
        {"role": "assistant", "content": None if calls_only else ""}
    ] * 3
    streamed = _reassemble(events, 3)
    flat = [_flat(choice) for choice in whole["choices"]]
    for choice in flat:
        choice["reasoning_content"] = None
    assert streamed == flat
    for choice in whole["choices"]:
        assert choice["message"]["tool_calls"], choice
        _check_calls(choice["message"])


async def test_a_named_call_cut_before_its_arguments_is_still_that_functions_call(client: httpx.AsyncClient) -> None:
    """As OpenAI's: the function's name is the request's, not the model's, so a call that
    ``max_tokens`` cut before its arguments is that function's, with none written (it came
    back as no call at all: an empty message), streamed and not."""
    fields = {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "max_tokens": 3, "n": 2}
    whole = await _chat(client, **fields)
    for choice in whole["choices"]:
        assert choice["finish_reason"] == "length"
        assert choice["message"]["content"] is None
        assert [call["function"] for call in choice["message"]["tool_calls"]] == [
            {"name": "get_weather", "arguments": ""}
        ]
    streamed = _reassemble(await _stream(client, **fields), 2)
    assert streamed == [_flat(choice) for choice in whole["choices"]]


async def test_auto_without_strict_is_free_text_and_none_shows_the_tools_but_calls_none(
    client: httpx.AsyncClient,
) -> None:
    free = await _chat(client, max_tokens=24)
    assert free["choices"][0]["message"]["content"] is not None or free["choices"][0]["message"].get("tool_calls")
    plain = await _chat(client, tools=None, max_tokens=4)
    # The text of a call, written under a regex: a call under "auto", content under "none".
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": true}}\n</tool_call>'
    fields = {"structured_outputs": {"regex": re.escape(call)}, "max_tokens": 120}
    called = await _chat(client, **fields)
    assert [c["function"] for c in called["choices"][0]["message"]["tool_calls"]] == [
        {"name": "add", "arguments": '{"a": 1, "b": true}'}
    ]
    shown = await _chat(client, tool_choice="none", **fields)
    assert shown["usage"]["prompt_tokens"] == free["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]
    assert shown["choices"][0]["message"]["content"] == call
    assert "tool_calls" not in shown["choices"][0]["message"]
    assert shown["choices"][0]["finish_reason"] == "stop"
    streamed = _reassemble(await _stream(client, tool_choice="none", **fields), 1)
    assert streamed == [_flat(shown["choices"][0])]


async def test_tokenize_counts_a_chat_with_its_tools(client: httpx.AsyncClient) -> None:
    """``/tokenize`` renders tools as a chat completion does: the same prompt tokens."""
    body = _body(max_tokens=1)
    counted = await client.post("/tokenize", json={"messages": body["messages"], "tools": body["tools"]})
    without = await client.post("/tokenize", json={"messages": body["messages"]})
    assert counted.json()["count"] == (await _chat(client, max_tokens=1))["usage"]["prompt_tokens"]
    assert counted.json()["count"] > without.json()["count"]
    refused = await client.post("/tokenize", json={"prompt": "hi", "tools": body["tools"]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools"
    bad = await client.post("/tokenize", json={"messages": body["messages"], "tools": {"x": 1}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools"


async def test_a_tool_result_turn_renders_through_the_template(client: httpx.AsyncClient, tokenizer: Any) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 20 C"},
    ]
    response = await client.post("/tokenize", json={"model": MODEL_NAME, "messages": messages})
    assert response.status_code == 200, response.text
    text = tokenizer.decode(response.json()["tokens"])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny, 20 C\n</tool_response>" in text
    result = await _chat(client, messages=messages, tool_choice="required", parallel_tool_calls=False)
    _check_calls(result["choices"][0]["message"])


def _turn(**call: Any) -> list[dict[str, Any]]:
    """A conversation whose assistant turn made one call: ``call``'s fields over a valid one."""
    made = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": true}'}, **call}
    return [
        {"role": "user", "content": "Add."},
        {"role": "assistant", "content": None, "tool_calls": [made]},
        {"role": "tool", "tool_call_id": "c1", "content": "2"},
    ]


NAMED = {"type": "function", "function": {"name": "add"}}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": {**NAMED, "x": 1}}, "tool_choice.x"),
        ({"tool_choice": {**NAMED, "function": {"name": "add", "arguments": "{}"}}}, "tool_choice.function.arguments"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": [*_tools(), *_tools()]}, "tools[2].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "tools[0].function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": [{"type": "function", "function": {"name": "f", "bogus": 1}}]}, "tools[0].function.bogus"),
        ({"tools": [{**_tools()[0], "cache_control": {"type": "ephemeral"}}]}, "tools[0].cache_control"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tool_choice": "required", "echo": True}, "echo"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
        (
            {"messages": _turn(function={"name": "add", "arguments": "{oops"})},
            "messages[1].tool_calls[0].function.arguments",
        ),
        ({"messages": _turn(x=1)}, "messages[1].tool_calls[0].x"),
        ({"messages": _turn(type="retrieval")}, "messages[1].tool_calls[0].type"),
        (
            {"messages": _turn(function={"name": "add", "arguments": "{}", "parsed": {}})},
            "messages[1].tool_calls[0].function.parsed",
        ),
    ],
)
async def test_bad_tool_requests_are_refused(client: httpx.AsyncClient, fields: dict[str, Any], param: str) -> None:
    response = await client.post("/v1/chat/completions", json=_body(**fields))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert param in response.json()["error"]["message"]


async def test_a_call_sent_back_as_clients_rebuild_it_is_taken(client: httpx.AsyncClient) -> None:
    parsed = {"name": "add", "arguments": '{"a": 1, "b": true}', "parsed_arguments": {"a": 1, "b": True}}
    for messages in (_turn(), _turn(index=0), _turn(function=parsed)):
        response = await client.post("/tokenize", json={"model": MODEL_NAME, "messages": messages})
        assert response.status_code == 200, response.text


async def test_mistral_call_ids_make_the_round_trip(manager: aiocb.Manager, tokenizer: Any) -> None:
    """Mistral's templates refuse call ids other than nine letters and digits: the server's
    own ids (streamed and not) were OpenAI's 29-character ones, so no call could be sent
    back with its result. Ids made elsewhere are mapped alike for a call and its result."""
    mistral = copy.deepcopy(tokenizer)
    mistral.chat_template = MISTRAL_TEMPLATE
    forced = {"tool_choice": {"type": "function", "function": {"name": "add"}}, "n": 2}
    user = {"role": "user", "content": "Add 1."}
    async with await _client(manager, mistral, tool_call_parser="mistral") as http:
        whole = await _chat(http, **forced)
        events = await _stream(http, **forced)
        ids = [choice["message"]["tool_calls"][0]["id"] for choice in whole["choices"]]
        ids += [
            call["id"]
            for event in events
            for choice in event["choices"]
            for call in choice["delta"].get("tool_calls", [])
            if "id" in call
        ]
        assert len(ids) == len(set(ids)) == 4
        assert all(re.fullmatch("[A-Za-z0-9]{9}", call_id) for call_id in ids), ids
        message = whole["choices"][0]["message"]
        result = {"role": "tool", "tool_call_id": ids[0], "content": "3"}
        await _chat(http, messages=[user, message, result], max_tokens=2)  # (a 200)

        theirs = "call_8ccfa0b46a2c45aa9f84adc3"
        message = {**message, "tool_calls": [{**message["tool_calls"][0], "id": theirs}]}
        turns = [[user, message, {**result, "tool_call_id": theirs}]] * 2
        texts = []
        for turn in turns:
            response = await http.post("/tokenize", json={"model": MODEL_NAME, "messages": turn})
            assert response.status_code == 200, response.text
            texts.append(mistral.decode(response.json()["tokens"]))
    assert texts[0] == texts[1]
    (call_id,) = re.findall(r'"id": "(\w+)"', texts[0])
    assert re.findall(r'"call_id": "(\w+)"', texts[0]) == [call_id]
    assert re.fullmatch("[A-Za-z0-9]{9}", call_id)


async def test_without_a_parser_tools_are_refused(manager: aiocb.Manager, tokenizer: Any) -> None:
    async with await _client(manager, tokenizer, tool_call_parser=None) as http:
        response = await http.post("/v1/chat/completions", json=_body())
        assert response.status_code == 400
        assert "--tool-call-parser" in response.json()["error"]["message"]
        assert (await http.post("/v1/chat/completions", json=_body(tool_choice="none"))).status_code == 200


async def test_reasoning_content(manager: aiocb.Manager, tokenizer: Any) -> None:
    """A template that opens <think> itself: the output starts inside the block."""
    end_think = str(tokenizer.convert_tokens_to_ids("</think>"))
    fields = {
        "tools": None,
        "chat_template_kwargs": {"think": True},
        "max_tokens": 24,
        "n": 3,
        "min_tokens": 6,
        "logit_bias": {end_think: 4},
    }
    async with await _client(manager, tokenizer, reasoning_parser="qwen3") as http:
        whole = await _chat(http, **fields)
        streamed = _reassemble(await _stream(http, **fields), 3)
        assert streamed == [_flat(choice) for choice in whole["choices"]]
        messages = [choice["message"] for choice in whole["choices"]]
        assert all(m["reasoning_content"] for m in messages), messages
        # (the block ends at the first </think>: one the model writes later is content, as
        # vLLM's parser leaves it)
        assert all("</think>" not in m["reasoning_content"] for m in messages)
        # A text that never leaves the thinking has no content (null, as vLLM's; the stream sends none).
        unfinished = await _chat(http, **{**fields, "logit_bias": {end_think: -100}})
        assert [c["message"]["content"] for c in unfinished["choices"]] == [None] * 3, unfinished
        assert all(c["message"]["reasoning_content"] for c in unfinished["choices"])
        # Thinking off (the template does not open the block): all content when no <think> comes.
        plain = await _chat(http, **{**fields, "chat_template_kwargs": {}, "logit_bias": {}})
        for choice in plain["choices"]:
            if not choice["message"]["content"].lstrip().startswith("<think>"):
                assert choice["message"]["reasoning_content"] is None
    async with await _client(manager, tokenizer) as http:  # no parser: the thoughts stay in the content
        message = (await _chat(http, **fields))["choices"][0]["message"]
        assert "reasoning_content" not in message


async def test_continuing_an_assistant_messages_reasoning_goes_on_inside_the_thinking(
    manager: aiocb.Manager, tokenizer: Any
) -> None:
    """``continue_final_message`` naming a reasoning field: the prompt ends inside the
    ``<think>`` block the template renders, so the output up to ``</think>`` is reasoning."""
    reasoning = copy.deepcopy(tokenizer)
    reasoning.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.reasoning_content %}<think>\n"
        "{{ m.reasoning_content }}\n</think>\n\n{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
    )
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "reasoning_content": "Let me", "content": ""}]
    end_think = str(tokenizer.convert_tokens_to_ids("</think>"))
    fields = {
        "tools": None,
        "messages": messages,
        "add_generation_prompt": False,
        "chat_template_kwargs": {"continue_final_message": "reasoning_content"},
        "max_tokens": 12,
        "min_tokens": 6,
        "logit_bias": {end_think: 8},
    }
    async with await _client(manager, reasoning, reasoning_parser="qwen3") as http:
        keys = ("messages", "add_generation_prompt", "chat_template_kwargs")
        prompt = (await http.post("/tokenize", json={key: fields[key] for key in keys})).json()
        assert tokenizer.decode(prompt["tokens"]).endswith("<think>\nLet me")
        message = (await _chat(http, **fields))["choices"][0]["message"]
    assert message["reasoning_content"] and "</think>" not in message["reasoning_content"], message


@pytest.mark.parametrize("parser", ["hermes", "mistral"])
@pytest.mark.parametrize("skip", [True, False], ids=["skipped", "kept"])
@pytest.mark.parametrize("special", ["<|endoftext|>", "<|im_end|>"], ids=["named", "added"])
async def test_special_tokens_in_the_content_are_the_same_with_tools_offered(
    manager: aiocb.Manager, tokenizer: Any, parser: str, skip: bool, special: str
) -> None:
    """``skip_special_tokens`` holds whether tools are offered or not: a parser that needs
    special tokens in the text (mistral's ``[TOOL_CALLS]``) drops the ones the client asked
    to skip, the added tokens marked special among them (``<|im_end|>`` here, which is not
    in ``all_special_tokens``), and keeps those the client asked to keep."""
    assert (special in tokenizer.all_special_tokens) == (special == "<|endoftext|>")
    bias = {str(tokenizer.convert_tokens_to_ids(special)): 100}
    fields = {"max_tokens": 3, "ignore_eos": True, "logit_bias": bias, "skip_special_tokens": skip}
    async with await _client(manager, tokenizer, tool_call_parser=parser) as http:
        plain = (await _chat(http, **fields, tools=None))["choices"][0]["message"]["content"]
        offered = (await _chat(http, **fields, tool_choice="auto"))["choices"][0]["message"]["content"]
    assert plain == offered == ("" if skip else special * 3)


@pytest.mark.parametrize("skip", [True, False], ids=["skipped", "kept"])
async def test_special_tokens_in_the_reasoning_are_the_same_with_tools_offered(
    manager: aiocb.Manager, tokenizer: Any, skip: bool
) -> None:
    """The same holds for the reasoning, which the tool-call parser never sees."""
    bias = {str(tokenizer.convert_tokens_to_ids("<|im_end|>")): 100}
    fields = {"max_tokens": 3, "ignore_eos": True, "logit_bias": bias, "skip_special_tokens": skip}
    fields["chat_template_kwargs"] = {"think": True}  # (the output starts inside the block)
    async with await _client(manager, tokenizer, tool_call_parser="mistral", reasoning_parser="qwen3") as http:
        plain = (await _chat(http, **fields, tools=None))["choices"][0]["message"]
        offered = (await _chat(http, **fields, tool_choice="auto"))["choices"][0]["message"]
        streamed = _reassemble(await _stream(http, **fields, tool_choice="auto"), 1)
    assert plain["reasoning_content"] == offered["reasoning_content"] == (None if skip else "<|im_end|>" * 3)
    assert streamed == [_flat({"message": offered, "finish_reason": "length"})]


@pytest.mark.parametrize("opened", [True, False], ids=["opened-by-the-template", "opened-by-the-output"])
@pytest.mark.parametrize(
    "constraint",
    [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": FLAG}}},
        {"structured_outputs": {"choice": ["yes", "no"]}},
    ],
    ids=["json_schema", "choice"],
)
async def test_an_output_constraint_holds_for_the_answer_after_the_thinking(
    manager: aiocb.Manager, tokenizer: Any, opened: bool, constraint: dict[str, Any]
) -> None:
    """With a reasoning parser, as vLLM does: the ``<think>`` block stays free and the
    constraint holds for the answer after it (the block is the template's, or one the
    output opens first); the streamed answer is the same."""
    start, end = (str(tokenizer.convert_tokens_to_ids(t)) for t in ("<think>", "</think>"))
    fields = {"tools": None, "max_tokens": 24, "chat_template_kwargs": {"think": opened}, **constraint}
    fields["logit_bias"] = {start: 10, end: 20}  # (into the block when free to open it, and out again)
    fields["logprobs"] = True
    async with await _client(manager, tokenizer, reasoning_parser="qwen3") as http:
        whole = await _chat(http, **fields)
        streamed = _reassemble(await _stream(http, **fields), 1)
    (choice,) = whole["choices"]
    assert streamed == [_flat(choice)]
    message = choice["message"]
    assert choice["finish_reason"] == "stop" and "<think>" not in message["content"], choice
    tokens = [entry["token"] for entry in choice["logprobs"]["content"]]
    assert tokens[: 1 if opened else 2] == (["</think>"] if opened else ["<think>", "</think>"]), tokens
    if "response_format" in constraint:
        assert isinstance(json.loads(message["content"])["ok"], bool), message
    else:
        assert message["content"] in ("yes", "no"), message


async def test_the_answers_constraint_is_built_off_the_loop(
    manager: aiocb.Manager, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A small body's JSON schema after the thinking is checked and made a grammar on the
    constraints' thread (sixty properties took 84 ms), not on the loop."""
    threads: list[str] = []

    def recorded(*args: Any, **kwargs: Any) -> dict[str, Any]:
        threads.append(threading.current_thread().name)
        return after_thinking(*args, **kwargs)

    monkeypatch.setattr(chat, "after_thinking", recorded)

    def constrained(schema: dict[str, Any]) -> dict[str, Any]:
        response_format = {"type": "json_schema", "json_schema": {"schema": schema}}
        return _body(tools=None, max_tokens=24, response_format=response_format)

    async with await _client(manager, tokenizer, reasoning_parser="qwen3") as http:
        answered = await http.post("/v1/chat/completions", json=constrained(FLAG))
        refused = await http.post("/v1/chat/completions", json=constrained({"type": "nonsense"}))
    assert len(threads) == 2 and all(name.startswith("aiocb-constraints") for name in threads), threads
    assert answered.status_code == 200, answered.text
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "response_format.json_schema.schema", refused.text


@pytest.mark.parametrize("constraint", [{"choice": ["yes", "no"]}, {"grammar": 'root ::= "(" [0-9] ")"'}])
async def test_an_answer_without_a_thinking_block_is_the_constraints_from_its_first_token(
    manager: aiocb.Manager, tokenizer: Any, constraint: dict[str, Any]
) -> None:
    """The newlines a reasoning model writes after its block belong to the block: an
    answer that comes without one starts as the constraint does (pushed towards a newline)."""
    newline, start = (str(tokenizer.convert_tokens_to_ids(t)) for t in ("\u010a", "<think>"))
    fields = {
        "tools": None,
        "max_tokens": 8,
        "structured_outputs": constraint,
        "logit_bias": {newline: 30, start: -100},
    }
    async with await _client(manager, tokenizer, reasoning_parser="qwen3") as http:
        message = (await _chat(http, **fields))["choices"][0]["message"]
    assert message["reasoning_content"] is None, message
    if "choice" in constraint:
        assert message["content"] in ("yes", "no"), message
    else:
        assert len(message["content"]) == 3 and message["content"][0] == "(" and message["content"][1].isdigit(), (
            message
        )


@pytest.mark.parametrize(
    ("constraint", "param"),
    [
        ({"structured_outputs": {"regex": "("}}, "structured_outputs.regex"),
        ({"guided_json": {"type": "nonsense"}}, "guided_json"),
        ({"guided_json": {"type": "object", "not": {"required": ["a"]}}}, "guided_json"),
    ],
)
async def test_a_bad_constraint_around_the_thinking_is_named_as_sent(
    manager: aiocb.Manager, tokenizer: Any, constraint: dict[str, Any], param: str
) -> None:
    async with await _client(manager, tokenizer, reasoning_parser="qwen3") as http:
        response = await http.post("/v1/chat/completions", json=_body(tools=None, max_tokens=4, **constraint))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(param), error


@pytest.mark.parametrize("fields", [{"tool_choice": "required"}, {"strict": True}], ids=["required", "strict"])
async def test_an_enforced_tool_schema_with_a_keyword_the_grammar_leaves_out_is_refused_naming_it(
    client: httpx.AsyncClient, fields: dict[str, Any]
) -> None:
    tools = _tools(strict=fields.pop("strict", None))
    tools[1]["function"]["parameters"] = {**ADD, "not": {"required": ["a"]}}
    response = await client.post("/v1/chat/completions", json=_body(tools=tools, **fields))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tools"
    assert "'not' at /" in error["message"] and '"add"' in error["message"], error["message"]


def test_a_key_sent_as_null_reaches_no_template() -> None:
    """A null key is none given: neither refused nor rendered (it reached templates that
    write a tool or a call as JSON)."""
    from aiocb.server.tools import template_messages

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "x_unknown": None}}
    request = parse_tools({"tools": [tool]})
    assert request is not None and "x_unknown" not in request.tools[0]["function"]
    call = {"id": "c", "type": "function", "bogus": None, "function": {"name": "f", "arguments": "{}", "junk": None}}
    (message,) = template_messages([{"role": "assistant", "content": None, "tool_calls": [call]}])
    (rendered,) = message["tool_calls"]
    assert "bogus" not in rendered and "junk" not in rendered["function"]
