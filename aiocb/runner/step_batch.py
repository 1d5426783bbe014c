"""A scheduled step copied out of the scheduler: what changed since the step before.

The device side keeps every running request's state in a persistent batch
(:class:`~aiocb.runner.input_batch.InputBatch`): a *slot* per request holding its block
tables and sampling parameters. A :class:`StepBatch` therefore carries, besides the
step's tokens and positions, only the rows that joined (their parameters), the blocks
appended to tables, and the rare per-row extras (logits controls, prompt logprobs). A
steady decode row costs a few list appends on the loop thread and vectorised copies on
the worker, whatever its length.

:class:`BatchWriter` lives on the event loop's thread: it assigns slots and remembers
what each slot was sent. It may copy a plan out a chunk of rows at a time (the loop
runs other work between chunks); the scheduler keeps ended requests' blocks until the
copy is complete (:meth:`~aiocb.core.scheduler.Scheduler.hold_blocks`).
"""

from __future__ import annotations

import array
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch

from aiocb.core.params import ResolvedParams
from aiocb.core.request import Request
from aiocb.core.scheduler import SchedulerOutput, wants_prompt_logprobs
from aiocb.runner.ngram_bans import RepeatedNgrams
from aiocb.runner.noise import seed_key
from aiocb.structured import new_bitmask


@dataclass(slots=True)
class RowControls:
    """A sampled row's logits controls for one step (rows that use none have no such object)."""

    params: ResolvedParams
    #: prompt and output tokens (penalizing rows only), of which the first ``history_length``
    #: are known to this step ...
    history: array.array[int] | None
    history_length: int
    num_prompt_tokens: int
    #: ... and whether the row's last token, still being sampled, follows them: then the
    #: previous step's sampled row ``carry_row`` has it
    carries: bool
    carry_row: int
    #: ``(token, bias)`` added this step besides the request's own (matched sequence biases)
    biases: list[tuple[int, float]] | None
    #: tokens banned this step besides the request's own: groups of them (bad words matched,
    #: n-grams, the stop tokens before ``min_tokens``, the first token's bans), the request's
    #: own collections referenced rather than copied (its stop tokens may be thousands)
    bans: tuple[Collection[int], ...]


#: A slot's sampling parameters: temperature (0 when greedy), top-k, top-p, min-p (0 when
#: greedy), 32-bit seed, whether to return logprobs, how many top alternatives, whether
#: logprobs are of the distribution drawn from, and the rarer filters (top-h, typical-p,
#: epsilon and eta cutoffs; None when greedy or when none is on).
RowParams = tuple[float, int, float, float, int, bool, int, bool, tuple[float, float, float, float] | None]


def row_params(params: ResolvedParams) -> RowParams:
    """The sampling parameters a slot keeps for ``params``."""
    greedy = params.greedy
    return (
        0.0 if greedy else params.temperature,
        0 if greedy else params.top_k,
        params.top_p,
        0.0 if greedy else params.min_p,
        seed_key(params.seed),
        params.return_logprobs,
        params.top_logprobs,
        params.processed_logprobs,
        None if greedy else params.rare_filters,
    )


