"""A web endpoint that awaits generations, cancelled when the client goes away.

    python examples/05_web_app.py           # calls the app in-process and exits
    python examples/05_web_app.py --serve   # serves it on 127.0.0.1:8000 (needs uvicorn)

The handler awaits `manager.generate` while watching the connection: if the client
disconnects first, the generation task is cancelled, which cancels the request and frees
its cache blocks at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from aiocb import Manager
from aiocb.default_model import load_default_model

model, tokenizer = load_default_model()
manager = Manager(model)


async def complete(request: Request) -> JSONResponse:
    body = await request.json()
    generation = asyncio.create_task(
        manager.generate(tokenizer(body["prompt"]).input_ids, max_new_tokens=int(body.get("max_tokens", 32)))
    )
    while not generation.done():
        if await request.is_disconnected():
            generation.cancel()  # cancels the request in the manager
            return JSONResponse({"error": "client went away"}, status_code=499)
        await asyncio.wait({generation}, timeout=0.05)
    output = generation.result()
    return JSONResponse({"text": tokenizer.decode(output.generated_tokens), "finish_reason": output.finish_reason})


@contextlib.asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    async with manager:  # started on the server's own event loop
        yield


app = Starlette(routes=[Route("/complete", complete, methods=["POST"])], lifespan=lifespan)


async def demo() -> None:
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            replies = await asyncio.gather(
                *(
                    client.post("/complete", json={"prompt": f"def task_{i}(self):\n", "max_tokens": 24})
                    for i in range(8)
                )
            )
    for reply in replies[:3]:
        print(reply.status_code, reply.json())


if __name__ == "__main__":
    if "--serve" in sys.argv:
        import uvicorn

        uvicorn.run(app, host="127.0.0.1", port=8000)
    else:
        asyncio.run(demo())
