"""Which requests run in the next forward pass, and how many tokens each computes.

There are no prefill and decode phases: every request's ``num_computed_tokens`` catches
up with its length, as much as the step's token budget allows. A long prompt therefore
spreads over several steps (chunked prefill), prefill and decode tokens share a step, and
a prefix hit or a recompute after preemption is the same rule with another starting point.

When the cache runs out of blocks the newest running request is preempted: its blocks are
freed and it goes back to the front of the queue to be recomputed later. The oldest
request is never preempted in favour of a newer one, so it always progresses, and any
request that fits the cache alone eventually runs: no deadlock, no error.

Once a request brings a ``priority`` (lower runs first, as vLLM's), "oldest" becomes
"first by (priority, arrival)": requests are admitted and planned in that order, the last
in it is the one preempted, and a waiting request preempts running ones that come after
it when the cache has no room for it. Without priorities nothing of this applies.

Several samples of one prompt (``n``) are one parent request and children held aside: the
parent computes the prompt but its last token, then each child forks from it (sharing its
full blocks, with a copy of the partial one) and all of them compute the last token and
sample on their own. A child that finds no room for its copy is queued as a request of
its own; when a parent ends first, its first child computes the prompt in its place and
the others fork from that one (queued all at once they would each compute it, and count
``n`` prompts against ``max_queued_tokens``).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import OrderedDict
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiocb.core.kv_cache import KVCacheManager
from aiocb.core.params import ResolvedParams
from aiocb.core.request import NONE_YET, Request
from aiocb.core.speculation import SpeculationPlanner
from aiocb.outputs import FinishReason, RequestStatus
from aiocb.speculative import SpeculativeConfig

#: Admitting a request costs about this many running requests' planning, plus one for each
#: block of its prompt that it looks up or registers in the prefix cache (hashing a block
#: of tokens: about 10 µs on the development machine): the planner pauses after a chunk's worth.
_ADMISSION_WORK = 4


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: positions ``start .. start + num_tokens - 1``."""

    request: Request
    start: int
    num_tokens: int
    #: whether the step reaches the request's last token, so its logits are sampled
    sample: bool = False
    #: whether the last position's token is still being sampled by the step before
    #: (async batching): the device takes it from that step's output
    carries: bool = False
    #: tokens proposed after the request's last one (speculative decoding): they are
    #: the row's other inputs, and every one of its positions is sampled (a draft model's
    #: proposals are made on the device: until the step's result names them, placeholders)
    drafts: list[int] | None = None


@dataclass(slots=True)
class SchedulerOutput:
    """The plan of one step."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    #: per cache group, ``(device block, host block)`` copies to make before the step
    #: (offloaded preempted requests) ...
    swap_out: list[list[tuple[int, int]]] = field(default_factory=list)
    #: ... and ``(host block, device block)`` copies bringing resumed requests back
    swap_in: list[list[tuple[int, int]]] = field(default_factory=list)
    #: per cache group, ``(parent block, child block)`` copies of forked samples (before the swaps)
    copy_blocks: list[list[tuple[int, int]]] = field(default_factory=list)
    #: rows whose next token is sampled (the sampled positions of drafts come after them)
    num_sampled: int = 0
    #: rows that bring proposed tokens (speculative decoding)
    num_speculating: int = 0
    #: whether a draft model runs over the step (speculation with ``method="draft"``, when
    #: a request speculates or catches up)
    drafting: bool = False
    #: requests whose draft cache misses tokens, and the tokens the draft computes first
    #: (its first missing position, the tokens from there)
    catch_up: dict[Request, tuple[int, list[int]]] = field(default_factory=dict)
    #: requests whose prompt chunk the draft model leaves out of its pass over the step
    #: (they wait or back off, or may not speculate): its cache misses those tokens
    draft_skip: set[Request] = field(default_factory=set)

    @property
    def num_tokens(self) -> int:
        """Query tokens in the step."""
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        """Whether there is nothing to run (no request and no cache copy)."""
        return not self.scheduled and not any(self.swap_out) and not any(self.swap_in) and not any(self.copy_blocks)


class Block(Protocol):
    """A ``[positions, k]`` block of a step's results (a host tensor), made into Python lists
    only when recorded."""

    def __getitem__(self, index: Any) -> Block: ...

    def reshape(self, *shape: int) -> Block: ...

    def tolist(self) -> list[Any]: ...


#: Prompt positions' most likely alternatives: their ids and their logprobs, ``[positions, k]``.
#: (Blocks rather than lists: the lists of a whole step, 76,800 of them for 38,400 scored
#: positions, set the cyclic collector off on the step thread, where it held the GIL, and so
#: the loop, 20 ms at a time; a request's are made as it is recorded, in a chunk of the update.)
PromptTops = tuple[Block, Block]


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one step produced, per sampled row in plan order, then per proposed token of
    the speculating rows (in plan order, each row's in order).

    ``prompt_logprobs`` has one entry per scheduled request that asked for prompt
    logprobs and computed prompt positions in this step (in plan order): the
    log-probabilities of the prompt tokens after the step's positions, with their top
    alternatives when the request asked for them (:data:`PromptTops`, ``[positions, k]``
    blocks). :meth:`Scheduler.update_in_chunks` consumes the entries (None once recorded).
    """

    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: list[tuple[list[float], PromptTops | None] | None] | None = None
    #: a draft model's proposals, per speculating row in plan order (each row's in order)
    proposed: list[int] | None = None
    #: rows of ``token_ids`` whose request's controls (or grammar) left no token to pick
    blocked: list[int] | None = None