@dataclass(frozen=True, slots=True)
class TableWrites:
    """One cache group's block-table changes: ``table[slots[i], columns[i]] = blocks[i]``,
    after clearing the rows of ``resets`` (slots given to a new owner or a new table) and
    cutting row ``cut_slots[i]`` back to ``cut_lengths[i]`` blocks."""

    resets: list[int] = field(default_factory=list)
    cut_slots: list[int] = field(default_factory=list)
    cut_lengths: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    columns: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class StepBatch:
    """An immutable copy of one step's plan, as changes to the persistent batch."""

    #: every scheduled token, row after row (0 where the previous step's sample goes)
    token_ids: list[int]
    #: per row: its slot, its first position and its number of tokens
    slots: list[int]
    starts: list[int]
    num_tokens: list[int]
    #: the rows whose next token is sampled, in order, and each one's random stream offset
    #: (how many tokens its request generated before this step)
    sampled: list[int]
    offsets: list[int]
    #: async batching: rows whose last input is still being sampled by the previous step,
    #: and which of that step's sampled rows samples it
    carry_rows: list[int]
    carry_from: list[int]
    #: slots given to a request this step, and its sampling parameters
    join_slots: list[int]
    join_params: list[RowParams]
    #: per cache group, the block tables' changes
    tables: list[TableWrites]
    #: by sampled row (its index in ``sampled``), the logits controls of rows that use them
    controls: dict[int, RowControls]
    #: by row (in row order), the prompt tokens that the row's positions predict (prompt logprobs)
    prompt_targets: dict[int, tuple[int, ...]]
    #: slots handed out so far (the persistent batch's height)
    num_slots: int = 0
    #: the most top alternatives a row scoring prompt tokens asked for
    prompt_top_logprobs: int = 0
    #: constrained rows (their indices in ``sampled``) and, row by row, the tokens their
    #: grammars allow (``[rows, ceil(vocab / 32)]`` int32 bits); None when no row is constrained
    bitmask_rows: list[int] = field(default_factory=list)
    bitmask: torch.Tensor | None = None
    #: how many rows compute one token
    num_single_token_rows: int = 0
    #: per cache group, block copies to make before the step (CPU offloading)
    swap_out: list[list[tuple[int, int]]] = field(default_factory=list)
    swap_in: list[list[tuple[int, int]]] = field(default_factory=list)
    #: per cache group, ``(source, destination)`` block copies within the cache (forks)
    copy_blocks: list[list[tuple[int, int]]] = field(default_factory=list)
    #: speculating rows (their indices in ``sampled``) and how many tokens each proposes:
    #: the positions of those tokens are sampled too, after every sampled row's last one
    draft_rows: list[int] = field(default_factory=list)
    draft_counts: list[int] = field(default_factory=list)
    #: whether a draft model runs over the step (it sleeps while no request speculates)
    drafting: bool = False
    #: rows whose draft cache misses tokens (their slots), the first missing position of
    #: each, and the missing tokens, row after row: the draft computes them first
    catch_up_slots: list[int] = field(default_factory=list)
    catch_up_starts: list[int] = field(default_factory=list)
    catch_up_counts: list[int] = field(default_factory=list)
    catch_up_ids: list[int] = field(default_factory=list)
    #: the catch-up rows (their indices among them) whose tokens all take a longrope
    #: model's long setting (as :attr:`long_rope_rows`)
    catch_up_long_rows: list[int] = field(default_factory=list)
    #: rows whose tokens all take a longrope model's long setting, whatever their
    #: positions: those of a long request (:attr:`~aiocb.core.request.Request.long_rope`)
    #: with positions within the original length (see :mod:`aiocb.runner.long_rope`)
    long_rope_rows: list[int] = field(default_factory=list)
    #: rows whose tokens (prompt chunks) the draft model's pass over the step leaves out
    draft_skip_rows: list[int] = field(default_factory=list)

    @property
    def num_drafts(self) -> int:
        """Proposed tokens in the step (each one a sampled position besides the rows')."""
        return sum(self.draft_counts)

    @property
    def num_rows(self) -> int:
        """Scheduled requests."""
        return len(self.slots)

    @property
    def num_sampled(self) -> int:
        """Rows whose next token is sampled."""
        return len(self.sampled)

    @property
    def is_decode(self) -> bool:
        """Whether every row computes and samples one token, scoring no prompt token."""
        n = len(self.slots)
        return 0 < n == self.num_single_token_rows == len(self.sampled) and not self.prompt_targets


