"""A scheduled step as flat tensors: no padding between requests.

The loop thread copies each plan out as a :class:`~aiocb.runner.step_batch.StepBatch`
(the changes to the persistent batch, plain values, so the scheduler may move on while
the device works); :func:`prepare_inputs` applies them to the
:class:`~aiocb.runner.input_batch.InputBatch` and builds the tensors of one forward pass:
token ids and positions of every scheduled token back to back, cache slots to write,
per-request KV slots or block tables to read, and the rows whose logits are sampled.
Tensors are built on the host with vectorised operations (a step's cost hardly depends
on its rows' lengths) and moved to the device in one copy per dtype through
:class:`HostToDevice` (pinned, double-buffered, on a side stream).
"""

from __future__ import annotations

import array
import bisect
import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar, cast

import torch

from aiocb.core.kv_cache import kept_positions, ring_safe_tokens, ring_size
from aiocb.runner.backends import Backend
from aiocb.runner.input_batch import InputBatch
from aiocb.runner.paged_cache import PagedKVCache
from aiocb.runner.sampler import SamplingTensors, controls_from_tensors
from aiocb.runner.step_batch import RowControls, StepBatch


def controls_host_tensors(controls: dict[int, RowControls], num_rows: int) -> dict[str, torch.Tensor]:
    """The controls of the sampled rows (by row, of ``num_rows``) as flat host tensors
    (none when no row uses one).

    Names start with ``c_``; :func:`~aiocb.runner.sampler.SamplingTensors.from_device`
    turns them into a :class:`~aiocb.runner.logits_controls.LogitsControls`. A history
    entry whose token is still being sampled by the previous step is a placeholder:
    ``c_history_carry`` says where, ``c_history_carry_rows`` from which previous row.
    """
    host: dict[str, torch.Tensor] = {}
    if not controls:
        return host
    long = torch.long
    # Biases, bans and allowed tokens may be thousands a row (a logit_bias, a request's stop
    # tokens before its min_tokens, allowed_token_ids): gathered in C arrays, a quarter of a
    # list's cost to make into a tensor, and added a collection at a time.
    bias_rows, bias_ids, bias_values = array.array("q"), array.array("q"), array.array("f")
    ban_rows, ban_ids = array.array("q"), array.array("q")
    allow_rows, allow_ids = array.array("q"), array.array("q")
    history: list[torch.Tensor] = []
    history_lengths: list[int] = []
    num_history = 0
    prompt_lengths: list[int] = []
    penalized: list[int] = []
    carry_at: list[int] = []
    carry_rows: list[int] = []
    restrict = [False] * num_rows
    for i, c in controls.items():
        params = c.params
        if params.bias_ids:
            bias_rows.extend(array.array("q", (i,)) * len(params.bias_ids))
            bias_ids.extend(params.bias_ids)
            bias_values.extend(params.bias_values)
        for token, bias in c.biases or ():
            bias_rows.append(i)
            bias_ids.append(token)
            bias_values.append(bias)
        for bans in (params.bans, *c.bans):
            ban_rows.extend(array.array("q", (i,)) * len(bans))
            ban_ids.extend(bans)
        allowed = params.allowed_token_ids
        if allowed is not None:
            restrict[i] = True
            allow_rows.extend(array.array("q", (i,)) * len(allowed))
            allow_ids.extend(allowed)
        if c.history is not None:
            penalized.append(i)
            length = c.history_length
            history.append(torch.frombuffer(c.history[:length], dtype=torch.long))
            if c.carries:
                carry_at.append(num_history + length)
                carry_rows.append(c.carry_row)
                history.append(_PLACEHOLDER)  # replaced on the device by the previous step's sample
            history_lengths.append(length + c.carries)
            num_history += length + c.carries
            prompt_lengths.append(c.num_prompt_tokens)
    if bias_rows:
        host["c_bias_rows"] = torch.frombuffer(bias_rows, dtype=long)
        host["c_bias_ids"] = torch.frombuffer(bias_ids, dtype=long)
        host["c_bias_values"] = torch.frombuffer(bias_values, dtype=torch.float32)
    if ban_rows:
        host["c_ban_rows"] = torch.frombuffer(ban_rows, dtype=long)
        host["c_ban_ids"] = torch.frombuffer(ban_ids, dtype=long)
    if allow_rows:
        host["c_restrict_rows"] = torch.tensor(restrict, dtype=torch.bool)
        host["c_allow_rows"] = torch.frombuffer(allow_rows, dtype=long)
        host["c_allow_ids"] = torch.frombuffer(allow_ids, dtype=long)
    if penalized:
        lengths = torch.tensor(history_lengths, dtype=long)
        host["c_history_ids"] = torch.cat(history)
        starts = torch.cumsum(lengths, 0) - lengths
        host["c_history_rows"] = _expand(torch.tensor(penalized, dtype=long), starts, num_history)
        # an entry is an output token when it lies past its row's start plus prompt length
        prompt_ends = _expand(starts + torch.tensor(prompt_lengths, dtype=long), starts, num_history)
        host["c_history_is_output"] = torch.arange(num_history) >= prompt_ends
        for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
            values = [_OFF[name]] * num_rows
            for i, c in controls.items():
                values[i] = getattr(c.params, name)
            host[f"c_{name}"] = torch.tensor(values, dtype=torch.float32)
        if carry_at:
            host["c_history_carry"] = torch.tensor(carry_at, dtype=long)
            host["c_history_carry_rows"] = torch.tensor(carry_rows, dtype=long)
    return host


