"""The GPU path's logic, exercised on the CPU: backends, graph padding, compile levels."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel

import aiocb
from aiocb.runner import attention, backends
from aiocb.runner.backends import Backend, select_backends
from aiocb.runner.compile import compile_configs
from aiocb.runner.cuda_graphs import DecodeGraphs, batch_buckets
from aiocb.runner.inputs import AttentionMetadata, HostToDevice, prepare_inputs
from aiocb.runner.model_runner import ModelRunner
from aiocb.runner.step_batch import StepBatch
from tests.conftest import random_prompts, reference_generate, tiny_qwen3
from tests.runner.conftest import record_eagerly

PROMPTS = random_prompts(4, 5, 40, seed=16)


def test_triton_backend_matches_generate_through_the_whole_model(
    qwen3: PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("triton")
    monkeypatch.setenv("AIOCB_ATTENTION_BACKEND", Backend.TRITON)
    config = aiocb.ContinuousBatchingConfig(page_size=16, max_batch_tokens=48)
    outputs = aiocb.generate_batch(qwen3, PROMPTS, max_new_tokens=6, continuous_batching_config=config)
    assert [o.generated_tokens for o in outputs.values()] == [reference_generate(qwen3, p, 6) for p in PROMPTS]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "decode-graphs"])
def test_sliding_window_layers_read_their_rings_in_place_through_triton(
    graphs: bool, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """A hybrid model's sliding layers attend through the Triton kernel where its rows
    bring few enough tokens for the ring to hold every key their queries need (decode
    steps, in CUDA graphs too, and short chunks where the schedule makes them: rows of
    several tokens in place are test_prompt_lookup_over_sliding_rings_in_graphs'), and as
    ``reference`` reads them in steps with longer rows: greedy outputs equal
    ``model.generate``'s."""
    pytest.importorskip("triton")
    from aiocb.core.kv_cache import ring_safe_tokens
    from aiocb.runner import triton_attention

    monkeypatch.setenv("AIOCB_ATTENTION_BACKEND", Backend.TRITON)
    captured: list[int] = request.getfixturevalue("graphs_on_cpu") if graphs else []
    windowed: list[int] = []  # each windowed kernel call's longest row
    kernel = triton_attention.triton_paged_attention

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        if args[9] is not None:  # (its sliding_window)
            windowed.append(args[6])
        return kernel(*args, **kwargs)

    monkeypatch.setattr(triton_attention, "triton_paged_attention", counted)
    window, page = 12, 4
    model = tiny_qwen3(use_sliding_window=True, sliding_window=window, max_window_layers=1)
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    prompts = random_prompts(5, 3, 40, seed=21)
    config = aiocb.ContinuousBatchingConfig(
        page_size=page, max_batch_tokens=24, decode_compile_config={"disable": True}
    )
    outputs = aiocb.generate_batch(model, prompts, max_new_tokens=12, continuous_batching_config=config)
    assert [o.generated_tokens for o in outputs.values()] == [reference_generate(model, p, 12) for p in prompts]
    safe = ring_safe_tokens(window, page)
    assert safe == 5 and windowed.count(1) >= 11 and all(longest <= safe for longest in windowed)
    assert bool(captured) == graphs


def test_prompt_lookup_over_sliding_rings_in_graphs(graphs_on_cpu: list[int]) -> None:
    """Rows verifying proposals read the sliding layers' rings in place too, replaying the
    graphs of their widths: greedy outputs are those of no speculation."""
    model = tiny_qwen3(use_sliding_window=True, sliding_window=12, max_window_layers=1)
    prompts = [p * 3 for p in random_prompts(4, 6, 14, seed=8)]  # (copies, for prompt lookup to find)
    # (few rows and widths: each graph is captured as an eager pass through Triton's interpreter)
    config = aiocb.ContinuousBatchingConfig(
        page_size=4, max_requests_per_batch=4, decode_compile_config={"disable": True}
    )
    speculative = aiocb.SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, disable_by_batch_size=None)

    async def main() -> tuple[list[list[int]], aiocb.ManagerStatistics, int]:
        async with aiocb.Manager(model, continuous_batching_config=config, speculative_config=speculative) as manager:
            outputs = await manager.generate_batch(prompts, max_new_tokens=16)
            graphs = manager._runner.graphs  # type: ignore[union-attr]
            assert graphs is not None
            return [o.generated_tokens for o in outputs.values()], manager.statistics(), graphs.wide_replays

    tokens, stats, wide_replays = asyncio.run(main())
    assert tokens == [reference_generate(model, p, 16) for p in prompts]
    assert stats.accepted_draft_tokens > 0 and wide_replays > 0


