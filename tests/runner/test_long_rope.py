"""A longrope model (Phi-3's long-context ones) runs to its full context: each token takes
the frequencies ``model.generate`` gives it in its own request (the long ones for every
token of a prompt past the original length, and for each token generated past it), whatever
shares its passes: chunked prefill, preemption, prefix hits, decode graphs; a plain call of
the model while a manager holds it keeps transformers' own choice."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import PreTrainedModel

import aiocb
from aiocb.runner.backends import Backend
from tests.conftest import random_prompts, reference_generate, tiny_llama

ORIGINAL = 32
ROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "original_max_position_embeddings": ORIGINAL,
    "factor": 4.0,
    "short_factor": [1.0] * 8,
    "long_factor": [1.0 + i for i in range(8)],  # (far from the short ones: other tokens)
}
#: prompts within the original length (the first two cross it as they generate), one of
#: exactly that length, and prompts past it
PROMPTS = [
    *random_prompts(3, 20, 30, seed=5),
    random_prompts(1, ORIGINAL, ORIGINAL, seed=7)[0],
    *random_prompts(3, 33, 70),
]
NEW = 16


@pytest.fixture(scope="module")
def model() -> PreTrainedModel:
    return tiny_llama(max_position_embeddings=4 * ORIGINAL, rope_parameters=ROPE)


async def _generate(
    model: PreTrainedModel, prompts: list[list[int]], max_new_tokens: int = NEW, **config: Any
) -> list[list[int]]:
    batching = aiocb.ContinuousBatchingConfig(page_size=16, **config)
    async with aiocb.Manager(model, continuous_batching_config=batching) as manager:
        outputs = await manager.generate_batch(prompts, max_new_tokens=max_new_tokens)
    return [output.generated_tokens for output in outputs.values()]


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"max_batch_tokens": 24},  # (long prompts prefilled a chunk at a time, below the length first)
        {"num_blocks": 10, "max_batch_tokens": 40},  # (preempted, and computed again)
    ],
    ids=["together", "chunked", "preempted"],
)
@pytest.mark.parametrize("backend", [Backend.CPU, Backend.REFERENCE])
async def test_each_request_equals_generate_whatever_shares_its_passes(
    model: PreTrainedModel, config: dict[str, Any], backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIOCB_ATTENTION_BACKEND", backend)
    expected = [reference_generate(model, prompt, NEW) for prompt in PROMPTS]
    assert len({tuple(e) for e in expected}) == len(expected)
    assert await _generate(model, PROMPTS, **config) == expected


async def test_the_long_frequencies_make_other_tokens(model: PreTrainedModel) -> None:
    """(The test above would not notice a request given the wrong frequencies otherwise.)"""
    short = tiny_llama(max_position_embeddings=4 * ORIGINAL, rope_parameters={**ROPE, "long_factor": [1.0] * 8})
    prompt = PROMPTS[-1]
    assert reference_generate(short, prompt, NEW) != reference_generate(model, prompt, NEW)


async def test_prefix_blocks_of_short_and_long_prompts_are_kept_apart(model: PreTrainedModel) -> None:
    """A short prompt's keys have the short frequencies, a long prompt's the long ones: the
    same tokens' blocks are not shared between them, but are between long prompts."""
    prefix = random_prompts(1, 2 * 16, 2 * 16, seed=11)[0]
    short, long, longer = prefix[:-2], [*prefix, *range(1, 9)], [*prefix, *range(20, 40)]
    config = aiocb.ContinuousBatchingConfig(page_size=16)
    async with aiocb.Manager(model, continuous_batching_config=config) as manager:
        got = []
        for prompt in (short, long, longer):
            output = await manager.generate_batch([prompt], max_new_tokens=NEW)
            got.append(next(iter(output.values())).generated_tokens)
            hits = manager.statistics().prefix_hit_tokens
            if prompt is long:
                assert hits == 0, "the long prompt took the short one's blocks"
        assert manager.statistics().prefix_hit_tokens == 2 * 16, "the longer prompt took the long one's"
    assert got == [reference_generate(model, prompt, NEW) for prompt in (short, long, longer)]


async def test_decode_graphs_take_the_long_frequencies_by_position(
    model: PreTrainedModel, graphs_on_cpu: list[int]
) -> None:
    """Graphs replay decode steps (every token's choice follows from its position); steps
    with tokens of a long prompt within the original length run eagerly."""
    prompts = [PROMPTS[1], PROMPTS[-1][:40]]  # (30 tokens, crossing the length as it generates; 40)
    config = {"max_batch_tokens": 24, "decode_compile_config": {"disable": True}}
    outputs = await _generate(model, prompts, max_new_tokens=6, **config)
    assert outputs == [reference_generate(model, p, 6) for p in prompts]
    assert graphs_on_cpu, "decode steps replayed graphs"


async def test_the_model_called_while_held_keeps_its_own_choice(model: PreTrainedModel) -> None:
    prompt = PROMPTS[-1]
    expected = reference_generate(model, prompt, NEW)
    async with aiocb.Manager(model, continuous_batching_config=aiocb.ContinuousBatchingConfig(page_size=16)):
        with torch.no_grad():
            held = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False)
    assert held[0, len(prompt) :].tolist() == expected


def test_a_rotary_embedding_computed_otherwise_is_refused(model: PreTrainedModel) -> None:
    class Scaled(type(model.model.rotary_emb)):  # type: ignore[misc]
        def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            cos, sin = super().forward(x, position_ids)
            return 2 * cos, 2 * sin

    odd = tiny_llama(max_position_embeddings=4 * ORIGINAL, rope_parameters=ROPE)
    odd.model.rotary_emb.__class__ = Scaled
    with pytest.raises(aiocb.InvalidConfigError, match="computes its longrope embedding otherwise"):
        aiocb.generate_batch(odd, [[5, 6, 7]], max_new_tokens=2)
