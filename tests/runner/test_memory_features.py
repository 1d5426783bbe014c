"""Prefix caching, CPU offloading, sliding-window and hybrid models: parity with generate."""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import logging
import os
import random

import psutil
import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
)

import aiocb
from aiocb.config import DEFAULT_MAX_REQUESTS_PER_BATCH
from aiocb.core.kv_cache import CacheGroup
from aiocb.runner import inputs, memory
from aiocb.runner.paged_cache import zeros
from tests.conftest import _TINY, random_prompts, reference_generate, tiny_qwen3

NEW = 16


def _shared_prefix_prompts() -> list[list[int]]:
    rng = random.Random(21)
    prefix = [rng.randrange(1, 512) for _ in range(200)]
    return [prefix + suffix for suffix in random_prompts(32, 1, 40, seed=22)]


async def _generate(
    model: PreTrainedModel, prompts: list[list[int]], config: aiocb.ContinuousBatchingConfig
) -> tuple[list[list[int]], aiocb.ManagerStatistics, list[CacheGroup]]:
    async with aiocb.Manager(model, continuous_batching_config=config) as manager:
        outputs = await manager.generate_batch(prompts, max_new_tokens=NEW)
        stats = manager.statistics()
        assert stats.free_blocks == stats.total_blocks, "blocks leaked"
        assert stats.running_requests == stats.waiting_requests == 0
        assert manager._steps is not None
        groups = manager._steps.scheduler.kv_cache.groups
    return [o.generated_tokens for o in outputs.values()], stats, groups


@pytest.mark.parametrize("async_batching", [False, True])
async def test_prefix_sharing_matches_generate(qwen3: PreTrainedModel, async_batching: bool) -> None:
    prompts = _shared_prefix_prompts()
    config = aiocb.ContinuousBatchingConfig(page_size=16, use_async_batching=async_batching)
    outputs, stats, _ = await _generate(qwen3, prompts, config)
    assert outputs == [reference_generate(qwen3, p, NEW) for p in prompts]
    # All but the first request reuse the 12 full blocks (192 tokens) of the prefix.
    assert stats.prefix_hit_tokens == 31 * 192
    prefill = sum(len(p) for p in prompts)
    assert stats.tokens_computed - 32 * (NEW - 1) == prefill - stats.prefix_hit_tokens


async def test_prefix_sharing_under_preemption(qwen3: PreTrainedModel) -> None:
    prompts = _shared_prefix_prompts()
    config = aiocb.ContinuousBatchingConfig(page_size=16, num_blocks=48, max_batch_tokens=256)
    outputs, stats, _ = await _generate(qwen3, prompts, config)
    assert outputs == [reference_generate(qwen3, p, NEW) for p in prompts]
    assert stats.preemptions > 0 and stats.prefix_hit_tokens > 0 and stats.recomputed_tokens > 0
    # Every token computed once, but those the cache served (a readmitted request's own
    # blocks given back are neither hits nor computed again), plus those computed again.
    prefill = sum(len(p) for p in prompts)
    assert stats.tokens_computed == prefill + 32 * (NEW - 1) - stats.prefix_hit_tokens + stats.recomputed_tokens


@pytest.mark.parametrize("sharing", [True, False])
async def test_a_readmitted_request_s_own_blocks_are_neither_hits_nor_recomputed(
    qwen3: PreTrainedModel, sharing: bool
) -> None:
    """Prompts that share nothing, preempted and recomputed: the cache gives a readmitted
    request back the full blocks it had computed (prefix caching on), which are not prompt
    tokens the cache served, and not computed again."""
    prompts = random_prompts(12, 40, 100, seed=25)
    config = aiocb.ContinuousBatchingConfig(page_size=16, num_blocks=24, safety_margin=0.0, allow_block_sharing=sharing)
    outputs, stats, _ = await _generate(qwen3, prompts, config)
    assert outputs == [reference_generate(qwen3, p, NEW) for p in prompts]
    assert stats.preemptions > 0 and stats.prefix_hit_tokens == 0
    prefill = sum(len(p) for p in prompts)
    assert stats.recomputed_tokens == stats.tokens_computed - prefill - len(prompts) * (NEW - 1) > 0