@dataclass(slots=True)
class RowState:
    """What a :class:`BatchWriter` sent about one request (kept in ``request.runner_state``)."""

    writer: BatchWriter | None = None
    #: the request's slot in the persistent batch; -1: none
    slot: int = -1
    #: the ``request.block_ids`` list last sent, and how many blocks of each group were sent
    tables: list[list[int]] | None = None
    sent: list[int] = field(default_factory=list)
    #: the last step (writer's count) that scheduled the request, and its sampled row there
    step: int = -1
    sampled_row: int = -1
    #: prompt and output tokens, kept up to date for penalties (see :func:`token_history`)
    history: array.array[int] | None = None
    #: the same as bytes, for ``no_repeat_ngram_size``
    ngrams: RepeatedNgrams | None = None


def row_state(request: Request) -> RowState:
    """The request's :class:`RowState`, made on first use."""
    state = request.runner_state
    if not isinstance(state, RowState):
        state = request.runner_state = RowState()
    return state


def token_history(request: Request) -> array.array[int]:
    """The request's prompt and generated tokens so far, in an ``array`` kept up to date a
    few tokens at a time (the step's copy costs the new tokens, not the history).

    The loop thread only appends to it; the step's worker copies the first ``n`` entries
    (one C call, atomic under the GIL), so it never sees a token beyond the step's.
    """
    state = row_state(request)
    history = state.history
    if history is None:
        history = state.history = array.array("q")
    if len(history) < len(request.token_ids):
        history.extend(request.token_ids[len(history) :])
    return history


