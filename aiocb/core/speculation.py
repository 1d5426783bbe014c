"""The scheduler's side of speculative decoding: which requests propose how many tokens in
the step being planned, where a new request of a draft model starts (the draft's
acceptance over all requests, one request scouting while the rest wait for its figure),
how much of the draft's cache a step catches up on, and whether the draft model runs over
the step at all.

The proposers themselves (prompt lookup, a draft model's share, their back-off) live in
:mod:`aiocb.speculative`; the scheduler plans rows and blocks and asks this planner about
speculation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiocb.core.kv_cache import KVCacheManager
from aiocb.core.request import Request
from aiocb.outputs import RequestStatus
from aiocb.speculative import SCOUT_EVERY, Acceptance, DraftProposer, NgramProposer, SpeculativeConfig

if TYPE_CHECKING:  # (the scheduler imports this module)
    from aiocb.core.scheduler import SchedulerOutput

#: How quickly the draft model's acceptance over all requests follows their tries: about the
#: last ten tries count.
_PRIOR_DECAY = 0.9
#: Tokens of n-grams that speculation's proposers index per step in all, about 0.12
#: microseconds each (1,024 tokens' n-grams at the default lengths 2, 3 and 4): it keeps a
#: step's planning off the loop's back.
_INDEX_PER_STEP = 9 * 1024
#: Tokens a draft model catches up on per step in all (those of steps it slept through), and
#: never more than a step's ``max_batch_tokens`` (the activations the cache planner allowed).
_CATCH_UP_PER_STEP = 2048


class SpeculationPlanner:
    """Speculation's state across steps and within the step being planned."""

    def __init__(
        self,
        config: SpeculativeConfig,
        kv_cache: KVCacheManager,
        *,
        max_batch_tokens: int,
        max_model_len: int | None,
        draft_share: float = 0.0,
    ) -> None:
        self.config = config
        #: whether requests speculate with a draft model (else by prompt lookup)
        self.uses_draft = config.method == "draft"
        self.kv_cache = kv_cache
        self.max_batch_tokens = max_batch_tokens
        self.max_model_len = max_model_len
        #: a draft model's share of the target's parameters (its requests' back-off floor)
        self.draft_share = draft_share
        #: what a step that verifies proposals costs against a decode step replaying a CUDA
        #: graph; set once the runner has measured it (see
        #: :class:`aiocb.speculative.Acceptance`)
        self.verify_cost = 1.0
        #: the draft model's recent acceptance over all its requests' tries (None before
        #: any): where a new request's :class:`DraftProposer` starts
        self.draft_acceptance: float | None = None
        #: new draft requests that started waiting since the last that scouted
        self.waiting_since_scout = 0
        #: the request whose tries give the draft its first acceptance figure: until one
        #: exists, it alone proposes, and the others wait for its figure
        self._first_scout: Request | None = None
        #: whether requests may speculate in the step being planned (its batch is small enough)
        self.on = False
        #: tokens the proposers may still index in the step being planned
        self._index_budget = _INDEX_PER_STEP
        #: requests of the step being planned whose draft cache misses tokens (a draft
        #: model's): the first missing position and how many the draft computes first ...
        self.catch_up: dict[Request, tuple[int, int]] = {}
        #: ... and how many more it may (:data:`_CATCH_UP_PER_STEP` in all)
        self._catch_up_left = 0

    def speculates_at(self, size: int) -> bool:
        """Whether requests may speculate in a batch of ``size`` running requests: a large
        batch is no longer memory-bound, and extra tokens cost compute."""
        limit = self.config.disable_by_batch_size
        return limit is None or size <= limit

    def start_step(self, size: int) -> bool:
        """A new step is planned with ``size`` running requests: whether they may speculate."""
        self.on = self.speculates_at(size)
        self._index_budget = _INDEX_PER_STEP
        self.catch_up.clear()
        self._catch_up_left = min(_CATCH_UP_PER_STEP, self.max_batch_tokens)
        return self.on

    @staticmethod
    def may_speculate(request: Request) -> bool:
        """Whether ``request`` may speculate at all: not when its logits at a proposed
        position would depend on the proposal (controls, a grammar)."""
        params = request.params
        return not (params.uses_controls or request.grammar is not None or params.needs_known_history)

    def draft_proposer(self, request: Request) -> DraftProposer:
        """The request's share of the draft model's proposals, made on first use: the draft's
        cache then holds none of its tokens, unless :meth:`admitted` or :meth:`forked` said
        otherwise."""
        proposer = request.proposer
        if not isinstance(proposer, DraftProposer):
            config, share, cost = self.config, self.draft_share, self.verify_cost
            proposer = DraftProposer(config, 0, share, cost, self.draft_acceptance)
            if self.draft_acceptance is None:
                # No figure yet: one request finds it out (its draft pass over its prompt and
                # its first tries) while the rest wait for it, so that a draft that does not
                # pay costs a batch that arrives at once one request's share, not every one's.
                proposer.waiting = not self._scouts_first(request)
            elif proposer.waiting:
                self.waiting_since_scout += 1
                if self.waiting_since_scout >= SCOUT_EVERY:  # (this one scouts: hopeful)
                    self.waiting_since_scout = 0
                    proposer = DraftProposer(config, 0, share, cost)
            request.proposer = proposer
        return proposer

    def _scouts_first(self, request: Request) -> bool:
        """Whether ``request`` tries the draft before it has any acceptance figure: the first
        to ask that may speculate does, and the next once that one ended without a try.
        (One that may not, with a penalty or a grammar, would never try: the others would
        wait for as long as it runs.)"""
        if not self.may_speculate(request):
            return False
        scout = self._first_scout
        if scout is None or scout is request or scout.is_finished:
            self._first_scout = request
            return True
        return False

    def _draft_wants(self, request: Request) -> bool:
        """Whether ``request`` may propose soon, so the draft's cache should hold its tokens
        (not while it waits or backs off: it is caught up on if it tries)."""
        return self.may_speculate(request) and not self.draft_proposer(request).paused

    def propose(self, request: Request, budget: int) -> list[int] | None:
        """The tokens ``request`` speculates in the step being planned (None: it does not)."""
        params = request.params
        if not self.may_speculate(request):
            return None
        room = min(  # (the proposer's own width is at most num_speculative_tokens)
            budget,
            params.max_new_tokens - request.num_output_tokens - 1,
            (self.max_model_len - request.num_tokens) if self.max_model_len is not None else budget,
        )
        if room <= 0:
            return None
        if self.uses_draft:
            computed = request.num_computed_tokens
            proposer = self.draft_proposer(request)
            if proposer.waiting and self.draft_acceptance is None and self._scouts_first(request):
                proposer.waiting = False  # (the one before it ended before any try)
            count = proposer.propose(room, self.draft_acceptance)
            first = min(proposer.drafted, computed)
            if count and first < computed:  # (the draft's cache misses tokens: computed first)
                take = min(computed - first, self._catch_up_left)
                if take > 0:
                    self.catch_up[request] = (first, take)
                    self._catch_up_left -= take
                if first + take < computed:
                    return None  # (still behind after this step's share)
            return [0] * count or None  # (the proposal's slots: the draft model writes its tokens on the device)
        lookup = request.proposer
        if lookup is None:
            lookup = request.proposer = NgramProposer(self.config, self.verify_cost)
        assert isinstance(lookup, NgramProposer)
        drafts, indexed = lookup.propose(request.token_ids, room, self._index_budget)
        self._index_budget -= indexed
        return drafts or None

    def waits(self, request: Request) -> bool:
        """Whether ``request``, a token of it in flight, waits for that token before it is
        planned again: its next step may bring a proposal, which follows that token (unless
        it backs off). A pipelined step plans no proposal, so this also counts the step of a
        pause."""
        if not (self.on and self.may_speculate(request)):
            return False
        proposer = request.proposer
        if isinstance(proposer, DraftProposer) and proposer.waiting:
            if self.draft_acceptance is None and self._scouts_first(request):
                # The one that was to try first ended before it did: this one tries next
                # (here, where a pipelined row would never reach :meth:`propose`).
                proposer.waiting = False
                return True
            # (it tries once the draft's acceptance over other requests recovers)
            return proposer.hopes(self.draft_acceptance)
        return proposer is None or (isinstance(proposer, Acceptance) and proposer.ready())

    def plan_drafting(
        self, output: SchedulerOutput, planned: dict[Request, int], drafted: dict[Request, list[int]], running: int
    ) -> None:
        """Whether the draft model runs over the step: when a request speculates in it, or
        catches up (the draft computes the tokens of steps it slept through first, then
        the step's), and, while the batch (admissions counted) is small enough to
        speculate (``running``: its size), when it computes prompt tokens of a request that
        may speculate and neither waits nor backs off (which requests with the same prefix
        then find in the draft's cache too). Otherwise it sleeps, and its cache misses the
        step's tokens; each planned request's :attr:`DraftProposer.drafted` says how far the
        draft's cache holds it after the step. (Nothing to plan without a draft model.)"""
        if not self.uses_draft:
            return
        for request, (first, take) in self.catch_up.items():
            if request in planned:  # (not un-planned after it asked)
                output.catch_up[request] = (first, request.token_ids[first : first + take])
        prompts = self.speculates_at(running) and any(
            request.status is not RequestStatus.DECODING and self._draft_wants(request) for request in planned
        )
        output.drafting = drafting = bool(drafted) or prompts or bool(output.catch_up)
        kv = self.kv_cache
        for request, start in planned.items():
            proposer = self.draft_proposer(request)
            # (a preempted request computes again from its start; one trimmed after a
            # rejection holds fewer tokens than the draft wrote)
            held = min(proposer.drafted, start)
            covered = drafting
            if request in output.catch_up:
                first, tokens = output.catch_up[request]
                held = first + len(tokens)
            elif (
                drafting
                and request.status is not RequestStatus.DECODING
                and request not in drafted
                and not self._draft_wants(request)
            ):
                # A prompt chunk the draft would compute for nothing yet.
                output.draft_skip.add(request)
                covered = False
            if covered and held == start:
                # The draft computes the step's tokens, but not its last proposal's key:
                # needed only once that proposal is accepted, it is caught up on then.
                held = request.num_computed_tokens - (request in drafted)
            proposer.drafted = held
            if kv.prefix_caching:  # (blocks that later requests' prefix hits serve the draft too)
                proposer.marked = kv.mark_drafted(request, held, proposer.marked)

    def load(self, output: SchedulerOutput) -> float:
        """How many times the extra cost of a step that verifies proposals falls on each
        speculating row of ``output`` (:meth:`aiocb.speculative.Acceptance.floor`): its
        rows per speculating row where, but for the proposals, every row decodes one token
        (a step that would have replayed a decode graph), else 0."""
        if not output.num_speculating or self.verify_cost <= 1.0:
            return 1.0
        scheduled = output.scheduled
        for item in scheduled:
            if item.num_tokens != 1 + (len(item.drafts) if item.drafts else 0):
                return 0.0
        return len(scheduled) / output.num_speculating

    def record(self, request: Request, proposed: int, accepted: int, load: float) -> None:
        """``request`` had ``accepted`` of its ``proposed`` tokens taken, in a step whose
        extra cost fell ``load`` times on each speculating row."""
        proposer = request.proposer
        if isinstance(proposer, Acceptance):
            proposer.record(proposed, accepted, load)
        if isinstance(proposer, DraftProposer):
            share = accepted / proposed
            prior = self.draft_acceptance
            self.draft_acceptance = share if prior is None else _PRIOR_DECAY * prior + (1 - _PRIOR_DECAY) * share
            self._first_scout = None

    def admitted(self, request: Request) -> None:
        """``request`` was admitted with prefix hits: the draft's cache holds the hit blocks
        the draft computed."""
        if self.uses_draft:
            proposer = self.draft_proposer(request)
            proposer.marked = self.kv_cache.drafted_blocks(request)
            proposer.drafted = proposer.marked * self.kv_cache.page_size

    def forked(self, parent: Request, child: Request) -> None:
        """``child`` forked from ``parent``'s blocks: the draft's cache is forked alike (the
        child holds what the parent did)."""
        if self.uses_draft:
            held = self.draft_proposer(parent).drafted
            self.draft_proposer(child).drafted = min(held, child.num_computed_tokens)