@dataclass(slots=True)
class SchedulerStats:
    """Counters since the scheduler was built."""

    num_steps: int = 0
    num_preemptions: int = 0
    num_computed_tokens: int = 0
    num_generated_tokens: int = 0
    #: computed tokens whose KV a preemption threw away, computed again on readmission
    #: (those the prefix cache gave back are not)
    num_recomputed_tokens: int = 0
    #: decode inputs planned while their token was still being sampled (async batching)
    num_carried_tokens: int = 0
    #: speculative decoding: proposed tokens the model verified (not those past a stop, or
    #: of a request that ended while its step ran), and those of them it agreed with
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class Scheduler:
    """Plans steps under a token budget, a request budget and the cache's capacity."""

    def __init__(
        self,
        kv_cache: KVCacheManager,
        *,
        max_batch_tokens: int,
        max_requests_per_batch: int,
        scheduler_type: str = "fifo",
        safety_margin: float = 0.15,
        max_model_len: int | None = None,
        speculative: SpeculativeConfig | None = None,
        max_scored_tokens: int | None = None,
        draft_share: float = 0.0,
        long_rope_from: int | None = None,
        long_rope_recomputes: bool = False,
    ) -> None:
        self.kv_cache = kv_cache
        #: a longrope model's original length: a request whose prompt passes it is long
        #: (:attr:`Request.long_rope`) ...
        self.long_rope_from = long_rope_from
        #: ... and, where the model's ``generate`` computes a sequence again once it passes
        #: that length (Phi-3's), the position at which a request that is not long yet is
        #: computed again, all long (see :mod:`aiocb.runner.long_rope`); None: never
        self.long_rope_switch = long_rope_from if long_rope_recomputes else None
        self._verify_cost = 1.0
        #: speculative decoding's planning (None: requests do not speculate)
        self.speculation = (
            None
            if speculative is None
            else SpeculationPlanner(
                speculative,
                kv_cache,
                max_batch_tokens=max_batch_tokens,
                max_model_len=max_model_len,
                draft_share=draft_share,
            )
        )
        #: prompt positions a step may score (``prompt_logprobs``): the rows of logits
        #: the cache planner keeps memory for (default ``max_requests_per_batch``)
        self.max_scored_tokens = max_scored_tokens or max_requests_per_batch
        #: ... and those the step being planned may still score
        self._scored_left = self.max_scored_tokens
        self.max_batch_tokens = max_batch_tokens
        self.max_requests_per_batch = max_requests_per_batch
        self.prefill_first = scheduler_type == "prefill_first"
        self.safety_margin = safety_margin
        self.max_model_len = max_model_len
        # Ordered sets: O(1) removal of a cancelled request, insertion order = priority.
        self.waiting: OrderedDict[Request, None] = OrderedDict()
        self.running: dict[Request, None] = {}
        #: prompt tokens of the waiting requests (what admission backpressure bounds)
        self.num_waiting_tokens = 0
        self.stats = SchedulerStats()
        #: whether any request brought a priority: then order is (priority, arrival)
        self.prioritized = False
        self._arrivals = itertools.count()
        self._order: dict[Request, tuple[int, int]] = {}
        #: the waiting requests by order, with stale entries (dropped when met)
        self._heap: list[tuple[int, int, Request]] = []
        #: parents still computing their prompt, and the children that will fork from them
        #: (last first: they are taken from the end of the list)
        self._forks: dict[Request, list[Request]] = {}
        #: each held child's list in ``_forks`` (the same list object: a parent's children
        #: pass to its heir with nothing to update per child)
        self._held: dict[Request, list[Request]] = {}
        #: requests that left the running set since the last plan
        self._departed: list[Request] = []
        #: while set, ended requests keep their blocks (see :meth:`hold_blocks`)
        self._holding = False
        self._ended_holding: list[Request] = []

    @property
    def verify_cost(self) -> float:
        """What a step that verifies proposals costs against a decode step replaying a CUDA
        graph (1.0 until the runner has measured it); speculation's planning reads it."""
        return self._verify_cost

    @verify_cost.setter
    def verify_cost(self, cost: float) -> None:
        self._verify_cost = cost
        if self.speculation is not None:
            self.speculation.verify_cost = cost

    @property
    def has_work(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self.waiting or self.running)

    def add(self, request: Request, children: Sequence[Request] = ()) -> None:
        """Queue a new request behind the others (of its priority); ``children`` are more
        samples of its prompt, forked from it once it has computed the prompt."""
        long_from = self.long_rope_from
        for r in (request, *children):
            r.status = RequestStatus.PENDING
            self._order[r] = (r.params.priority, next(self._arrivals))
            if long_from is not None and r.num_prompt_tokens > long_from:
                r.long_rope = True
        if request.params.priority and not self.prioritized:
            self.prioritized = True
            self._heap = [(*self._order[r], r) for r in self.waiting]
            heapq.heapify(self._heap)
        self._enqueue(request)
        if children and request.num_prompt_tokens > 1:
            samples = list(children)[::-1]  # (last first: forked from the end, in order)
            self._forks[request] = samples
            self._held.update((child, samples) for child in children)
        else:  # nothing to share
            for child in children:
                self._enqueue(child)

    @property
    def num_held_children(self) -> int:
        """Samples waiting for their parent to compute the prompt."""
        return len(self._held)

    def finish(
        self,
        request: Request,
        reason: FinishReason,
        now: float,
        *,
        status: RequestStatus = RequestStatus.FINISHED,
        error: str | None = None,
    ) -> None:
        """End ``request`` wherever it is and free its blocks (at once, or when the plan
        being made and copied out is complete: see :meth:`hold_blocks`)."""
        if request.is_finished:
            return
        if request in self.running:
            del self.running[request]
            self._departed.append(request)
        self._order.pop(request, None)
        if request in self.waiting:
            self._dequeue(request)
        samples = self._held.pop(request, None)
        if samples is not None:  # a held sample: it no longer waits for the fork
            samples.remove(request)
        samples = self._forks.pop(request, None)
        if samples:  # the parent will not compute the prompt: its first sample does, for the rest
            heir = samples.pop()
            del self._held[heir]
            self._enqueue(heir)
            if samples:
                self._forks[heir] = samples
        if self._holding:
            self._ended_holding.append(request)
        else:
            self.kv_cache.free(request)
            self.kv_cache.drop_host_copy(request)
        if request.text is not None:
            request.text.finish()
            if request.text.matched is not None and reason in (FinishReason.LENGTH, FinishReason.STOP):
                # (one completed by the text held to the end: the characters of its last bytes)
                reason, request.stop_reason = FinishReason.STOP, request.text.matched
        if reason is FinishReason.ERROR and error is None and request.error is not None:
            status, error = RequestStatus.FAILED, request.error  # (the request's own failure: _stop_reason)
        request.status = status
        request.finish_reason = reason
        request.error = error
        request.finished_time = now

    def take_departed(self) -> list[Request]:
        """The requests that left the running set (ended, or preempted) since the last call.

        One ended while a paused plan was being made may still be in that plan.
        """
        departed, self._departed = self._departed, []
        return departed

    def hold_blocks(self) -> None:
        """Until :meth:`release_blocks`, a request that ends keeps its blocks.

        A caller that lets other work run while it makes a plan (:meth:`plan`) and copies it
        out sets this first: a request ended meanwhile (a cancellation) may still be in the
        plan, whose copy reads its blocks; they must not be handed to another request before.
        """
        self._holding = True

    def release_blocks(self) -> int:
        """Free the blocks of the requests that ended since :meth:`hold_blocks`; how many ended."""
        self._holding = False
        ended, self._ended_holding = self._ended_holding, []
        for request in ended:
            self.kv_cache.free(request)
            self.kv_cache.drop_host_copy(request)
        return len(ended)

    def schedule(self) -> SchedulerOutput:
        """Plan the next step and allocate its blocks, in one go."""
        planner = self.plan()
        while True:
            try:
                next(planner)
            except StopIteration as done:
                output: SchedulerOutput = done.value
                return output

    def plan(self, chunk: int = 256) -> Generator[None, None, SchedulerOutput]:
        """Plan the next step and allocate its blocks, pausing (a bare ``yield``) after
        about ``chunk`` requests' worth of work (a request looked at; more for one admitted
        or whose prompt blocks are hashed); the plan is the generator's return value.

        While it is paused, requests may be added or ended: an ended one is skipped if not
        yet planned, and stays in the plan (its sampled token is dropped) if already
        planned, so pause only under :meth:`hold_blocks`.
        """
        budget = self.max_batch_tokens
        planned: dict[Request, int] = {}  # request -> first position of this step
        preempted: list[Request] = []
        output = SchedulerOutput(preempted=preempted)
        if self._forks:
            yield from self._fork_children(output, chunk)
        if self.prioritized:
            self._make_room_for_priority(output)
        out_of_room = False

        # (the loops below run for every running request each step: names are bound locally)
        running, forks, kv = self.running, self._forks, self.kv_cache
        single_full, page = kv.single_full, kv.page_size
        max_rows = self.max_requests_per_batch
        switch = self.long_rope_switch
        speculation = self.speculation
        if speculation is not None and not speculation.start_step(len(running)):
            speculation = None  # (not at this batch size)
        drafted: dict[Request, list[int]] = {}
        self._scored_left = self.max_scored_tokens
        # While a request waits that could be admitted, running prompts' chunks take at
        # most half the step's tokens: one long prompt must not hold back the short ones
        # queued behind it for its whole prefill (vLLM's long_prefill_token_threshold does
        # the like). The step's size is the same: the other half admits them. (At least
        # one token: the admission foreseen may not come, its prefix hits taking the free
        # blocks it was counted on, and a step must not plan nothing.) Under priorities, a
        # prompt that outranks the waiting request is not held back for it.
        halved = self._admission_waits(budget // 2)
        prefill_room = max(budget // 2, 1) if halved else budget
        outranking = self._order[self._first_waiting()][0] if halved and self.prioritized else None
        # Most rows of most steps only decode: a short loop plans those, and the general one
        # below the rest (or everything, when a decoding row needs more than its next token).
        rest = None
        # (the short loop's rows, already in their final form, and those of them whose step
        # completes a block: shared once nothing can un-plan them)
        decoded: list[ScheduledRequest] = []
        completing: list[Request] = []
        unplanned = False  # whether the general loop un-planned one of the short loop's rows
        in_running_order = speculation is None and not (self.prioritized or self.prefill_first)
        if in_running_order and len(running) <= min(max_rows, budget):
            rest = yield from self._plan_decodes(planned, decoded, completing, chunk)
            budget -= len(planned)
        for looked, request in enumerate(self._running_by_priority() if rest is None else rest, 1):
            if looked % chunk == 0:
                yield
            if request not in running:
                continue  # preempted earlier in this step (or ended while paused)
            if len(planned) >= max_rows or budget <= 0:
                break
            computed = request.num_computed_tokens
            num_new = min(len(request.token_ids) + request.num_pending_tokens - computed, budget)
            if forks and request in forks:  # its children fork before the prompt's last token
                num_new = min(num_new, request.num_prompt_tokens - 1 - computed)
            prefilling = request.status is RequestStatus.PREFILLING
            if prefilling and (outranking is None or self._order[request][0] >= outranking):
                num_new = min(num_new, prefill_room)
            if request.params.prompt_logprobs:
                num_new = self._within_scored_budget(request, computed, num_new)
            if num_new <= 0 or (request.num_pending_tokens and self._waits_for_token(request)):
                continue
            most_drafts = budget - 1
            if switch is not None and not request.long_rope:
                if computed + num_new > switch:  # (its keys so far have the short setting)
                    self._restart_long(request)
                    continue
                most_drafts = min(most_drafts, switch - computed - 1)  # (nor may proposals pass it)
            drafts = None
            decoding = request.status is RequestStatus.DECODING and not request.num_pending_tokens
            if speculation is not None and num_new == 1 and decoding and most_drafts > 0:
                drafts = speculation.propose(request, most_drafts)
                if drafts:
                    num_new += len(drafts)
            # (the common decode step, whose last block has room, needs no allocate call)
            blocks = request.block_ids
            fits = single_full and blocks and computed + num_new <= len(blocks[0]) * page
            while not fits and not kv.allocate(request, num_new):
                if drafts:  # speculation gives way before anything is preempted
                    drafts, num_new = None, 1
                    continue
                if drafted:  # the proposals of rows planned before it too, newest first
                    budget += self._undraft(*drafted.popitem())
                    continue
                out_of_room = True
                victim = self._last_running()
                if victim in planned:  # un-plan it: give its tokens back
                    start = planned.pop(victim)
                    budget += victim.num_computed_tokens - start
                    victim.num_computed_tokens = start
                    drafted.pop(victim, None)
                    if decoded and victim.status is RequestStatus.DECODING:  # (the short loop's)
                        victim.num_pending_tokens -= 1
                        unplanned = True
                self._preempt(victim, output)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                planned[request] = computed
                request.num_computed_tokens = computed + num_new
                budget -= num_new
                if prefilling:
                    prefill_room -= num_new
                if drafts:
                    drafted[request] = drafts

        if unplanned:
            decoded = [item for item in decoded if item.request in planned]
        # Full blocks are shareable as soon as a step that computes them is planned (and
        # no longer un-plannable): a request admitted later, even in this same step, reads
        # them after they are written (device work runs in plan order, and a step writes
        # every new token's K/V before any request of it reads the cache).
        if kv.prefix_caching:
            page = kv.page_size
            # The short loop's rows that complete a block, then the general loop's rows. Each
            # request looked at counts, and each block hashed: a whole batch may complete its
            # blocks in the same step, and one long prompt chunk many blocks.
            work = 0
            short = (request for request in completing if request in planned)
            for request in itertools.chain(short, itertools.islice(planned, len(decoded), None)):
                work += 1
                # (most steps complete no block: only then is the call worth its cost)
                completed = min(request.num_computed_tokens, len(request.token_ids)) // page
                if completed > request.num_registered_blocks:
                    work += completed - request.num_registered_blocks
                    kv.cache_full_blocks(request)
                if work >= chunk:
                    work = 0
                    yield
        if not out_of_room:
            yield from self._admit(planned, budget, output, chunk)

        scheduled = output.scheduled
        scheduled += decoded
        num_tokens = num_sampled = len(decoded)
        num_carried = sum(1 for item in decoded if item.carries)
        for looked, (request, start) in enumerate(itertools.islice(planned.items(), len(decoded), None), 1):
            if looked % chunk == 0:
                yield
            end = request.num_computed_tokens
            known = len(request.token_ids)
            drafts = drafted.get(request) if drafted else None
            if drafts is not None:
                scheduled.append(ScheduledRequest(request, start, end - start, True, False, drafts))
                output.num_speculating += 1
                request.speculating = True
                sample, end = True, known  # (the proposed positions are not carried tokens)
            else:
                sample = end == known + request.num_pending_tokens
                scheduled.append(ScheduledRequest(request, start, end - start, sample, end > known))
            num_tokens += request.num_computed_tokens - start
            if sample:
                request.num_pending_tokens += 1
                num_sampled += 1
            if end > known:
                num_carried += 1
        output.num_sampled = num_sampled
        if self.speculation is not None:
            self.speculation.plan_drafting(output, planned, drafted, len(running))
        self.stats.num_carried_tokens += num_carried
        if scheduled:
            self.stats.num_steps += 1
            self.stats.num_computed_tokens += num_tokens
        return output

    def update(self, output: SchedulerOutput, result: StepResult, now: float) -> list[Request]:
        """Append the sampled tokens of a step; returns the requests it finished.

        ``result.token_ids[i]`` belongs to the i-th scheduled request whose ``sample`` is
        set. Requests that ended while the step ran (a cancellation) drop their token.
        """
        finished: list[Request] = []
        for _, ended in self.update_in_chunks(output, result, now, chunk=max(1, len(output.scheduled))):
            finished += ended
        return finished

    def update_in_chunks(
        self, output: SchedulerOutput, result: StepResult, now: float, chunk: int = 256
    ) -> Iterator[tuple[list[Request], list[Request]]]:
        """:meth:`update`, about ``chunk`` scheduled requests' worth of work at a time (a
        request that records prompt logprobs counts for more, one per
        :data:`_PROMPT_ENTRIES_PER_WORK` of them): after each chunk, yields those of its
        requests that got a token and those that ended (the caller may let other work run
        before taking the next chunk)."""
        if not output.scheduled:
            yield [], []
            return
        row = 0
        prompt_row = 0
        draft_row = output.num_sampled  # (the drafts' sampled positions follow the sampled rows)
        updated: list[Request] = []
        finished: list[Request] = []
        # (this loop runs for every sampled row each step: names are bound locally)
        running, decoding, finished_status = self.running, RequestStatus.DECODING, RequestStatus.FINISHED
        max_model_len = self.max_model_len
        tokens, logprobs, tops = result.token_ids, result.logprobs, result.top_logprobs
        blocked = None if result.blocked is None else frozenset(result.blocked)
        last = len(output.scheduled)
        num_generated = 0
        load = 1.0 if self.speculation is None else self.speculation.load(output)
        work = 0
        for looked, item in enumerate(output.scheduled, 1):
            request = item.request
            params = request.params
            work += 1
            if params.prompt_logprobs and wants_prompt_logprobs(request, item.start):
                assert result.prompt_logprobs is not None
                entry = result.prompt_logprobs[prompt_row]
                assert entry is not None
                # The step's lists are let go of a row at a time, in this chunk: freed all
                # at once with the step's result (38,400 positions with 20 alternatives
                # each, bench/response_holds.py's echo), they held the loop 30 ms.
                result.prompt_logprobs[prompt_row] = None
                prompt_row += 1
                values, top_prompt = entry
                # (a slice at a time, the loop given back between: one request's 8,192
                # positions with 20 alternatives each are 20 ms of dictionaries)
                for entries, more in _record_prompt_logprobs(request, item.start, values, top_prompt):
                    work += -(-entries // _PROMPT_ENTRIES_PER_WORK)
                    if more and work >= chunk:
                        work = 0
                        self.stats.num_generated_tokens += num_generated
                        num_generated = 0
                        yield updated, finished
                        updated, finished = [], []
                del values, top_prompt
            if item.drafts is not None:
                request.num_pending_tokens -= 1
                request.speculating = False
                if request.status < finished_status:
                    num_generated += self._accept(item, result, draft_row, row, now, finished, load)
                    if request in running:
                        request.status = decoding
                    updated.append(request)
                draft_row += len(item.drafts)
                row += 1
            elif item.sample:
                request.num_pending_tokens -= 1
                status = request.status
                if blocked is not None and row in blocked and status < finished_status:
                    request.error = _NOTHING_ALLOWED if request.grammar is None else _conflict(params)
                    self.finish(request, FinishReason.ERROR, now)
                    finished.append(request)
                elif status < finished_status:  # (else ended while the step ran: no token)
                    num_generated += 1
                    token = tokens[row]
                    token_ids = request.token_ids
                    token_ids.append(token)
                    if logprobs is not None and params.return_logprobs:  # (another row's, else)
                        request.logprobs.append(float(logprobs[row]))
                    if tops is not None and params.top_logprobs:
                        request.top_logprobs.append(dict(tops[row][: params.top_logprobs]))
                    if request.first_token_time is None:
                        request.first_token_time = now
                    if params.record_timestamps:
                        request.timestamps.append(now)
                    if status is not decoding and request in running:  # (not if preempted while the step ran)
                        request.status = decoding
                    updated.append(request)
                    if request.text is None and request.grammar is None:
                        # _stop_reason's rules for a request without stop strings or a grammar,
                        # inline: most rows, every step (a call costs a fifth of this loop);
                        # test_a_stop_token_ends_a_request_only_after_min_tokens holds both to one result
                        num_output = len(token_ids) - len(request.prompt_ids)
                        reason = None
                        if num_output > params.min_tokens and token in params.stop_token_ids:
                            request.stop_reason = token
                            reason = FinishReason.STOP
                        elif num_output >= params.max_new_tokens or (
                            max_model_len is not None and len(token_ids) >= max_model_len
                        ):
                            reason = FinishReason.LENGTH
                    else:
                        reason = self._stop_reason(request, token)
                    if reason is not None:
                        self.finish(request, reason, now)
                        finished.append(request)
                row += 1
            if work >= chunk or looked == last:
                work = 0
                self.stats.num_generated_tokens += num_generated
                num_generated = 0
                yield updated, finished
                updated, finished = [], []

    def _plan_decodes(
        self, planned: dict[Request, int], decoded: list[ScheduledRequest], completing: list[Request], chunk: int
    ) -> Generator[None, None, list[Request] | None]:
        """The general planning loop's work on the decoding requests, which it takes first,
        in the running order: each computes its next position (or waits for its token in
        flight), and its row of the plan is made at once (into ``decoded``; ``completing``
        gets those whose step completes a block). Returns the other running requests, in
        the order the general loop takes them after these; or None, with nothing planned,
        at a decoding request that needs more than one position or finds no block (the
        general loop then plans them all: it makes the same allocations up to there).

        The caller checked that every running request fits the step's rows and tokens.
        """
        running, kv = self.running, self.kv_cache
        single_full, page = kv.single_full, kv.page_size
        registering = kv.prefix_caching
        decoding = RequestStatus.DECODING
        switch = self.long_rope_switch
        others: list[Request] = []
        for looked, request in enumerate(list(running), 1):
            if looked % chunk == 0:
                yield
            if request not in running:
                continue  # ended while paused
            if request.status is not decoding:
                others.append(request)
                continue
            computed = request.num_computed_tokens
            pending = request.num_pending_tokens
            num_new = len(request.token_ids) + pending - computed
            if num_new <= 0 or (pending and self._waits_for_token(request)):
                continue
            blocks = request.block_ids
            fits = single_full and blocks and computed < len(blocks[0]) * page
            if num_new > 1 or (switch is not None and computed >= switch and not request.long_rope):
                break  # (the general loop computes a request again past the switch)
            if not (fits or kv.allocate(request, 1)):
                break
            planned[request] = computed
            request.num_computed_tokens = computed + 1
            # Its one position is its last: the step samples it (the final loop's rule).
            decoded.append(ScheduledRequest(request, computed, 1, True, pending > 0))
            request.num_pending_tokens = pending + 1
            if registering and min(computed + 1, len(request.token_ids)) // page > request.num_registered_blocks:
                completing.append(request)
        else:
            return others
        for item in decoded:
            item.request.num_computed_tokens = item.start
            item.request.num_pending_tokens -= 1
        planned.clear()
        decoded.clear()
        completing.clear()
        return None

    def _accept(
        self,
        item: ScheduledRequest,
        result: StepResult,
        draft_row: int,
        row: int,
        now: float,
        finished: list[Request],
        load: float,
    ) -> int:
        """Take a speculating row's tokens while they agree with its proposal; returns how
        many it got. Its cache positions past them are given back."""
        request, drafts = item.request, item.drafts
        assert drafts is not None
        k = len(drafts)
        if result.proposed is not None:  # (a draft model's, made on the device)
            first = draft_row - (len(result.token_ids) - len(result.proposed))  # (after the sampled rows)
            drafts = item.drafts = result.proposed[first : first + k]
        params = request.params
        tokens, logprobs, tops = result.token_ids, result.logprobs, result.top_logprobs
        taken = accepted = 0
        ended = False
        for j in range(k + 1):
            at = draft_row + j if j < k else row  # (the last position is the row's own sample)
            token = int(tokens[at])
            request.token_ids.append(token)
            if logprobs is not None and params.return_logprobs:
                request.logprobs.append(float(logprobs[at]))
            if tops is not None and params.top_logprobs:
                request.top_logprobs.append(dict(tops[at][: params.top_logprobs]))
            if request.first_token_time is None:
                request.first_token_time = now
            if params.record_timestamps:
                request.timestamps.append(now)
            taken += 1
            agrees = j < k and token == drafts[j]
            accepted += agrees
            reason = self._stop_reason(request, token)
            if reason is not None:
                self.finish(request, reason, now)
                finished.append(request)
                ended = True
                break
            if not agrees:
                break
        self.stats.num_accepted_tokens += accepted
        # Proposals past a stop were never compared: neither rejected nor counted.
        verified = min(taken, k) if ended else k
        self.stats.num_draft_tokens += verified
        assert self.speculation is not None  # (the row brought proposals)
        self.speculation.record(request, verified, accepted, load)
        if not ended:
            # Computed: the last token and the proposed ones kept (the last one taken is
            # the next step's input). A request preempted meanwhile computed less, or none.
            request.num_computed_tokens = min(request.num_computed_tokens, item.start + taken)
            if request in self.running:
                self.kv_cache.trim(request)
        return taken

    def _stop_reason(self, request: Request, token: int) -> FinishReason | None:
        """Why ``request``, just given ``token``, ends now (None: it goes on)."""
        params = request.params
        num_output = len(request.token_ids) - len(request.prompt_ids)
        completed = request.grammar is not None and request.grammar.accept(token)
        if completed and request.grammar is not None and request.grammar.rejected:
            request.error = _conflict(params)
            return FinishReason.ERROR
        # (a grammar that allows nothing more lets its end token through under min_tokens)
        stops = token in params.stop_token_ids and (num_output > params.min_tokens or completed)
        # The text of a stop token is left out, as a stop string is (unless kept).
        keeps_text = not stops or params.include_stop_str_in_output
        matched = request.text.add(token, num_output, last=stops) if request.text is not None and keeps_text else None
        if stops:
            request.stop_reason = token
            return FinishReason.STOP
        if matched is not None:
            request.stop_reason = matched
            return FinishReason.STOP
        if completed:
            return FinishReason.STOP
        if num_output >= params.max_new_tokens:
            return FinishReason.LENGTH
        if self.max_model_len is not None and len(request.token_ids) >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _waits_for_token(self, request: Request) -> bool:
        """Whether nothing can be planned for ``request`` until the token a step in flight
        samples for it lands: that token surely ends it, or its next step's logits
        controls depend on that token's value."""
        if not request.num_pending_tokens:
            return False
        if request.params.needs_known_history or request.speculating:
            return True
        if self.speculation is not None and self.speculation.waits(request):
            return True
        if request.num_output_tokens + request.num_pending_tokens >= request.params.max_new_tokens:
            return True
        return self.max_model_len is not None and request.num_scheduled_tokens >= self.max_model_len

    def _running_by_priority(self) -> list[Request]:
        decoding = [r for r in self.running if r.status is RequestStatus.DECODING]
        prefilling = [r for r in self.running if r.status is not RequestStatus.DECODING]
        if self.prioritized:  # (stable: within a priority, the phase order below)
            decoding.sort(key=self._order.__getitem__)
            prefilling.sort(key=self._order.__getitem__)
            ordered = prefilling + decoding if self.prefill_first else decoding + prefilling
            return sorted(ordered, key=lambda r: self._order[r][0])
        return prefilling + decoding if self.prefill_first else decoding + prefilling

    def _undraft(self, request: Request, drafts: list[int]) -> int:
        """Take back the proposals of ``request``, planned in this step, and the blocks their
        positions took; returns the step's tokens that frees."""
        request.num_computed_tokens -= len(drafts)
        self.kv_cache.trim(request)
        return len(drafts)

    def _last_running(self) -> Request:
        """The running request to preempt first: the newest, or the last by (priority, arrival)."""
        if self.prioritized:
            return max(self.running, key=self._order.__getitem__)
        return next(reversed(self.running))

    def _first_waiting(self) -> Request:
        """The waiting request to admit next: the front of the queue, or the first by (priority, arrival)."""
        if not self.prioritized:
            return next(iter(self.waiting))
        heap = self._heap
        while heap[0][2] not in self.waiting:
            heapq.heappop(heap)
        return heap[0][2]

    def _fork_children(self, output: SchedulerOutput, chunk: int) -> Generator[None, None, None]:
        """Fork the children of every parent whose planned steps cover its prompt but the
        last token (its KV is written by steps launched before this one), pausing after
        every ``chunk`` (a request of a thousand samples forks them over several pauses)."""
        forked = 0
        for parent in list(self._forks):
            if parent not in self.running or parent.num_computed_tokens < parent.num_prompt_tokens - 1:
                continue
            assert parent.num_computed_tokens == parent.num_prompt_tokens - 1
            children = self._forks[parent]
            while children:
                if forked and forked % chunk == 0:
                    yield
                    if self._forks.get(parent) is not children:
                        break  # (the parent ended meanwhile: its other samples passed to an heir)
                    if not children:
                        break  # (its last samples ended meanwhile)
                forked += 1
                child = children.pop()
                del self._held[child]
                copies = self.kv_cache.fork(parent, child)
                if copies is None:
                    self._enqueue(child)  # no room for its copy: it computes its prompt itself
                    continue
                _extend(output.copy_blocks, copies)
                if self.speculation is not None:
                    self.speculation.forked(parent, child)
                if parent.params.prompt_logprobs:
                    # The parent scores the prompt for all: the same lists, which its steps
                    # in flight may still fill (a sample never scores positions before
                    # the fork point; one preempted and computed again finds them recorded).
                    child.prompt_logprobs = parent.prompt_logprobs
                    child.prompt_top_logprobs = parent.prompt_top_logprobs
                self.kv_cache.num_prefix_hit_tokens += child.num_computed_tokens
                child.num_cached_tokens = child.num_computed_tokens
                self.running[child] = None
                child.status = RequestStatus.PREFILLING
                child.scheduled_time = time.perf_counter()
            if self._forks.get(parent) is children:
                del self._forks[parent]

    def _make_room_for_priority(self, output: SchedulerOutput) -> None:
        """Preempt running requests that come after the first waiting one, until it fits."""
        if not self.waiting:
            return
        request = self._first_waiting()
        if request.num_pending_tokens:
            return  # it resumes once its token has landed
        first_chunk = min(request.num_tokens - request.num_computed_tokens, self.max_batch_tokens)
        while self.running:
            victim = self._last_running()
            if self._order[victim] <= self._order[request]:
                return
            # Room in every cache group (each has its own pool), and a block to spare.
            room = (
                self.kv_cache.has_room(request, first_chunk, spare=1)
                and (self.kv_cache.free_fraction >= self.safety_margin)
                and len(self.running) < self.max_requests_per_batch
            )
            if room:
                return
            self._preempt(victim, output)
            output.preempted.append(victim)

    def _admit(
        self, planned: dict[Request, int], budget: int, output: SchedulerOutput, chunk: int
    ) -> Generator[None, None, None]:
        """Move waiting requests into the step while budget, cache and margin allow
        (pausing after about ``chunk`` running requests' worth of work: admitting one costs
        several of those, and more the more prompt blocks it looks up and registers)."""
        work = 0
        page = self.kv_cache.page_size
        switch = self.long_rope_switch
        while self.waiting and budget > 0 and len(planned) < self.max_requests_per_batch:
            if self.running and self.kv_cache.free_fraction < self.safety_margin:
                break  # keep the rest of the cache for the requests already running
            request = self._first_waiting()
            if request.num_pending_tokens:
                break  # preempted while its token was in flight: resume once it has landed
            offloaded = bool(request.host_block_ids)
            if switch is not None and not request.long_rope and request.num_tokens > switch:
                # (computed from its start past the switch: all long; a copy offloaded
                # before it has the short setting)
                _make_long(request)
                if offloaded:
                    self.kv_cache.drop_host_copy(request)
                    request.num_lost_tokens += request.num_computed_tokens
                    request.num_computed_tokens, offloaded = 0, False
            matched = not request.block_ids and not offloaded and not request.params.prompt_logprobs
            if matched:
                # (a request scoring its prompt must compute every prompt position)
                request.num_computed_tokens = self.kv_cache.match_prefix(request)
                if request in self._forks and request.num_computed_tokens == request.num_prompt_tokens - 1:
                    # The prefix cache holds all but the last token: the fork point. A parent
                    # must compute something before its children fork (next step), so that
                    # the fork never waits on an empty step.
                    self.kv_cache.unmatch_last_block(request)
                if self.speculation is not None:
                    self.speculation.admitted(request)
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if request in self._forks:  # its children fork before the prompt's last token
                num_new = min(num_new, request.num_prompt_tokens - 1 - request.num_computed_tokens)
            if request.params.prompt_logprobs:
                num_new = self._within_scored_budget(request, request.num_computed_tokens, num_new)
                if num_new <= 0:
                    break  # (the step scores all the prompt positions it may)
            if not self.kv_cache.allocate(request, num_new):
                if not offloaded:
                    self.kv_cache.free(request)  # let go of prefix hits until it can run
                    request.num_computed_tokens = 0
                break
            # (counted once admitted: a counter never goes back) What a preemption threw
            # away and the cache gives back is neither a hit nor computed again.
            lost, request.num_lost_tokens = request.num_lost_tokens, 0
            found = request.num_computed_tokens if matched else 0
            self.kv_cache.num_prefix_hit_tokens += max(0, found - lost)
            self.stats.num_recomputed_tokens += max(0, lost - found)
            if matched and request.scheduled_time is None:
                # Its prompt's (a request readmitted after a preemption finds its own
                # generated tokens' blocks too: not prompt tokens served from the cache).
                request.num_cached_tokens = min(request.num_computed_tokens, request.num_prompt_tokens)
            if offloaded:
                _extend(output.swap_in, self.kv_cache.restore(request))
            self._dequeue(request)
            self.running[request] = None
            if request.scheduled_time is None:
                request.scheduled_time = time.perf_counter()
            request.status = RequestStatus.PREFILLING
            planned[request] = request.num_computed_tokens
            request.num_computed_tokens += num_new
            budget -= num_new
            self.kv_cache.cache_full_blocks(request)
            work += _ADMISSION_WORK + request.num_computed_tokens // page
            if work >= chunk:
                work = 0
                yield  # (the loop's conditions are checked again after it)

    def _admission_waits(self, room: int) -> bool:
        """Whether the first waiting request could be admitted this step with ``room``
        tokens: a row left, the cache above its margin, blocks for its first chunk free
        (:meth:`_admit`'s conditions, before the step's own allocations; prefix hits not
        counted)."""
        if not self.waiting or len(self.running) >= self.max_requests_per_batch:
            return False
        if self.running and self.kv_cache.free_fraction < self.safety_margin:
            return False
        first = self._first_waiting()
        if first.num_pending_tokens:
            return False
        return self.kv_cache.has_room(first, min(first.num_tokens - first.num_computed_tokens, max(room, 1)))

    def _within_scored_budget(self, request: Request, start: int, num_new: int) -> int:
        """``num_new`` cut so that the step scores at most ``max_scored_tokens`` prompt
        positions in all: the cache planner set memory aside for that many rows of logits,
        so a longer prompt is scored over several steps."""
        scored = min(start + num_new, request.num_prompt_tokens - 1) - start
        if scored <= 0:
            return num_new
        if scored > self._scored_left:
            num_new = scored = self._scored_left
        self._scored_left -= scored
        return num_new

    def _preempt(self, request: Request, output: SchedulerOutput) -> None:
        """Take the request's blocks and put it at the front of the queue: its KV goes to
        host memory when CPU offloading has room, otherwise it is computed again later."""
        copies = self.kv_cache.offload(request)
        if copies is not None:
            _extend(output.swap_out, copies)
        self._requeue_first(request, computed_again=copies is None)
        request.num_preemptions += 1
        self.stats.num_preemptions += 1

    def _restart_long(self, request: Request) -> None:
        """Put ``request``, whose next pass passes the longrope switch, at the front of the
        queue to be computed again from its start, all long (its blocks, of the short
        setting, go back: the prefix cache keeps them for short requests)."""
        self._requeue_first(request, computed_again=True)
        _make_long(request)

    def _requeue_first(self, request: Request, *, computed_again: bool) -> None:
        """Move a running request to the front of the queue (``computed_again``: its blocks
        go back, and it is computed again from its start once readmitted)."""
        del self.running[request]
        self._departed.append(request)
        if computed_again:
            self.kv_cache.free(request)
            request.num_lost_tokens += request.num_computed_tokens  # (counted when it is readmitted)
            request.num_computed_tokens = 0
        request.status = RequestStatus.PENDING
        self._enqueue(request)
        self.waiting.move_to_end(request, last=False)

    def _enqueue(self, request: Request) -> None:
        self.waiting[request] = None
        self.num_waiting_tokens += request.num_prompt_tokens
        if self.prioritized:
            heapq.heappush(self._heap, (*self._order[request], request))
            if len(self._heap) > 2 * len(self.waiting) + 64:  # mostly stale entries: rebuild
                self._heap = [(*self._order[r], r) for r in self.waiting]
                heapq.heapify(self._heap)

    def _dequeue(self, request: Request) -> None:
        del self.waiting[request]
        self.num_waiting_tokens -= request.num_prompt_tokens


def _make_long(request: Request) -> None:
    """Make every token of ``request`` take the long setting from now on: its blocks'
    hashes, from the other root, are made again (see :mod:`aiocb.runner.long_rope`)."""
    request.long_rope = True
    request.block_hashes = NONE_YET


def wants_prompt_logprobs(request: Request, start: int) -> bool:
    """Whether a step starting at ``start`` computes logits that score prompt tokens."""
    return request.params.prompt_logprobs and start < request.num_prompt_tokens - 1


#: the error of a constrained request whose other controls leave its grammar no token
_CONSTRAINT_CONFLICT = (
    "no token satisfies both the request's output constraint and its other controls "
    "(allowed_token_ids, bad_words_ids, no_repeat_ngram_size, sequence_bias, ...)"
)
#: the error of a constrained request whose constraint alone allows no token (a grammar
#: that admits no text, or none at this point)
_CONSTRAINT_ALONE = "no token satisfies the request's output constraint at this point: its grammar allows no text here"


def _conflict(params: ResolvedParams) -> str:
    """Why a constrained request was left no token: its constraint, or its other controls too."""
    return _CONSTRAINT_CONFLICT if params.uses_controls else _CONSTRAINT_ALONE


#: the error of a request whose controls left no token at a step (its pick would be a
#: token it forbade: transformers' greedy search gives token 0 there)
_NOTHING_ALLOWED = (
    "no token is left to generate: the request's controls (allowed_token_ids, bad_words_ids, "
    "no_repeat_ngram_size, min_tokens, ...) ban every token at this step"
)

#: Prompt logprobs recorded (positions times one plus their alternatives) that count as one
#: request's worth of update work: a chunk whose requests record thousands of them (a
#: prefill chunk of a long prompt, twenty alternatives a position) ends sooner.
_PROMPT_ENTRIES_PER_WORK = 64

#: Prompt logprobs recorded between two of the update's pauses at most (about 0.25 ms
#: with twenty alternatives a position on this project's CPU machine).
_PROMPT_ENTRIES_PER_SLICE = 2048


def _record_prompt_logprobs(
    request: Request, start: int, values: list[float], tops: PromptTops | None
) -> Iterator[tuple[int, bool]]:
    """Record the logprobs of the prompt positions after ``start`` that follow the ones
    recorded (after a preemption the prompt is computed again: what was recorded first
    stays), a slice of positions at a time: yields each slice's count of entries (positions
    times one plus their alternatives) once it is recorded, and whether more follow."""
    first = len(request.prompt_logprobs) - (start + 1)
    if first < 0 or first >= len(values):
        return
    wanted = request.params.top_logprobs if tops is not None else 0
    per_slice = max(1, _PROMPT_ENTRIES_PER_SLICE // (1 + wanted))
    for begin in range(first, len(values), per_slice):
        end = min(begin + per_slice, len(values))
        request.prompt_logprobs.extend(values[begin:end])
        if not wanted:
            request.prompt_top_logprobs.extend([None] * (end - begin))
        else:
            assert tops is not None
            # (the step computes as many alternatives as its most demanding row asked for;
            # flat lists, not a list a position: those would be tracked by the cyclic collector)
            ids = tops[0][begin:end, :wanted].reshape(-1).tolist()
            logprobs = tops[1][begin:end, :wanted].reshape(-1).tolist()
            request.prompt_top_logprobs.extend(
                dict(zip(ids[at : at + wanted], logprobs[at : at + wanted], strict=True))
                for at in range(0, len(ids), wanted)
            )
        yield (end - begin) * (1 + wanted), end < len(values)


def _extend(per_group: list[list[tuple[int, int]]], more: list[list[tuple[int, int]]]) -> None:
    """Append per-group copy lists."""
    while len(per_group) < len(more):
        per_group.append([])
    for mine, theirs in zip(per_group, more, strict=False):
        mine.extend(theirs)