def test_backend_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, default = torch.device("cpu"), aiocb.ContinuousBatchingConfig()
    assert select_backends(cpu, default, [None], 256, dtype=torch.bfloat16, head_dim=64) == [Backend.REFERENCE]
    assert select_backends(cpu, default, [None, 64], 256, dtype=torch.float32, head_dim=8192) == [
        Backend.REFERENCE,
        Backend.REFERENCE,
    ]
    cuda = torch.device("cuda")
    off = aiocb.ContinuousBatchingConfig(max_blocks_per_request=0)
    assert select_backends(cuda, off, [None, 64], 256, dtype=torch.float16, head_dim=64) == [
        Backend.REFERENCE,
        Backend.REFERENCE,
    ]
    chosen = select_backends(
        cuda,
        aiocb.ContinuousBatchingConfig(auto_switch_to_flash=False),
        [None, 64],
        256,
        dtype=torch.float16,
        head_dim=64,
    )
    # Sliding-window groups use Triton's kernel (it reads their rings) where Triton runs.
    from aiocb.runner import triton_attention

    assert chosen == [Backend.TRITON] * 2 if triton_attention.is_available(cuda) else [Backend.REFERENCE] * 2
    with monkeypatch.context() as patched:  # (flash-attn cannot read a ring)
        patched.setattr(backends, "_flash_available", lambda: True)
        assert select_backends(cuda, default, [None, 64], 256, dtype=torch.float16, head_dim=64) == [
            Backend.FLASH,
            Backend.REFERENCE,
        ]


