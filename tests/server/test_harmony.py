"""gpt-oss's harmony format through the chat endpoint: the analysis channel as
``reasoning_content``, the final channel as content, a message to ``functions.NAME`` as a
tool call, streamed and not, with no marker reaching the client; and what is refused.

The model is a scripted GPT-2: its attention and MLP write nothing, so each position's
hidden state is its position embedding (one-hot), which the head maps to the token the
script puts next; its outputs are a harmony model's, token for token.
"""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import torch
import xgrammar
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedModel

import aiocb
from aiocb.server import build_app
from aiocb.server.chat_output import MessageBuilder
from aiocb.server.fragments import Content, Fragment, Reasoning, ToolArguments, ToolCall
from aiocb.server.harmony import MARKERS, HarmonyOutput, harmony_constraint
from aiocb.server.tools import ToolRequest
from aiocb.structured import GrammarCompiler
from tests.server.conftest import build_tokenizer, serve_config

MODEL_NAME = "tiny-gpt-oss"
#: gpt-oss's chat template, reduced to what the tests need
HARMONY_TEMPLATE = (
    "{%- if tools %}<|start|>developer<|message|># Tools\n{%- for tool in tools %}\n{{ tool.function.name }}"
    "{%- endfor %}<|end|>{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ message.content }}<|end|>"
    "{%- else %}<|start|>{{ message.role }}<|message|>{{ message.content }}<|end|>{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"
)
#: the most positions of the scripted model
POSITIONS = 256
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = (
    "<|channel|>analysis<|message|>The user asks for the weather.<|end|><|start|>assistant<|channel|>commentary "
    'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
)
ANSWER = (
    "<|channel|>analysis<|message|>A greeting.<|end|><|start|>assistant<|channel|>final<|message|>It is sunny."
    "<|return|>"
)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(MARKERS)})
    tokenizer.chat_template = HARMONY_TEMPLATE
    return tokenizer


def scripted_model(tokenizer: Any, prompt: list[int], script: str, fallback: str = "") -> PreTrainedModel:
    """A GPT-2 that answers ``prompt`` with ``script`` (greedily), then stops: the script's
    last token (``<|return|>`` or ``<|call|>``) is an EOS of its generation config, as gpt-oss's are.
    Where a constraint forbids the script's token, its second choice is ``fallback``'s token
    at that position: a constrained output follows the fallback where they part."""
    script_ids = tokenizer(script, add_special_tokens=False).input_ids
    fallback_ids = tokenizer(fallback, add_special_tokens=False).input_ids
    assert len(prompt) + max(len(script_ids), len(fallback_ids)) <= POSITIONS
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=POSITIONS,
        n_embd=POSITIONS,
        n_layer=1,
        n_head=4,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
        model.transformer.ln_f.weight.fill_(1.0)
        model.transformer.wpe.weight.copy_(torch.eye(POSITIONS))
        for k, token in enumerate(fallback_ids):
            model.lm_head.weight[token, len(prompt) - 1 + k] = 5.0
        for k, token in enumerate(script_ids):
            model.lm_head.weight[token, len(prompt) - 1 + k] = 10.0
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids(["<|return|>", "<|call|>"])
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def prompt_of(
    tokenizer: Any, tools: list[dict[str, Any]] | None = None, messages: list[dict[str, Any]] = QUESTION
) -> list[int]:
    """The prompt the server makes of ``messages`` (a last assistant message: continued)."""
    continued = messages[-1]["role"] == "assistant"
    text = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=not continued, continue_final_message=continued
    )
    ids: list[int] = tokenizer(text, add_special_tokens=False).input_ids
    return ids


@asynccontextmanager
async def serving(
    tokenizer: Any,
    script: str,
    tools: bool,
    messages: list[dict[str, Any]] = QUESTION,
    fallback: str = "",
    **app: Any,
) -> AsyncIterator[httpx.AsyncClient]:
    prompt = prompt_of(tokenizer, [WEATHER] if tools else None, messages)
    model = scripted_model(tokenizer, prompt, script, fallback)
    async with aiocb.Manager(model, continuous_batching_config=serve_config(), tokenizer=tokenizer) as manager:
        served = build_app(manager, tokenizer, MODEL_NAME, **app)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=served), base_url="http://test") as http:
            yield http


