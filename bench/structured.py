"""What constrained decoding costs: the same workload free, then with half of it under a
JSON schema, interleaved.

The bundled model and tokenizer (``aiocb.default_model``), W1's shape of workload within
the model's 256-token context: 64 requests, prompts of 16..128 tokens (seeded, drawn from
the vocabulary), up to 64 new tokens at temperature 1.0, seeded per request. In the constrained run every other request
must produce JSON under a small schema (an object with a bounded integer, an enum and a
short array); such a request ends as soon as its JSON is complete, so the two runs make a
different number of tokens: compare the tokens per second and the mean step time, both
printed. Every constrained output is checked to parse and to match the schema's keys.

    python bench/structured.py [--repeats 3] [--requests 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/structured.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiocb
from aiocb.default_model import load_default_model
from bench.common import machine_info

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9999},
        "kind": {"enum": ["add", "remove", "update"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["id", "kind", "tags"],
}


async def _run(model: Any, tokenizer: Any, prompts: list[list[int]], new: int, constrained: bool) -> dict[str, float]:
    async with aiocb.Manager(model, tokenizer=tokenizer) as manager:
        await manager.generate_batch(prompts[:4], max_new_tokens=4)  # warm-up
        if constrained:  # (compiled once, before the clock starts, as a server would have it cached)
            await manager.generate(prompts[0], max_new_tokens=4, json_schema=SCHEMA)
        steps = manager.statistics().steps
        started = time.perf_counter()
        ids = []
        for i, prompt in enumerate(prompts):
            extra: dict[str, Any] = {"json_schema": SCHEMA} if constrained and i % 2 == 0 else {}
            ids.append(await manager.add_request(prompt, max_new_tokens=new, temperature=1.0, seed=i, **extra))
        outputs = [await manager.get_result(i) for i in ids]
        wall = time.perf_counter() - started
        steps = manager.statistics().steps - steps
    tokens = 0
    for i, output in enumerate(outputs):
        assert output is not None
        tokens += len(output.generated_tokens)
        if constrained and i % 2 == 0:
            value = json.loads(output.text or "")
            assert set(value) == {"id", "kind", "tags"}, output.text
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "step_ms": wall / steps * 1e3}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    model, tokenizer = load_default_model()
    rng = random.Random(0)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(1, vocab) for _ in range(rng.randint(16, 128))] for _ in range(args.requests)]
    runs: dict[str, list[dict[str, float]]] = {"free": [], "half constrained": []}
    for _ in range(args.repeats):
        for name, constrained in (("free", False), ("half constrained", True)):
            runs[name].append(asyncio.run(_run(model, tokenizer, prompts, args.new_tokens, constrained)))
    print(machine_info().describe())
    print(f"\n{args.requests} requests, prompts 16..128 tokens, up to {args.new_tokens} new tokens, temperature 1.0\n")
    print("| run | tokens | tokens/s | mean step ms |")
    print("| :--- | ---: | ---: | ---: |")
    for name, results in runs.items():
        rates = [r["tokens_per_s"] for r in results]
        steps = [r["step_ms"] for r in results]
        rate = f"{statistics.median(rates):.0f} ({min(rates):.0f}–{max(rates):.0f})"
        step = f"{statistics.median(steps):.2f} ({min(steps):.2f}–{max(steps):.2f})"
        print(f"| {name} | {results[0]['tokens']:.0f} | {rate} | {step} |")
    free = statistics.median(r["tokens_per_s"] for r in runs["free"])
    mixed = statistics.median(r["tokens_per_s"] for r in runs["half constrained"])
    print(f"\nthroughput with half the requests constrained: {mixed / free:.2f}x of free (target >= 0.85x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
