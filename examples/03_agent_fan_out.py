"""An agent fanning out 1,000 concurrent calls: plain `await`s in a TaskGroup.

Every call is an ordinary coroutine; the manager batches whatever is in flight at each
step, so a thousand tasks cost no more ceremony than one.
"""

from __future__ import annotations

import asyncio
import time

from aiocb import Manager
from aiocb.default_model import load_default_model

TOOLS = ["read_file", "write_file", "list_dir", "run_tests", "grep"]


async def main(calls: int = 1000) -> None:
    model, tokenizer = load_default_model()
    async with Manager(model) as manager:

        async def think(step: int) -> str:
            prompt = f"def {TOOLS[step % len(TOOLS)]}_{step}(path):\n    "
            output = await manager.generate(tokenizer(prompt).input_ids, max_new_tokens=12, temperature=0.8, seed=step)
            return tokenizer.decode(output.generated_tokens)

        started = time.perf_counter()
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(think(i)) for i in range(calls)]
        elapsed = time.perf_counter() - started
        stats = manager.statistics()
    print(f"{calls} calls in {elapsed:.1f} s ({stats.tokens_generated / elapsed:.0f} tokens/s, {stats.steps} steps)")
    print("first answer:", repr(tasks[0].result()))


if __name__ == "__main__":
    asyncio.run(main())