def test_a_draft_model_needs_the_kernel_of_the_target_s_full_attention_layers_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its cache mirrors their blocks: a hybrid target's sliding layers, which flash-attn
    cannot read (their rings), attend otherwise without refusing it."""
    import dataclasses

    from aiocb.runner.draft import draft_spec, refuse_other_kernels
    from aiocb.runner.memory import CachePlan
    from aiocb.runner.model_spec import model_spec

    monkeypatch.setattr(backends, "_flash_available", lambda: True)  # (a CUDA machine with flash-attn)
    cuda, config = torch.device("cuda"), aiocb.ContinuousBatchingConfig()
    hybrid = tiny_qwen3(use_sliding_window=True, sliding_window=32, max_window_layers=1)
    target = dataclasses.replace(model_spec(hybrid), device=cuda)
    windows = [window for window, _ in target.group_layers()]
    chosen = select_backends(cuda, config, windows, 256, dtype=target.dtype, head_dim=target.head_dim)
    assert chosen == [Backend.FLASH, Backend.REFERENCE]
    plan = CachePlan(256, [10, 10], 256, 8, 0, [0, 0])
    refuse_other_kernels(dataclasses.replace(draft_spec(tiny_qwen3()), device=cuda), plan, config, chosen)
    # On a CPU a draft in bf16 cannot take the fp32 target's C kernels.
    on_cpu = select_backends(torch.device("cpu"), config, windows, 256, dtype=target.dtype, head_dim=target.head_dim)
    bf16 = dataclasses.replace(draft_spec(tiny_qwen3()), dtype=torch.bfloat16)
    with pytest.raises(aiocb.InvalidConfigError, match="attention kernel of the target's full-attention layers"):
        refuse_other_kernels(bf16, plan, config, on_cpu)


def test_batch_buckets_bound_padding_waste() -> None:
    buckets = batch_buckets(1024)
    assert buckets[:5] == [1, 2, 4, 8, 16] and buckets[-1] == 1024
    assert buckets == sorted(set(buckets))
    for rows in range(1, 1025):
        bucket = next(b for b in buckets if b >= rows)
        assert bucket <= (2 * rows if rows <= 16 else 1.5 * rows), rows
    assert batch_buckets(5)[-1] == 5


def test_compile_levels_and_explicit_configs() -> None:
    assert compile_configs(aiocb.ContinuousBatchingConfig()) == (None, None)
    varlen, decode = compile_configs(aiocb.ContinuousBatchingConfig(default_compile_level=3))
    assert varlen == decode == {"mode": "max-autotune-no-cudagraphs", "dynamic": False}
    explicit = {"mode": "reduce-overhead"}
    varlen, decode = compile_configs(
        aiocb.ContinuousBatchingConfig(default_compile_level=1, decode_compile_config=explicit)
    )
    assert varlen == {"mode": "default", "dynamic": True} and decode == explicit


@pytest.mark.parametrize("asked", [True, (True, False), (False, True), (True, True)])
def test_cuda_graphs_are_refused_without_cuda(
    qwen3: PreTrainedModel, caplog: pytest.LogCaptureFixture, asked: bool | tuple[bool, bool]
) -> None:
    """Graphs of any steps asked for by name (mixed ones alone too) are said not to be made."""
    with caplog.at_level(logging.WARNING, logger="aiocb"):
        runner = ModelRunner(qwen3, aiocb.ContinuousBatchingConfig(use_cuda_graph=asked, num_blocks=64))
    assert runner.graphs is None
    assert [r.message for r in caplog.records if "use_cuda_graph" in r.message] == [
        "use_cuda_graph is ignored: graphs need CUDA and in-place paged attention (device cpu, backends "
        f"{runner.backends})"
    ]
    assert not runner.async_batching


def test_padded_decode_replay_equals_the_unpadded_step(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    monkeypatch.setenv("AIOCB_ATTENTION_BACKEND", Backend.TRITON)
    monkeypatch.setattr(DecodeGraphs, "_record", record_eagerly)
    model = tiny_qwen3()
    runner = ModelRunner(model, aiocb.ContinuousBatchingConfig(page_size=16, num_blocks=64))
    for tensor in (*runner.cache.key, *runner.cache.value):
        tensor.zero_()  # (fresh cache memory is uninitialised: compare writes against zeros)
    runner.attach()
    try:
        graphs = DecodeGraphs(
            lambda ids, pos, keep, meta: attention.forward(model, ids, pos, keep, meta),
            runner.cache,
            runner.backends,
            max_rows=8,
            max_blocks_per_request=4,
            device=runner.device,
        )
        # Three requests decode their second token: bucket 4, one padding row.
        from aiocb.core.kv_cache import KVCacheManager
        from aiocb.core.params import ResolvedParams
        from aiocb.core.request import Request
        from aiocb.core.scheduler import Scheduler

        kv = KVCacheManager(runner.spec.cache_groups(runner.plan.num_blocks), 16, enable_prefix_caching=False)
        scheduler = Scheduler(kv, max_batch_tokens=256, max_requests_per_batch=8)
        for i, prompt in enumerate(PROMPTS[:3]):
            scheduler.add(Request(f"r{i}", prompt, ResolvedParams(max_new_tokens=4), 0.0))
        prefill = scheduler.schedule()
        scheduler.update(prefill, runner.execute(runner.writer.snapshot(prefill)), 0.0)
        decode = scheduler.schedule()
        batch: StepBatch = runner.writer.snapshot(decode)
        before = [t.clone() for t in runner.cache.key]
        inputs = prepare_inputs(batch, runner.cache, HostToDevice(runner.device), runner.backends, runner.input_batch)
        assert graphs.eligible(batch, inputs)
        with torch.inference_mode():
            padded = graphs.run(inputs, batch.num_rows)
        # The padding row wrote only to the trash block.
        trash = runner.cache.trash_block(0)
        for layer, old in enumerate(before):
            changed = (runner.cache.key[layer] != old).flatten(1).any(1).nonzero().flatten().tolist()
            real = {b for item in decode.scheduled for b in item.request.block_ids[0]}
            assert set(changed) <= real | {trash}
        for layer, old in enumerate(before):  # undo this step's writes, then run it unpadded
            runner.cache.key[layer].copy_(old)
        inputs = prepare_inputs(batch, runner.cache, HostToDevice(runner.device), runner.backends, runner.input_batch)
        with torch.inference_mode():
            metadata: AttentionMetadata = inputs.attention
            eager = attention.forward(
                model, inputs.input_ids[None], inputs.position_ids[None], inputs.logits_indices, metadata
            )
        assert torch.allclose(padded, eager, atol=1e-5)
    finally:
        runner.detach()
    assert model.config._attn_implementation == "sdpa"
    assert attention.ATTENTION_NAME != "sdpa"


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_compile_level_one_matches_generate(qwen3: PreTrainedModel) -> None:
    config = aiocb.ContinuousBatchingConfig(default_compile_level=1, max_batch_tokens=64)
    outputs = aiocb.generate_batch(qwen3, PROMPTS, max_new_tokens=6, continuous_batching_config=config)
    assert [o.generated_tokens for o in outputs.values()] == [reference_generate(qwen3, p, 6) for p in PROMPTS]


def test_a_steps_inputs_are_moved_tensor_by_tensor_in_place(qwen3: PreTrainedModel) -> None:
    """HostToDevice.move walks the typed inputs (dataclasses and lists): every tensor is
    replaced where it was, everything else is kept."""
    from aiocb.core.kv_cache import KVCacheManager
    from aiocb.core.params import ResolvedParams
    from aiocb.core.request import Request
    from aiocb.core.scheduler import Scheduler
    from aiocb.runner.inputs import _find_tensors, _with_tensors

    runner = ModelRunner(qwen3, aiocb.ContinuousBatchingConfig(num_blocks=64, page_size=16))
    kv = KVCacheManager(runner.spec.cache_groups(runner.plan.num_blocks), 16, enable_prefix_caching=False)
    scheduler = Scheduler(kv, max_batch_tokens=256, max_requests_per_batch=8)
    for i, prompt in enumerate(PROMPTS):
        params = ResolvedParams(max_new_tokens=4, temperature=0.7, top_k=5, seed=i, repetition_penalty=1.2)
        scheduler.add(Request(f"r{i}", prompt, params, 0.0))
    batch = runner.writer.snapshot(scheduler.schedule())
    inputs = prepare_inputs(batch, runner.cache, HostToDevice(runner.device), runner.backends, runner.input_batch)
    found: list[torch.Tensor] = []
    _find_tensors(inputs, found)
    assert any(t is inputs.attention.groups[0].prefill_read_slots[-1] for t in found)
    assert inputs.sampling.controls is not None and any(t is inputs.sampling.controls.history_ids for t in found)
    moved = _with_tensors(inputs, iter([t.clone() for t in found]))
    again: list[torch.Tensor] = []
    _find_tensors(moved, again)
    assert len(again) == len(found)
    for before, after in zip(found, again, strict=True):
        assert after is not before and after.dtype == before.dtype and torch.equal(after, before)
    assert moved.attention.cache is runner.cache  # type: ignore[attr-defined]
    assert moved.prompt_counts == inputs.prompt_counts  # type: ignore[attr-defined]


async def test_triton_backend_with_a_draft_model_that_catches_up(
    qwen3: PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A copy of the target drafts over Triton's attention: it sleeps while two requests
    # decode (over disable_by_batch_size), then the one left catches up on the tokens it
    # missed (a multi-token pass over its own cache) and its proposals are all accepted.
    pytest.importorskip("triton")
    monkeypatch.setenv("AIOCB_ATTENTION_BACKEND", Backend.TRITON)
    spec = aiocb.SpeculativeConfig(
        method="draft", draft_model=copy.deepcopy(qwen3), num_speculative_tokens=2, disable_by_batch_size=1
    )
    config = aiocb.ContinuousBatchingConfig(page_size=16, max_batch_tokens=48)
    lengths = (3, 12)
    async with aiocb.Manager(qwen3, continuous_batching_config=config, speculative_config=spec) as manager:
        drafter = manager._runner.drafter  # type: ignore[union-attr]
        assert drafter is not None
        caught_up: list[int] = []
        propose = drafter.propose
        drafter.propose = lambda batch, *a: caught_up.extend(batch.catch_up_counts) or propose(batch, *a)  # type: ignore[method-assign]
        ids = [manager.add_request_nowait(p, max_new_tokens=n) for p, n in zip(PROMPTS, lengths, strict=False)]
        outputs = [await manager.get_result(rid) for rid in ids]
        stats = manager.statistics()
    assert [o.generated_tokens for o in outputs] == [  # type: ignore[union-attr]
        reference_generate(qwen3, p, n) for p, n in zip(PROMPTS, lengths, strict=False)
    ]
    assert stats.draft_tokens > 0 and stats.accepted_draft_tokens == stats.draft_tokens
    assert caught_up and caught_up[0] > len(PROMPTS[1])  # (its prompt and the tokens decoded without the draft)


def test_the_packed_copy_to_the_device_keeps_every_dtype_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """HostToDevice's CUDA path (one pinned buffer and one copy per carrier dtype), run on
    the host with CUDA's streams and events stubbed: integers and bools travel as int64,
    each floating dtype as itself (a float64 or bf16 tensor packed as int64 lost its fractions)."""

    class Stub:
        def __init__(self, *args: Any, **kwargs: Any) -> None: ...
        def record(self, stream: Any = None) -> None: ...
        def synchronize(self) -> None: ...
        def wait_stream(self, stream: Any) -> None: ...

    monkeypatch.setattr(torch.cuda, "Stream", Stub)
    monkeypatch.setattr(torch.cuda, "Event", Stub)
    monkeypatch.setattr(torch.cuda, "current_stream", Stub)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None, raising=False)
    mover = HostToDevice(torch.device("cpu"))
    mover._stream = Stub()  # type: ignore[assignment]

    def unpinned(dtype: torch.dtype, turn: int, numel: int) -> torch.Tensor:  # (pinning needs CUDA)
        return mover._buffers.setdefault((dtype, turn), torch.empty(4096, dtype=dtype))

    monkeypatch.setattr(mover, "_host_buffer", unpinned)
    tensors = [
        torch.tensor([1, 2**40, -7]),
        torch.tensor([-1, 2**31 - 1, -(2**31)], dtype=torch.int32),
        torch.tensor([True, False]),
        torch.tensor([[0.1, float("-inf")], [2.5, -0.0]]),
        torch.tensor([1.5, -2.25], dtype=torch.float64),
        torch.tensor([1.5, 3.0e38], dtype=torch.bfloat16),
        torch.tensor([0.5], dtype=torch.float16),
        torch.tensor([200, 3], dtype=torch.uint8),
    ]
    for _ in range(2):  # (both turns' buffers)
        moved = mover._copy(tensors)
        for before, after in zip(tensors, moved, strict=True):
            assert after.dtype == before.dtype and after.shape == before.shape and torch.equal(after, before)
    assert {dtype for dtype, _ in mover._buffers} == {
        torch.int64,
        torch.float32,
        torch.float64,
        torch.bfloat16,
        torch.float16,
    }
