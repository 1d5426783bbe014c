"""What every replica of a Ray Serve app is built with: the model loading and server options."""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

from aiocb.cli.serve import DTYPES, MAX_TORCH_THREADS, chat_template_problem, device_of
from aiocb.config import ContinuousBatchingConfig, as_config
from aiocb.errors import InvalidConfigError
from aiocb.server.app import check_api_key
from aiocb.server.harmony import REASONING_PARSER, TOOL_CALL_PARSER
from aiocb.server.limits import ServerLimits
from aiocb.server.reasoning import ReasoningSplitter
from aiocb.server.tool_parsers import PARSERS
from aiocb.speculative import SpeculativeConfig

_DEFAULT_LIMITS = ServerLimits()
#: Why a replica has no send timeout (its responses go to the ingress, then the proxy).
_SEND_TIMEOUT_REFUSED = (
    "does not apply to replicas: Ray Serve's proxy writes to the client, and takes what a client leaves unread "
    "without making the replica wait"
)
_LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


@dataclass(frozen=True, slots=True)
class ReplicaOptions:
    """``build_app``'s server options, as ``aiocb serve``'s flags of the same names.

    Attributes:
        tokenizer: tokenizer path or hub id (default: the model's).
        chat_template: the chat template (its Jinja text, which replicas on other nodes
            need no file for) to render chats with instead of the tokenizer's.
        served_model_name: the model id clients send (default: the model path, or
            ``pycode-tiny`` for the bundled model).
        dtype: ``auto`` (the checkpoint's), ``float32``, ``float16`` or ``bfloat16``.
        device: ``auto`` (cuda when the replica has a GPU), ``cpu``, ``cuda`` or ``cuda:N``.
        trust_remote_code: allow custom model code.
        torch_threads: torch's intra-op threads in each replica (default: torch's choice).
        api_key: require ``Authorization: Bearer KEY`` on the API routes.
        shutdown_timeout: seconds running requests get when a replica shuts down (Ray
            Serve's drain, its ``graceful_shutdown_timeout_s``: a request still running
            then ends with the replica, its stream with an error event).
        limits: what one request may cost (:class:`~aiocb.server.limits.ServerLimits`).
        continuous_batching_config: each replica's engine configuration.
        speculative_config: speculative decoding (a draft model given by path).
        tool_call_parser: ``auto``, a parser name, or None (tools refused).
        reasoning_parser: split ``<think>`` into ``reasoning_content`` (None: no split).
        access_log: one ``aiocb.access`` log line per request in the replicas' logs.
        log_level: the level of aiocb's log lines in the replicas' logs.
    """

    tokenizer: str | None = None
    chat_template: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    trust_remote_code: bool = False
    torch_threads: int | None = None
    api_key: str | None = None
    shutdown_timeout: float = 10.0
    limits: ServerLimits = dataclasses.field(default_factory=ServerLimits)
    continuous_batching_config: ContinuousBatchingConfig = dataclasses.field(default_factory=ContinuousBatchingConfig)
    speculative_config: SpeculativeConfig | None = None
    tool_call_parser: str | None = "auto"
    reasoning_parser: str | None = None
    access_log: bool = True
    log_level: str = "info"

    def __post_init__(self) -> None:
        if self.chat_template is not None:
            if not isinstance(self.chat_template, str):
                raise InvalidConfigError(f"chat_template must be the template's text, got {self.chat_template!r}")
            problem = chat_template_problem(self.chat_template)
            if problem is not None:
                raise InvalidConfigError(f"chat_template: {problem}")
        check_api_key(self.api_key)
        if self.dtype not in DTYPES:
            raise InvalidConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        tool_parsers = (*PARSERS, TOOL_CALL_PARSER)
        if self.tool_call_parser not in (None, "auto", *tool_parsers):
            raise InvalidConfigError(
                f"unknown tool_call_parser {self.tool_call_parser!r}; known: auto, {', '.join(tool_parsers)}"
            )
        reasoning_parsers = (*ReasoningSplitter.names, REASONING_PARSER)
        if self.reasoning_parser is not None and self.reasoning_parser not in reasoning_parsers:
            raise InvalidConfigError(
                f"unknown reasoning_parser {self.reasoning_parser!r}; known: {', '.join(reasoning_parsers)}"
            )
        if self.log_level not in _LOG_LEVELS:
            raise InvalidConfigError(f"log_level must be one of {', '.join(_LOG_LEVELS)}, got {self.log_level!r}")
        if self.device != "auto" and (not isinstance(self.device, str) or device_of(self.device) is None):
            raise InvalidConfigError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        threads = self.torch_threads
        if threads is not None:
            count = _integer(threads)
            if count is None or not 1 <= count <= MAX_TORCH_THREADS:
                raise InvalidConfigError(f"torch_threads must be an int from 1 to {MAX_TORCH_THREADS}, got {threads!r}")
            object.__setattr__(self, "torch_threads", count)  # (a NumPy int, say: as Python's)
        object.__setattr__(
            self, "shutdown_timeout", check_seconds("shutdown_timeout", self.shutdown_timeout, zero=True)
        )
        for name in ("trust_remote_code", "access_log"):
            value = getattr(self, name)
            if not isinstance(value, (bool, _NUMPY_BOOL)):
                raise InvalidConfigError(f"{name} must be True or False, got {value!r}")
            object.__setattr__(self, name, bool(value))
        if not isinstance(self.limits, ServerLimits):
            raise InvalidConfigError(f"limits must be a ServerLimits, got {type(self.limits).__name__}")
        if self.limits.send_timeout != _DEFAULT_LIMITS.send_timeout:
            raise InvalidConfigError(f"limits.send_timeout {_SEND_TIMEOUT_REFUSED}")
        # (aiocb's or transformers' own, as a Manager takes it)
        object.__setattr__(self, "continuous_batching_config", as_config(self.continuous_batching_config))
        if self.continuous_batching_config.return_logprobs:
            raise InvalidConfigError(
                "continuous_batching_config.return_logprobs is the library's default for requests that do not "
                "say; a server's requests always say (the logprobs field, false when left out)"
            )
        if self.speculative_config is not None and not isinstance(self.speculative_config, SpeculativeConfig):
            raise InvalidConfigError(
                f"speculative_config must be an aiocb.SpeculativeConfig, got {type(self.speculative_config).__name__}"
            )

    @classmethod
    def from_kwargs(cls, options: dict[str, object]) -> ReplicaOptions:
        """The options given as ``build_app``'s keyword arguments; unknown names are refused."""
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise InvalidConfigError(
                f"build_app() got unknown server options: {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        return cls(**options)  # type: ignore[arg-type]


#: NumPy's boolean scalar type, where NumPy is installed (a truth value, as ``bool`` is)
_NUMPY_BOOL: tuple[type, ...] = ()
try:
    import numpy

    _NUMPY_BOOL = (numpy.bool_,)
except ImportError:  # pragma: no cover - (torch brings NumPy with it)
    pass


def _integer(value: object) -> int | None:
    """``value`` as an int where it is an integer (Python's or NumPy's), not a truth value."""
    if isinstance(value, numbers.Integral) and not isinstance(value, (bool, *_NUMPY_BOOL)):
        return int(value)
    return None


def check_seconds(name: str, value: object, *, zero: bool = False) -> float:
    """``value`` as a float; refused, naming it, unless a finite number above 0 (or
    ``zero``: 0 or more)."""
    seconds = math.nan
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, *_NUMPY_BOOL)):
        seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not zero):
        least = "0 or more" if zero else "above 0"
        raise InvalidConfigError(f"{name} must be a finite number of seconds, {least}, got {value!r}")
    return seconds


def check_count(name: str, value: object, *, least: int) -> int:
    """``value`` as an int; refused, naming it, unless an integer of at least ``least``."""
    count = _integer(value)
    if count is None or count < least:
        raise InvalidConfigError(f"{name} must be an int >= {least}, got {value!r}")
    return count
