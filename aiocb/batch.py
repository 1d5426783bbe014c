"""``generate_batch``: the blocking convenience over :class:`~aiocb.Manager`."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from aiocb.config import ContinuousBatchingConfig, WorkloadHints, as_config
from aiocb.engine.manager import Manager
from aiocb.errors import InvalidConfigError, InvalidRequestError
from aiocb.outputs import GenerationOutput
from aiocb.params import SamplingParams, check_sampling_params
from aiocb.prompts import Prompt, check_prompt_list
from aiocb.runner.distributed import follow_call, return_to_followers, tensor_parallel_layout
from aiocb.sampling import merged_generation_config
from aiocb.speculative import SpeculativeConfig

logger = logging.getLogger(__name__)


def generate_batch(
    model: PreTrainedModel,
    inputs: Sequence[Prompt],
    generation_config: GenerationConfig | None = None,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    progress: bool = False,
    max_new_tokens: int | None = None,
    sampling_params: SamplingParams | None = None,
    speculative_config: SpeculativeConfig | None = None,
    record_timestamps: bool = False,
    progress_bar: bool | None = None,
    persistent_manager: bool = False,
    warmup: bool = True,
    **params: Any,
) -> dict[str, GenerationOutput]:
    """Generate for every prompt and block until all are done.

    Returns ``{request_id: output}`` in input order, with ids ``req_<k>`` from the manager's
    counter (``req_0``, ``req_1``, ... for a new manager; a ``persistent_manager`` keeps
    counting); with ``n`` > 1 each prompt's samples (``<id>__child#<i>``) come before it.
    ``sampling_params`` and the request parameters given as keywords (``temperature``,
    ``seed``, ``stop``, ...) apply to every prompt. With a ``tokenizer``, prompts may be
    texts or chat messages and outputs carry ``text``. ``speculative_config`` makes requests
    speculate (:class:`~aiocb.SpeculativeConfig`). It runs
    its own event loop, so it cannot be called from async code: there, use
    ``await manager.generate_batch(inputs)``.

    transformers' own arguments are taken too: ``record_timestamps`` (each output's
    ``timestamps``), ``progress_bar`` (``progress``), ``persistent_manager`` (the manager and
    its cache are kept on the model for the next call) and ``warmup`` (aiocb always warms
    up, capturing its CUDA graphs before the first step: ``False`` is refused).

    Under tensor parallelism call it on every rank with the same arguments, as with
    transformers: rank 0 runs the manager, the other ranks follow its steps inside the
    same call, and every rank returns rank 0's outputs (or raises its exception). Ranks
    whose prompts, configs or parameters differ from rank 0's raise
    :class:`~aiocb.InvalidRequestError`; only rank 0 shows ``progress``. Rank 0 may also
    call it alone while the other ranks run :func:`aiocb.distributed.run_follower`: they
    follow its steps and go on following until :func:`aiocb.distributed.shutdown`.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        in_loop = False
    else:
        in_loop = True
    layout = tensor_parallel_layout(model)
    if in_loop and (layout is None or not layout.is_driver):  # rank 0 tells its followers first
        raise _in_a_loop()
    # (a one-shot iterable read once: the same for the fingerprint, the checks and the run)
    params = {name: tuple(value) if isinstance(value, Iterator) else value for name, value in params.items()}
    fingerprint = "" if layout is None else _fingerprint(
        inputs,
        generation_config,
        continuous_batching_config,
        tokenizer is not None,
        max_new_tokens,
        sampling_params,
        speculative_config,
        record_timestamps,
        persistent_manager,
        warmup,
        params,
    )  # fmt: skip
    if layout is not None and not layout.is_driver:
        # A follower checks nothing itself: rank 0 checks the same arguments and sends what it
        # raised (a follower refusing on its own would leave the ranks' calls out of step).
        followed: dict[str, GenerationOutput] = follow_call(
            model, _config_or_default(model, continuous_batching_config, generation_config), fingerprint
        )
        return followed

    def run() -> dict[str, GenerationOutput]:
        nonlocal progress
        if in_loop:
            raise _in_a_loop()
        if warmup is not True:
            raise InvalidRequestError(
                f"warmup={warmup!r}: aiocb always captures its CUDA graphs before the first step (none lands in a "
                "request's time); leave warmup out",
                param="warmup",
            )
        if progress_bar is not None:
            if progress and not progress_bar:
                raise InvalidRequestError(
                    "progress=True and progress_bar=False contradict each other", param="progress"
                )
            progress = progress_bar  # (transformers' name for it)
        if record_timestamps is not False:  # (checked as any request parameter)
            params["record_timestamps"] = record_timestamps
        check_prompt_list(inputs)
        _check_types(generation_config, sampling_params)  # (before the hints read them)
        if len(inputs) == 0:  # (nothing to run: what would have run it is checked all the same)
            as_config(continuous_batching_config, generation_config or model.generation_config)
            (sampling_params or SamplingParams()).updated(max_new_tokens=max_new_tokens, **params)
            return {}

        async def generate() -> dict[str, GenerationOutput]:
            # (a kept manager keeps the sizes it was built with: these prompts' hints are
            # for a new one, and given to a kept one they would only be warned of)
            reused = persistent_manager and Manager.persistent_manager_of(model) is not None
            manager = Manager(
                model,
                generation_config,
                continuous_batching_config,
                tokenizer=tokenizer,
                speculative_config=speculative_config,
                persistent_manager=persistent_manager,
                workload_hints=None
                if reused
                else _workload_hints(model, inputs, generation_config, max_new_tokens, sampling_params, params),
            )
            async with manager:
                return await manager.generate_batch(
                    inputs, max_new_tokens, progress=progress, sampling_params=sampling_params, **params
                )

        return asyncio.run(generate())

    if layout is None:
        return run()
    timeout = _config_or_default(model, continuous_batching_config, generation_config).cpu_group_timeout
    try:
        outputs = run()
    except BaseException as exc:
        try:
            return_to_followers(layout, timeout, None, exc, fingerprint)
        except Exception as send_failure:  # rank 0's own error is the one to raise
            logger.warning("could not tell the follower ranks that generate_batch() failed: %s", send_failure)
        raise
    return_to_followers(layout, timeout, outputs, None, fingerprint)
    return outputs