async def test_prefix_sharing_off(qwen3: PreTrainedModel) -> None:
    prompts = _shared_prefix_prompts()[:4]
    config = aiocb.ContinuousBatchingConfig(page_size=16, allow_block_sharing=False)
    outputs, stats, _ = await _generate(qwen3, prompts, config)
    assert stats.prefix_hit_tokens == 0
    assert outputs == [reference_generate(qwen3, p, NEW) for p in prompts]


@pytest.mark.parametrize("async_batching", [False, True])
async def test_cpu_offloading_restores_without_recompute(qwen3: PreTrainedModel, async_batching: bool) -> None:
    prompts = random_prompts(16, 20, 200, seed=23)
    config = aiocb.ContinuousBatchingConfig(
        page_size=16, num_blocks=40, cpu_offload_space=0.01, use_async_batching=async_batching
    )
    outputs, stats, _manager = await _generate(qwen3, prompts, config)
    assert outputs == [reference_generate(qwen3, p, NEW) for p in prompts]
    assert stats.preemptions > 0
    assert stats.offloaded_blocks > 0 and stats.restored_blocks == stats.offloaded_blocks
    assert stats.recomputed_tokens == 0, "offloaded requests resume without recomputing"
    prompt_tokens = sum(len(p) for p in prompts)
    assert stats.tokens_computed == prompt_tokens + len(prompts) * (NEW - 1)


async def test_cpu_offloading_falls_back_to_recompute_when_the_host_pool_is_full(qwen3: PreTrainedModel) -> None:
    prompts = random_prompts(12, 40, 100, seed=25)
    # Room on the host for 6 blocks of 16 tokens (K and V, 2 layers, 2 heads of 16, fp32).
    space = 6 * (2 * 2 * 16 * 2 * 16 * 4) / 2**30
    config = aiocb.ContinuousBatchingConfig(page_size=16, num_blocks=24, cpu_offload_space=space, safety_margin=0.0)
    async with aiocb.Manager(qwen3, continuous_batching_config=config) as manager:
        outputs = await manager.generate_batch(prompts, max_new_tokens=60)
        stats = manager.statistics()
    assert [o.generated_tokens for o in outputs.values()] == [reference_generate(qwen3, p, 60) for p in prompts]
    assert stats.offloaded_blocks > 0 and stats.restored_blocks == stats.offloaded_blocks
    assert stats.recomputed_tokens > 0, "the host pool was too small for every preempted request"
    assert stats.free_blocks == stats.total_blocks


