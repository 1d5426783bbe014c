"""Per-request sampling, seeds and logprobs through the public API."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from transformers import GenerationConfig, PreTrainedModel

import aiocb
from aiocb.runner.memory import MIN_SCORED_ROWS, scored_rows
from tests.conftest import random_prompts, reference_generate

PROMPTS = random_prompts(8, 5, 80, seed=5)


async def test_per_request_parameters_apply_independently_in_one_step(qwen3: PreTrainedModel) -> None:
    reference = reference_generate(qwen3, PROMPTS[0], 20)
    async with aiocb.Manager(qwen3) as manager:
        hot = manager.generate(PROMPTS[0], max_new_tokens=20, temperature=2.5, top_k=0, seed=1)
        top1 = manager.generate(PROMPTS[0], max_new_tokens=20, temperature=1.0, top_k=1, seed=2)
        greedy = manager.generate(PROMPTS[0], max_new_tokens=20)
        hot_out, top1_out, greedy_out = await asyncio.gather(hot, top1, greedy)
        assert manager.statistics().steps <= 21, "the three requests shared their steps"
    assert top1_out.generated_tokens == reference
    assert greedy_out.generated_tokens == reference
    assert hot_out.generated_tokens != reference


async def test_same_seed_gives_same_tokens_whatever_the_neighbours(qwen3: PreTrainedModel) -> None:
    params = {"max_new_tokens": 24, "temperature": 1.0, "top_p": 0.9, "top_k": 40, "seed": 1234}
    async with aiocb.Manager(qwen3) as manager:
        alone = await manager.generate(PROMPTS[1], **params)
        neighbours = [
            manager.generate(p, max_new_tokens=30, temperature=0.5 + i / 4, seed=i) for i, p in enumerate(PROMPTS)
        ]
        crowded, *_ = await asyncio.gather(manager.generate(PROMPTS[1], **params), *neighbours)
        other_seed = await manager.generate(PROMPTS[1], **{**params, "seed": 99})
    assert crowded.generated_tokens == alone.generated_tokens
    assert other_seed.generated_tokens != alone.generated_tokens


async def test_unseeded_requests_are_reproducible_with_the_config_seed(qwen3: PreTrainedModel) -> None:
    config = aiocb.ContinuousBatchingConfig(seed=7)

    async def run() -> list[list[int]]:
        async with aiocb.Manager(qwen3, continuous_batching_config=config) as manager:
            outs = await manager.generate_batch(PROMPTS[:3], max_new_tokens=10, temperature=1.0)
        return [o.generated_tokens for o in outs.values()]

    assert await run() == await run()


async def test_logprobs_match_log_softmax_of_the_model(qwen3: PreTrainedModel) -> None:
    async with aiocb.Manager(qwen3) as manager:
        outputs = await asyncio.gather(
            manager.generate(PROMPTS[2], max_new_tokens=12, return_logprobs=True),
            manager.generate(PROMPTS[3], max_new_tokens=12, return_logprobs=True, temperature=0.7, seed=3),
        )
    for prompt, output in zip(PROMPTS[2:4], outputs, strict=True):
        assert output.logprobs is not None and len(output.logprobs) == 12
        sequence = prompt + output.generated_tokens
        with torch.no_grad():
            logits = qwen3(torch.tensor([sequence])).logits[0]
        expected = logits.log_softmax(-1)[len(prompt) - 1 : -1].gather(
            1, torch.tensor(output.generated_tokens)[:, None]
        )
        assert torch.allclose(torch.tensor(output.logprobs), expected[:, 0], atol=1e-4)


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "speculating"])
async def test_processed_logprobs_are_of_the_distribution_drawn_from(qwen3: PreTrainedModel, speculate: bool) -> None:
    """``logprobs_mode="processed"``: transformers' logits processors (penalty, temperature,
    top-k, top-p, min-p; top-h, typical-p, epsilon and eta cutoffs) applied to the model's
    logits, then a log-softmax; a greedy row's are of its penalised logits (a row sampled
    with top-k 1, drawn greedily, has top-k 1's: 0 for its token); raw rows in the same
    steps keep the model's own."""
    from transformers import (
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    sampled = {"temperature": 0.7, "top_k": 20, "top_p": 0.9, "min_p": 0.05, "seed": 5}
    rare = {"temperature": 1.3, "top_h": 0.9, "typical_p": 0.8, "epsilon_cutoff": 1e-4, "eta_cutoff": 3e-3, "seed": 6}
    cases = [
        {**sampled, "repetition_penalty": 1.3, "logprobs_mode": "processed"},
        {"repetition_penalty": 1.3, "logprobs_mode": "processed"},
        {**sampled, "repetition_penalty": 1.3},
        {**rare, "repetition_penalty": 1.3, "logprobs_mode": "processed"},
        {"temperature": 0.5, "top_k": 1, "seed": 7, "repetition_penalty": 1.3, "logprobs_mode": "processed"},
    ]
    speculative = aiocb.SpeculativeConfig(prompt_lookup_min=1, disable_by_batch_size=None) if speculate else None
    async with aiocb.Manager(qwen3, speculative_config=speculative) as manager:
        outputs = await asyncio.gather(
            *(manager.generate(PROMPTS[i], max_new_tokens=10, return_logprobs=True, **c) for i, c in enumerate(cases))
        )
    for i, (case, output) in enumerate(zip(cases, outputs, strict=True)):
        prompt, processors = PROMPTS[i], [RepetitionPenaltyLogitsProcessor(1.3)]
        if case.get("logprobs_mode") != "processed":
            processors = []
        elif "top_h" in case:  # (and top-k 50, the default, as generate sets it)
            given = {k: v for k, v in case.items() if k in rare and k != "seed"}
            config = GenerationConfig(**given, top_k=50, do_sample=True)
            processors += list(qwen3._get_logits_processor(generation_config=config, device="cpu"))
        elif case.get("top_k") == 1:  # (drawn greedily; its distribution is top-k 1's)
            processors += [TemperatureLogitsWarper(0.5), TopKLogitsWarper(1)]
        elif "temperature" in case:
            processors += [TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), TopPLogitsWarper(0.9)]
            processors.append(MinPLogitsWarper(0.05))
        sequence = prompt + output.generated_tokens
        with torch.no_grad():
            logits = qwen3(torch.tensor([sequence])).logits[0]
        expected = []
        for j, token in enumerate(output.generated_tokens):
            history = torch.tensor([sequence[: len(prompt) + j]])
            scores = logits[len(prompt) + j - 1][None].clone()
            for processor in processors:
                scores = processor(history, scores)
            expected.append(float(scores.log_softmax(-1)[0, token]))
        assert output.logprobs is not None
        assert all(math.isfinite(e) for e in expected), "a token drawn outside the filtered set"
        assert torch.allclose(torch.tensor(output.logprobs), torch.tensor(expected), atol=1e-4), case


