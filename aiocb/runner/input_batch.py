"""The persistent batch: every slot's block tables and sampling parameters (worker side).

A slot belongs to one running request (the event loop's
:class:`~aiocb.runner.step_batch.BatchWriter` hands them out). Its rows here change only
when a :class:`~aiocb.runner.step_batch.StepBatch` says so: a new owner's parameters and
tables, blocks appended. A step then gathers the rows of its slots in a few vectorised
copies instead of rebuilding them from Python objects. The tensors live in host memory
and each step's gathered copy is what goes to the device, so a step in flight never
sees a later step's changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from aiocb.runner.filter_chain import OFF, RareFilters
from aiocb.runner.step_batch import StepBatch

_LONG = torch.long


@dataclass(frozen=True, slots=True)
class SlotParams:
    """The sampling parameters of a step's sampled slots (a greedy row's temperature and
    min-p are 0), and the batch-wide flags read from them on the host. Shared by the steps
    that sample the same slots: nothing may change these tensors in place."""

    slots: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seed: torch.Tensor
    #: None when no row uses min-p
    min_p: torch.Tensor | None
    #: the rarer filters of the rows that use any; None when no row does
    rare: RareFilters | None
    all_greedy: bool
    any_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_logprobs: bool
    max_top_logprobs: int
    max_top_k: int
    #: rows whose logprobs are of the distribution drawn from; None when no row's are
    processed_logprobs: torch.Tensor | None


class InputBatch:
    """Host tensors indexed by slot: block tables (per cache group) and sampling parameters."""

    def __init__(self, null_blocks: Sequence[int], num_slots: int = 64, width: int = 8) -> None:
        self._null = list(null_blocks)
        self.tables = [torch.full((num_slots, width), null, dtype=_LONG) for null in self._null]
        #: per group and slot, how many table entries are real
        self.lengths = [torch.zeros(num_slots, dtype=_LONG) for _ in self._null]
        self.temperature = torch.zeros(num_slots, dtype=torch.float32)
        self.top_k = torch.zeros(num_slots, dtype=_LONG)
        self.top_p = torch.ones(num_slots, dtype=torch.float32)
        self.min_p = torch.zeros(num_slots, dtype=torch.float32)
        self.filters = torch.tensor(OFF, dtype=torch.float32).repeat(num_slots, 1)
        self.seed = torch.zeros(num_slots, dtype=_LONG)
        self.logprobs = torch.zeros(num_slots, dtype=torch.bool)
        self.top_logprobs = torch.zeros(num_slots, dtype=_LONG)
        self.processed_logprobs = torch.zeros(num_slots, dtype=torch.bool)
        #: the last two :meth:`sampling_params`, the latest first: steady decode steps sample
        #: the same slots, whose parameters change only when a slot gets a new owner (two:
        #: a draft model's passes sample the speculating rows' slots in between)
        self._params: list[SlotParams] = []

    @property
    def num_slots(self) -> int:
        """Rows allocated (grown on demand)."""
        return int(self.temperature.shape[0])

    def apply(self, batch: StepBatch) -> None:
        """Take in a step's changes: new owners' parameters and the tables' writes."""
        if batch.num_slots > self.num_slots:
            self._grow_slots(batch.num_slots)
        if batch.join_slots:
            self._params = []
            slots = torch.tensor(batch.join_slots, dtype=_LONG)
            temperature, top_k, top_p, min_p, seed, logprobs, top_logprobs, processed, filters = zip(
                *batch.join_params, strict=True
            )
            self.temperature[slots] = torch.tensor(temperature, dtype=torch.float32)
            self.top_k[slots] = torch.tensor(top_k, dtype=_LONG)
            self.top_p[slots] = torch.tensor(top_p, dtype=torch.float32)
            self.min_p[slots] = torch.tensor(min_p, dtype=torch.float32)
            self.seed[slots] = torch.tensor(seed, dtype=_LONG)
            self.logprobs[slots] = torch.tensor(logprobs, dtype=torch.bool)
            self.top_logprobs[slots] = torch.tensor(top_logprobs, dtype=_LONG)
            self.processed_logprobs[slots] = torch.tensor(processed, dtype=torch.bool)
            self.filters[slots] = torch.tensor([OFF if f is None else f for f in filters], dtype=torch.float32)
        for g, writes in enumerate(batch.tables):
            if writes.resets:
                resets = torch.tensor(writes.resets, dtype=_LONG)
                self.tables[g][resets] = self._null[g]
                self.lengths[g][resets] = 0
            for slot, kept in zip(writes.cut_slots, writes.cut_lengths, strict=True):
                self.tables[g][slot, kept:] = self._null[g]
                self.lengths[g][slot] = kept
            if not writes.slots:
                continue
            slots = torch.tensor(writes.slots, dtype=_LONG)
            columns = torch.tensor(writes.columns, dtype=_LONG)
            widest = max(writes.columns) + 1
            if widest > self.tables[g].shape[1]:
                self._grow_width(g, widest)
            self.tables[g].index_put_((slots, columns), torch.tensor(writes.blocks, dtype=_LONG))
            self.lengths[g].scatter_reduce_(0, slots, columns + 1, "amax")

    def sampling_params(self, slots: torch.Tensor) -> SlotParams:
        """The sampling parameters of ``slots`` (the step's sampled rows, in order)."""
        for last in self._params:
            if last.slots.shape == slots.shape and torch.equal(last.slots, slots):
                return last
        temperature = self.temperature.index_select(0, slots)
        top_k = self.top_k.index_select(0, slots)
        top_p = self.top_p.index_select(0, slots)
        min_p = self.min_p.index_select(0, slots)
        drawn = temperature != 0.0
        tops = self.top_logprobs.index_select(0, slots)
        processed = self.processed_logprobs.index_select(0, slots)
        drawn_k = top_k[drawn]
        params = SlotParams(
            # (a copy: the caller may reuse its tensor)
            slots=slots.clone(),
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=self.seed.index_select(0, slots),
            min_p=min_p if bool((min_p > 0.0).any()) else None,
            rare=RareFilters.gather(self.filters.index_select(0, slots), drawn),
            all_greedy=not bool(drawn.any()),
            any_greedy=not bool(drawn.all()),
            any_top_k=bool((drawn_k > 0).any()),
            any_top_p=bool((top_p[drawn] < 1.0).any()),
            any_logprobs=bool((self.logprobs.index_select(0, slots) | (tops > 0)).any()),
            max_top_logprobs=int(tops.max()) if tops.numel() else 0,
            max_top_k=int(drawn_k.max()) if drawn_k.numel() else 0,
            processed_logprobs=processed if bool(processed.any()) else None,
        )
        self._params = [params, *self._params[:1]]
        return params

    def table(self, group: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The block tables of ``slots`` in one cache group, ``[rows, widest]`` padded with its
        null block, and each row's length."""
        lengths = self.lengths[group].index_select(0, slots)
        width = max(1, int(lengths.max())) if slots.numel() else 1
        return self.tables[group][:, :width].index_select(0, slots), lengths

    def _grow_slots(self, needed: int) -> None:
        size = max(needed, 2 * self.num_slots)
        self._params = []

        def grown(t: torch.Tensor, fill: float | int | bool) -> torch.Tensor:
            bigger = torch.full((size, *t.shape[1:]), fill, dtype=t.dtype)
            bigger[: t.shape[0]] = t
            return bigger

        self.tables = [grown(t, null) for t, null in zip(self.tables, self._null, strict=True)]
        self.lengths = [grown(t, 0) for t in self.lengths]
        self.temperature = grown(self.temperature, 0.0)
        self.top_k = grown(self.top_k, 0)
        self.top_p = grown(self.top_p, 1.0)
        self.min_p = grown(self.min_p, 0.0)
        filters = torch.tensor(OFF, dtype=torch.float32).repeat(size, 1)
        filters[: self.filters.shape[0]] = self.filters
        self.filters = filters
        self.seed = grown(self.seed, 0)
        self.logprobs = grown(self.logprobs, False)
        self.top_logprobs = grown(self.top_logprobs, 0)
        self.processed_logprobs = grown(self.processed_logprobs, False)

    def _grow_width(self, group: int, needed: int) -> None:
        table = self.tables[group]
        wider = torch.full((table.shape[0], max(needed, 2 * table.shape[1])), self._null[group], dtype=_LONG)
        wider[:, : table.shape[1]] = table
        self.tables[group] = wider
