"""Architectures whose attention aiocb cannot route through its paged cache are refused,
naming them, never run over no cache; gpt-oss's attention sinks are honoured by every
attention backend (longrope models: ``test_long_rope.py``)."""

from __future__ import annotations

import inspect
import re
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

import aiocb
from aiocb.runner import attention
from tests.conftest import random_prompts, reference_generate, tiny_llama

#: Tiny sizes under every name the configs below give them.
_SIZES: dict[str, object] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "n_embd": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "n_layer": 2,
    "num_attention_heads": 4,
    "n_head": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "n_positions": 256,
    "rotary_dim": 8,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "initializer_range": 0.3,  # (weights spread enough that greedy outputs differ from token to token)
    "pad_token_id": 0,
    "eos_token_id": None,
    "bos_token_id": None,
}


def tiny(model_type: str, **overrides: object) -> PreTrainedModel:
    """A 2-layer model of ``model_type`` with seeded random weights."""
    config_class = type(AutoConfig.for_model(model_type))
    accepted = set(inspect.signature(config_class.__init__).parameters)
    config = config_class(**{**{k: v for k, v in _SIZES.items() if k in accepted}, **overrides})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


async def _generate(model: PreTrainedModel, prompts: list[list[int]], **config: Any) -> list[list[int]]:
    batching = aiocb.ContinuousBatchingConfig(page_size=16, **config)
    async with aiocb.Manager(model, continuous_batching_config=batching) as manager:
        outputs = await manager.generate_batch(prompts, max_new_tokens=8)
    return [output.generated_tokens for output in outputs.values()]


@pytest.mark.parametrize(
    ("model_type", "message"),
    [
        ("mamba", "MambaForCausalLM has no attention layout"),
        ("llama", r"LlamaForCausalLM has no layers \(num_hidden_layers=0\)"),
    ],
)
async def test_a_model_whose_attention_cannot_use_the_paged_cache_is_refused_at_start(
    model_type: str, message: str
) -> None:
    model = tiny(model_type, num_hidden_layers=0) if model_type == "llama" else tiny(model_type)
    with pytest.raises(aiocb.InvalidConfigError, match=message):
        await _generate(model, [[5, 6, 7]])


@pytest.mark.parametrize(
    ("model_type", "message"),
    [
        # (their attention is their own: GPT-J's ran over no cache, silently; Bloom's failed on aiocb's inputs)
        ("gptj", r"GPTJForCausalLM's attention does not go through .*\(none of its 2 layers called it\)"),
        (
            "bloom",
            r"BloomForCausalLM's attention does not go through .*its first pass failed before any layer called it: "
            "ValueError",
        ),
        # (its decoder layers call attention without the keyword arguments that carry aiocb's metadata)
        ("stablelm", "StableLmForCausalLM's attention .* was called without the keyword arguments"),
        ("nemotron", "NemotronForCausalLM's attention .* was called without the keyword arguments"),
        ("diffllama", "DiffLlamaForCausalLM's attention .* layer 0 called attention 2 times in one pass"),
        ("jetmoe", r"JetMoeAttention gives keys of 4 heads of 128 \(layer 0\), where its config says 2 of 128"),
    ],
)
async def test_a_model_whose_first_pass_misses_the_paged_cache_is_refused_naming_why(
    model_type: str, message: str
) -> None:
    """Their attention goes through the interface, but not as aiocb's cache needs it: the
    first pass finds it (each of these ran over no cache, or wrote one layer's keys twice,
    giving other tokens than ``model.generate`` or a shape error deep in torch)."""
    model = tiny(model_type)
    with pytest.raises(aiocb.EngineDeadError) as caught:
        await _generate(model, [[5, 6, 7]])
    assert isinstance(caught.value.cause, aiocb.InvalidConfigError)
    assert re.search(message, str(caught.value.cause)), str(caught.value.cause)


@pytest.mark.parametrize(
    ("model_type", "overrides"),
    [
        ("gpt2", {}),  # (learned absolute positions, Conv1D projections)
        ("gpt_neox", {"rotary_pct": 0.25}),  # (partial rotary, parallel residual)
        ("phi3", {}),  # (fused qkv)
        ("mixtral", {"sliding_window": 8}),  # (MoE, sliding)
        ("qwen2", {"attention_bias": True}),
        ("opt", {}),
        ("cohere", {}),
        ("granite", {}),
    ],
)
async def test_other_architectures_match_generate(model_type: str, overrides: dict[str, object]) -> None:
    """Greedy outputs equal ``model.generate``'s, with chunked prefill and preemption."""
    model = tiny(model_type, **overrides)
    prompts = random_prompts(4, 3, 40, seed=7)
    expected = [reference_generate(model, p, 8) for p in prompts]
    assert await _generate(model, prompts, num_blocks=8, max_batch_tokens=32) == expected


