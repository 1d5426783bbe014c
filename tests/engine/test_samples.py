"""``n`` samples of one prompt: the prompt computed (and scored) once, each sample forked from it.

A forked sample shares the prompt's full blocks and gets a copy of the partial last one;
its tokens must equal those of a request of its own with the same seed, whatever the
schedule (chunked prompts, preemption, async batching) and the model's attention
(full, sliding window, hybrid).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import GenerationConfig, PreTrainedModel

import aiocb
from tests.conftest import random_prompts, reference_generate, tiny_qwen3
from tests.runner.test_memory_features import _gemma3, _mistral

PROMPT = random_prompts(1, 45, 45, seed=51)[0]
NEW = 12
SAMPLED = {"temperature": 1.0, "top_k": 0, "seed": 5}


async def test_n_samples_compute_the_prompt_once(qwen3: PreTrainedModel) -> None:
    config = aiocb.ContinuousBatchingConfig(page_size=16)
    async with aiocb.Manager(qwen3, continuous_batching_config=config) as manager:
        before = manager.statistics()
        samples = await manager.generate(PROMPT, n=8, max_new_tokens=NEW, **SAMPLED)
        after = manager.statistics()
        alone = [await manager.generate(PROMPT, max_new_tokens=NEW, **{**SAMPLED, "seed": 5 + i}) for i in range(8)]
    assert [s.request_id for s in samples] == ["req_0"] + [f"req_0__child#{i}" for i in range(7)]
    # The parent computes the prompt but its last token; every sample computes that one, then decodes.
    assert after.tokens_computed - before.tokens_computed == (len(PROMPT) - 1) + 8 + 8 * (NEW - 1)
    assert after.prefix_hit_tokens - before.prefix_hit_tokens == 7 * (len(PROMPT) - 1)
    assert [s.num_cached_tokens for s in samples] == [0] + [len(PROMPT) - 1] * 7
    assert len({tuple(s.generated_tokens) for s in samples}) > 4, "the samples should differ"
    for i, (sample, own) in enumerate(zip(samples, alone, strict=True)):
        assert sample.generated_tokens == own.generated_tokens, f"sample {i} (seed {5 + i})"
    assert after.free_blocks == after.total_blocks


SCHEDULES: dict[str, dict[str, Any]] = {
    "chunked_prompt": {"page_size": 16, "max_batch_tokens": 20},
    "preemption": {"page_size": 16, "num_blocks": 14, "max_batch_tokens": 64},
    "async_batching": {"page_size": 16, "use_async_batching": True},
    "aligned_page": {"page_size": 11},  # the parent stops at 44 tokens: exactly four full blocks
}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("factory", [tiny_qwen3, _mistral, _gemma3], ids=["qwen3", "mistral", "gemma3"])
async def test_forked_samples_equal_requests_of_their_own(schedule: str, factory: Any) -> None:
    model = factory()
    config = aiocb.ContinuousBatchingConfig(**SCHEDULES[schedule])
    async with aiocb.Manager(model, continuous_batching_config=config) as manager:
        samples = await manager.generate(PROMPT, n=4, max_new_tokens=NEW, **SAMPLED)
        greedy = await manager.generate(PROMPT, n=3, max_new_tokens=NEW)
        stats = manager.statistics()
    async with aiocb.Manager(model, continuous_batching_config=config) as manager:
        alone = [await manager.generate(PROMPT, max_new_tokens=NEW, **{**SAMPLED, "seed": 5 + i}) for i in range(4)]
    for i, (sample, own) in enumerate(zip(samples, alone, strict=True)):
        assert sample.generated_tokens == own.generated_tokens, f"sample {i}"
    reference = reference_generate(model, PROMPT, NEW)
    assert [g.generated_tokens for g in greedy] == [reference] * 3
    assert stats.free_blocks == stats.total_blocks


def test_generate_batch_with_num_return_sequences_names_children_like_transformers(qwen3: PreTrainedModel) -> None:
    prompts = random_prompts(2, 10, 30, seed=53)
    gen = GenerationConfig(num_return_sequences=3, do_sample=True, max_new_tokens=6)
    outputs = aiocb.generate_batch(qwen3, prompts, gen, seed=9)
    assert list(outputs) == [
        "req_0__child#0",
        "req_0__child#1",
        "req_0",
        "req_1__child#0",
        "req_1__child#1",
        "req_1",
    ]
    assert all(len(o.generated_tokens) == 6 for o in outputs.values())


async def test_samples_stream_and_cancel_on_their_own(qwen3: PreTrainedModel) -> None:
    async with aiocb.Manager(qwen3) as manager:
        rid = await manager.add_request(PROMPT, max_new_tokens=NEW, n=3, **SAMPLED)
        assert manager.cancel_request(f"{rid}__child#0")  # while it waits for the fork
        child = f"{rid}__child#1"
        chunks = [chunk async for chunk in manager.stream(child)]
        outputs = {}
        while len(outputs) < 2:
            output = await manager.get_result()
            assert output is not None
            outputs[output.request_id] = output
        stats = manager.statistics()
    assert chunks[-1].request_id == child and len(chunks[-1].generated_tokens) == NEW
    assert outputs[rid].status is aiocb.RequestStatus.FINISHED and len(outputs[rid].generated_tokens) == NEW
    cancelled = outputs[f"{rid}__child#0"]
    assert cancelled.finish_reason is aiocb.FinishReason.CANCELLED and not cancelled.generated_tokens
    assert stats.free_blocks == stats.total_blocks


async def test_n_is_checked(qwen3: PreTrainedModel) -> None:
    async with aiocb.Manager(qwen3) as manager:
        with pytest.raises(aiocb.InvalidRequestError, match="n must be >= 1"):
            await manager.generate(PROMPT, n=0)
        await manager.add_request(PROMPT, request_id="x__child#0", max_new_tokens=2)
        with pytest.raises(aiocb.InvalidRequestError, match="x__child#0"):
            await manager.add_request(PROMPT, request_id="x", n=2, max_new_tokens=2)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
async def test_samples_scoring_their_prompt_share_the_parents_score(qwen3: PreTrainedModel, schedule: str) -> None:
    """With ``prompt_logprobs``, the prompt is still computed (and scored) once: every
    sample gets the parent's scores, which the steps in flight at the fork may still be
    recording (async batching, a prompt chunked over steps), and its own tokens."""
    config = aiocb.ContinuousBatchingConfig(**SCHEDULES[schedule])
    scoring = {"prompt_logprobs": True, "top_logprobs": 3}
    async with aiocb.Manager(qwen3, continuous_batching_config=config) as manager:
        before = manager.statistics()
        samples = await manager.generate(PROMPT, n=4, max_new_tokens=NEW, **scoring, **SAMPLED)
        after = manager.statistics()
        alone = [
            await manager.generate(PROMPT, max_new_tokens=NEW, **scoring, **{**SAMPLED, "seed": 5 + i})
            for i in range(4)
        ]
    if schedule != "preemption":  # (a preempted sample computes its prompt again)
        assert after.tokens_computed - before.tokens_computed == (len(PROMPT) - 1) + 4 * NEW
    with torch.no_grad():
        logprobs = qwen3(torch.tensor([PROMPT])).logits[0].log_softmax(-1)
    expected = logprobs[:-1].gather(1, torch.tensor(PROMPT[1:])[:, None])[:, 0]
    for i, (sample, own) in enumerate(zip(samples, alone, strict=True)):
        assert sample.generated_tokens == own.generated_tokens, f"sample {i}"
        assert sample.prompt_logprobs is not None and sample.prompt_top_logprobs is not None
        assert sample.prompt_logprobs[0] is None and sample.prompt_top_logprobs[0] is None
        assert torch.allclose(torch.tensor(sample.prompt_logprobs[1:]), expected, atol=1e-4), f"sample {i}"
        assert sample.prompt_logprobs == samples[0].prompt_logprobs
        assert sample.prompt_top_logprobs == samples[0].prompt_top_logprobs
        assert [list(top) for top in sample.prompt_top_logprobs[1:]] == logprobs[:-1].topk(3).indices.tolist()
    assert after.free_blocks == after.total_blocks