async def test_processed_logprobs_leave_the_prompt_logprobs_the_models(qwen3: PreTrainedModel) -> None:
    """No prompt token is drawn: its logprob is of the model's distribution whatever the
    mode, while the generated tokens' follow the temperature they were drawn with."""
    prompt = PROMPTS[1]
    async with aiocb.Manager(qwen3) as manager:
        output = await manager.generate(
            prompt,
            max_new_tokens=3,
            return_logprobs=True,
            prompt_logprobs=True,
            logprobs_mode="processed",
            temperature=0.5,
            seed=2,
        )
    sequence = prompt + output.generated_tokens
    with torch.no_grad():
        logits = qwen3(torch.tensor([sequence])).logits[0]
    targets = torch.tensor(sequence[1:])[:, None]
    raw = logits.log_softmax(-1)[:-1].gather(1, targets)[:, 0]
    drawn = logits / 0.5  # (and top-k 50, the default: the drawn tokens are within it)
    drawn = drawn.masked_fill(drawn < drawn.topk(50).values[:, -1:], float("-inf"))
    drawn = drawn.log_softmax(-1)[:-1].gather(1, targets)[:, 0]
    assert output.prompt_logprobs is not None and output.logprobs is not None
    assert torch.allclose(torch.tensor(output.prompt_logprobs[1:]), raw[: len(prompt) - 1], atol=1e-4)
    assert torch.allclose(torch.tensor(output.logprobs), drawn[len(prompt) - 1 :], atol=1e-4)


