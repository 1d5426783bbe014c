"""Speculative decoding (prompt lookup): outputs token for token those of no speculation,
greedy and sampled, under chunked prefill, prefix sharing, preemption and async batching;
proposals that are accepted and rejected; blocks given back; bad configs refused."""

from __future__ import annotations

from typing import Any

import pytest
from transformers import PreTrainedModel

import aiocb
from tests.conftest import MODELS, random_prompts

NEW = 120


def _prompts() -> list[list[int]]:
    # Repeated stretches (copy-heavy) and plain random prompts, of varied lengths.
    base = random_prompts(6, 8, 40, seed=5)
    return [p * 3 for p in base[:3]] + base[3:] + random_prompts(4, 60, 200, seed=6)


PROMPTS = _prompts()
CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "chunked_prefill": {"max_batch_tokens": 48},
    "preemption": {"page_size": 16, "num_blocks": 48, "max_batch_tokens": 96},
    "async_batching": {"use_async_batching": True, "max_batch_tokens": 128},
}


async def _run(
    model: PreTrainedModel, speculative: aiocb.SpeculativeConfig | None, config: dict[str, Any], **params: Any
) -> tuple[list[aiocb.GenerationOutput], aiocb.ManagerStatistics]:
    cb = aiocb.ContinuousBatchingConfig(**config)
    async with aiocb.Manager(model, continuous_batching_config=cb, speculative_config=speculative) as manager:
        outputs = await manager.generate_batch(PROMPTS, max_new_tokens=NEW, **params)
        stats = manager.statistics()
    assert stats.free_blocks == stats.total_blocks, "blocks leaked"
    return list(outputs.values()), stats


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request: pytest.FixtureRequest) -> PreTrainedModel:
    return MODELS[request.param]()


CASES = [(name, "greedy") for name in sorted(CONFIGS)] + [("default", "sampled"), ("async_batching", "sampled")]


@pytest.mark.parametrize(("config_name", "sampling"), CASES)
async def test_outputs_equal_no_speculation(model: PreTrainedModel, config_name: str, sampling: str) -> None:
    params: dict[str, Any] = (
        {"do_sample": False} if sampling == "greedy" else {"temperature": 0.4, "top_k": 50, "seed": 7}
    )
    config = CONFIGS[config_name]
    plain, _ = await _run(model, None, config, **params)
    speculative = aiocb.SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, disable_by_batch_size=None)
    fast, stats = await _run(model, speculative, config, **params)
    for i, (a, b) in enumerate(zip(plain, fast, strict=True)):
        assert b.generated_tokens == a.generated_tokens, f"prompt {i}"
        assert b.finish_reason == a.finish_reason
    assert stats.draft_tokens > stats.accepted_draft_tokens, "some proposals were rejected"
    if sampling == "greedy":  # (sampled at random, these models' outputs hardly repeat)
        assert stats.accepted_draft_tokens > 0, "some proposals were accepted"
    if config_name == "preemption":
        assert stats.preemptions > 0


@pytest.mark.parametrize("draws", [1_000, pytest.param(20_000, marks=pytest.mark.slow)])
async def test_sampled_first_tokens_have_the_same_distribution(draws: int) -> None:
    """The first three tokens of ``draws`` seeded samples (temperature 1) of a copy-heavy
    prompt, with and without speculation: the same tokens seed by seed, so the same
    distribution (total variation 0, against that of two runs with different seeds)."""
    model = MODELS["qwen3"]()
    prompt = random_prompts(3, 8, 20, seed=5)[2] * 3
    config = aiocb.ContinuousBatchingConfig(max_queue_size=0, max_batch_tokens=8192)
    speculative = aiocb.SpeculativeConfig(prompt_lookup_min=1, disable_by_batch_size=None)
    counts = []
    for spec, seed in ((None, 0), (speculative, 0), (None, draws)):
        async with aiocb.Manager(model, continuous_batching_config=config, speculative_config=spec) as manager:
            samples = await manager.generate(prompt, max_new_tokens=4, temperature=1.0, seed=seed, n=draws)
            stats = manager.statistics()
        assert isinstance(samples, list)
        seen: dict[tuple[int, ...], int] = {}
        for sample in samples:
            key = tuple(sample.generated_tokens[:3])
            seen[key] = seen.get(key, 0) + 1
        counts.append(seen)
        if spec is not None:
            assert stats.accepted_draft_tokens > 0, "some samples took proposed tokens"

    def tv(a: dict[tuple[int, ...], int], b: dict[tuple[int, ...], int]) -> float:
        return 0.5 * sum(abs(a.get(k, 0) - b.get(k, 0)) for k in a.keys() | b.keys()) / draws

    plain, fast, other = counts
    assert tv(plain, fast) == 0.0 < tv(plain, other)


