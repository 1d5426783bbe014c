"""Sizing the paged cache and the step budget from the memory the device has free."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import psutil
import torch

from aiocb.config import (
    DEFAULT_MAX_BATCH_TOKENS,
    DEFAULT_MAX_REQUESTS_PER_BATCH,
    DEFAULT_MEMORY_PERCENT_ACCELERATOR,
    DEFAULT_MEMORY_PERCENT_CPU,
    MIN_AUTO_MAX_BATCH_TOKENS,
    ContinuousBatchingConfig,
)
from aiocb.core.kv_cache import ring_size
from aiocb.runner.model_spec import ModelSpec
from aiocb.speculative import SpeculativeConfig

logger = logging.getLogger(__name__)

#: Share of the budget the per-step buffers may take before max_batch_tokens is lowered.
_MAX_ACTIVATION_SHARE = 0.25
#: Prompt positions a step may score for ``prompt_logprobs`` however few requests it holds
#: (a long prompt scored alone still goes 512 positions a step).
MIN_SCORED_ROWS = 512


def scored_rows(max_requests_per_batch: int) -> int:
    """Prompt positions one step may score: rows of logits the cache plan keeps room for
    beside the sampled rows'."""
    return max(max_requests_per_batch, MIN_SCORED_ROWS)


@dataclass(frozen=True, slots=True)
class CachePlan:
    """The sizes the cache and the scheduler are built with."""

    page_size: int
    #: blocks per cache group, in ``ModelSpec.group_layers()`` order
    num_blocks: list[int]
    max_batch_tokens: int
    max_requests_per_batch: int
    budget_bytes: int
    #: host-memory blocks per cache group for CPU offloading (zeros: off)
    num_host_blocks: list[int]


def free_memory_bytes(device: torch.device) -> int:
    """Memory free for the cache: the device's free memory, or available host RAM on CPU.

    On CUDA that counts what PyTorch's caching allocator holds unused (a destroyed
    manager's cache, say, which the driver does not see as free but the next one reuses)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        held = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free) + max(int(held), 0)
    return host_memory_bytes()


def memory_percent(config: ContinuousBatchingConfig, device: torch.device) -> float:
    """The share of free memory the cache plan takes on ``device``: ``max_memory_percent``,
    else the device kind's default: CUDA's, or the host's wherever the memory counted is the
    host's (:func:`free_memory_bytes`; Apple's MPS shares it too: there transformers takes
    the CPU's share as well, keeping clear of swap)."""
    if config.max_memory_percent is not None:
        return config.max_memory_percent
    return DEFAULT_MEMORY_PERCENT_ACCELERATOR if device.type == "cuda" else DEFAULT_MEMORY_PERCENT_CPU


def host_memory_bytes() -> int:
    """Host memory available now (bytes)."""
    return int(psutil.virtual_memory().available)


