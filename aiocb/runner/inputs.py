"""A scheduled step as flat tensors: no padding between requests.

The loop thread takes a :class:`StepBatch` snapshot of the plan (plain lists, so the
scheduler may move on while the device works); :func:`prepare_inputs` turns it into the
tensors of one forward pass: token ids and positions of every scheduled token back to
back, cache slots to write, per-request KV slots to read, and the rows whose logits are
sampled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from aiocb.core.kv_cache import ring_size
from aiocb.core.scheduler import SchedulerOutput, wants_prompt_logprobs
from aiocb.runner.paged_cache import PagedKVCache
from aiocb.runner.sampler import SamplingTensors


@dataclass(frozen=True, slots=True)
class RowSpec:
    """One scheduled request: positions ``start .. start + num_tokens - 1``."""

    start: int
    num_tokens: int
    #: per cache group, the request's blocks in order
    block_ids: tuple[tuple[int, ...], ...]
    sample: bool
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    #: how many tokens the request generated before this step (its random stream offset)
    offset: int = 0
    logprobs: bool = False
    top_logprobs: int = 0
    #: with prompt logprobs: the prompt tokens that this step's positions predict
    prompt_targets: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class StepBatch:
    """An immutable snapshot of one step's plan."""

    token_ids: list[int]
    rows: list[RowSpec]

    @property
    def num_sampled(self) -> int:
        """Rows whose next token is sampled."""
        return sum(1 for r in self.rows if r.sample)


def snapshot(output: SchedulerOutput) -> StepBatch:
    """Copy what the device needs out of the scheduler's live state."""
    token_ids: list[int] = []
    rows: list[RowSpec] = []
    for item in output.scheduled:
        request = item.request
        params = request.params
        token_ids.extend(request.token_ids[item.start : item.start + item.num_tokens])
        targets: tuple[int, ...] = ()
        if wants_prompt_logprobs(request, item.start):
            last = min(item.start + item.num_tokens, request.num_prompt_tokens - 1)
            targets = tuple(request.token_ids[item.start + 1 : last + 1])
        rows.append(
            RowSpec(
                start=item.start,
                num_tokens=item.num_tokens,
                block_ids=tuple(tuple(blocks) for blocks in request.block_ids),
                sample=item.sample,
                temperature=params.temperature,
                top_k=params.top_k,
                top_p=params.top_p,
                seed=params.seed,
                offset=request.num_output_tokens,
                logprobs=params.return_logprobs,
                top_logprobs=params.top_logprobs,
                prompt_targets=targets,
            )
        )
    return StepBatch(token_ids, rows)


@dataclass(slots=True)
class GroupAttention:
    """Where one cache group's layers write and read in this step."""

    window: int | None
    #: ``[T]`` the cache slot each new token's K/V goes to
    slot_mapping: torch.Tensor
    #: ``[B, max_blocks]`` int32 block ids of each row, padded with the null block
    block_table: torch.Tensor
    #: ``[Bd, Lmax]`` slots of each single-token row's keys (its window), padded with the null slot
    decode_slots: torch.Tensor | None = None
    #: ``[Bd, Lmax]`` which entries of ``decode_slots`` are real
    decode_valid: torch.Tensor | None = None
    #: per multi-token row, the slots of the keys before its first new token
    prefill_past_slots: list[torch.Tensor] = field(default_factory=list)
    #: per multi-token row, a ``[q, past + q]`` mask, or None for plain causal attention
    prefill_masks: list[torch.Tensor | None] = field(default_factory=list)


@dataclass(slots=True)
class AttentionMetadata:
    """Everything the attention function needs besides the layer's Q, K and V."""

    cache: PagedKVCache
    groups: list[GroupAttention]
    num_tokens: int
    #: ``[B + 1]`` int32 flat index of each row's first token, then the total
    query_start: torch.Tensor
    #: ``[B]`` int32 each row's context length after this step (cached + new tokens)
    seq_lens: torch.Tensor
    max_query_len: int
    max_seq_len: int
    #: ``[Bd]`` flat token index of each single-token row
    decode_token_index: torch.Tensor | None
    #: per multi-token row, ``(first flat token, number of tokens)``
    prefill_rows: list[tuple[int, int]]


@dataclass(slots=True)
class StepInputs:
    """The model's inputs for one step."""

    input_ids: torch.Tensor  # [T]
    position_ids: torch.Tensor  # [T]
    #: [S + P] flat index of each sampled row's last token, then of each scored prompt position
    logits_indices: torch.Tensor
    attention: AttentionMetadata
    sampling: SamplingTensors
    #: [P] the prompt token each scored position predicts
    prompt_targets: torch.Tensor
    #: per row that scores prompt tokens, how many (in row order)
    prompt_counts: list[int]