def _expand(values: torch.Tensor, starts: torch.Tensor, total: int) -> torch.Tensor:
    """``values[k]`` repeated over the run ``starts[k] ..`` of a ``[total]`` tensor (runs
    back to back, none empty): a cumulative sum of the differences placed at the starts,
    several times cheaper on a CPU than ``repeat_interleave``."""
    marks = torch.zeros(total, dtype=values.dtype)
    marks[starts] = torch.diff(values, prepend=values.new_zeros(1))
    return torch.cumsum(marks, 0)


_PLACEHOLDER = torch.zeros(1, dtype=torch.long)

#: The value of each penalty that leaves a row's logits as they are.
_OFF = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


@dataclass(slots=True)
class DecodeChunk:
    """Single-token rows attended in one batch, each over its own keys padded to ``width``."""

    #: ``[n]`` which single-token rows (their order in the step); None: all, in order
    rows: torch.Tensor | None
    #: ``[n * width]`` the slots of each row's keys (its window), padded with the null slot
    slots: torch.Tensor
    #: ``[n, width]`` which slots are real; None when every row has ``width`` keys
    valid: torch.Tensor | None
    width: int


@dataclass(slots=True)
class DecodeKeys:
    """Which keys each single-token row attends over, read in place by the ``cpu`` backend."""

    #: ``[n]`` each row's row of the group's block table; None: the same row (every row is one)
    table_rows: torch.Tensor | None
    #: ``[n]`` the position of each row's first key (its window's first, in a sliding layer)
    first: torch.Tensor
    #: ``[n]`` how many keys each row attends over (this step's one among them)
    count: torch.Tensor


@dataclass(slots=True)
class PrefillKeys:
    """The multi-token rows the ``cpu`` backend attends in place (layers without a sliding
    window): each row's queries attend causally over its keys from position 0."""

    #: ``[n]`` each row's row of the group's block table
    table_rows: torch.Tensor
    #: ``[n]`` the flat index of each row's first token, its position, and its number of tokens
    token: torch.Tensor
    start: torch.Tensor
    length: torch.Tensor


