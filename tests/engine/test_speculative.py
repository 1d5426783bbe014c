"""Speculative decoding (prompt lookup and a draft model): outputs token for token those
of no speculation, greedy and sampled, under chunked prefill, prefix sharing, preemption
and async batching; proposals that are accepted and rejected; blocks given back; bad
configs refused."""

from __future__ import annotations

import asyncio
import copy
from collections import Counter
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel

import aiocb
from tests.conftest import MODELS, random_prompts

NEW = 120


def _prompts() -> list[list[int]]:
    # Repeated stretches (copy-heavy) and plain random prompts, of varied lengths.
    base = random_prompts(6, 8, 40, seed=5)
    return [p * 3 for p in base[:3]] + base[3:] + random_prompts(4, 60, 200, seed=6)


PROMPTS = _prompts()
#: run after PROMPTS, in the same manager, the first alone: the others read its cached
#: blocks (a prefix of more than one default page of 256 tokens)
SHARED = [PROMPTS[7] + PROMPTS[8] + tail for tail in random_prompts(3, 5, 12, seed=7)]
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
        first = await manager.generate(SHARED[0], max_new_tokens=NEW, **params)
        again = await manager.generate_batch(SHARED[1:], max_new_tokens=NEW, **params)
        stats = manager.statistics()
    assert stats.free_blocks == stats.total_blocks, "blocks leaked"
    assert stats.prefix_hit_tokens > 0, "prompts shared cached blocks"
    assert isinstance(first, aiocb.GenerationOutput)
    return [*outputs.values(), first, *again.values()], stats


#: outputs without speculation, by (model class, config name, sampling): the same run for
#: every case that compares against it (the models are seeded, the runs deterministic)
_PLAIN: dict[tuple[str, str, str], list[aiocb.GenerationOutput]] = {}


async def _plain(
    model: PreTrainedModel, config_name: str, sampling: str, params: dict[str, Any]
) -> list[aiocb.GenerationOutput]:
    key = (type(model).__name__, config_name, sampling)
    if key not in _PLAIN:
        _PLAIN[key], _ = await _run(model, None, CONFIGS[config_name], **params)
    return _PLAIN[key]


# (llama's cases run with `nox -s slow`; the gate checks llama's parity in tests/runner/test_parity.py)
@pytest.fixture(
    scope="module",
    params=[name if name == "qwen3" else pytest.param(name, marks=pytest.mark.slow) for name in sorted(MODELS)],
)
def model(request: pytest.FixtureRequest) -> PreTrainedModel:
    return MODELS[request.param]()


@pytest.fixture(
    scope="module",
    params=[name if name == "qwen3" else pytest.param(name, marks=pytest.mark.slow) for name in sorted(MODELS)],
)
def engine_model(request: pytest.FixtureRequest) -> PreTrainedModel:
    """The models for the engine's mechanisms (streams, sleeping drafts), whose tests are
    among the suite's longest: one in the default session, the others in ``nox -s slow``
    (outputs against no speculation stay on every architecture)."""
    return MODELS[request.param]()


CASES = [(name, "greedy") for name in sorted(CONFIGS)] + [("default", "sampled"), ("async_batching", "sampled")]


@pytest.mark.parametrize(("config_name", "sampling"), CASES)
async def test_outputs_equal_no_speculation(model: PreTrainedModel, config_name: str, sampling: str) -> None:
    params: dict[str, Any] = (
        {"do_sample": False} if sampling == "greedy" else {"temperature": 0.4, "top_k": 50, "seed": 7}
    )
    config = CONFIGS[config_name]
    plain = await _plain(model, config_name, sampling, params)
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
    speculative = aiocb.SpeculativeConfig(prompt_lookup_min=1, disable_by_batch_size=None)
    plain, _ = await _first_three(model, prompt, None, 0, draws)
    fast, stats = await _first_three(model, prompt, speculative, 0, draws)
    other, _ = await _first_three(model, prompt, None, draws, draws)
    assert stats.accepted_draft_tokens > 0, "some samples took proposed tokens"
    assert _total_variation(plain, fast) == 0.0 < _total_variation(plain, other)


async def _first_three(
    model: PreTrainedModel, prompt: list[int], spec: aiocb.SpeculativeConfig | None, seed: int, draws: int
) -> tuple[Counter[tuple[int, ...]], aiocb.ManagerStatistics]:
    """How often each first three tokens came up in ``draws`` seeded samples (temperature 1)."""
    # (64 rows a step: at a thousand, speculation turns itself down and hardly proposes)
    config = aiocb.ContinuousBatchingConfig(max_queue_size=0, max_batch_tokens=8192, max_requests_per_batch=64)
    async with aiocb.Manager(model, continuous_batching_config=config, speculative_config=spec) as manager:
        samples = await manager.generate(prompt, max_new_tokens=4, temperature=1.0, seed=seed, n=draws)
        stats = manager.statistics()
    assert isinstance(samples, list)
    return Counter(tuple(sample.generated_tokens[:3]) for sample in samples), stats


def _total_variation(a: Counter[tuple[int, ...]], b: Counter[tuple[int, ...]]) -> float:
    return 0.5 * sum(abs(a[k] - b[k]) for k in a.keys() | b.keys()) / sum(a.values())


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


@pytest.mark.parametrize("method", ["ngram", "draft"])
async def test_streams_logprobs_and_cancellation_mid_speculation(engine_model: PreTrainedModel, method: str) -> None:
    model = engine_model
    if method == "draft":
        speculative = _draft_config(_draft(model, "same"))
    else:
        speculative = aiocb.SpeculativeConfig(prompt_lookup_min=1, disable_by_batch_size=None)
    params: dict[str, Any] = {"max_new_tokens": NEW, "do_sample": False, "return_logprobs": True}
    async with aiocb.Manager(model) as manager:
        reference = await manager.generate(PROMPTS[0], **params)
    assert isinstance(reference, aiocb.GenerationOutput)
    async with aiocb.Manager(model, speculative_config=speculative) as manager:
        rid = await manager.add_request(PROMPTS[0], **params)
        sizes, last = [], None
        async for chunk in manager.stream(rid):
            sizes.append(len(chunk.generated_tokens) - (0 if last is None else len(last.generated_tokens)))
            last = chunk
        assert last is not None and last.generated_tokens == reference.generated_tokens
        assert last.logprobs == pytest.approx(reference.logprobs, abs=1e-4)
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
    manager = aiocb.Manager(model, speculative_config=config)
    # (queued before the start: the steps have all six from the first, whenever the runner is ready)
    ids = [manager.add_request_nowait(p, max_new_tokens=20, do_sample=False) for p in PROMPTS[:6]]
    async with manager:
        for request_id in ids:
            await manager.get_result(request_id)
        assert manager.statistics().draft_tokens == 0
        await manager.generate(PROMPTS[0], max_new_tokens=60, do_sample=False)
        assert manager.statistics().draft_tokens > 0


async def test_requests_whose_proposals_fail_back_off(model: PreTrainedModel) -> None:
    # Sampled from a random model, the tokens rarely follow what prompt lookup proposes,
    # so most proposals fail and a request then stops proposing for backoff_steps steps:
    # never backing off proposes the most, a pause longer than the run the least; the
    # outputs are the same in all three.
    async def proposed(**fields: Any) -> tuple[int, list[list[int]]]:
        config = aiocb.SpeculativeConfig(prompt_lookup_min=1, disable_by_batch_size=None, **fields)
        async with aiocb.Manager(model, speculative_config=config) as manager:
            outputs = await manager.generate_batch(PROMPTS[:3], max_new_tokens=NEW, temperature=1.0, seed=3)
            stats = manager.statistics()
        assert stats.accepted_draft_tokens <= stats.draft_tokens / 4
        return stats.draft_tokens, [o.generated_tokens for o in outputs.values()]

    never, outputs = await proposed(min_acceptance=0.0)
    default, default_outputs = await proposed()
    long_pause, long_pause_outputs = await proposed(backoff_steps=10 * NEW)
    assert never > default > long_pause
    assert outputs == default_outputs == long_pause_outputs