async def test_logprobs_are_absent_unless_asked(qwen3: PreTrainedModel) -> None:
    async with aiocb.Manager(qwen3) as manager:
        plain = await manager.generate(PROMPTS[0], max_new_tokens=3)
    assert plain.logprobs is None
    config = aiocb.ContinuousBatchingConfig(return_logprobs=True)
    async with aiocb.Manager(qwen3, continuous_batching_config=config) as manager:
        with_config = await manager.generate(PROMPTS[0], max_new_tokens=3)
    assert with_config.logprobs is not None and len(with_config.logprobs) == 3


@pytest.mark.parametrize("max_rows", [None, 3], ids=["one-score", "scored-in-chunks-of-3-rows"])
async def test_top_logprobs_and_prompt_logprobs(qwen3: PreTrainedModel, max_rows: int | None) -> None:
    prompt = PROMPTS[4]
    # (a step's scored prompt positions are scored max_requests_per_batch rows at a time)
    config = aiocb.ContinuousBatchingConfig(max_batch_tokens=32, max_requests_per_batch=max_rows)
    async with aiocb.Manager(qwen3, continuous_batching_config=config) as m:
        # A long prompt chunked over several steps still scores every prompt token once.
        output = await m.generate(prompt, max_new_tokens=5, top_logprobs=3, prompt_logprobs=True)
    sequence = prompt + output.generated_tokens
    with torch.no_grad():
        logprobs = qwen3(torch.tensor([sequence])).logits[0].log_softmax(-1)
    assert output.prompt_logprobs is not None and output.prompt_top_logprobs is not None
    assert len(output.prompt_logprobs) == len(prompt) and output.prompt_logprobs[0] is None
    expected_prompt = logprobs[: len(prompt) - 1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor(output.prompt_logprobs[1:]), expected_prompt, atol=1e-4)
    for j in range(1, len(prompt)):
        top = output.prompt_top_logprobs[j]
        assert top is not None and len(top) == 3
        assert set(top) == set(logprobs[j - 1].topk(3).indices.tolist())
    assert output.top_logprobs is not None and len(output.top_logprobs) == 5
    for i, (token, top) in enumerate(zip(output.generated_tokens, output.top_logprobs, strict=True)):
        position = len(prompt) - 1 + i
        assert max(top, key=top.__getitem__) == token  # greedy: the pick is the best
        assert abs(top[token] - float(logprobs[position, token])) < 1e-4
    assert output.logprobs is not None and len(output.logprobs) == 5


