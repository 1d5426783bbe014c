"""Prefix sharing: a common system prompt is computed once and reused by every request."""

from __future__ import annotations

import asyncio

import aiocb
from aiocb import Manager
from aiocb.default_model import load_default_model

SYSTEM = '''"""Utilities for the project's command-line tools.

Every helper below takes plain arguments, returns plain values and never prints.
"""

import os
import sys
from pathlib import Path

'''
TASKS = ["def read_lines(path):\n", "def write_json(path, data):\n", "def find_root():\n", "def is_hidden(name):\n"]


async def run(sharing: bool) -> aiocb.ManagerStatistics:
    model, tokenizer = load_default_model()
    config = aiocb.ContinuousBatchingConfig(page_size=16, allow_block_sharing=sharing)
    prompts = [tokenizer(SYSTEM + task).input_ids for task in TASKS * 4]
    async with Manager(model, continuous_batching_config=config) as manager:
        outputs = await manager.generate_batch(prompts, max_new_tokens=24)
        stats = manager.statistics()
    if sharing:
        print(tokenizer.decode(next(iter(outputs.values())).generated_tokens))
    return stats


async def main() -> None:
    shared, separate = await run(True), await run(False)
    print(
        f"with sharing:    {shared.tokens_computed} tokens computed, {shared.prefix_hit_tokens} served from the cache"
    )
    print(f"without sharing: {separate.tokens_computed} tokens computed")


if __name__ == "__main__":
    asyncio.run(main())