async def test_where_a_step_without_a_graph_costs_more_only_paying_proposals_go_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where decode steps replay CUDA graphs, a step that verifies proposals runs without
    one: the runner measures what that costs at start (``verify_cost``) and requests whose
    proposals cannot pay for it back off, with the same outputs. A copy of the target as
    draft has every proposal taken, and pays where a step costs the same either way, but
    never where it costs twice a decode step (its own passes run without graphs too);
    prompt lookup, partly taken, proposes less where no proposal can pay (20: more than
    k + 1 tokens a step)."""
    from aiocb.runner.model_runner import ModelRunner

    model = MODELS["qwen3"]()
    warm_up = ModelRunner.warm_up

    async def run(method: str, cost: float) -> tuple[aiocb.ManagerStatistics, list[list[int]]]:
        def measured(runner: ModelRunner) -> None:
            warm_up(runner)
            runner.verify_cost = cost

        monkeypatch.setattr(ModelRunner, "warm_up", measured)
        draft = copy.deepcopy(model) if method == "draft" else None
        config = aiocb.SpeculativeConfig(method=method, draft_model=draft, disable_by_batch_size=None)
        async with aiocb.Manager(model, speculative_config=config) as manager:
            outputs = await manager.generate_batch(PROMPTS[:3], max_new_tokens=NEW, do_sample=False)
            scheduler = manager._steps.scheduler  # type: ignore[union-attr]
            assert scheduler.verify_cost == cost
            stats = manager.statistics()
        return stats, [o.generated_tokens for o in outputs.values()]

    (same, outputs), (twice, twice_outputs) = await run("draft", 1.0), await run("draft", 2.0)
    assert outputs == twice_outputs
    assert same.accepted_draft_tokens == same.draft_tokens > 4 * twice.draft_tokens > 0
    (cheap, outputs), (never, never_outputs) = await run("ngram", 1.0), await run("ngram", 20.0)
    assert outputs == never_outputs
    assert 0 < never.draft_tokens < 0.75 * cheap.draft_tokens


def test_the_back_off_floor_follows_the_cost_of_a_step_without_a_graph() -> None:
    from aiocb.speculative import DraftProposer, NgramProposer

    config = aiocb.SpeculativeConfig(num_speculative_tokens=4, min_acceptance=0.2, backoff_steps=2)
    assert NgramProposer(config).floor(4) == 0.2  # (no graphs: the floor given)
    dear = NgramProposer(config, verify_cost=3.0)
    assert dear.floor(4) == 0.5 and dear.floor(2) == 1.0 and dear.floor(1) == 2.0  # (cost - 1) / width
    drafted = aiocb.SpeculativeConfig(method="draft", draft_model="draft", num_speculative_tokens=4)
    # A draft's passes run eagerly too: (cost * (1 + width * share) - 1) / width.
    assert DraftProposer(drafted, 0, share=0.25, verify_cost=2.0).floor(4) == 0.75
    assert DraftProposer(drafted, 0, share=0.25).floor(4) == 0.25  # (the draft's share alone)
    # Acceptance 0.85 after a half-taken proposal of 4 pays at cost 1 (floor 0.2) and at
    # cost 3 (0.5); a try that never pays (cost past width + 1) pauses, and as tries are no
    # longer cheap, each pause doubles after a failed try.
    never = NgramProposer(config, verify_cost=6.0)
    tokens = [7, 8, 1, 2, 3, 4, 5, 6, 7, 8]
    pauses = []
    for _ in range(4):
        width = len(never.propose(tokens, 4, budget=100)[0])
        never.record(width, width)  # (all taken: still not worth an eager step)
        steps = 0
        while not never.propose(tokens, 4, budget=100)[0]:
            steps += 1
        pauses.append(steps)
    assert pauses == [2, 4, 8, 16]
    # A verifying step a tenth dearer than a decode step (graphs replayed for both) keeps
    # the floor given: its failed tries stay cheap, their pauses short.
    near = NgramProposer(config, verify_cost=1.1)
    assert near.floor(1) == near.floor(4) == 0.2
    pauses = []
    while len(pauses) < 3:  # (failed tries until it backs off, then each try after a pause fails)
        width = len(near.propose(tokens, 4, budget=100)[0])
        near.record(width, 0)
        steps = 0
        while not near.propose(tokens, 4, budget=100)[0]:
            steps += 1
        if steps:
            pauses.append(steps)
    assert pauses == [2, 2, 2]


def test_the_try_after_a_pause_alone_decides_and_rows_that_lose_their_graph_count() -> None:
    from types import SimpleNamespace

    from aiocb.core.scheduler import ScheduledRequest, SchedulerOutput
    from aiocb.core.speculation import SpeculationPlanner
    from aiocb.speculative import NgramProposer

    config = aiocb.SpeculativeConfig(num_speculative_tokens=4, backoff_steps=2)
    proposer = NgramProposer(config, verify_cost=3.0)
    tokens = [7, 8, 1, 2, 3, 4, 5, 6, 7, 8]
    for proposed, accepted in ((4, 0), (3, 3), (4, 0), (3, 3), (4, 0)):
        assert len(proposer.propose(tokens, 4, budget=100)[0]) == proposed
        proposer.record(proposed, accepted)
    assert [len(proposer.propose(tokens, 4, budget=100)[0]) for _ in range(3)] == [0, 0, 3]  # (paused)
    proposer.record(3, 3)  # 4 tokens for a step that costs 3: it pays, whatever came before
    assert len(proposer.propose(tokens, 4, budget=100)[0]) == 4
    # A step whose other rows decode (and would replay a graph) charges its speculating
    # rows for them; one with a prompt chunk runs without a graph anyway.
    assert proposer.floor(4) == 0.5 and proposer.floor(4, load=3.0) == 1.5 and proposer.floor(4, load=0.0) == 0.2

    def output(*rows: tuple[int, list[int] | None]) -> SchedulerOutput:
        scheduled = [ScheduledRequest(None, 0, n, True, False, drafts) for n, drafts in rows]  # type: ignore[arg-type]
        return SchedulerOutput(scheduled=scheduled, num_speculating=sum(d is not None for _, d in rows))

    load = SpeculationPlanner.load
    measured, plain = SimpleNamespace(verify_cost=3.0), SimpleNamespace(verify_cost=1.0)
    decodes = output((3, [5, 6]), (1, None), (1, None), (1, None))
    assert load(measured, decodes) == 4.0  # type: ignore[arg-type]
    assert load(plain, decodes) == 1.0  # type: ignore[arg-type]
    assert load(measured, output((3, [5, 6]), (2, [9]), (1, None))) == 1.5  # type: ignore[arg-type]
    assert load(measured, output((3, [5, 6]), (40, None))) == 0.0  # type: ignore[arg-type]


def test_a_proposer_narrows_after_failures_backs_off_then_widens_after_a_whole_accept() -> None:
    from aiocb.speculative import NgramProposer

    config = aiocb.SpeculativeConfig(num_speculative_tokens=4, min_acceptance=0.5, backoff_steps=3)
    proposer = NgramProposer(config)
    tokens = [7, 8, 1, 2, 3, 4, 5, 6, 7, 8]  # (its suffix 7, 8 occurred before: 1, 2, 3, ... follows)
    # (k, not the room; a token costs its n-grams' tokens: 2 + 3 + 4)
    assert proposer.propose(tokens, 8, budget=100) == ([1, 2, 3, 4], 9 * len(tokens))
    proposer.record(4, 0)  # a failed proposal: one token fewer (acceptance 1.0 -> 0.7)
    assert proposer.propose(tokens, 8, budget=100)[0] == [1, 2, 3]
    proposer.record(3, 1)  # 0.59: one fewer again
    assert proposer.propose(tokens, 8, budget=100)[0] == [1, 2]
    assert proposer.propose(tokens, 1, budget=100)[0] == [1]  # (never past the room)
    proposer.record(2, 0)  # 0.41, under min_acceptance: a pause of backoff_steps steps
    assert [proposer.propose(tokens, 8, budget=100)[0] for _ in range(3)] == [[], [], []]
    assert proposer.propose(tokens, 8, budget=100)[0] == [1]  # back, as narrow as it left
    proposer.record(1, 0)  # the try fails: the same pause (a try of prompt lookup is cheap)
    assert [proposer.propose(tokens, 8, budget=100)[0] for _ in range(4)] == [[], [], [], [1]]
    proposer.record(1, 1)  # taken whole: two more
    assert proposer.propose(tokens, 8, budget=100)[0] == [1, 2, 3]
    proposer.record(3, 3)  # two more, up to k
    assert proposer.propose(tokens, 8, budget=100)[0] == [1, 2, 3, 4]
    # Steps that find nothing to propose are no failed proposals: a match after them is
    # proposed in full.
    lonely = NgramProposer(config)
    history = [100, 101]
    for token in range(102, 112):
        history.append(token)
        assert lonely.propose(history, 4, budget=100)[0] == []
    history += [100, 101]
    assert lonely.propose(history, 4, budget=100)[0] == [102, 103, 104, 105]


def test_a_draft_request_backs_off_below_the_drafts_share_of_the_target() -> None:
    # A draft pass costs about the draft's share of the target's parameters (memory-bound
    # decoding): a dear draft backs off at an acceptance a cheap one keeps proposing at.
    from aiocb.speculative import DraftProposer, draft_share

    config = aiocb.SpeculativeConfig(method="draft", draft_model="draft", num_speculative_tokens=2, backoff_steps=2)
    # (a prior of 1.0: hopeful, as after other requests' accepted tries)
    cheap, dear = DraftProposer(config, 0, share=0.05, prior=1.0), DraftProposer(config, 0, share=0.6, prior=1.0)
    for proposer in (cheap, dear):
        proposer.record(2, 1)  # acceptance 1.0 -> 0.85
        proposer.record(2, 0)  # 0.595: under the dear draft's share, over min_acceptance
    assert cheap.propose(2) == 1
    assert [dear.propose(2) for _ in range(3)] == [0, 0, 1]
    target = MODELS["qwen3"]()
    share = draft_share(_draft(target, "random"), target)
    assert 0.0 < share < 0.5
    assert draft_share(_draft(target, "same"), target) == 1.0
    # Weights held as buffers (as quantized ones often are) count, by their bytes.
    packed = _draft(target, "same")
    for module in packed.modules():
        if isinstance(module, torch.nn.Linear):
            weight = module.weight.detach().to(torch.float16)
            del module.weight
            module.register_buffer("weight", weight)
    assert 0.5 < draft_share(packed, target) < 1.0
    # A draft whose share is 1 or more still speculates while (nearly) all is accepted.
    as_dear = DraftProposer(config, 0, share=1.5, prior=1.0)
    for _ in range(4):
        as_dear.record(2, 2)
        assert as_dear.propose(2) == 2
    as_dear.record(2, 1)  # 0.85, under the floor (0.9)
    assert as_dear.propose(2) == 0


def test_a_draft_requests_pauses_double_while_its_tries_fail() -> None:
    # A try costs a draft model's passes: after a pause whose try fails too, the next pause
    # is twice as long (up to 8 x backoff_steps), and short again once a try succeeds.
    from aiocb.speculative import DraftProposer

    config = aiocb.SpeculativeConfig(method="draft", draft_model="draft", min_acceptance=0.5, backoff_steps=2)
    proposer = DraftProposer(config, 0, prior=1.0)

    def pause() -> int:
        steps = 0
        while not proposer.propose(4):
            steps += 1
        return steps

    proposer.record(4, 0)  # 0.7
    proposer.record(4, 0)  # 0.49: a pause of backoff_steps
    pauses = [pause()]
    for _ in range(4):
        proposer.record(1, 0)  # the try after the pause fails (0.35)
        pauses.append(pause())
    assert pauses == [2, 4, 8, 16, 16]
    proposer.record(1, 1)  # 0.65: a try that succeeds
    proposer.record(3, 0)  # 0.455: under min_acceptance again
    assert pause() == 2


def test_a_new_draft_request_starts_from_the_drafts_recent_acceptance() -> None:
    from aiocb.speculative import DraftProposer

    config = aiocb.SpeculativeConfig(method="draft", draft_model="draft", min_acceptance=0.3, backoff_steps=3)
    assert DraftProposer(config, 0).propose(4) == 4  # (no history: it tries ...)
    # (... and that first try alone decides, as one after a pause: floor 0.3, 0.7 * 0.3 + 0.3 * share)
    first, second, known = DraftProposer(config, 0), DraftProposer(config, 0), DraftProposer(config, 0, prior=1.0)
    first.record(4, 1)  # 0.285
    second.record(4, 2)  # 0.36
    known.record(4, 1)  # 0.775 (from a prior of 1.0: it would take three such tries)
    assert first.paused and not second.paused and not known.paused
    assert DraftProposer(config, 0, prior=0.5).propose(4) == 4
    late = DraftProposer(config, 0, prior=0.1)  # (under the floor: it waits ...)
    assert late.paused and late.waiting
    assert [late.propose(4, prior) for prior in (0.1, 0.05, None, 0.29)] == [0, 0, 0, 0]
    assert late.propose(4, 0.35) == 4  # (... until the draft's acceptance recovers)
    assert not late.paused and late.acceptance == 0.35
    late.record(4, 0)  # 0.245: from there, its own acceptance backs it off
    assert late.paused and not late.waiting and late.propose(4, 0.9) == 0


async def test_requests_after_a_hopeless_draft_start_paused_and_the_draft_skips_their_prompts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An unrelated draft's tries fail for the first requests; those that come after wait
    (the draft's acceptance does not recover), so the draft neither proposes for them nor
    computes their prompts, but for one in eight, which scouts; the outputs are those of
    no speculation."""
    from aiocb.runner.draft import Drafter

    model = MODELS["qwen3"]()
    runs: list[int] = []
    propose = Drafter.propose

    def counted(self: Drafter, *args: Any) -> Any:
        runs.append(1)
        return propose(self, *args)

    monkeypatch.setattr(Drafter, "propose", counted)
    first, later = PROMPTS[:4], random_prompts(8, 5, 30, seed=21)
    speculative = _draft_config(_draft(model, "random"))
    async with aiocb.Manager(model, speculative_config=speculative) as manager:
        await manager.generate_batch(first, max_new_tokens=24)
        speculation = manager._steps.scheduler.speculation  # type: ignore[union-attr]
        assert speculation is not None
        assert speculation.draft_acceptance is not None and speculation.draft_acceptance < 0.3
        before, proposed = len(runs), manager.statistics().draft_tokens
        speculation.waiting_since_scout = 0  # (the count of waiting requests starts here)
        outputs = await manager.generate_batch(later[:7], max_new_tokens=24)  # (none of 7 scouts)
        assert len(runs) == before and manager.statistics().draft_tokens == proposed  # (the draft slept)
        scout = await manager.generate(later[7], max_new_tokens=24)  # (the eighth scouts)
        assert len(runs) > before and manager.statistics().draft_tokens > proposed
    async with aiocb.Manager(model) as plain:
        expected = await plain.generate_batch(later, max_new_tokens=24)
    got = [o.generated_tokens for o in outputs.values()] + [scout.generated_tokens]  # type: ignore[union-attr]
    assert got == [o.generated_tokens for o in expected.values()]