class BatchWriter:
    """Copies plans out of the scheduler as :class:`StepBatch` changes (event-loop thread).

    :meth:`begin`, then :meth:`add_rows` over the plan's rows in order (in as many chunks
    as the caller likes), then :meth:`finish`. :meth:`snapshot` does all three.
    """

    def __init__(self, num_groups: int, vocab_size: int, long_rope_from: int | None = None) -> None:
        self.num_groups = num_groups
        self.vocab_size = vocab_size
        #: a longrope model's original length (see :attr:`StepBatch.long_rope_rows`)
        self.long_rope_from = long_rope_from
        self._free: list[int] = []
        self._next_slot = 0
        self._steps = 0
        self._output: SchedulerOutput | None = None
        self._parts: _Parts | None = None
        self._departed: list[Request] = []

    @property
    def num_slots(self) -> int:
        """Slots handed out at some point (the persistent batch's height)."""
        return self._next_slot

    @property
    def num_live_slots(self) -> int:
        """Slots owned by a request now."""
        return self._next_slot - len(self._free)

    def snapshot(self, output: SchedulerOutput, departed: Sequence[Request] = (), pipelined: bool = False) -> StepBatch:
        """The whole plan at once (see :meth:`begin`)."""
        self.begin(output, departed, pipelined)
        self.add_rows(len(output.scheduled))
        return self.finish()

    def begin(self, output: SchedulerOutput, departed: Sequence[Request] = (), pipelined: bool = False) -> None:
        """Start copying ``output``. ``departed``: the requests that left the running set
        since the last copy (:meth:`~aiocb.core.scheduler.Scheduler.take_departed`), whose
        slots are given back; ``pipelined``: the previous copy's step is still in flight,
        and rows that carry take their last token from its samples."""
        assert self._output is None, "the previous plan's copy was not finished"
        self._steps += 1
        self._output = output
        self._departed = list(departed)
        self._parts = _Parts(self.num_groups, pipelined)
        constrained = sum(1 for item in output.scheduled if item.sample and item.request.grammar is not None)
        if constrained:
            self._parts.bitmask = new_bitmask(constrained, self.vocab_size)
        for request in self._departed:
            state = request.runner_state
            if isinstance(state, RowState) and state.writer is self and state.slot >= 0 and not request.is_finished:
                # Preempted: its blocks are gone. If the same plan admitted it again it gets a
                # new slot below; an ended request's slot is freed once the copy is complete
                # (it may still be in this plan: ended while the plan was being made).
                self._release(state)

    def add_rows(self, stop: int) -> None:
        """Copy the plan's rows up to ``stop`` (exclusive), after those already copied."""
        output, parts = self._output, self._parts
        assert output is not None and parts is not None
        scheduled = output.scheduled
        step = self._steps
        # (this loop runs for every scheduled row each step: names are bound locally)
        slots, starts, counts, token_ids = parts.slots, parts.starts, parts.num_tokens, parts.token_ids
        sampled, offsets = parts.sampled, parts.offsets
        one_group = self.num_groups == 1
        long_from = self.long_rope_from
        for row in range(len(slots), min(stop, len(scheduled))):
            item = scheduled[row]
            request = item.request
            state = request.runner_state
            if not isinstance(state, RowState) or state.writer is not self:
                state = row_state(request)
                state.writer, state.slot = self, -1
            if state.slot < 0:
                self._assign(state, request, parts)
            else:
                # A request's block lists only grow while it runs: one given back (a
                # preemption) departs, and the slot goes with it.
                assert request.block_ids is state.tables, "a running request's blocks were replaced"
                sent = state.sent
                cuts = request.block_cuts
                if cuts is not None:  # (given back since the last copy, perhaps taken again)
                    request.block_cuts = None
                    _send_cuts(parts.tables, state, cuts)
                if one_group:
                    if request.block_ids and len(request.block_ids[0]) > sent[0]:
                        _send_blocks(parts.tables[0], state, 0, request.block_ids[0])
                else:
                    for g, blocks in enumerate(request.block_ids):
                        if len(blocks) > sent[g]:
                            _send_blocks(parts.tables[g], state, g, blocks)
            slots.append(state.slot)
            start, num = item.start, item.num_tokens
            starts.append(start)
            counts.append(num)
            if long_from is not None and start < long_from and request.long_rope:
                parts.long_rope_rows.append(row)
            drafts = item.drafts
            if drafts is not None:
                token_ids.append(request.token_ids[start])
                token_ids.extend(drafts)
            elif num == 1:
                token_ids.append(0 if item.carries else request.token_ids[start])
            else:
                token_ids.extend(request.token_ids[start : start + num])
                if item.carries:  # (the slice stopped short of it)
                    token_ids.append(0)
            carry_row = -1
            if item.carries:
                assert parts.pipelined and state.step == step - 1, "a carried token must come from the step before"
                carry_row = state.sampled_row
                parts.carry_rows.append(row)
                parts.carry_from.append(carry_row)
            state.step = step
            params = request.params
            if item.sample:
                offset = len(request.token_ids) - len(request.prompt_ids) + request.num_pending_tokens - 1
                state.sampled_row = len(sampled)
                grammar_ends = False
                if request.grammar is not None:
                    assert parts.bitmask is not None
                    mask_row = len(parts.bitmask_rows)
                    request.grammar.fill(parts.bitmask, mask_row)
                    parts.bitmask_rows.append(state.sampled_row)
                    # A complete grammar that can only stop outranks min_tokens: banning its
                    # stops would leave no token at all.
                    grammar_ends = offset < params.min_tokens and request.grammar.only_ends(
                        parts.bitmask, mask_row, params.stop_token_ids
                    )
                if params.uses_controls:
                    parts.controls[state.sampled_row] = row_controls(
                        request, offset, item.carries, carry_row, may_stop=grammar_ends
                    )
                sampled.append(row)
                if drafts is not None:  # (this row's own sample comes after its proposed tokens')
                    parts.draft_rows.append(state.sampled_row)
                    parts.draft_counts.append(len(drafts))
                    offset += len(drafts)
                offsets.append(offset)
            if params.prompt_logprobs and wants_prompt_logprobs(request, start):
                last = min(start + num, request.num_prompt_tokens - 1)
                parts.prompt_targets[row] = tuple(request.token_ids[start + 1 : last + 1])
                parts.prompt_top = max(parts.prompt_top, params.top_logprobs)

    def finish(self) -> StepBatch:
        """The copied plan (every row must have been added)."""
        output, parts = self._output, self._parts
        assert output is not None and parts is not None
        assert len(parts.slots) == len(output.scheduled), "rows were left out of the copy"
        self._output = self._parts = None
        catch_up = _catch_up(output, self.long_rope_from)  # (before the slots of requests that ended are let go)
        departed, self._departed = self._departed, []
        for request in departed:
            state = request.runner_state
            if isinstance(state, RowState) and state.writer is self and state.slot >= 0 and request.is_finished:
                self._release(state)
        return StepBatch(
            token_ids=parts.token_ids,
            slots=parts.slots,
            starts=parts.starts,
            num_tokens=parts.num_tokens,
            sampled=parts.sampled,
            offsets=parts.offsets,
            carry_rows=parts.carry_rows,
            carry_from=parts.carry_from,
            join_slots=parts.join_slots,
            join_params=parts.join_params,
            tables=parts.tables,
            controls=parts.controls,
            prompt_targets=parts.prompt_targets,
            num_slots=self._next_slot,
            prompt_top_logprobs=parts.prompt_top,
            bitmask_rows=parts.bitmask_rows,
            bitmask=parts.bitmask,
            num_single_token_rows=parts.num_tokens.count(1),
            swap_out=[list(pairs) for pairs in output.swap_out],
            swap_in=[list(pairs) for pairs in output.swap_in],
            copy_blocks=[list(pairs) for pairs in output.copy_blocks],
            drafting=output.drafting,
            draft_rows=parts.draft_rows,
            draft_counts=parts.draft_counts,
            long_rope_rows=parts.long_rope_rows,
            draft_skip_rows=_draft_skip_rows(output),
            **catch_up,
        )

    def _assign(self, state: RowState, request: Request, parts: _Parts) -> None:
        state.slot = self._free.pop() if self._free else self._take_new_slot()
        parts.join_slots.append(state.slot)
        parts.join_params.append(row_params(request.params))
        slot = state.slot
        for g in range(self.num_groups):
            writes = parts.tables[g]
            writes.resets.append(slot)
            blocks = request.block_ids[g] if g < len(request.block_ids) else []
            writes.slots.extend([slot] * len(blocks))
            writes.columns.extend(range(len(blocks)))
            writes.blocks.extend(blocks)
        state.tables = request.block_ids
        request.block_cuts = None
        state.sent = [len(blocks) for blocks in request.block_ids]
        state.sent.extend([0] * (self.num_groups - len(state.sent)))

    def _take_new_slot(self) -> int:
        slot = self._next_slot
        self._next_slot += 1
        return slot

    def release(self, departed: Sequence[Request]) -> None:
        """Give back the slots of ``departed`` requests (that left the running set: see
        :meth:`begin`) between two copies, when no plan is coming to do it."""
        assert self._output is None, "a plan is being copied"
        for request in departed:
            state = request.runner_state
            if isinstance(state, RowState) and state.writer is self and state.slot >= 0:
                self._release(state)

    def _release(self, state: RowState) -> None:
        self._free.append(state.slot)
        state.slot = -1
        state.tables = None
        state.sent = []


