"""``aiocb serve [MODEL]``: an OpenAI-compatible HTTP server (uvicorn) over one Manager.

The HTTP handlers and the manager's step coroutine run on the same event loop (uvloop when
it is installed). Without MODEL it serves the bundled ``pycode-tiny``. Every
:class:`~aiocb.ContinuousBatchingConfig` field is a flag, made from the dataclass itself:
``--page-size 32``, ``--num-blocks 4096``, ``--allow-block-sharing`` /
``--no-allow-block-sharing``, ``--use-cuda-graph false,true``; so is every
:class:`~aiocb.server.limits.ServerLimits` field (``--max-request-bytes``, ...).

``SIGTERM`` (or ``Ctrl-C``) drains: the server stops accepting connections, ``/ready``
answers 503, and running requests get ``--shutdown-timeout`` seconds to finish before they
are aborted.

``--api-workers N`` runs the HTTP side in N processes in front of the engine's (see
:mod:`aiocb.cli.api_workers`).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import logging
import math
import os
import re
import socket
import sys
import types
import typing
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from aiocb.config import ContinuousBatchingConfig
from aiocb.errors import InvalidConfigError
from aiocb.server.app import api_key_problem
from aiocb.server.harmony import REASONING_PARSER as HARMONY_REASONING
from aiocb.server.harmony import TOOL_CALL_PARSER as HARMONY_TOOL_CALLS
from aiocb.server.limits import ServerLimits
from aiocb.server.reasoning import ReasoningSplitter
from aiocb.server.tool_parsers import PARSERS
from aiocb.speculative import SpeculativeConfig

if typing.TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

DTYPES = ("auto", "float32", "float16", "bfloat16")
#: The name the bundled model is served under when no MODEL is given.
_DEFAULT_MODEL_NAME = "pycode-tiny"
SHUTDOWN_MARGIN_S = 5.0
#: The exit status of a server whose drain a second SIGINT cut short (0: drained).
FORCED_EXIT = 1
#: The most intra-op threads ``--torch-threads`` may ask torch for (100,000 crashed it).
MAX_TORCH_THREADS = 1024
#: Defaults of the flags that configure uvicorn (which --replicas does not run).
UVICORN_DEFAULTS: dict[str, Any] = {
    "loop": "auto",
    "max_connections": 4096,
    "header_timeout": 30.0,
    "timeout_keep_alive": 5.0,
    "max_header_bytes": 16384,
}
_NONE_WORDS = frozenset({"none", "null", "auto"})
_TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
_FALSE_WORDS = frozenset({"0", "false", "no", "off"})


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``aiocb serve``: model loading, HTTP, and one per ContinuousBatchingConfig field."""
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="a local model directory or a hub id (AutoModelForCausalLM); default: the bundled pycode-tiny",
    )
    parser.add_argument("--tokenizer", default=None, help="tokenizer path or hub id (default: the model's)")
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the model id clients send (default: MODEL, or pycode-tiny without one)",
    )
    parser.add_argument(
        "--chat-template",
        default=None,
        help="the chat template to render chats with instead of the tokenizer's: a file, or the Jinja text itself",
    )
    parser.add_argument("--dtype", choices=DTYPES, default="auto", help="weights dtype (default: the checkpoint's)")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    parser.add_argument("--trust-remote-code", action="store_true", help="allow custom model code from the hub")
    parser.add_argument(
        "--torch-threads", type=int, default=None, help="CPU threads of torch's intra-op pool (default: torch's choice)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind (default 8000; 0 picks a free one)")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("AIOCB_API_KEY"),
        help="require 'Authorization: Bearer KEY' (default: $AIOCB_API_KEY, else no key)",
    )
    parser.add_argument(
        "--api-workers",
        type=int,
        default=0,
        metavar="N",
        help="HTTP processes in front of the engine's: N of them parse requests, tokenize and stream, while "
        "the engine process only runs the model (default 0: all in one process)",
    )
    parser.add_argument(
        "--loop",
        choices=("auto", "uvloop", "asyncio"),
        default=UVICORN_DEFAULTS["loop"],
        help="event loop (auto: uvloop if installed)",
    )
    parser.add_argument(
        "--shutdown-timeout", type=float, default=10.0, help="seconds running requests get on shutdown (default 10)"
    )
    parser.add_argument(
        "--log-level",
        choices=("critical", "error", "warning", "info", "debug"),
        default="info",
        help="log level (default: info)",
    )
    parser.add_argument(
        "--no-access-log", dest="access_log", action="store_false", help="no access-log line per request"
    )
    parser.add_argument(
        "--speculative-config",
        type=_speculative_config,
        default=None,
        metavar="JSON",
        help='speculative decoding, as aiocb.SpeculativeConfig fields: \'{"method": "ngram", '
        '"num_speculative_tokens": 4}\' (default: none)',
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=("auto", "none", *PARSERS, HARMONY_TOOL_CALLS),
        default="auto",
        help="the format of tool calls in chat outputs (default auto: the one the chat template writes; "
        f"none: requests with tools are refused; {HARMONY_TOOL_CALLS}: gpt-oss's harmony, found without it)",
    )
    parser.add_argument(
        "--reasoning-parser",
        choices=(*ReasoningSplitter.names, HARMONY_REASONING),
        default=None,
        help="split <think>...</think> into reasoning_content (default: reasoning stays in the content; "
        f"{HARMONY_REASONING}: gpt-oss's harmony, whose channels are always read)",
    )
    replicas = parser.add_argument_group("replicas", "data-parallel replicas on Ray Serve (the 'ray' extra)")
    replicas.add_argument(
        "--replicas",
        type=_replica_count,
        default=None,
        metavar="N|auto",
        help="serve with N replicas on Ray Serve, or 'auto' to autoscale them by ongoing requests "
        "(aiocb.ray_serve.AUTOSCALING_DEFAULTS); requests sharing a prompt prefix go to one replica",
    )
    replicas.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="the Ray cluster to run on ('auto', or ray://HEAD:10001; default: start a local Ray instance)",
    )
    replicas.add_argument(
        "--autoscaling-config",
        type=_json_object,
        default=None,
        metavar="JSON",
        help="Ray Serve autoscaling_config fields ('{\"max_replicas\": 8}'); the others keep aiocb's defaults",
    )
    replicas.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="ranks per replica, placed together with a Ray placement group (default 1)",
    )
    replicas.add_argument(
        "--ingress-replicas",
        type=_ingress_count,
        default=None,
        metavar="N",
        help="replicas of the ingress that forwards requests to the engine replicas, each with its own prefix "
        "table (default 1)",
    )
    replicas.add_argument(
        "--routing",
        choices=("prefix_affinity", "power_of_two"),
        default=None,
        help="how the ingress picks a replica (default prefix_affinity; power_of_two: Ray Serve's default)",
    )
    connections = parser.add_argument_group("connections", "bounds on connections and on each one's headers")
    connections.add_argument(
        "--max-connections",
        type=int,
        default=UVICORN_DEFAULTS["max_connections"],
        help=(
            "open connections (and requests) at most, per API worker; beyond them a request gets a 503 naming "
            "this flag, with Retry-After (/health, /ready and /metrics are still served; default 4096)"
        ),
    )
    connections.add_argument(
        "--header-timeout",
        type=float,
        default=UVICORN_DEFAULTS["header_timeout"],
        help="seconds a request's headers may take to arrive before the connection is closed (default 30)",
    )
    connections.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=UVICORN_DEFAULTS["timeout_keep_alive"],
        help="seconds an idle keep-alive connection stays (default 5)",
    )
    connections.add_argument(
        "--max-header-bytes",
        type=int,
        default=UVICORN_DEFAULTS["max_header_bytes"],
        help="bytes of request line and headers at most; beyond them the connection gets 431 (default 16384)",
    )
    limits = parser.add_argument_group("request limits", "ServerLimits fields: what one request may cost")
    for flag, kwargs in _dataclass_flags(ServerLimits, prefix="limit_"):
        limits.add_argument(flag, **kwargs)
    group = parser.add_argument_group(
        "continuous batching", "ContinuousBatchingConfig fields; unset flags keep the config's defaults"
    )
    for flag, kwargs in config_flags():
        if flag == "--return-logprobs":  # (refused where the arguments are checked)
            kwargs = {**kwargs, "help": "refused: a server's requests always say (their logprobs field)"}
        elif flag in ("--max-queue-size", "--max-queued-tokens"):  # (a server's requests never wait for room)
            what = "requests" if flag == "--max-queue-size" else "prompt tokens"
            kwargs = {
                **kwargs,
                "help": f"waiting {what} the engine takes at most; beyond them a request gets 429 with "
                "Retry-After (default: 0, no bound)",
            }
        group.add_argument(flag, **kwargs)


