"""``generate_batch``: the blocking convenience over :class:`~aiocb.Manager`."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from aiocb.config import ContinuousBatchingConfig
from aiocb.engine.manager import Manager
from aiocb.outputs import GenerationOutput
from aiocb.params import SamplingParams
from aiocb.prompts import Prompt
from aiocb.speculative import SpeculativeConfig


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
    **params: Any,
) -> dict[str, GenerationOutput]:
    """Generate for every prompt and block until all are done.

    Returns ``{request_id: output}`` in input order, with ids ``req_0``, ``req_1``, ...
    ``sampling_params`` and the request parameters given as keywords (``temperature``,
    ``seed``, ``stop``, ...) apply to every prompt. With a ``tokenizer``, prompts may be
    texts or chat messages and outputs carry ``text``. ``speculative_config`` makes requests
    speculate (:class:`~aiocb.SpeculativeConfig`). It runs
    its own event loop, so it cannot be called from async code: there, use
    ``await manager.generate_batch(inputs)``.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise RuntimeError(
            "aiocb.generate_batch() blocks, so it cannot run inside a running event loop; "
            "use `await manager.generate_batch(inputs)` on an aiocb.Manager instead"
        )
    if not inputs:
        return {}

    async def run() -> dict[str, GenerationOutput]:
        manager = Manager(
            model,
            generation_config,
            continuous_batching_config,
            tokenizer=tokenizer,
            num_requests_hint=len(inputs),
            speculative_config=speculative_config,
        )
        async with manager:
            return await manager.generate_batch(
                inputs, max_new_tokens, progress=progress, sampling_params=sampling_params, **params
            )

    return asyncio.run(run())
