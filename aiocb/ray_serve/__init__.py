"""Data-parallel replicas on Ray Serve, with prefix-affinity routing (the ``ray`` extra).

``build_app(model, num_replicas=2)`` is a Ray Serve application: an ingress deployment
that hashes each prompt's prefix, and replicas that each run one :class:`aiocb.Manager`
behind the OpenAI-compatible routes of ``aiocb serve``::

    from ray import serve
    import aiocb.ray_serve

    serve.run(aiocb.ray_serve.build_app("Qwen/Qwen3-0.6B", num_replicas=4), route_prefix="/")

``aiocb serve MODEL --replicas N [--ray-address ADDR]`` does the same from the command
line. Requests whose prompts share a prefix go to the replica that already caches it
(:class:`PrefixAffinityRouter`); each response names its replica in the
``x-aiocb-replica`` header. A replica whose engine dies fails Ray's health check and is
replaced; a replica lost mid-burst fails only its own requests.
"""

from __future__ import annotations

from aiocb.ray_serve.app import AUTOSCALING_DEFAULTS, PROBE_ROOM, build_app
from aiocb.ray_serve.options import ReplicaOptions
from aiocb.ray_serve.replica import REPLICA_HEADER
from aiocb.ray_serve.routing import BLOCK_CHARS, PrefixAffinityRouter, prefix_hashes, prompt_text

__all__ = [
    "AUTOSCALING_DEFAULTS",
    "BLOCK_CHARS",
    "PROBE_ROOM",
    "REPLICA_HEADER",
    "PrefixAffinityRouter",
    "ReplicaOptions",
    "build_app",
    "prefix_hashes",
    "prompt_text",
]