def config_flags() -> list[tuple[str, dict[str, Any]]]:
    """``(flag, add_argument keyword arguments)`` for every ContinuousBatchingConfig field."""
    return _dataclass_flags(ContinuousBatchingConfig, prefix="cb_")


def config_from_args(args: argparse.Namespace) -> ContinuousBatchingConfig:
    """The ContinuousBatchingConfig the flags describe (fields not given keep their defaults)."""
    return ContinuousBatchingConfig(**_given(args, ContinuousBatchingConfig, "cb_"))


def limits_from_args(args: argparse.Namespace) -> ServerLimits:
    """The ServerLimits the flags describe (fields not given keep their defaults)."""
    return ServerLimits(**_given(args, ServerLimits, "limit_"))


def _dataclass_flags(cls: type, *, prefix: str) -> list[tuple[str, dict[str, Any]]]:
    """``(flag, add_argument keyword arguments)`` for every field of the dataclass ``cls``."""
    hints = typing.get_type_hints(cls)
    docs = _attribute_docs(cls.__doc__ or "")
    flags: list[tuple[str, dict[str, Any]]] = []
    for field in dataclasses.fields(cls):
        kwargs = _argument_for(hints[field.name])
        default = field.default if field.default is not dataclasses.MISSING else None
        doc = docs.get(field.name, "").replace("%", "%%")
        kwargs.update(dest=f"{prefix}{field.name}", default=argparse.SUPPRESS, help=f"{doc} (default: {default!r})")
        flags.append(("--" + field.name.replace("_", "-"), kwargs))
    return flags