async def test_a_host_pool_larger_than_the_safety_threshold_is_clamped_to_it(
    qwen3: PreTrainedModel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    prompts = random_prompts(12, 40, 100, seed=25)
    six_blocks = 6 * (2 * 2 * 16 * 2 * 16 * 4)  # (as above: room for 6 blocks)
    # A host whose available memory's half, beside the device cache's 24 blocks (on a CPU,
    # host memory too), is those six blocks, and a pool asked of 1,000 GiB (the device's
    # cache, on this CPU, still planned from what is really free).
    available = memory.free_memory_bytes(torch.device("cpu"))
    monkeypatch.setattr(memory, "free_memory_bytes", lambda device: available)
    monkeypatch.setattr(memory, "host_memory_bytes", lambda: 2 * six_blocks + 24 * six_blocks // 6)
    config = aiocb.ContinuousBatchingConfig(
        page_size=16, num_blocks=24, cpu_offload_space=1000.0, cpu_offload_space_safety_threshold=0.5, safety_margin=0.0
    )
    with caplog.at_level(logging.WARNING, logger="aiocb.runner.memory"):
        async with aiocb.Manager(qwen3, continuous_batching_config=config) as manager:
            outputs = await manager.generate_batch(prompts, max_new_tokens=60)
            stats = manager.statistics()
    assert "cpu_offload_space=1000.0 GiB exceeds 50% of the available host memory" in caplog.text
    assert [o.generated_tokens for o in outputs.values()] == [reference_generate(qwen3, p, 60) for p in prompts]
    assert stats.offloaded_blocks > 0 and stats.recomputed_tokens > 0, "a pool of six blocks, not 1,000 GiB"
    # A threshold of 0 turns offloading off, as in transformers.
    config = config.replace(cpu_offload_space_safety_threshold=0.0)
    async with aiocb.Manager(qwen3, continuous_batching_config=config) as manager:
        await manager.generate_batch(prompts, max_new_tokens=60)
        stats = manager.statistics()
    assert stats.preemptions > 0 and stats.offloaded_blocks == 0


def _mistral() -> PreTrainedModel:
    torch.manual_seed(0)
    return MistralForCausalLM(
        MistralConfig(**{**_TINY, "num_hidden_layers": 3, "head_dim": 16}, sliding_window=40)
    ).eval()


def _gemma2() -> PreTrainedModel:
    torch.manual_seed(0)
    config = Gemma2Config(
        **{**_TINY, "num_hidden_layers": 4, "head_dim": 16},
        sliding_window=40,
        tie_word_embeddings=False,
        final_logit_softcapping=None,
        attn_implementation="eager",
    )
    return Gemma2ForCausalLM(config).eval()


def _gemma3() -> PreTrainedModel:
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        **{**_TINY, "num_hidden_layers": 4, "head_dim": 16},
        sliding_window=40,
        sliding_window_pattern=2,
        tie_word_embeddings=False,
        final_logit_softcapping=None,
        attn_implementation="eager",
    )
    return Gemma3ForCausalLM(config).eval()


@pytest.mark.parametrize("factory", [_mistral, _gemma2, _gemma3], ids=["mistral", "gemma2", "gemma3"])
@pytest.mark.parametrize(
    "config",
    [
        {"page_size": 16},
        {"page_size": 16, "num_blocks": 60, "max_batch_tokens": 50},
        {"page_size": 16, "num_blocks": 60, "max_batch_tokens": 50, "use_async_batching": True},
    ],
    ids=["roomy", "chunked_and_preempted", "async"],
)
def test_sliding_window_and_hybrid_models_match_generate(factory: object, config: dict[str, object]) -> None:
    model = factory()  # type: ignore[operator]
    prompts = random_prompts(10, 1, 150, seed=24)  # many longer than the window of 40
    cb_config = aiocb.ContinuousBatchingConfig(**config)  # type: ignore[arg-type]
    outputs, stats, groups = asyncio.run(_generate(model, prompts, cb_config))
    assert outputs == [reference_generate(model, p, NEW) for p in prompts]
    assert stats.prefix_hit_tokens == 0, "no prefix sharing when any layer slides"
    windows = {g.sliding_window for g in groups}
    assert 40 in windows
    if factory is not _mistral:
        assert None in windows, "hybrid: full and sliding groups side by side"
    if "num_blocks" not in config:
        # A sliding group is sized for a ring of ceil(39 / 16) + 1 = 4 blocks per concurrent
        # request (1024 by default), whatever the sequence length.
        sliding = next(g for g in groups if g.sliding_window == 40)
        assert sliding.num_blocks == 4 * DEFAULT_MAX_REQUESTS_PER_BATCH


def test_multi_head_latent_attention_is_refused_naming_it() -> None:
    """DeepSeek-V2/V3's keys and values are wider than the head_dim its config gives: a
    cache of that width failed at the first step (an index_copy_ shape error)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        **{**_TINY, "num_hidden_layers": 2},
        moe_intermediate_size=16,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
    )
    with pytest.raises(aiocb.InvalidConfigError, match="kv_lora_rank"):
        aiocb.generate_batch(DeepseekV3ForCausalLM(config).eval(), [[1, 2, 3]], max_new_tokens=2)


def test_layers_of_a_kind_the_paged_cache_does_not_keep_are_refused_naming_it() -> None:
    """Llama 4's chunked attention, read as full attention, would see past its chunk."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    config = Llama4TextConfig(
        **{**_TINY, "num_hidden_layers": 4},
        intermediate_size_mlp=64,
        attention_chunk_size=8,
        num_local_experts=2,
    )
    with pytest.raises(aiocb.InvalidConfigError, match="the model has chunked_attention layers"):
        aiocb.generate_batch(Llama4ForCausalLM(config).eval(), [[1, 2, 3]], max_new_tokens=2)


