"""End-to-end checks that need a CUDA device (run by bench/gpu_check.py, skipped elsewhere).

Plain functions driving asyncio themselves, so they need nothing beyond pytest.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel, Qwen3Config, Qwen3ForCausalLM

import aiocb
from aiocb.runner.cuda_graphs import DecodeGraphs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


#: The test models' sizes (Qwen3's; gpt-oss's too, with its experts)
_SIZES: dict[str, Any] = {
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "initializer_range": 0.3,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": 0,
}


def _model(dtype: torch.dtype, **overrides: Any) -> PreTrainedModel:
    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(**{**_SIZES, **overrides})).to("cuda", dtype).eval()


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 4096) for _ in range(rng.randint(8, 300))] for _ in range(count)]


def _run(
    model: PreTrainedModel,
    prompts: list[list[int]],
    new: int,
    speculative_config: aiocb.SpeculativeConfig | None = None,
    **config: Any,
) -> list[list[int]]:
    async def main() -> list[list[int]]:
        cb = aiocb.ContinuousBatchingConfig(max_memory_percent=0.3, **config)
        async with aiocb.Manager(
            model, continuous_batching_config=cb, speculative_config=speculative_config
        ) as manager:
            outputs = await manager.generate_batch(prompts, max_new_tokens=new)
            stats = manager.statistics()
            assert stats.free_blocks == stats.total_blocks
        return [o.generated_tokens for o in outputs.values()]

    return asyncio.run(main())


def test_bf16_greedy_is_as_close_to_fp32_as_transformers_bf16() -> None:
    """bf16 outputs drift apart at the first near-tie (another kernel rounds differently),
    so exact sequences say little. aiocb generates greedily in bf16; then the same model in
    fp32 (transformers, one forward per sequence) is the truth, and aiocb's distance from it
    (argmax agreement and log-probability error at each generated position) must be about
    transformers' own bf16 distance from it on the same sequences: bf16 rounding, no more.
    A wrong kernel is off by nats, not hundredths."""
    model = _model(torch.bfloat16)
    truth = _model(torch.float32)
    prompts = _prompts(64)
    new = 32

    async def main() -> list[aiocb.GenerationOutput]:
        # Eager decode inside the graphs: the kernels and the graphs; bench/gpu_check.py's
        # parity phase measures the compiled default against transformers' bf16.
        cb = aiocb.ContinuousBatchingConfig(
            max_memory_percent=0.3, max_requests_per_batch=64, decode_compile_config={"disable": True}
        )
        params = aiocb.SamplingParams(return_logprobs=True)
        async with aiocb.Manager(model, continuous_batching_config=cb) as manager:
            outputs = await manager.generate_batch(prompts, max_new_tokens=new, sampling_params=params)
        return list(outputs.values())

    def scored(m: PreTrainedModel, prompt: list[int], tokens: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            logits = m(input_ids=torch.tensor([prompt + tokens[:-1]], device="cuda")).logits
        return logits[0, len(prompt) - 1 :].float().log_softmax(-1)

    agree = {"aiocb": 0, "transformers": 0}
    error = {"aiocb": 0.0, "transformers": 0.0}
    positions = 0
    for prompt, output in zip(prompts, asyncio.run(main()), strict=True):
        tokens, logprobs = output.generated_tokens, output.logprobs
        assert logprobs is not None and len(tokens) == new
        chosen = torch.tensor(tokens, device="cuda")[:, None]
        exact, bf16 = scored(truth, prompt, tokens), scored(model, prompt, tokens)
        best = exact.argmax(-1)
        theirs = exact.gather(1, chosen)[:, 0]
        agree["aiocb"] += int((best == chosen[:, 0]).sum())
        agree["transformers"] += int((best == bf16.argmax(-1)).sum())
        error["aiocb"] += float((torch.tensor(logprobs, device="cuda") - theirs).abs().sum())
        error["transformers"] += float((bf16.gather(1, chosen)[:, 0] - theirs).abs().sum())
        positions += new
    rate = {k: v / positions for k, v in agree.items()}
    mean = {k: v / positions for k, v in error.items()}
    print(f"bf16 parity against fp32 over {positions} positions: argmax agreement {rate}, "
          f"mean logprob error {mean}")  # fmt: skip
    assert rate["aiocb"] >= rate["transformers"] - 0.03
    assert mean["aiocb"] <= 1.5 * mean["transformers"] + 0.01


def test_async_batching_equals_synchronous_steps() -> None:
    model = _model(torch.float32)
    prompts = _prompts(48, seed=1)
    sync = _run(model, prompts, 24, use_async_batching=False, use_cuda_graph=False)
    pipelined = _run(model, prompts, 24, use_async_batching=True, use_cuda_graph=False)
    assert pipelined == sync


def test_cuda_graph_replay_equals_eager(caplog: pytest.LogCaptureFixture) -> None:
    model = _model(torch.float32)
    prompts = _prompts(40, seed=2)
    eager = _run(model, prompts, 24, use_cuda_graph=False, use_async_batching=False)
    with caplog.at_level(logging.WARNING, logger="aiocb.runner.model_runner"):
        graphs = _run(
            model, prompts, 24, use_cuda_graph=True, use_async_batching=False, decode_compile_config={"disable": True}
        )
    # (True asks for mixed-step graphs too, which are not captured: said, not silently ignored)
    assert "graphs of mixed and prefill steps, which aiocb does not capture" in caplog.text
    same = sum(a == b for a, b in zip(eager, graphs, strict=True))
    print(f"graphs vs eager: {same}/{len(prompts)} identical")
    assert same >= 0.95 * len(prompts)


def test_sliding_layers_read_in_place_equal_their_reference_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hybrid model's sliding layers through the Triton kernel over their rings (decode
    steps in graphs, short chunks eager) against the reference backend's gathers."""
    from aiocb.runner import triton_attention

    model = _model(torch.float32, use_sliding_window=True, sliding_window=96, max_window_layers=2)
    assert "sliding_attention" in model.config.layer_types and "full_attention" in model.config.layer_types
    prompts = _prompts(40, seed=4)
    windowed: list[int] = []  # (captures and eager steps: replays call no Python)
    kernel = triton_attention.triton_paged_attention

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        if args[9] is not None:
            windowed.append(args[6])
        return kernel(*args, **kwargs)

    monkeypatch.setattr(triton_attention, "triton_paged_attention", counted)
    in_place = _run(model, prompts, 48, page_size=32, decode_compile_config={"disable": True})
    assert 1 in windowed
    # Prompt lookup's verified rows (up to 9 tokens) read the rings in place too, in graphs of their own.
    speculative = aiocb.SpeculativeConfig(num_speculative_tokens=8, prompt_lookup_min=1, disable_by_batch_size=None)
    verified = _run(
        model, prompts, 48, page_size=32, decode_compile_config={"disable": True}, speculative_config=speculative
    )
    same = sum(a == b for a, b in zip(in_place, verified, strict=True))
    print(f"sliding layers with prompt lookup vs without: {same}/{len(prompts)} identical")
    assert same >= 0.95 * len(prompts)
    # A draft model (the same weights, every layer in full) mirrors the full-attention layers' blocks.
    drafted = aiocb.SpeculativeConfig(
        method="draft", draft_model=_model(torch.float32), num_speculative_tokens=4, disable_by_batch_size=None
    )
    verified = _run(
        model, prompts, 48, page_size=32, decode_compile_config={"disable": True}, speculative_config=drafted
    )
    same = sum(a == b for a, b in zip(in_place, verified, strict=True))
    print(f"sliding layers with a draft model vs without: {same}/{len(prompts)} identical")
    assert same >= 0.95 * len(prompts)
    monkeypatch.setenv("AIOCB_ATTENTION_BACKEND", "reference")
    gathered = _run(model, prompts, 48, page_size=32, use_cuda_graph=False)
    same = sum(a == b for a, b in zip(in_place, gathered, strict=True))
    print(f"sliding layers in place vs gathered: {same}/{len(prompts)} identical")
    assert same >= 0.95 * len(prompts)


