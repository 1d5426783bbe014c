"""Stream one request: print the text as tokens arrive."""

from __future__ import annotations

import asyncio

from aiocb import Manager
from aiocb.default_model import load_default_model


async def main() -> None:
    model, tokenizer = load_default_model()
    prompt = "def parse_args(argv):\n    "
    async with Manager(model) as manager:
        request_id = await manager.add_request(tokenizer(prompt).input_ids, max_new_tokens=80, temperature=0.7, seed=0)
        print(prompt, end="", flush=True)
        shown = ""
        async for chunk in manager.stream(request_id):  # each chunk holds every token so far
            text = tokenizer.decode(chunk.generated_tokens, skip_special_tokens=True)
            print(text[len(shown) :], end="", flush=True)
            shown = text
        print(f"\n[{chunk.status.name}, {chunk.finish_reason}, {len(chunk.generated_tokens)} tokens]")


if __name__ == "__main__":
    asyncio.run(main())