def test_a_hybrid_models_rings_share_a_small_budget_with_its_full_layers() -> None:
    """A sliding group is given a ring per concurrent request only where that leaves its
    full groups as many blocks: else every group gets the same (as transformers' blocks of
    the whole model), and the plan stands (the rings once took the whole budget, and more:
    no room left for the full layers, a MemoryError at start for Gemma 2 and 3)."""
    from aiocb.runner.memory import plan_cache
    from aiocb.runner.model_spec import model_spec

    spec = model_spec(_gemma3())
    config = aiocb.ContinuousBatchingConfig(page_size=16, max_batch_tokens=256)
    windows = [window for window, _ in spec.group_layers()]
    tight = plan_cache(spec, config, free_bytes=2**24)
    assert tight.num_blocks[0] == tight.num_blocks[1] > 0
    roomy = plan_cache(spec, config, free_bytes=2**26)
    rings = 4 * roomy.max_requests_per_batch  # (ceil(39 / 16) + 1 blocks a window)
    assert roomy.num_blocks[windows.index(40)] == rings < roomy.num_blocks[windows.index(None)]


def test_an_unbounded_host_pool_on_a_cpu_leaves_out_what_the_cache_takes(
    qwen3: PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a CPU the device cache is host memory too: the offload pool (cpu_offload_space
    None: the safety threshold's share of what is available) counts it taken."""
    from aiocb.runner import memory
    from aiocb.runner.model_spec import model_spec

    spec, available = model_spec(qwen3), 2**30
    monkeypatch.setattr(memory, "host_memory_bytes", lambda: available)
    config = aiocb.ContinuousBatchingConfig(cpu_offload_space=None, max_memory_percent=0.5, max_batch_tokens=256)
    plan = memory.plan_cache(spec, config, free_bytes=available)
    per_block = spec.bytes_per_block(config.page_size, spec.num_layers)
    device, host = plan.num_blocks[0] * per_block, plan.num_host_blocks[0] * per_block
    assert host <= (available - device) * config.cpu_offload_space_safety_threshold
    assert host > 0


def test_processes_sharing_the_host_plan_with_their_share_of_its_memory(
    qwen3: PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tensor-parallel ranks on one machine: each plans a CPU cache and an offload pool
    from its share of the host memory (each planned 60% and 80% of all of it)."""
    from aiocb.runner.model_spec import model_spec

    spec, available = model_spec(qwen3), 2**30
    monkeypatch.setattr(memory, "host_memory_bytes", lambda: available)
    config = aiocb.ContinuousBatchingConfig(cpu_offload_space=None, max_memory_percent=0.5, max_batch_tokens=256)
    alone = memory.plan_cache(spec, config, free_bytes=available)
    shared = memory.plan_cache(spec, config, free_bytes=available, host_share=2)
    per_block = spec.bytes_per_block(config.page_size, spec.num_layers)
    for plan in (alone, shared):  # (each process's cache and pool within its share)
        share = available // (2 if plan is shared else 1)
        assert plan.num_blocks[0] * per_block <= share * config.max_memory_percent
        room = (share - plan.num_blocks[0] * per_block) * config.cpu_offload_space_safety_threshold
        assert plan.num_host_blocks[0] * per_block <= room
    assert 0 < shared.num_blocks[0] < 0.6 * alone.num_blocks[0]
    assert 0 < shared.num_host_blocks[0] < 0.6 * alone.num_host_blocks[0]


@pytest.mark.parametrize(("device", "share"), [("cuda", 0.9), ("cpu", 0.6), ("mps", 0.6), ("xpu", 0.6)])
def test_the_default_memory_share_is_the_hosts_wherever_host_memory_is_counted(device: str, share: float) -> None:
    """MPS (memory shared with the host, counted as the host's) took CUDA's 0.9 of it."""
    assert memory.memory_percent(aiocb.ContinuousBatchingConfig(), torch.device(device)) == share
    assert memory.memory_percent(aiocb.ContinuousBatchingConfig(max_memory_percent=0.3), torch.device(device)) == 0.3


def test_the_plan_on_cuda_keeps_room_for_the_decode_graphs(qwen3: PreTrainedModel) -> None:
    """Captured decode graphs keep their pool (the largest bucket's activations and logits)
    and their logits' output buffer allocated beside the step buffers: a CUDA plan leaves
    them room, unless decode graphs are turned off."""
    from aiocb.runner.model_spec import model_spec

    spec = dataclasses.replace(model_spec(qwen3), device=torch.device("cuda"))
    sizes = {"max_batch_tokens": 256, "max_requests_per_batch": 64, "cpu_offload_space": 0}
    free = 2**30
    plans = {
        graphs: memory.plan_cache(spec, aiocb.ContinuousBatchingConfig(use_cuda_graph=graphs, **sizes), free_bytes=free)
        for graphs in (None, (True, False), False, (True, True))
    }
    per_block = sum(spec.group_block_bytes(plans[None].page_size))
    held = 64 * (memory.activation_bytes_per_token(spec) + 2 * spec.vocab_size * spec.dtype_bytes)
    assert plans[None].num_blocks == plans[(True, True)].num_blocks
    assert plans[False].num_blocks == plans[(True, False)].num_blocks
    assert plans[False].num_blocks[0] - plans[None].num_blocks[0] == pytest.approx(held / per_block, abs=1)


async def test_a_hybrid_managers_chosen_num_blocks_fits_given_back() -> None:
    """The num_blocks a manager reports is whole-model blocks costing what its groups' do
    (it reported the full group's, which given back to every group took far more memory)."""
    model = _gemma3()
    config = aiocb.ContinuousBatchingConfig(page_size=16, max_batch_tokens=256, max_memory_percent=0.05)
    async with aiocb.Manager(model, continuous_batching_config=config) as manager:
        chosen = manager.continuous_batching_config
        planned = manager.statistics().total_blocks
    assert chosen.num_blocks is not None and chosen.num_blocks < planned
    # (a little more room: the host's free memory moves between the two plans)
    given_back = dataclasses.replace(chosen, max_memory_percent=0.06)
    async with aiocb.Manager(model, continuous_batching_config=given_back) as again:
        assert (await again.generate([1, 2, 3], max_new_tokens=2)).generated_tokens


@pytest.mark.parametrize("chunk_bytes", [None, 1 << 12], ids=["one_batch", "row_batches"])
async def test_decode_over_a_shared_prefix_reads_it_once(
    qwen3: PreTrainedModel, monkeypatch: pytest.MonkeyPatch, chunk_bytes: int | None
) -> None:
    from aiocb.runner import attention

    monkeypatch.setenv("AIOCB_ATTENTION_BACKEND", "reference")  # (the cpu backend reads keys in place)
    if chunk_bytes is not None:
        monkeypatch.setattr(inputs, "_CPU_DECODE_CHUNK_BYTES", chunk_bytes)
    calls = 0
    batch_rows: set[int] = set()
    original = attention._attend_shared_prefix

    def counting(q: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        nonlocal calls
        calls += 1
        batch_rows.add(q.shape[0])
        return original(q, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(attention, "_attend_shared_prefix", counting)
    rng = random.Random(26)
    prefix = [rng.randrange(1, 512) for _ in range(300)]
    prompts = [prefix + suffix for suffix in random_prompts(12, 1, 30, seed=27)]
    config = aiocb.ContinuousBatchingConfig(page_size=16)
    outputs, stats, _ = await _generate(qwen3, prompts, config)
    assert outputs == [reference_generate(qwen3, p, NEW) for p in prompts]
    assert stats.prefix_hit_tokens == 11 * 288
    assert calls > 0, "decode steps attended to the shared blocks in one product"
    if chunk_bytes is None:
        assert max(batch_rows) == len(prompts), "every row in one batch"
    else:
        assert max(batch_rows) < len(prompts), "rows in several batches, each reading the shared blocks"


@pytest.mark.parametrize("backend", ["cpu", "reference", "triton"])
def test_a_window_of_one_attends_each_token_to_itself(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its ring keeps a step's last key, which its own query reads (it kept none: the key
    read was garbage). Against greedy decoding by whole forward passes: transformers' cached
    ``generate`` keeps ``window - 1`` keys too, none here, and differs from its own forward."""
    if backend == "triton":
        pytest.importorskip("triton")
    monkeypatch.setenv("AIOCB_ATTENTION_BACKEND", backend)
    model = tiny_qwen3(use_sliding_window=True, sliding_window=1, max_window_layers=1)
    prompts = random_prompts(3, 5, 20, seed=3)
    config = aiocb.ContinuousBatchingConfig(page_size=4, max_batch_tokens=16)
    outputs = aiocb.generate_batch(model, prompts, max_new_tokens=8, continuous_batching_config=config)
    for prompt, output in zip(prompts, outputs.values(), strict=True):
        sequence = list(prompt)
        with torch.no_grad():
            for _ in range(8):
                sequence.append(int(model(torch.tensor([sequence])).logits[0, -1].argmax()))
        assert output.generated_tokens == sequence[len(prompt) :]


def test_prefix_caching_is_off_for_sliding_models_with_a_log_line(caplog: pytest.LogCaptureFixture) -> None:
    async def start_and_stop() -> bool:
        async with aiocb.Manager(_mistral()) as manager:
            assert manager._steps is not None
            return manager._steps.scheduler.kv_cache.prefix_caching

    with caplog.at_level(logging.INFO, logger="aiocb"):
        assert not asyncio.run(start_and_stop())
    assert any("prefix caching is off" in r.message and "sliding" in r.message for r in caplog.records)


@pytest.mark.parametrize("factory", [_mistral, _gemma3], ids=["mistral", "gemma3"])
def test_sliding_window_decode_rows_in_batches_match_generate(factory: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """Single-token rows attended a few at a time (see ``inputs._decode_chunks``), over rings
    (the reference backend; the default tests run the cpu one)."""
    monkeypatch.setenv("AIOCB_ATTENTION_BACKEND", "reference")
    monkeypatch.setattr(inputs, "_CPU_DECODE_CHUNK_BYTES", 1 << 14)
    model = factory()  # type: ignore[operator]
    prompts = random_prompts(10, 1, 150, seed=24)
    outputs, _, _ = asyncio.run(_generate(model, prompts, aiocb.ContinuousBatchingConfig(page_size=16)))
    assert outputs == [reference_generate(model, p, NEW) for p in prompts]


def test_the_cache_plan_counts_what_the_caching_allocator_holds_unused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A destroyed manager's cache goes back to PyTorch's allocator, not the driver: the
    next manager's plan counts it as free (it was about a tenth of the first's)."""
    from aiocb.runner.memory import free_memory_bytes

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10 * 2**30, 140 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 120 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 2 * 2**30)
    assert free_memory_bytes(cuda) == 128 * 2**30


def test_the_cache_plan_keeps_room_for_the_rows_a_verifying_step_samples(qwen3: PreTrainedModel) -> None:
    """Speculating requests sample ``k + 1`` rows each (at most ``disable_by_batch_size``
    requests speculate, at most ``max_batch_tokens`` rows in all)."""
    from aiocb.runner.memory import plan_cache
    from aiocb.runner.model_spec import model_spec

    spec, free = model_spec(qwen3), 2**30
    config = aiocb.ContinuousBatchingConfig(max_requests_per_batch=64, max_batch_tokens=256)
    plain = plan_cache(spec, config, free_bytes=free)
    per_block = spec.bytes_per_block(config.page_size, spec.num_layers)
    for disable, rows in ((8, 64), (None, 256), (32, 32 * 5)):
        speculative = aiocb.SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=disable)
        plan = plan_cache(spec, config, free_bytes=free, speculative=speculative)
        lost = 3 * 4 * spec.vocab_size * (rows - 64)
        assert plain.num_blocks[0] - plan.num_blocks[0] == pytest.approx(lost / per_block, abs=1), disable


async def test_a_given_num_blocks_must_fit_the_memory_budget(qwen3: PreTrainedModel) -> None:
    """As transformers checks a given cache size's footprint: a ``num_blocks`` beyond what
    ``max_memory_percent`` of the free memory leaves after the step buffers is refused,
    naming both, before anything is allocated (not an out-of-memory error later)."""
    from aiocb.runner.memory import plan_cache
    from aiocb.runner.model_spec import model_spec

    spec, free = model_spec(qwen3), 2**30
    sizes = {"max_batch_tokens": 256, "max_requests_per_batch": 8, "max_memory_percent": 0.5}
    fitted = plan_cache(spec, aiocb.ContinuousBatchingConfig(**sizes), free_bytes=free).num_blocks[0]
    given = aiocb.ContinuousBatchingConfig(num_blocks=fitted, **sizes)
    assert plan_cache(spec, given, free_bytes=free).num_blocks == [fitted]
    with pytest.raises(MemoryError, match=r"num_blocks=.*max_memory_percent"):
        plan_cache(spec, aiocb.ContinuousBatchingConfig(num_blocks=fitted + 64, **sizes), free_bytes=free)
    # A small cache holds fewer requests than the default count (each writes a block of its
    # own): the step buffers are reckoned for those (the logits of 2 rows of a 151,936-token
    # vocabulary, not 1,024).
    small = aiocb.ContinuousBatchingConfig(num_blocks=2, page_size=16, max_batch_tokens=256, max_memory_percent=0.6)
    wide = dataclasses.replace(spec, vocab_size=151_936)
    assert plan_cache(wide, small, free_bytes=free).max_requests_per_batch == 2
    tiny = aiocb.ContinuousBatchingConfig(num_blocks=10**6, max_memory_percent=1e-6)
    with pytest.raises(MemoryError, match="num_blocks=1000000"):
        async with aiocb.Manager(qwen3, continuous_batching_config=tiny) as manager:
            await manager.generate([1, 2, 3], max_new_tokens=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_zeroed_host_cache_is_made_without_writing_it(dtype: torch.dtype) -> None:
    """A draft model's cache starts at zero (its rows may be read where the draft never
    wrote): in host memory, of pages zeroed when first touched, not written at once (a
    default-sized draft cache took 10 s of a manager's start, all of its memory committed)."""
    process = psutil.Process()
    before = process.memory_info().rss
    cache = zeros((2**28 // 4, 2, 2), dtype, torch.device("cpu"))  # (1 GiB of float32)
    grown = process.memory_info().rss - before
    assert grown < 64 * 2**20, f"{grown / 2**20:.0f} MiB written at once"
    assert cache.dtype == dtype and cache.shape == (2**28 // 4, 2, 2) and cache.is_contiguous()
    assert cache.data_ptr() % 64 == 0
    assert not cache[:: 2**16].any() and not cache[-1].any()
    cache[7] = 1.5  # (writable, as the cache it is)
    assert cache[7].sum().item() == 6.0 and not cache[6].any()
    child = os.fork()
    if child == 0:  # (a forked child writes its own copy of the page, never the parent's)
        ctypes.memset(cache[0].data_ptr(), 0x7F, 4)
        os._exit(0)
    assert os.waitpid(child, 0)[1] == 0
    assert not cache[0].any()