def _given(args: argparse.Namespace, cls: type, prefix: str) -> dict[str, Any]:
    return {
        field.name: getattr(args, prefix + field.name)
        for field in dataclasses.fields(cls)
        if hasattr(args, prefix + field.name)
    }


def said_by_flag(message: str, fields: Iterable[str]) -> str:
    """A config's or limits' error as a command line's: the fields it names (of those given)
    named by their flags."""
    for name in fields:
        message = re.sub(rf"(?<![\w-]){re.escape(name)}(?![\w-])", "--" + name.replace("_", "-"), message)
    return message


def run_serve(args: argparse.Namespace) -> int:
    """Load the model and tokenizer, then serve until interrupted; returns the exit status."""
    try:
        config = config_from_args(args)
        limits = limits_from_args(args)
    except (InvalidConfigError, ValueError) as exc:
        given = [*_given(args, ContinuousBatchingConfig, "cb_"), *_given(args, ServerLimits, "limit_")]
        print(f"aiocb serve: {said_by_flag(str(exc), given)}", file=sys.stderr)
        return 2
    if args.chat_template is not None:
        try:  # (read here: replicas and API workers get the text, which a remote node can use)
            args.chat_template = read_chat_template(args.chat_template)
        except ValueError as exc:
            print(f"aiocb serve: {exc}", file=sys.stderr)
            return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if not args.access_log:
        logging.getLogger("aiocb.access").setLevel(logging.WARNING)
    from aiocb.cli.replicas import replica_problems

    problems = flag_problems(args) + replica_problems(args)
    if problems:
        print(f"aiocb serve: {'; '.join(problems)}", file=sys.stderr)
        return 2
    if args.replicas is not None:
        if importlib.util.find_spec("ray") is None:
            print("aiocb serve --replicas needs the 'ray' extra (pip install 'aiocb[ray]')", file=sys.stderr)
            return 2
        from aiocb.cli.replicas import serve_with_replicas

        return serve_with_replicas(args, config, limits)
    try:
        import aiocb.server.connections  # noqa: F401  (the 'serve' extra's packages)
    except ImportError as exc:
        print(f"aiocb serve needs the 'serve' extra (pip install 'aiocb[serve]'): {exc}", file=sys.stderr)
        return 2
    if args.api_workers:
        from aiocb.cli.api_workers import serve_with_workers

        return serve_with_workers(args, config)
    listeners = listen(args)
    if isinstance(listeners, str):
        print(f"aiocb serve: {listeners}", file=sys.stderr)
        return 2
    try:
        return _serve_on(listeners, args, config, limits)
    finally:
        for listener in listeners:
            listener.close()