def _config_or_default(
    model: PreTrainedModel,
    continuous_batching_config: ContinuousBatchingConfig | None,
    generation_config: GenerationConfig | None,
) -> ContinuousBatchingConfig:
    """The config a call runs with (for its ``cpu_group_timeout``), or the default one where
    what was given is refused (the refusal is the call's to raise, on rank 0)."""
    carrier = generation_config if isinstance(generation_config, GenerationConfig) else model.generation_config
    try:
        return as_config(continuous_batching_config, carrier)
    except InvalidRequestError:
        return ContinuousBatchingConfig()


def _check_types(generation_config: GenerationConfig | None, sampling_params: SamplingParams | None) -> None:
    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise InvalidConfigError(
            f"generation_config must be a transformers GenerationConfig, got {type(generation_config).__name__}"
        )
    check_sampling_params(sampling_params)


def _workload_hints(
    model: PreTrainedModel,
    inputs: Sequence[Any],
    generation_config: GenerationConfig | None,
    max_new_tokens: int | None,
    sampling_params: SamplingParams | None,
    params: Mapping[str, Any],
) -> WorkloadHints:
    """The batch's requests as transformers counts them (every sample of every prompt), its
    longest prompt where every prompt is token ids (a text's length is known once it is
    tokenized), and the most tokens a request generates where it says (a value a request
    refuses says nothing: the request says why)."""
    num_requests = len(inputs) * _samples_per_prompt(model, generation_config, sampling_params, params)
    longest = 0
    for prompt in inputs:
        if isinstance(prompt, torch.Tensor):
            length = prompt.shape[-1] if prompt.dim() else 0
        elif isinstance(prompt, str) or not isinstance(prompt, Sequence) or (prompt and isinstance(prompt[0], Mapping)):
            return WorkloadHints(num_requests=num_requests)  # (text, or chat messages)
        else:
            length = len(prompt)
        longest = max(longest, length)
    if max_new_tokens is None and sampling_params is not None:
        max_new_tokens = sampling_params.max_new_tokens
    if max_new_tokens is None:
        max_new_tokens = merged_generation_config(model, generation_config).max_new_tokens
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        return WorkloadHints(num_requests=num_requests)
    return WorkloadHints(longest, max_new_tokens, num_requests)


def _samples_per_prompt(
    model: PreTrainedModel,
    generation_config: GenerationConfig | None,
    sampling_params: SamplingParams | None,
    params: Mapping[str, Any],
) -> int:
    """The ``n`` the requests will have (1 where it is not a valid count: the request says why)."""
    n = params.get("n")
    if n is None and sampling_params is not None:
        n = sampling_params.n
    if n is None:
        n = merged_generation_config(model, generation_config).num_return_sequences
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1


def _in_a_loop() -> RuntimeError:
    return RuntimeError(
        "aiocb.generate_batch() blocks, so it cannot run inside a running event loop; "
        "use `await manager.generate_batch(inputs)` on an aiocb.Manager instead"
    )


def _fingerprint(*arguments: Any) -> str:
    """A digest of ``generate_batch``'s arguments, to check that every rank passed the same."""
    digest = hashlib.sha256()
    for argument in arguments:
        digest.update(repr(_canonical(argument)).encode())
    return digest.hexdigest()


def _canonical(value: Any) -> Any:
    """``value`` in a form whose ``repr`` is the same in every process for equal values:
    sets sorted (string hashing differs between processes), mappings by key, tensors by
    their bytes, dataclasses by their fields."""
    if isinstance(value, GenerationConfig):
        return value.to_json_string(use_diff=True)
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu().contiguous()
        return (
            "tensor",
            str(data.dtype),
            tuple(data.shape),
            hashlib.sha256(data.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest(),
        )
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        return (type(value).__name__, _canonical(fields))
    if isinstance(value, Mapping):
        return tuple(sorted((repr(_canonical(k)), _canonical(v)) for k, v in value.items()))
    if isinstance(value, set | frozenset):
        return ("set", tuple(sorted(repr(_canonical(v)) for v in value)))
    if isinstance(value, list | tuple):
        return tuple(_canonical(v) for v in value)
    if isinstance(value, np.ndarray | np.generic) and value.dtype != object:
        # (by their bytes, as tensors: a long array's repr leaves out its middle)
        array = np.ascontiguousarray(value)
        return ("array", str(array.dtype), array.shape, hashlib.sha256(array.tobytes()).hexdigest())
    if isinstance(value, np.ndarray):  # (of objects: by what they are)
        return ("array", value.shape, _canonical(value.tolist()))
    if isinstance(value, str | bytes | int | float | complex | bool | None):
        return value
    # (another object's repr may name its address, which differs between processes)
    return _ADDRESS.sub("", repr(value))


#: An object's address in a default repr (``<Foo object at 0x7f...>``).
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