async def test_a_long_scored_prompt_is_scored_over_several_steps(qwen3: PreTrainedModel) -> None:
    assert scored_rows(8) == MIN_SCORED_ROWS == 512
    prompt = random_prompts(1, 1200, 1200, seed=9)[0]
    # A step scores at most scored_rows() prompt positions (the logits the cache planner has
    # room for), however many tokens it may compute; float32 log-softmaxes are taken 8
    # rows (max_requests_per_batch) at a time.
    config = aiocb.ContinuousBatchingConfig(max_batch_tokens=2048, max_requests_per_batch=8)
    async with aiocb.Manager(qwen3, continuous_batching_config=config) as m:
        scored = await m.generate(prompt, max_new_tokens=1, prompt_logprobs=True)
        scored_steps = m.statistics().steps
        await m.generate(prompt, max_new_tokens=1)
        plain_steps = m.statistics().steps - scored_steps
    assert (scored_steps, plain_steps) == (3, 1)  # positions 0-1198 in 512, 512 and 175, then 1 step
    with torch.no_grad():
        logprobs = qwen3(torch.tensor([prompt])).logits[0].log_softmax(-1)
    expected = logprobs[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert scored.prompt_logprobs is not None
    assert torch.allclose(torch.tensor(scored.prompt_logprobs[1:]), expected, atol=1e-4)


async def test_a_top_k_past_the_vocabulary_keeps_every_token(qwen3: PreTrainedModel) -> None:
    """However large (beyond int64 too), a top-k of the vocabulary or more is no filter,
    as 0 is; it never reaches the device as a number it cannot hold."""
    prompts = random_prompts(2, 5, 10, seed=41)
    vocab = qwen3.config.vocab_size
    async with aiocb.Manager(qwen3) as manager:
        unfiltered = await manager.generate(prompts[0], max_new_tokens=8, top_k=0, temperature=1.0, seed=3)
        for top_k in (vocab, 2**63, 10**30):
            huge, mate = await asyncio.gather(
                manager.generate(prompts[0], max_new_tokens=8, top_k=top_k, temperature=1.0, seed=3),
                manager.generate(prompts[1], max_new_tokens=8),
            )
            assert huge.generated_tokens == unfiltered.generated_tokens
            assert mate.generated_tokens == reference_generate(qwen3, prompts[1], 8)


async def test_a_temperature_past_float32_is_refused(qwen3: PreTrainedModel) -> None:
    async with aiocb.Manager(qwen3) as manager:
        with pytest.raises(aiocb.InvalidRequestError, match="temperature must be at most") as caught:
            await manager.generate([1, 2, 3], max_new_tokens=2, temperature=1e39)
        assert caught.value.param == "temperature"
        output = await manager.generate([1, 2, 3], max_new_tokens=2, temperature=1e38, seed=1)
        assert len(output.generated_tokens) == 2


async def test_prompt_top_logprobs_hold_the_requests_own_count_whatever_shares_the_step(
    qwen3: PreTrainedModel,
) -> None:
    prompts = random_prompts(2, 8, 8, seed=3)
    async with aiocb.Manager(qwen3) as manager:
        mine, other, plain = await asyncio.gather(
            manager.generate(prompts[0], max_new_tokens=2, prompt_logprobs=True, top_logprobs=2),
            manager.generate(prompts[1], max_new_tokens=2, prompt_logprobs=True, top_logprobs=5),
            manager.generate(prompts[1], max_new_tokens=2, prompt_logprobs=True),
        )
    for output, count in ((mine, 2), (other, 5)):
        assert output.prompt_top_logprobs is not None
        assert {len(top) for top in output.prompt_top_logprobs[1:] if top is not None} == {count}
    assert not any(plain.prompt_top_logprobs or [])  # (none asked for)


async def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(qwen3: PreTrainedModel) -> None:
    """vLLM's ``truncate_prompt_tokens``: the request is the prompt's last k tokens, in its
    outputs and its prompt logprobs too; -1 keeps the model's context length."""
    prompt = random_prompts(1, 60, 60, seed=61)[0]
    async with aiocb.Manager(qwen3) as manager:
        cut = await manager.generate(prompt, max_new_tokens=6, truncate_prompt_tokens=20, prompt_logprobs=True)
        whole = await manager.generate(prompt, max_new_tokens=6, truncate_prompt_tokens=600)
        assert qwen3.config.max_position_embeddings == 2048
        long = [7] * 2100
        with pytest.raises(aiocb.InvalidRequestError, match=r"prompt \(2048 tokens\) plus max_new_tokens \(4\)"):
            await manager.generate(long, max_new_tokens=4, truncate_prompt_tokens=-1)
        ends = await manager.generate(long, max_new_tokens=4, truncate_prompt_tokens=2044)
        with pytest.raises(aiocb.InvalidRequestError, match=r"truncate_prompt_tokens \(2049\) is more than"):
            await manager.generate(prompt, max_new_tokens=4, truncate_prompt_tokens=2049)
    assert cut.prompt_ids == prompt[-20:]
    assert cut.generated_tokens == reference_generate(qwen3, prompt[-20:], 6)
    assert cut.prompt_logprobs is not None and len(cut.prompt_logprobs) == 20
    assert whole.prompt_ids == prompt and whole.generated_tokens == reference_generate(qwen3, prompt, 6)
    assert ends.prompt_ids == long[-2044:] and len(ends.generated_tokens) == 4
