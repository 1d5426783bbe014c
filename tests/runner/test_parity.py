"""Greedy outputs equal `model.generate` token for token, under every scheduling regime."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import PreTrainedModel

import aiocb
from aiocb.runner import inputs
from tests.conftest import MAX_NEW_TOKENS, MODELS, random_prompts, reference_generate

PROMPTS = random_prompts(32, 1, 300, seed=1)

CONFIGS: dict[str, dict[str, object]] = {
    "default": {},
    "chunked_prefill": {"max_batch_tokens": 64},
    "preemption": {"page_size": 16, "num_blocks": 40},
    "prefill_first": {"scheduler_type": "prefill_first", "max_batch_tokens": 96, "page_size": 32},
    "fifo_small_cache": {"scheduler_type": "fifo", "page_size": 16, "num_blocks": 80, "max_batch_tokens": 100},
    # Async batching runs the same pipeline on CPU: step N+1 is planned and launched
    # before step N's tokens reach the host, its decode inputs taken from N's output.
    "async_batching": {"use_async_batching": True, "max_batch_tokens": 128},
    "async_preemption": {"use_async_batching": True, "page_size": 16, "num_blocks": 40, "max_batch_tokens": 96},
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def case(request: pytest.FixtureRequest) -> tuple[PreTrainedModel, list[list[int]]]:
    model = MODELS[request.param]()
    return model, [reference_generate(model, p, MAX_NEW_TOKENS) for p in PROMPTS]


@pytest.mark.parametrize("config_name", sorted(CONFIGS))
def test_generate_batch_matches_generate(case: tuple[PreTrainedModel, list[list[int]]], config_name: str) -> None:
    model, references = case
    config = aiocb.ContinuousBatchingConfig(**CONFIGS[config_name])  # type: ignore[arg-type]
    outputs = aiocb.generate_batch(model, PROMPTS, continuous_batching_config=config, max_new_tokens=MAX_NEW_TOKENS)
    assert list(outputs) == [f"req_{i}" for i in range(len(PROMPTS))]
    for i, output in enumerate(outputs.values()):
        assert output.prompt_ids == PROMPTS[i]
        assert output.status is aiocb.RequestStatus.FINISHED
        assert output.generated_tokens == references[i], f"prompt {i} (length {len(PROMPTS[i])})"


@pytest.mark.parametrize("scheduler_type", ["fifo", "prefill_first"])
async def test_streams_match_generate_under_preemption(
    case: tuple[PreTrainedModel, list[list[int]]], scheduler_type: str
) -> None:
    model, references = case
    config = aiocb.ContinuousBatchingConfig(
        page_size=16,
        num_blocks=40,
        max_batch_tokens=128,
        scheduler_type=scheduler_type,  # type: ignore[arg-type]
    )
    async with aiocb.Manager(model, continuous_batching_config=config) as manager:
        ids = [await manager.add_request(p, max_new_tokens=MAX_NEW_TOKENS) for p in PROMPTS]
        for rid, reference in zip(ids, references, strict=True):
            chunks = [chunk async for chunk in manager.stream(rid)]
            assert chunks[-1].status is aiocb.RequestStatus.FINISHED
            assert all(not c.is_finished() for c in chunks[:-1])
            assert chunks[-1].generated_tokens == reference
            # Every chunk extends the previous one.
            for before, after in itertools.pairwise(chunks):
                assert after.generated_tokens[: len(before.generated_tokens)] == before.generated_tokens
        stats = manager.statistics()
        assert stats.preemptions > 0, "the cache was sized so that requests must be preempted"
        assert stats.free_blocks == stats.total_blocks


@pytest.mark.parametrize("chunk_bytes", [4096, 1 << 16], ids=["row_by_row", "a_few_rows"])
def test_decode_rows_attended_in_batches_match_generate(
    case: tuple[PreTrainedModel, list[list[int]]], chunk_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CPU, single-token rows are attended in batches small enough to stay in the
    processor's cache, sorted by length; shrink the batches so that every step has many."""
    model, references = case
    monkeypatch.setenv("AIOCB_ATTENTION_BACKEND", "reference")  # (the cpu backend reads keys in place)
    monkeypatch.setattr(inputs, "_CPU_DECODE_CHUNK_BYTES", chunk_bytes)
    batches: list[int] = []
    split = inputs._decode_chunks

    def counting(lengths: torch.Tensor, max_slots: int | None) -> list[torch.Tensor | None]:
        chunks = split(lengths, max_slots)
        batches.append(len(chunks))
        return chunks

    monkeypatch.setattr(inputs, "_decode_chunks", counting)
    config = aiocb.ContinuousBatchingConfig(max_batch_tokens=512)
    outputs = aiocb.generate_batch(model, PROMPTS, continuous_batching_config=config, max_new_tokens=MAX_NEW_TOKENS)
    assert [o.generated_tokens for o in outputs.values()] == references
    assert max(batches) > 4
