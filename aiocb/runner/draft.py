"""The draft model of speculative decoding, run inside the target's step.

The draft keeps its own paged cache with the target's block ids and page size (its own
layers and heads), so every block the scheduler hands out, shares, copies or swaps holds
the same tokens in both caches, and the target's block tables serve the draft too.

Each step the draft runs in (one where a request speculates or catches up), before the
target's forward pass:

0. the draft computes the tokens of steps it slept through, for the rows that catch up;
1. the draft runs over the step's own inputs (prefill chunks, decode tokens, and the
   placeholders where the speculating rows' proposals go), which keeps its cache in step
   with the target's and gives each speculating row's first proposal; prompt chunks of
   requests that do not propose yet (they wait for the draft's acceptance to recover, or
   back off, or may not speculate) are left out, and caught up on if they come to;
2. one decode pass per further proposal feeds each speculating row its latest proposal
   and draws the next, rewriting the placeholders' keys with the proposals' own. The last
   proposal's key is not written: the target may reject it, and when it accepts it the
   draft catches up on it in the request's next proposing step (step 0).

The proposals then replace the placeholders in the target's inputs (on the device, no
host synchronisation) and come back with the step's results. Every proposal is drawn
with the request's own parameters and noise at the token index the target draws it at.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import accumulate

import torch
from transformers import PreTrainedModel

from aiocb.config import ContinuousBatchingConfig
from aiocb.errors import InvalidConfigError
from aiocb.runner import attention
from aiocb.runner.backends import Backend, select_backends
from aiocb.runner.cuda_graphs import DecodeGraphs
from aiocb.runner.input_batch import InputBatch
from aiocb.runner.inputs import HostToDevice, StepInputs, prepare_inputs
from aiocb.runner.memory import CachePlan
from aiocb.runner.model_spec import ModelSpec, model_spec
from aiocb.runner.paged_cache import PagedKVCache
from aiocb.runner.sampler import sample
from aiocb.runner.step_batch import StepBatch, TableWrites


@dataclass(slots=True)
class _Plan:
    """Where a step's proposals come from and go (host tensors, then device)."""

    #: per speculating row: the flat index of its first token (its last known one) ...
    first_index: torch.Tensor
    #: ... and the target's sampling row of its first proposal
    first_sampling: torch.Tensor
    #: per proposal (row by row, in order): its flat index in the target's inputs
    input_index: torch.Tensor
    #: per decode pass: which of the previous pass's rows it feeds (their latest
    #: proposals are its inputs, and each row fed draws its next proposal) ...
    keep: list[torch.Tensor] = field(default_factory=list)
    #: ... and per pass (the first included): where each row's draw goes among the step's
    #: proposals
    destination: list[torch.Tensor] = field(default_factory=list)


def draft_spec(draft: PreTrainedModel) -> ModelSpec:
    """The draft's cache layout, refused where it cannot mirror the target's cache."""
    spec = model_spec(draft)
    if any(w is not None for w in spec.layer_windows):
        raise InvalidConfigError("draft_model has sliding-window layers: a draft model needs full attention")
    if spec.tp_size != 1:
        raise InvalidConfigError("draft_model is tensor-parallel: a draft model runs on one device")
    return spec


def refuse_other_kernels(
    spec: ModelSpec, plan: CachePlan, config: ContinuousBatchingConfig, backends: list[str]
) -> None:
    """InvalidConfigError unless a draft model of ``spec`` attends through the kernel of the
    target's full-attention layers (``backends[0]``: their group comes first), whose blocks
    its cache mirrors: the draft's first pass of a step attends through the target's
    attention metadata, built for the target's kernels, so the draft's cache (its dtype,
    its head size) must take the same."""
    # (flash-attn, where the target's sinks turned it down, is not the draft's to want)
    sinks = spec.sinks or backends[0] != Backend.FLASH
    own = select_backends(
        spec.device, config, [None], plan.page_size, dtype=spec.dtype, head_dim=spec.head_dim, sinks=sinks
    )[0]
    if own != backends[0]:
        flash_refused = spec.sinks and backends[0] == Backend.FLASH
        why = (
            "its attention has sinks, which flash-attn does not take"
            if flash_refused
            else "give a draft model in the target's dtype"
        )
        raise InvalidConfigError(
            f"draft_model ({spec.dtype}, heads of {spec.head_dim}) cannot use the attention kernel of the "
            f"target's full-attention layers ({backends[0]}; it would need {own}): {why}"
        )