def _body(offer: bool, **fields: Any) -> dict[str, Any]:
    """A chat body (``offer``: with the weather function among its tools)."""
    tools = {"tools": [WEATHER]} if offer else {}
    return {"model": MODEL_NAME, "messages": QUESTION, "max_tokens": 100, **tools, **fields}


def _calls(fragments: list[Fragment]) -> list[tuple[str, str]]:
    """Each call's name and arguments, its fragments gathered as a response's message is."""
    message = MessageBuilder(reasoning=True)
    message.add(fragments)
    return [(c["function"]["name"], c["function"]["arguments"]) for c in message.message().get("tool_calls", [])]


async def _streamed(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[dict[str, Any], str | None, str]:
    """The message a stream's deltas make, its finish reason, and every delta's text."""
    message: dict[str, Any] = {"content": "", "reasoning_content": "", "tool_calls": []}
    finish, seen = None, ""
    async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line.removeprefix("data: "))["choices"][0]
            delta = choice["delta"]
            seen += json.dumps(delta)
            message["content"] += delta.get("content") or ""
            message["reasoning_content"] += delta.get("reasoning_content") or ""
            for call in delta.get("tool_calls") or []:  # (a call's first delta names it, the next add arguments)
                if "id" in call:
                    assert call["index"] == len(message["tool_calls"])
                    message["tool_calls"].append(dict(call["function"]))
                else:
                    message["tool_calls"][call["index"]]["arguments"] += call["function"]["arguments"]
            finish = choice["finish_reason"] or finish
    return message, finish, seen


async def _both_ways(
    tokenizer: Any, script: str, offer: bool
) -> tuple[dict[str, Any], dict[str, Any], str | None, str]:
    """The response's choice, the stream's message and finish reason, and both bodies'
    text, of one chat request answered with ``script``."""
    async with serving(tokenizer, script, tools=offer) as client:
        response = await client.post("/v1/chat/completions", json=_body(offer))
        assert response.status_code == 200, response.text
        streamed, finish, seen = await _streamed(client, _body(offer))
    return response.json()["choices"][0], streamed, finish, response.text + seen


async def test_a_call_after_reasoning_is_a_tool_call(tokenizer: Any) -> None:
    choice, streamed, finish, seen = await _both_ways(tokenizer, CALL, offer=True)
    message = choice["message"]
    assert choice["finish_reason"] == finish == "tool_calls"
    assert message["reasoning_content"] == streamed["reasoning_content"] == "The user asks for the weather."
    assert not message["content"] and not streamed["content"]
    call = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert [c["function"] for c in message["tool_calls"]] == streamed["tool_calls"] == [call]
    assert not any(marker in seen for marker in MARKERS), "no marker reaches the client"


async def test_a_final_message_is_the_content(tokenizer: Any) -> None:
    choice, streamed, finish, seen = await _both_ways(tokenizer, ANSWER, offer=False)
    assert choice["finish_reason"] == finish == "stop"
    assert choice["message"]["content"] == streamed["content"] == "It is sunny."
    assert choice["message"]["reasoning_content"] == streamed["reasoning_content"] == "A greeting."
    assert "tool_calls" not in choice["message"] and not streamed["tool_calls"]
    assert not any(marker in seen for marker in MARKERS)


@pytest.mark.parametrize("stream", [False, True])
async def test_an_output_cut_in_a_header_leaves_the_header_out(tokenizer: Any, stream: bool) -> None:
    """max_tokens ends the output inside the second message's header: none of it is content."""
    cut = len(tokenizer("<|channel|>analysis<|message|>A greeting.<|end|><|start|>assistant<|channel|>fi").input_ids)
    async with serving(tokenizer, ANSWER, tools=False) as client:
        if stream:
            message, finish, _ = await _streamed(client, _body(False, max_tokens=cut))
        else:
            choice = (await client.post("/v1/chat/completions", json=_body(False, max_tokens=cut))).json()["choices"][0]
            message, finish = choice["message"], choice["finish_reason"]
    assert finish == "length"
    assert message["reasoning_content"] == "A greeting." and not message["content"]