@pytest.mark.parametrize("kind", ["random", "same"])
async def test_a_fresh_managers_batch_waits_for_one_requests_first_try(
    monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Before the draft has any acceptance figure, one request of a batch that arrives at
    once tries it (its prompt through the draft, its first proposals) and the rest wait for
    that figure: they join when the draft pays (a copy of the target) and never propose
    when it does not (an unrelated draft); the outputs are those of no speculation."""
    from aiocb.speculative import DraftProposer

    before_figure: set[int] = set()
    proposing: set[int] = set()
    propose = DraftProposer.propose

    def spied(self: DraftProposer, k: int, prior: float | None = None) -> int:
        count = propose(self, k, prior)
        if count:
            proposing.add(id(self))
            if prior is None:
                before_figure.add(id(self))
        return count

    monkeypatch.setattr(DraftProposer, "propose", spied)
    model = MODELS["qwen3"]()
    prompts = random_prompts(8, 5, 30, seed=23)
    async with aiocb.Manager(model, speculative_config=_draft_config(_draft(model, kind))) as manager:
        batches = _watch_drafts(manager)
        ids = [manager.add_request_nowait(p, max_new_tokens=24) for p in prompts]  # (all in the first step)
        outputs = [await manager.get_result(rid) for rid in ids]
        stats = manager.statistics()
    async with aiocb.Manager(model) as plain:
        expected = await plain.generate_batch(prompts, max_new_tokens=24)
    assert [o.generated_tokens for o in outputs] == [o.generated_tokens for o in expected.values()]  # type: ignore[union-attr]
    assert len(before_figure) == 1, "one request tries before the draft has a figure"
    assert len(proposing) == (8 if kind == "same" else 1)
    assert len(batches[0].draft_skip_rows) == 7, "the draft computed the prompt of the one that tries alone"
    if kind == "same":  # (the others' prompts, caught up on once they propose, as the target has them)
        assert stats.acceptance_rate is not None and stats.acceptance_rate > 0.95

    # A first request that ends before it could try (one new token) leaves the figure to
    # the next.
    before_figure.clear()
    proposing.clear()
    async with aiocb.Manager(model, speculative_config=_draft_config(_draft(model, kind))) as manager:
        outputs = await asyncio.gather(
            manager.generate(prompts[0], max_new_tokens=1),
            *(manager.generate(prompt, max_new_tokens=24) for prompt in prompts[1:]),
        )
    assert [o.generated_tokens for o in outputs[1:]] == [o.generated_tokens for o in list(expected.values())[1:]]
    assert len(before_figure) == 1
    assert len(proposing) == (7 if kind == "same" else 1)


async def test_under_async_batching_a_first_request_that_ends_before_it_tries_hands_the_try_on() -> None:
    """Pipelined steps plan no proposals: a request that waits for the draft's first figure
    must still become the one that tries once the first ended without a try, or no request
    ever proposes."""
    model = MODELS["qwen3"]()
    prompts = random_prompts(8, 5, 30, seed=23)
    config = aiocb.ContinuousBatchingConfig(use_async_batching=True)
    speculative = _draft_config(_draft(model, "same"))
    async with aiocb.Manager(model, continuous_batching_config=config, speculative_config=speculative) as manager:
        outputs = await asyncio.gather(
            manager.generate(prompts[0], max_new_tokens=1),
            *(manager.generate(prompt, max_new_tokens=24) for prompt in prompts[1:]),
        )
        stats = manager.statistics()
    async with aiocb.Manager(model) as plain:
        expected = await plain.generate_batch(prompts[1:], max_new_tokens=24)
    assert [o.generated_tokens for o in outputs[1:]] == [o.generated_tokens for o in expected.values()]
    assert stats.draft_tokens > 0 and stats.acceptance_rate is not None and stats.acceptance_rate > 0.95


async def test_the_draft_leaves_out_the_prompts_of_requests_that_wait() -> None:
    """Where the draft runs over a step for one request's prompt (a scout's), it leaves out
    the prompts of the requests that wait for its acceptance to recover: it computes a
    fraction of the batch's prompt tokens; the outputs are those of no speculation."""
    from aiocb.speculative import SCOUT_EVERY

    model = MODELS["qwen3"]()
    draft = _draft(model, "random")
    computed: list[int] = []
    draft.register_forward_pre_hook(
        lambda module, args, kwargs: computed.append(kwargs["input_ids"].shape[-1]), with_kwargs=True
    )
    prompts = random_prompts(8, 60, 90, seed=29)
    async with aiocb.Manager(model, speculative_config=_draft_config(draft)) as manager:
        await manager.generate_batch(PROMPTS[:4], max_new_tokens=24)
        speculation = manager._steps.scheduler.speculation  # type: ignore[union-attr]
        assert speculation is not None
        assert speculation.draft_acceptance is not None and speculation.draft_acceptance < 0.3
        speculation.waiting_since_scout = SCOUT_EVERY - 1  # (the next that would wait scouts)
        computed.clear()
        outputs = await manager.generate_batch(prompts, max_new_tokens=6)
    async with aiocb.Manager(model) as plain:
        expected = await plain.generate_batch(prompts, max_new_tokens=6)
    assert [o.generated_tokens for o in outputs.values()] == [o.generated_tokens for o in expected.values()]
    waiting = sum(map(len, prompts[1:]))
    assert computed and sum(computed) < waiting / 2, (sum(computed), waiting)


