"""Scheduler: token and request budgets, chunked prefill, admission, preemption, stopping.

Most tests drive a simulated engine loop: ``schedule()``, then "run" the step against a
fake physical cache that checks every position a step reads holds what it should, then
``update()`` with deterministic fake tokens.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Generator
from dataclasses import dataclass, field
from unittest import mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from aiocb.core.kv_cache import CacheGroup, KVCacheManager, ring_size
from aiocb.core.params import ResolvedParams
from aiocb.core.request import Request
from aiocb.core.scheduler import ScheduledRequest, Scheduler, SchedulerOutput, StepResult
from aiocb.outputs import FinishReason, RequestStatus
from aiocb.speculative import SpeculativeConfig
from tests.fuzzing import fuzz_settings

PAGE = 4


# ---------------------------------------------------------------------- helpers


def make_request(
    request_id: str,
    prompt_len: int,
    max_new_tokens: int = 4,
    *,
    stop: frozenset[int] = frozenset(),
    prompt: list[int] | None = None,
) -> Request:
    if prompt is None:
        seed = sum(map(ord, request_id))
        prompt = [1 + (seed * 31 + i * 7) % 997 for i in range(prompt_len)]
    params = ResolvedParams(max_new_tokens=max_new_tokens, stop_token_ids=stop)
    return Request(request_id, prompt, params, arrival_time=0.0)


def fake_token(request: Request) -> int:
    """The token 'sampled' after ``request``'s current tokens: a function of its content only."""
    return 2000 + (sum(request.prompt_ids[:3]) * 13 + request.num_tokens * 7) % 1000


def expected_output(request: Request, count: int) -> list[int]:
    shadow = Request("shadow", list(request.prompt_ids), request.params, 0.0)
    for _ in range(count):
        shadow.token_ids.append(fake_token(shadow))
    return shadow.output_ids


def full_cache(num_blocks: int, *, prefix: bool = False, page: int = PAGE) -> KVCacheManager:
    return KVCacheManager([CacheGroup((0,), num_blocks)], page, enable_prefix_caching=prefix)


def make_scheduler(
    kv: KVCacheManager,
    *,
    budget: int = 64,
    max_requests: int = 64,
    scheduler_type: str = "fifo",
    margin: float = 0.0,
    max_model_len: int | None = None,
) -> Scheduler:
    return Scheduler(
        kv,
        max_batch_tokens=budget,
        max_requests_per_batch=max_requests,
        scheduler_type=scheduler_type,
        safety_margin=margin,
        max_model_len=max_model_len,
    )


