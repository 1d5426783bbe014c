"""Steps that verify speculative proposals replay CUDA graphs of their own (stood in for on
the CPU, the Triton kernels interpreted): outputs token for token those of no speculation,
for prompt lookup and a draft model, under async batching; every such replay equal to the
eager pass on the same inputs and writing only the step's blocks and the trash block; the
draft model's passes replay its own graphs; nothing captured after the warm-up; a failed
capture of those graphs leaves their steps eager."""

from __future__ import annotations

import copy
import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import aiocb
from aiocb.runner.cuda_graphs import DecodeGraphs
from aiocb.runner.inputs import StepInputs
from aiocb.runner.model_runner import ModelRunner
from tests.conftest import random_prompts, reference_generate, tiny_qwen3

#: copy-heavy prompts (a stretch three times), and two plain ones
PROMPTS = [p * 3 for p in random_prompts(3, 6, 12, seed=5)] + random_prompts(2, 5, 20, seed=6)
NEW = 16


@pytest.fixture
def checked_replays(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every replay of a graph of a step with proposals is checked against the eager pass of
    the same inputs over the same cache, and for the blocks it writes; returns the widths
    replayed."""
    widths: list[int] = []
    replay = DecodeGraphs.run_wide

    def run_wide(
        self: DecodeGraphs, inputs: StepInputs, num_rows: int, width: int, logits_indices: torch.Tensor | None = None
    ) -> torch.Tensor:
        cache = self._cache
        tensors = [*cache.key, *cache.value]
        before = [t.clone() for t in tensors]
        logits = replay(self, inputs, num_rows, width, logits_indices).clone()
        after = [t.clone() for t in tensors]
        # Only the blocks of the step's rows, and the trash block, were written.
        (group,) = inputs.attention.groups
        allowed = (set(group.block_table.flatten().tolist()) - {cache.null_block(0)}) | {cache.trash_block(0)}
        for old, new in zip(before, after, strict=True):
            changed = (old.view(torch.int32) != new.view(torch.int32)).flatten(1).any(1)  # (bits: NaN garbage)
            assert set(changed.nonzero().flatten().tolist()) <= allowed
        # The same logits as the eager pass over the step's own inputs, from the same cache.
        for tensor, old in zip(tensors, before, strict=True):
            tensor.copy_(old)
        keep = inputs.logits_indices if logits_indices is None else logits_indices
        metadata = dataclasses.replace(inputs.attention, cache=cache)
        eager = self._forward(inputs.input_ids[None], inputs.position_ids[None], keep, metadata)
        torch.testing.assert_close(logits, eager, atol=1e-4, rtol=1e-4)
        for tensor, new in zip(tensors, after, strict=True):
            tensor.copy_(new)
        widths.append(width)
        return logits

    monkeypatch.setattr(DecodeGraphs, "run_wide", run_wide)
    return widths


def _replays(graphs: DecodeGraphs, width: int) -> int:
    return sum(graph.replays for (_, w), (graph, _) in graphs._graphs.items() if w == width)  # type: ignore[attr-defined]


async def _serve(
    speculative: aiocb.SpeculativeConfig | None, model: Any, **params: Any
) -> tuple[list[list[int]], ModelRunner, Any]:
    config = aiocb.ContinuousBatchingConfig(
        page_size=16, num_blocks=96, max_requests_per_batch=4, decode_compile_config={"disable": True}
    )
    async with aiocb.Manager(model, continuous_batching_config=config, speculative_config=speculative) as manager:
        runner = manager._runner
        assert runner is not None and runner.graphs is not None and runner.async_batching
        outputs = await manager.generate_batch(PROMPTS, max_new_tokens=NEW, **params)
        stats = manager.statistics()
        assert manager._steps is not None and manager._steps.scheduler.verify_cost == runner.verify_cost
    return [o.generated_tokens for o in outputs.values()], runner, stats


# (the draft one: 22 s of the default session; its outputs are checked eagerly there too)
@pytest.mark.parametrize("method", ["ngram", pytest.param("draft", marks=pytest.mark.slow)])
async def test_steps_with_proposals_replay_graphs_and_equal_no_speculation(
    graphs_on_cpu: list[int], checked_replays: list[int], method: str
) -> None:
    model = tiny_qwen3()
    if method == "ngram":
        speculative = aiocb.SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1)
    else:  # a copy of the model: every proposal accepted
        speculative = aiocb.SpeculativeConfig(
            method="draft", draft_model=copy.deepcopy(model), num_speculative_tokens=3
        )
    outputs, runner, stats = await _serve(speculative, model)
    assert outputs == [reference_generate(model, p, NEW) for p in PROMPTS]
    assert stats.accepted_draft_tokens > 0
    graphs = runner.graphs
    assert graphs is not None
    assert graphs.widths == ([2, 3, 5] if method == "ngram" else [2, 3, 4]) and graphs.wide_buckets == [1, 2, 4]
    # Every graph before the first step, none after.
    assert graphs.captures == len(graphs.keys)
    captured = len(graphs.keys)
    # The target's steps with proposals replayed graphs (each checked), several widths of them.
    assert graphs.wide_replays > 0
    if method == "draft":
        drafter = runner.drafter
        assert drafter is not None and drafter.graphs is not None
        captured += len(drafter.graphs.keys)
        assert drafter.graphs.captures == len(drafter.graphs.keys)
        # Its pass over the step's inputs (the checked ones besides the target's), and its
        # decode passes, one for each proposal after the first.
        assert drafter.graphs.wide_replays > 0 and _replays(drafter.graphs, 1) > 0
        # (its graphs keep one token's logits a row, the target's every token's)
        assert drafter.graphs._logits_out is not None and graphs._logits_out is not None
        assert drafter.graphs._logits_out.shape[0] == 4 and graphs._logits_out.shape[0] == 4 * 4
        assert len(checked_replays) == graphs.wide_replays + drafter.graphs.wide_replays
        assert stats.accepted_draft_tokens == stats.draft_tokens  # (a copy of the model)
    else:
        assert len(checked_replays) == graphs.wide_replays
        assert len(set(checked_replays)) > 1, "proposals of several widths"
    assert len(graphs_on_cpu) == captured
    assert runner.verify_cost >= 1.0


@pytest.mark.slow  # (35 s of the default session; sampled speculation is checked eagerly there)
async def test_sampled_rows_under_graphs_equal_no_speculation(
    graphs_on_cpu: list[int], checked_replays: list[int]
) -> None:
    """Seeded sampled rows (temperature, top-k) with a copy of the model as draft: the
    draws at the verified positions come from the graphs' shared logits buffer, the
    draft's from its own graphs; the outputs are those of no speculation (under the decode
    graphs alone)."""
    model = tiny_qwen3()
    params = {"temperature": 0.8, "top_k": 20, "seed": 5}
    draft = aiocb.SpeculativeConfig(method="draft", draft_model=copy.deepcopy(model), num_speculative_tokens=3)
    fast, runner, stats = await _serve(draft, model, **params)
    plain, _, _ = await _serve(None, model, **params)
    assert fast == plain
    assert stats.accepted_draft_tokens > 0 and checked_replays
    assert runner.graphs is not None and runner.graphs.wide_replays > 0


def test_wide_graphs_run_steps_whose_block_tables_fit_theirs() -> None:
    """A step whose rows' block tables are wider than the graphs' runs eagerly (a context
    that fills them runs in a graph: the padding tokens after the step's own belong to no
    row and read nothing); so does one with a prompt token scored, or a row that computes a
    prompt chunk, or more rows than the graphs hold."""
    runner = ModelRunner(tiny_qwen3(), aiocb.ContinuousBatchingConfig(page_size=16, num_blocks=16))
    graphs = DecodeGraphs(
        lambda *args: torch.zeros(1), runner.cache, runner.backends, 4, 4, runner.device,
        widths=[2, 3, 5], max_wide_rows=4,
    )  # fmt: skip

    def width(tokens: list[int], drafts: int, longest_context: int, blocks: int = 4, **changes: Any) -> int:
        rows = len(tokens)
        batch = SimpleNamespace(num_rows=rows, num_sampled=rows, num_drafts=drafts, prompt_targets={})
        for name, value in changes.items():
            setattr(batch, name, value)
        group = SimpleNamespace(block_table=torch.zeros(rows, blocks), backend=runner.backends[0])
        metadata = SimpleNamespace(
            groups=[group], num_tokens=sum(tokens), max_query_len=max(tokens), max_seq_len=longest_context
        )
        return graphs.width_for(batch, SimpleNamespace(attention=metadata))  # type: ignore[arg-type]

    assert width([3, 1], 2, 40) == 3
    assert width([4, 2], 4, 40) == 5
    assert width([4, 2], 4, 64) == 5  # (the 4 blocks of 16 the graphs' tables hold, full)
    assert width([4, 2], 4, 65, blocks=5) == 0
    assert width([1, 1], 0, 40) == 0  # (a decode step: the decode graphs')
    assert width([6, 1], 5, 40) == 0  # (wider than any graph)
    assert width([3, 4], 2, 40) == 0  # (a prompt chunk)
    assert width([3, 1], 2, 40, prompt_targets={1: (5,)}) == 0
    assert width([3, 1], 2, 40, num_sampled=1) == 0
    assert width([2] * 5, 5, 40) == 0  # (more rows than the graphs hold)


@pytest.mark.slow  # (20 s of the default session; the graphs of proposals are checked there)
async def test_a_failed_capture_of_speculations_graphs_leaves_its_steps_eager(
    graphs_on_cpu: list[int], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Graphs of steps that verify proposals, and the draft model's, only speed speculation
    up: when their capture fails the runner serves without them, outputs unchanged."""
    record = DecodeGraphs._record

    def failing(self: DecodeGraphs, args: Any) -> Any:
        if args[3].max_query_len > 1:
            raise RuntimeError("operation not permitted when stream is capturing")
        return record(self, args)

    monkeypatch.setattr(DecodeGraphs, "_record", failing)
    model = tiny_qwen3()
    speculative = aiocb.SpeculativeConfig(method="draft", draft_model=copy.deepcopy(model), num_speculative_tokens=3)
    outputs, runner, stats = await _serve(speculative, model)
    assert outputs == [reference_generate(model, p, NEW) for p in PROMPTS]
    assert stats.accepted_draft_tokens == stats.draft_tokens > 0
    assert runner.graphs is not None and runner.graphs.widths == [] and runner.graphs.captured
    assert _replays(runner.graphs, 1) > 0  # (decode steps still replay theirs)
    assert runner.drafter is not None and runner.drafter.graphs is None
    messages = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert any("verify proposals failed" in m for m in messages)
    assert any("draft model's CUDA graphs failed" in m for m in messages)
