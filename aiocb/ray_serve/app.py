"""``build_app``: an OpenAI-compatible Ray Serve application of aiocb replicas."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any, Literal

import ray
from ray import serve
from ray.serve.config import AutoscalingConfig
from ray.serve.deployment import Application

from aiocb.errors import InvalidConfigError
from aiocb.ray_serve.ingress import Ingress
from aiocb.ray_serve.options import ReplicaOptions, check_count, check_seconds
from aiocb.ray_serve.replica import EngineReplica
from aiocb.ray_serve.routing import BLOCK_CHARS, MAX_ENTRIES, MAX_IMBALANCE, PrefixAffinityRouter
from aiocb.ray_serve.tensor_parallel import CLOSE_TIMEOUT_S

#: ``autoscaling_config`` keys left out take these values. Replicas are added while
#: the average replica has more than ``target_ongoing_requests`` requests running or
#: queued (a continuous-batching replica serves dozens at once at little cost each, so
#: the target is high), and removed after ten quiet minutes (a replica takes a model
#: load to come back).
AUTOSCALING_DEFAULTS: dict[str, Any] = {
    "min_replicas": 1,
    "max_replicas": 4,
    "target_ongoing_requests": 64,
    "upscale_delay_s": 30.0,
    "downscale_delay_s": 600.0,
}
#: Requests one replica takes at once beyond its ``--max-concurrent-requests``: room for the
#: probes (``/health``, ``/ready``, ``/metrics``), which the server never refuses, and for
#: the requests it answers 429 (it must see them to refuse them).
PROBE_ROOM = 16
#: Requests the ingress takes at once (it only forwards them).
INGRESS_MAX_ONGOING_REQUESTS = 8192
#: Seconds a replica's destructor gets once Ray Serve's drain ended (the engine stopped).
_DESTRUCTOR_S = 2.0
#: Seconds the ingress's drain outlasts the engine replicas' (it carries their responses,
#: and a stream the engine's end cut off to its error event and ``[DONE]``).
_INGRESS_DRAIN_MARGIN_S = 5.0

Routing = Literal["prefix_affinity", "power_of_two"]


def build_app(
    model: str | os.PathLike[str] | None = None,
    *,
    num_replicas: int | Literal["auto"] | None = None,
    autoscaling_config: Mapping[str, Any] | AutoscalingConfig | None = None,
    ray_actor_options: Mapping[str, Any] | None = None,
    tensor_parallel_size: int = 1,
    routing: Routing = "prefix_affinity",
    max_ongoing_requests: int | None = None,
    max_imbalance: int = MAX_IMBALANCE,
    health_check_period_s: float = 10.0,
    health_check_timeout_s: float = 30.0,
    num_ingress_replicas: int = 1,
    **server_options: Any,
) -> Application:
    """A Ray Serve application: replicas that each run one :class:`aiocb.Manager` on
    ``model`` (a local path or hub id; None: the bundled pycode-tiny) behind the
    OpenAI-compatible routes of ``aiocb serve``, streaming included, with an ingress that
    routes requests by prompt prefix. Run it with ``serve.run(build_app(...))``.

    Args:
        num_replicas: a fixed count (default 1), or ``"auto"`` for autoscaling with
            :data:`AUTOSCALING_DEFAULTS`.
        autoscaling_config: Ray Serve autoscaling by ongoing requests per replica (a dict,
            or Ray Serve's ``AutoscalingConfig``); keys left out take
            :data:`AUTOSCALING_DEFAULTS`. Not with a fixed ``num_replicas``.
        ray_actor_options: each replica's resources (default ``{"num_cpus": 1}``, plus
            ``"num_gpus": 1`` when the Ray cluster has GPUs, or, before Ray is initialised,
            when this machine has). Under tensor parallelism each rank's bundle holds what
            they reserve (CPUs, GPUs, ``memory``, ``accelerator_type``, custom
            ``resources``), and each rank's actor gets them and their ``runtime_env``.
        tensor_parallel_size: ranks per replica. Above 1 each replica gets a placement
            group of one bundle per rank (packed on one node where possible): the replica
            is rank 0, the other ranks are Ray actors.
        routing: ``"prefix_affinity"`` (:class:`~aiocb.ray_serve.PrefixAffinityRouter`)
            or ``"power_of_two"`` (Ray Serve's default: the less loaded of two random
            replicas).
        max_ongoing_requests: requests one replica takes at once (more wait in the
            ingress's router); default: the server's ``max_concurrent_requests`` plus
            :data:`PROBE_ROOM` (with no such bound, 0, as many as an ingress replica takes:
            8,192). Below that the replica's 429s and probes would wait in the router:
            refused.
        max_imbalance: ongoing requests a prefix's replica may have beyond the least
            loaded one's and still get the requests that share the prefix (prefix-affinity
            routing only, as is the ``x-aiocb-replica`` request header).
        health_check_period_s, health_check_timeout_s: Ray Serve's health checks; a
            replica whose engine is dead fails its check, and exits by itself first.
        num_ingress_replicas: ingress replicas (each keeps its own prefix table).
        server_options: :class:`~aiocb.ray_serve.ReplicaOptions` fields
            (``continuous_batching_config``, ``api_key``, ``limits``, ``dtype``, ...).

    Raises:
        InvalidConfigError: naming the first option that is wrong.
    """
    options = _local_paths(ReplicaOptions.from_kwargs(server_options))
    source = None if model is None else os.fspath(model)
    if source is not None and os.path.exists(source):
        if options.served_model_name is None:  # (clients name it as given, as with one process)
            options = dataclasses.replace(options, served_model_name=source)
        source = os.path.abspath(source)  # the replicas' working directory is not this one
    bound = options.limits.max_concurrent_requests
    least = bound + PROBE_ROOM
    if max_ongoing_requests is None:  # (no bound, 0: as many as an ingress replica takes)
        max_ongoing_requests = least if bound else INGRESS_MAX_ONGOING_REQUESTS
    deployment_options = _scaling(num_replicas, autoscaling_config)
    actor_options = _actor_options(ray_actor_options)
    deployment_options |= _placement(source, options, tensor_parallel_size, actor_options)
    _check_device(options.device, actor_options)
    _check_chat_parsers(source, options)
    # (as Python's numbers: Ray's configs and the router's keyword arguments are serialised)
    max_ongoing_requests = check_count("max_ongoing_requests", max_ongoing_requests, least=1)
    num_ingress_replicas = check_count("num_ingress_replicas", num_ingress_replicas, least=1)
    max_imbalance = check_count("max_imbalance", max_imbalance, least=0)
    health_check_period_s = check_seconds("health_check_period_s", health_check_period_s)
    health_check_timeout_s = check_seconds("health_check_timeout_s", health_check_timeout_s)
    if max_ongoing_requests < least:
        raise InvalidConfigError(
            f"max_ongoing_requests ({max_ongoing_requests}) must be at least the server's max_concurrent_requests "
            f"({options.limits.max_concurrent_requests}) plus {PROBE_ROOM}: a replica that takes fewer never "
            "answers 429, and its probes wait behind its requests"
        )
    if routing == "prefix_affinity":
        deployment_options["request_router_config"] = {  # a RequestRouterConfig's fields
            "request_router_class": f"{PrefixAffinityRouter.__module__}.{PrefixAffinityRouter.__name__}",
            "request_router_kwargs": {"max_imbalance": max_imbalance, "max_entries": MAX_ENTRIES},
        }
    elif routing != "power_of_two":
        raise InvalidConfigError(f"routing must be 'prefix_affinity' or 'power_of_two', got {routing!r}")
    elif max_imbalance != MAX_IMBALANCE:
        raise InvalidConfigError("max_imbalance is prefix-affinity routing's; routing='power_of_two' has none")
    follower_options = _rank_options(actor_options) if tensor_parallel_size > 1 else None
    # Ray Serve drains a replica itself: it waits for the running requests, for up to this,
    # before it calls the replica's destructor (which stops the engine and, under tensor
    # parallelism, releases the followers), and kills it when this runs out. So running
    # requests get shutdown_timeout; the rest is the destructor's.
    shutdown_s = options.shutdown_timeout + _DESTRUCTOR_S + (2 * CLOSE_TIMEOUT_S if tensor_parallel_size > 1 else 0.0)
    engine = serve.deployment(
        name="AiocbEngine",
        max_ongoing_requests=max_ongoing_requests,
        health_check_period_s=health_check_period_s,
        health_check_timeout_s=health_check_timeout_s,
        graceful_shutdown_timeout_s=shutdown_s,
        **deployment_options,
    )(EngineReplica).bind(source, options, tensor_parallel_size, follower_options)
    ingress = serve.deployment(
        name="AiocbIngress",
        num_replicas=num_ingress_replicas,
        max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS,
        graceful_shutdown_timeout_s=shutdown_s + _INGRESS_DRAIN_MARGIN_S,
        ray_actor_options={"num_cpus": 0},
    )(Ingress)
    application: Application = ingress.bind(engine, options.limits, BLOCK_CHARS, options.api_key)
    return application


def _scaling(
    num_replicas: int | str | None, autoscaling: Mapping[str, Any] | AutoscalingConfig | None
) -> dict[str, Any]:
    if num_replicas not in (None, "auto") and autoscaling is not None:
        raise InvalidConfigError("autoscaling_config goes with num_replicas='auto' (or none), not a fixed count")
    if isinstance(autoscaling, AutoscalingConfig):  # (Ray's own: its fields as given)
        autoscaling = autoscaling.model_dump(exclude_unset=True)
    if autoscaling is not None and not isinstance(autoscaling, Mapping):
        raise InvalidConfigError(
            f"autoscaling_config must be a dict or Ray Serve's AutoscalingConfig, got {type(autoscaling).__name__}"
        )
    if num_replicas == "auto" or autoscaling is not None:
        merged = {**AUTOSCALING_DEFAULTS, **(autoscaling or {})}
        try:
            AutoscalingConfig(**merged)
        except Exception as exc:  # pydantic's ValidationError names the field
            raise InvalidConfigError(f"autoscaling_config is not valid: {exc}") from None
        return {"autoscaling_config": merged}
    if num_replicas is None:
        return {"num_replicas": 1}
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
        raise InvalidConfigError(f"num_replicas must be an int >= 1 or 'auto', got {num_replicas!r}")
    return {"num_replicas": num_replicas}


def _actor_options(given: Mapping[str, Any] | None) -> dict[str, Any]:
    if given is not None:
        if not isinstance(given, Mapping):
            raise InvalidConfigError(f"ray_actor_options must be a dict, got {type(given).__name__}")
        return dict(given)
    options: dict[str, Any] = {"num_cpus": 1}
    # Ray's cluster when it runs; else this machine, where serve.run will start one.
    gpus = ray.cluster_resources().get("GPU", 0) if ray.is_initialized() else _local_gpus()
    if gpus > 0:
        options["num_gpus"] = 1
    return options


def _check_chat_parsers(model: str | None, options: ReplicaOptions) -> None:
    """Refuse parsers of another format than the chat template's here, where the tokenizer
    is on this machine (the bundled model's, or a local directory's), rather than in every
    replica as it builds its app."""
    from aiocb.default_model import DEFAULT_MODEL_PATH
    from aiocb.server.app import chat_parsers_of

    source = options.tokenizer or model or str(DEFAULT_MODEL_PATH)
    tokenizer: Any
    if os.path.isdir(source):
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=options.trust_remote_code)
        except Exception as exc:  # (every replica would fail to load it)
            raise InvalidConfigError(f"the tokenizer in {source} does not load: {exc}") from None
    elif options.chat_template is None:
        return  # (a hub id: the replicas load it, and refuse there)
    else:
        tokenizer = SimpleNamespace()
    if options.chat_template is not None:  # (the replicas' template, in place of the tokenizer's)
        tokenizer.chat_template = options.chat_template
    try:
        chat_parsers_of(tokenizer, options.tool_call_parser, options.reasoning_parser)
    except ValueError as exc:
        raise InvalidConfigError(str(exc)) from None


def _check_device(device: str, actor_options: Mapping[str, Any]) -> None:
    """Refuse a CUDA device the replicas would not have: a replica sees the GPUs Ray gives
    it alone, numbered from 0 (one for a fraction of one)."""
    if not device.startswith("cuda"):
        return
    given = actor_options.get("num_gpus") or 0
    if not isinstance(given, (int, float)) or given <= 0:
        raise InvalidConfigError(
            f"device={device!r}, but ray_actor_options give each replica no GPU: add 'num_gpus': 1 (or a fraction, "
            "to share one)"
        )
    index = int(device.partition(":")[2] or 0)
    if index >= max(1, math.ceil(given)):
        raise InvalidConfigError(
            f"device={device!r}, but each replica sees only the {math.ceil(given)} GPU(s) Ray gives it "
            f"(num_gpus={given}), numbered from 0"
        )


def _local_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _local_paths(options: ReplicaOptions) -> ReplicaOptions:
    """``options`` with a tokenizer or draft model given by a path here made absolute: the
    replicas' working directory is not this one (a relative path there would be read as
    a hub id)."""
    if options.tokenizer is not None and os.path.exists(options.tokenizer):
        options = dataclasses.replace(options, tokenizer=os.path.abspath(options.tokenizer))
    speculative = options.speculative_config
    if speculative is not None and isinstance(speculative.draft_model, str) and os.path.exists(speculative.draft_model):
        absolute = dataclasses.replace(speculative, draft_model=os.path.abspath(speculative.draft_model))
        options = dataclasses.replace(options, speculative_config=absolute)
    return options


#: The ``ray_actor_options`` that reserve resources, and the one that sets up a process:
#: every tensor-parallel rank's actor gets them
_RANK_OPTIONS = ("num_cpus", "num_gpus", "memory", "accelerator_type", "resources", "runtime_env")


def _rank_options(actor_options: Mapping[str, Any]) -> dict[str, Any]:
    """One tensor-parallel rank's actor options: those of the replica's that reserve
    resources or set up its process (a CPU, as a Serve replica, when none is said)."""
    options = {key: actor_options[key] for key in _RANK_OPTIONS if actor_options.get(key) is not None}
    options.setdefault("num_cpus", 1)
    return options


def _bundle(rank_options: Mapping[str, Any]) -> dict[str, float]:
    """One rank's placement-group bundle: what its actor (the replica's, for rank 0) asks
    Ray for, as Ray counts it (``accelerator_type`` a sliver of a resource of that name)."""
    bundle = {
        "CPU": float(rank_options["num_cpus"]),
        "GPU": float(rank_options.get("num_gpus", 0)),
        "memory": float(rank_options.get("memory", 0)),
    }
    if rank_options.get("accelerator_type"):
        bundle[f"accelerator_type:{rank_options['accelerator_type']}"] = 0.001
    bundle |= {name: float(amount) for name, amount in (rank_options.get("resources") or {}).items()}
    bundle = {name: amount for name, amount in bundle.items() if amount > 0}
    if not bundle:
        raise InvalidConfigError(
            "ray_actor_options reserve nothing (num_cpus=0, no GPUs, memory or resources): under tensor "
            "parallelism each rank's placement-group bundle must hold some resource"
        )
    return bundle


def _placement(model: str | None, options: ReplicaOptions, size: int, actor_options: dict[str, Any]) -> dict[str, Any]:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise InvalidConfigError(f"tensor_parallel_size must be an int >= 1, got {size!r}")
    if size == 1:
        return {"ray_actor_options": actor_options}
    if model is None:
        raise InvalidConfigError("tensor_parallel_size > 1 needs a model path or hub id (not the bundled model)")
    if options.speculative_config is not None and options.speculative_config.method == "draft":
        raise InvalidConfigError("speculative decoding with a draft model does not support tensor parallelism yet")
    if options.device not in ("auto", "cpu", "cuda"):
        raise InvalidConfigError(
            f"device={options.device!r} with tensor parallelism: give 'auto', 'cpu' or 'cuda' "
            "(each rank gets a GPU of its own)"
        )
    if os.path.isdir(model):
        import aiocb.distributed

        aiocb.distributed.validate_tp(model, size, trust_remote_code=options.trust_remote_code)
    bundle = _bundle(_rank_options(actor_options))
    return {
        "ray_actor_options": actor_options,
        "placement_group_bundles": [dict(bundle) for _ in range(size)],
        "placement_group_strategy": "PACK",
    }