def test_the_default_proposal_length_depends_on_the_method() -> None:
    # Prompt lookup proposes for free, a draft model runs a pass per proposed token.
    assert aiocb.SpeculativeConfig().num_speculative_tokens == 8
    assert aiocb.SpeculativeConfig(method="draft", draft_model="draft").num_speculative_tokens == 4
    assert aiocb.SpeculativeConfig(num_speculative_tokens=3).num_speculative_tokens == 3
    assert aiocb.SpeculativeConfig.from_dict({"num_speculative_tokens": 5}).num_speculative_tokens == 5


def test_prompt_lookup_indexes_a_bounded_number_of_n_gram_tokens_a_step() -> None:
    """A step's budget counts the tokens of the n-grams indexed: with lengths 1 to 8 a
    token costs 36 (counted by tokens, a step with long lengths indexed for seconds)."""
    from aiocb.speculative import NgramProposer

    proposer = NgramProposer(aiocb.SpeculativeConfig(prompt_lookup_min=1, prompt_lookup_max=8))
    tokens = list(range(1000)) * 2
    assert proposer.propose(tokens, 8, budget=9 * 1024) == ([], 256 * 36)  # (catching up)
    assert proposer.propose(tokens, 8, budget=1) == ([], 36)  # (a token at least, while any is left)
    assert proposer.propose(tokens, 8, budget=0) == ([], 0)
    while not proposer.propose(tokens, 8, budget=9 * 1024)[0]:
        pass
    assert proposer.propose([*tokens, 0], 8, budget=9 * 1024)[0] == list(range(1, 9))
    # Free: the tokens one step gives (num_speculative_tokens + 1 at most), whatever the room
    # the step leaves (a step's whole room, a prompt was once indexed free).
    fresh = NgramProposer(aiocb.SpeculativeConfig(num_speculative_tokens=3))
    assert fresh.propose(tokens[:5], 4000, budget=0) == ([], 0)
    assert fresh.propose(tokens[:500], 4000, budget=90) == ([], 90)


