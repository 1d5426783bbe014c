"""EOS ids, stop tokens and max_new_tokens, each from its source."""

from __future__ import annotations

import copy

import pytest
from transformers import GenerationConfig, PreTrainedModel

import aiocb
from tests.conftest import random_prompts, reference_generate, tiny_llama

PROMPT = random_prompts(1, 30, 30, seed=6)[0]


def _stop_token(model: PreTrainedModel, index: int = 5) -> int:
    """A token greedy decoding produces at `index` (and not before) of PROMPT's continuation."""
    tokens = reference_generate(model, PROMPT, 20)
    candidates = [t for i, t in enumerate(tokens) if i >= index and t not in tokens[:i]]
    return candidates[0]


async def test_eos_from_generation_config_int_and_list(qwen3: PreTrainedModel) -> None:
    eos = _stop_token(qwen3)
    expected = reference_generate(qwen3, PROMPT, 20, eos_token_id=eos)
    assert expected[-1] == eos and len(expected) < 20
    for value in (eos, [511, eos]):
        generation_config = GenerationConfig(eos_token_id=value, max_new_tokens=20)
        async with aiocb.Manager(qwen3, generation_config=generation_config) as manager:
            output = await manager.generate(PROMPT)
        assert output.generated_tokens == expected
        assert output.finish_reason is aiocb.FinishReason.STOP


async def test_eos_falls_back_to_the_model_config() -> None:
    plain = tiny_llama(seed=2)
    eos = _stop_token(plain)
    model = tiny_llama(seed=2, eos_token_id=eos)
    expected = reference_generate(plain, PROMPT, 20, eos_token_id=eos)
    async with aiocb.Manager(model, generation_config=GenerationConfig()) as manager:
        output = await manager.generate(PROMPT, max_new_tokens=20)
    assert output.generated_tokens == expected
    assert output.finish_reason is aiocb.FinishReason.STOP


async def test_per_request_stop_tokens_and_eos_override(qwen3: PreTrainedModel) -> None:
    stop = _stop_token(qwen3, index=3)
    expected = reference_generate(qwen3, PROMPT, 20, eos_token_id=stop)
    async with aiocb.Manager(qwen3) as manager:
        by_stop = await manager.generate(PROMPT, max_new_tokens=20, stop_token_ids=[stop])
        by_eos = await manager.generate(PROMPT, max_new_tokens=20, eos_token_id=stop)
        neither = await manager.generate(PROMPT, max_new_tokens=20)
    assert by_stop.generated_tokens == expected == by_eos.generated_tokens
    assert neither.generated_tokens == reference_generate(qwen3, PROMPT, 20)
    assert neither.finish_reason is aiocb.FinishReason.LENGTH


async def test_max_new_tokens_global_and_per_request(qwen3: PreTrainedModel) -> None:
    generation_config = copy.deepcopy(qwen3.generation_config)
    generation_config.max_new_tokens = 7
    async with aiocb.Manager(qwen3, generation_config=generation_config) as manager:
        default = await manager.generate(PROMPT)
        override = await manager.generate(PROMPT, max_new_tokens=3)
    assert len(default.generated_tokens) == 7 and len(override.generated_tokens) == 3
    assert default.generated_tokens[:3] == override.generated_tokens
    assert default.finish_reason is aiocb.FinishReason.LENGTH


async def test_generation_stops_at_the_model_context_length() -> None:
    model = tiny_llama(max_position_embeddings=40)
    async with aiocb.Manager(model) as manager:
        output = await manager.generate(PROMPT, max_new_tokens=10)
        assert len(PROMPT) + len(output.generated_tokens) <= 40
        with pytest.raises(aiocb.InvalidRequestError, match="context length"):
            await manager.generate(PROMPT, max_new_tokens=11)