def _serve_on(
    listeners: list[socket.socket], args: argparse.Namespace, config: ContinuousBatchingConfig, limits: ServerLimits
) -> int:
    """Load the model and serve it on ``listeners`` until interrupted; the exit status."""
    from aiocb.server import build_app
    from aiocb.server.connections import DrainingServer

    try:
        manager, tokenizer = load_manager(args, config)
    except (ModelLoadError, InvalidConfigError) as exc:  # (the latter: a draft model that would not load)
        print(f"aiocb serve: {exc}", file=sys.stderr)
        return 2
    name = served_model_name(args)
    try:
        app = build_app(
            manager,
            tokenizer,
            name,
            api_key=args.api_key,
            shutdown_timeout=args.shutdown_timeout,
            limits=limits,
            **chat_parsers(args),
        )
    except ValueError as exc:  # (a parser of another format than the chat template's)
        print(f"aiocb serve: {exc}", file=sys.stderr)
        return 2
    loop = event_loop_name(args)
    logger.info("serving %s (event loop: %s)", name, loop)
    server = DrainingServer(uvicorn_config(app, args, loop), app, args.shutdown_timeout, start_engine=True)
    server.run(sockets=listeners)
    if server.start_error is not None:
        print(f"aiocb serve: the engine did not start: {failure_text(server.start_error)}", file=sys.stderr)
        return 2
    return FORCED_EXIT if server.force_exit else 0


