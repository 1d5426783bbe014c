"""Event-loop lag while the server takes one completions request with many prompts.

The app runs in this process over ASGI (httpx, no socket), on the loop a 1 ms heartbeat
shares: one ``POST /v1/completions`` brings ``--prompts`` two-token prompts (token ids)
for one new token each. The heartbeat records how late it wakes (what held the loop:
parsing, queuing the choices, starting their streams, waking their readers, the response)
and the garbage collector's pauses during the request are listed beside it.

    python bench/many_choices.py [--prompts 3000] [--repeats 3]

The model is a tiny seeded Qwen3 over a byte-level BPE tokenizer trained here (the test
suite's server fixtures), so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/many_choices.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

import aiocb
from aiocb.server import build_app
from aiocb.server.limits import ServerLimits
from bench.common import machine_info
from bench.loop_watch import GCPauses, Heartbeat
from tests.server.conftest import MODEL_NAME, build_tokenizer, serve_config, serve_model


async def one_round(manager: aiocb.Manager, tokenizer: Any, prompts: int) -> str:
    limits = ServerLimits(max_choices=max(prompts, ServerLimits().max_choices))
    app = build_app(manager, tokenizer, MODEL_NAME, limits=limits)
    body = {"prompt": [[5, i % 50 + 6] for i in range(prompts)], "max_tokens": 1}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://bench") as client:
        await client.post("/v1/completions", json={"prompt": body["prompt"][:8], "max_tokens": 1})  # warm-up
        async with Heartbeat() as beat:
            await asyncio.sleep(0.01)
            with GCPauses() as collector:
                started = time.perf_counter()
                response = await client.post("/v1/completions", json=body)
                wall = time.perf_counter() - started
    assert response.status_code == 200 and len(response.json()["choices"]) == prompts, response.text[:300]
    generation = collector.longest[0][1] if collector.longest else "-"
    return (
        f"{prompts} prompts: wall {wall:.2f} s; {beat.summary()}; collector: "
        f"{collector.collections} pauses, longest {collector.max_pause * 1e3:.1f} ms (generation {generation})"
    )


async def main_async(args: argparse.Namespace) -> None:
    tokenizer = build_tokenizer()
    model = serve_model(tokenizer)
    async with aiocb.Manager(model, continuous_batching_config=serve_config(num_blocks=4096)) as manager:
        for _ in range(args.repeats):
            print(await one_round(manager, tokenizer, args.prompts), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--prompts", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(machine_info().describe(), flush=True)
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
