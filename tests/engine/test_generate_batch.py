"""The blocking aiocb.generate_batch."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel

import aiocb
from tests.conftest import random_prompts, reference_generate

PROMPTS = random_prompts(5, 3, 40, seed=14)


def test_blocking_generate_batch_with_progress_bar(qwen3: PreTrainedModel, capsys: pytest.CaptureFixture[str]) -> None:
    outputs = aiocb.generate_batch(qwen3, PROMPTS, max_new_tokens=4, progress=True)
    assert list(outputs) == [f"req_{i}" for i in range(5)]
    assert [o.generated_tokens for o in outputs.values()] == [reference_generate(qwen3, p, 4) for p in PROMPTS]
    assert "5/5" in capsys.readouterr().err


def test_blocking_generate_batch_of_nothing(qwen3: PreTrainedModel) -> None:
    assert aiocb.generate_batch(qwen3, []) == {}


async def test_blocking_generate_batch_refuses_a_running_loop(qwen3: PreTrainedModel) -> None:
    with pytest.raises(RuntimeError, match=r"await manager\.generate_batch"):
        aiocb.generate_batch(qwen3, PROMPTS)


def test_sampling_parameters_apply_to_every_prompt(qwen3: PreTrainedModel) -> None:
    first = aiocb.generate_batch(qwen3, PROMPTS[:2], max_new_tokens=6, temperature=1.0, seed=5, return_logprobs=True)
    again = aiocb.generate_batch(qwen3, PROMPTS[:2], max_new_tokens=6, temperature=1.0, seed=5, return_logprobs=True)
    assert [o.generated_tokens for o in first.values()] == [o.generated_tokens for o in again.values()]
    assert all(o.logprobs is not None and len(o.logprobs) == 6 for o in first.values())


@pytest.mark.parametrize(
    "samples",
    [{"n": 3}, {"sampling_params": aiocb.SamplingParams(n=3)}, {"generation_config": "num_return_sequences=3"}],
    ids=["keyword", "sampling_params", "generation_config"],
)
def test_batches_are_sized_and_counted_by_samples(
    qwen3: PreTrainedModel,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    samples: dict[str, object],
) -> None:
    """As transformers does: every sample of every prompt is a row the batch may hold,
    and a finished request on the progress bar."""
    from transformers import GenerationConfig

    hints: list[int] = []
    init = aiocb.Manager.__init__

    def spy(self: aiocb.Manager, *args: object, **kwargs: Any) -> None:
        hints.append(kwargs["workload_hints"].num_requests)
        init(self, *args, **kwargs)

    monkeypatch.setattr(aiocb.Manager, "__init__", spy)

    if samples.get("generation_config"):
        samples = {"generation_config": GenerationConfig(num_return_sequences=3, do_sample=True, max_new_tokens=4)}
    config = aiocb.ContinuousBatchingConfig(page_size=16, num_blocks=64)
    outputs = aiocb.generate_batch(
        qwen3, random_prompts(2, 4, 8, seed=3), continuous_batching_config=config, progress=True,
        max_new_tokens=4, temperature=1.0, **samples,  # type: ignore[arg-type]
    )  # fmt: skip
    assert len(outputs) == 6 and hints == [6]
    assert "6/6" in capsys.readouterr().err


def test_the_decode_block_table_is_sized_by_the_batchs_longest_request(qwen3: PreTrainedModel) -> None:
    """As transformers sizes it from ``generate_batch``'s prompts and ``max_new_tokens``:
    an even number of pages, one more than the longest request needs (610 tokens in pages
    of 16: 39, so 40); where the prompts are text, or the config says, not."""
    config = aiocb.ContinuousBatchingConfig(page_size=16, num_blocks=128)

    def width(prompts: list[Any], config: aiocb.ContinuousBatchingConfig, **params: Any) -> int | None:
        aiocb.generate_batch(qwen3, prompts, continuous_batching_config=config, persistent_manager=True, **params)
        manager = aiocb.Manager(qwen3, persistent_manager=True)
        try:
            return manager.continuous_batching_config.max_blocks_per_request
        finally:
            asyncio.run(manager.destroy())

    prompts = random_prompts(2, 100, 600, seed=1)
    assert width(prompts, config, max_new_tokens=10) == 40
    assert width([torch.tensor(p) for p in prompts], config, max_new_tokens=10) == 40
    assert width(prompts, config, sampling_params=aiocb.SamplingParams(max_new_tokens=30)) == 42  # (630 tokens)
    assert width(prompts, config.replace(max_blocks_per_request=7), max_new_tokens=10) == 7


async def test_a_manager_is_sized_by_its_workload_hints(qwen3: PreTrainedModel) -> None:
    """aiocb's ``WorkloadHints`` or transformers': the block table holds the longest request,
    the batch as many requests as come at once; ``num_requests_hint`` says the latter too."""
    from transformers.generation.continuous_batching.utils import WorkloadHints

    config = aiocb.ContinuousBatchingConfig(page_size=16, num_blocks=64)
    for hints in (aiocb.WorkloadHints(100, 20, 3), WorkloadHints(100, 20, 3)):
        async with aiocb.Manager(qwen3, continuous_batching_config=config, workload_hints=hints) as manager:
            resolved = manager.continuous_batching_config
        assert (resolved.max_blocks_per_request, resolved.max_requests_per_batch) == (10, 3)  # (120 tokens: 8 + 1)
    longer = aiocb.WorkloadHints(9000, 9000)  # (no request is longer than the model's 2,048 positions)
    async with aiocb.Manager(qwen3, continuous_batching_config=config, workload_hints=longer) as manager:
        assert manager.continuous_batching_config.max_blocks_per_request == 130  # (128 pages, one more, even)
    async with aiocb.Manager(
        qwen3,
        continuous_batching_config=config,
        workload_hints=aiocb.WorkloadHints(num_requests=3),
        num_requests_hint=5,
    ) as manager:
        resolved = manager.continuous_batching_config
    assert (resolved.max_blocks_per_request, resolved.max_requests_per_batch) == (32, 5)
    assert manager.config.max_blocks_per_request is None  # (the config given is left as it was)
    with pytest.raises(aiocb.InvalidConfigError, match="workload_hints must be a WorkloadHints, got int"):
        aiocb.Manager(qwen3, workload_hints=3)  # type: ignore[arg-type]
    with pytest.raises(aiocb.InvalidConfigError, match=r"WorkloadHints\.num_requests must be >= 0"):
        aiocb.WorkloadHints(num_requests=-1)


def test_transformers_own_arguments(
    qwen3: PreTrainedModel, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """``record_timestamps``, ``progress_bar``, ``persistent_manager`` and ``warmup``, as
    transformers' ``generate_batch`` takes them."""
    outputs = aiocb.generate_batch(qwen3, PROMPTS, max_new_tokens=5, record_timestamps=True, progress_bar=True)
    assert "5/5" in capsys.readouterr().err
    for prompt, output in zip(PROMPTS, outputs.values(), strict=True):
        assert output.generated_tokens == reference_generate(qwen3, prompt, 5)
        stamps = output.timestamps
        assert stamps is not None and len(stamps) == 5 and stamps == sorted(stamps)
        start, end = output.lifespan
        assert output.created_time <= start <= stamps[0] and stamps[-1] <= end
    plain = aiocb.generate_batch(qwen3, PROMPTS[:1], max_new_tokens=2)
    assert plain["req_0"].timestamps is None
    with pytest.raises(aiocb.InvalidRequestError, match="warmup"):
        aiocb.generate_batch(qwen3, PROMPTS, warmup=False)
    # (built with a config of its own: a later call that gives none reuses it as it is)
    config = aiocb.ContinuousBatchingConfig(page_size=16, num_blocks=64)
    kept = aiocb.generate_batch(qwen3, PROMPTS[:2], None, config, max_new_tokens=2, persistent_manager=True)
    manager = aiocb.Manager(qwen3, persistent_manager=True)  # (the one the call kept)
    try:
        assert manager._runner is not None, "its cache was kept"
        again = aiocb.generate_batch(qwen3, PROMPTS[:2], max_new_tokens=2, persistent_manager=True)
        assert [o.generated_tokens for o in again.values()] == [o.generated_tokens for o in kept.values()]
        assert aiocb.Manager(qwen3, persistent_manager=True) is manager
        assert manager.config == config
        with caplog.at_level("WARNING", logger="aiocb"):
            assert aiocb.Manager(qwen3, persistent_manager=True, num_requests_hint=7) is manager
        assert "num_requests_hint=7 is not applied: the model's persistent manager was sized for 2" in caplog.text
        caplog.clear()
        with caplog.at_level("WARNING", logger="aiocb"):
            assert aiocb.Manager(qwen3, persistent_manager=True, workload_hints=aiocb.WorkloadHints(3, 4, 9)) is manager
        assert "workload_hints=WorkloadHints(max_prompt_length=3, max_generated_length=4, num_requests=9) are not " in (
            caplog.text
        )
        with pytest.raises(aiocb.InvalidConfigError, match="workload_hints must be a WorkloadHints, got dict"):
            aiocb.Manager(qwen3, persistent_manager=True, workload_hints={"num_requests": 9})
        # (generate_batch's own hints, from other prompts, are not the caller's to be warned of)
        caplog.clear()
        with caplog.at_level("WARNING", logger="aiocb"):
            aiocb.generate_batch(qwen3, PROMPTS, max_new_tokens=1, persistent_manager=True)
        assert "not applied" not in caplog.text
        with pytest.raises(aiocb.InvalidConfigError, match="num_requests_hint must be an int of at least 1"):
            aiocb.Manager(qwen3, persistent_manager=True, num_requests_hint=-5)
    finally:
        import asyncio

        asyncio.run(manager.destroy())