def test_a_step_s_indexing_budget_leaves_no_request_behind_for_good() -> None:
    """The tokens a request's last step gave are indexed whatever the budget: charged, the
    first few requests planned took the budget every step with long lengths, and those
    after them never caught up (24 of 32 never proposed with lengths 2 to 16, 3 with 2 to 8)."""
    from types import SimpleNamespace

    from aiocb.core.speculation import SpeculationPlanner

    config = aiocb.SpeculativeConfig(prompt_lookup_min=2, prompt_lookup_max=8, num_speculative_tokens=8)
    planner = SpeculationPlanner(config, None, max_batch_tokens=8192, max_model_len=None)
    params = SimpleNamespace(uses_controls=False, needs_known_history=False, max_new_tokens=10**9)
    requests = []
    for r in range(32):
        cycle = [1000 * r + i for i in range(50)]  # (a prompt its output copies: every proposal accepted)
        requests.append(
            SimpleNamespace(
                params=params, grammar=None, token_ids=cycle * 4, proposer=None, cycle=cycle, num_output_tokens=0
            )
        )
    proposed = [0] * len(requests)
    for _ in range(60):
        planner.start_step(len(requests))
        for i, request in enumerate(requests):
            request.num_tokens = len(request.token_ids)
            drafts = planner.propose(request, 10**6)  # type: ignore[arg-type]
            proposed[i] += bool(drafts)
            for _ in range(1 + len(drafts or ())):
                request.token_ids.append(request.cycle[len(request.token_ids) % 50])
    assert min(proposed) > 0, proposed


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"method": "draft"}, "needs a draft_model"),
        ({"method": "draft", "draft_model": "x", "prompt_lookup_max": 6}, "prompt_lookup_max apply to method"),
        ({"draft_model": "x"}, "draft_model applies to method"),
        ({"method": "eagle"}, "speculative method"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"prompt_lookup_min": 5, "prompt_lookup_max": 3}, "prompt_lookup_min"),
        ({"prompt_lookup_max": 9}, "prompt_lookup_max must be <= 8"),
        ({"num_speculative_tokens": 65}, "num_speculative_tokens must be <= 64"),
        ({"disable_by_batch_size": 0}, "disable_by_batch_size"),
        ({"min_acceptance": 2.0}, "min_acceptance"),
        ({"min_acceptance": True}, "min_acceptance"),
    ],
)
def test_bad_configs_are_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(aiocb.InvalidConfigError, match=message):
        aiocb.SpeculativeConfig(**fields)
    with pytest.raises(aiocb.InvalidConfigError, match="unknown speculative config field"):
        aiocb.SpeculativeConfig.from_dict({"lookahead": 3})


@pytest.mark.parametrize(
    ("layers", "config_name"),
    [("sliding", "default"), ("hybrid", "preemption"), ("hybrid", "async_batching"), ("sliding", "chunked_prefill")],
)
@pytest.mark.parametrize("sampling", ["greedy", pytest.param("sampled", marks=pytest.mark.slow)])
async def test_prompt_lookup_on_sliding_window_models_equals_no_speculation(
    layers: str, config_name: str, sampling: str
) -> None:
    """A row verifying proposals writes them into its sliding layers' rings of blocks: one
    rejected must not have overwritten a key still in the window (the ring holds a page
    more than the window, and k + 1 tokens fit in it)."""
    window_layers = 1 if layers == "hybrid" else 0  # (layers from this one on slide)
    model = MODELS["qwen3"](use_sliding_window=True, sliding_window=32, max_window_layers=window_layers)
    params: dict[str, Any] = (
        {"do_sample": False} if sampling == "greedy" else {"temperature": 0.4, "top_k": 50, "seed": 7}
    )
    config = aiocb.ContinuousBatchingConfig(**{"page_size": 16, **CONFIGS[config_name]})
    # (at pages of 16 a window of 32 keeps a ring of 3 blocks: 17 tokens a row may write)
    speculative = aiocb.SpeculativeConfig(num_speculative_tokens=16, prompt_lookup_min=1, disable_by_batch_size=None)
    stats = await _equal_without(model, config, speculative, params)
    assert stats.draft_tokens > stats.accepted_draft_tokens, "some proposals were rejected"
    if sampling == "greedy":
        assert stats.accepted_draft_tokens > 0, "some proposals were accepted"
    if config_name == "preemption":
        assert stats.preemptions > 0


async def _equal_without(
    model: PreTrainedModel,
    config: aiocb.ContinuousBatchingConfig,
    speculative: aiocb.SpeculativeConfig,
    params: dict[str, Any],
) -> aiocb.ManagerStatistics:
    """PROMPTS' outputs without and with ``speculative``, asserted equal (no block leaked):
    the speculative run's statistics."""
    runs = []
    for spec in (None, speculative):
        async with aiocb.Manager(model, continuous_batching_config=config, speculative_config=spec) as manager:
            outputs = await manager.generate_batch(PROMPTS, max_new_tokens=NEW, **params)
            stats = manager.statistics()
        assert stats.free_blocks == stats.total_blocks, "blocks leaked"
        runs.append([o.generated_tokens for o in outputs.values()])
    assert runs[1] == runs[0]
    return stats


async def test_speculation_a_sliding_window_model_cannot_take_is_refused() -> None:
    sliding = MODELS["qwen3"](use_sliding_window=True, sliding_window=32, max_window_layers=0)
    config = aiocb.ContinuousBatchingConfig(page_size=16)
    too_many = aiocb.SpeculativeConfig(num_speculative_tokens=17)
    manager = aiocb.Manager(sliding, continuous_batching_config=config, speculative_config=too_many)
    with pytest.raises(aiocb.InvalidConfigError, match="num_speculative_tokens=17 is more than the 16"):
        manager.start()
    drafted = _draft_config(_draft(MODELS["qwen3"](), "other"))
    manager = aiocb.Manager(sliding, continuous_batching_config=config, speculative_config=drafted)
    with pytest.raises(aiocb.InvalidConfigError, match="a draft model needs a target with full-attention layers"):
        manager.start()


@pytest.mark.parametrize(
    ("config_name", "sampling"),
    [
        ("default", "greedy"),
        *(  # (6 s each: in nox -s slow)
            pytest.param(name, sampling, marks=pytest.mark.slow)
            for name, sampling in [("default", "sampled"), ("preemption", "greedy"), ("async_batching", "greedy")]
        ),
    ],
)
async def test_a_draft_model_over_a_hybrid_target_equals_no_speculation(config_name: str, sampling: str) -> None:
    """The draft's cache mirrors the blocks of the target's full-attention layers; the
    target's sliding layers verify the proposals in their rings."""
    target = MODELS["qwen3"](use_sliding_window=True, sliding_window=32, max_window_layers=1)
    draft = MODELS["qwen3"]()  # (the same weights, every layer attending in full: mostly the same proposals)
    config = aiocb.ContinuousBatchingConfig(**{"page_size": 16, **CONFIGS[config_name]})
    speculative = _draft_config(draft, num_speculative_tokens=4)
    params: dict[str, Any] = (
        {"do_sample": False} if sampling == "greedy" else {"temperature": 0.4, "top_k": 50, "seed": 7}
    )
    stats = await _equal_without(target, config, speculative, params)
    assert stats.draft_tokens > stats.accepted_draft_tokens > 0
    if config_name == "preemption":
        assert stats.preemptions > 0


# ---------------------------------------------------------------- a draft model


def _draft(model: PreTrainedModel, kind: str) -> PreTrainedModel:
    """A copy of the target (it proposes what the target draws) or an unrelated model with
    the same vocabulary (it proposes little that the target takes)."""
    if kind == "same":
        return copy.deepcopy(model)
    return MODELS["qwen3"](seed=11, num_hidden_layers=1, hidden_size=32, num_attention_heads=2, head_dim=16)


def _draft_config(draft: PreTrainedModel | str, **fields: Any) -> aiocb.SpeculativeConfig:
    return aiocb.SpeculativeConfig(**{"method": "draft", "draft_model": draft, "disable_by_batch_size": None, **fields})