@dataclass(slots=True)
class GroupAttention:
    """Where one cache group's layers write and read in this step."""

    window: int | None
    backend: str
    #: ``[T]`` the cache slot each new token's K/V goes to
    slot_mapping: torch.Tensor
    #: ``[B, max_blocks]`` int32 block ids of each row, padded with the null block
    block_table: torch.Tensor
    #: reference backend: the single-token rows, in batches whose keys are gathered together
    decode_chunks: list[DecodeChunk] = field(default_factory=list)
    #: cpu backend: the single-token rows' keys ...
    decode_keys: DecodeKeys | None = None
    #: ... and those of its multi-token rows it attends in place (in a layer without a
    #: sliding window, rows of at most :data:`_IN_PLACE_MOST_QUERIES` tokens)
    prefill_keys: PrefillKeys | None = None
    #: reference backend: ``[S]`` slots of the blocks every single-token row shares (a
    #: common prefix); then the chunks hold each row's keys after them
    decode_shared_slots: torch.Tensor | None = None
    #: reference and cpu backends: the multi-token rows attended one by one (the cpu backend's
    #: kernel takes the others), as ``(first flat token, number of tokens)``, and per such
    #: row with cached keys the slots to read them from
    #: (sliding layers: its keys before its first new token, read before the step writes;
    #: full layers: those and its new ones, read after), empty for a fresh prompt; and a
    #: ``[q, past + q]`` mask (None for plain causal attention)
    prefill_rows: list[tuple[int, int]] = field(default_factory=list)
    prefill_read_slots: list[torch.Tensor] = field(default_factory=list)
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
    #: ``[T]`` bool: the tokens that take a longrope model's long frequencies whatever
    #: their positions (:attr:`StepBatch.long_rope_rows`'); None when there are none
    long_rope: torch.Tensor | None = None


@dataclass(slots=True)
class StepInputs:
    """The model's inputs for one step, on the device."""

    input_ids: torch.Tensor  # [T]
    position_ids: torch.Tensor  # [T]
    #: [S + D + P] flat index of each sampled row's last token, then of each proposed
    #: token's position (speculating rows), then of each scored prompt position
    logits_indices: torch.Tensor
    attention: AttentionMetadata
    sampling: SamplingTensors
    #: [P] the prompt token each scored position predicts
    prompt_targets: torch.Tensor
    #: per row that scores prompt tokens, how many (in row order)
    prompt_counts: list[int]
    #: async batching: flat indices of tokens still on the device, and which previous sampled row
    #: each takes its token from
    carry_index: torch.Tensor | None = None
    carry_rows: torch.Tensor | None = None


class HostToDevice:
    """Moves a step's host tensors to the device in one copy per carrier dtype (int64 for
    integers and bools, each floating dtype its own).

    On CUDA the tensors are packed into pinned host buffers, two per dtype used in turn
    (the copy of step N may still be reading one while step N+1 fills the other), and
    copied on a side stream that the compute stream then waits for. On CPU it is the
    identity.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self._turn = 0
        self._buffers: dict[tuple[torch.dtype, int], torch.Tensor] = {}
        self._done: list[torch.cuda.Event | None] = [None, None]
        self._stream = torch.cuda.Stream(device) if self._cuda else None  # type: ignore[no-untyped-call]

    def move(self, inputs: _T) -> _T:
        """``inputs`` (dataclasses and lists holding tensors) with every tensor on the device;
        on CPU, ``inputs`` itself."""
        if not self._cuda:
            return inputs
        found: list[torch.Tensor] = []
        _find_tensors(inputs, found)
        moved = self._copy(found)
        return cast(_T, _with_tensors(inputs, iter(moved)))

    def _copy(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The same tensors on the device, in order."""
        turn = self._turn
        self._turn ^= 1
        done = self._done[turn]
        if done is not None:
            done.synchronize()  # the copy that last read this turn's buffers (long finished)
        stream = self._stream
        assert stream is not None
        compute = torch.cuda.current_stream(self.device)
        copies: list[tuple[list[int], torch.Tensor]] = []
        # Integers and bools travel as int64 (exactly), each floating dtype as itself.
        carriers = [t.dtype if t.is_floating_point() else torch.int64 for t in tensors]
        for kind in dict.fromkeys(carriers):
            which = [i for i, carrier in enumerate(carriers) if carrier == kind]
            total = sum(tensors[i].numel() for i in which)
            host = self._host_buffer(kind, turn, total)
            offset = 0
            for i in which:
                flat = tensors[i].reshape(-1)
                host[offset : offset + flat.numel()].copy_(flat)
                offset += flat.numel()
            with torch.cuda.stream(stream):
                device_buffer = host[:total].to(self.device, non_blocking=True)
            device_buffer.record_stream(compute)
            copies.append((which, device_buffer))
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(stream)
        self._done[turn] = event
        # Only now may the compute stream touch the copies: every view and dtype conversion
        # below is queued on it after this wait, never before.
        compute.wait_stream(stream)
        packed: list[torch.Tensor] = list(tensors)
        for which, device_buffer in copies:
            offset = 0
            for i in which:
                source = tensors[i]
                view = device_buffer[offset : offset + source.numel()].view(source.shape)
                packed[i] = view if source.dtype == device_buffer.dtype else view.to(source.dtype)
                offset += source.numel()
        return packed

    def _host_buffer(self, dtype: torch.dtype, turn: int, numel: int) -> torch.Tensor:
        buffer = self._buffers.get((dtype, turn))
        if buffer is None or buffer.numel() < numel:
            size = max(numel, 2 * (0 if buffer is None else buffer.numel()), 4096)
            buffer = torch.empty(size, dtype=dtype, pin_memory=True)
            self._buffers[(dtype, turn)] = buffer
        return buffer