async def test_a_continued_final_message_goes_on_as_content(tokenizer: Any) -> None:
    messages = [*QUESTION, {"role": "assistant", "content": "It is"}]
    async with serving(tokenizer, " sunny.<|return|>", tools=False, messages=messages) as client:
        body = _body(False, messages=messages, add_generation_prompt=False)
        body["chat_template_kwargs"] = {"continue_final_message": True}
        response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == " sunny."


async def test_a_call_of_a_function_not_offered_stays_content(tokenizer: Any) -> None:
    """As other formats' calls of unknown functions: the client sees what the model wrote."""
    async with serving(tokenizer, CALL.replace("get_weather", "get_time"), tools=True) as client:
        response = await client.post("/v1/chat/completions", json=_body(True))
    message = response.json()["choices"][0]["message"]
    assert message["content"] == '{"city": "Paris"}' and "tool_calls" not in message


#: the first message of ANSWER, and the next one's header up to its channel
GREETING = "<|channel|>analysis<|message|>A greeting.<|end|><|start|>assistant<|channel|>"
SKY = {"type": "object", "properties": {"sky": {"type": "string"}}, "required": ["sky"]}
JSON_ANSWER = GREETING + 'final<|message|>{"sky": "sunny"}<|return|>'
#: an answer in words that no JSON can begin with (a longer one could go on inside a string)
WORDS = GREETING + "final<|message|>It<|return|>"
CALL_AFTER_GREETING = (
    GREETING + 'commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
)
STRICT_WEATHER = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}


@pytest.mark.parametrize(
    "fields",
    [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "sky", "schema": SKY}}},
        {"response_format": {"type": "json_object"}},
        {"structured_outputs": {"json": SKY}},
    ],
)
async def test_an_output_constraint_holds_the_final_message_and_leaves_the_reasoning_free(
    tokenizer: Any, fields: dict[str, Any]
) -> None:
    """The model would answer in words; constrained, its final message is JSON, after the
    same free analysis (a grammar over the whole output would have refused its headers)."""
    async with serving(tokenizer, WORDS, tools=False, fallback=JSON_ANSWER) as client:
        free = await client.post("/v1/chat/completions", json=_body(False))
        response = await client.post("/v1/chat/completions", json=_body(False, **fields))
        assert response.status_code == 200, response.text
        streamed, finish, seen = await _streamed(client, _body(False, **fields))
    assert free.json()["choices"][0]["message"]["content"] == "It"
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == finish == "stop"
    assert choice["message"]["content"] == streamed["content"] == '{"sky": "sunny"}'
    assert choice["message"]["reasoning_content"] == streamed["reasoning_content"] == "A greeting."
    assert not any(marker in seen for marker in MARKERS)


async def test_a_marker_inside_the_json_answer_is_the_answer_s(tokenizer: Any) -> None:
    """The constraint lets a JSON string hold a marker token; the content keeps it whole."""
    answer = GREETING + 'final<|message|>{"sky": "a<|end|>b"}<|return|>'
    body = _body(False, response_format={"type": "json_schema", "json_schema": {"name": "sky", "schema": SKY}})
    async with serving(tokenizer, WORDS, tools=False, fallback=answer) as client:
        response = await client.post("/v1/chat/completions", json=body)
        streamed, _, _ = await _streamed(client, body)
    assert response.json()["choices"][0]["message"]["content"] == streamed["content"] == '{"sky": "a<|end|>b"}'


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
async def test_tool_choice_makes_the_model_call_after_its_reasoning(tokenizer: Any, tool_choice: Any) -> None:
    async with serving(tokenizer, ANSWER, tools=True, fallback=CALL_AFTER_GREETING) as client:
        free = await client.post("/v1/chat/completions", json=_body(True))
        response = await client.post("/v1/chat/completions", json=_body(True, tool_choice=tool_choice))
        assert response.status_code == 200, response.text
        streamed, finish, seen = await _streamed(client, _body(True, tool_choice=tool_choice))
    assert free.json()["choices"][0]["message"]["content"] == "It is sunny."
    choice = response.json()["choices"][0]
    message = choice["message"]
    assert choice["finish_reason"] == finish == ("tool_calls" if tool_choice == "required" else "stop")
    assert message["content"] is None and not streamed["content"]
    assert message["reasoning_content"] == streamed["reasoning_content"] == "A greeting."
    call = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert [c["function"] for c in message["tool_calls"]] == streamed["tool_calls"] == [call]
    assert not any(marker in seen for marker in MARKERS)