@dataclass(slots=True)
class _Parts:
    """A :class:`StepBatch` being put together."""

    num_groups: int
    pipelined: bool
    token_ids: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    carry_rows: list[int] = field(default_factory=list)
    carry_from: list[int] = field(default_factory=list)
    join_slots: list[int] = field(default_factory=list)
    join_params: list[RowParams] = field(default_factory=list)
    tables: list[TableWrites] = field(init=False)
    controls: dict[int, RowControls] = field(default_factory=dict)
    prompt_targets: dict[int, tuple[int, ...]] = field(default_factory=dict)
    prompt_top: int = 0
    bitmask_rows: list[int] = field(default_factory=list)
    bitmask: torch.Tensor | None = None
    draft_rows: list[int] = field(default_factory=list)
    draft_counts: list[int] = field(default_factory=list)
    long_rope_rows: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tables = [TableWrites() for _ in range(self.num_groups)]


def _draft_skip_rows(output: SchedulerOutput) -> list[int]:
    """The rows of ``output.draft_skip``'s requests."""
    skip = output.draft_skip
    if not skip:
        return []
    return [row for row, item in enumerate(output.scheduled) if item.request in skip]


def _catch_up(output: SchedulerOutput, long_from: int | None) -> dict[str, list[int]]:
    """:class:`StepBatch`'s catch-up columns (none without catch-up rows); ``long_from``: a
    longrope model's original length."""
    if not output.catch_up:
        return {}
    columns: dict[str, list[int]] = {
        "catch_up_slots": [],
        "catch_up_starts": [],
        "catch_up_counts": [],
        "catch_up_ids": [],
        "catch_up_long_rows": [],
    }
    for row, (request, (first, tokens)) in enumerate(output.catch_up.items()):
        state = request.runner_state
        assert isinstance(state, RowState) and state.slot >= 0  # (the request is a row of the step)
        if long_from is not None and first < long_from and request.long_rope:
            columns["catch_up_long_rows"].append(row)
        columns["catch_up_slots"].append(state.slot)
        columns["catch_up_starts"].append(first)
        columns["catch_up_counts"].append(len(tokens))
        columns["catch_up_ids"].extend(tokens)
    return columns


