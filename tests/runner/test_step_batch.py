"""The persistent batch: what the loop's BatchWriter sends keeps the worker's InputBatch equal
to the scheduler's state, through joins, block appends, preemption (recompute and
offloading), prefix hits, forks, sliding rings, and requests ended while a plan is paused.

A simulated engine drives the real Scheduler, BatchWriter and InputBatch without a model:
each plan is made and copied out a few rows at a time, with cancellations in between (as
other coroutines would do), and each copied row is checked against the request.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Generator

import torch
from hypothesis import given
from hypothesis import strategies as st

from aiocb.core.kv_cache import CacheGroup, KVCacheManager
from aiocb.core.params import ResolvedParams
from aiocb.core.request import Request
from aiocb.core.scheduler import Scheduler, SchedulerOutput, StepResult
from aiocb.outputs import FinishReason, RequestStatus
from aiocb.runner.filter_chain import OFF
from aiocb.runner.input_batch import InputBatch
from aiocb.runner.inputs import controls_host_tensors
from aiocb.runner.step_batch import BatchWriter, RowState, StepBatch, TableWrites, row_controls, row_params
from tests.fuzzing import fuzz_settings

PAGE = 4


def _requests(rng: random.Random, count: int) -> list[tuple[Request, list[Request]]]:
    shared = [rng.randrange(1, 500) for _ in range(3 * PAGE)]
    made = []
    for i in range(count):
        own = [rng.randrange(1, 500) for _ in range(rng.randrange(1, 14))]
        prompt = shared[: rng.choice((0, PAGE, 2 * PAGE, 3 * PAGE))] + own
        params = ResolvedParams(
            max_new_tokens=rng.randrange(1, 9),
            temperature=rng.choice((0.0, 0.7, 1.3)),
            top_k=rng.choice((0, 1, 5)),
            top_p=rng.choice((1.0, 0.9)),
            min_p=rng.choice((0.0, 0.1)),
            typical_p=rng.choice((1.0, 1.0, 0.8)),
            eta_cutoff=rng.choice((0.0, 0.0, 0.001)),
            seed=rng.randrange(2**40),
            return_logprobs=rng.random() < 0.3,
            top_logprobs=rng.choice((0, 0, 2)),
        )
        children = [Request(f"r{i}__child#{c}", list(prompt), params, 0.0) for c in range(rng.choice((0, 0, 0, 2)))]
        made.append((Request(f"r{i}", prompt, params, 0.0), children))
    return made


def _drive(planner: Generator[None, None, SchedulerOutput], pause: Callable[[], None]) -> SchedulerOutput:
    while True:
        try:
            next(planner)
        except StopIteration as done:
            return done.value
        pause()


def _check_rows(
    batch: StepBatch, output: SchedulerOutput, state: InputBatch, slots: list[int], expected: list[list[list[int]]]
) -> None:
    assert batch.slots == slots
    assert len(set(slots)) == len(slots), "two rows share a slot"
    tokens: list[int] = []
    for row, (item, tables) in enumerate(zip(output.scheduled, expected, strict=True)):
        request, slot = item.request, batch.slots[row]
        for g, blocks in enumerate(tables):
            length = int(state.lengths[g][slot])
            assert state.tables[g][slot, :length].tolist() == blocks, f"row {row} group {g}"
            assert (state.tables[g][slot, length:] == state._null[g]).all(), "stale entries past the table"
        temperature, top_k, top_p, min_p, seed, logprobs, top_logprobs, processed, filters = row_params(request.params)
        assert float(state.temperature[slot]) == torch.tensor(temperature, dtype=torch.float32).item()
        assert (int(state.top_k[slot]), int(state.seed[slot]), bool(state.logprobs[slot])) == (top_k, seed, logprobs)
        assert int(state.top_logprobs[slot]) == top_logprobs
        assert bool(state.processed_logprobs[slot]) == processed
        assert float(state.top_p[slot]) == torch.tensor(top_p, dtype=torch.float32).item()
        assert float(state.min_p[slot]) == torch.tensor(min_p, dtype=torch.float32).item()
        assert state.filters[slot].tolist() == torch.tensor(filters or OFF, dtype=torch.float32).tolist()
        known = request.token_ids[item.start : item.start + item.num_tokens]
        tokens += known + [0] * (item.num_tokens - len(known))
        assert batch.starts[row] == item.start and batch.num_tokens[row] == item.num_tokens
    assert batch.token_ids == tokens
    sampled = [row for row, item in enumerate(output.scheduled) if item.sample]
    assert batch.sampled == sampled
    if sampled:  # the gathered parameters (perhaps those of the step before) are the rows' own
        gathered = state.sampling_params(torch.tensor([slots[row] for row in sampled]))
        for i, row in enumerate(sampled):
            temperature, top_k, _, _, seed, _, _, _, filters = row_params(output.scheduled[row].request.params)
            assert (int(gathered.top_k[i]), int(gathered.seed[i])) == (top_k, seed)
            uses_filters = gathered.rare is not None and i in gathered.rare.rows.tolist()
            assert uses_filters == (filters is not None)
            assert float(gathered.temperature[i]) == torch.tensor(temperature, dtype=torch.float32).item()


@given(
    seed=st.integers(0, 2**32 - 1),
    num_blocks=st.integers(14, 40),
    layout=st.sampled_from(["prefix", "offload", "sliding"]),
    pipelined=st.booleans(),
)
@fuzz_settings(60)
def test_the_persistent_batch_follows_the_scheduler(seed: int, num_blocks: int, layout: str, pipelined: bool) -> None:
    rng = random.Random(seed)
    if layout == "sliding":
        groups = [CacheGroup((0,), num_blocks), CacheGroup((1,), num_blocks, sliding_window=2 * PAGE)]
    else:
        groups = [CacheGroup((0, 1), num_blocks, num_host_blocks=num_blocks if layout == "offload" else 0)]
    kv = KVCacheManager(groups, PAGE, enable_prefix_caching=layout == "prefix")
    scheduler = Scheduler(kv, max_batch_tokens=24, max_requests_per_batch=6)
    writer = BatchWriter(len(groups), 500)
    state = InputBatch([1000 + g for g in range(len(groups))], num_slots=2, width=2)
    pending = _requests(rng, 24)
    in_flight: SchedulerOutput | None = None
    steps = 0

    def cancel_one() -> None:
        live = [r for r in (*scheduler.running, *scheduler.waiting) if not r.is_finished]
        if live and rng.random() < 0.3:
            scheduler.finish(rng.choice(live), FinishReason.CANCELLED, 0.0, status=RequestStatus.CANCELLED)

    while pending or scheduler.has_work or in_flight is not None:
        steps += 1
        assert steps < 2000, "no progress"
        for _ in range(rng.randrange(3)):
            if pending:
                parent, children = pending.pop()
                scheduler.add(parent, children)
        output = None
        if scheduler.has_work:
            scheduler.hold_blocks()
            output = _drive(scheduler.plan(chunk=2), cancel_one)  # cancelled while paused: kept in the plan
            # Every planned row holds the blocks of the positions it computes, ended or not.
            expected = [[list(blocks) for blocks in item.request.block_ids] for item in output.scheduled]
            for item, tables in zip(output.scheduled, expected, strict=True):
                assert len(tables[0]) * PAGE >= item.start + item.num_tokens, "a planned row lost its blocks"
            if output.is_empty:
                output = None
                scheduler.release_blocks()
            else:
                writer.begin(output, scheduler.take_departed(), pipelined and in_flight is not None)
                slots: list[int] = []
                for stop in range(1, len(output.scheduled) + 1):
                    writer.add_rows(stop)
                    slots.append(output.scheduled[stop - 1].request.runner_state.slot)  # type: ignore[union-attr]
                    cancel_one()  # ended while the copy is paused: its blocks stay until released
                batch = writer.finish()
                state.apply(batch)
                _check_rows(batch, output, state, slots, expected)
                scheduler.release_blocks()
        done, in_flight = (in_flight, output) if pipelined else (output, None)
        if done is not None:
            tokens = [rng.randrange(1, 500) for item in done.scheduled if item.sample]
            scheduler.update(done, StepResult(tokens), 0.0)
        live = [r for r in scheduler.running]
        owned = [r.runner_state.slot for r in live if isinstance(r.runner_state, RowState) and r.runner_state.slot >= 0]
        assert len(set(owned)) == len(owned), "two running requests own one slot"
    writer.snapshot(SchedulerOutput(), scheduler.take_departed())  # the last ones' slots back
    assert writer.num_live_slots == 0, "slots leaked"
    assert kv.num_free_blocks == kv.num_total_blocks, "blocks leaked"


def _joining(slots: list[int], temperatures: list[float]) -> StepBatch:
    """A step that gives ``slots`` new owners sampling at ``temperatures`` (top-k 5 each)."""
    params = [(t, 5, 1.0, 0.0, 7, False, 0, False, None) for t in temperatures]
    return StepBatch(
        token_ids=[],
        slots=[],
        starts=[],
        num_tokens=[],
        sampled=[],
        offsets=[],
        carry_rows=[],
        carry_from=[],
        join_slots=slots,
        join_params=params,
        tables=[TableWrites()],
        controls={},
        prompt_targets={},
        num_slots=max(slots) + 1,
    )


def test_sampling_parameters_are_gathered_again_once_a_slot_changes_owner() -> None:
    state = InputBatch([1000], num_slots=2, width=2)
    state.apply(_joining([0, 1], [0.5, 0.0]))
    slots = torch.tensor([1, 0])
    first = state.sampling_params(slots)
    assert first.temperature.tolist() == [0.0, 0.5] and not first.all_greedy and first.any_top_k
    assert first.any_greedy
    assert state.sampling_params(torch.tensor([1, 0])) is first  # a steady step: the same gather
    state.apply(_joining([0], [0.0]))  # slot 0's request left, and a greedy one took the slot
    again = state.sampling_params(slots)
    assert again.temperature.tolist() == [0.0, 0.0] and again.all_greedy and not again.any_top_k
    state.apply(_joining([5], [0.25]))  # (the batch grows)
    assert state.sampling_params(torch.tensor([5, 1])).temperature.tolist() == [0.25, 0.0]
    drawn = state.sampling_params(torch.tensor([5]))
    assert not drawn.all_greedy and not drawn.any_greedy  # (a GPU draw may skip the argmax)


def test_a_draft_models_gathers_between_steps_keep_the_steps_own() -> None:
    # A draft model's passes sample the speculating rows' slots between two steps that
    # sample every row: both gathers are kept, and neither is made again.
    state = InputBatch([1000], num_slots=3, width=2)
    state.apply(_joining([0, 1, 2], [0.5, 0.0, 0.25]))
    step, drafting = torch.tensor([0, 1, 2]), torch.tensor([2])
    every, some = state.sampling_params(step), state.sampling_params(drafting)
    assert state.sampling_params(torch.tensor([0, 1, 2])) is every
    assert state.sampling_params(torch.tensor([2])) is some
    assert some.temperature.tolist() == [0.25]
    state.sampling_params(torch.tensor([1]))  # (a third: the oldest goes)
    assert state.sampling_params(step) is not every


def test_a_rows_stop_tokens_before_min_tokens_are_banned_without_a_copy_a_step() -> None:
    """A request's stop tokens (``aiocb serve`` allows 4,096 of them) are banned at each step
    before its ``min_tokens`` by reference to its own C array of them: copied into every
    sample's bans each step, 64 samples held the loop 2.2 ms a step (and gathering them from
    a set, 150,000 held the GIL 5 ms a step). The host tensors still ban them all, with the
    first token's bans at the first step only."""
    stops = frozenset(range(100, 4196))
    params = ResolvedParams(max_new_tokens=8, temperature=1.0, stop_token_ids=stops, min_tokens=2, begin_bans=(7,))
    assert sorted(params.held_stops) == sorted(stops) and params.held_stops.typecode == "q"
    request = Request("r", [1, 2, 3], params, 0.0)
    first, second, third = (row_controls(request, offset, carries=False) for offset in range(3))
    assert first.bans == (params.held_stops, (7,)) and second.bans == (params.held_stops,) and third.bans == ()
    assert first.bans[0] is params.held_stops
    host = controls_host_tensors({0: first, 1: third}, num_rows=2)
    assert host["c_ban_ids"].tolist() == [*stops, 7] and host["c_ban_rows"].tolist() == [0] * (len(stops) + 1)
