"""``ContinuousBatchingConfig``: the hardware-side settings, with transformers' names and defaults.

The model-side settings (``max_new_tokens``, ``eos_token_id``, sampling) live in a
transformers ``GenerationConfig``; this config says how the runtime uses the machine.
Every value is checked when the config is built, so a bad value fails at the line that
wrote it rather than deep inside the step loop.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Literal

from aiocb.errors import InvalidConfigError

logger = logging.getLogger(__name__)

SchedulerType = Literal["fifo", "prefill_first"]

#: ``max_batch_tokens`` when it is not given; memory sizing may lower it, never below the floor.
DEFAULT_MAX_BATCH_TOKENS = 8192
_DEFAULT_PAGE_SIZE = 256
MIN_AUTO_MAX_BATCH_TOKENS = 256
#: ``max_requests_per_batch`` when neither the config nor the workload says otherwise.
DEFAULT_MAX_REQUESTS_PER_BATCH = 1024
#: ``max_blocks_per_request`` when it is None.
DEFAULT_MAX_BLOCKS_PER_REQUEST = 32
#: ``safety_margin`` per scheduler when it is None.
DEFAULT_SAFETY_MARGIN: dict[str, float] = {"fifo": 0.15, "prefill_first": 0.0}
#: ``max_memory_percent`` when it is None: host memory is shared with everything else.
DEFAULT_MEMORY_PERCENT_CPU = 0.6
DEFAULT_MEMORY_PERCENT_ACCELERATOR = 0.9
#: The longest ``cpu_group_timeout`` (a year, in seconds): lock and queue waits overflow
#: long before 1e10 s, and None already means waiting for ever.
MAX_CPU_GROUP_TIMEOUT = 365 * 24 * 3600


@dataclass
class ContinuousBatchingConfig:
    """How the runtime batches, caches and runs requests on the device.

    Field names and defaults follow transformers' ``ContinuousBatchingConfig``; ``None``
    means "size it from the machine and the workload". Fields aiocb adds are marked.

    Attributes:
        page_size: KV tokens per page of one layer (the block size). At least 4.
        num_blocks: KV cache blocks; by default they fill the memory budget.
        max_batch_tokens: query tokens per forward pass (longer prompts are chunked);
            8192 by default, lowered to fit memory but never below 256.
        max_memory_percent: share of free device memory (host memory on CPU) the cache and
            batch buffers may use; 0.9 on CUDA, 0.6 on CPU and other devices by default.
        max_requests_per_batch: requests per forward pass; by default the number of
            prompts submitted (``generate_batch``, or the manager's :class:`WorkloadHints`)
            or 1024, capped by ``max_batch_tokens``.
        max_blocks_per_request: width of the decode fast path's block table; when None,
            enough for the longest request where :class:`WorkloadHints` say
            (``generate_batch`` gives them), else 32; 0 disables the fast path.
        allow_block_sharing: prefix caching across requests (full-attention models only).
        use_async_batching: overlap scheduling of step N+1 with step N on the device
            (on a CPU too); on by default when CUDA graphs are on.
        use_cuda_graph: capture and replay CUDA graphs; ``(varlen, decode)`` sets the two
            paths apart. On by default on CUDA for the decode path.
        q_padding_interval_size, kv_padding_interval_size: accepted for compatibility
            (checked, then unused, with a warning when not 0): aiocb captures no graphs of
            mixed steps, and its decode graphs are keyed by padded batch size.
        varlen_compile_config: ``torch.compile`` keyword arguments for mixed/prefill steps (a
            dict, or a transformers ``CompileConfig``).
        decode_compile_config: ``torch.compile`` keyword arguments for decode-only steps.
            (aiocb) When neither it nor ``default_compile_level`` is set and decode steps
            replay CUDA graphs on one process, the decode model is compiled with
            ``mode="default", dynamic=True`` before the graphs are captured;
            ``{"disable": True}`` (``torch.compile``'s own switch) keeps it eager. Modes
            that capture CUDA graphs of their own are refused while aiocb's are on.
        default_compile_level: 0 (no compile) to 3; explicit compile configs win.
        scheduler_type: ``"fifo"`` (decode first) or ``"prefill_first"``. In both, while a
            request waits that could be admitted, running prompts' chunks take at most half
            the step's tokens.
        safety_margin: fraction of the cache kept free for running requests: below it no
            new request is admitted; 0.15 for fifo and 0.0 for prefill_first by default.
        return_logprobs: return each generated token's log-probability by default.
        seed: seeds the per-request random streams of requests that bring no seed.
        auto_switch_to_flash: use flash-attn for the paged attention when it is importable
            (False: aiocb's own kernels still, never the model's ``sdpa`` or ``eager``).
        cpu_offload_space: GiB of host memory for KV blocks of preempted requests (0 = off;
            None sizes it from ``cpu_offload_space_safety_threshold``).
        cpu_offload_space_safety_threshold: share of available host memory the offload
            pool may take: a larger ``cpu_offload_space`` is clamped to it (with a
            warning), and None sizes the pool from it (0: no offloading).
        cpu_group_timeout: seconds a tensor-parallel collective may wait, and rank 0 a whole
            step (its own forward included), at most a year (None = forever).
        per_request_processors: accepted for compatibility; per-request sampling
            parameters always apply in aiocb.
        max_queue_size: waiting requests admitted before ``add_request`` waits (0 = no bound).
        max_queued_tokens: (aiocb) waiting prompt tokens before ``add_request`` waits
            (0 = no bound).
        max_model_len: (aiocb, vLLM's name) the longest sequence, prompt and generated
            tokens, a request may reach; None: the model's context length (more than it is
            refused when the manager is built).
        drop_unsupported_processors: a ``GenerationConfig`` field that changes outputs and
            that aiocb cannot honour (beam search, ``encoder_no_repeat_ngram_size``,
            ``guidance_scale``, ...) is dropped with one warning naming it; with False it
            is refused with ``InvalidRequestError`` when the manager is built.
        disable_nccl_graph_mixing: under tensor parallelism (``WORLD_SIZE`` > 1), set
            ``NCCL_GRAPH_MIXING_SUPPORT=0`` (as transformers does).
        grammar_compile_timeout: (aiocb) seconds a structured-output constraint may take to
            compile: one of over 2,048 characters compiles in a child process first,
            stopped past it, and the request is refused naming it (xgrammar's compile
            cannot be stopped in the engine's process). None: every constraint compiles in
            the engine's process alone, with no bound.
        block_size: deprecated name of ``page_size``.
        use_default_compile_configs: deprecated in transformers, mapped as it maps it:
            True sets ``default_compile_level`` to 3, False to 0 (with a warning).
        max_cached_graphs: deprecated in transformers; accepted and ignored, with a warning.
    """

    page_size: int = _DEFAULT_PAGE_SIZE
    num_blocks: int | None = None
    max_batch_tokens: int | None = None
    max_memory_percent: float | None = None
    max_requests_per_batch: int | None = None
    max_blocks_per_request: int | None = None
    allow_block_sharing: bool = True
    use_async_batching: bool | None = None
    use_cuda_graph: bool | tuple[bool, bool] | None = None
    q_padding_interval_size: int = 0
    kv_padding_interval_size: int = 0
    varlen_compile_config: dict[str, Any] | None = None
    decode_compile_config: dict[str, Any] | None = None
    default_compile_level: int = 0
    scheduler_type: SchedulerType = "fifo"
    safety_margin: float | None = None
    return_logprobs: bool = False
    seed: int | None = None
    auto_switch_to_flash: bool = True
    cpu_offload_space: float | None = 0.0
    cpu_offload_space_safety_threshold: float = 0.8
    cpu_group_timeout: float | None = 300.0
    per_request_processors: bool = False
    max_queue_size: int = 0
    max_queued_tokens: int = 0
    max_model_len: int | None = None
    drop_unsupported_processors: bool = True
    disable_nccl_graph_mixing: bool = True
    grammar_compile_timeout: float | None = 10.0
    block_size: int | None = None
    use_default_compile_configs: bool | None = None
    max_cached_graphs: int | None = None

    def __post_init__(self) -> None:
        for check, required, optional in (
            (_check_bool, _BOOLS, _OPTIONAL_BOOLS),
            (_check_number, _NUMBERS, _OPTIONAL_NUMBERS),
        ):
            for name in (*required, *optional):
                value = getattr(self, name)
                if value is not None or name in required:
                    check(value, name)
        if self.block_size is not None:
            if self.page_size not in (_DEFAULT_PAGE_SIZE, self.block_size):
                raise InvalidConfigError(
                    f"page_size={self.page_size} and block_size={self.block_size} (its deprecated name) disagree: "
                    "give page_size alone"
                )
            logger.warning(
                "ContinuousBatchingConfig.block_size is deprecated: use page_size (block_size=%d taken as page_size)",
                self.block_size,
            )
            self.page_size, self.block_size = self.block_size, None
        if self.use_default_compile_configs is not None:
            # (as transformers maps it since deprecating it)
            self.default_compile_level = 3 if self.use_default_compile_configs else 0
            logger.warning(
                "ContinuousBatchingConfig.use_default_compile_configs is deprecated: use default_compile_level "
                "(set to %d from it)",
                self.default_compile_level,
            )
        if self.max_cached_graphs is not None:
            logger.warning("ContinuousBatchingConfig.max_cached_graphs is deprecated and has no effect")
        if self.disable_nccl_graph_mixing and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            os.environ.setdefault("NCCL_GRAPH_MIXING_SUPPORT", "0")
        _check_int(self.page_size, "page_size", minimum=4)
        _check_optional_int(self.num_blocks, "num_blocks", minimum=1)
        _check_optional_int(self.max_batch_tokens, "max_batch_tokens", minimum=1)
        _check_optional_int(self.max_requests_per_batch, "max_requests_per_batch", minimum=1)
        _check_optional_int(self.max_blocks_per_request, "max_blocks_per_request", minimum=0)
        _check_optional_int(self.max_model_len, "max_model_len", minimum=1)
        _check_int(self.q_padding_interval_size, "q_padding_interval_size", minimum=0)
        _check_int(self.kv_padding_interval_size, "kv_padding_interval_size", minimum=0)
        padded = [n for n in ("q_padding_interval_size", "kv_padding_interval_size") if getattr(self, n)]
        if padded:
            logger.warning(
                "ContinuousBatchingConfig.%s pads transformers' CUDA graphs of mixed steps, which aiocb does not "
                "capture: it has no effect (aiocb's decode graphs are keyed by padded batch size)",
                " and ".join(padded),
            )
        _check_int(self.max_queue_size, "max_queue_size", minimum=0)
        _check_int(self.max_queued_tokens, "max_queued_tokens", minimum=0)
        _check_int(self.default_compile_level, "default_compile_level", minimum=0)
        if self.default_compile_level > 3:
            raise InvalidConfigError(f"default_compile_level must be 0, 1, 2 or 3, got {self.default_compile_level}")
        if self.max_memory_percent is not None and not 0.0 < self.max_memory_percent <= 1.0:
            raise InvalidConfigError(f"max_memory_percent must be in (0, 1], got {self.max_memory_percent}")
        if not isinstance(self.scheduler_type, str) or self.scheduler_type not in DEFAULT_SAFETY_MARGIN:
            raise InvalidConfigError(
                f"scheduler_type must be one of {sorted(DEFAULT_SAFETY_MARGIN)}, got {self.scheduler_type!r}"
            )
        if self.safety_margin is not None and not 0.0 <= self.safety_margin <= 1.0:
            raise InvalidConfigError(f"safety_margin must be in [0, 1], got {self.safety_margin}")
        if self.cpu_offload_space is not None and self.cpu_offload_space < 0:
            raise InvalidConfigError(f"cpu_offload_space must be >= 0 GiB or None, got {self.cpu_offload_space}")
        if not 0.0 <= self.cpu_offload_space_safety_threshold <= 1.0:
            raise InvalidConfigError(
                f"cpu_offload_space_safety_threshold must be in [0, 1] (0: no offloading), "
                f"got {self.cpu_offload_space_safety_threshold}"
            )
        if self.cpu_group_timeout is not None and self.cpu_group_timeout <= 0:
            raise InvalidConfigError(f"cpu_group_timeout must be > 0 seconds or None, got {self.cpu_group_timeout}")
        if self.cpu_group_timeout is not None and self.cpu_group_timeout > MAX_CPU_GROUP_TIMEOUT:
            raise InvalidConfigError(
                f"cpu_group_timeout must be at most {MAX_CPU_GROUP_TIMEOUT} s (a year), or None to wait for ever; "
                f"got {self.cpu_group_timeout}"
            )
        if self.grammar_compile_timeout is not None and self.grammar_compile_timeout <= 0:
            raise InvalidConfigError(
                f"grammar_compile_timeout must be > 0 seconds or None, got {self.grammar_compile_timeout}"
            )
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise InvalidConfigError(f"seed must be an int or None, got {self.seed!r}")
        graphs = self.use_cuda_graph
        if isinstance(graphs, list):  # (a pair read from JSON)
            graphs = self.use_cuda_graph = tuple(graphs)
        if not (
            graphs is None
            or isinstance(graphs, bool)
            or (isinstance(graphs, tuple) and len(graphs) == 2 and all(isinstance(g, bool) for g in graphs))
        ):
            raise InvalidConfigError(
                f"use_cuda_graph must be a bool, a (varlen, decode) pair of bools or None, got {graphs!r}"
            )
        for name in ("varlen_compile_config", "decode_compile_config"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, dict) and callable(getattr(value, "to_dict", None)):
                value = value.to_dict()  # (transformers' CompileConfig, whose fields are torch.compile's)
                setattr(self, name, value)
            if value is not None and not isinstance(value, dict):
                raise InvalidConfigError(
                    f"{name} must be a dict of torch.compile arguments, a transformers CompileConfig or None"
                )
            unknown = sorted(set(value or ()) - _compile_arguments())
            if unknown:
                raise InvalidConfigError(
                    f"{name} has {', '.join(map(repr, unknown))}, which torch.compile does not take; "
                    f"it takes {', '.join(sorted(_compile_arguments()))}"
                )
            _check_compile_values(name, value or {})

    @property
    def resolved_safety_margin(self) -> float:
        """The safety margin in effect: the field, or the scheduler's default."""
        if self.safety_margin is not None:
            return self.safety_margin
        return DEFAULT_SAFETY_MARGIN[self.scheduler_type]

    @property
    def cuda_graph_booleans(self) -> tuple[bool, bool]:
        """``use_cuda_graph`` as ``(varlen, decode)``, as transformers' config gives it:
        ``(False, False)`` while it is None (the manager decides: see
        ``Manager.continuous_batching_config``)."""
        graphs = self.use_cuda_graph
        if graphs is None:
            return False, False
        if isinstance(graphs, bool):
            return graphs, graphs
        return graphs

    @property
    def fallback_max_blocks_per_request(self) -> int:
        """``max_blocks_per_request`` when neither it nor the workload's hints say."""
        return DEFAULT_MAX_BLOCKS_PER_REQUEST

    def sized_for(self, hints: WorkloadHints | None, context: int | None = None) -> ContinuousBatchingConfig:
        """This config, or where ``max_blocks_per_request`` is None and ``hints`` give the
        longest request (else ``max_model_len`` bounds it), a copy whose block table holds
        it (at most the model's ``context``): an even number of pages, one more than its
        tokens need (as transformers sizes it)."""
        if self.max_blocks_per_request is not None:
            return self
        if hints is not None:
            longest = hints.max_prompt_length + hints.max_generated_length
        elif self.max_model_len is not None:  # (every request fits the decode graphs' tables)
            longest = self.max_model_len
        else:
            return self
        if context is not None:
            longest = min(longest, context)
        if longest <= 0:
            return self
        blocks = -(-longest // self.page_size) + 1
        sized = copy.copy(self)  # (not replace(): no checks or deprecation warnings again)
        sized.max_blocks_per_request = blocks + blocks % 2
        return sized

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ContinuousBatchingConfig:
        """Build a config from a mapping, rejecting unknown field names by name."""
        return cls(**values)

    def replace(self, **changes: Any) -> ContinuousBatchingConfig:
        """A copy with some fields changed (validated like a new config)."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True, slots=True)
class WorkloadHints:
    """What a manager may size itself by before its requests come (transformers'
    ``WorkloadHints``, whose own a manager takes too): the longest prompt and the most
    tokens a request generates (``max_blocks_per_request``, when the config leaves it None),
    and how many requests come at once (``max_requests_per_batch``). 0: not known.
    ``generate_batch`` gives them from its prompts."""

    max_prompt_length: int = 0
    max_generated_length: int = 0
    num_requests: int = 0

    def __post_init__(self) -> None:
        for name in ("max_prompt_length", "max_generated_length", "num_requests"):
            _check_int(getattr(self, name), f"WorkloadHints.{name}", minimum=0)

    @classmethod
    def of(cls, value: Any) -> WorkloadHints | None:
        """``value`` as aiocb's hints: None, aiocb's, or transformers' (its three fields
        read); anything else is refused with :class:`InvalidConfigError` naming its type."""
        if value is None or isinstance(value, WorkloadHints):
            return value
        if dataclasses.is_dataclass(value) and type(value).__name__ == "WorkloadHints":
            fields: Any = value  # (transformers' class, not imported: its fields are aiocb's)
            return cls(fields.max_prompt_length, fields.max_generated_length, fields.num_requests)
        raise InvalidConfigError(f"workload_hints must be a WorkloadHints, got {type(value).__name__}")


def _is_transformers_config(value: Any) -> bool:
    """Whether ``value`` is transformers' ``ContinuousBatchingConfig`` (a dataclass of that name)."""
    return dataclasses.is_dataclass(value) and type(value).__name__ == "ContinuousBatchingConfig"


def _check_compile_values(name: str, arguments: dict[str, Any]) -> None:
    """``torch.compile`` arguments' values, checked now (else the start, or the first step,
    fails on them in torch's words, or in words that blame the model)."""
    for key, kinds, what in (
        ("fullgraph", (bool,), "a bool"),
        ("dynamic", (bool, type(None)), "a bool or None"),
        ("disable", (bool,), "a bool"),
        ("options", (dict, type(None)), "a dict or None"),
    ):
        if key in arguments and not isinstance(arguments[key], kinds):
            raise InvalidConfigError(f"{name}'s {key} must be {what}, got {arguments[key]!r}")
    if arguments.get("fullgraph"):
        raise InvalidConfigError(
            f"{name}'s fullgraph must be false: aiocb's paged attention runs outside the compiled graph "
            "(its per-step metadata is Python), so a model's forward pass is never one whole graph"
        )
    backend = arguments.get("backend")
    if backend is not None and not isinstance(backend, str) and not callable(backend):
        raise InvalidConfigError(f"{name}'s backend must be a backend's name or a callable, got {backend!r}")
    mode = arguments.get("mode")
    if mode is not None:
        from torch._inductor import list_mode_options

        modes = list_mode_options()
        if mode not in modes:
            raise InvalidConfigError(f"{name}'s mode must be one of {', '.join(modes)}, got {mode!r}")
    if isinstance(backend, str):
        from torch._dynamo import list_backends

        known = list_backends(exclude_tags=())
        if backend not in known:
            raise InvalidConfigError(f"{name}'s backend must be one of {', '.join(known)}, got {backend!r}")


@functools.cache
def _compile_arguments() -> frozenset[str]:
    """The keyword arguments of ``torch.compile`` (besides the model)."""
    import torch

    return frozenset(inspect.signature(torch.compile).parameters) - {"model"}


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(ContinuousBatchingConfig))


def as_config(value: Any, generation_config: Any = None) -> ContinuousBatchingConfig:
    """The :class:`ContinuousBatchingConfig` a manager runs with, from what it was given.

    aiocb's own; transformers' ``ContinuousBatchingConfig``, whose fields aiocb's has under
    the same names (copied, then checked as a new config); or, when none is given, one that
    ``generation_config`` carries as ``continuous_batching_config`` (deprecated in
    transformers, which still honours it with a warning), else the defaults. Anything else
    is refused with :class:`InvalidConfigError` naming its type.
    """
    if value is None:
        carried = getattr(generation_config, "continuous_batching_config", None)
        if carried is None:
            return ContinuousBatchingConfig()
        if not isinstance(carried, ContinuousBatchingConfig) and not _is_transformers_config(carried):
            # (transformers passes over it too: what a GenerationConfig read from JSON holds)
            logger.warning(
                "the GenerationConfig's continuous_batching_config is a %s, not a ContinuousBatchingConfig: ignored",
                type(carried).__name__,
            )
            return ContinuousBatchingConfig()
        logger.warning(
            "passing a ContinuousBatchingConfig through GenerationConfig is deprecated: "
            "pass it as continuous_batching_config"
        )
        value = carried
    if isinstance(value, ContinuousBatchingConfig):
        return value
    if _is_transformers_config(value):
        fields = {f.name for f in dataclasses.fields(value)}
        unknown = sorted(fields - _FIELD_NAMES)
        if unknown:
            raise InvalidConfigError(f"transformers' ContinuousBatchingConfig has fields aiocb lacks: {unknown}")
        return ContinuousBatchingConfig(**{name: getattr(value, name) for name in fields})
    raise InvalidConfigError(
        "continuous_batching_config must be an aiocb.ContinuousBatchingConfig (or transformers'), "
        f"got {type(value).__name__}"
    )


_dataclass_init = ContinuousBatchingConfig.__init__


def _checked_init(self: ContinuousBatchingConfig, *args: Any, **kwargs: Any) -> None:
    # A misspelt field would otherwise surface as a bare TypeError about __init__.
    unknown = sorted(set(kwargs) - _FIELD_NAMES)
    if unknown:
        raise InvalidConfigError(
            f"unknown ContinuousBatchingConfig field(s): {', '.join(unknown)}; "
            f"known fields: {', '.join(sorted(_FIELD_NAMES))}"
        )
    _dataclass_init(self, *args, **kwargs)


ContinuousBatchingConfig.__init__ = _checked_init  # type: ignore[method-assign]


#: the fields that must be a bool (or may be None too) ...
_BOOLS = (
    "allow_block_sharing",
    "return_logprobs",
    "auto_switch_to_flash",
    "per_request_processors",
    "drop_unsupported_processors",
    "disable_nccl_graph_mixing",
)
_OPTIONAL_BOOLS = ("use_async_batching", "use_default_compile_configs")
#: ... and a finite number (or may be None too), before their ranges are checked
_NUMBERS = ("cpu_offload_space_safety_threshold",)
_OPTIONAL_NUMBERS = (
    "max_memory_percent",
    "safety_margin",
    "cpu_offload_space",
    "cpu_group_timeout",
    "grammar_compile_timeout",
)


def _check_bool(value: object, name: str) -> None:
    if not isinstance(value, bool):
        raise InvalidConfigError(f"{name} must be True or False, got {value!r}")


def _check_number(value: object, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidConfigError(f"{name} must be a finite number, got {value!r}")


def _check_int(value: object, name: str, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidConfigError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise InvalidConfigError(f"{name} must be >= {minimum}, got {value}")


def _check_optional_int(value: object, name: str, *, minimum: int) -> None:
    if value is not None:
        _check_int(value, name, minimum=minimum)