async def test_logprobs_stop_tokens_and_lengths_stay_exact(model: PreTrainedModel) -> None:
    plain_stats: list[Any] = []
    runs = []
    for speculative in (None, aiocb.SpeculativeConfig(prompt_lookup_min=1, disable_by_batch_size=None)):
        async with aiocb.Manager(model, speculative_config=speculative) as manager:
            first = await manager.generate(PROMPTS[0], max_new_tokens=NEW, do_sample=False)
            stop = first.generated_tokens[30]  # a token the greedy output makes: it ends there
            outputs = await manager.generate_batch(
                PROMPTS, max_new_tokens=57, do_sample=False, return_logprobs=True, top_logprobs=2, stop_token_ids=[stop]
            )
            runs.append(list(outputs.values()))
            plain_stats.append(manager.statistics())
    for a, b in zip(*runs, strict=True):
        assert b.generated_tokens == a.generated_tokens
        assert len(b.generated_tokens) <= 57
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4)
        assert [list(t) for t in b.top_logprobs or []] == [list(t) for t in a.top_logprobs or []]
        assert b.finish_reason == a.finish_reason
    assert any(o.finish_reason is aiocb.FinishReason.STOP for o in runs[0])
    assert plain_stats[1].accepted_draft_tokens > 0


async def test_streams_and_cancellation_mid_speculation(model: PreTrainedModel) -> None:
    speculative = aiocb.SpeculativeConfig(prompt_lookup_min=1, disable_by_batch_size=None)
    async with aiocb.Manager(model, speculative_config=speculative) as manager:
        reference = await manager.generate(PROMPTS[0], max_new_tokens=NEW, do_sample=False)
        rid = await manager.add_request(PROMPTS[0], max_new_tokens=NEW, do_sample=False)
        seen: list[int] = []
        sizes = []
        async for chunk in manager.stream(rid):
            sizes.append(len(chunk.generated_tokens) - len(seen))
            seen = list(chunk.generated_tokens)
        assert seen == reference.generated_tokens
        doomed = await manager.add_request(PROMPTS[1], max_new_tokens=NEW, do_sample=False)
        async for chunk in manager.stream(doomed):
            if len(chunk.generated_tokens) > 10:
                manager.cancel_request(doomed)
                break
        stats = manager.statistics()
    assert max(sizes) > 1, "a step that accepted proposals delivers several tokens"
    assert stats.free_blocks == stats.total_blocks


def test_generate_batch_takes_a_speculative_config(model: PreTrainedModel) -> None:
    config = aiocb.SpeculativeConfig(prompt_lookup_min=1, disable_by_batch_size=None)
    fast = aiocb.generate_batch(model, PROMPTS[:3], max_new_tokens=40, do_sample=False, speculative_config=config)
    plain = aiocb.generate_batch(model, PROMPTS[:3], max_new_tokens=40, do_sample=False)
    assert [o.generated_tokens for o in fast.values()] == [o.generated_tokens for o in plain.values()]


async def test_a_large_batch_turns_speculation_off(model: PreTrainedModel) -> None:
    config = aiocb.SpeculativeConfig(prompt_lookup_min=1, disable_by_batch_size=2)
    async with aiocb.Manager(model, speculative_config=config) as manager:
        await manager.generate_batch(PROMPTS[:6], max_new_tokens=20, do_sample=False)
        assert manager.statistics().draft_tokens == 0
        await manager.generate(PROMPTS[0], max_new_tokens=60, do_sample=False)
        assert manager.statistics().draft_tokens > 0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"method": "draft"}, "draft model is not supported yet"),
        ({"method": "eagle"}, "speculative method"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"prompt_lookup_min": 5, "prompt_lookup_max": 3}, "prompt_lookup_min"),
        ({"disable_by_batch_size": 0}, "disable_by_batch_size"),
        ({"min_acceptance": 2.0}, "min_acceptance"),
    ],
)
def test_bad_configs_are_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(aiocb.InvalidConfigError, match=message):
        aiocb.SpeculativeConfig(**fields)
    with pytest.raises(aiocb.InvalidConfigError, match="unknown speculative config field"):
        aiocb.SpeculativeConfig.from_dict({"lookahead": 3})


async def test_sliding_window_models_are_refused() -> None:
    sliding = MODELS["qwen3"](use_sliding_window=True, sliding_window=32, max_window_layers=0)
    manager = aiocb.Manager(sliding, speculative_config=aiocb.SpeculativeConfig())
    with pytest.raises(aiocb.InvalidConfigError, match="sliding-window"):
        manager.start()
