"""A longrope model (Phi-3's long-context ones) runs to its full context: each token takes
the setting ``model.generate`` gives it in its own request (the long one for every token
of a prompt past the original length, and for each token generated past it; Phi-3 and
PhiMoE compute a sequence again, all long, once it passes the length), whatever shares its
passes: chunked prefill, preemption, offloading, prefix hits, speculation, decode graphs;
a plain call of the model while a manager holds it (or two managers) keeps transformers'
own choice."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest
import torch
from transformers import (
    Phi3Config,
    Phi3ForCausalLM,
    PhimoeConfig,
    PhimoeForCausalLM,
    PreTrainedModel,
)
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

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


#: a tiny model's sizes, with the longrope scaling
_SIZES = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4 * ORIGINAL,
    "original_max_position_embeddings": ORIGINAL,
    "initializer_range": 0.3,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": 0,
}


@pytest.fixture(scope="module")
def model() -> PreTrainedModel:
    return tiny_llama(max_position_embeddings=4 * ORIGINAL, rope_parameters=ROPE)


def tiny_phi3() -> PreTrainedModel:
    torch.manual_seed(0)
    return Phi3ForCausalLM(Phi3Config(**_SIZES, rope_parameters=ROPE)).eval()


def tiny_phimoe() -> PreTrainedModel:
    """PhiMoE's longrope switches its scale alone (its frequencies are the short ones)."""
    torch.manual_seed(0)
    rope = {**ROPE, "short_mscale": 1.0, "long_mscale": 1.5}
    config = PhimoeConfig(**_SIZES, rope_parameters=rope, num_local_experts=4, num_experts_per_tok=2)
    return PhimoeForCausalLM(config).eval()


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
    config = {"max_batch_tokens": 24, "max_requests_per_batch": 2, "decode_compile_config": {"disable": True}}
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


async def test_a_rotary_embedding_of_its_own_is_run_as_it_is() -> None:
    """Each setting is the module's own forward's: one that computes otherwise than
    transformers' (here, twice its embedding) is followed too."""

    class Doubled(LlamaRotaryEmbedding):
        def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            cos, sin = super().forward(x, position_ids)
            return 2 * cos, 2 * sin

    model = tiny_llama(max_position_embeddings=4 * ORIGINAL, rope_parameters=ROPE)
    model.model.rotary_emb.__class__ = Doubled
    prompts = [PROMPTS[1], PROMPTS[-1]]
    assert await _generate(model, prompts) == [reference_generate(model, p, NEW) for p in prompts]


@pytest.fixture(scope="module")
def phi3() -> PreTrainedModel:
    return tiny_phi3()


@pytest.mark.parametrize(
    ("config", "speculative"),
    [
        ({}, None),
        ({"max_batch_tokens": 24}, None),
        ({"num_blocks": 10, "max_batch_tokens": 40}, None),  # (preempted, and computed again)
        ({"num_blocks": 10, "max_batch_tokens": 40, "cpu_offload_space": 0.01}, None),  # (offloaded)
        ({}, {"num_speculative_tokens": 4, "prompt_lookup_min": 1}),
        ({}, {"method": "draft", "num_speculative_tokens": 3}),  # (a copy of it: every proposal taken)
    ],
    ids=["together", "chunked", "preempted", "offloaded", "prompt-lookup", "draft"],
)
async def test_phi3_computes_a_sequence_again_once_it_passes_the_length(
    phi3: PreTrainedModel, config: dict[str, Any], speculative: dict[str, Any] | None
) -> None:
    """Phi-3's ``generate`` drops its cache when the sequence passes the original length and
    computes it again all long: the requests that cross it here equal that (proposals stop
    short of it: a pass past it with short keys cached would score them otherwise)."""
    prompts = [*PROMPTS, (PROMPTS[0][:7] * 4)[:28]]  # (and a copy-heavy one, proposed for at once)
    expected = [reference_generate(phi3, prompt, NEW) for prompt in prompts]
    batching = aiocb.ContinuousBatchingConfig(page_size=16, **config)
    draft = {"draft_model": copy.deepcopy(phi3)} if speculative and speculative.get("method") == "draft" else {}
    spec = None if speculative is None else aiocb.SpeculativeConfig(**speculative, **draft)
    async with aiocb.Manager(phi3, continuous_batching_config=batching, speculative_config=spec) as manager:
        outputs = await manager.generate_batch(prompts, max_new_tokens=NEW)
        stats = manager.statistics()
    assert [output.generated_tokens for output in outputs.values()] == expected
    assert stats.recomputed_tokens > 0, "the crossing requests were computed again"
    if draft:  # (the copy's rotary embeddings choose as the target's, token by token)
        assert stats.draft_tokens > 50 and stats.accepted_draft_tokens == stats.draft_tokens