def listen(args: argparse.Namespace) -> list[socket.socket] | str:
    """The listening sockets of ``--host`` and ``--port``, one for each address the host
    has (IPv4, IPv6, both for ``localhost``, as uvicorn binds them), bound before the model
    loads (a port in use is found in a moment, not after it); or why there are none. With
    ``--port 0`` they share the port the first one took."""
    sockets: list[socket.socket] = []
    try:
        addresses = socket.getaddrinfo(args.host, args.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        port = args.port
        for family, _, _, _, address in dict.fromkeys(addresses):  # (in order, each once)
            # (IPv6's any address takes IPv4 clients too, as uvicorn's bind of it does)
            both = family == socket.AF_INET6 and address[0] == "::" and socket.has_dualstack_ipv6()
            bound = socket.create_server(
                (address[0], port, *address[2:]), family=family, backlog=4096, dualstack_ipv6=both
            )
            sockets.append(bound)
            port = bound.getsockname()[1]
    except (OSError, OverflowError) as exc:
        for bound in sockets:
            bound.close()
        return f"cannot listen on {args.host}:{args.port}: {exc}"
    return sockets


def failure_text(exc: BaseException) -> str:
    """An exception's message for one line of the command's output (its type where it has none)."""
    return str(exc) or type(exc).__name__


def flag_problems(args: argparse.Namespace) -> list[str]:
    """What is wrong with the flags the server itself reads (each naming its flag)."""
    problems = []
    checks = [
        ("--port", args.port, 0 <= args.port <= 65535, "a port, 0 to 65535 (0: a free one)"),
        ("--api-workers", args.api_workers, args.api_workers >= 0, "0 or more"),
        ("--shutdown-timeout", args.shutdown_timeout, args.shutdown_timeout >= 0, "0 or more seconds"),
        ("--header-timeout", args.header_timeout, args.header_timeout > 0, "more than 0 seconds"),
        ("--timeout-keep-alive", args.timeout_keep_alive, args.timeout_keep_alive > 0, "more than 0 seconds"),
        ("--max-connections", args.max_connections, args.max_connections >= 1, "1 or more"),
        ("--max-header-bytes", args.max_header_bytes, args.max_header_bytes >= 1024, "1024 or more"),
    ]
    if args.torch_threads is not None:
        fine = 1 <= args.torch_threads <= MAX_TORCH_THREADS
        checks.append(("--torch-threads", args.torch_threads, fine, f"1 to {MAX_TORCH_THREADS}"))
    for flag, value, fine, wanted in checks:
        if not fine or (isinstance(value, float) and not math.isfinite(value)):
            problems.append(f"{flag} must be {wanted}, got {value}")
    if args.api_key is not None and not args.api_key.strip():
        problems.append("--api-key (or $AIOCB_API_KEY) is empty: give a key, or leave both unset for no key")
    elif (problem := api_key_problem(args.api_key, "--api-key (or $AIOCB_API_KEY)")) is not None:
        problems.append(problem)
    world = os.environ.get("WORLD_SIZE", "")
    launched = "TORCHELASTIC_RUN_ID" in os.environ or {"RANK", "LOCAL_RANK"} <= os.environ.keys()
    if args.replicas is None and launched and world.isdigit() and int(world) > 1:
        problems.append(
            f"this is one of {world} processes torchrun launched (WORLD_SIZE={world}), and the server is one "
            "process: each would load the whole model and serve on the same port. For tensor parallelism give "
            "--tensor-parallel-size with --replicas, or write a torchrun script around aiocb.Manager (README: "
            "Tensor parallelism)"
        )
    if args.loop == "uvloop" and importlib.util.find_spec("uvloop") is None:
        problems.append("--loop uvloop needs the uvloop package, which is not installed (pip install 'aiocb[uvloop]')")
    if getattr(args, "cb_return_logprobs", False):
        problems.append(
            "--return-logprobs is the library's default for requests that do not say; a server's requests "
            "always say (the logprobs field, false when left out)"
        )
    # (replicas on a cluster run where its GPUs are, not on this machine)
    if args.device != "auto" and (args.replicas is None or args.ray_address is None):
        problems += device_problems(args.device)
    return problems


def read_chat_template(value: str) -> str:
    """``--chat-template``'s template: the text of the file ``value`` names, else ``value``
    itself where it reads as a template (it holds a brace or a line break, vLLM's rule);
    ValueError naming what is wrong, a template that does not compile included."""
    path = os.path.expanduser(value)
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as file:
                text, where = file.read(), value
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--chat-template {value}: cannot be read: {exc}") from None
    elif "{" in value or "}" in value or "\n" in value:
        text, where = value, "text"
    elif os.path.isdir(path):
        raise ValueError(f"--chat-template {value}: a directory, not a template file")
    else:
        raise ValueError(f"--chat-template {value!r}: no such file (nor a Jinja template)")
    problem = chat_template_problem(text)
    if problem is not None:
        raise ValueError(f"--chat-template {where}: {problem}")
    return text


def chat_template_problem(text: str) -> str | None:
    """Why the chat template ``text`` cannot render chats (None: it compiles, as transformers
    compiles it)."""
    if not text.strip():
        return "the template is empty"
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        _compile_jinja_template(text)
    except Exception as exc:  # (jinja2's syntax errors; a private helper of transformers)
        return f"not a Jinja template transformers can compile: {exc}"
    return None


def device_of(name: str) -> torch.device | None:
    """The device ``name`` names where aiocb runs (``cpu``, ``cuda``, ``cuda:N``); None for
    any other name (``auto`` is the caller's to read)."""
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        return None
    return device if device.type in ("cpu", "cuda") else None


def device_problems(name: str, choices: str = "auto, cpu, cuda or cuda:N") -> list[str]:
    """Why ``--device NAME`` cannot run here (empty: it can); ``choices`` say what it may be."""
    import torch

    device = device_of(name)
    if device is None:
        return [f"--device must be {choices}, got {name!r}"]
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            return [f"--device {name}: this machine has no CUDA device (torch {torch.__version__})"]
        if device.index is not None and device.index >= count:
            return [f"--device {name}: this machine has {count} CUDA device(s), numbered from 0"]
    return []


class ModelLoadError(Exception):
    """The model or its tokenizer could not be loaded (the message says which, and why)."""


def _replica_count(text: str) -> int | str:
    """``--replicas``: a count of at least 1, or ``auto``."""
    return text if text == "auto" else _count(text, "replica", "a count or 'auto'")


def _ingress_count(text: str) -> int:
    """``--ingress-replicas``: a count of at least 1."""
    return _count(text, "ingress replica", "a count")


def _count(text: str, what: str, expected: str) -> int:
    """A count of at least one ``what`` (argparse reports the error, saying it ``expected``)."""
    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if count < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1 {what}, got {count}")
    return count


def _speculative_config(text: str) -> SpeculativeConfig:
    """``--speculative-config``'s JSON object as a config (argparse reports the error)."""
    try:
        fields = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(fields, dict):
        raise argparse.ArgumentTypeError("must be a JSON object of SpeculativeConfig fields")
    try:
        return SpeculativeConfig.from_dict(fields)
    except (InvalidConfigError, TypeError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def load_manager(args: argparse.Namespace, config: ContinuousBatchingConfig) -> tuple[Any, Any]:
    """The model loaded from the flags, in a (not yet started) ``aiocb.Manager`` that knows
    its tokenizer's vocabulary for output constraints; ``(manager, tokenizer)``."""
    import aiocb

    model, tokenizer = load_model(args)
    manager = aiocb.Manager(
        model,
        continuous_batching_config=config,
        grammar_tokenizer=tokenizer,
        speculative_config=args.speculative_config,
    )
    return manager, tokenizer


def chat_parsers(args: argparse.Namespace) -> dict[str, str | None]:
    """``build_app``'s tool-call and reasoning parser arguments, from the flags."""
    tool_call_parser = None if args.tool_call_parser == "none" else args.tool_call_parser
    return {"tool_call_parser": tool_call_parser, "reasoning_parser": args.reasoning_parser}


def served_model_name(args: argparse.Namespace) -> str:
    """The model id clients send."""
    return model_name(args.model, args.served_model_name)


def model_name(model: str | None, served_model_name: str | None = None) -> str:
    """The model id clients send: ``served_model_name``, else the model's path or hub id
    (``pycode-tiny`` for the bundled model)."""
    return served_model_name or (model if model is not None else _DEFAULT_MODEL_NAME)


def event_loop_name(args: argparse.Namespace) -> str:
    """uvicorn's name of the event loop to run (``--loop``, auto: uvloop when installed)."""
    loop: str = args.loop
    if loop == "auto":
        loop = "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
    return loop


def uvicorn_config(app: Any, args: argparse.Namespace, loop: str) -> Any:
    """uvicorn's configuration of the HTTP side, from the flags (``app``: the server's, whose
    metrics count the refusals of the connections' protocol)."""
    import uvicorn

    from aiocb.server.connections import http_protocol

    limits = limits_from_args(args)
    protocol = http_protocol(
        args.header_timeout,
        args.max_header_bytes,
        max_connections=args.max_connections,
        send_timeout=limits.send_timeout,
        metrics=None if app is None else app.state.aiocb.metrics,
    )
    return uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        loop=loop,
        http=protocol,
        log_level=args.log_level,
        access_log=False,  # aiocb.access logs each request with its id, tokens and latency
        timeout_keep_alive=args.timeout_keep_alive,
        h11_max_incomplete_event_size=args.max_header_bytes,
        # The drain aborts what is left at --shutdown-timeout; the margin lets those
        # responses reach their clients before uvicorn cancels the connections.
        timeout_graceful_shutdown=args.shutdown_timeout + SHUTDOWN_MARGIN_S,
    )


def load_model(args: argparse.Namespace) -> tuple[Any, Any]:
    """``AutoModelForCausalLM`` and ``AutoTokenizer`` from ``args.model`` (or ``args.tokenizer``);
    :class:`ModelLoadError` naming what could not be loaded."""
    try:
        return load_pretrained(
            args.model,
            tokenizer=args.tokenizer,
            dtype=args.dtype,
            device=args.device,
            trust_remote_code=args.trust_remote_code,
            torch_threads=args.torch_threads,
            chat_template=args.chat_template,
        )
    except Exception as exc:  # (transformers' config checks raise their own kinds, as torch's do)
        what = args.model if args.model is not None else "the bundled model"
        if missing_local_path(args.model):
            raise ModelLoadError(f"cannot load {what}: no such directory") from exc
        device = args.device if args.device != "auto" else "cuda" if _cuda_available() else "cpu"
        raise ModelLoadError(f"cannot load {what} (or its tokenizer) on {device}: {failure_text(exc)}") from exc


def missing_local_path(model: str | None) -> bool:
    """Whether ``model`` is written as a local path (not a hub id) that does not exist."""
    return model is not None and model.startswith(("/", ".", "~")) and not os.path.exists(os.path.expanduser(model))


def _cuda_available() -> bool:
    """Whether torch sees a CUDA device (what ``--device auto`` picks then)."""
    import torch

    return torch.cuda.is_available()


def load_pretrained(
    model: str | None,
    *,
    tokenizer: str | None = None,
    dtype: str = "auto",
    device: str = "auto",
    trust_remote_code: bool = False,
    torch_threads: int | None = None,
    chat_template: str | None = None,
) -> tuple[Any, Any]:
    """``AutoModelForCausalLM`` (in eval mode on ``device``; ``auto``: cuda when available) and
    ``AutoTokenizer`` from ``model`` (None: the bundled pycode-tiny) or ``tokenizer``, with
    ``chat_template`` (its text) in place of its own where given."""
    import torch
    from transformers import AutoModelForCausalLM

    if torch_threads:
        torch.set_num_threads(torch_threads)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    torch_dtype: Any = dtype if dtype == "auto" else getattr(torch, dtype)
    source = model
    if source is None:
        from aiocb.default_model import DEFAULT_MODEL_PATH

        source = str(DEFAULT_MODEL_PATH)
    loaded_tokenizer = load_tokenizer(tokenizer or source, trust_remote_code, chat_template)
    loaded: Any = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, trust_remote_code=trust_remote_code)
    return loaded.to(device).eval(), loaded_tokenizer


