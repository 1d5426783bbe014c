"""When decode CUDA graphs are captured, in which order and mode, and which model they capture.

CUDA is mocked or the capture replaced by an eager stand-in, so the logic runs on the CPU:
every bucket is captured before the first step (at the first decode step under tensor
parallelism), largest first, in ``thread_local`` mode, and never again afterwards; the
decode compile default follows the device and the graphs.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from functools import partial
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel

import aiocb
from aiocb.errors import InvalidConfigError
from aiocb.runner import cuda_graphs
from aiocb.runner.backends import Backend
from aiocb.runner.compile import GRAPHED_DECODE_COMPILE, compile_configs, compiled
from aiocb.runner.cuda_graphs import DecodeGraphs, batch_buckets, query_widths
from aiocb.runner.inputs import AttentionMetadata
from aiocb.runner.model_runner import ModelRunner
from aiocb.runner.tp_driver import DriverRunner
from tests.conftest import random_prompts, reference_generate, tiny_qwen3

# ------------------------------------------------------------------ the capture itself, CUDA mocked


class _FakeCuda:
    """Records the calls ``DecodeGraphs._record`` makes to ``torch.cuda``."""

    def __init__(self) -> None:
        self.pool = object()
        self.pools_made = 0
        self.graph_kwargs: list[dict[str, Any]] = []
        self.capturing = False
        self.streams_made: list[object] = []
        self.warm_up_streams: list[object] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        current = SimpleNamespace(wait_stream=lambda other: None)
        monkeypatch.setattr(cuda_graphs, "_CAPTURE_STREAMS", {})
        monkeypatch.setattr(torch.cuda, "Stream", self._stream)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
        monkeypatch.setattr(torch.cuda, "stream", self._use_stream)
        monkeypatch.setattr(torch.cuda, "graph_pool_handle", self._pool_handle)
        monkeypatch.setattr(torch.cuda, "graph_pool_handle", self._pool_handle)
        monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: SimpleNamespace(replay=lambda: None))
        monkeypatch.setattr(torch.cuda, "graph", self._graph)

    def _stream(self, device: object = None) -> object:
        stream = SimpleNamespace(wait_stream=lambda other: None)
        self.streams_made.append(stream)
        return stream

    def _use_stream(self, stream: object) -> contextlib.nullcontext[None]:
        self.warm_up_streams.append(stream)
        return contextlib.nullcontext()

    def _pool_handle(self) -> object:
        self.pools_made += 1
        return self.pool

    @contextlib.contextmanager
    def _graph(self, graph: object, **kwargs: Any) -> Iterator[None]:
        self.graph_kwargs.append(kwargs)
        self.capturing = True
        try:
            yield
        finally:
            self.capturing = False


def _graphs(runner: ModelRunner, forward: Callable[..., torch.Tensor], max_rows: int) -> DecodeGraphs:
    return DecodeGraphs(forward, runner.cache, [Backend.TRITON], max_rows, 4, runner.device)


def test_capture_all_goes_largest_first_in_thread_local_mode_on_one_pool(
    qwen3: PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = _FakeCuda()
    fake.install(monkeypatch)
    runner = ModelRunner(qwen3, aiocb.ContinuousBatchingConfig(page_size=16, num_blocks=16))
    calls: list[tuple[int, bool]] = []  # (bucket, inside the capture)

    def forward(ids: torch.Tensor, pos: torch.Tensor, keep: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        calls.append((ids.shape[1], fake.capturing))
        # Capture runs on all-padding inputs: every row writes to the trash block.
        trash = runner.cache.trash_block(0) * runner.cache.page_size
        assert meta.num_tokens == ids.shape[1] and bool((meta.groups[0].slot_mapping == trash).all())
        return torch.zeros(ids.shape[1], 3)

    graphs = _graphs(runner, forward, max_rows=20)
    assert graphs.buckets == [1, 2, 4, 8, 16, 20] and not graphs.captured and graphs.capture_seconds is None
    graphs.capture_all()
    order = [bucket for bucket, inside in calls if inside]
    assert order == [20, 16, 8, 4, 2, 1]
    # Two warm-up passes (lazy initialisation, compilation) before each capture, outside it.
    assert [bucket for bucket, inside in calls if not inside] == [b for b in order for _ in range(2)]
    # One stream for every warm-up and capture (cuBLAS keeps a workspace per stream used).
    (stream,) = fake.streams_made
    assert fake.warm_up_streams == [stream] * 6
    expected = {"pool": fake.pool, "stream": stream, "capture_error_mode": "thread_local"}
    assert all(kwargs == expected for kwargs in fake.graph_kwargs)
    assert fake.pools_made == 1 and graphs.captures == 6 and graphs.captured
    assert graphs.capture_seconds is not None and graphs.capture_seconds >= 0
    graphs.capture_all()  # nothing missing: nothing captured
    assert graphs.captures == 6
    graphs.release()
    assert not graphs.captured
    graphs.capture_all()
    assert graphs.captures == 12 and fake.pools_made == 2
    _graphs(runner, forward, max_rows=4).capture_all()  # another manager's graphs
    assert fake.streams_made == [stream]


def test_verify_cost_times_the_smallest_bucket_eagerly_against_its_replay(
    qwen3: PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without graphs of steps that verify proposals, what such a step costs against a
    replay (the speculative back-off's measure): the smallest bucket's pass run eagerly on
    padding inputs, timed against its graph's replay; never below 1."""
    _FakeCuda().install(monkeypatch)
    runner = ModelRunner(qwen3, aiocb.ContinuousBatchingConfig(page_size=16, num_blocks=16))
    graphs = _graphs(runner, lambda ids, *rest: torch.zeros(ids.shape[1], 3), max_rows=8)
    graphs.capture_all()
    _, logits = graphs._graphs[(1, 1)]
    graphs._graphs[(1, 1)] = (SimpleNamespace(replay=lambda: time.sleep(0.002)), logits)  # type: ignore[assignment]
    rows: list[int] = []

    def eager(ids: torch.Tensor, pos: torch.Tensor, keep: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        rows.append(ids.shape[1])
        trash = runner.cache.trash_block(0) * runner.cache.page_size
        assert bool((meta.groups[0].slot_mapping == trash).all())  # (padding: no real KV touched)
        time.sleep(0.008)
        return torch.zeros(ids.shape[1], 3)

    assert 2.0 < graphs.verify_cost(eager) < 8.0
    assert rows == [1] * 6  # (one untimed pass, then five)
    assert graphs.verify_cost(lambda *args: torch.zeros(1, 3)) == 1.0  # (faster than a replay: 1)


def test_query_widths_double_the_proposal_up_to_the_most() -> None:
    assert query_widths(1) == [2]
    assert query_widths(3) == [2, 3, 4]
    assert query_widths(4) == [2, 3, 5]
    assert query_widths(6) == [2, 3, 5, 7]
    assert query_widths(8) == [2, 3, 5, 9]


def test_graphs_of_steps_with_proposals_are_captured_with_the_decode_ones_by_token_slots(
    qwen3: PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given query widths, every (row bucket, width) gets a graph of ``bucket x width`` token
    slots, captured with the decode graphs, the most slots first, each on padding inputs
    of rows of ``width`` tokens that write only to the trash block; all of them write their
    logits to one buffer."""
    fake = _FakeCuda()
    fake.install(monkeypatch)
    runner = ModelRunner(qwen3, aiocb.ContinuousBatchingConfig(page_size=16, num_blocks=16))
    captured: list[tuple[int, int, list[int]]] = []  # (token slots, max query length, query starts)

    def forward(ids: torch.Tensor, pos: torch.Tensor, keep: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if fake.capturing:
            captured.append((ids.shape[1], meta.max_query_len, meta.query_start.tolist()))
        trash = runner.cache.trash_block(0) * runner.cache.page_size
        assert bool((meta.groups[0].slot_mapping == trash).all()) and keep.shape[0] == ids.shape[1]
        assert meta.num_tokens == ids.shape[1] == len(meta.seq_lens) * meta.max_query_len
        assert bool((meta.seq_lens == meta.max_query_len).all())
        return torch.zeros(ids.shape[1], 3)

    graphs = DecodeGraphs(
        forward, runner.cache, [Backend.TRITON], 8, 4, runner.device, widths=[1, 2, 3, 5], max_wide_rows=2
    )
    assert graphs.buckets == [1, 2, 4, 8] and graphs.wide_buckets == [1, 2] and graphs.widths == [2, 3, 5]
    graphs.capture_all()
    assert graphs.captured and graphs.captures == 4 + 2 * 3
    assert [(slots, width) for slots, width, _ in captured] == [
        (10, 5), (8, 1), (6, 3), (5, 5), (4, 1), (4, 2), (3, 3), (2, 1), (2, 2), (1, 1)
    ]  # fmt: skip
    assert captured[0][2] == [0, 5, 10] and captured[1][2] == list(range(9))
    # Every graph leaves its logits in one buffer of the most token slots' rows.
    shared = graphs._logits_out
    assert shared is not None and shared.shape == (10, 3)
    for (bucket, width), (_, logits) in graphs._graphs.items():
        assert logits.data_ptr() == shared.data_ptr() and logits.shape == (bucket * width, 3)
    # Without proposals configured (or without rows for them): the decode graphs alone.
    assert DecodeGraphs(forward, runner.cache, [Backend.TRITON], 8, 4, runner.device, widths=[2, 3]).keys == [
        (8, 1), (4, 1), (2, 1), (1, 1)
    ]  # fmt: skip


def test_verify_cost_with_graphs_of_steps_with_proposals_times_the_widest_replay(
    qwen3: PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With graphs of steps that verify proposals, the measure is the smallest bucket's
    widest graph replayed against the smallest decode graph; nothing runs eagerly."""
    _FakeCuda().install(monkeypatch)
    runner = ModelRunner(qwen3, aiocb.ContinuousBatchingConfig(page_size=16, num_blocks=16))
    graphs = DecodeGraphs(
        lambda ids, *rest: torch.zeros(ids.shape[1], 3), runner.cache, [Backend.TRITON], 8, 4, runner.device,
        widths=[2, 5], max_wide_rows=4,
    )  # fmt: skip
    graphs.capture_all()
    for key, seconds in (((1, 1), 0.002), ((1, 5), 0.005)):
        _, logits = graphs._graphs[key]
        replay = partial(time.sleep, seconds)
        graphs._graphs[key] = (SimpleNamespace(replay=replay), logits)  # type: ignore[assignment]

    def eager(*args: object) -> torch.Tensor:
        raise AssertionError("no eager pass: a step with proposals replays a graph")

    assert 1.5 < graphs.verify_cost(eager) < 4.0


def test_ranks_that_agree_on_the_plan_capture_the_same_buckets_in_the_same_order(
    qwen3: PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every tensor-parallel rank builds its graphs from the agreed plan's row count: the
    capture order (and so the order of the warm-up passes' collectives) depends on it alone."""
    _FakeCuda().install(monkeypatch)
    runner = ModelRunner(qwen3, aiocb.ContinuousBatchingConfig(page_size=16, num_blocks=16))
    for max_rows in (1, 5, 48, 1000):
        orders: list[list[int]] = []
        for _ in range(2):
            order: list[int] = []

            def forward(ids: torch.Tensor, *rest: object, order: list[int] = order) -> torch.Tensor:
                order.append(ids.shape[1])
                return torch.zeros(ids.shape[1], 3)

            _graphs(runner, forward, max_rows).capture_all()
            orders.append(order[2::3])  # the captured pass of each bucket
        assert orders[0] == orders[1] == sorted(batch_buckets(max_rows), reverse=True)


# ------------------------------------------------------------------ through the manager, capture stood in for


def _serve(model: PreTrainedModel, config: aiocb.ContinuousBatchingConfig, rounds: list[list[list[int]]]) -> Any:
    """Run ``rounds`` of prompts through one manager; per round the outputs and the graph
    captures so far, and the runner."""

    async def main() -> tuple[list[tuple[list[list[int]], int]], ModelRunner]:
        seen = []
        async with aiocb.Manager(model, continuous_batching_config=config) as manager:
            runner = manager._runner
            assert runner is not None and runner.graphs is not None
            # (the step thread compiles and captures: seconds, a minute or more on a busy machine)
            deadline = time.monotonic() + 300
            while not runner.graphs.captured and time.monotonic() < deadline:  # noqa: ASYNC110 (nothing to wait on)
                await asyncio.sleep(0.01)
            # Every graph before any request came, hence before the first step.
            assert runner.graphs.captured and manager.statistics().steps == 0
            # Captured without autograd: no graph of saved activations held in the pool.
            assert not any(out.requires_grad for _, out in runner.graphs._graphs.values())
            # Inputs of the kind the eager steps' are (inference tensors): a compiled decode
            # model that saw both would compile a second variant of each of its frames.
            assert runner.graphs._input_ids.is_inference() and runner.graphs._positions.is_inference()
            for prompts in rounds:
                outputs = await manager.generate_batch(prompts, max_new_tokens=5)
                seen.append(([o.generated_tokens for o in outputs.values()], runner.graphs.captures))
        return seen, runner

    return asyncio.run(main())


def _check_captured_once(
    model: PreTrainedModel, config: aiocb.ContinuousBatchingConfig, captured: list[int], rounds: int = 3
) -> Any:
    """Serve ``rounds`` of prompts (up to three): every bucket captured before the first
    step and none after, the outputs generate's."""
    prompts = [random_prompts(3, 4, 30, seed=5), random_prompts(6, 3, 40, seed=6), random_prompts(1, 9, 9, seed=7)]
    seen, runner = _serve(model, config, prompts[-rounds:])
    buckets = runner.graphs.buckets
    assert buckets == [1, 2, 4, 6]
    assert captured == [6, 4, 2, 1]  # every bucket before the first step, largest first
    assert [captures for _, captures in seen] == [4] * rounds  # and none afterwards
    assert runner.graphs.capture_seconds is not None
    for (outputs, _), batch in zip(seen, prompts[-rounds:], strict=True):
        assert outputs == [reference_generate(model, p, 5) for p in batch]
    return runner


def test_every_bucket_is_captured_before_the_first_step_and_never_again(graphs_on_cpu: list[int]) -> None:
    model = tiny_qwen3()
    config = aiocb.ContinuousBatchingConfig(
        page_size=16, num_blocks=64, max_requests_per_batch=6, decode_compile_config={"disable": True}
    )
    runner = _check_captured_once(model, config, graphs_on_cpu)
    assert runner._decode_model is model  # the opt-out: no compiled wrapper


@pytest.mark.parametrize("decode_compiled", [True, False])
def test_a_warm_up_that_compiled_collects_then_freezes_once(
    graphs_on_cpu: list[int], monkeypatch: pytest.MonkeyPatch, decode_compiled: bool
) -> None:
    """The objects a decode model's compile leaves (long-lived, hundreds of thousands) go
    out of the collector's view after the warm-up that made them: a full collection, then
    a freeze, once (no capture later: no second freeze); never without a compile."""
    import gc

    calls: list[str] = []
    monkeypatch.setattr("aiocb.engine.manager._model_frozen", True)  # (the first manager's freeze: done)
    monkeypatch.setattr(gc, "collect", lambda *args: calls.append("collect") or 0)
    monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))

    # (a stand-in for torch.compile: any decode model that is not the model itself)
    def compile_stand_in(model: PreTrainedModel, arguments: dict[str, Any] | None) -> Any:
        return model if arguments is None or arguments.get("disable") else partial(model)

    monkeypatch.setattr("aiocb.runner.model_runner.compiled", compile_stand_in)
    model = tiny_qwen3()
    decode = None if decode_compiled else {"disable": True}
    config = aiocb.ContinuousBatchingConfig(
        page_size=16, num_blocks=64, max_requests_per_batch=6, decode_compile_config=decode
    )
    runner = _check_captured_once(
        model, config, graphs_on_cpu, rounds=1
    )  # (one short round: the freeze comes before it)
    assert (runner._decode_model is not model) == decode_compiled
    # (other code collects too: what matters is one freeze, right after a collection)
    assert calls.count("freeze") == int(decode_compiled)
    assert all(calls[i - 1] == "collect" for i, call in enumerate(calls) if call == "freeze")


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_the_default_compiled_decode_model_is_what_the_graphs_capture(
    graphs_on_cpu: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With graphs on and no compile asked for, the graphs capture the compiled decode model
    (compiled in the warm-up before the first capture), and its greedy tokens are generate's."""
    model = tiny_qwen3()
    made: list[dict[str, Any] | None] = []

    def compile_and_note(model: PreTrainedModel, arguments: dict[str, Any] | None) -> Any:
        made.append(arguments)
        return compiled(model, arguments)

    monkeypatch.setattr("aiocb.runner.model_runner.compiled", compile_and_note)
    config = aiocb.ContinuousBatchingConfig(page_size=16, num_blocks=64, max_requests_per_batch=6)
    runner = _check_captured_once(model, config, graphs_on_cpu)
    assert made == [None, GRAPHED_DECODE_COMPILE]  # (mixed steps stay eager)
    assert isinstance(runner._decode_model, torch._dynamo.eval_frame.OptimizedModule)


# ------------------------------------------------------------------ tensor parallelism: re-init


def test_rank_zero_drops_its_graphs_when_the_followers_build_a_new_cache(
    qwen3: PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A persistent manager's runner attached after another manager's replaced the
    followers' cache: they build new runners, which capture at the next decode step, so
    rank 0 must capture there too (its old graphs are dropped)."""
    _FakeCuda().install(monkeypatch)
    runner = ModelRunner(qwen3, aiocb.ContinuousBatchingConfig(page_size=16, num_blocks=16))
    sent: list[str] = []
    driver = SimpleNamespace(
        closed=False,
        current=None,
        call=lambda what, job: job(),
        send=lambda kind, *payload: sent.append(kind),
        channel=SimpleNamespace(set_timeout=lambda timeout: None, gather=lambda answer: [answer, None]),
        claim=lambda runner: None,
    )
    driving = DriverRunner.__new__(DriverRunner)
    driving.__dict__.update(runner.__dict__)
    driving.__dict__.update(_driver=driver, _num_requests_hint=None, _speculative=None, _keep_cache=True)
    driving.layout = SimpleNamespace(followers=(1,))  # (each follower says it built its runner)
    driving.graphs = _graphs(runner, lambda ids, *rest: torch.zeros(ids.shape[1], 3), max_rows=4)
    driving.graphs.capture_all()
    try:
        driving.attach()  # the followers hold another runner's cache
        assert sent == ["init", "attach"] and driver.current is driving
        assert not driving.graphs.captured
        driving.graphs.capture_all()
        driving.attach()  # they hold this one's: nothing rebuilt, the graphs stay
        assert sent == ["init", "attach", "attach"] and driving.graphs.captured
    finally:
        ModelRunner.detach(driving)


# ------------------------------------------------------------------ which compile for which runner


def test_the_decode_compile_default_follows_the_graphs() -> None:
    default = aiocb.ContinuousBatchingConfig()
    assert compile_configs(default) == (None, None)
    assert compile_configs(default, decode_graphs=True) == (None, GRAPHED_DECODE_COMPILE)
    assert compile_configs(default, decode_graphs=True, tensor_parallel=True) == (None, None)
    level = aiocb.ContinuousBatchingConfig(default_compile_level=2)
    both = {"mode": "max-autotune-no-cudagraphs", "dynamic": True}
    assert compile_configs(level, decode_graphs=True) == (both, both)
    off = aiocb.ContinuousBatchingConfig(decode_compile_config={"disable": True})
    assert compile_configs(off, decode_graphs=True) == (None, {"disable": True})
    explicit = aiocb.ContinuousBatchingConfig(decode_compile_config={"mode": "default", "dynamic": False})
    assert compile_configs(explicit, decode_graphs=True, tensor_parallel=True)[1] == {
        "mode": "default",
        "dynamic": False,
    }


@pytest.mark.parametrize(
    "decode", [{"mode": "reduce-overhead"}, {"mode": "max-autotune"}, {"options": {"triton.cudagraphs": True}}]
)
def test_a_decode_compile_with_its_own_cuda_graphs_is_refused_under_ours(decode: dict[str, Any]) -> None:
    config = aiocb.ContinuousBatchingConfig(decode_compile_config=decode)
    with pytest.raises(InvalidConfigError, match="decode_compile_config"):
        compile_configs(config, decode_graphs=True)
    assert compile_configs(config)[1] == decode  # without aiocb's graphs it is torch.compile's business


def test_compiled_honours_disable(qwen3: PreTrainedModel) -> None:
    assert compiled(qwen3, None) is qwen3
    assert compiled(qwen3, {"disable": True, "mode": "default"}) is qwen3


def test_runners_without_decode_graphs_keep_the_eager_decode_model(qwen3: PreTrainedModel) -> None:
    runner = ModelRunner(qwen3, aiocb.ContinuousBatchingConfig(page_size=16, num_blocks=16))
    assert runner.graphs is None and runner._decode_model is qwen3 and runner._varlen_model is qwen3


async def test_only_steps_shaped_as_the_graphs_run_on_the_decode_model(
    qwen3: PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step of one-token rows that samples none of them (a prompt fed a token a step)
    runs on the varlen model: a compiled decode model guards on one sampled token a row,
    and another shape recompiled it mid-serving."""
    from aiocb.runner import attention

    seen: list[tuple[str, int, int]] = []
    forward = attention.forward

    def recorded(model: Any, input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        kind = "decode" if model == "decode" else "varlen"
        logits_indices = args[1]
        seen.append((kind, input_ids.shape[1], len(logits_indices)))
        return forward(qwen3, input_ids, *args, **kwargs)

    monkeypatch.setattr(attention, "forward", recorded)
    config = aiocb.ContinuousBatchingConfig(page_size=16, num_blocks=64, max_batch_tokens=1, max_requests_per_batch=1)
    prompt = random_prompts(1, 3, 3, seed=4)[0]
    async with aiocb.Manager(qwen3, continuous_batching_config=config) as manager:
        runner = manager._runner
        assert runner is not None
        runner._decode_model, runner._varlen_model = "decode", "varlen"
        output = await manager.generate(prompt, max_new_tokens=3)
    assert output.generated_tokens == reference_generate(qwen3, prompt, 3)
    assert seen == [("varlen", 1, 0), ("varlen", 1, 0), ("decode", 1, 1), ("decode", 1, 1), ("decode", 1, 1)]


def test_a_session_cancelled_during_its_warm_up_ends_after_it(
    qwen3: PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step loop's task cancelled while the step thread warms up (the event loop
    closing): the session's end, which gives the model back its own attention, waits until
    the step thread has left the model."""
    seen: list[str] = []

    def slow_warm_up(self: ModelRunner) -> None:
        time.sleep(0.3)
        seen.append(self.model.config._attn_implementation)  # still ours at the warm-up's end?

    monkeypatch.setattr(ModelRunner, "warm_up", slow_warm_up)
    original = qwen3.config._attn_implementation

    async def main() -> None:
        manager = aiocb.Manager(qwen3)
        manager.start()
        await asyncio.sleep(0.05)  # (the step thread is in its warm-up)
        assert manager._task is not None
        manager._task.cancel()
        await asyncio.gather(manager._task, return_exceptions=True)
        assert len(seen) == 1 and seen[0] != original  # the warm-up ended before the session did
        assert qwen3.config._attn_implementation == original

    asyncio.run(main())


def test_a_decode_step_that_cannot_be_captured_runs_eagerly_unless_graphs_were_asked_for(
    graphs_on_cpu: list[int], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A forward that reads a device value on the host (a dynamic RoPE, say) fails to
    capture: with the device's default graphs, decode steps then run on the model itself,
    outputs unchanged; with ``use_cuda_graph=True`` the manager fails to start, saying so."""

    def uncapturable(self: DecodeGraphs, args: Any) -> Any:
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(DecodeGraphs, "_record", uncapturable)
    # (a stand-in for torch.compile's decode model: the graphs' compile is left too)
    monkeypatch.setattr("aiocb.runner.model_runner.compiled", lambda model, arguments: partial(model))
    model = tiny_qwen3()
    prompts = random_prompts(3, 4, 30, seed=8)
    config = aiocb.ContinuousBatchingConfig(page_size=16, num_blocks=64, max_requests_per_batch=4)

    async def main(config: aiocb.ContinuousBatchingConfig) -> list[list[int]]:
        async with aiocb.Manager(model, continuous_batching_config=config) as manager:
            outputs = await manager.generate_batch(prompts, max_new_tokens=5)
            runner = manager._runner
            assert runner is not None and runner.graphs is None and runner._decode_model is model
        return [o.generated_tokens for o in outputs.values()]

    with caplog.at_level("ERROR", logger="aiocb.runner.model_runner"):
        assert asyncio.run(main(config)) == [reference_generate(model, p, 5) for p in prompts]
    assert "CUDA graphs failed: they run eagerly" in caplog.text
    asked = aiocb.ContinuousBatchingConfig(page_size=16, num_blocks=64, max_requests_per_batch=4, use_cuda_graph=True)
    with pytest.raises(Exception, match="operation not permitted") as caught:
        asyncio.run(main(asked))
    error: BaseException | None = caught.value
    while error is not None and not getattr(error, "__notes__", None):
        error = error.__cause__
    assert error is not None and "use_cuda_graph=False" in error.__notes__[0]
