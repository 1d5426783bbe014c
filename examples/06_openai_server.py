"""The OpenAI-compatible server driven by the official `openai` client.

Starts `aiocb serve` for the bundled model on a free local port (in-process, one event
loop for HTTP and generation), then calls it like any OpenAI endpoint.
"""

from __future__ import annotations

import asyncio
import socket

import uvicorn
from openai import AsyncOpenAI

import aiocb
from aiocb.default_model import DEFAULT_MODEL_PATH, load_default_model
from aiocb.server import build_app


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def main() -> None:
    model, tokenizer = load_default_model()
    app = build_app(aiocb.Manager(model), tokenizer, model_name=DEFAULT_MODEL_PATH.name)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    serving = asyncio.create_task(server.serve())
    while not server.started:  # noqa: ASYNC110 (uvicorn offers a flag, not an event)
        await asyncio.sleep(0.05)
    try:
        client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
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
    finally:
        server.should_exit = True
        await serving


if __name__ == "__main__":
    asyncio.run(main())
