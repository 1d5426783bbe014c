"""An agent over the `openai` client: tools called, their results fed back, answers typed.

Starts the OpenAI-compatible server for the bundled model on a free local port (in-process:
HTTP and generation share this event loop), then runs several agents at once. Each one
asks, gets tool calls whose arguments follow the tools' JSON schemas, runs the tools,
sends the results back as `tool` messages and takes the model's next turn. Then a call
streamed, its arguments arriving as the model writes them (`client.chat.completions.stream`),
and last a pydantic-typed extraction through `client.beta.chat.completions.parse`.

Needs `pip install 'aiocb[serve,structured]' openai pydantic`. The bundled model is tiny and
writes code-like text, so its *choices* are arbitrary; what it cannot do is produce a call
that does not parse or arguments that do not validate: the server constrains them.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from openai import AsyncOpenAI
from pydantic import BaseModel, Field

from aiocb import Manager
from aiocb.default_model import DEFAULT_MODEL_PATH, load_default_model
from aiocb.server import build_app
from aiocb.server.connections import local_server

MODEL = DEFAULT_MODEL_PATH.name
CITIES = ["Paris", "Oslo", "Lima", "Kyoto"]
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Today's weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": CITIES}},
                "required": ["city"],
                "additionalProperties": False,
            },
            "strict": True,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "to_fahrenheit",
            "description": "Convert a temperature from Celsius to Fahrenheit",
            "parameters": {
                "type": "object",
                "properties": {"celsius": {"type": "integer", "minimum": -60, "maximum": 60}},
                "required": ["celsius"],
                "additionalProperties": False,
            },
            "strict": True,
        },
    },
]


def get_weather(city: str) -> dict[str, Any]:
    return {"city": city, "celsius": 10 + 3 * CITIES.index(city), "sky": "clear"}


def to_fahrenheit(celsius: int) -> dict[str, Any]:
    return {"fahrenheit": round(celsius * 9 / 5 + 32, 1)}


FUNCTIONS = {"get_weather": get_weather, "to_fahrenheit": to_fahrenheit}


class WeatherReport(BaseModel):
    city: str = Field(max_length=12)
    celsius: int = Field(ge=-60, le=60)
    sunny: bool


async def agent(client: AsyncOpenAI, question: str, seed: int, rounds: int = 2) -> list[str]:
    """Ask, run the tools the model calls, feed the results back; the transcript."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    transcript = [f"user: {question}"]
    for turn in range(rounds):
        reply = await client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            # The first turn must call a tool; later ones may answer instead.
            tool_choice="required" if turn == 0 else "auto",
            parallel_tool_calls=False,
            max_tokens=96,
            temperature=0.8,
            seed=seed + turn,
        )
        message = reply.choices[0].message
        if not message.tool_calls:
            transcript.append(f"assistant: {message.content!r} ({reply.choices[0].finish_reason})")
            break
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            arguments = json.loads(call.function.arguments)  # always valid: the server enforced the schema
            result = FUNCTIONS[call.function.name](**arguments)
            transcript.append(f"assistant calls {call.function.name}({arguments}) -> {result}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
    return transcript


async def main() -> None:
    model, tokenizer = load_default_model()
    manager = Manager(model, grammar_tokenizer=tokenizer)  # (the vocabulary for constraints)
    app = build_app(manager, tokenizer, model_name=MODEL)  # tool-call format: detected from the template
    async with local_server(app) as url, AsyncOpenAI(base_url=f"{url}/v1", api_key="unused") as client:
        questions = [f"Is it warm in {city}? Answer in Fahrenheit." for city in CITIES]
        transcripts = await asyncio.gather(*(agent(client, q, seed=i) for i, q in enumerate(questions)))
        for transcript in transcripts:
            print("\n".join(transcript), end="\n\n")

        # Streamed, a call's arguments grow as the model writes them (an agent's UI may show them).
        pieces: list[str] = []
        async with client.chat.completions.stream(
            model=MODEL,
            messages=[{"role": "user", "content": "What is the weather in Kyoto?"}],
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=64,
            seed=3,
        ) as stream:
            async for event in stream:
                if event.type == "tool_calls.function.arguments.delta":
                    pieces.append(event.arguments_delta)
        print(f"streamed get_weather arguments, in {len(pieces)} pieces: {' | '.join(pieces)}")

        request = {"role": "user", "content": "Report: Lima, 21 degrees, sunny."}
        completion = await client.beta.chat.completions.parse(
            model=MODEL, messages=[request], response_format=WeatherReport, max_tokens=64, seed=7
        )
        print("parsed:", repr(completion.choices[0].message.parsed))


if __name__ == "__main__":
    asyncio.run(main())