class Drafter:
    """Runs the draft model over a step and proposes the speculating rows' tokens."""

    def __init__(
        self,
        model: PreTrainedModel,
        spec: ModelSpec,
        plan: CachePlan,
        config: ContinuousBatchingConfig,
        backends: list[str],
        vocab_size: int,
    ) -> None:
        refuse_other_kernels(spec, plan, config, backends)
        self.model = model
        self.spec = spec
        # Zeroed: a step's first pass runs over every row, those the draft slept through
        # too (waiting or backing-off requests), whose queries then read positions the draft
        # never wrote; their results are not used, but uninitialised memory could hold NaNs.
        self.cache = PagedKVCache(spec, plan, zeroed=True)
        self.backends = backends
        #: proposals are drawn from the ids both vocabularies have
        self.vocab_size = min(vocab_size, spec.vocab_size)
        self._target_vocab_size = vocab_size
        self._transfer = HostToDevice(spec.device)
        #: whether this holds the model's attention (see :func:`attention.install`)
        self._attached = False
        #: the draft's CUDA graphs (None: its passes run eagerly), set and captured by the runner
        self.graphs: DecodeGraphs | None = None

    def attach(self) -> None:
        """Route the draft's attention through its paged cache, and a longrope draft's rotary
        embeddings to the setting of each token (idempotent). The tokens the target's steps
        mark long are long to the draft too: a copy of the target proposes its tokens."""
        if not self._attached:
            attention.hold(self.model, self.spec.long_rope_from)
            self._attached = True

    def detach(self) -> None:
        """Give the draft back its original attention and rotary embeddings (idempotent)."""
        if self._attached:
            attention.let_go(self.model, self.spec.long_rope_from)
            self._attached = False

    def propose(self, batch: StepBatch, inputs: StepInputs, state: InputBatch) -> torch.Tensor | None:
        """Run the draft over the step (``inputs`` are the target's, their carried tokens
        in place) and write its proposals into ``inputs.input_ids``; returns them, row by
        row (None when no row speculates)."""
        if batch.catch_up_slots:
            self._catch_up(batch, state)
        rows = [batch.sampled[r] for r in batch.draft_rows]  # (the speculating rows' batch rows)
        plan = self._transfer.move(_plan(batch, rows)) if rows else None
        graphs = self.graphs
        logits: torch.Tensor | None
        if batch.draft_skip_rows:
            logits = self._first_pass_without(batch, inputs, state, rows)
        elif (
            graphs is not None
            and plan is not None
            and inputs.attention.long_rope is None  # (as the target's steps: graphs take no marks)
            and (width := graphs.width_for(batch, inputs))
        ):
            own = replace(inputs, input_ids=self._ids(inputs.input_ids))
            logits = graphs.run_wide(own, batch.num_rows, width, plan.first_index)
        else:
            first_attention = replace(inputs.attention, cache=self.cache)
            keep = plan.first_index if plan is not None else inputs.logits_indices[:0]
            logits = attention.forward(
                self.model, self._ids(inputs.input_ids)[None], inputs.position_ids[None], keep, first_attention
            )
        if plan is None:
            return None
        assert logits is not None  # (the speculating rows are never left out)
        proposals = torch.empty(batch.num_drafts, dtype=torch.long, device=inputs.input_ids.device)
        tokens = sample(self._common(logits), inputs.sampling.select(plan.first_sampling)).tokens
        proposals.index_copy_(0, plan.destination[0], tokens)
        for j, step in enumerate(_decode_passes(batch, rows, state.num_slots), 1):
            pass_inputs = prepare_inputs(step, self.cache, self._transfer, self.backends, state)
            pass_inputs.input_ids.copy_(tokens.index_select(0, plan.keep[j - 1]))
            if graphs is not None and graphs.eligible(step, pass_inputs):
                logits = graphs.run(pass_inputs, step.num_rows)
            else:
                logits = attention.forward(
                    self.model,
                    pass_inputs.input_ids[None],
                    pass_inputs.position_ids[None],
                    pass_inputs.logits_indices,
                    pass_inputs.attention,
                )
            sampling = replace(pass_inputs.sampling, any_logprobs=False, max_top_logprobs=0)
            tokens = sample(self._common(logits), sampling).tokens
            proposals.index_copy_(0, plan.destination[j], tokens)
        inputs.input_ids.index_copy_(0, plan.input_index, proposals)
        return proposals

    def _first_pass_without(
        self, batch: StepBatch, inputs: StepInputs, state: InputBatch, rows: list[int]
    ) -> torch.Tensor | None:
        """The first pass over the step's rows but ``batch.draft_skip_rows`` (prompt chunks,
        so the step runs without a graph anyway): the draft's logits at the first token of
        each of ``rows`` (the speculating ones), None when no row is left."""
        skipped = set(batch.draft_skip_rows)
        kept = [r for r in range(batch.num_rows) if r not in skipped]
        if not kept:
            return None
        counts = [batch.num_tokens[r] for r in kept]
        firsts = [0, *accumulate(counts)]  # (each kept row's first token in the pass)
        place = {r: i for i, r in enumerate(kept)}
        step = _draft_pass(
            batch,
            state.num_slots,
            token_ids=[0] * firsts[-1],  # (the target's inputs, carried tokens in place)
            slots=[batch.slots[r] for r in kept],
            starts=[batch.starts[r] for r in kept],
            num_tokens=counts,
            sampled=[],
            offsets=[],
            long_rope_rows=[place[r] for r in batch.long_rope_rows if r in place],
        )
        own = prepare_inputs(step, self.cache, self._transfer, self.backends, state)
        row_kept = torch.ones(batch.num_rows, dtype=torch.bool)
        row_kept[batch.draft_skip_rows] = False
        taken = row_kept.repeat_interleave(torch.tensor(batch.num_tokens)).nonzero()[:, 0]  # (kept rows' tokens)
        keep = torch.tensor([firsts[place[r]] for r in rows], dtype=torch.long)
        taken, keep = self._transfer.move([taken, keep])
        own.input_ids.copy_(inputs.input_ids.index_select(0, taken))
        return attention.forward(
            self.model, self._ids(own.input_ids)[None], own.position_ids[None], keep, own.attention
        )

    def _catch_up(self, batch: StepBatch, state: InputBatch) -> None:
        """Compute the tokens of steps the draft slept through, into its cache (no logits)."""
        step = _draft_pass(
            batch,
            state.num_slots,
            token_ids=batch.catch_up_ids,
            slots=batch.catch_up_slots,
            starts=batch.catch_up_starts,
            num_tokens=batch.catch_up_counts,
            sampled=[],
            offsets=[],
            long_rope_rows=batch.catch_up_long_rows,
        )
        inputs = prepare_inputs(step, self.cache, self._transfer, self.backends, state)
        attention.forward(
            self.model,
            self._ids(inputs.input_ids)[None],
            inputs.position_ids[None],
            inputs.logits_indices,
            inputs.attention,
        )

    def _ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids`` as the draft reads them: ids past its vocabulary are a padded
        vocabulary's unused ones, and any stand-in keeps the outputs exact (proposals only
        decide how many tokens are kept)."""
        if self.spec.vocab_size < self._target_vocab_size:
            return input_ids.clamp(max=self.spec.vocab_size - 1)
        return input_ids

    def _common(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's logits over the ids both vocabularies have, as the sampler takes them
        (float32, rows contiguous: a padded vocabulary's slice is not)."""
        return logits[:, : self.vocab_size].float().contiguous()