def test_gpt_oss_sinks_in_the_triton_kernel_equal_their_reference_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    """gpt-oss's attention sinks (sliding and full layers) through the Triton kernel, in
    decode graphs and eager steps, against the reference backend's gathers."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    config = GptOssConfig(**_SIZES, num_local_experts=4, num_experts_per_tok=2, sliding_window=64)
    model = GptOssForCausalLM(config).to("cuda", torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    _graphs_against_reference(model, _prompts(24, seed=6), 24, "gpt-oss sinks", monkeypatch)


def test_longrope_in_decode_graphs_equals_its_eager_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """Phi-3's longrope chosen per request (aiocb.runner.long_rope) in decode graphs, prompts
    on either side of the original length and crossing it, against eager steps through the
    reference backend (the decode model uncompiled: the phase's time is the other tests')."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "original_max_position_embeddings": 256,
        "short_factor": [1.0] * 16,
        "long_factor": [1.0 + i / 4 for i in range(16)],
    }
    sizes = {**_SIZES, "head_dim": 32}  # (Phi-3's: hidden_size over its heads)
    config = Phi3Config(**sizes, rope_parameters=rope, original_max_position_embeddings=256)
    model = Phi3ForCausalLM(config).to("cuda", torch.float32).eval()
    _graphs_against_reference(model, _prompts(24, seed=7), 48, "longrope", monkeypatch)