DRAFT_CASES = [
    *((name, "greedy", "random") for name in sorted(CONFIGS)),
    ("default", "greedy", "same"),
    ("preemption", "greedy", "same"),
    ("chunked_prefill", "greedy", "same"),
    ("async_batching", "greedy", "same"),
    ("default", "sampled", "same"),
    ("default", "rarer filters", "same"),
    ("async_batching", "sampled", "random"),
]
#: Each kind of sampling's parameters.
_SAMPLING: dict[str, dict[str, Any]] = {
    "greedy": {"do_sample": False},
    "sampled": {"temperature": 0.4, "top_k": 50, "seed": 7},
    # (the draft's first proposal drawn without them was often refused: 85 of 111 taken)
    "rarer filters": {"temperature": 0.8, "typical_p": 0.9, "epsilon_cutoff": 0.01, "seed": 3},
}


@pytest.mark.parametrize(("config_name", "sampling", "kind"), DRAFT_CASES)
async def test_draft_model_outputs_equal_no_speculation(
    model: PreTrainedModel, config_name: str, sampling: str, kind: str
) -> None:
    params = _SAMPLING[sampling]
    config = CONFIGS[config_name]
    plain = await _plain(model, config_name, sampling, params)
    fast, stats = await _run(model, _draft_config(_draft(model, kind)), config, **params)
    for i, (a, b) in enumerate(zip(plain, fast, strict=True)):
        assert b.generated_tokens == a.generated_tokens, f"prompt {i}"
        assert b.finish_reason == a.finish_reason
    assert stats.draft_tokens > 0
    if kind == "same":  # (it draws with the target's noise from the target's logits, over its blocks)
        assert stats.acceptance_rate > (0.99 if sampling == "rarer filters" else 0.95)
    else:
        assert stats.acceptance_rate < 0.5
    if config_name == "preemption":
        assert stats.preemptions > 0


@pytest.mark.parametrize("draws", [400, pytest.param(20_000, marks=pytest.mark.slow)])
async def test_draft_model_sampled_first_tokens_have_the_same_distribution(draws: int) -> None:
    """As for prompt lookup: seed by seed the same first tokens, so total variation 0."""
    model = MODELS["qwen3"]()
    prompt = random_prompts(3, 8, 20, seed=5)[2]
    plain, _ = await _first_three(model, prompt, None, 0, draws)
    fast, stats = await _first_three(model, prompt, _draft_config(_draft(model, "same")), 0, draws)
    other, _ = await _first_three(model, prompt, None, draws, draws)
    assert stats.acceptance_rate is not None and stats.acceptance_rate > 0.95
    assert _total_variation(plain, fast) == 0.0 < _total_variation(plain, other)


def test_draft_model_cache_mirrors_the_target_blocks(model: PreTrainedModel) -> None:
    """One block budget for both caches: the draft's blocks cost memory out of it."""
    from aiocb.runner.memory import plan_cache
    from aiocb.runner.model_runner import ModelRunner

    draft = _draft(model, "random")
    config = aiocb.ContinuousBatchingConfig(num_blocks=40, page_size=16)
    runner = ModelRunner(model, config, draft_model=draft)
    assert runner.drafter is not None
    assert runner.drafter.cache.group_num_blocks == runner.cache.group_num_blocks == [40]
    assert runner.drafter.cache.key[0].shape[1] == runner.cache.key[0].shape[1] == 16
    spec, drafted, auto = runner.spec, runner.drafter.spec, aiocb.ContinuousBatchingConfig()
    alone = plan_cache(spec, auto, free_bytes=2**30)
    extra = drafted.bytes_per_block(auto.page_size, drafted.num_layers)
    shared = plan_cache(spec, auto, free_bytes=2**30, extra_bytes_per_block=extra)
    own = spec.bytes_per_block(auto.page_size, spec.num_layers)
    assert shared.num_blocks[0] == pytest.approx(alone.num_blocks[0] * own / (own + extra), rel=0.01)
    # The host pool of CPU offloading holds both caches' blocks within cpu_offload_space.
    space = 0.001  # GiB
    offloading = auto.replace(cpu_offload_space=space)
    host = plan_cache(spec, offloading, free_bytes=2**30, extra_bytes_per_block=extra).num_host_blocks[0]
    assert host * (own + extra) <= space * 2**30 < (host + 1) * (own + extra)