_T = TypeVar("_T")


def _find_tensors(value: object, found: list[torch.Tensor]) -> None:
    """Every tensor of a structure of dataclasses and lists, in a fixed order."""
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, list):
        for item in value:
            _find_tensors(item, found)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            _find_tensors(getattr(value, f.name), found)


def _with_tensors(value: object, moved: Iterator[torch.Tensor]) -> object:
    """The same structure with its tensors replaced, in :func:`_find_tensors`'s order."""
    if isinstance(value, torch.Tensor):
        return next(moved)
    if isinstance(value, list):
        return [_with_tensors(item, moved) for item in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: _with_tensors(getattr(value, f.name), moved) for f in dataclasses.fields(value)}
        return dataclasses.replace(value, **changes)
    return value


def prepare_inputs(
    batch: StepBatch, cache: PagedKVCache, transfer: HostToDevice, backends: Sequence[str], state: InputBatch
) -> StepInputs:
    """Apply a step's changes to the persistent batch ``state`` and flatten the step into
    device tensors; ``backends[g]`` is cache group g's attention.

    Everything is built on the host as the typed structures the model and sampler take
    (:class:`StepInputs`, :class:`AttentionMetadata`, :class:`GroupAttention`,
    :class:`~aiocb.runner.sampler.SamplingTensors`), which ``transfer`` then moves to the
    device in a few packed copies.
    """
    state.apply(batch)
    long = torch.long
    num_rows = batch.num_rows
    slots = _longs(batch.slots)
    q_lens = _longs(batch.num_tokens)
    starts = _longs(batch.starts)
    num_tokens = len(batch.token_ids)
    single = batch.num_single_token_rows == num_rows  # (every row's token is its last)
    if single:
        first_token = torch.arange(num_rows)
        row_of_token = first_token
        positions = starts
    else:
        row_of_token = torch.repeat_interleave(torch.arange(num_rows), q_lens)
        first_token = torch.cumsum(q_lens, 0) - q_lens
        positions = torch.arange(num_tokens) - first_token[row_of_token] + starts[row_of_token]
    last_token = first_token + q_lens - 1
    seq_lens = starts + q_lens
    step = _Step(batch, cache, single, starts, positions, row_of_token, seq_lens)

    sampled = _longs(batch.sampled)
    prompt_counts = [len(targets) for targets in batch.prompt_targets.values()]
    logits_indices = last_token.index_select(0, sampled)
    sample_slots = slots.index_select(0, sampled)
    offsets = _longs(batch.offsets)
    if batch.draft_rows:
        # A speculating row's proposed tokens are sampled at the positions before its last
        # one, each with its own stream offset: after the sampled rows, row by row.
        counts = torch.tensor(batch.draft_counts, dtype=long)
        owner = torch.repeat_interleave(torch.tensor(batch.draft_rows, dtype=long), counts)
        within = torch.arange(int(counts.sum())) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        back = torch.repeat_interleave(counts, counts) - within  # positions before the row's last
        logits_indices = torch.cat((logits_indices, logits_indices[owner] - back))
        sample_slots = torch.cat((sample_slots, sample_slots[owner]))
        offsets = torch.cat((offsets, offsets[owner] - back))
    if batch.prompt_targets:
        scored = torch.tensor(list(batch.prompt_targets), dtype=long)
        counts = torch.tensor(prompt_counts, dtype=long)
        prompt_rows = torch.repeat_interleave(scored, counts)
        within = torch.arange(int(counts.sum())) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        logits_indices = torch.cat((logits_indices, first_token[prompt_rows] + within))
    decode_index = first_token if single else (q_lens == 1).nonzero()[:, 0]
    prefill = [] if single else [i for i, n in enumerate(batch.num_tokens) if n > 1]
    firsts = first_token.tolist() if prefill else []
    # (the cpu backend's kernel takes the rows of a few queries, whose cost is reading their
    # keys; longer ones are compute-bound, where SDPA's blocked matrix products are faster)
    in_place = [i for i in prefill if batch.num_tokens[i] <= _IN_PLACE_MOST_QUERIES]
    apart = [i for i in prefill if batch.num_tokens[i] > _IN_PLACE_MOST_QUERIES] if in_place else prefill

    groups = []
    longest = max(batch.num_tokens)
    for g, window in enumerate(cache.group_windows):
        table, table_lengths = state.table(g, slots)
        backend = backends[g]
        if backend == Backend.TRITON and window is not None and longest > ring_safe_tokens(window, cache.page_size):
            backend = Backend.REFERENCE  # (its long rows overwrite keys their first queries read: read first)
        group = GroupAttention(
            window=window,
            backend=backend,
            slot_mapping=step.write_slots(g, table),
            block_table=table.to(torch.int32),
        )
        if backend == Backend.REFERENCE:
            if batch.num_single_token_rows:
                step.reference_decode(group, g, table, table_lengths, decode_index)
            step.reference_prefill(group, g, table, prefill, firsts)
        elif backend == Backend.CPU:
            if batch.num_single_token_rows:
                group.decode_keys = step.decode_keys(g, decode_index)
            if window is not None or not in_place:
                step.reference_prefill(group, g, table, prefill, firsts)
            else:
                group.prefill_keys = step.prefill_keys(in_place, first_token)
                step.reference_prefill(group, g, table, apart, firsts)
        groups.append(group)
    attention = AttentionMetadata(
        cache=cache,
        groups=groups,
        num_tokens=num_tokens,
        query_start=torch.cat((first_token, torch.tensor([num_tokens]))).to(torch.int32),
        seq_lens=seq_lens.to(torch.int32),
        max_query_len=longest,
        max_seq_len=int(seq_lens.max()),
        decode_token_index=first_token.index_select(0, decode_index) if batch.num_single_token_rows else None,
    )
    if batch.long_rope_rows:
        long_rows = torch.zeros(len(batch.num_tokens), dtype=torch.bool)
        long_rows[_longs(batch.long_rope_rows)] = True
        attention.long_rope = torch.repeat_interleave(long_rows, q_lens, output_size=num_tokens)
    carry_index = carry_rows = None
    if batch.carry_rows:
        carry_index = last_token[_longs(batch.carry_rows)]
        carry_rows = _longs(batch.carry_from)
    inputs = StepInputs(
        input_ids=_longs(batch.token_ids),
        position_ids=positions,
        logits_indices=logits_indices,
        attention=attention,
        sampling=_sampling_tensors(batch, state, sample_slots, offsets),
        prompt_targets=torch.tensor([t for targets in batch.prompt_targets.values() for t in targets], dtype=long),
        prompt_counts=prompt_counts,
        carry_index=carry_index,
        carry_rows=carry_rows,
    )
    return transfer.move(inputs)