async def test_timestamps_of_streamed_and_speculated_tokens(qwen3: PreTrainedModel) -> None:
    speculative = aiocb.SpeculativeConfig(prompt_lookup_min=1, disable_by_batch_size=None)
    async with aiocb.Manager(qwen3, speculative_config=speculative) as manager:
        rid = await manager.add_request([5, 6, 7, 5, 6, 7, 5, 6], max_new_tokens=12, record_timestamps=True)
        seen = 0
        async for chunk in manager.stream(rid):
            assert chunk.timestamps is not None and len(chunk.timestamps) == len(chunk.generated_tokens) >= seen
            seen = len(chunk.generated_tokens)
        assert seen == 12 and chunk.finished_time is not None and chunk.timestamps[-1] <= chunk.finished_time


async def test_prompts_that_share_a_prefix_are_queued_together(
    qwen3: PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With block sharing on, a batch's prompts are queued in the order of their first ids
    (so that those sharing a prefix compute it once and hit it at once), whatever order
    they came in; their outputs still come back in the input order."""
    from aiocb.engine.manager import Manager

    shared = {label: [(label * 37 + i) % 400 + 1 for i in range(48)] for label in (1, 2, 3)}
    prompts = [shared[1 + i % 3] + [i + 1] for i in range(12)]
    queued: list[int] = []
    submit = Manager._submit_group

    def recorded(self: Manager, request: Any, **kwargs: Any) -> Any:
        queued.append(request.prompt_ids[0])
        return submit(self, request, **kwargs)

    monkeypatch.setattr(Manager, "_submit_group", recorded)
    async with aiocb.Manager(
        qwen3, continuous_batching_config=aiocb.ContinuousBatchingConfig(allow_block_sharing=True)
    ) as manager:
        outputs = await manager.generate_batch(prompts, max_new_tokens=2)
    runs = [first for i, first in enumerate(queued) if i == 0 or queued[i - 1] != first]
    assert len(runs) == 3, queued  # (each prefix's prompts one after another)
    assert [o.prompt_ids for o in outputs.values()] == prompts