async def test_a_strict_function_s_arguments_follow_its_schema(tokenizer: Any) -> None:
    wrong = CALL.replace('{"city": "Paris"}', "{}")  # (the city left out, which the schema requires)
    async with serving(tokenizer, wrong, tools=True, fallback=CALL) as client:
        free = await client.post("/v1/chat/completions", json=_body(True))
        response = await client.post("/v1/chat/completions", json=_body(True, tools=[STRICT_WEATHER]))
    assert free.json()["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == "{}"
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
        (
            {
                "tool_choice": "required",
                "messages": [*QUESTION, {"role": "assistant", "content": "It is"}],
                "add_generation_prompt": False,
                "chat_template_kwargs": {"continue_final_message": True},
            },
            "cannot follow the final message",
        ),
    ],
)
async def test_constraints_that_contradict_are_refused(tokenizer: Any, fields: dict[str, Any], message: str) -> None:
    async with serving(tokenizer, CALL, tools=True) as client:
        response = await client.post("/v1/chat/completions", json=_body(True, **fields))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "tool_choice" and message in error["message"], error


async def test_without_a_tool_call_parser_tools_are_refused(tokenizer: Any) -> None:
    async with serving(tokenizer, CALL, tools=True, tool_call_parser=None) as client:
        response = await client.post("/v1/chat/completions", json=_body(True))
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools"


async def test_parsers_of_another_format_are_refused(tokenizer: Any) -> None:
    model = scripted_model(tokenizer, prompt_of(tokenizer), ANSWER)
    async with aiocb.Manager(model, continuous_batching_config=serve_config()) as manager:
        with pytest.raises(ValueError, match=r"harmony format, whose reasoning parser is 'openai_gptoss'.*not 'qwen3'"):
            build_app(manager, tokenizer, MODEL_NAME, reasoning_parser="qwen3")
        with pytest.raises(ValueError, match=r"whose tool-call parser is 'openai'.*not 'hermes'"):
            build_app(manager, tokenizer, MODEL_NAME, tool_call_parser="hermes")
        build_app(manager, tokenizer, MODEL_NAME, reasoning_parser="openai_gptoss", tool_call_parser="openai")
        other = build_tokenizer()
        with pytest.raises(ValueError, match="'openai_gptoss' parser reads gpt-oss's harmony format"):
            build_app(manager, other, MODEL_NAME, reasoning_parser="openai_gptoss")


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_the_parser_reads_any_split_of_the_text(step: int) -> None:
    """Markers split across deltas; a recipient before the channel; built-in tools' calls
    as reasoning; messages of one kind a line apart; a call cut at the length limit."""
    text = (
        "<|channel|>analysis<|message|>Search first.<|end|><|start|>assistant<|channel|>analysis "
        'to=browser.search<|message|>{"q": "paris"}<|call|><|start|>assistant<|channel|>commentary<|message|>'
        "Checking.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
        '{"city": "Paris"}<|call|><|start|>assistant to=functions.get_weather<|channel|>commentary json'
        '<|message|>{"city": "Li'
    )
    output = HarmonyOutput(["get_weather"], hidden=["<|endoftext|>", *MARKERS])
    fragments = [f for i in range(0, len(text), step) for f in output.feed(text[i : i + step])]
    fragments += output.finish(cut=True)
    reasoning = "".join(getattr(f, "text", "") for f in fragments if type(f).__name__ == "Reasoning")
    content = "".join(getattr(f, "text", "") for f in fragments if type(f).__name__ == "Content")
    calls = _calls(fragments)
    assert reasoning == 'Search first.\n{"q": "paris"}'
    assert content == "Checking."
    assert calls == [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Li')]
    assert output.calls == 2


def _parsed(text: str, step: int, **options: Any) -> tuple[str, str]:
    """(reasoning, content) of ``text`` fed ``step`` characters at a time."""
    output = HarmonyOutput(None, **options)
    fragments = [f for i in range(0, len(text), step) for f in output.feed(text[i : i + step])] + output.finish()
    reasoning = "".join(f.text for f in fragments if isinstance(f, Reasoning))
    return reasoning, "".join(f.text for f in fragments if isinstance(f, Content))


@pytest.mark.parametrize("step", [1, 7, 1000])
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # messages of each kind interleaved: a line between two of one kind
        (
            "<|channel|>analysis<|message|>A.<|end|><|start|>assistant<|channel|>commentary<|message|>Checking."
            "<|end|><|start|>assistant<|channel|>analysis<|message|>B.<|end|><|start|>assistant<|channel|>final"
            "<|message|>Done.<|return|>",
            ("A.\nB.", "Checking.\nDone."),
        ),
        # an output that ends in a header (a stop string matched it): left out
        ("<|channel|>analysis<|message|>A.<|end|><|start|>assistant<|channel|>fin", ("A.", "")),
        ("<|chan", ("", "")),
        # no harmony at all, however long and however split: content, markers left out
        ("x" * 300 + "<|channel|>final<|message|>tail<|return|>", ("", "x" * 300 + "finaltail")),
        ("Just text.", ("", "Just text.")),
        # text before the first header that is no part of one: content
        ("Hello there<|channel|>final<|message|>Hi<|return|>", ("", "Hello there\nHi")),
    ],
)
def test_the_parser_s_edges(step: int, text: str, expected: tuple[str, str]) -> None:
    assert _parsed(text, step) == expected