def _longs(values: Sequence[int]) -> torch.Tensor:
    """``values`` as a 1-D int64 tensor, through a C array: about 3x cheaper than
    ``torch.tensor`` on a list of Python ints."""
    if not values:
        return torch.empty(0, dtype=torch.long)
    return torch.frombuffer(array.array("q", values), dtype=torch.long)


@dataclass(slots=True)
class _Step:
    """What the per-group builders of :func:`prepare_inputs` share (host tensors)."""

    batch: StepBatch
    cache: PagedKVCache
    single: bool
    starts: torch.Tensor
    positions: torch.Tensor
    row_of_token: torch.Tensor
    seq_lens: torch.Tensor

    def write_slots(self, g: int, table: torch.Tensor) -> torch.Tensor:
        """``[T]`` the cache slot each new token's K/V goes to, in cache group ``g``."""
        cache, page, window = self.cache, self.cache.page_size, self.cache.group_windows[g]
        ring = ring_size(window, page) if window is not None else None
        token_tables = table if self.single else table[self.row_of_token]
        slot_mapping = _slots(token_tables, self.positions, page, ring)
        if window is not None:
            # Sliding layers keep only a chunk's last window-1 positions (later queries see
            # no others; with a window of 1, its last, which its own query reads); earlier
            # ones would land on ring slots that later tokens of the same chunk overwrite.
            seq_lens = self.seq_lens if self.single else self.seq_lens[self.row_of_token]
            written = self.positions >= seq_lens - kept_positions(window)
            slot_mapping = torch.where(written, slot_mapping, cache.trash_block(g) * page)
        return slot_mapping

    def reference_decode(
        self, group: GroupAttention, g: int, table: torch.Tensor, lengths: torch.Tensor, decode_index: torch.Tensor
    ) -> None:
        """The reference backend's single-token rows: batches of gathered keys, and the
        prefix they all share."""
        cache, page, window = self.cache, self.cache.page_size, self.cache.group_windows[g]
        ring = ring_size(window, page) if window is not None else None
        null = cache.null_block(g)
        pos = self.starts.index_select(0, decode_index)
        decode_table = table if self.single else table.index_select(0, decode_index)
        shared = 0
        if window is None:
            shared = _shared_prefix_blocks(decode_table, lengths.index_select(0, decode_index))
        if shared * page < _MIN_SHARED_TOKENS:
            shared = 0
        if shared:
            blocks = decode_table[0, :shared]
            group.decode_shared_slots = (blocks[:, None] * page + torch.arange(page)[None, :]).reshape(-1)
        first_key = _first_keys(pos, window, shared * page)
        key_counts = pos - first_key + 1
        for chunk in _decode_chunks(key_counts, _decode_chunk_slots(cache)):
            n_keys = key_counts if chunk is None else key_counts[chunk]
            chunk_pos = pos if chunk is None else pos[chunk]
            chunk_first = first_key if chunk is None else first_key[chunk]
            chunk_table = decode_table if chunk is None else decode_table[chunk]
            steps = torch.arange(int(n_keys.max()))
            valid = steps[None, :] < n_keys[:, None]
            key_pos = torch.where(valid, chunk_first[:, None] + steps[None, :], chunk_pos[:, None])
            chunk_slots = torch.where(valid, _slots(chunk_table, key_pos, page, ring), null * page).reshape(-1)
            group.decode_chunks.append(
                DecodeChunk(chunk, chunk_slots, None if bool(valid.all()) else valid, len(steps))
            )

    def decode_keys(self, g: int, decode_index: torch.Tensor) -> DecodeKeys:
        """The ``cpu`` backend's single-token rows: the positions of their keys."""
        window = self.cache.group_windows[g]
        pos = self.starts if self.single else self.starts.index_select(0, decode_index)
        first = _first_keys(pos, window, 0)
        return DecodeKeys(None if self.single else decode_index, first, pos - first + 1)

    def prefill_keys(self, prefill: list[int], first_token: torch.Tensor) -> PrefillKeys:
        """The ``cpu`` backend's multi-token rows (``prefill``, their indices) in a full layer."""
        rows = _longs(prefill)
        return PrefillKeys(
            rows,
            first_token.index_select(0, rows),
            self.starts.index_select(0, rows),
            _longs([self.batch.num_tokens[i] for i in prefill]),
        )

    def reference_prefill(
        self, group: GroupAttention, g: int, table: torch.Tensor, prefill: list[int], firsts: list[int]
    ) -> None:
        """Multi-token rows attended one by one (``prefill``, their indices; ``firsts``, every
        row's first flat token): the slots of their cached keys, and masks."""
        page, window = self.cache.page_size, self.cache.group_windows[g]
        ring = ring_size(window, page) if window is not None else None
        for i in prefill:
            start, q_len = self.batch.starts[i], self.batch.num_tokens[i]
            group.prefill_rows.append((firsts[i], q_len))
            lo = max(0, start - (window - 1)) if window is not None else 0
            read = torch.arange(lo, start if window is not None or start == 0 else start + q_len)
            group.prefill_read_slots.append(_slots(table[i : i + 1].expand(len(read), -1), read, page, ring))
            group.prefill_masks.append(_prefill_mask(lo, start, q_len, window))