async def test_a_longrope_draft_catches_up_with_each_token_s_setting(phi3: PreTrainedModel) -> None:
    """A draft that slept through long prompts (the batch too large to speculate) computes
    their tokens later with the long setting, as the target did: a copy of the target
    still proposes its tokens."""
    lengths = [NEW + 4 * i for i in range(len(PROMPTS))]  # (the batch shrinks: speculation starts)
    expected = [reference_generate(phi3, prompt, n) for prompt, n in zip(PROMPTS, lengths, strict=True)]
    spec = aiocb.SpeculativeConfig(
        method="draft", num_speculative_tokens=3, draft_model=copy.deepcopy(phi3), disable_by_batch_size=3
    )
    batching = aiocb.ContinuousBatchingConfig(page_size=16, max_batch_tokens=24)
    async with aiocb.Manager(phi3, continuous_batching_config=batching, speculative_config=spec) as manager:
        outputs = await asyncio.gather(
            *(manager.generate(prompt, max_new_tokens=n) for prompt, n in zip(PROMPTS, lengths, strict=True))
        )
        stats = manager.statistics()
    assert [output.generated_tokens for output in outputs] == expected
    assert stats.draft_tokens > 5 and stats.accepted_draft_tokens == stats.draft_tokens


async def test_phi3_s_crossed_sequences_share_blocks_with_long_prompts_only(phi3: PreTrainedModel) -> None:
    """A request computed again past the length holds long keys: a long prompt of its
    tokens finds its blocks; a short request's blocks stay short."""
    short = PROMPTS[1]  # (30 tokens: crosses the length as it generates)
    async with aiocb.Manager(phi3, continuous_batching_config=aiocb.ContinuousBatchingConfig(page_size=16)) as manager:
        first = await manager.generate_batch([short], max_new_tokens=NEW)
        sequence = [*short, *next(iter(first.values())).generated_tokens]
        hits = manager.statistics().prefix_hit_tokens
        second = await manager.generate_batch([sequence], max_new_tokens=4)
        assert manager.statistics().prefix_hit_tokens - hits == 16 * ((len(sequence) - 1) // 16)
    assert next(iter(second.values())).generated_tokens == reference_generate(phi3, sequence, 4)


async def test_phimoe_s_scale_is_chosen_per_request() -> None:
    model = tiny_phimoe()
    prompts = [PROMPTS[0], PROMPTS[-1]]
    assert await _generate(model, prompts) == [reference_generate(model, p, NEW) for p in prompts]


async def test_two_managers_hold_the_model_until_the_last_lets_go(model: PreTrainedModel) -> None:
    rotary = model.model.rotary_emb
    batching = aiocb.ContinuousBatchingConfig(page_size=16)
    async with aiocb.Manager(model, continuous_batching_config=batching) as first:
        async with aiocb.Manager(model, continuous_batching_config=batching):
            pass
        outputs = await first.generate_batch(PROMPTS[-2:], max_new_tokens=NEW)
        assert [o.generated_tokens for o in outputs.values()] == [
            reference_generate(model, p, NEW) for p in PROMPTS[-2:]
        ]
    assert "forward" not in vars(rotary), "the rotary embedding has its own forward back"


async def test_a_copy_of_the_held_model_is_a_model_of_its_own() -> None:
    """A copy made while a manager holds the model (a draft made of it, say) runs on its
    own weights and buffers, and is left as transformers made it once its own manager ends."""
    model = tiny_llama(max_position_embeddings=4 * ORIGINAL, rope_parameters=ROPE)
    prompt = PROMPTS[0]  # (short, crossing the length as it generates)
    async with aiocb.Manager(model, continuous_batching_config=aiocb.ContinuousBatchingConfig(page_size=16)):
        twin = copy.deepcopy(model)
    assert "forward" not in vars(model.model.rotary_emb)
    with torch.no_grad():
        # (another model now: were the copy to run on the original's buffers, nothing would change)
        twin.model.rotary_emb.original_inv_freq.mul_(2.0)
    expected = reference_generate(twin, prompt, NEW)
    assert expected != reference_generate(model, prompt, NEW)
    assert await _generate(twin, [prompt]) == [expected]
    assert "forward" not in vars(twin.model.rotary_emb), "the copy is left as transformers made it"


async def test_a_longrope_config_without_a_rotary_module_named_so_is_refused() -> None:
    model = tiny_llama(max_position_embeddings=4 * ORIGINAL, rope_parameters=ROPE)
    model.model.rotary_emb.rope_type = "custom"  # (as a model's own rotary class would be)
    with pytest.raises(aiocb.InvalidConfigError, match="none of its modules is a rotary embedding"):
        await _generate(model, [[5, 6, 7]])
