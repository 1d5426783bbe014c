"""Two replicas of the bundled model on Ray Serve, with prefix-affinity routing.

Starts a local Ray instance, runs ``aiocb.ray_serve.build_app`` with two replicas behind
Ray Serve's HTTP proxy, then sends chat requests of three "tenants" (each with its own long
system prompt) through the official ``openai`` client: every tenant's requests land on
one replica, which computes the system prompt once and reads it from its cache after.
Needs `pip install 'aiocb[ray]' openai`.
"""

from __future__ import annotations

import socket
from collections import defaultdict

import ray
from openai import OpenAI
from ray import serve

import aiocb
from aiocb.ray_serve import REPLICA_HEADER, build_app


def main() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        config = aiocb.ContinuousBatchingConfig(page_size=16, num_blocks=512)
        serve.run(build_app(None, num_replicas=2, torch_threads=1, continuous_batching_config=config))
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        served = defaultdict(set)
        for user in range(4):
            for tenant in ("billing", "search", "storage"):
                system = f"You review the {tenant} service's Python code. " + f"def {tenant}_helper(x): return x\n" * 30
                raw = client.chat.completions.with_raw_response.create(
                    model="pycode-tiny",
                    messages=[{"role": "system", "content": system}, {"role": "user", "content": f"question {user}"}],
                    max_tokens=8,
                    temperature=0,
                )
                reply = raw.parse()
                served[tenant].add(raw.headers[REPLICA_HEADER])
                cached = reply.usage.prompt_tokens_details.cached_tokens if reply.usage.prompt_tokens_details else 0
                print(f"{tenant:8} user {user}: replica {raw.headers[REPLICA_HEADER]}, {cached} cached prompt tokens")
        for tenant, replicas in served.items():
            print(f"{tenant}: served by {', '.join(sorted(replicas))}")
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
