"""``aiocb serve --api-workers N``: one engine process, N HTTP processes in front of it.

The engine process loads the model, runs the :class:`~aiocb.Manager` and an
:class:`~aiocb.server.remote.EngineService` on its event loop, binds the listening socket
and starts the workers. Each worker (``python -m aiocb.cli.api_workers``) loads only the
tokenizer and the model's config, accepts connections on the shared socket (the kernel
hands each new connection to one of them) and serves the same app as the one-process
server, over a :class:`~aiocb.server.remote.RemoteManager`. ``/metrics`` adds up the
request metrics of all workers (prometheus_client's multiprocess mode) with the engine's.

``SIGTERM`` or ``SIGINT`` to the engine process drains: the workers stop accepting, answer
``/ready`` with 503 and give their running requests ``--shutdown-timeout`` seconds; then
the engine stops. A worker that dies takes the whole server down (exit status 1), so that
whatever supervises it restarts one consistent server; a worker whose engine went away
(killed, or it dropped a worker that fell behind) exits too (status 1), leaving the port.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

from aiocb.cli.serve import (
    SHUTDOWN_MARGIN_S,
    ModelLoadError,
    chat_parsers,
    event_loop_name,
    failure_text,
    limits_from_args,
    listen,
    load_manager,
    load_tokenizer,
    served_model_name,
    uvicorn_config,
)
from aiocb.collector import freeze_alive_objects
from aiocb.config import ContinuousBatchingConfig
from aiocb.errors import InvalidConfigError

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Seconds between checks that every worker is alive.
_WATCH_INTERVAL_S = 0.2


def serve_with_workers(args: argparse.Namespace, config: ContinuousBatchingConfig) -> int:
    """Run the engine process of ``aiocb serve --api-workers N`` until a signal; the exit status."""
    listeners = listen(args)
    if isinstance(listeners, str):
        print(f"aiocb serve: {listeners}", file=sys.stderr)
        return 2
    # (the workers share one socket: of the host's IPv4 address where it has one, as
    # ``localhost``'s ::1 may come first)
    listener = next((s for s in listeners if s.family == socket.AF_INET), listeners[0])
    for other in listeners:
        if other is not listener:
            other.close()
    from aiocb.server.app import chat_parsers_of

    try:
        manager, tokenizer = load_manager(args, config)
        # (the workers' apps read the chat outputs: a parser of another format fails here, once)
        chat_parsers_of(tokenizer, **chat_parsers(args))
    except (ModelLoadError, InvalidConfigError, ValueError) as exc:  # (a draft model that would not load; a parser)
        listener.close()
        print(f"aiocb serve: {exc}", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="aiocb-engine-"))  # private (0700): the socket and metrics
    try:
        return _run_loop(event_loop_name(args), _engine(args, manager, listener, workdir))
    finally:
        listener.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _run_loop(loop: str, coroutine: Coroutine[Any, Any, T]) -> T:
    if loop == "uvloop":
        import uvloop

        result: T = uvloop.run(coroutine)
        return result
    return asyncio.run(coroutine)


async def _engine(args: argparse.Namespace, manager: Any, listener: socket.socket, workdir: Path) -> int:
    from aiocb.server.remote import EngineService

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        manager.start()  # (the cache is planned here: it may not fit)
        await manager.wait_started()
    except Exception as exc:  # (a runner that cannot be built ends the server here)
        print(f"aiocb serve: the engine did not start: {failure_text(exc)}", file=sys.stderr)
        return 2
    service = EngineService(manager)
    engine_socket = str(workdir / "engine.sock")
    await service.start(engine_socket)
    (workdir / "args.pickle").write_bytes(pickle.dumps(args))
    metrics_dir = workdir / "metrics"
    metrics_dir.mkdir()
    workers = [_start_worker(workdir, engine_socket, listener, metrics_dir) for _ in range(args.api_workers)]
    port = listener.getsockname()[1]
    # Only the workers accept: once they all stop, connecting is refused, as with one process.
    listener.close()
    logger.info(
        "serving %s on http://%s:%d with %d API workers (pids %s)",
        served_model_name(args),
        args.host,
        port,
        len(workers),
        ", ".join(str(w.pid) for w in workers),
    )
    status = 0
    try:
        while not stop.is_set():
            dead = [w for w in workers if w.poll() is not None]
            if dead:
                logger.error(
                    "API worker %d exited with status %s; stopping the server", dead[0].pid, dead[0].returncode
                )
                status = 1
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), _WATCH_INTERVAL_S)
        logger.info("shutting down: the API workers drain, then the engine stops")
        await _stop_workers(workers, args.shutdown_timeout + 2 * SHUTDOWN_MARGIN_S)
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
        await service.close()
        await manager.stop(timeout=SHUTDOWN_MARGIN_S)
    return status


def _start_worker(
    workdir: Path, engine_socket: str, listener: socket.socket, metrics_dir: Path
) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "aiocb.cli.api_workers", "--engine-socket", engine_socket]
    command += ["--listen-fd", str(listener.fileno()), "--args", str(workdir / "args.pickle")]
    # Set before the worker imports prometheus_client: its metrics then live in files here.
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}
    return subprocess.Popen(command, env=env, pass_fds=(listener.fileno(),))


async def _stop_workers(workers: list[subprocess.Popen[bytes]], timeout: float) -> None:
    for worker in workers:
        if worker.poll() is None:
            worker.send_signal(signal.SIGTERM)
    await asyncio.to_thread(_wait_for_exit, workers, timeout)
    for worker in workers:
        if worker.poll() is None:
            logger.warning("API worker %d did not stop within %.0f s; killed", worker.pid, timeout)
            worker.kill()


def _wait_for_exit(workers: list[subprocess.Popen[bytes]], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for worker in workers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            worker.wait(timeout=max(deadline - time.monotonic(), 0.0))


# --------------------------------------------------------------------------- a worker


async def _worker(args: argparse.Namespace, engine_socket: str, listener: socket.socket) -> int:
    from transformers import AutoConfig

    from aiocb.server import build_app
    from aiocb.server.connections import DrainingServer
    from aiocb.server.remote import RemoteManager

    source = args.model
    if source is None:
        from aiocb.default_model import DEFAULT_MODEL_PATH

        source = str(DEFAULT_MODEL_PATH)
    tokenizer = load_tokenizer(args.tokenizer or source, args.trust_remote_code, args.chat_template)
    model_config = AutoConfig.from_pretrained(source, trust_remote_code=args.trust_remote_code)
    engine = await RemoteManager.connect(engine_socket, model_config)
    app = build_app(
        engine,
        tokenizer,
        served_model_name(args),
        api_key=args.api_key,
        shutdown_timeout=args.shutdown_timeout,
        limits=limits_from_args(args),
        **chat_parsers(args),
    )
    # Everything alive now (torch, transformers, the tokenizer, the app) lives as long as
    # the process: out of the collector's view, as the engine's manager does with its own
    # (see aiocb.collector). Without it a full collection,
    # which a large request's objects set off, rescanned some 365,000 objects: 150-365 ms
    # of this worker's loop.
    freeze_alive_objects()
    server = DrainingServer(uvicorn_config(app, args, event_loop_name(args)), app, args.shutdown_timeout)
    lost: list[str] = []

    async def exit_when_the_engine_goes() -> None:
        lost.append(await engine.wait_lost())
        logger.error("API worker: %s; exiting", lost[0])
        server.should_exit = True

    watch = asyncio.create_task(exit_when_the_engine_goes())
    try:
        await server.serve(sockets=[listener])
    finally:
        watch.cancel()
        await engine.close()
    return 1 if lost else 0


def main(argv: Sequence[str] | None = None) -> int:
    """A worker process: ``python -m aiocb.cli.api_workers --engine-socket PATH --listen-fd FD --args FILE``."""
    parser = argparse.ArgumentParser(prog="aiocb API worker")
    parser.add_argument("--engine-socket", required=True, help="the engine's Unix socket")
    parser.add_argument("--listen-fd", type=int, required=True, help="the listening socket, inherited")
    parser.add_argument("--args", type=Path, required=True, help="the engine's parsed command line (pickle)")
    own = parser.parse_args(argv)
    args: argparse.Namespace = pickle.loads(own.args.read_bytes())
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s[%(process)d]: %(message)s")
    if not args.access_log:
        logging.getLogger("aiocb.access").setLevel(logging.WARNING)
    listener = socket.socket(fileno=own.listen_fd)
    return _run_loop(event_loop_name(args), _worker(args, own.engine_socket, listener))


if __name__ == "__main__":
    sys.exit(main())