def _plan(batch: StepBatch, rows: list[int]) -> _Plan:
    counts = batch.draft_counts
    first_tokens = [0, *accumulate(batch.num_tokens)]
    starts = [0, *accumulate(counts)]  # (each row's first proposal among the step's)
    long = torch.long
    input_index = [first_tokens[row] + j for row, c in zip(rows, counts, strict=True) for j in range(1, c + 1)]
    plan = _Plan(
        first_index=torch.tensor([first_tokens[row] for row in rows], dtype=long),
        first_sampling=torch.tensor([batch.num_sampled + s for s in starts[:-1]], dtype=long),
        input_index=torch.tensor(input_index, dtype=long),
    )
    # Pass j (0: the first) draws the (j+1)-th proposal of the rows that propose that many;
    # pass j >= 1 feeds them their j-th. (No pass feeds a row its last proposal: the key
    # it would write is needed only once the target accepts that proposal, and the draft
    # catches up on it then.)
    members = list(range(len(rows)))
    for j in range(max(counts)):
        if j:
            fed = [i for i in members if counts[i] > j]
            where = {i: k for k, i in enumerate(members)}
            plan.keep.append(torch.tensor([where[i] for i in fed], dtype=long))
            members = fed
        plan.destination.append(torch.tensor([starts[i] + j for i in members], dtype=long))
    return plan


def _decode_passes(batch: StepBatch, rows: list[int], num_slots: int) -> list[StepBatch]:
    """The draft's decode passes after the first: pass j feeds each row that proposes more
    than j tokens its j-th proposal, at that proposal's position, sampled with the noise of
    the token after it."""
    counts = batch.draft_counts
    passes = []
    for j in range(1, max(counts)):
        members = [i for i, c in enumerate(counts) if c > j]
        n = len(members)
        passes.append(
            _draft_pass(
                batch,
                num_slots,
                token_ids=[0] * n,  # (the previous pass's proposals, on the device)
                slots=[batch.slots[rows[i]] for i in members],
                starts=[batch.starts[rows[i]] + j for i in members],
                num_tokens=[1] * n,
                sampled=list(range(n)),
                # the row's own sample is its (count)-th token after the last known one
                offsets=[batch.offsets[batch.draft_rows[i]] - counts[i] + j for i in members],
            )
        )
    return passes


def _draft_pass(
    batch: StepBatch,
    num_slots: int,
    *,
    token_ids: list[int],
    slots: list[int],
    starts: list[int],
    num_tokens: list[int],
    sampled: list[int],
    offsets: list[int],
    long_rope_rows: list[int] | None = None,
) -> StepBatch:
    """A pass of the draft alone over some of ``batch``'s slots: no slot joins, block-table
    changes, carried tokens, logits controls or prompt scores (the step's own pass made
    those); ``long_rope_rows``: its rows whose tokens all take the long setting (a decode
    pass has none: its positions are past the original length where its request is long)."""
    return StepBatch(
        token_ids=token_ids,
        slots=slots,
        starts=starts,
        num_tokens=num_tokens,
        sampled=sampled,
        offsets=offsets,
        carry_rows=[],
        carry_from=[],
        join_slots=[],
        join_params=[],
        tables=[TableWrites() for _ in batch.tables],
        controls={},
        prompt_targets={},
        num_slots=num_slots,
        num_single_token_rows=num_tokens.count(1),
        long_rope_rows=long_rope_rows or [],
    )