def prepare_inputs(batch: StepBatch, cache: PagedKVCache, device: torch.device) -> StepInputs:
    """Flatten a step into tensors on ``device``."""
    rows = batch.rows
    page = cache.page_size
    long = torch.long
    q_lens = torch.tensor([r.num_tokens for r in rows], dtype=long)
    starts = torch.tensor([r.start for r in rows], dtype=long)
    num_tokens = len(batch.token_ids)
    row_of_token = torch.repeat_interleave(torch.arange(len(rows)), q_lens)
    first_token = torch.cumsum(q_lens, 0) - q_lens
    positions = torch.arange(num_tokens) - first_token[row_of_token] + starts[row_of_token]
    sampled = [i for i, r in enumerate(rows) if r.sample]
    scored = [i for i, r in enumerate(rows) if r.prompt_targets]
    prompt_counts = [len(rows[i].prompt_targets) for i in scored]
    prompt_indices = [int(first_token[i]) + j for i, n in zip(scored, prompt_counts, strict=True) for j in range(n)]
    logits_indices = torch.cat((
        (first_token + q_lens - 1)[sampled],
        torch.tensor(prompt_indices, dtype=long),
    ))

    decode = [i for i, r in enumerate(rows) if r.num_tokens == 1]
    prefill = [i for i, r in enumerate(rows) if r.num_tokens > 1]
    decode_index = torch.tensor(decode, dtype=long)

    groups: list[GroupAttention] = []
    for g, window in enumerate(cache.group_windows):
        ring = ring_size(window, page) if window is not None else None
        null = cache.null_block(g)
        table = _block_table(rows, g, null)
        # Sliding layers keep only the last window-1 positions of a chunk; earlier ones
        # would land on ring slots that later tokens of the same chunk overwrite.
        written = torch.ones(num_tokens, dtype=torch.bool)
        if window is not None:
            last = (starts + q_lens)[row_of_token]
            written = positions >= last - (window - 1)
        slots = _slots(table[row_of_token], positions, page, ring)
        slot_mapping = torch.where(written, slots, cache.trash_block(g) * page)
        group = GroupAttention(
            window=window, slot_mapping=slot_mapping.to(device), block_table=table.to(device, torch.int32)
        )

        if decode:
            pos = starts[decode_index]
            lo = (pos - window + 1).clamp_min(0) if window is not None else torch.zeros_like(pos)
            lengths = pos - lo + 1
            width = int(lengths.max())
            steps = torch.arange(width)
            valid = steps[None, :] < lengths[:, None]
            key_pos = torch.where(valid, lo[:, None] + steps[None, :], pos[:, None])
            key_slots = _slots(table[decode_index], key_pos, page, ring)
            group.decode_slots = torch.where(valid, key_slots, null * page).to(device)
            group.decode_valid = valid.to(device)

        for i in prefill:
            start, q_len = rows[i].start, rows[i].num_tokens
            lo = max(0, start - (window - 1)) if window is not None else 0
            past_pos = torch.arange(lo, start)
            group.prefill_past_slots.append(_slots(table[i : i + 1].expand(len(past_pos), -1), past_pos, page, ring).to(device))
            group.prefill_masks.append(_prefill_mask(lo, start, q_len, window, device))
        groups.append(group)

    seq_lens = starts + q_lens
    query_start = torch.cat((first_token, torch.tensor([num_tokens])))
    attention = AttentionMetadata(
        cache=cache,
        groups=groups,
        num_tokens=num_tokens,
        query_start=query_start.to(device, torch.int32),
        seq_lens=seq_lens.to(device, torch.int32),
        max_query_len=int(q_lens.max()),
        max_seq_len=int(seq_lens.max()),
        decode_token_index=first_token[decode_index].to(device) if decode else None,
        prefill_rows=[(int(first_token[i]), rows[i].num_tokens) for i in prefill],
    )
    return StepInputs(
        input_ids=torch.tensor(batch.token_ids, dtype=long).to(device),
        position_ids=positions.to(device),
        logits_indices=logits_indices.to(device),
        attention=attention,
        sampling=SamplingTensors.from_rows([rows[i] for i in sampled], device),
        prompt_targets=torch.tensor([t for i in scored for t in rows[i].prompt_targets], dtype=long).to(device),
        prompt_counts=prompt_counts,
    )


def _block_table(rows: list[RowSpec], group: int, null: int) -> torch.Tensor:
    width = max(1, max(len(r.block_ids[group]) for r in rows))
    return torch.tensor(
        [list(r.block_ids[group]) + [null] * (width - len(r.block_ids[group])) for r in rows],
        dtype=torch.long,
    )


def _slots(table: torch.Tensor, positions: torch.Tensor, page: int, ring: int | None) -> torch.Tensor:
    """Cache slots of ``positions`` (any shape) given each position's block-table row.

    ``table`` has shape ``positions.shape + (max_blocks,)`` minus the last positions
    dimension broadcast: ``[..., max_blocks]`` aligned with ``positions[..., :]``.
    """
    column = positions // page
    if ring is not None:
        column = column % ring
    if positions.dim() == 1:
        blocks = table.gather(1, column[:, None])[:, 0]
    else:
        blocks = table.gather(1, column)
    return blocks * page + positions % page


def _prefill_mask(lo: int, start: int, q_len: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """Which keys (positions ``lo .. start + q_len - 1``) each new query may see."""
    if lo == start and (window is None or q_len <= window):
        return None  # plain causal attention over the new tokens
    key_pos = torch.arange(lo, start + q_len)
    query_pos = torch.arange(start, start + q_len)
    mask = key_pos[None, :] <= query_pos[:, None]
    if window is not None:
        mask &= key_pos[None, :] > query_pos[:, None] - window
    return mask.to(device)