def load_tokenizer(source: str, trust_remote_code: bool, chat_template: str | None) -> Any:
    """``AutoTokenizer`` from ``source``, with ``chat_template`` (its text) in place of its own
    where given."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m aiocb.cli.serve MODEL ...``."""
    parser = argparse.ArgumentParser(prog="aiocb serve", description=__doc__.splitlines()[0] if __doc__ else None)
    add_serve_arguments(parser)
    return run_serve(parser.parse_args(argv))


# --------------------------------------------------------------------------- flags from types


def _argument_for(hint: Any) -> dict[str, Any]:
    """add_argument keyword arguments that parse a value of type ``hint``."""
    options = set(typing.get_args(hint)) if _is_union(hint) else {hint}
    optional = type(None) in options
    options.discard(type(None))
    if options == {bool}:
        return {"action": argparse.BooleanOptionalAction}
    if len(options) == 1:
        (only,) = options
        if typing.get_origin(only) is typing.Literal:
            return {"choices": list(typing.get_args(only))}
        if only in (int, float):
            return {"type": _nullable(only) if optional else only, "metavar": only.__name__.upper()}
        if typing.get_origin(only) is dict:
            return {"type": _json_object, "metavar": "JSON"}
    if bool in options and any(typing.get_origin(o) is tuple for o in options):
        return {"type": _bool_or_pair, "metavar": "BOOL[,BOOL]"}
    raise TypeError(f"no command-line parser for a config field of type {hint!r}")


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def _nullable(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        return None if text.lower() in _NONE_WORDS else kind(text)

    parse.__name__ = getattr(kind, "__name__", "value")
    return parse


def _parse_bool(text: str) -> bool:
    word = text.strip().lower()
    if word in _TRUE_WORDS:
        return True
    if word in _FALSE_WORDS:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _bool_or_pair(text: str) -> bool | tuple[bool, bool] | None:
    if text.lower() in _NONE_WORDS:
        return None
    parts = text.split(",")
    if len(parts) == 1:
        return _parse_bool(parts[0])
    if len(parts) == 2:
        return (_parse_bool(parts[0]), _parse_bool(parts[1]))
    raise argparse.ArgumentTypeError(f"expected BOOL or BOOL,BOOL, got {text!r}")


def _json_object(text: str) -> dict[str, Any] | None:
    if text.lower() in _NONE_WORDS:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def _attribute_docs(docstring: str) -> dict[str, str]:
    """``{name: text}`` from a Google-style ``Attributes:`` section."""
    docs: dict[str, str] = {}
    inside = False
    current: list[str] | None = None
    for line in docstring.splitlines():
        stripped = line.strip()
        if stripped == "Attributes:":
            inside = True
            continue
        if not inside or not stripped:
            continue
        indent = len(line) - len(line.lstrip())
        names, colon, text = stripped.partition(":")
        # (one entry may document several fields: "a, b: text")
        named = names.split(", ")
        if colon and all(name.isidentifier() for name in named) and indent <= 8:
            current = named
            for name in named:
                docs[name] = text.strip()
        elif current is not None:
            for name in current:
                docs[name] += " " + stripped
    return docs


if __name__ == "__main__":
    sys.exit(main())