def _send_cuts(tables: list[TableWrites], state: RowState, cuts: list[int]) -> None:
    """Send the cuts of a request's block lists (``cuts[g]`` blocks kept in group g)."""
    for g, kept in enumerate(cuts):
        if kept < state.sent[g]:
            tables[g].cut_slots.append(state.slot)
            tables[g].cut_lengths.append(kept)
            state.sent[g] = kept


def _send_blocks(writes: TableWrites, state: RowState, group: int, blocks: list[int]) -> None:
    """Send the blocks a request's list of ``group`` gained since the last copy."""
    first = state.sent[group]
    writes.slots.extend([state.slot] * (len(blocks) - first))
    writes.columns.extend(range(first, len(blocks)))
    writes.blocks.extend(blocks[first:])
    state.sent[group] = len(blocks)


def row_controls(
    request: Request, offset: int, carries: bool, carry_row: int = -1, *, may_stop: bool = False
) -> RowControls:
    """What a request's controls do at the step sampling its ``offset``-th output token
    (counted from 0); ``carries``: its last token is still being sampled by the step before,
    in that step's sampled row ``carry_row``; ``may_stop``: its stop tokens are not banned
    before ``min_tokens`` (its grammar allows nothing else)."""
    params = request.params
    penalizes = params.penalizes
    biases: list[tuple[int, float]] | None = None
    bans: tuple[Collection[int], ...] = ()
    if params.sequence_index is not None:
        # (the scheduler plans no step for such a request while its last token is in flight)
        bias_matcher, bad_matcher = params.sequence_index.matchers()
        known = request.token_ids
        biases = bias_matcher.matches(known)
        bans = ([token for token, _ in bad_matcher.matches(known)],)
    if params.no_repeat_ngram_size:
        state = row_state(request)
        if state.ngrams is None:
            state.ngrams = RepeatedNgrams()
        repeated = state.ngrams.bans(request.token_ids, params.no_repeat_ngram_size)
        if repeated:
            bans = (*bans, repeated)
    if offset < params.min_tokens and not may_stop:
        bans = (*bans, params.held_stops)
    if offset == 0 and params.begin_bans:
        bans = (*bans, params.begin_bans)
    return RowControls(
        params,
        token_history(request) if penalizes else None,
        request.num_tokens,
        request.num_prompt_tokens,
        carries and penalizes,
        carry_row,
        biases,
        bans,
    )