def test_a_function_named_as_a_kind_of_text_is_called() -> None:
    output = HarmonyOutput(["content"])
    text = '<|channel|>commentary to=functions.content json<|message|>{"a": 1}<|call|>'
    fragments = output.feed(text) + output.finish()
    assert _calls(fragments) == [("content", '{"a": 1}')]


def test_a_continued_reasoning_goes_on_as_reasoning() -> None:
    text = " more.<|end|><|start|>assistant<|channel|>final<|message|>Done.<|return|>"
    assert _parsed(text, 3, inside="reasoning") == (" more.", "Done.")


def test_a_header_too_long_to_be_one_is_content_read_at_once() -> None:
    """(The parser used to read such a text's own <|start|> as the end of it, again and again.)"""
    output, fragments = HarmonyOutput(None), []
    worker = threading.Thread(
        target=lambda: fragments.extend(output.feed("<|start|>assistant to=" + "x" * 300)), daemon=True
    )
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), "the parser did not return"
    assert merged_text(fragments + output.finish()) == "assistant to=" + "x" * 300


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_markers_in_json_strings_the_grammar_holds_are_text(step: int) -> None:
    """A call's arguments and a JSON answer are JSON under the constraint: an end marker's
    text inside one of their strings is the string's (the parser ended the body there)."""
    text = (
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "a<|end|>\\"<|start|>b"}'
        '<|call|><|start|>assistant<|channel|>final<|message|>{"sky": "<|return|>x"}<|return|>'
    )
    output = HarmonyOutput(["get_weather"], json_kinds={"call", "content"})
    fragments = [f for at in range(0, len(text), step) for f in output.feed(text[at : at + step])] + output.finish()
    assert _calls(fragments) == [("get_weather", '{"city": "a<|end|>\\"<|start|>b"}')]
    assert merged_text(fragments) == '{"sky": "<|return|>x"}'


def merged_text(fragments: list[Any]) -> str:
    return "".join(f.text for f in fragments if isinstance(f, Content))


TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
CALL_FORMS = [
    '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>',
    ' to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{"city": "Paris"}<|call|>',
    ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>',
]
THINK = "<|channel|>analysis<|message|>Maybe {not json} <|constrain|> stray.<|end|><|start|>assistant"
#: a message that the parser ends at the <|start|> the model wrote for its <|end|>
UNENDED = "<|channel|>analysis<|message|>Hmm.<|start|>assistant"
BROWSE = '<|channel|>analysis to=browser.search code<|message|>{"query": "weather"}<|call|>'
PREAMBLE = "<|channel|>commentary<|message|>Let me look.<|end|><|start|>assistant"


