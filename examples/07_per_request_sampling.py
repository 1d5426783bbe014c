"""Per-request sampling: greedy, hot and seeded requests side by side in the same steps.

A request's `seed` fixes its samples whatever else shares its batch.
"""

from __future__ import annotations

import asyncio

from aiocb import Manager
from aiocb.default_model import load_default_model


async def main() -> None:
    model, tokenizer = load_default_model()
    ids = tokenizer("def handle_request(self, request):\n    ").input_ids
    async with Manager(model) as manager:
        greedy, cool, hot, seeded = await asyncio.gather(
            manager.generate(ids, max_new_tokens=32),
            manager.generate(ids, max_new_tokens=32, temperature=0.3, top_p=0.9, seed=1),
            manager.generate(ids, max_new_tokens=32, temperature=1.5, top_k=50, seed=2),
            manager.generate(ids, max_new_tokens=32, temperature=0.8, seed=42),
        )
        alone = await manager.generate(ids, max_new_tokens=32, temperature=0.8, seed=42)
    for name, output in [("greedy", greedy), ("t=0.3", cool), ("t=1.5", hot), ("seed=42", seeded)]:
        print(f"--- {name}\n{tokenizer.decode(output.generated_tokens)}")
    print("same seed, different neighbours, same tokens:", alone.generated_tokens == seeded.generated_tokens)


if __name__ == "__main__":
    asyncio.run(main())
