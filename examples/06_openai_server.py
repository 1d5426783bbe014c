"""The OpenAI-compatible server driven by the official `openai` client.

Starts the server for the bundled model on a free local port (in-process, one event
loop for HTTP and generation), then calls it like any OpenAI endpoint.
"""

from __future__ import annotations

import asyncio

from openai import AsyncOpenAI

from aiocb import Manager
from aiocb.default_model import DEFAULT_MODEL_PATH, load_default_model
from aiocb.server import build_app
from aiocb.server.connections import local_server


async def main() -> None:
    model, tokenizer = load_default_model()
    # (the tokenizer's vocabulary is what response_format and enforced tools compile against)
    manager = Manager(model, grammar_tokenizer=tokenizer)
    app = build_app(manager, tokenizer, model_name=DEFAULT_MODEL_PATH.name)
    async with local_server(app) as url, AsyncOpenAI(base_url=f"{url}/v1", api_key="unused") as client:
        reply = await client.completions.create(
            model=DEFAULT_MODEL_PATH.name, prompt="def merge_sort(items):\n", max_tokens=48, temperature=0
        )
        print(reply.choices[0].text)
        print("usage:", reply.usage)
        stream = await client.completions.create(
            model=DEFAULT_MODEL_PATH.name, prompt="class Queue:\n", max_tokens=32, stream=True, seed=1, temperature=0.8
        )
        async for event in stream:
            print(event.choices[0].text, end="", flush=True)
        print()


if __name__ == "__main__":
    asyncio.run(main())