def _tools(choice: str = "auto", forced: bool = False, strict: bool = False) -> ToolRequest:
    weather = STRICT_WEATHER if strict else WEATHER
    return ToolRequest(tools=(weather, TIME), choice=choice, forced=forced, parallel=True)


@pytest.mark.parametrize(
    ("answer", "tools", "inside", "accepted", "refused"),
    [
        (  # a JSON answer after any reasoning; calls of any function still possible
            ("json_schema", json.dumps(SKY)),
            _tools(),
            None,
            [
                '<|channel|>final<|message|>{"sky": "x"}<|return|>',
                THINK + THINK + GREETING + 'final<|message|>{"sky": "x"}<|return|>',
            ]
            + [THINK + form for form in CALL_FORMS]
            + [THINK + '<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{"any": 1}<|call|>'],
            [
                THINK + "<|channel|>final<|message|>It is.<|return|>",
                THINK + '<|channel|>final<|message|>{"sky": "x"',
                THINK,
                THINK + PREAMBLE + CALL_FORMS[0],  # (a preamble is content, which the answer's constraint holds)
                UNENDED
                + '<|channel|>final<|message|>It is.<|end|><|start|>assistant<|channel|>final<|message|>{"sky": "x"}'
                "<|return|>",
            ],
        ),
        (  # the headers gpt-oss writes: content types, calls in either channel; no built-in tool
            ("json_schema", json.dumps(SKY)),
            _tools(strict=True),
            None,
            [
                THINK + '<|channel|>final <|constrain|>json<|message|>{"sky": "x"}<|return|>',
                THINK + '<|channel|>final json<|message|>{"sky": "x"}<|return|>',
                THINK
                + '<|channel|>analysis to=functions.get_weather <|constrain|>json<|message|>{"city": "P"}<|call|>',
                THINK + '<|channel|>commentary to=functions.get_weather json<|message|>{"city": "P"}<|call|>',
                THINK
                + '<|channel|>commentary to=functions.get_weather<|constrain|>json<|message|>{"city": "P"}<|call|>',
            ],
            [
                THINK + BROWSE,  # (an answer must come: the server cannot run a built-in tool)
                " to=python<|channel|>analysis code<|message|>print(1)<|call|>",
                THINK + f'<|channel|>final {"json" * 5}<|message|>{{"sky": "x"}}<|return|>',  # (headers are bounded)
                THINK + '<|channel|>final<|message|>Hi<|end|><|start|>assistant<|channel|>final<|message|>{"sky": "x"}'
                "<|return|>",
                UNENDED + '<|channel|>commentary to=functions.get_weather json<|message|>{"town": 7}<|call|>',
            ],
        ),
        (  # required: a call, after reasoning but no preamble, and no final message
            None,
            _tools("required"),
            None,
            [THINK + form for form in CALL_FORMS] + [CALL_FORMS[0]],
            [
                ANSWER,
                THINK + PREAMBLE + CALL_FORMS[0],
                THINK + CALL_FORMS[0].replace('"city"', '"town"'),
                THINK + BROWSE,
                UNENDED + CALL_FORMS[0].replace('"city"', '"town"'),
            ],
        ),
        (  # a named function: that one alone
            None,
            _tools("get_time", forced=True),
            None,
            [THINK + "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}<|call|>"],
            [THINK + CALL_FORMS[0]],
        ),
        (  # a strict function under auto: its arguments, and words are still an answer
            None,
            _tools(strict=True),
            None,
            [
                ANSWER,
                THINK + "<|channel|>final<|message|>Anything at all<|return|>",
                THINK + PREAMBLE + CALL_FORMS[1],
                THINK + BROWSE,
                " to=python<|channel|>analysis code<|message|>print(1)<|call|>",
            ],
            [
                THINK + CALL_FORMS[0].replace('"Paris"', "7"),
                THINK + "<|channel|>final<|message|>Hi <|end|> there<|return|>",
            ],
        ),
        (  # a continued analysis goes on to its end first
            ("regex", "yes|no"),
            None,
            "reasoning",
            [" on.<|end|><|start|>assistant<|channel|>final<|message|>no<|return|>"],
            [
                "<|channel|>final<|message|>no<|return|>",
                " on.<|end|><|start|>assistant<|channel|>final<|message|>maybe",
            ],
        ),
        (  # a continued final message is the answer itself
            ("regex", "yes|no"),
            _tools(),
            "content",
            ["yes<|return|>"],
            ["<|channel|>final<|message|>yes<|return|>", "maybe<|return|>"],
        ),
    ],
)
def test_the_constraint_of_a_harmony_output(
    tokenizer: Any,
    answer: tuple[str, str] | None,
    tools: ToolRequest | None,
    inside: str | None,
    accepted: list[str],
    refused: list[str],
) -> None:
    """What the structural tag lets through, the model's end token included (it ends a
    complete output), and what it stops: a whole output is accepted only if complete."""
    compiler = GrammarCompiler(tokenizer, len(tokenizer), tokenizer.convert_tokens_to_ids(["<|return|>", "<|call|>"]))
    grammar = compiler.compile(("structural_tag", json.dumps(harmony_constraint(answer, tools, inside))))

    def takes(text: str) -> bool:
        matcher = xgrammar.GrammarMatcher(grammar)
        ids = tokenizer(text, add_special_tokens=False).input_ids
        return all(matcher.accept_token(token) for token in ids) and matcher.is_terminated()

    assert [text for text in accepted if not takes(text)] == []
    assert [text for text in refused if takes(text)] == []