def _sampling_tensors(
    batch: StepBatch, state: InputBatch, slots: torch.Tensor, offsets: torch.Tensor
) -> SamplingTensors:
    """The sampled positions' parameters (their slots are ``slots``, their stream offsets
    ``offsets``) gathered from ``state`` (a greedy row's temperature and min-p are 0 there),
    their controls and grammar masks, and the batch-wide flags read from them on the host."""
    gathered = state.sampling_params(slots)
    controls = controls_host_tensors(batch.controls, len(slots))
    return SamplingTensors(
        temperature=gathered.temperature,
        top_k=gathered.top_k,
        top_p=gathered.top_p,
        seed=gathered.seed,
        offset=offsets,
        all_greedy=gathered.all_greedy,
        any_greedy=gathered.any_greedy,
        any_top_k=gathered.any_top_k,
        any_top_p=gathered.any_top_p,
        any_logprobs=gathered.any_logprobs,
        max_top_logprobs=gathered.max_top_logprobs,
        max_top_k=gathered.max_top_k,
        min_p=gathered.min_p,
        rare=gathered.rare,
        processed_logprobs=gathered.processed_logprobs,
        controls=controls_from_tensors(controls),
        history_carry=controls.get("c_history_carry"),
        history_carry_rows=controls.get("c_history_carry_rows"),
        bitmask=batch.bitmask,
        bitmask_rows=None if batch.bitmask is None else torch.tensor(batch.bitmask_rows, dtype=torch.long),
    )