def plan(output: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    """``(request id, start, num_tokens, sample)`` per scheduled request, in order."""
    return [(s.request.request_id, s.start, s.num_tokens, s.sample) for s in output.scheduled]


def step(scheduler: Scheduler, now: float = 1.0) -> tuple[SchedulerOutput, list[Request]]:
    """One engine step with fake tokens."""
    output = scheduler.schedule()
    tokens = [fake_token(s.request) for s in output.scheduled if s.sample]
    return output, scheduler.update(output, StepResult(tokens), now)


class PhysicalCache:
    """What the KV tensors would hold: ``(position, token)`` per (group, block, offset).

    Before a step writes, it checks every earlier position each scheduled request attends
    to is stored where its block table says, with the right token: a wrong prefix hit, a
    block handed to two requests, or a ring too small shows up as a mismatch.
    """

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.windows = [g.sliding_window for g in kv.groups]
        self.rings = [None if w is None else ring_size(w, kv.page_size) for w in self.windows]
        self.slots: list[dict[tuple[int, int], tuple[int, int]]] = [{} for _ in kv.groups]

    def _where(self, group: int, table: list[int], position: int) -> tuple[int, int]:
        column = position // self.kv.page_size
        ring = self.rings[group]
        if ring is not None:
            column %= ring
        return table[column], position % self.kv.page_size

    def sealed(self) -> list[set[int]]:
        """Per group, the blocks a request holds that hold a registered prefix: no step may
        write them while they are shared. (A free block that keeps a hash may be evicted
        and written, and a block a step completes is registered as the step is planned.)"""
        return [
            {b for b in range(pool.num_blocks) if pool.ref_count(b) and pool.block_hash(b) is not None}
            for pool in self.kv.pools
        ]

    def run(self, output: SchedulerOutput, sealed_before: list[set[int]]) -> None:
        """Apply a step: check every read against what was written, and that a shared block
        is only written by the one request computing it in this step.

        (Blocks a step computes are registered when it is planned, so that a request
        admitted into the same step can share them; a block overwritten while another
        request could still hit it shows up as a wrong read.)
        """
        writers: list[dict[int, Request]] = [{} for _ in self.windows]
        for item in output.scheduled:
            request = item.request
            for group, window in enumerate(self.windows):
                table = request.block_ids[group]
                first = 0 if window is None else max(0, item.start - (window - 1))
                for position in range(first, item.start):
                    where = self._where(group, table, position)
                    held = self.slots[group].get(where)
                    assert held == (position, request.token_ids[position]), (request.request_id, group, position)
                pool = self.kv.pools[group]
                for position in range(item.start, item.start + item.num_tokens):
                    block, offset = self._where(group, table, position)
                    # Shared only with requests admitted into this step to reuse what it computes.
                    assert pool.ref_count(block) == 1 or block not in sealed_before[group], "writes a shared block"
                    assert writers[group].setdefault(block, request) is request, "two requests write one block"
                    self.slots[group][(block, offset)] = (position, request.token_ids[position])


@dataclass
class SimResult:
    steps: int = 0
    finished: Counter[str] = field(default_factory=Counter)
    preempted: Counter[str] = field(default_factory=Counter)
    #: the step (0-based) at which each request finished
    finished_at: dict[str, int] = field(default_factory=dict)
    max_running: int = 0


def check_state(scheduler: Scheduler) -> None:
    """Invariants that hold between steps (and right after ``schedule()``)."""
    kv = scheduler.kv_cache
    assert not set(scheduler.waiting) & set(scheduler.running)
    # prompt tokens: what admission backpressure bounds (a preempted request's output is not counted)
    assert scheduler.num_waiting_tokens == sum(r.num_prompt_tokens for r in scheduler.waiting)
    for request in scheduler.waiting:
        assert request.status is RequestStatus.PENDING
        assert not request.block_ids
        assert request.num_computed_tokens == 0
    for g, pool in enumerate(kv.pools):
        held: Counter[int] = Counter()
        for request in scheduler.running:
            assert request.status in (RequestStatus.PREFILLING, RequestStatus.DECODING)
            table = request.block_ids[g]
            assert len(set(table)) == len(table)
            assert len(table) == kv._blocks_wanted(g, request.num_computed_tokens)
            held.update(table)
        for block in range(pool.num_blocks):
            assert pool.ref_count(block) == held[block], (g, block)
        assert pool.num_free == pool.num_blocks - len(held)


def simulate(
    scheduler: Scheduler,
    requests: list[Request],
    *,
    max_steps: int = 10_000,
) -> SimResult:
    """Run the engine loop until every request has finished; check invariants each step."""
    physical = PhysicalCache(scheduler.kv_cache)
    result = SimResult()
    for request in requests:
        scheduler.add(request)
    while scheduler.has_work:
        assert result.steps < max_steps, "no progress: deadlock or livelock"
        order = {r: i for i, r in enumerate(scheduler.running)}
        before = {r: r.num_computed_tokens for r in scheduler.running}
        sealed_before = physical.sealed()
        output = scheduler.schedule()
        assert not output.is_empty, "an empty step while requests are pending"
        assert output.num_tokens <= scheduler.max_batch_tokens
        assert len(output.scheduled) <= scheduler.max_requests_per_batch
        scheduled = [s.request for s in output.scheduled]
        assert len(set(scheduled)) == len(scheduled)
        for item in output.scheduled:
            request = item.request
            assert item.num_tokens >= 1
            assert request in scheduler.running
            assert item.start + item.num_tokens == request.num_computed_tokens <= request.num_tokens
            assert item.sample == (request.num_computed_tokens == request.num_tokens)
            if request in before:  # a running request continues where it was
                assert item.start == before[request]
        # preemption takes the newest running requests and puts them first in line, in order
        for victim in output.preempted:
            assert victim in order
            assert victim not in scheduler.running
            assert all(order[victim] > order[r] for r in scheduler.running if r in order)
            result.preempted[victim.request_id] += 1
        assert list(scheduler.waiting)[: len(output.preempted)] == sorted(output.preempted, key=order.__getitem__)
        check_state(scheduler)
        physical.run(output, sealed_before)
        result.max_running = max(result.max_running, len(scheduler.running))
        tokens = [fake_token(s.request) for s in output.scheduled if s.sample]
        finished = scheduler.update(output, StepResult(tokens), float(result.steps))
        for request in finished:
            assert request.is_finished
            assert not request.block_ids
            assert request not in scheduler.running
            assert request not in scheduler.waiting
            result.finished[request.request_id] += 1
            result.finished_at[request.request_id] = result.steps
        check_state(scheduler)
        result.steps += 1
    kv = scheduler.kv_cache
    assert kv.num_free_blocks == kv.num_total_blocks, "blocks leaked"
    assert scheduler.num_waiting_tokens == 0
    return result


def assert_all_finished(result: SimResult, requests: list[Request]) -> None:
    assert result.finished == Counter({r.request_id: 1 for r in requests})
    for request in requests:
        assert request.status is RequestStatus.FINISHED
        assert request.finish_reason is FinishReason.LENGTH
        assert request.output_ids == expected_output(request, request.params.max_new_tokens)
        assert request.num_preemptions == result.preempted[request.request_id]


# ---------------------------------------------------------------------- budgets, chunking


def test_chunked_prefill_spreads_a_long_prompt_and_samples_only_at_its_end() -> None:
    scheduler = make_scheduler(full_cache(64), budget=10)
    request = make_request("a", 25, max_new_tokens=3)
    scheduler.add(request)
    plans = []
    for _ in range(5):
        output, _ = step(scheduler)
        plans.append(plan(output))
    assert plans == [
        [("a", 0, 10, False)],
        [("a", 10, 10, False)],
        [("a", 20, 5, True)],
        [("a", 25, 1, True)],
        [("a", 26, 1, True)],
    ]
    assert request.status is RequestStatus.FINISHED
    assert request.first_token_time == 1.0
    assert request.num_output_tokens == 3
    assert not scheduler.has_work


def test_update_takes_tokens_only_for_sampled_rows() -> None:
    scheduler = make_scheduler(full_cache(64), budget=12)
    a, b = make_request("a", 3), make_request("b", 20)
    scheduler.add(a)
    scheduler.add(b)
    output = scheduler.schedule()
    assert plan(output) == [("a", 0, 3, True), ("b", 0, 9, False)]
    assert scheduler.update(output, StepResult([42]), 1.0) == []
    assert a.output_ids == [42]
    assert b.output_ids == []
    assert a.status is RequestStatus.DECODING
    assert b.status is RequestStatus.PREFILLING
    assert b.first_token_time is None


def test_update_records_logprobs_of_the_requests_that_asked() -> None:
    scheduler = make_scheduler(full_cache(64))
    a = Request("a", [1, 2, 3], ResolvedParams(max_new_tokens=4, return_logprobs=True), arrival_time=0.0)
    b = make_request("b", 5)
    scheduler.add(a)
    scheduler.add(b)
    output = scheduler.schedule()
    scheduler.update(output, StepResult([7, 8], [-0.5, -1.5]), 1.0)
    assert (a.output_ids, a.logprobs) == ([7], [-0.5])
    assert (b.output_ids, list(b.logprobs)) == ([8], [])


@pytest.mark.parametrize("budget", [1, 3, 7, 16])
def test_token_budget_is_respected_every_step(budget: int) -> None:
    scheduler = make_scheduler(full_cache(200), budget=budget)
    requests = [make_request(f"r{i}", 5 + 3 * i, max_new_tokens=4) for i in range(6)]
    result = simulate(scheduler, requests)  # simulate() asserts the budget at every step
    assert_all_finished(result, requests)
    # a one-token budget still finishes, one token per step
    total = sum(r.num_prompt_tokens + r.params.max_new_tokens - 1 for r in requests)
    assert result.steps >= -(-total // budget)
    assert scheduler.stats.num_computed_tokens == total


def test_a_step_fills_the_budget_when_work_allows() -> None:
    scheduler = make_scheduler(full_cache(200), budget=16)
    for i in range(4):
        scheduler.add(make_request(f"r{i}", 10))
    output = scheduler.schedule()
    assert output.num_tokens == 16
    assert plan(output) == [("r0", 0, 10, True), ("r1", 0, 6, False)]


@pytest.mark.parametrize("max_requests", [1, 2, 3])
def test_max_requests_per_batch_is_respected(max_requests: int) -> None:
    scheduler = make_scheduler(full_cache(200), budget=64, max_requests=max_requests)
    requests = [make_request(f"r{i}", 3, max_new_tokens=3) for i in range(5)]
    for request in requests:
        scheduler.add(request)
    output = scheduler.schedule()
    assert len(output.scheduled) == max_requests
    assert len(scheduler.running) == max_requests
    assert len(scheduler.waiting) == 5 - max_requests
    # and over a whole run (simulate() checks every step)
    fresh = [make_request(f"r{i}", 3, max_new_tokens=3) for i in range(5)]
    result = simulate(make_scheduler(full_cache(200), budget=64, max_requests=max_requests), fresh)
    assert result.max_running == max_requests
    assert_all_finished(result, fresh)


def test_decode_and_prefill_share_a_step() -> None:
    scheduler = make_scheduler(full_cache(64), budget=8)
    a = make_request("a", 4, max_new_tokens=5)
    scheduler.add(a)
    step(scheduler)
    b = make_request("b", 20)
    scheduler.add(b)
    output, _ = step(scheduler)
    assert plan(output) == [("a", 4, 1, True), ("b", 0, 7, False)]
    assert b.status is RequestStatus.PREFILLING


def _decoder_and_long_prefill(scheduler_type: str) -> tuple[Scheduler, SchedulerOutput]:
    scheduler = make_scheduler(full_cache(64), budget=16, scheduler_type=scheduler_type)
    scheduler.add(make_request("a", 4, max_new_tokens=8))
    scheduler.add(make_request("b", 30))
    first, _ = step(scheduler)
    assert plan(first) == [("a", 0, 4, True), ("b", 0, 12, False)]
    return scheduler, scheduler.schedule()


def test_fifo_schedules_decoding_requests_before_prefilling_ones() -> None:
    _, output = _decoder_and_long_prefill("fifo")
    assert plan(output) == [("a", 4, 1, True), ("b", 12, 15, False)]


def test_prefill_first_schedules_prefilling_requests_before_decoding_ones() -> None:
    scheduler, output = _decoder_and_long_prefill("prefill_first")
    assert plan(output) == [("b", 12, 16, False)]  # b takes the whole budget, a waits a step
    scheduler.update(output, StepResult([]), 2.0)
    output, _ = step(scheduler)
    assert plan(output) == [("b", 28, 2, True), ("a", 4, 1, True)]


def test_fifo_decoding_order_follows_admission_order() -> None:
    scheduler = make_scheduler(full_cache(64), budget=64)
    for name in "abc":
        scheduler.add(make_request(name, 3, max_new_tokens=5))
    step(scheduler)
    output, _ = step(scheduler)
    assert [s.request.request_id for s in output.scheduled] == ["a", "b", "c"]


# ---------------------------------------------------------------------- admission


def test_safety_margin_blocks_admission_while_requests_run() -> None:
    scheduler = make_scheduler(full_cache(10), budget=64, margin=0.5)
    a = make_request("a", 24, max_new_tokens=2)  # 6 of 10 blocks: 40% left, under the margin
    scheduler.add(a)
    step(scheduler)
    b = make_request("b", 4, max_new_tokens=2)
    scheduler.add(b)
    output, _ = step(scheduler)
    assert plan(output) == [("a", 24, 1, True)]  # b fits, but the margin keeps it waiting
    assert b in scheduler.waiting
    assert a.is_finished
    output, _ = step(scheduler)  # nothing runs now: b is admitted
    assert plan(output) == [("b", 0, 4, True)]


def test_no_margin_admits_what_fits() -> None:
    scheduler = make_scheduler(full_cache(10), budget=64, margin=0.0)
    scheduler.add(make_request("a", 24, max_new_tokens=2))
    step(scheduler)
    scheduler.add(make_request("b", 4, max_new_tokens=2))
    output, _ = step(scheduler)
    assert plan(output) == [("a", 24, 1, True), ("b", 0, 4, True)]


def test_a_full_margin_runs_one_request_at_a_time_but_never_stalls() -> None:
    scheduler = make_scheduler(full_cache(20), budget=64, margin=1.0)
    requests = [make_request(f"r{i}", 6, max_new_tokens=3) for i in range(4)]
    result = simulate(scheduler, requests)
    assert result.max_running == 1  # nothing runs: admitted; something runs: margin not met
    assert_all_finished(result, requests)


def test_admission_is_first_in_first_out() -> None:
    scheduler = make_scheduler(full_cache(4), budget=64)
    big = make_request("big", 16, max_new_tokens=1)  # the whole cache
    small = make_request("small", 2, max_new_tokens=1)
    scheduler.add(make_request("a", 4, max_new_tokens=3))
    scheduler.add(big)
    scheduler.add(small)
    output, _ = step(scheduler)
    assert plan(output) == [("a", 0, 4, True)]  # small would fit, but big is first in line
    assert list(scheduler.waiting) == [big, small]
    assert not big.block_ids


@pytest.mark.parametrize("scheduler_type", ["fifo", "prefill_first"])
def test_a_long_prompt_leaves_half_the_step_to_requests_waiting_behind_it(scheduler_type: str) -> None:
    """While a request waits that could be admitted, running prompts' chunks take half the
    step's tokens at most: the short request behind a long prompt starts at once, instead
    of after the long one's whole prefill; with nobody waiting the long prompt has the
    whole step again."""
    scheduler = make_scheduler(full_cache(64), budget=16, scheduler_type=scheduler_type)
    scheduler.add(make_request("long", 100, max_new_tokens=2))
    assert plan(step(scheduler)[0]) == [("long", 0, 16, False)]  # (nobody waits)
    scheduler.add(make_request("short", 5, max_new_tokens=2))
    assert plan(step(scheduler)[0]) == [("long", 16, 8, False), ("short", 0, 5, True)]
    # (fifo decodes the short one first; prefill_first, prefills first, lets it wait)
    expected = (
        [("short", 5, 1, True), ("long", 24, 15, False)] if scheduler_type == "fifo" else [("long", 24, 16, False)]
    )
    assert plan(step(scheduler)[0]) == expected


def test_a_prompt_that_outranks_the_waiting_request_keeps_the_whole_step() -> None:
    """Under priorities the half-step cap holds back only prompts that do not outrank the
    request waiting: an urgent prompt's prefill was halved by lower-priority requests
    arriving behind it (its first token twice as late), an equal one's still is."""
    scheduler = make_scheduler(full_cache(64), budget=16)
    scheduler.add(_prioritised("urgent", 100, -10, 2))
    assert plan(step(scheduler)[0]) == [("urgent", 0, 16, False)]
    scheduler.add(_prioritised("low", 5, 10, 2))
    assert plan(step(scheduler)[0]) == [("urgent", 16, 16, False)]  # (low waits: urgent outranks it)
    equal = make_scheduler(full_cache(64), budget=16)
    equal.add(_prioritised("first", 100, 3, 2))
    step(equal)
    equal.add(_prioritised("second", 5, 3, 2))
    assert plan(step(equal)[0]) == [("first", 16, 8, False), ("second", 0, 5, True)]


def test_a_long_prompt_keeps_the_whole_step_while_nothing_waiting_could_be_admitted() -> None:
    """The cap is for admitting what waits: with the batch's rows all taken, or no blocks
    for the waiting request's first chunk, the running prompt keeps the whole step."""
    rows_taken = make_scheduler(full_cache(64), budget=16, max_requests=1)
    rows_taken.add(make_request("long", 100, max_new_tokens=2))
    step(rows_taken)
    rows_taken.add(make_request("short", 5))
    assert [plan(step(rows_taken)[0]) for _ in range(2)] == [[("long", 16, 16, False)], [("long", 32, 16, False)]]
    no_blocks = make_scheduler(full_cache(64), budget=16)
    no_blocks.add(make_request("long", 100, max_new_tokens=2))
    step(no_blocks)
    no_blocks.add(make_request("big", 12))
    asked: list[tuple[str, int]] = []

    def no_room(request: Request, num_new_tokens: int, spare: int = 0) -> bool:
        asked.append((request.request_id, num_new_tokens))
        return False

    with mock.patch.object(no_blocks.kv_cache, "has_room", no_room):
        assert plan(no_blocks.schedule()) == [("long", 16, 16, False)]
    assert asked == [("big", 8)]  # (its first chunk: the half step it would get)


def test_admission_stops_at_the_token_budget() -> None:
    scheduler = make_scheduler(full_cache(64), budget=5)
    for name in "abc":
        scheduler.add(make_request(name, 5))
    output = scheduler.schedule()
    assert plan(output) == [("a", 0, 5, True)]
    assert len(scheduler.waiting) == 2


# ---------------------------------------------------------------------- preemption


def test_preemption_frees_the_newest_request_and_requeues_it_first() -> None:
    scheduler = make_scheduler(full_cache(4), budget=64)
    a = make_request("a", 8, max_new_tokens=3)
    b = make_request("b", 8, max_new_tokens=3)
    c = make_request("c", 2, max_new_tokens=1)
    for request in (a, b, c):
        scheduler.add(request)
    output, _ = step(scheduler)
    assert plan(output) == [("a", 0, 8, True), ("b", 0, 8, True)]  # the cache is full: c waits
    b_tokens = list(b.token_ids)
    # a's 9th token needs a third block: b, the newest, makes room
    output, _ = step(scheduler)
    assert plan(output) == [("a", 8, 1, True)]
    assert output.preempted == [b]
    assert list(scheduler.waiting) == [b, c]
    assert b.status is RequestStatus.PENDING
    assert not b.block_ids
    assert b.num_computed_tokens == 0
    assert b.num_preemptions == 1
    assert b.token_ids == b_tokens  # generated tokens are kept, only the KV is recomputed
    assert scheduler.num_waiting_tokens == 8 + 2  # prompt tokens
    assert scheduler.stats.num_preemptions == 1
    assert scheduler.stats.num_recomputed_tokens == 0  # (counted once readmitted: its blocks may come back)
    # a finishes; b is recomputed from scratch, its generated token included
    output, _ = step(scheduler)
    assert plan(output) == [("a", 9, 1, True)]
    assert a.is_finished
    output, _ = step(scheduler)
    assert plan(output) == [("b", 0, 9, True), ("c", 0, 2, True)]
    assert scheduler.stats.num_recomputed_tokens == 8
    assert b.output_ids == expected_output(b, 2)


def test_preemption_of_a_request_planned_earlier_in_the_step_unplans_it() -> None:
    # prefill_first: b (newest, prefilling) is planned first and takes the last block; a
    # (decoding, older) then needs a block, so b is preempted and must leave the plan.
    kv = full_cache(3)
    scheduler = make_scheduler(kv, budget=5, scheduler_type="prefill_first")
    a = make_request("a", 3, max_new_tokens=8)
    scheduler.add(a)
    step(scheduler)
    b = make_request("b", 5, max_new_tokens=1)
    scheduler.add(b)
    output, _ = step(scheduler)
    assert plan(output) == [("a", 3, 1, True), ("b", 0, 4, False)]
    assert kv.num_free_blocks == 1
    output = scheduler.schedule()
    assert output.preempted == [b]
    assert plan(output) == [("a", 4, 1, True)]
    assert list(scheduler.waiting) == [b]
    assert b.num_computed_tokens == 0
    assert b.num_lost_tokens == 4 and scheduler.stats.num_recomputed_tokens == 0  # (counted once readmitted)
    check_state(scheduler)


def test_the_oldest_request_is_never_preempted() -> None:
    kv = full_cache(6)
    scheduler = make_scheduler(kv, budget=16)
    requests = [make_request(f"r{i}", 6 + i % 3, max_new_tokens=10) for i in range(8)]
    result = simulate(scheduler, requests)
    assert_all_finished(result, requests)
    assert sum(result.preempted.values()) > 0  # the cache really was too small
    assert result.preempted["r0"] == 0
    # and it progresses every step: prefill in the first, then one token per step
    assert result.finished_at["r0"] == requests[0].params.max_new_tokens - 1


@pytest.mark.parametrize("scheduler_type", ["fifo", "prefill_first"])
@pytest.mark.parametrize("prefix", [False, True])
def test_many_requests_on_a_tiny_cache_all_finish(scheduler_type: str, prefix: bool) -> None:
    kv = full_cache(8, prefix=prefix)  # 32 tokens of cache
    scheduler = make_scheduler(kv, budget=12, max_requests=6, scheduler_type=scheduler_type, margin=0.1)
    lengths = [3, 17, 9, 1, 20, 5, 12, 8, 2, 15, 11, 4, 7, 13, 6, 10]
    requests = [make_request(f"r{i}", n, max_new_tokens=1 + (i * 5) % 12) for i, n in enumerate(lengths)]
    result = simulate(scheduler, requests, max_steps=2000)
    assert_all_finished(result, requests)
    assert sum(result.preempted.values()) > 0
    assert scheduler.stats.num_preemptions == sum(result.preempted.values())
    assert scheduler.stats.num_generated_tokens == sum(r.params.max_new_tokens for r in requests)


def test_requests_sharing_a_prefix_on_a_tiny_cache() -> None:
    kv = full_cache(10, prefix=True)
    scheduler = make_scheduler(kv, budget=10, max_requests=4, margin=0.0)
    system = list(range(500, 512))  # 3 pages shared by everyone
    requests = [
        make_request(f"r{i}", 0, max_new_tokens=2 + i % 5, prompt=[*system, *range(i, i + 1 + i % 7)])
        for i in range(12)
    ]
    result = simulate(scheduler, requests, max_steps=2000)
    assert_all_finished(result, requests)
    assert kv.num_prefix_hit_tokens > 0
    assert any(r.num_cached_tokens >= 12 for r in requests)


def test_hybrid_cache_with_a_sliding_group_finishes_everything() -> None:
    groups = [CacheGroup((0,), 12), CacheGroup((1,), 6, sliding_window=6)]  # ring of 3
    kv = KVCacheManager(groups, PAGE, enable_prefix_caching=True)
    scheduler = make_scheduler(kv, budget=9, max_requests=4)
    requests = [make_request(f"r{i}", 3 + 4 * i, max_new_tokens=6) for i in range(6)]
    result = simulate(scheduler, requests, max_steps=2000)
    assert_all_finished(result, requests)
    assert sum(result.preempted.values()) > 0  # the sliding pool ran out of rings


# ---------------------------------------------------------------------- stopping


def test_a_stop_token_finishes_with_stop_and_is_kept() -> None:
    scheduler = make_scheduler(full_cache(16))
    probe = make_request("a", 4, max_new_tokens=10)
    stop_after_two = expected_output(probe, 2)[1]
    assert expected_output(probe, 1)[0] != stop_after_two  # so the stop ends the second token
    request = make_request("a", 4, max_new_tokens=10, stop=frozenset({stop_after_two}))
    scheduler.add(request)
    finished: list[Request] = []
    for _ in range(5):
        finished += step(scheduler)[1]
    assert finished == [request]
    assert request.finish_reason is FinishReason.STOP
    assert request.status is RequestStatus.FINISHED
    assert request.output_ids == expected_output(request, 2)
    assert request.output_ids[-1] == stop_after_two


def test_max_new_tokens_finishes_with_length() -> None:
    scheduler = make_scheduler(full_cache(16))
    request = make_request("a", 4, max_new_tokens=3)
    scheduler.add(request)
    results = [step(scheduler, now=float(i))[1] for i in range(3)]
    assert results == [[], [], [request]]
    assert request.finish_reason is FinishReason.LENGTH
    assert request.num_output_tokens == 3
    assert request.finished_time == 2.0
    assert request.first_token_time == 0.0
    assert not request.block_ids
    assert not scheduler.has_work


def test_max_model_len_finishes_with_length() -> None:
    scheduler = make_scheduler(full_cache(16), max_model_len=7)
    request = make_request("a", 5, max_new_tokens=10)
    scheduler.add(request)
    step(scheduler)
    assert not request.is_finished
    _, finished = step(scheduler)
    assert finished == [request]
    assert request.finish_reason is FinishReason.LENGTH
    assert request.num_tokens == 7


def test_a_stop_token_wins_over_length() -> None:
    scheduler = make_scheduler(full_cache(16))
    probe = make_request("a", 4, max_new_tokens=1)
    request = make_request("a", 4, max_new_tokens=1, stop=frozenset(expected_output(probe, 1)))
    scheduler.add(request)
    step(scheduler)
    assert request.finish_reason is FinishReason.STOP


# ---------------------------------------------------------------------- finish()


def test_finish_a_waiting_request() -> None:
    scheduler = make_scheduler(full_cache(16))
    a, b = make_request("a", 5), make_request("b", 7)
    scheduler.add(a)
    scheduler.add(b)
    assert scheduler.num_waiting_tokens == 12
    scheduler.finish(a, FinishReason.CANCELLED, 3.0, status=RequestStatus.CANCELLED)
    assert a.status is RequestStatus.CANCELLED
    assert a.finish_reason is FinishReason.CANCELLED
    assert a.finished_time == 3.0
    assert list(scheduler.waiting) == [b]
    assert scheduler.num_waiting_tokens == 7
    output, _ = step(scheduler)
    assert plan(output) == [("b", 0, 7, True)]


def test_finish_a_running_request_frees_its_blocks_and_drops_its_token() -> None:
    kv = full_cache(16)
    scheduler = make_scheduler(kv)
    a, b = make_request("a", 5), make_request("b", 6)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler)
    output = scheduler.schedule()
    assert kv.num_free_blocks == 16 - 2 - 2
    scheduler.finish(a, FinishReason.ERROR, 2.0, status=RequestStatus.FAILED, error="boom")
    assert kv.num_free_blocks == 16 - 2
    assert not a.block_ids
    assert a not in scheduler.running
    # the step was already planned with a in it: its row is skipped, b gets its own token
    assert scheduler.update(output, StepResult([111, 222]), 3.0) == []
    assert a.num_output_tokens == 1
    assert b.output_ids[-1] == 222
    assert (a.status, a.finish_reason, a.error) == (RequestStatus.FAILED, FinishReason.ERROR, "boom")
    check_state(scheduler)


def test_finish_is_idempotent() -> None:
    kv = full_cache(16)
    scheduler = make_scheduler(kv)
    request = make_request("a", 5)
    scheduler.add(request)
    step(scheduler)
    scheduler.finish(request, FinishReason.CANCELLED, 2.0, status=RequestStatus.CANCELLED)
    scheduler.finish(request, FinishReason.TIMEOUT, 5.0, status=RequestStatus.FAILED, error="late")
    assert (request.status, request.finish_reason, request.finished_time, request.error) == (
        RequestStatus.CANCELLED,
        FinishReason.CANCELLED,
        2.0,
        None,
    )
    assert kv.num_free_blocks == kv.num_total_blocks
    assert scheduler.num_waiting_tokens == 0
    assert not scheduler.has_work


def test_num_waiting_tokens_tracks_the_queue() -> None:
    scheduler = make_scheduler(full_cache(4), budget=64)
    a, b, c = make_request("a", 8, 3), make_request("b", 8, 3), make_request("c", 3, 3)
    for request in (a, b, c):
        scheduler.add(request)
    assert scheduler.num_waiting_tokens == 19
    step(scheduler)  # a, b admitted
    assert scheduler.num_waiting_tokens == 3
    step(scheduler)  # b preempted with its generated token: its prompt counts again
    assert b in scheduler.waiting
    assert b.num_output_tokens == 1
    assert scheduler.num_waiting_tokens == 3 + 8
    scheduler.finish(b, FinishReason.CANCELLED, 1.0)
    assert scheduler.num_waiting_tokens == 3
    check_state(scheduler)


# ---------------------------------------------------------------------- prefix hits in the scheduler


def test_a_prefix_hit_skips_the_cached_tokens() -> None:
    kv = full_cache(16, prefix=True)
    scheduler = make_scheduler(kv)
    prompt = list(range(1, 15))  # 3 full pages + 2
    a = make_request("a", 0, max_new_tokens=1, prompt=prompt)
    scheduler.add(a)
    step(scheduler)
    b = make_request("b", 0, max_new_tokens=1, prompt=prompt)
    scheduler.add(b)
    output, _ = step(scheduler)
    assert plan(output) == [("b", 12, 2, True)]
    assert b.num_cached_tokens == 12
    assert kv.num_prefix_hit_tokens == 12
    assert scheduler.stats.num_computed_tokens == 14 + 2


def test_a_failed_admission_does_not_count_prefix_hits() -> None:
    # Regression: a request whose hits are released because it does not fit yet counted
    # its hits again at every retry.
    kv = full_cache(6, prefix=True)
    scheduler = make_scheduler(kv)
    shared = list(range(1, 9))  # 2 pages
    a = make_request("a", 0, max_new_tokens=6, prompt=[*shared, 50, 51, 52, 53, 54, 55, 56, 57])  # 4 blocks
    scheduler.add(a)
    step(scheduler)
    b = make_request("b", 0, max_new_tokens=1, prompt=[*shared, *range(60, 72)])  # 2 hits + 3 new blocks
    scheduler.add(b)
    for _ in range(3):
        output, _ = step(scheduler)
        assert [s.request for s in output.scheduled] == [a]  # b does not fit next to a
        assert b.num_computed_tokens == 0
        assert not b.block_ids
    assert kv.num_prefix_hit_tokens == 0
    while not a.is_finished:
        step(scheduler)
    output, _ = step(scheduler)
    assert plan(output) == [("b", 8, 12, True)]
    assert b.num_cached_tokens == 8
    assert kv.num_prefix_hit_tokens == 8


# ---------------------------------------------------------------------- property test


@st.composite
def workloads(draw: st.DrawFn) -> tuple[Scheduler, list[Request]]:
    page = draw(st.sampled_from([1, 2, 4, 8]))
    num_blocks = draw(st.integers(2, 24))
    sliding = draw(st.one_of(st.none(), st.integers(1, 20)))
    groups = [CacheGroup((0,), num_blocks)]
    if sliding is not None:
        ring = ring_size(sliding, page)
        groups.append(CacheGroup((1,), draw(st.integers(ring, 3 * ring)), sliding_window=sliding))
    kv = KVCacheManager(groups, page, enable_prefix_caching=draw(st.booleans()))
    capacity = kv.capacity_tokens
    assert capacity == num_blocks * page
    scheduler = make_scheduler(
        kv,
        budget=draw(st.integers(1, 40)),
        max_requests=draw(st.integers(1, 8)),
        scheduler_type=draw(st.sampled_from(["fifo", "prefill_first"])),
        margin=draw(st.sampled_from([0.0, 0.1, 0.15, 0.5, 1.0])),
    )
    shared = draw(st.lists(st.integers(1, 5), max_size=capacity))  # e.g. a system prompt
    requests: list[Request] = []
    for i in range(draw(st.integers(1, 10))):
        # the manager's limit: prompt + max_new_tokens fits the cache alone
        total = draw(st.integers(2, capacity + 1))  # the last token's KV is never needed
        max_new = draw(st.integers(1, total - 1))
        prompt_len = total - max_new
        kind = draw(st.sampled_from(["fresh", "shared", "repeat"]))
        if kind == "repeat" and requests:  # an earlier prompt again (or its start): full-page hits
            prompt = requests[draw(st.integers(0, len(requests) - 1))].prompt_ids[:prompt_len]
        else:
            prompt = shared[:prompt_len] if kind == "shared" else []
        prompt = prompt + [100 + (i * 37 + j) % 50 for j in range(prompt_len - len(prompt))]
        requests.append(make_request(f"r{i}", 0, max_new_tokens=max_new, prompt=prompt))
    return scheduler, requests


@pytest.mark.parametrize(
    ("page", "budget", "prompts"),
    [
        # r2 takes the block that held r0's prefix and registers its own prompt there
        (1, 2, [[100], [137], [124], [124, 111]]),
        # r2 takes the block that held this very prefix (the pool evicted it) and registers it again
        (2, 8, [[1, 4], [8, 8], [1, 4], [1, 4, 7]]),
        # r2's prompt is chunked: its second step completes the block r3 shares
        (2, 2, [[100], [137, 138], [124, 125], [124, 125, 111]]),
    ],
)
def test_a_block_registered_in_a_step_is_shared_in_that_step(page: int, budget: int, prompts: list[list[int]]) -> None:
    """r2 registers a prefix block as the step that writes it is planned; r3, admitted into
    the same step, shares it while r2 writes it."""
    kv = KVCacheManager([CacheGroup((0,), 2)], page, enable_prefix_caching=True)
    scheduler = make_scheduler(kv, budget=budget, max_requests=2)
    requests = [make_request(f"r{i}", 0, max_new_tokens=1, prompt=p) for i, p in enumerate(prompts)]
    result = simulate(scheduler, requests)
    assert_all_finished(result, requests)
    assert requests[3].num_cached_tokens == len(prompts[2])


def _general_loop_only(
    self: Scheduler,
    planned: dict[Request, int],
    decoded: list[ScheduledRequest],
    completing: list[Request],
    chunk: int,
) -> Generator[None, None, None]:
    """A stand-in for ``Scheduler._plan_decodes`` that always leaves the step to the general loop."""
    yield from ()


def _plans(scheduler: Scheduler, requests: list[Request]) -> tuple[list[object], list[int]]:
    """Every step's rows and preemptions, then how many prompt tokens each request found cached."""
    for request in requests:
        scheduler.add(request)
    plans: list[object] = []
    while scheduler.has_work and len(plans) < 2_000:
        output = scheduler.schedule()
        plans.append(
            (
                [(s.request.request_id, s.start, s.num_tokens, s.sample, s.carries) for s in output.scheduled],
                [r.request_id for r in output.preempted],
                [r.num_pending_tokens for r in requests],
            )
        )
        scheduler.update(output, StepResult([fake_token(s.request) for s in output.scheduled if s.sample]), 0.0)
    return plans, [r.num_cached_tokens for r in requests]


@fuzz_settings(100)
@given(workload=workloads())
def test_the_decoding_rows_short_loop_plans_what_the_general_loop_plans(
    workload: tuple[Scheduler, list[Request]],
) -> None:
    shortcut = _plans(*copy.deepcopy(workload))
    with mock.patch.object(Scheduler, "_plan_decodes", _general_loop_only):
        general = _plans(*workload)
    assert shortcut == general


@fuzz_settings(200)
@given(workload=workloads())
def test_random_workloads_run_to_completion(workload: tuple[Scheduler, list[Request]]) -> None:
    scheduler, requests = workload
    total = sum(r.num_prompt_tokens + r.params.max_new_tokens for r in requests)
    result = simulate(scheduler, requests, max_steps=50 * total + 50)
    assert_all_finished(result, requests)
    assert result.preempted[requests[0].request_id] == 0
    assert scheduler.stats.num_generated_tokens == sum(r.params.max_new_tokens for r in requests)


def test_a_decoding_row_preempted_later_in_the_same_plan_leaves_it() -> None:
    """The short loop plans B's next token first; A, before it in the running order and still
    computing its prompt (scored two positions a step), then finds no block, so B (the last
    running) is preempted: it leaves the plan with nothing planned or pending."""
    kv = full_cache(3, page=2)
    scheduler = Scheduler(kv, max_batch_tokens=8, max_requests_per_batch=4, safety_margin=0.0, max_scored_tokens=2)
    a = Request("a", list(range(1, 11)), ResolvedParams(max_new_tokens=4, prompt_logprobs=True), arrival_time=0.0)
    b = make_request("b", 2)
    scheduler.add(a)
    scheduler.add(b)
    first = scheduler.schedule()
    planned = [(s.request, s.start, s.num_tokens, s.sample) for s in first.scheduled]
    assert planned == [(a, 0, 2, False), (b, 0, 2, True)]
    scheduler.update(first, StepResult([fake_token(b)], prompt_logprobs=[([-1.0, -1.0], None)]), 0.0)
    assert b.status is RequestStatus.DECODING and a.status is RequestStatus.PREFILLING
    second = scheduler.schedule()
    assert [(s.request, s.start, s.num_tokens) for s in second.scheduled] == [(a, 2, 2)]
    assert second.preempted == [b] and second.num_sampled == 0
    assert (b.num_computed_tokens, b.num_pending_tokens, b.status) == (0, 0, RequestStatus.PENDING)


@pytest.mark.parametrize("with_text", [False, True])
def test_a_stop_token_ends_a_request_only_after_min_tokens(with_text: bool) -> None:
    """The scheduler's own rule (the sampler also bans stop tokens before ``min_tokens``):
    a stop token ends the request once more than ``min_tokens`` tokens were generated, and
    ``max_new_tokens`` ends it as LENGTH; the same with or without a text state."""
    for min_tokens, max_new, expected in ((2, 8, (3, FinishReason.STOP)), (9, 4, (4, FinishReason.LENGTH))):
        scheduler = make_scheduler(full_cache(8))
        params = ResolvedParams(max_new_tokens=max_new, stop_token_ids=frozenset({7}), min_tokens=min_tokens)
        request = Request("r", [1, 2, 3], params, arrival_time=0.0, text=_NoText() if with_text else None)
        scheduler.add(request)
        while scheduler.has_work:
            output = scheduler.schedule()
            scheduler.update(output, StepResult([7] * output.num_sampled), 0.0)
        assert (len(request.output_ids), request.finish_reason) == expected
        assert request.output_ids == [7] * expected[0]


class _NoText:
    """A text state without stop strings (the general stop rule's path)."""

    text = ""
    matched = None

    def add(self, token_id: int, num_output_tokens: int, *, last: bool = False) -> str | None:
        return None

    def finish(self) -> None:
        pass


def test_admission_pauses_by_the_prompt_blocks_it_hashes() -> None:
    """The planner pauses (a bare yield) after about ``chunk`` running requests' worth of
    admission work: short prompts several at a time, a long prompt with prefix caching
    (every block of it hashed and registered) on its own."""

    def pauses(prompt_len: int, count: int, chunk: int) -> int:
        kv = full_cache(count * (prompt_len // PAGE + 2), prefix=True)
        scheduler = make_scheduler(kv, budget=count * prompt_len, max_requests=count)
        for i in range(count):
            scheduler.add(make_request(f"r{i}", prompt_len=prompt_len))
        yields, output = planned_with_pauses(scheduler, chunk)
        assert len(output.scheduled) == count
        return yields

    # every 8 short prompts (as before), and once more when the final loop has listed 32 rows
    assert pauses(prompt_len=PAGE - 1, count=32, chunk=32) == 4 + 1
    assert pauses(prompt_len=40 * PAGE, count=6, chunk=32) == 6  # after every long one


def planned_with_pauses(scheduler: Scheduler, chunk: int) -> tuple[int, SchedulerOutput]:
    """The next step's plan, and how many times its planner paused."""
    planner = scheduler.plan(chunk)
    yields = 0
    while True:
        try:
            next(planner)
        except StopIteration as done:
            return yields, done.value
        yields += 1


def test_a_prompt_chunk_completing_many_blocks_pauses_the_planner() -> None:
    """The second chunk of a long prompt completes 20 blocks, each hashed and registered in
    the prefix cache while the step is planned: that counts as 20 requests' work."""
    scheduler = make_scheduler(full_cache(48, prefix=True), budget=20 * PAGE, max_requests=4)
    scheduler.add(make_request("long", prompt_len=40 * PAGE))
    first, _ = step(scheduler)
    assert plan(first) == [("long", 0, 20 * PAGE, False)]
    yields, second = planned_with_pauses(scheduler, chunk=8)
    assert plan(second) == [("long", 20 * PAGE, 20 * PAGE, True)]  # (its last chunk: sampled)
    assert yields == 1  # (a request looked at alone would not have paused it)


def test_the_measured_verify_cost_is_kept_with_and_without_speculation() -> None:
    plain = make_scheduler(full_cache(8))
    speculating = Scheduler(
        full_cache(8), max_batch_tokens=64, max_requests_per_batch=8, speculative=SpeculativeConfig()
    )
    for scheduler in (plain, speculating):
        assert scheduler.verify_cost == 1.0
        scheduler.verify_cost = 2.5  # (as the step loop sets the runner's measure)
        assert scheduler.verify_cost == 2.5
    assert speculating.speculation is not None and speculating.speculation.verify_cost == 2.5


# ---------------------------------------------------------------------- priority and cache groups


def _prioritised(request_id: str, prompt_len: int, priority: int, max_new_tokens: int) -> Request:
    request = make_request(request_id, prompt_len, max_new_tokens)
    request.params = ResolvedParams(max_new_tokens=max_new_tokens, priority=priority)
    return request


def _steps_until_scheduled(scheduler: Scheduler, request_id: str) -> tuple[int, list[str]]:
    """Steps run before ``request_id`` is scheduled, and who that step preempted."""
    for step in range(300):
        output = scheduler.schedule()
        scheduler.update(output, StepResult([7] * output.num_sampled), 0.0)
        if any(item.request.request_id == request_id for item in output.scheduled):
            return step, [r.request_id for r in output.preempted]
    raise AssertionError(f"{request_id} never ran")


@pytest.mark.parametrize("hybrid", [False, True], ids=["full", "full+sliding"])
def test_an_urgent_request_preempts_when_its_own_group_is_full(hybrid: bool) -> None:
    """Each cache group has its own pool: free sliding-window blocks are no room for the
    full-attention blocks an urgent request needs."""
    groups = [CacheGroup((0,), 10)] + ([CacheGroup((1,), 10, sliding_window=32)] if hybrid else [])
    kv = KVCacheManager(groups, 16, enable_prefix_caching=False)
    scheduler = Scheduler(kv, max_batch_tokens=256, max_requests_per_batch=64, safety_margin=0.0)
    for name in ("low0", "low1"):
        scheduler.add(_prioritised(name, 64, 5, 200))
    output = scheduler.schedule()
    scheduler.update(output, StepResult([7] * output.num_sampled), 0.0)
    assert kv.pools[0].num_free == 2 and (not hybrid or kv.pools[1].num_free == 4)
    scheduler.add(_prioritised("urgent", 40, 0, 4))  # 3 full-attention blocks and a spare
    assert _steps_until_scheduled(scheduler, "urgent") == (0, ["low1"])


def test_an_urgent_request_that_fits_a_sliding_cache_preempts_nothing() -> None:
    """A sliding-window group gives a request at most a ring of blocks, however long its prompt."""
    kv = KVCacheManager([CacheGroup((0,), 24, sliding_window=12)], 4, enable_prefix_caching=False)
    assert ring_size(12, 4) == 4
    scheduler = Scheduler(kv, max_batch_tokens=64, max_requests_per_batch=64, safety_margin=0.0)
    for i in range(5):
        scheduler.add(_prioritised(f"low{i}", 20, 5, 50))
    for _ in range(3):
        output = scheduler.schedule()
        scheduler.update(output, StepResult([7] * output.num_sampled), 0.0)
    assert kv.pools[0].num_free == 4
    scheduler.add(_prioritised("urgent", 64, 0, 4))
    output = scheduler.schedule()
    assert "urgent" in [item.request.request_id for item in output.scheduled]
    assert output.preempted == []


# ---------------------------------------------------------------------- samples forked in slices


def _with_samples(count: int) -> tuple[Request, list[Request]]:
    parent = make_request("parent", 12, 4)
    children = [Request(f"parent__child#{i}", list(parent.prompt_ids), parent.params, 0.0) for i in range(count)]
    return parent, children


@pytest.mark.parametrize("ends", ["nothing", "a sample", "the parent"])
def test_many_samples_fork_over_several_pauses_and_survive_what_ends_meanwhile(ends: str) -> None:
    kv = full_cache(200)
    scheduler = make_scheduler(kv, budget=64)
    parent, children = _with_samples(10)
    scheduler.add(parent, children)
    step(scheduler)  # the prompt but its last token: the samples fork in the next plan
    scheduler.hold_blocks()
    planner = scheduler.plan(chunk=3)
    pauses = 0
    while True:
        try:
            next(planner)
        except StopIteration as done:
            output = done.value
            break
        pauses += 1
        if pauses == 2 and ends == "a sample":
            scheduler.finish(children[-1], FinishReason.CANCELLED, 1.0)  # (one not forked yet)
        elif pauses == 2 and ends == "the parent":
            scheduler.finish(parent, FinishReason.CANCELLED, 1.0)
    scheduler.release_blocks()
    assert pauses >= 3, "forked a slice at a time"
    running = [r for r in children if r in scheduler.running]
    queued = [r for r in children if r in scheduler.waiting]
    finished = [r for r in children if r.is_finished]
    held = [r for r in children if not (r in scheduler.running or r in scheduler.waiting or r.is_finished)]
    assert len(running) + len(queued) + len(finished) + len(held) == 10
    assert [r.request_id for r in running] == [c.request_id for c in children[: len(running)]], "in order"
    if ends == "the parent":  # the first were forked; the next computes the prompt for the rest
        assert running == children[:7] and held == children[7:] and scheduler.num_held_children == 3
        assert [r.num_cached_tokens for r in running] == [11] * 6 + [0]
        assert (children[6], 0, 11) in [(s.request, s.start, s.num_tokens) for s in output.scheduled]
    else:
        assert not held and scheduler.num_held_children == 0
    scheduled = {item.request for item in output.scheduled}
    assert set(running) <= scheduled
    for request in (parent, *children):
        scheduler.finish(request, FinishReason.CANCELLED, 2.0)
    assert not scheduler.waiting and scheduler.num_held_children == 0 and scheduler.num_waiting_tokens == 0
    assert kv.num_free_blocks == kv.num_total_blocks


@pytest.mark.parametrize("computed", [False, True], ids=["queued", "computing its prompt"])
def test_a_parent_that_ends_before_its_samples_fork_passes_them_to_its_first_sample(computed: bool) -> None:
    """Its first sample computes the prompt in its place and the others still fork from it:
    the queue holds one prompt's tokens (``max_queued_tokens``), not ``n``, and the prompt
    is computed once."""
    kv = full_cache(200)
    scheduler = make_scheduler(kv, budget=8)
    parent, children = _with_samples(4)
    scheduler.add(parent, children)
    if computed:
        step(scheduler)  # 8 of its 12 prompt tokens
        assert parent.num_computed_tokens == 8
    scheduler.finish(parent, FinishReason.CANCELLED, 1.0)
    assert list(scheduler.waiting) == [children[0]] and scheduler.num_waiting_tokens == 12
    assert scheduler.num_held_children == 3
    for _ in range(2):  # 8 tokens, then 3: the prompt but its last token
        step(scheduler)
    assert children[0].num_computed_tokens == 11 and scheduler.num_held_children == 3
    output, _ = step(scheduler)  # the other samples fork, and all compute the last token
    assert [(s.request, s.start, s.num_tokens) for s in output.scheduled] == [(r, 11, 1) for r in children]
    assert [r.num_cached_tokens for r in children] == [0, 11, 11, 11]
    assert scheduler.num_held_children == 0 and not scheduler.waiting
    for request in children:
        scheduler.finish(request, FinishReason.CANCELLED, 2.0)
    assert kv.num_free_blocks == kv.num_total_blocks


def test_samples_cancelled_parent_first_each_pass_the_rest_on_and_leave_nothing_behind() -> None:
    """The order the router cancels a group in: every heir passes the rest to the next."""
    kv = full_cache(200)
    scheduler = make_scheduler(kv)
    parent, children = _with_samples(5)
    scheduler.add(parent, children)
    group = [parent, *children]
    for ended, request in enumerate(group, 1):
        scheduler.finish(request, FinishReason.CANCELLED, 1.0)
        live = group[ended:]
        assert list(scheduler.waiting) == live[:1] and scheduler.num_held_children == len(live[1:])
    assert not scheduler.waiting and scheduler.num_held_children == 0 and scheduler.num_waiting_tokens == 0


def test_a_step_update_ends_its_chunks_sooner_for_requests_recording_many_prompt_logprobs() -> None:
    """Each request recording 64 prompt positions with 20 alternatives counts for 22 requests'
    worth of update work: a chunk of 32 holds two of them, not all four."""
    scheduler = Scheduler(
        full_cache(64, page=16), max_batch_tokens=1024, max_requests_per_batch=8, max_scored_tokens=1024
    )
    params = ResolvedParams(max_new_tokens=2, prompt_logprobs=True, top_logprobs=20)
    scored = [Request(f"s{i}", list(range(1, 66)), params, arrival_time=0.0) for i in range(4)]
    plain = [make_request(f"p{i}", 8) for i in range(4)]
    for request in (*scored, *plain):
        scheduler.add(request)
    output = scheduler.schedule()
    assert [s.request for s in output.scheduled] == [*scored, *plain] and all(s.sample for s in output.scheduled)
    tops = (torch.arange(20).repeat(64, 1), torch.full((64, 20), -1.0))
    result = StepResult([fake_token(s.request) for s in output.scheduled], prompt_logprobs=[([-1.0] * 64, tops)] * 4)
    chunks = [updated for updated, _ in scheduler.update_in_chunks(output, result, 0.0, chunk=32)]
    assert [len(updated) for updated in chunks] == [2, 2, 4]
    assert all(
        len(r.prompt_top_logprobs) == 65 and r.prompt_top_logprobs[-1] == dict.fromkeys(range(20), -1.0) for r in scored
    )


def test_prompt_logprobs_are_recorded_once_and_let_go_of_a_row_at_a_time() -> None:
    """A step's prompt logprobs become the request's as the update reaches it, and the
    step's entry is let go of then (its lists freed a row at a time, not with the whole
    result); only the request's own number of alternatives become dicts; positions
    recorded before (a prompt computed again after a preemption) keep their first values."""
    from aiocb.core.scheduler import _record_prompt_logprobs

    scheduler = Scheduler(full_cache(64, page=16), max_batch_tokens=64, max_requests_per_batch=4, max_scored_tokens=64)
    params = ResolvedParams(max_new_tokens=2, prompt_logprobs=True, top_logprobs=2)
    request = Request("s", list(range(1, 9)), params, arrival_time=0.0)
    scheduler.add(request)
    output = scheduler.schedule()
    ids, values = torch.arange(35).reshape(7, 5), -torch.arange(35, dtype=torch.float32).reshape(7, 5)
    chosen = [-0.5 * i for i in range(7)]
    result = StepResult([fake_token(request)], prompt_logprobs=[(chosen, (ids, values))])
    scheduler.update(output, result, 0.0)
    assert result.prompt_logprobs == [None]
    assert request.prompt_logprobs == [None, *chosen]
    assert request.prompt_top_logprobs[1:] == [{5 * i: -5.0 * i, 5 * i + 1: -5.0 * i - 1} for i in range(7)]
    # Computed again from position 3: the first values stay, nothing is appended twice.
    assert list(_record_prompt_logprobs(request, 3, [9.0] * 4, (ids[3:], values[3:] + 1))) == []
    assert request.prompt_logprobs == [None, *chosen]
    assert len(request.prompt_top_logprobs) == 8


def test_proposals_of_rows_planned_earlier_give_way_before_a_later_row_is_preempted() -> None:
    # a's proposals would take the last two free blocks, and b (newer) then needs one for
    # its next token: a's proposals are taken back (and their blocks) instead of b preempted.
    kv = full_cache(6)
    speculative = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=2)
    scheduler = Scheduler(kv, max_batch_tokens=64, max_requests_per_batch=8, speculative=speculative)
    a = make_request("a", 8, max_new_tokens=16, prompt=[5, 6, 7, 8] * 2)
    b = make_request("b", 8, max_new_tokens=16, prompt=[40 + i for i in range(8)])
    scheduler.add(a)
    scheduler.add(b)
    scheduler.update(scheduler.schedule(), StepResult([5, 50]), 1.0)  # (a's last tokens repeat its prompt)
    assert kv.num_free_blocks == 2
    output = scheduler.schedule()
    assert output.preempted == []
    assert plan(output) == [("a", 8, 1, True), ("b", 8, 1, True)]
    assert [item.drafts for item in output.scheduled] == [None, None]
    assert [len(r.block_ids[0]) for r in (a, b)] == [3, 3] and kv.num_free_blocks == 0
    check_state(scheduler)
    # With room for both, a speculates.
    roomy = Scheduler(full_cache(8), max_batch_tokens=64, max_requests_per_batch=8, speculative=speculative)
    roomy.add(make_request("a", 8, 16, prompt=[5, 6, 7, 8] * 2))
    roomy.add(make_request("b", 8, 16, prompt=[40 + i for i in range(8)]))
    roomy.update(roomy.schedule(), StepResult([5, 50]), 1.0)
    output = roomy.schedule()
    assert output.preempted == [] and [item.drafts for item in output.scheduled] == [[6, 7, 8, 5], None]


def test_a_running_prefill_goes_on_when_the_admission_foreseen_does_not_come() -> None:
    """A one-token budget: the waiting request seems to fit (its prefix hits, cached free
    blocks, counted as room), so the running prompt's chunk takes half the budget; the hits
    then take those blocks and it is not admitted: the running prompt still gets its token
    (with none, every step was empty)."""
    kv = KVCacheManager([CacheGroup((0,), 3)], 2, enable_prefix_caching=True)
    scheduler = Scheduler(kv, max_batch_tokens=1, max_requests_per_batch=4, safety_margin=0.0)

    def step() -> SchedulerOutput:
        out = scheduler.schedule()
        scheduler.update(out, StepResult([7] * out.num_sampled), 0.0)
        return out

    scheduler.add(Request("F", [1, 2, 3, 4, 5], ResolvedParams(max_new_tokens=1), 0.0))
    while scheduler.has_work:
        step()
    running = Request("A", [11, 12, 13, 14, 15], ResolvedParams(max_new_tokens=1), 0.0)
    scheduler.add(running)
    step()
    scheduler.add(Request("W", [1, 2, 3, 4, 9], ResolvedParams(max_new_tokens=1), 0.0))
    for computed in range(2, 5):
        out = step()
        assert [(row.request.request_id, row.num_tokens) for row in out.scheduled] == [("A", 1)]
        assert running.num_computed_tokens == computed
    while scheduler.has_work:
        assert not step().is_empty
    assert kv.num_free_blocks == 3