def test_a_call_s_arguments_stream_without_the_whitespace_around_them() -> None:
    """A call to an offered function begins with its arguments' first text that is not
    whitespace and streams from there; whitespace at their end is held, then left out."""
    head = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    output = HarmonyOutput(["get_weather"])
    assert output.feed(head + "  \n") == []
    (call,) = output.feed('{"city":')
    assert isinstance(call, ToolCall) and (call.name, call.arguments) == ("get_weather", '{"city":')
    assert output.feed(" ") == []
    assert output.feed('"Paris"} \n') == [ToolArguments(0, ' "Paris"}')]
    assert output.feed(" <|call|>") == [] and output.finish() == []
    # No arguments: a call of none, or nothing where the output was cut before them.
    for cut, calls in ((False, [("get_weather", "")]), (True, [])):
        empty = HarmonyOutput(["get_weather"])
        assert _calls(empty.feed(head + " ") + empty.finish(cut=cut)) == calls


def test_a_named_function_s_call_cut_before_its_arguments_is_that_call() -> None:
    """As the other formats' (and OpenAI's): ``max_tokens`` ending the output in the call's
    header, or before its first argument, gives the named function's call with none."""
    head = (
        "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>commentary "
        "to=functions.get_weather <|constrain|>json<|message|>"
    )
    for text in (head, head + " ", head[:-20], "<|chan", ""):
        output = HarmonyOutput(["get_weather"], forced="get_weather")
        assert _calls(output.feed(text) + output.finish(cut=True)) == [("get_weather", "")], text
        stopped = HarmonyOutput(["get_weather"], forced="get_weather")
        assert _calls(stopped.feed(text) + stopped.finish()) == ([("get_weather", "")] if text.startswith(head) else [])
    whole = HarmonyOutput(["get_weather"], forced="get_weather")
    assert _calls(whole.feed(head + '{"city": "Pa') + whole.finish(cut=True)) == [("get_weather", '{"city": "Pa')]


@pytest.mark.parametrize("lead", [240, 246, 250, 256])
def test_a_header_whose_marker_ends_past_the_allowance_is_read_however_split(lead: int) -> None:
    """A header's ``<|message|>`` that begins within the 256 characters a header may have
    and ends past them: read a character at a time, it was taken for content (whole, for
    a header)."""
    head = "<|channel|>commentary to=functions.get_weather "
    text = head + "x" * (lead - len(head)) + '<|message|>{"a": 1}<|call|>'
    for step in (1, 8, len(text)):
        output = HarmonyOutput(["get_weather"])
        fragments = [f for at in range(0, len(text), step) for f in output.feed(text[at : at + step])]
        assert _calls(fragments + output.finish()) == [("get_weather", '{"a": 1}')], step