#: The cpu backend's kernel attends multi-token rows of at most this many tokens in place (a
#: speculating row's proposals, a short prompt): one tile of queries, whose cost is reading
#: the row's keys. A longer row is compute-bound, and SDPA's blocked matrix products were
#: faster there (2.4x for 16 rows of 100..1,000 tokens with 16 heads of 128, one layer on
#: the development machine), while for 1,024 rows of 16 tokens one kernel call took 1.8 ms
#: against 31 ms for a call of SDPA per row.
_IN_PLACE_MOST_QUERIES = 32


#: Single-token rows attend to a prefix they all share in one matrix product (the keys read
#: once) when it holds at least this many blocks' worth of tokens.
_MIN_SHARED_TOKENS = 256


#: On CPU, single-token rows are attended in batches whose gathered keys and values take
#: about this many bytes: such a batch is read back from the processor's cache, where one
#: batch of every row would go out to main memory (measured about 1.5x faster in a step's
#: attention on the development machine).
_CPU_DECODE_CHUNK_BYTES = 4 << 20
#: Elsewhere (a GPU) the batches are as large as this bound lets them be: their gathered
#: keys and values are memory the cache plan does not reserve (a window of 4,096 over 1,024
#: rows of a Mistral-7B layer would gather 16 GiB at once).
_DEVICE_DECODE_CHUNK_BYTES = 256 << 20