def _graphs_against_reference(
    model: PreTrainedModel, prompts: list[list[int]], new: int, what: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``model``'s outputs in decode graphs (the Triton kernel; the decode model uncompiled)
    against eager steps through the reference backend's gathers: 95% identical at least."""
    graphed = _run(model, prompts, new, page_size=32, decode_compile_config={"disable": True})
    monkeypatch.setenv("AIOCB_ATTENTION_BACKEND", "reference")
    eager = _run(model, prompts, new, page_size=32, use_cuda_graph=False)
    same = sum(a == b for a, b in zip(graphed, eager, strict=True))
    print(f"{what} in graphs vs eager reference: {same}/{len(prompts)} identical")
    assert same >= 0.95 * len(prompts)


def test_graphs_and_async_batching_are_on_by_default_on_cuda() -> None:
    model = _model(torch.bfloat16)

    async def main() -> None:
        # (the decode model eager and few graphs: the compile is the next test's, and time)
        config = aiocb.ContinuousBatchingConfig(
            max_memory_percent=0.2, max_requests_per_batch=16, decode_compile_config={"disable": True}
        )
        async with aiocb.Manager(model, continuous_batching_config=config) as manager:
            runner = manager._runner
            assert runner is not None
            assert isinstance(runner.graphs, DecodeGraphs), runner.backends
            assert runner.async_batching
            await manager.generate(_prompts(1)[0], max_new_tokens=8)
            # The warm-up timed a pass without a graph against a replay (speculation's
            # back-off charges it): a small model's eager pass is launch-bound, far slower.
            assert runner.verify_cost > 1.0
            assert manager._steps is not None and manager._steps.scheduler.verify_cost == runner.verify_cost
            print(f"verify_cost: {runner.verify_cost:.2f}")

    asyncio.run(main())


@pytest.fixture
def began(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per CUDA graph capture begun (``CUDAGraph.capture_begin``) from here on."""
    captures: list[int] = []
    capture_begin = torch.cuda.CUDAGraph.capture_begin

    def counting(self: torch.cuda.CUDAGraph, *args: Any, **kwargs: Any) -> None:
        captures.append(1)
        capture_begin(self, *args, **kwargs)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", counting)
    return captures


def test_every_decode_graph_is_captured_before_the_first_step_and_none_later(began: list[int]) -> None:
    """Counted at ``CUDAGraph.capture_begin``: the session's warm-up captures every bucket
    before the first step, and steps of any batch size capture nothing. (The decode model
    eager: the prompt-lookup test below checks the same with it compiled, the default, so
    that the check pays one compile.)"""
    model = _model(torch.bfloat16)
    prompts = _prompts(20, seed=3)

    async def main() -> None:
        config = aiocb.ContinuousBatchingConfig(
            max_memory_percent=0.2, max_requests_per_batch=32, decode_compile_config={"disable": True}
        )
        async with aiocb.Manager(model, continuous_batching_config=config) as manager:
            runner = manager._runner
            assert runner is not None and runner.graphs is not None
            graphs = runner.graphs
            for _ in range(1200):  # (the step thread captures and compiles; the loop stays free)
                if graphs.captured:
                    break
                await asyncio.sleep(0.05)
            assert manager.statistics().steps == 0
            assert len(began) == graphs.captures == len(graphs.buckets)
            print(f"graph captures: {len(began)} buckets in {graphs.capture_seconds:.2f} s, decode model eager")
            for count in (1, 3, 7, 20):
                await manager.generate_batch(prompts[:count], max_new_tokens=6)
            assert len(began) == graphs.captures == len(graphs.buckets)

    asyncio.run(main())


def test_a_draft_model_under_graphs_and_async_batching() -> None:
    """A copy of the target as draft model, on the device's default path (decode graphs,
    async batching, the device copy stream): a batch larger than ``disable_by_batch_size``
    puts the draft to sleep, the requests left catch up and speculate; greedy and sampled
    rows, the outputs those of no speculation and (nearly) every proposal accepted; the
    steps that verify proposals and the draft's passes replay graphs."""
    import copy

    model = _model(torch.float32)
    draft = copy.deepcopy(model)
    prompts = _prompts(8, seed=4)
    lengths = [6, 6, 6, 6, 6, 6, 48, 48]
    spec = aiocb.SpeculativeConfig(method="draft", draft_model=draft, disable_by_batch_size=2)

    replays: list[int] = []

    async def run(speculative: aiocb.SpeculativeConfig | None) -> tuple[list[list[int]], aiocb.ManagerStatistics]:
        config = aiocb.ContinuousBatchingConfig(max_memory_percent=0.2, decode_compile_config={"disable": True})
        async with aiocb.Manager(model, continuous_batching_config=config, speculative_config=speculative) as manager:
            runner = manager._runner
            assert runner is not None and runner.graphs is not None and runner.async_batching
            ids = [
                manager.add_request_nowait(p, max_new_tokens=n, do_sample=False)
                for p, n in zip(prompts[:-1], lengths[:-1], strict=True)
            ]
            ids.append(manager.add_request_nowait(prompts[-1], max_new_tokens=lengths[-1], temperature=0.8, seed=3))
            outputs = [await manager.get_result(rid) for rid in ids]
            stats = manager.statistics()
            assert stats.free_blocks == stats.total_blocks
            if runner.drafter is not None:
                assert runner.drafter.graphs is not None
                replays.extend((runner.graphs.wide_replays, runner.drafter.graphs.wide_replays))
        return [o.generated_tokens for o in outputs], stats  # type: ignore[union-attr]

    plain, _ = asyncio.run(run(None))
    fast, stats = asyncio.run(run(spec))
    same = sum(a == b for a, b in zip(plain, fast, strict=True))
    print(f"draft model on the device: {same}/{len(plain)} identical, {stats.draft_tokens} proposed, "
          f"acceptance {stats.acceptance_rate}, graph replays of steps with proposals: target {replays[0]}, "
          f"draft {replays[1]}")  # fmt: skip
    assert same >= len(plain) - 1  # (verification runs other kernels than decoding)
    # (A copy of the target never pays: each proposed token costs a pass as dear as the
    # target's, so the requests back off after their tries; those tries are what is checked.)
    assert stats.draft_tokens >= 4 and stats.acceptance_rate is not None and stats.acceptance_rate > 0.9
    assert replays[0] > 0 and replays[1] > 0


def test_no_sampled_step_waits_for_the_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    """The session's warm-up compiles the sampler's kernels for every combination of
    filters, for the model's bfloat16 logits and for float32 ones (after a penalty):
    requests that sample with any of them then compile nothing (on the H200 the first
    sampled step of a process stalled for seconds, and the event loop with it)."""
    from aiocb.runner import triton_sampler

    model = _model(torch.bfloat16)
    prompts = _prompts(8, seed=5)
    compiles: list[object] = []
    kernel = triton_sampler._sample_kernel
    do_compile = kernel._do_compile

    def counting(*args: Any, **kwargs: Any) -> Any:
        compiles.append(args[0])
        return do_compile(*args, **kwargs)

    async def main() -> None:
        config = aiocb.ContinuousBatchingConfig(
            max_memory_percent=0.2, max_requests_per_batch=16, decode_compile_config={"disable": True}
        )
        async with aiocb.Manager(model, continuous_batching_config=config) as manager:
            await manager.generate(prompts[0], max_new_tokens=2)  # (after the session's warm-up)
            monkeypatch.setattr(kernel, "_do_compile", counting)
            filters: list[dict[str, Any]] = [
                {},
                {"top_k": 20},
                {"top_p": 0.9},
                {"min_p": 0.05},
                {"top_k": 50, "top_p": 0.8, "min_p": 0.02},
                {"top_p": 0.9, "repetition_penalty": 1.2},  # (float32 logits, after the penalty)
            ]
            # (batches of 1, 2 and 3 rows: the parameters' views into the packed per-step
            # buffer start at every alignment)
            for i, extra in enumerate(filters):
                for rows in (1, 2, 3):
                    params = aiocb.SamplingParams(do_sample=True, temperature=0.8, seed=i, **extra)
                    await manager.generate_batch(prompts[:rows], max_new_tokens=4, sampling_params=params)

    asyncio.run(main())
    assert compiles == []


def test_prompt_lookup_replays_graphs_of_its_steps_with_the_decode_model_compiled(began: list[int]) -> None:
    """Prompt lookup on the default path (the decode model compiled under the graphs):
    every graph, those of steps that verify proposals included, is captured before the
    first step and none later; such steps replay them; the outputs are ``model.generate``'s
    (fp32; one manager, so one compile in the check's time); a verifying step costs about
    a decode step (``verify_cost``)."""
    model = _model(torch.float32)
    prompts = [p[:40] * 4 for p in _prompts(6, seed=5)]  # (copy-heavy: a stretch four times)
    new = 48
    with torch.inference_mode():
        expected = [
            model.generate(torch.tensor([p], device="cuda"), max_new_tokens=new, do_sample=False)[0, len(p) :].tolist()
            for p in prompts
        ]
    spec = aiocb.SpeculativeConfig(prompt_lookup_min=1, disable_by_batch_size=8)

    async def run() -> tuple[list[list[int]], aiocb.ManagerStatistics, dict[str, float]]:
        config = aiocb.ContinuousBatchingConfig(max_memory_percent=0.2, max_requests_per_batch=16)
        async with aiocb.Manager(model, continuous_batching_config=config, speculative_config=spec) as manager:
            runner = manager._runner
            assert runner is not None and runner.graphs is not None
            assert runner._decode_model is not model  # compiled by default under the graphs
            outputs = await manager.generate_batch(prompts, max_new_tokens=new, do_sample=False)
            graphs = runner.graphs
            assert len(began) == graphs.captures == len(graphs.keys), (len(began), graphs.captures)
            for count in (1, 3, 7):  # (steps of other batch sizes capture nothing)
                await manager.generate_batch(prompts[:count], max_new_tokens=4)
            assert len(began) == graphs.captures == len(graphs.keys)
            seen = {
                "replays": graphs.wide_replays,
                "verify_cost": runner.verify_cost,
                "seconds": graphs.capture_seconds,
            }
            return [o.generated_tokens for o in outputs.values()], manager.statistics(), seen

    fast, stats, seen = asyncio.run(run())
    same = sum(a == b for a, b in zip(expected, fast, strict=True))
    print(f"prompt lookup under graphs: {same}/{len(expected)} as model.generate, {stats.draft_tokens} proposed, "
          f"acceptance {stats.acceptance_rate}, {seen['replays']} replays of steps with proposals, "
          f"verify_cost {seen['verify_cost']:.2f}, {len(began)} graphs in {seen['seconds']:.1f} s")  # fmt: skip
    assert same >= len(expected) - 1  # (the compiled model and the kernels round otherwise)
    assert seen["replays"] > 0 and stats.draft_tokens > 0


def test_rows_with_the_rarer_filters_pick_on_the_device_what_they_pick_on_cpu() -> None:
    """A batch mixing rows with top-h, typical-p, epsilon or eta cutoffs and rows without:
    on CUDA (the Triton draw, then the filtered rows drawn again over the vocabulary) each
    row picks what it picks on the CPU, from float32 logits; bfloat16 logits draw too."""
    from aiocb.runner.sampler import SamplingTensors, sample
    from tests.runner.test_filter_chain import MIXED_ROWS as rows

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(rows), 4096, generator=gen) * 3
    on_cpu = sample(logits, SamplingTensors.from_rows(rows, logits.device)).tokens
    device = torch.device("cuda")
    on_gpu = sample(logits.to(device), SamplingTensors.from_rows(rows, device)).tokens.cpu()
    assert on_gpu.tolist() == on_cpu.tolist()
    half = sample(logits.to(device, torch.bfloat16), SamplingTensors.from_rows(rows, device)).tokens
    assert half.shape == (8,) and int(half.min()) >= 0 and int(half.max()) < 4096
