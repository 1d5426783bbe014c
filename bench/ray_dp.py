"""Data-parallel replicas on Ray Serve: one replica against two, and prefix-affinity against
Ray Serve's default routing, on a local Ray instance with the bundled pycode-tiny.

* **Throughput.** 128 completions of 64 new tokens (EOS ignored, greedy), 64 in flight,
  through Ray Serve's proxy and aiocb's ingress: one replica with ``--threads`` torch
  threads against two replicas with ``--threads / 2`` each (the same cores in all).
* **Prefix hits.** The multi-tenant workload of the tests: 8 system prompts of about
  1,000 characters x 64 users, users in turn across tenants, one new token, 16 in flight.
  Prompt tokens read from the cache (``usage.prompt_tokens_details.cached_tokens``)
  for one replica, two with prefix affinity and two with power-of-two choices, with a
  roomy cache (every tenant fits in each replica) and a tight one of 128 blocks (a
  tenant's system prompt is about 22 blocks: four tenants and the requests in flight fit in
  one replica, all eight do not).

    python bench/ray_dp.py [--threads 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/ray_dp.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx
import ray
from ray import serve

import aiocb
from aiocb.ray_serve import REPLICA_HEADER, build_app
from bench.common import machine_info, markdown_table

PORT = 8765
MODEL = "pycode-tiny"
SYSTEMS = [
    f"# tenant {tenant}: you maintain module_{tenant}.py\n"
    + "".join(f"def helper_{tenant}_{i}(value):\n    return value * {tenant + i} + {i}\n\n" for i in range(16))
    for tenant in range(8)
]
USERS = 64


def deploy(replicas: int, threads: int, num_blocks: int, routing: str = "prefix_affinity") -> float:
    """Run the app (replacing the last one); seconds until it is ready."""
    started = time.perf_counter()
    config = aiocb.ContinuousBatchingConfig(page_size=16, num_blocks=num_blocks)
    app = build_app(
        None, num_replicas=replicas, torch_threads=threads, continuous_batching_config=config, routing=routing
    )
    serve.run(app, name="bench", route_prefix="/")
    return time.perf_counter() - started


async def throughput(requests: int = 128, new: int = 64, concurrency: int = 64) -> dict[str, Any]:
    limit = asyncio.Semaphore(concurrency)
    served: Counter[str] = Counter()

    async def one(http: httpx.AsyncClient, i: int) -> int:
        body = {"model": MODEL, "prompt": f"def task_{i}(items):\n    # step {i}\n", "max_tokens": new}
        body |= {"temperature": 0, "ignore_eos": True}
        async with limit:
            response = await http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        served[response.headers[REPLICA_HEADER]] += 1
        tokens: int = response.json()["usage"]["completion_tokens"]
        return tokens

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{PORT}", timeout=600) as http:
        await asyncio.gather(*(one(http, i) for i in range(8)))  # warm-up
        served.clear()
        started = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(http, i) for i in range(requests))))
        seconds = time.perf_counter() - started
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds, "per_replica": dict(served)}


async def prefix_hits(concurrency: int = 16) -> dict[str, Any]:
    limit = asyncio.Semaphore(concurrency)
    placement: dict[int, set[str]] = {}

    async def one(http: httpx.AsyncClient, tenant: int, user: int) -> tuple[int, int]:
        prompt = SYSTEMS[tenant] + f"# user {user} asks for a test of helper_{tenant}_{user % 16}\n"
        async with limit:
            response = await http.post(
                "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
            )
        assert response.status_code == 200, response.text
        placement.setdefault(tenant, set()).add(response.headers[REPLICA_HEADER])
        usage = response.json()["usage"]
        return usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{PORT}", timeout=600) as http:
        started = time.perf_counter()
        results = await asyncio.gather(*(one(http, t, u) for u in range(USERS) for t in range(len(SYSTEMS))))
        seconds = time.perf_counter() - started
    cached = sum(c for c, _ in results)
    prompt = sum(p for _, p in results)
    return {
        "cached_tokens": cached,
        "prompt_tokens": prompt,
        "hit_rate": cached / prompt,
        "seconds": seconds,
        "replicas_per_tenant": sum(len(r) for r in placement.values()) / len(placement),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--threads", type=int, default=2, help="torch threads in all (split between replicas)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    info = machine_info()
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    print(info.describe())
    results: dict[str, Any] = {"machine": info.describe()}
    try:
        rows = []
        for replicas in (1, 2, 1, 2):  # interleaved, twice
            ready = deploy(replicas, max(args.threads // replicas, 1), 1024)
            run = asyncio.run(throughput())
            results.setdefault("throughput", []).append({"replicas": replicas, "ready_s": ready, **run})
            rows.append([str(replicas), f"{ready:.1f}", f"{run['seconds']:.2f}", f"{run['tokens_per_s']:.0f}"])
            rows[-1].append(", ".join(str(n) for n in run["per_replica"].values()))
        print(markdown_table(["replicas", "ready s", "wall s", "output tok/s", "requests per replica"], rows))

        rows = []
        for label, blocks in (("roomy", 1024), ("tight", 128)):
            for name, replicas, routing in (
                ("one replica", 1, "prefix_affinity"),
                ("two, prefix affinity", 2, "prefix_affinity"),
                ("two, power of two", 2, "power_of_two"),
            ):
                deploy(replicas, max(args.threads // replicas, 1), blocks, routing)
                run = asyncio.run(prefix_hits())
                results.setdefault("prefix", []).append({"cache": label, "setup": name, "blocks": blocks, **run})
                rows.append(
                    [
                        f"{label} ({blocks} blocks)",
                        name,
                        f"{run['cached_tokens']:,}",
                        f"{run['hit_rate']:.1%}",
                        f"{run['replicas_per_tenant']:.2f}",
                        f"{run['seconds']:.1f}",
                    ]
                )
        print()
        print(
            markdown_table(
                ["cache per replica", "setup", "cached prompt tokens", "of all prompt tokens", "replicas/tenant", "s"],
                rows,
            )
        )
    finally:
        serve.shutdown()
        ray.shutdown()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
