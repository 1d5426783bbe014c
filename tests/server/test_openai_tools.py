"""``aiocb serve`` (the bundled model, its own chat template) driven by the official
``openai`` client: enforced tool calls that parse and validate, streamed tool-call deltas
that reassemble to the response, and pydantic-typed ``parse``."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")
openai = pytest.importorskip("openai")

MODEL = "pycode-tiny"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}},
    "required": ["city"],
    "additionalProperties": False,
}
CONVERT = {
    "type": "object",
    "properties": {"celsius": {"type": "integer", "minimum": -60, "maximum": 60}},
    "required": ["celsius"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "to_fahrenheit": CONVERT}
TOOLS = [
    {"type": "function", "function": {"name": name, "description": f"the {name} tool", "parameters": schema}}
    for name, schema in SCHEMAS.items()
]
MESSAGES = [{"role": "user", "content": "How warm is it in Oslo, in Fahrenheit?"}]


class Report(pydantic.BaseModel):  # type: ignore[misc,name-defined]
    city: str = pydantic.Field(max_length=10)
    celsius: int = pydantic.Field(ge=-60, le=60)
    sunny: bool


class GetWeather(pydantic.BaseModel):  # type: ignore[misc,name-defined]
    city: str = pydantic.Field(max_length=10)


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``aiocb serve`` with no model (the bundled one) on a free port, as a subprocess."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "aiocb.cli.serve",
        "--port",
        str(port),
        "--no-access-log",
        "--log-level",
        "warning",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    log = log_path.open("w")
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"aiocb serve exited: {log_path.read_text()}")
            try:
                if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("aiocb serve did not become ready")
            time.sleep(0.2)
        yield f"{url}/v1"
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


@pytest.fixture
def client(base_url: str) -> Any:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)


def _validate(call: Any) -> tuple[str, dict[str, Any]]:
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return call.function.name, arguments


def test_required_and_named_tools(client: Any) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        n=4,
        temperature=1.0,
        seed=1,
        max_tokens=256,
    )
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.tool_calls, choice
        for call in choice.message.tool_calls:
            _validate(call)
    named = {"type": "function", "function": {"name": "to_fahrenheit"}}
    reply = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=named, n=4, temperature=1.0, seed=2, max_tokens=256
    )
    for choice in reply.choices:
        (call,) = choice.message.tool_calls
        assert _validate(call)[0] == "to_fahrenheit"


def test_streamed_tool_calls_reassemble_to_the_response(client: Any) -> None:
    fields: dict[str, Any] = {
        "model": MODEL,
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": "required",
        "temperature": 1.0,
        "seed": 5,
        "n": 2,
        "max_tokens": 256,  # (the bundled model's generation config caps a chat's default at 64)
    }
    whole = client.chat.completions.create(**fields)
    calls: dict[tuple[int, int], dict[str, str]] = {}
    pieces: dict[tuple[int, int], int] = {}
    finish: dict[int, str] = {}
    for chunk in client.chat.completions.create(stream=True, **fields):
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                key = (choice.index, call.index)
                # A call's first delta has its id, type and name; the next, more of its arguments.
                assert (call.id is not None) == (call.function.name is not None) == (key not in calls)
                entry = calls.setdefault(key, {"name": "", "arguments": ""})
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
                pieces[key] = pieces.get(key, 0) + bool(call.function.arguments)
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    expected = {
        (choice.index, i): {"name": call.function.name, "arguments": call.function.arguments}
        for choice in whole.choices
        for i, call in enumerate(choice.message.tool_calls)
    }
    assert calls == expected
    assert finish == {choice.index: choice.finish_reason for choice in whole.choices}
    # The arguments stream as the model writes them, not whole at the call's end.
    assert all(count > 1 for count in pieces.values()), pieces


def test_the_client_s_stream_helper_sees_arguments_grow(client: Any) -> None:
    """openai's ``chat.completions.stream`` helper: argument delta events as they are
    written, and a final completion equal to the response's."""
    fields: dict[str, Any] = {
        "model": MODEL,
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "temperature": 1.0,
        "seed": 7,
        "max_tokens": 256,
    }
    whole = client.chat.completions.create(**fields)
    growth: list[str] = []
    with client.chat.completions.stream(**fields) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                assert event.name == "get_weather" and event.index == 0
                growth.append(event.arguments_delta)
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    ((expected),) = whole.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == (expected.function.name, expected.function.arguments)
    assert len(growth) > 1 and "".join(growth) == call.function.arguments
    assert _validate(call)[0] == "get_weather"


def test_a_tool_result_turn_and_the_next_call(client: Any) -> None:
    first = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        seed=3,
        max_tokens=256,
    )
    message = first.choices[0].message
    (call,) = message.tool_calls
    messages = [
        *MESSAGES,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"celsius": 12})},
    ]
    second = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        seed=4,
        max_tokens=256,
    )
    (next_call,) = second.choices[0].message.tool_calls
    _validate(next_call)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result were rendered


def test_pydantic_parse(client: Any) -> None:
    for seed in range(3):
        asked = [{"role": "user", "content": f"Report {seed}: Lima, 21 degrees, sunny."}]
        completion = client.beta.chat.completions.parse(model=MODEL, messages=asked, response_format=Report, seed=seed)
        assert isinstance(completion.choices[0].message.parsed, Report)
    # A parsed message goes back into the history as the client sends it, ``parsed`` included
    # (dumped here: the client's own dump warns that a generic model's field holds a Report).
    sent_back = completion.choices[0].message.model_dump(exclude_unset=True, warnings=False)
    again = [*asked, sent_back, {"role": "user", "content": "Again."}]
    assert client.chat.completions.create(model=MODEL, messages=again, max_tokens=2).choices
    completion = client.beta.chat.completions.parse(
        model=MODEL,
        messages=MESSAGES,
        tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice="required",
        temperature=1.0,
        seed=7,
        max_tokens=96,
    )
    (call,) = completion.choices[0].message.tool_calls[:1]
    assert isinstance(call.function.parsed_arguments, GetWeather)
    message = completion.choices[0].message  # (its calls' ``parsed_arguments`` included)
    results = [{"role": "tool", "tool_call_id": made.id, "content": "12 C"} for made in message.tool_calls]
    assert client.chat.completions.create(model=MODEL, messages=[*MESSAGES, message, *results], max_tokens=2).choices