def tiny_gpt_oss(**overrides: object) -> PreTrainedModel:
    """A 2-layer gpt-oss (a sliding-window layer of 8, a full one), its attention sinks drawn
    wide enough that greedy outputs change when they are left out."""
    return tiny_with_sinks("gpt_oss", sliding_window=8, **overrides)


def tiny_with_sinks(model_type: str, **overrides: object) -> PreTrainedModel:
    """A 2-layer model of ``model_type``, whose attention has sinks, drawn wide enough that
    greedy outputs change when they are left out."""
    model = tiny(model_type, **overrides)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), torch.Tensor):
                module.sinks.normal_(0.0, 2.0, generator=torch.Generator().manual_seed(module.layer_idx))
    return model


@pytest.mark.parametrize("backend", ["cpu", "reference", "triton", "triton-graphs"])
async def test_gpt_oss_attention_sinks_match_generate(
    backend: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """Greedy outputs equal ``model.generate``'s, with chunked prefill and preemption, in
    each backend: the C kernels, torch ops (a chunk's scores a slice of queries at a time),
    the Triton kernel (interpreted on the CPU), and it in decode graphs."""
    captured: list[int] | None = None
    if backend == "triton-graphs":
        captured = request.getfixturevalue("graphs_on_cpu")
    else:
        if backend == "triton":
            pytest.importorskip("triton")
        monkeypatch.setenv("AIOCB_ATTENTION_BACKEND", backend)
    if backend == "reference":  # (a chunk's queries a few at a time, as a long chunk's go)
        monkeypatch.setattr(attention, "_MOST_SCORES", 1024)
    model = tiny_gpt_oss()
    prompts = random_prompts(4, 3, 40, seed=7)
    expected = [reference_generate(model, p, 8) for p in prompts]
    # (decode graphs on the CPU run an eager stand-in of the model: compiling it would only take time)
    eager = {"decode_compile_config": {"disable": True}} if backend == "triton-graphs" else {}
    assert await _generate(model, prompts, num_blocks=8, max_batch_tokens=32, **eager) == expected
    assert captured is None or captured, "decode steps replayed graphs"


@pytest.mark.parametrize("model_type", ["granite_swa", "flint"])
async def test_other_models_with_attention_sinks_match_generate(model_type: str) -> None:
    """Granite-SWA's sinks (and a sliding layer), Flint's (kept in float32)."""
    model = tiny_with_sinks(model_type)
    prompts = random_prompts(4, 3, 40, seed=9)
    expected = [reference_generate(model, p, 8) for p in prompts]
    assert await _generate(model, prompts, num_blocks=8, max_batch_tokens=32) == expected


async def test_gpt_oss_rows_sharing_a_long_prefix_count_each_head_s_sink_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference backend reads a prefix every decode row shares once for all of them:
    one softmax spans the prefix, each row's own keys and its head's sink."""
    monkeypatch.setenv("AIOCB_ATTENTION_BACKEND", "reference")
    shared_calls: list[int] = []
    attend = attention._attend_shared_prefix

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        shared_calls.append(1)
        return attend(*args, **kwargs)

    monkeypatch.setattr(attention, "_attend_shared_prefix", counted)
    # (full-attention layers alone: a sliding layer's blocks are never shared)
    model = tiny_gpt_oss(layer_types=["full_attention"] * 2, max_position_embeddings=512)
    prefix = random_prompts(1, 300, 300, seed=3)[0]
    prompts = [prefix + tail for tail in random_prompts(3, 2, 9, seed=4)]
    expected = [reference_generate(model, p, 8) for p in prompts]
    assert await _generate(model, prompts) == expected
    assert shared_calls


async def test_a_model_class_without_source_is_served() -> None:
    """A class defined where transformers cannot read its source (a notebook cell, a REPL),
    whose attention goes through the interface as its base class's does: the first pass
    finds it does (transformers' own check, which reads the source, says it does not)."""
    namespace: dict[str, Any] = {}
    exec("from transformers import LlamaForCausalLM\nclass Mine(LlamaForCausalLM):\n    pass\n", namespace)
    mine = namespace["Mine"]
    # (transformers' check reads the source, and keeps its answer on the class, which a
    # subclass inherits once its base was checked: its answer for a fresh class, whatever
    # this process checked before)
    mine._can_set_attn_implementation = classmethod(lambda cls: False)
    torch.manual_seed(0)
    model = mine(tiny_llama().config).eval()
    prompts = random_prompts(3, 3, 20, seed=2)
    assert await _generate(model, prompts) == [reference_generate(model, p, 8) for p in prompts]
