"""``aiocb serve MODEL --replicas N``: data-parallel replicas on Ray Serve.

Without ``--ray-address`` a local Ray instance is started (every replica on this
machine); with one (``auto``, or ``ray://head:10001``) the app runs on that cluster, and
``MODEL`` must be a hub id or a path that every node has. Ray Serve's HTTP proxy listens
on ``--host`` / ``--port``. ``SIGTERM`` or ``Ctrl-C`` deletes the app (replicas drain for
``--shutdown-timeout`` seconds) and, for a local instance, stops Ray.
"""

from __future__ import annotations

import argparse
import functools
import logging
import signal
import sys
import threading
from typing import Any

from aiocb.cli.serve import UVICORN_DEFAULTS, chat_parsers, listen, missing_local_path, served_model_name
from aiocb.config import ContinuousBatchingConfig
from aiocb.server.limits import ServerLimits

logger = logging.getLogger(__name__)

#: The name of the Ray Serve application the command runs.
APP_NAME = "aiocb"


def replica_problems(args: argparse.Namespace) -> list[str]:
    """Why the flags cannot run as Ray Serve replicas (empty: they can)."""
    problems: list[str] = []
    if args.replicas is None:
        for flag, value in (
            ("--ray-address", args.ray_address),
            ("--autoscaling-config", args.autoscaling_config),
            ("--routing", args.routing),
            ("--ingress-replicas", args.ingress_replicas),
        ):
            if value is not None:
                problems.append(f"{flag} needs --replicas")
        if args.tensor_parallel_size != 1:
            problems.append(
                "--tensor-parallel-size needs --replicas (Ray Serve places each replica's ranks); on one machine "
                "without Ray, write a torchrun script around aiocb.Manager (README: Tensor parallelism)"
            )
        return problems
    if args.api_workers:
        problems.append("--api-workers does not apply to --replicas (Ray Serve's proxy and ingress take HTTP)")
    for name, default in UVICORN_DEFAULTS.items():
        if getattr(args, name) != default:
            problems.append(f"--{name.replace('_', '-')} is uvicorn's and does not apply to --replicas")
    if args.port == 0:
        problems.append("--port 0 does not apply to --replicas: Ray Serve's proxy needs a fixed port")
    if hasattr(args, "limit_send_timeout"):  # (given: limits' flags default to absent)
        problems.append(
            "--send-timeout does not apply to --replicas: Ray Serve's proxy writes to the client, and takes what a "
            "client leaves unread without making the replica wait"
        )
    if args.autoscaling_config is not None and args.replicas != "auto":
        problems.append("--autoscaling-config goes with --replicas auto, not a fixed count")
    if args.ray_address is None and missing_local_path(args.model):  # (a cluster's nodes may have it)
        problems.append(f"cannot load {args.model}: no such directory")
    return problems


def serve_with_replicas(args: argparse.Namespace, config: ContinuousBatchingConfig, limits: ServerLimits) -> int:
    """Run the app on Ray Serve until a signal; the exit status."""
    import ray
    from ray import serve

    from aiocb.errors import InvalidConfigError
    from aiocb.ray_serve import build_app

    make_app = functools.partial(
        build_app,
        args.model,
        num_replicas=args.replicas,
        autoscaling_config=args.autoscaling_config,
        tensor_parallel_size=args.tensor_parallel_size,
        routing=args.routing or "prefix_affinity",
        num_ingress_replicas=args.ingress_replicas or 1,
        **server_options(args, config, limits),
    )
    try:
        make_app()  # every option checked before Ray starts
    except InvalidConfigError as exc:
        print(f"aiocb serve: {exc}", file=sys.stderr)
        return 2
    local = args.ray_address is None
    if local:  # (a port in use is found now, not once Ray has started)
        bound = listen(args)
        if isinstance(bound, str):
            print(f"aiocb serve: {bound}", file=sys.stderr)
            return 2
        for sock in bound:
            sock.close()
    # "local": a new instance, never a cluster found through RAY_ADDRESS or `ray start`,
    # whose Serve apps shutting down would take with it.
    ray.init(address="local" if local else args.ray_address, log_to_driver=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    deployed = False  # (an app this command did not deploy is never deleted by it)
    try:
        try:
            serve.start(http_options={"host": args.host, "port": args.port})
        except RuntimeError as exc:  # (its proxy's bind failing, taken since the check above)
            reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            print(f"aiocb serve: Ray Serve's proxy did not start on {args.host}:{args.port}: {reason}", file=sys.stderr)
            return 2
        client = serve.context._get_global_client()
        proxy = None if client is None else client.http_config  # Serve already running keeps its own
        if proxy is not None and (proxy.host, proxy.port) != (args.host, args.port):
            print(
                f"aiocb serve: Ray Serve already runs on this cluster with its proxy on {proxy.host}:{proxy.port}; "
                f"give --host {proxy.host} --port {proxy.port}",
                file=sys.stderr,
            )
            return 2
        if not local and APP_NAME in serve.status().applications:
            print(
                f"aiocb serve: an app named {APP_NAME!r} already runs on this cluster (another aiocb serve "
                f"--replicas?); stop it, or run `serve.delete({APP_NAME!r})`, first",
                file=sys.stderr,
            )
            return 2
        # Built again now that Ray runs, so that the replicas' default resources see the cluster's GPUs.
        app = make_app()
        deployed = True  # (from here on: a deploy that fails half-way is cleaned up)
        try:
            serve.run(app, name=APP_NAME, route_prefix="/")
        except RuntimeError as exc:  # (Ray Serve's: the replicas' own errors are in the log above)
            print(
                f"aiocb serve: the replicas did not start ({exc}); their errors are in the log above", file=sys.stderr
            )
            return 2
        logger.info(
            "serving %s on http://%s:%d with %s replicas on Ray Serve",
            served_model_name(args),
            args.host,
            args.port,
            args.replicas,
        )
        stop.wait()
        logger.info("shutting down: the replicas drain, then the app is deleted")
    finally:
        if deployed:
            # The app first: its replicas drain while Ray Serve's proxy still carries their
            # responses (serve.shutdown() alone kills the proxy at once, cutting them off).
            serve.delete(APP_NAME)
        if local:
            serve.shutdown()
        ray.shutdown()
    return 0


def server_options(args: argparse.Namespace, config: ContinuousBatchingConfig, limits: ServerLimits) -> dict[str, Any]:
    """``build_app``'s server options, from the flags."""
    return {
        "tokenizer": args.tokenizer,
        "chat_template": args.chat_template,
        "served_model_name": args.served_model_name,
        "dtype": args.dtype,
        "device": args.device,
        "trust_remote_code": args.trust_remote_code,
        "torch_threads": args.torch_threads,
        "api_key": args.api_key,
        "shutdown_timeout": args.shutdown_timeout,
        "limits": limits,
        "continuous_batching_config": config,
        "speculative_config": args.speculative_config,
        "access_log": args.access_log,
        "log_level": args.log_level,
        **chat_parsers(args),
    }