def activation_bytes_per_token(spec: ModelSpec) -> int:
    """A generous estimate of the transient memory one query token needs in a forward."""
    width = 6 * spec.hidden_size + 3 * spec.intermediate_size
    width += 2 * (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
    return width * spec.dtype_bytes


def plan_cache(
    spec: ModelSpec,
    config: ContinuousBatchingConfig,
    *,
    num_requests_hint: int | None = None,
    free_bytes: int | None = None,
    extra_bytes_per_block: int = 0,
    speculative: SpeculativeConfig | None = None,
    host_share: int = 1,
) -> CachePlan:
    """Decide ``max_batch_tokens``, ``max_requests_per_batch`` and blocks per cache group.

    ``max_batch_tokens`` and ``num_blocks`` share one budget (``max_memory_percent`` of
    free memory): the step buffers are reserved first, lowering a default
    ``max_batch_tokens`` if they would take more than a quarter of it, but never below
    256; the blocks fill the rest unless ``num_blocks`` is given, which must fit it. Each block of a full
    attention group costs ``extra_bytes_per_block`` more (a draft model's cache, which
    mirrors the target's blocks). With ``speculative``, a step that verifies proposals
    samples ``k + 1`` rows per speculating request: the logits' room counts them.
    ``host_share`` processes plan on this machine's host memory at once (tensor-parallel
    ranks): each takes its share of it, for a cache in host memory (on CPU) and for the
    offloading pool.
    """
    page = config.page_size
    percent = memory_percent(config, spec.device)
    free = free_memory_bytes(spec.device) if free_bytes is None else free_bytes
    if spec.device.type == "cpu":
        free //= host_share
    budget = int(free * percent)

    per_token = activation_bytes_per_token(spec)
    max_batch_tokens = config.max_batch_tokens
    if max_batch_tokens is None:
        affordable = int(budget * _MAX_ACTIVATION_SHARE) // per_token
        max_batch_tokens = max(MIN_AUTO_MAX_BATCH_TOKENS, min(DEFAULT_MAX_BATCH_TOKENS, affordable))

    if config.max_requests_per_batch is not None:
        max_requests = config.max_requests_per_batch
    else:
        max_requests = min(num_requests_hint or DEFAULT_MAX_REQUESTS_PER_BATCH, DEFAULT_MAX_REQUESTS_PER_BATCH)
    max_requests = max(1, min(max_requests, max_batch_tokens))
    if config.num_blocks is not None:
        # (no more requests than blocks, each writing one of its own: the clamp below, made first)
        max_requests = min(max_requests, config.num_blocks)

    # fp32 logits of every sampled row, plus the sampler's noise and sort buffers (and the
    # float32 log-softmax of scored prompt positions, taken that many rows at a time), and
    # the logits of the prompt positions a step may score, in the model's dtype.
    sampled = max_requests
    if speculative is not None:
        assert speculative.num_speculative_tokens is not None
        speculating = min(max_requests, speculative.disable_by_batch_size or max_requests)
        verified = speculating * (speculative.num_speculative_tokens + 1)
        sampled = max(max_requests, min(verified, max_batch_tokens))
    logits_bytes = (3 * sampled * 4 + scored_rows(max_requests) * spec.dtype_bytes) * spec.vocab_size
    graphs_bytes = _graphs_bytes(spec, config, max_requests, per_token)
    remaining = budget - max_batch_tokens * per_token - logits_bytes - graphs_bytes

    groups = spec.group_layers()
    # (a block of each group, a full group's with its extra bytes)
    costs = [
        block + (extra_bytes_per_block if window is None else 0)
        for block, (window, _) in zip(spec.group_block_bytes(page), groups, strict=True)
    ]
    if config.num_blocks is not None:
        num_blocks = [config.num_blocks] * len(groups)
        needed = config.num_blocks * sum(costs)
        if needed > remaining:  # (as transformers checks a given size's footprint)
            raise MemoryError(
                f"num_blocks={config.num_blocks} needs {needed / 2**20:,.1f} MiB of KV cache, more than the "
                f"{max(remaining, 0) / 2**20:,.1f} MiB left of the memory budget ({percent:.0%} of "
                f"{free / 2**20:,.0f} MiB free) after the step buffers ({(budget - remaining) / 2**20:,.1f} MiB for "
                f"max_batch_tokens={max_batch_tokens} and max_requests_per_batch={max_requests}); lower num_blocks "
                "or those, or raise max_memory_percent"
            )
    else:
        num_blocks = _fill_budget(groups, costs, page, max_requests, remaining)
    if min(num_blocks) < 1:
        raise MemoryError(
            f"no room for the KV cache: {budget / 2**30:.2f} GiB budget "
            f"({percent:.0%} of {free / 2**30:.2f} GiB free) is taken by the step buffers; "
            "lower max_batch_tokens or max_requests_per_batch, or raise max_memory_percent"
        )
    max_requests = min(max_requests, min(num_blocks))
    host_blocks = _host_blocks(spec, num_blocks, costs, config, host_share)
    logger.info(
        "KV cache: %s blocks of %d tokens per group, max_batch_tokens=%d, max_requests_per_batch=%d, "
        "host offload blocks %s",
        num_blocks, page, max_batch_tokens, max_requests, host_blocks,
    )  # fmt: skip
    return CachePlan(page, num_blocks, max_batch_tokens, max_requests, budget, host_blocks)


def _graphs_bytes(spec: ModelSpec, config: ContinuousBatchingConfig, max_requests: int, per_token: int) -> int:
    """What decode CUDA graphs keep allocated beside the step buffers (0 where none are
    captured): their private pool, which holds the largest bucket's activations
    (``per_token`` a row) and logits, and the buffer their logits are copied out to."""
    wanted = config.use_cuda_graph
    decode = wanted[1] if isinstance(wanted, tuple) else wanted
    if spec.device.type != "cuda" or decode is False:
        return 0
    return max_requests * (per_token + 2 * spec.vocab_size * spec.dtype_bytes)


def _host_blocks(
    spec: ModelSpec,
    num_blocks: list[int],
    per_block: list[int],
    config: ContinuousBatchingConfig,
    host_share: int = 1,
) -> list[int]:
    """Host blocks per group for CPU offloading, shared out like the device cache (a block
    of each group costing ``per_block``: a draft model's cache, which mirrors the full
    groups' blocks, offloads with them), from this process's share of the host memory."""
    space = config.cpu_offload_space
    device_bytes = sum(n * b for n, b in zip(num_blocks, per_block, strict=True))
    available = host_memory_bytes() // host_share
    if spec.device.type == "cpu":  # (the cache itself is about to take that much of it)
        available = max(available - device_bytes, 0)
    limit = int(available * config.cpu_offload_space_safety_threshold)
    if space is None:
        host_bytes = limit
    else:
        host_bytes = int(space * 2**30)
        if host_bytes > limit:  # (as transformers clamps it: a pool past the host's memory would swap or fail)
            logger.warning(
                "cpu_offload_space=%.1f GiB exceeds %.0f%% of the available host memory (%.1f GiB): "
                "clamped to %.1f GiB",
                space, 100 * config.cpu_offload_space_safety_threshold, available / 2**30, limit / 2**30,
            )  # fmt: skip
            host_bytes = limit
    if host_bytes <= 0:
        return [0] * len(num_blocks)
    return [int(host_bytes * n * b / device_bytes) // b for n, b in zip(num_blocks, per_block, strict=True)]


def _fill_budget(
    groups: list[tuple[int | None, tuple[int, ...]]],
    per_block: list[int],
    page: int,
    max_requests: int,
    remaining: int,
) -> list[int]:
    """Blocks per group filling ``remaining`` bytes. A sliding group needs at most a ring
    per concurrent request; a full group's need grows with the contexts. Every group gets
    the same count of blocks where that leaves the sliding groups less than their rings (as
    transformers' whole-model blocks: then fewer requests hold a window's ring at once),
    and a full group the bytes a sliding group's rings leave beside that. ``per_block``: a
    block's bytes in each group."""
    even = max(remaining, 0) // sum(per_block)
    blocks = [even if window is None else min(ring_size(window, page) * max_requests, even) for window, _ in groups]
    full = [i for i, (window, _) in enumerate(groups) if window is None]
    if full:
        left = remaining - sum(n * b for n, b, (window, _) in zip(blocks, per_block, groups, strict=True) if window)
        per_full_block = sum(per_block[i] for i in full)
        for i in full:
            blocks[i] = left // per_full_block
    return blocks