def test_the_draft_models_cache_starts_at_zero(model: PreTrainedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step's first draft pass runs over rows the draft slept through too (their results
    unused), whose queries read positions it never wrote: the draft's cache starts zeroed,
    whatever fresh memory holds (here NaNs), where the target's is only allocated."""
    from aiocb.runner import paged_cache
    from aiocb.runner.model_runner import ModelRunner

    def poisoned(*args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.full(*args, float("nan"), **kwargs)  # (what fresh memory may hold)

    monkeypatch.setattr(paged_cache.torch, "empty", poisoned)
    config = aiocb.ContinuousBatchingConfig(num_blocks=8, page_size=16)
    runner = ModelRunner(model, config, draft_model=_draft(model, "random"))
    assert runner.drafter is not None
    for layer in runner.drafter.cache.key + runner.drafter.cache.value:
        assert not layer.any(), "every block of the draft's cache is zero"
    assert runner.cache.key[0][0].isnan().all(), "(the target's cache is left as allocated)"


def _watch_drafts(manager: aiocb.Manager) -> list[Any]:
    """The batches the draft model runs over, from now on."""
    runner = manager._runner
    assert runner is not None and runner.drafter is not None
    batches: list[Any] = []
    original = runner.drafter.propose
    runner.drafter.propose = lambda batch, *args: batches.append(batch) or original(batch, *args)  # type: ignore[method-assign]
    return batches


async def test_a_large_batch_puts_the_draft_model_to_sleep_and_later_steps_catch_up(
    engine_model: PreTrainedModel,
) -> None:
    """Past ``disable_by_batch_size`` the draft model does not run (its cost would be the
    step's); once the batch is small again, the requests it slept through have the draft
    compute their missed tokens, then speculate: a copy of the target accepts everything,
    which it would not with a gap or a wrong key in its cache."""
    model = engine_model
    spec = _draft_config(_draft(model, "same"), disable_by_batch_size=2)
    lengths = [12, 12, 12, 12, 60, 60]
    work = list(zip(PROMPTS[:6], lengths, strict=True))
    async with aiocb.Manager(model) as manager:
        plain = [await manager.generate(p, max_new_tokens=n, do_sample=False) for p, n in work]
    async with aiocb.Manager(model, speculative_config=spec) as manager:
        batches = _watch_drafts(manager)
        # Added with no await between them, so that the first step already holds all six
        # (generate_batch gives the loop back while it adds, and a slow machine may step then).
        ids = [manager.add_request_nowait(p, max_new_tokens=n, do_sample=False) for p, n in work]
        outputs = [await manager.get_result(rid) for rid in ids]
        stats = manager.statistics()
    assert [o.generated_tokens for o in outputs] == [o.generated_tokens for o in plain]  # type: ignore[union-attr]
    assert batches, "the last two requests speculated"
    assert all(batch.num_rows <= 2 for batch in batches), "the draft model slept through the large batch's steps"
    caught_up = [batch for batch in batches if batch.catch_up_slots]
    assert caught_up and max(sum(batch.catch_up_counts) for batch in caught_up) > 12
    assert stats.draft_tokens > 20 and stats.acceptance_rate is not None and stats.acceptance_rate > 0.95


async def test_the_draft_model_sleeps_while_its_requests_back_off(engine_model: PreTrainedModel) -> None:
    """A draft that proposes badly: its request backs off, and while it does the draft
    model does not run (no step of it speculates); after each pause the draft catches up
    on the tokens it missed, and the outputs stay those of no speculation."""
    model = engine_model
    spec = _draft_config(_draft(model, "random"), min_acceptance=0.5, backoff_steps=6)
    async with aiocb.Manager(model) as manager:
        plain = await manager.generate(PROMPTS[0], max_new_tokens=NEW, do_sample=False)
    async with aiocb.Manager(model, speculative_config=spec) as manager:
        batches = _watch_drafts(manager)
        fast = await manager.generate(PROMPTS[0], max_new_tokens=NEW, do_sample=False)
        stats = manager.statistics()
    assert isinstance(fast, aiocb.GenerationOutput) and isinstance(plain, aiocb.GenerationOutput)
    assert fast.generated_tokens == plain.generated_tokens
    assert stats.draft_tokens > 0
    assert len(batches) < stats.steps / 2, (len(batches), stats.steps)
    assert sum(1 for batch in batches if batch.catch_up_slots) >= 2


@pytest.mark.parametrize("vocab", [500, 520])
async def test_a_draft_with_a_padded_vocabulary(vocab: int) -> None:
    """Vocabularies padded to different sizes (as a model family's sizes often are): the
    draft proposes from the ids both have."""
    target = MODELS["qwen3"]()
    draft = MODELS["qwen3"](seed=3, num_hidden_layers=1, vocab_size=vocab)
    plain, _ = await _run(target, None, CONFIGS["default"], do_sample=False)
    fast, stats = await _run(target, _draft_config(draft), CONFIGS["default"], do_sample=False)
    assert [o.generated_tokens for o in fast] == [o.generated_tokens for o in plain]
    assert stats.draft_tokens > 0


async def test_a_draft_model_path_is_loaded(tmp_path: Any) -> None:
    target = MODELS["qwen3"]()
    _draft(target, "random").save_pretrained(tmp_path)
    spec = _draft_config(str(tmp_path))
    async with aiocb.Manager(target) as manager:
        plain = await manager.generate(PROMPTS[0], max_new_tokens=30, do_sample=False)
    async with aiocb.Manager(target, speculative_config=spec) as manager:
        fast = await manager.generate(PROMPTS[0], max_new_tokens=30, do_sample=False)
        assert manager.statistics().draft_tokens > 0
    assert isinstance(plain, aiocb.GenerationOutput) and isinstance(fast, aiocb.GenerationOutput)
    assert fast.generated_tokens == plain.generated_tokens


@pytest.mark.parametrize(
    ("draft", "message"),
    [
        ("same-object", "not the target model itself"),
        ("vocab", "vocabulary"),
        ("sliding", "sliding-window"),
        ("not-a-model", "PreTrainedModel"),
        ("/nonexistent/draft", "could not be loaded"),
    ],
)
async def test_bad_draft_models_are_refused(draft: str, message: str) -> None:
    target = MODELS["qwen3"]()
    model: Any = {
        "same-object": target,
        "vocab": MODELS["qwen3"](vocab_size=4096),
        "sliding": MODELS["qwen3"](use_sliding_window=True, sliding_window=32, max_window_layers=0),
        "not-a-model": torch.nn.Linear(2, 2),
    }.get(draft, draft)
    with pytest.raises(aiocb.InvalidConfigError, match=message):
        async with aiocb.Manager(target, speculative_config=_draft_config(model)):
            pass


@pytest.mark.parametrize("first_turn", ["penalised", "large_batch"])
async def test_prefix_hits_serve_the_draft_only_blocks_it_computed(first_turn: str) -> None:
    """The draft writes its cache in the target's blocks but sleeps through some steps (a
    request that cannot speculate, a large batch): a later request whose prompt hits those
    blocks has the draft compute what it slept through, so a copy of the target accepts
    everything. Reading the blocks as they are would read keys the draft never wrote."""
    model = MODELS["qwen3"]()
    spec = _draft_config(_draft(model, "same"), disable_by_batch_size=2)
    config = aiocb.ContinuousBatchingConfig(page_size=16)
    prompts = random_prompts(4, 40, 40, seed=3)
    tail = random_prompts(1, 5, 5, seed=9)[0]

    async def first(manager: aiocb.Manager) -> list[int]:
        if first_turn == "penalised":  # (its decode steps cannot speculate: the draft sleeps)
            out = await manager.generate(prompts[0], max_new_tokens=48, do_sample=False, repetition_penalty=1.2)
            assert isinstance(out, aiocb.GenerationOutput)
            return prompts[0] + out.generated_tokens
        ids = [manager.add_request_nowait(p, max_new_tokens=4, do_sample=False) for p in prompts]
        for rid in ids:
            await manager.get_result(rid)
        return prompts[0]

    async with aiocb.Manager(model, continuous_batching_config=config) as manager:
        follow = await first(manager) + tail
        plain = await manager.generate(follow, max_new_tokens=40, do_sample=False)
    async with aiocb.Manager(model, continuous_batching_config=config, speculative_config=spec) as manager:
        assert await first(manager) + tail == follow
        before = manager.statistics()
        fast = await manager.generate(follow, max_new_tokens=40, do_sample=False)
        stats = manager.statistics()
    assert isinstance(fast, aiocb.GenerationOutput) and isinstance(plain, aiocb.GenerationOutput)
    assert fast.generated_tokens == plain.generated_tokens
    assert stats.prefix_hit_tokens - before.prefix_hit_tokens >= 32, "the follow-up hit the first turn's blocks"
    proposed = stats.draft_tokens - before.draft_tokens
    assert proposed > 0 and stats.accepted_draft_tokens - before.accepted_draft_tokens == proposed


async def test_a_request_cancelled_while_its_catch_up_is_planned(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner gives the loop back between requests; a request that asked the draft to
    catch up may be cancelled then, before its row is copied out. The step goes on without
    it (the engine neither fails nor leaks)."""
    import aiocb.engine.step_loop as step_loop

    model = MODELS["qwen3"]()
    spec = _draft_config(_draft(model, "random"), min_acceptance=0.9, backoff_steps=3)
    prompts = random_prompts(2, 20, 20, seed=3)
    monkeypatch.setattr(step_loop, "CHUNK", 1)  # (a turn after every request planned)
    async with aiocb.Manager(model, speculative_config=spec) as manager:
        scheduler = manager._steps.scheduler
        plan = scheduler.plan
        cancelled: list[bool] = []
        victim = manager.add_request_nowait(prompts[0], max_new_tokens=80, do_sample=False)
        other = manager.add_request_nowait(prompts[1], max_new_tokens=80, do_sample=False)

        def planning(chunk: int) -> Any:
            steps = plan(chunk)
            while True:
                try:
                    next(steps)
                except StopIteration as done:
                    return done.value
                if not cancelled and any(r.request_id == victim for r in scheduler.speculation.catch_up):
                    cancelled.append(manager.cancel_request(victim))
                yield

        monkeypatch.setattr(scheduler, "plan", planning)
        ended = await manager.get_result(victim)
        survivor = await manager.get_result(other)
        stats = manager.statistics()
    assert cancelled == [True], "the victim was cancelled while its catch-up was planned"
    assert isinstance(ended, aiocb.GenerationOutput) and ended.finish_reason == aiocb.FinishReason.CANCELLED
    assert isinstance(survivor, aiocb.GenerationOutput) and len(survivor.generated_tokens) == 80
    assert stats.free_blocks == stats.total_blocks


@pytest.mark.parametrize("method", ["ngram", "draft"])
async def test_a_large_batch_of_speculative_requests_still_pipelines(method: str) -> None:
    """Past ``disable_by_batch_size`` no request speculates, so none waits for its last
    token before its next step is planned: with async batching the steps overlap as they
    do without speculation (each step carries its rows' tokens on the device)."""
    model = MODELS["qwen3"]()
    fields: dict[str, Any] = {"draft_model": _draft(model, "random")} if method == "draft" else {}
    spec = aiocb.SpeculativeConfig(method=method, disable_by_batch_size=2, **fields)
    config = aiocb.ContinuousBatchingConfig(use_async_batching=True)
    prompts = random_prompts(6, 20, 20, seed=3)
    carried, outputs = [], []
    for speculative in (None, spec):
        async with aiocb.Manager(model, continuous_batching_config=config, speculative_config=speculative) as manager:
            ids = [manager.add_request_nowait(p, max_new_tokens=40, do_sample=False) for p in prompts]
            outputs.append([(await manager.get_result(rid)).generated_tokens for rid in ids])  # type: ignore[union-attr]
            carried.append(manager._steps.scheduler.stats.num_carried_tokens)
            assert manager.statistics().draft_tokens == 0
    assert outputs[0] == outputs[1]
    assert carried[0] > 100 and carried[1] == carried[0]


async def test_samples_of_one_prompt_fork_the_drafts_cache_as_it_is() -> None:
    """More samples of a prompt fork its blocks when its prompt is computed; if the draft
    slept through that (a large batch), the forks hold no draft keys either and catch up
    before they speculate: a copy of the target then accepts nearly everything."""
    model = MODELS["qwen3"]()
    spec = _draft_config(_draft(model, "same"), disable_by_batch_size=3)
    prompts = random_prompts(6, 20, 20, seed=3)
    async with aiocb.Manager(model, speculative_config=spec) as manager:
        # (five short requests keep the batch large while the prompt below is computed)
        shorts = [manager.add_request_nowait(p, max_new_tokens=6, do_sample=False) for p in prompts[1:]]
        samples = await manager.generate(prompts[0], max_new_tokens=60, temperature=1.0, seed=5, n=3)
        for rid in shorts:
            await manager.get_result(rid)
        stats = manager.statistics()
    assert isinstance(samples, list) and len(samples) == 3
    assert all(len(s.generated_tokens) == 60 for s in samples)
    assert stats.draft_tokens > 60 and stats.acceptance_rate is not None and stats.acceptance_rate > 0.95


async def test_a_catch_up_is_no_larger_than_a_step() -> None:
    """The draft catches up on at most ``max_batch_tokens`` tokens a step (what the cache
    planner allowed a pass's activations), over as many steps as it takes."""
    model = MODELS["qwen3"]()
    spec = _draft_config(_draft(model, "same"), disable_by_batch_size=1)
    config = aiocb.ContinuousBatchingConfig(max_batch_tokens=32)
    # (the long prompt is computed, a chunk a step, while the short request runs beside it:
    # the draft sleeps through both, then catches up on the long one)
    work = [(PROMPTS[0], 8), (PROMPTS[1], 60)]
    assert len(PROMPTS[1]) > 100
    async with aiocb.Manager(model, continuous_batching_config=config) as manager:
        plain = [await manager.generate(p, max_new_tokens=n, do_sample=False) for p, n in work]
    async with aiocb.Manager(model, continuous_batching_config=config, speculative_config=spec) as manager:
        batches = _watch_drafts(manager)
        ids = [manager.add_request_nowait(p, max_new_tokens=n, do_sample=False) for p, n in work]
        outputs = [await manager.get_result(rid) for rid in ids]
        stats = manager.statistics()
    assert [o.generated_tokens for o in outputs] == [o.generated_tokens for o in plain]  # type: ignore[union-attr]
    counts = [sum(batch.catch_up_counts) for batch in batches if batch.catch_up_slots]
    assert len(counts) >= 2 and max(counts) == 32, counts
    assert stats.draft_tokens > 20 and stats.acceptance_rate is not None and stats.acceptance_rate > 0.95


async def test_the_draft_model_never_runs_for_requests_that_cannot_speculate() -> None:
    """A request with logits controls (a penalty) never speculates: the draft model
    computes neither its prompt nor its tokens."""
    model = MODELS["qwen3"]()
    spec = _draft_config(_draft(model, "same"))
    async with aiocb.Manager(model) as manager:
        plain = await manager.generate(PROMPTS[0], max_new_tokens=20, do_sample=False, repetition_penalty=1.3)
    async with aiocb.Manager(model, speculative_config=spec) as manager:
        batches = _watch_drafts(manager)
        fast = await manager.generate(PROMPTS[0], max_new_tokens=20, do_sample=False, repetition_penalty=1.3)
    assert isinstance(fast, aiocb.GenerationOutput) and isinstance(plain, aiocb.GenerationOutput)
    assert fast.generated_tokens == plain.generated_tokens
    assert batches == []


async def test_a_draft_that_cannot_use_the_targets_attention_kernels_is_refused() -> None:
    """The draft's first pass of a step attends through the target's attention metadata:
    a draft whose cache the target's kernels do not take (a bfloat16 draft beside a
    float32 target on the CPU, whose C kernels take float32) is refused, naming why."""
    model = MODELS["qwen3"]()
    draft = _draft(model, "same").to(torch.bfloat16)
    with pytest.raises(aiocb.InvalidConfigError, match=r"draft_model \(torch.bfloat16.*target's dtype"):
        async with aiocb.Manager(model, speculative_config=_draft_config(draft)):
            pass


async def test_a_first_request_that_cannot_speculate_does_not_hold_the_others_back() -> None:
    """Before the draft has a figure, the one request that tries it first must be one that
    may speculate: a penalised request running first would otherwise keep every later
    request waiting for as long as it runs."""
    model = MODELS["qwen3"]()
    prompts = random_prompts(4, 10, 30, seed=3)
    async with aiocb.Manager(model, speculative_config=_draft_config(_draft(model, "same"))) as manager:
        penalised = asyncio.create_task(
            manager.generate(prompts[0], max_new_tokens=2000, repetition_penalty=1.2, eos_token_id=[])
        )
        await asyncio.sleep(0)
        outputs = await asyncio.gather(*(manager.generate(p, max_new_tokens=40) for p in prompts[1:]))
        assert not penalised.done()
        stats = manager.statistics()
        penalised.cancel()
    async with aiocb.Manager(model) as plain:
        expected = await plain.generate_batch(prompts[1:], max_new_tokens=40)
    assert [o.generated_tokens for o in outputs] == [o.generated_tokens for o in expected.values()]
    assert stats.draft_tokens > 0 and stats.accepted_draft_tokens == stats.draft_tokens


async def test_proposals_past_a_stop_are_neither_rejected_nor_counted() -> None:
    """A request that stops on the first proposed position had its later proposals never
    compared: its try counts as all accepted (a copy of the target agrees with every
    token), so the requests after it speculate, and the statistics count only what the
    model verified."""
    model = MODELS["qwen3"]()
    prompts = random_prompts(8, 10, 30, seed=3)
    async with aiocb.Manager(model) as plain:
        reference = await plain.generate(prompts[0], max_new_tokens=10)
        expected = await plain.generate_batch(prompts[1:], max_new_tokens=40)
    stop = reference.generated_tokens[1]  # (the first proposed position)
    async with aiocb.Manager(model, speculative_config=_draft_config(_draft(model, "same"))) as manager:
        first = await manager.generate(prompts[0], max_new_tokens=10, stop_token_ids=[stop])
        assert first.generated_tokens == reference.generated_tokens[:2]
        after_first = manager.statistics()
        outputs = await manager.generate_batch(prompts[1:], max_new_tokens=40)
        stats = manager.statistics()
    assert after_first.draft_tokens == after_first.accepted_draft_tokens == 1
    assert [o.generated_tokens for o in outputs.values()] == [o.generated_tokens for o in expected.values()]
    assert stats.draft_tokens > 100 and stats.accepted_draft_tokens == stats.draft_tokens