def _decode_chunk_slots(cache: PagedKVCache) -> int:
    """How many key slots (padding included) one batch of single-token rows may gather."""
    budget = _CPU_DECODE_CHUNK_BYTES if cache.device.type == "cpu" else _DEVICE_DECODE_CHUNK_BYTES
    return max(1, budget // (2 * cache.slot_nbytes))


def _decode_chunks(lengths: torch.Tensor, max_slots: int) -> list[torch.Tensor | None]:
    """Split single-token rows with ``lengths`` keys into batches of at most ``max_slots``
    gathered keys: rows by increasing length (so each batch pads little), as many as fit.

    Returns each batch's row indices, or ``[None]``: every row in one batch, in order.
    """
    if int(lengths.max()) * len(lengths) <= max_slots:
        return [None]
    sizes, order = torch.sort(lengths, stable=True)
    count = len(sizes)
    chunks: list[torch.Tensor | None] = []
    first = 0
    while first < count:
        # rows first .. i fit while (i + 1 - first) * sizes[i] (increasing in i) stays in budget
        padded = (torch.arange(1, count - first + 1) * sizes[first:]).tolist()
        fit = max(1, _count_at_most(padded, max_slots))
        chunks.append(order[first : first + fit])
        first += fit
    return chunks if len(chunks) > 1 else [None]


def _count_at_most(increasing: list[int], bound: int) -> int:
    """How many leading values of a non-decreasing list are at most ``bound``."""
    return bisect.bisect_right(increasing, bound)


def _shared_prefix_blocks(tables: torch.Tensor, lengths: torch.Tensor) -> int:
    """How many leading blocks every row of ``tables`` (``[rows, width]``, ``lengths``
    real entries each) holds in common (0 if not worth sharing).

    Prefix caching maps a common prompt prefix to the same physical blocks, so decode rows
    behind one system prompt share their first blocks; the last block of a row is never
    counted (it is still being written).
    """
    if tables.shape[0] < 2:
        return 0
    most = int(lengths.min()) - 1
    if most <= 0:
        return 0
    same = (tables[:, :most] == tables[:1, :most]).all(0)
    return int(same.to(torch.long).cumprod(0).sum())


def _first_keys(positions: torch.Tensor, window: int | None, floor: int) -> torch.Tensor:
    """The first key position single-token rows at ``positions`` attend to: their window's
    first in a sliding layer, else ``floor`` (after any prefix read apart)."""
    if window is None:
        return torch.full_like(positions, floor)
    return (positions - window + 1).clamp_min(0)


def _slots(table: torch.Tensor, positions: torch.Tensor, page: int, ring: int | None) -> torch.Tensor:
    """Cache slots of ``positions``; ``table`` holds the block-table row of each position
    (``[N, max_blocks]`` for 1-D positions of length N) or of each row of 2-D positions."""
    column = positions // page
    if ring is not None:
        column = column % ring
    blocks = table.gather(1, column[:, None])[:, 0] if positions.dim() == 1 else table.gather(1, column)
    return blocks * page + positions % page


def _prefill_mask(lo: int, start: int, q_len: int, window: int | None) -> torch.Tensor | None:
    """Which keys (positions ``lo .. start + q_len - 1``) each new query may see."""
    if lo == start and (window is None or q_len <= window):
        return None  # plain causal attention over the new tokens
    key_pos = torch.arange(lo, start + q_len)
    query_pos = torch.arange(start, start + q_len)
    mask = key_pos[None, :] <= query_pos[:, None]
    if window is not None:
        mask &= key_pos[None, :] > query_pos[:, None] - window
    return mask
