"""A scheduled step as flat tensors: no padding between requests.

The loop thread takes a :class:`StepBatch` snapshot of the plan (plain values, so the
scheduler may move on while the device works); :func:`prepare_inputs` turns it into the
tensors of one forward pass: token ids and positions of every scheduled token back to
back, cache slots to write, per-request KV slots or block tables to read, and the rows
whose logits are sampled. Tensors are built on the host and moved to the device in one
copy per dtype through :class:`HostToDevice` (pinned, double-buffered, on a side stream).
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from aiocb.core.kv_cache import ring_size
from aiocb.core.params import ResolvedParams
from aiocb.core.request import Request
from aiocb.core.scheduler import SchedulerOutput, wants_prompt_logprobs
from aiocb.runner.backends import Backend
from aiocb.runner.logits_controls import matched_sequence_bias
from aiocb.runner.paged_cache import PagedKVCache
from aiocb.runner.sampler import SamplingTensors


@dataclass(slots=True)
class RowControls:
    """A sampled row's logits controls for one step (rows that use none have no such object)."""

    params: ResolvedParams
    #: prompt and output tokens (penalizing rows only), of which the first ``history_length``
    #: are known to this step ...
    history: array.array[int] | None
    history_length: int
    num_prompt_tokens: int
    #: ... and whether the row's last token, still being sampled, follows them
    carries: bool
    #: ``(token, bias)`` added this step besides the request's own (matched sequence biases)
    biases: list[tuple[int, float]] | None
    #: tokens banned this step besides the request's own (bad words, min_tokens, first token)
    bans: list[int] | None


@dataclass(slots=True)  # (not frozen: a frozen __init__ costs several times more per row)
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
    min_p: float = 0.0
    seed: int = 0
    #: how many tokens the request generated before this step (its random stream offset)
    offset: int = 0
    controls: RowControls | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    #: with prompt logprobs: the prompt tokens that this step's positions predict
    prompt_targets: tuple[int, ...] = ()
    #: async batching: the row, among the previous step's sampled rows, whose token is
    #: this row's last input (still on the device when this step was planned); -1 if none
    carry_row: int = -1


@dataclass(frozen=True, slots=True)
class StepBatch:
    """An immutable snapshot of one step's plan."""

    token_ids: list[int]
    rows: list[RowSpec]
    #: per cache group, block copies to make before the step (CPU offloading)
    swap_out: list[list[tuple[int, int]]] = field(default_factory=list)
    swap_in: list[list[tuple[int, int]]] = field(default_factory=list)
    #: per cache group, ``(source, destination)`` block copies within the cache (forks)
    copy_blocks: list[list[tuple[int, int]]] = field(default_factory=list)

    @property
    def num_sampled(self) -> int:
        """Rows whose next token is sampled."""
        return sum(1 for r in self.rows if r.sample)


def snapshot(output: SchedulerOutput, previous: SchedulerOutput | None = None) -> StepBatch:
    """Copy what the device needs out of the scheduler's live state.

    ``previous`` is the step still in flight (async batching): a row whose last token it
    has yet to sample takes that token from its output on the device.
    """
    carry_rows: dict[int, int] = {}
    if previous is not None:
        sampled = (item.request for item in previous.scheduled if item.sample)
        carry_rows = {id(request): row for row, request in enumerate(sampled)}
    token_ids: list[int] = []
    rows: list[RowSpec] = []
    for item in output.scheduled:
        request = item.request
        params = request.params
        known = request.token_ids[item.start : item.start + item.num_tokens]
        carry_row = -1
        if item.carries:
            carry_row = carry_rows[id(request)]
            known.append(0)  # replaced on the device by the previous step's sample
        token_ids.extend(known)
        targets: tuple[int, ...] = ()
        if wants_prompt_logprobs(request, item.start):
            last = min(item.start + item.num_tokens, request.num_prompt_tokens - 1)
            targets = tuple(request.token_ids[item.start + 1 : last + 1])
        offset = request.num_output_tokens + request.num_pending_tokens - (1 if item.sample else 0)
        rows.append(
            RowSpec(
                start=item.start,
                num_tokens=item.num_tokens,
                block_ids=tuple(tuple(blocks) for blocks in request.block_ids),
                sample=item.sample,
                temperature=params.temperature,
                top_k=params.top_k,
                top_p=params.top_p,
                min_p=params.min_p,
                seed=params.seed,
                offset=offset,
                controls=row_controls(request, offset, item.carries) if item.sample and params.uses_controls else None,
                logprobs=params.return_logprobs,
                top_logprobs=params.top_logprobs,
                prompt_targets=targets,
                carry_row=carry_row,
            )
        )
    return StepBatch(
        token_ids,
        rows,
        [list(pairs) for pairs in output.swap_out],
        [list(pairs) for pairs in output.swap_in],
        [list(pairs) for pairs in output.copy_blocks],
    )


def row_controls(request: Request, offset: int, carries: bool) -> RowControls:
    """What a request's controls do at the step sampling its ``offset``-th output token
    (counted from 0); ``carries``: its last token is still being sampled by the step before."""
    params = request.params
    penalizes = params.penalizes
    biases: list[tuple[int, float]] | None = None
    bans: list[int] | None = None
    if params.sequence_biases or params.bad_sequences:
        # (the scheduler plans no step for such a request while its last token is in flight)
        known = request.token_ids
        biases = matched_sequence_bias(known, params.sequence_biases)
        bans = [token for token, _ in matched_sequence_bias(known, params.bad_sequences)]
    if offset < params.min_tokens:
        bans = [*(bans or ()), *params.stop_token_ids]
    if offset == 0 and params.begin_bans:
        bans = [*(bans or ()), *params.begin_bans]
    return RowControls(
        params,
        token_history(request) if penalizes else None,
        request.num_tokens,
        request.num_prompt_tokens,
        carries and penalizes,
        biases,
        bans,
    )


def token_history(request: Request) -> array.array[int]:
    """The request's prompt and generated tokens so far, in an ``array`` kept up to date a
    few tokens at a time (the step's snapshot costs the new tokens, not the history).

    The loop thread only appends to it; the step's worker copies the first ``n`` entries
    (one C call, atomic under the GIL), so it never sees a token beyond the snapshot's.
    """
    history = request.runner_state
    if not isinstance(history, array.array):
        history = request.runner_state = array.array("q")
    if len(history) < len(request.token_ids):
        history.extend(request.token_ids[len(history) :])
    return history


def controls_host_tensors(rows: Sequence[RowSpec]) -> dict[str, torch.Tensor]:
    """The sampled rows' controls as flat host tensors (none when no row uses one).

    Names start with ``c_``; :func:`~aiocb.runner.sampler.SamplingTensors.from_device`
    turns them into a :class:`~aiocb.runner.logits_controls.LogitsControls`. A history
    entry whose token is still being sampled by the previous step is a placeholder:
    ``c_history_carry`` says where, ``c_history_carry_rows`` from which previous row.
    """
    host: dict[str, torch.Tensor] = {}
    with_controls = [(i, r.controls) for i, r in enumerate(rows) if r.controls is not None]
    if not with_controls:
        return host
    long = torch.long
    bias_rows: list[int] = []
    bias_ids: list[int] = []
    bias_values: list[float] = []
    ban_rows: list[int] = []
    ban_ids: list[int] = []
    allow_rows: list[int] = []
    allow_ids: list[int] = []
    history: list[torch.Tensor] = []
    history_lengths: list[int] = []
    num_history = 0
    prompt_lengths: list[int] = []
    penalized: list[int] = []
    carry_at: list[int] = []
    carry_rows: list[int] = []
    restrict = [False] * len(rows)
    for i, c in with_controls:
        params = c.params
        for biases in (params.biases, c.biases or ()):
            for token, bias in biases:
                bias_rows.append(i)
                bias_ids.append(token)
                bias_values.append(bias)
        for bans in (params.bans, c.bans or ()):
            ban_rows += [i] * len(bans)
            ban_ids += bans
        allowed = params.allowed_token_ids
        if allowed is not None:
            restrict[i] = True
            allow_rows += [i] * len(allowed)
            allow_ids += allowed
        if c.history is not None:
            penalized.append(i)
            length = c.history_length
            history.append(torch.frombuffer(c.history[:length], dtype=torch.long))
            if c.carries:
                carry_at.append(num_history + length)
                carry_rows.append(rows[i].carry_row)
                history.append(_PLACEHOLDER)  # replaced on the device by the previous step's sample
            history_lengths.append(length + c.carries)
            num_history += length + c.carries
            prompt_lengths.append(c.num_prompt_tokens)
    if bias_rows:
        host["c_bias_rows"] = torch.tensor(bias_rows, dtype=long)
        host["c_bias_ids"] = torch.tensor(bias_ids, dtype=long)
        host["c_bias_values"] = torch.tensor(bias_values, dtype=torch.float32)
    if ban_rows:
        host["c_ban_rows"] = torch.tensor(ban_rows, dtype=long)
        host["c_ban_ids"] = torch.tensor(ban_ids, dtype=long)
    if allow_rows:
        host["c_restrict_rows"] = torch.tensor(restrict, dtype=torch.bool)
        host["c_allow_rows"] = torch.tensor(allow_rows, dtype=long)
        host["c_allow_ids"] = torch.tensor(allow_ids, dtype=long)
    if penalized:
        lengths = torch.tensor(history_lengths, dtype=long)
        host["c_history_ids"] = torch.cat(history)
        starts = torch.cumsum(lengths, 0) - lengths
        host["c_history_rows"] = _expand(torch.tensor(penalized, dtype=long), starts, num_history)
        # an entry is an output token when it lies past its row's start plus prompt length
        prompt_ends = _expand(starts + torch.tensor(prompt_lengths, dtype=long), starts, num_history)
        host["c_history_is_output"] = torch.arange(num_history) >= prompt_ends
        for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
            host[f"c_{name}"] = torch.tensor(
                [getattr(r.controls.params, name) if r.controls is not None else _OFF[name] for r in rows],
                dtype=torch.float32,
            )
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
    #: reference backend: ``[S]`` slots of the blocks every single-token row shares (a
    #: common prefix); then the chunks hold each row's keys after them
    decode_shared_slots: torch.Tensor | None = None
    #: reference backend, per multi-token row with cached keys: the slots to read them from
    #: (sliding layers: its keys before its first new token, read before the step writes;
    #: full layers: those and its new ones, read after), empty for a fresh prompt; and a
    #: ``[q, past + q]`` mask (None for plain causal attention)
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
    #: per multi-token row, ``(first flat token, number of tokens)``
    prefill_rows: list[tuple[int, int]]


@dataclass(slots=True)
class StepInputs:
    """The model's inputs for one step, on the device."""

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
    #: async batching: flat indices of tokens still on the device, and which previous sampled row
    #: each takes its token from
    carry_index: torch.Tensor | None = None
    carry_rows: torch.Tensor | None = None


class HostToDevice:
    """Moves a step's host tensors to the device in one copy per dtype.

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

    def __call__(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The same tensors on the device, by name."""
        if not self._cuda:
            return tensors
        turn = self._turn
        self._turn ^= 1
        done = self._done[turn]
        if done is not None:
            done.synchronize()  # the copy that last read this turn's buffers (long finished)
        stream = self._stream
        assert stream is not None
        compute = torch.cuda.current_stream(self.device)
        copies: list[tuple[list[str], torch.Tensor]] = []
        for kind in (torch.int64, torch.float32):
            names = [n for n, t in tensors.items() if (t.dtype == torch.float32) == (kind == torch.float32)]
            if not names:
                continue
            total = sum(tensors[n].numel() for n in names)
            host = self._host_buffer(kind, turn, total)
            offset = 0
            for name in names:
                flat = tensors[name].reshape(-1)
                host[offset : offset + flat.numel()].copy_(flat)
                offset += flat.numel()
            with torch.cuda.stream(stream):
                device_buffer = host[:total].to(self.device, non_blocking=True)
            device_buffer.record_stream(compute)
            copies.append((names, device_buffer))
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(stream)
        self._done[turn] = event
        # Only now may the compute stream touch the copies: every view and dtype conversion
        # below is queued on it after this wait, never before.
        compute.wait_stream(stream)
        packed: dict[str, torch.Tensor] = {}
        for names, device_buffer in copies:
            offset = 0
            for name in names:
                source = tensors[name]
                view = device_buffer[offset : offset + source.numel()].view(source.shape)
                packed[name] = view if source.dtype == device_buffer.dtype else view.to(source.dtype)
                offset += source.numel()
        return packed

    def _host_buffer(self, dtype: torch.dtype, turn: int, numel: int) -> torch.Tensor:
        buffer = self._buffers.get((dtype, turn))
        if buffer is None or buffer.numel() < numel:
            size = max(numel, 2 * (0 if buffer is None else buffer.numel()), 4096)
            buffer = torch.empty(size, dtype=dtype, pin_memory=True)
            self._buffers[(dtype, turn)] = buffer
        return buffer


def prepare_inputs(
    batch: StepBatch, cache: PagedKVCache, transfer: HostToDevice, backends: Sequence[str]
) -> StepInputs:
    """Flatten a step into device tensors; ``backends[g]`` is cache group g's attention."""
    rows = batch.rows
    page = cache.page_size
    long = torch.long
    host: dict[str, torch.Tensor] = {}
    q_lens = torch.tensor([r.num_tokens for r in rows], dtype=long)
    starts = torch.tensor([r.start for r in rows], dtype=long)
    num_tokens = len(batch.token_ids)
    row_of_token = torch.repeat_interleave(torch.arange(len(rows)), q_lens)
    first_token = torch.cumsum(q_lens, 0) - q_lens
    positions = torch.arange(num_tokens) - first_token[row_of_token] + starts[row_of_token]
    host["input_ids"] = torch.tensor(batch.token_ids, dtype=long)
    host["positions"] = positions

    sampled = [i for i, r in enumerate(rows) if r.sample]
    scored = [i for i, r in enumerate(rows) if r.prompt_targets]
    prompt_counts = [len(rows[i].prompt_targets) for i in scored]
    prompt_indices = [int(first_token[i]) + j for i, n in zip(scored, prompt_counts, strict=True) for j in range(n)]
    host["logits_indices"] = torch.cat(((first_token + q_lens - 1)[sampled], torch.tensor(prompt_indices, dtype=long)))
    host["prompt_targets"] = torch.tensor([t for i in scored for t in rows[i].prompt_targets], dtype=long)
    seq_lens = starts + q_lens
    host["query_start"] = torch.cat((first_token, torch.tensor([num_tokens])))
    host["seq_lens"] = seq_lens
    carried = [i for i, r in enumerate(rows) if r.carry_row >= 0]
    if carried:
        host["carry_index"] = (first_token + q_lens - 1)[carried]
        host["carry_rows"] = torch.tensor([rows[i].carry_row for i in carried], dtype=long)

    decode = [i for i, r in enumerate(rows) if r.num_tokens == 1]
    prefill = [i for i, r in enumerate(rows) if r.num_tokens > 1]
    decode_index = torch.tensor(decode, dtype=long)
    if decode:
        host["decode_token_index"] = first_token[decode_index]

    masks: dict[str, torch.Tensor | None] = {}
    chunk_widths: list[list[int]] = [[] for _ in cache.group_windows]
    for g, window in enumerate(cache.group_windows):
        ring = ring_size(window, page) if window is not None else None
        null = cache.null_block(g)
        table = _block_table(rows, g, null)
        slots = _slots(table[row_of_token], positions, page, ring)
        if window is not None:
            # Sliding layers keep only a chunk's last window-1 positions; earlier ones
            # would land on ring slots that later tokens of the same chunk overwrite.
            written = positions >= seq_lens[row_of_token] - (window - 1)
            slots = torch.where(written, slots, cache.trash_block(g) * page)
        host[f"slots{g}"] = slots
        host[f"table{g}"] = table
        if backends[g] != Backend.REFERENCE:
            continue
        if decode:
            pos = starts[decode_index]
            shared = _shared_prefix_blocks([rows[i].block_ids[g] for i in decode]) if window is None else 0
            if shared * page < _MIN_SHARED_TOKENS:
                shared = 0
            if shared:
                blocks = torch.tensor(rows[decode[0]].block_ids[g][:shared], dtype=long)
                host[f"decode_shared{g}"] = (blocks[:, None] * page + torch.arange(page)[None, :]).reshape(-1)
            first_key = (pos - window + 1).clamp_min(0) if window is not None else torch.full_like(pos, shared * page)
            lengths = pos - first_key + 1
            for c, chunk in enumerate(_decode_chunks(lengths, _decode_chunk_slots(cache))):
                which = slice(None) if chunk is None else chunk
                n_keys, chunk_pos = lengths[which], pos[which]
                steps = torch.arange(int(n_keys.max()))
                valid = steps[None, :] < n_keys[:, None]
                key_pos = torch.where(valid, first_key[which][:, None] + steps[None, :], chunk_pos[:, None])
                chunk_slots = _slots(table[decode_index[which]], key_pos, page, ring)
                host[f"dslots{g}_{c}"] = torch.where(valid, chunk_slots, null * page).reshape(-1)
                if not bool(valid.all()):
                    host[f"dvalid{g}_{c}"] = valid
                if chunk is not None:
                    host[f"drows{g}_{c}"] = chunk
                chunk_widths[g].append(len(steps))
        for i in prefill:
            start, q_len = rows[i].start, rows[i].num_tokens
            lo = max(0, start - (window - 1)) if window is not None else 0
            read = torch.arange(lo, start if window is not None or start == 0 else start + q_len)
            host[f"read{g}_{i}"] = _slots(table[i : i + 1].expand(len(read), -1), read, page, ring)
            mask = _prefill_mask(lo, start, q_len, window)
            if mask is not None:
                host[f"mask{g}_{i}"] = mask
            masks[f"mask{g}_{i}"] = mask

    sampled_rows = [rows[i] for i in sampled]
    host.update(SamplingTensors.host_tensors(sampled_rows))
    host.update(controls_host_tensors(sampled_rows))
    dev = transfer(host)

    groups: list[GroupAttention] = []
    for g, window in enumerate(cache.group_windows):
        group = GroupAttention(
            window=window,
            backend=backends[g],
            slot_mapping=dev[f"slots{g}"],
            block_table=dev[f"table{g}"].to(torch.int32),
        )
        if backends[g] == Backend.REFERENCE:
            group.decode_chunks = [
                DecodeChunk(dev.get(f"drows{g}_{c}"), dev[f"dslots{g}_{c}"], dev.get(f"dvalid{g}_{c}"), width)
                for c, width in enumerate(chunk_widths[g])
            ]
            group.decode_shared_slots = dev.get(f"decode_shared{g}")
            group.prefill_read_slots = [dev[f"read{g}_{i}"] for i in prefill]
            group.prefill_masks = [dev[k] if masks[k] is not None else None for k in (f"mask{g}_{i}" for i in prefill)]
        groups.append(group)
    attention = AttentionMetadata(
        cache=cache,
        groups=groups,
        num_tokens=num_tokens,
        query_start=dev["query_start"].to(torch.int32),
        seq_lens=dev["seq_lens"].to(torch.int32),
        max_query_len=int(q_lens.max()),
        max_seq_len=int(seq_lens.max()),
        decode_token_index=dev.get("decode_token_index"),
        prefill_rows=[(int(first_token[i]), rows[i].num_tokens) for i in prefill],
    )
    return StepInputs(
        input_ids=dev["input_ids"],
        position_ids=dev["positions"],
        logits_indices=dev["logits_indices"],
        attention=attention,
        sampling=SamplingTensors.from_device(dev, sampled_rows),
        prompt_targets=dev["prompt_targets"],
        prompt_counts=prompt_counts,
        carry_index=dev.get("carry_index"),
        carry_rows=dev.get("carry_rows"),
    )


#: Single-token rows attend to a prefix they all share in one matrix product (the keys read
#: once) when it holds at least this many blocks' worth of tokens.
_MIN_SHARED_TOKENS = 256


#: On CPU, single-token rows are attended in batches whose gathered keys and values take
#: about this many bytes: such a batch is read back from the processor's cache, where one
#: batch of every row would go out to main memory (measured about 1.5x faster in a step's
#: attention on the development machine). On GPUs one batch of every row is best.
_CPU_DECODE_CHUNK_BYTES = 4 << 20


def _decode_chunk_slots(cache: PagedKVCache) -> int | None:
    """How many key slots (padding included) one batch of single-token rows may gather."""
    if cache.device.type != "cpu":
        return None
    return max(1, _CPU_DECODE_CHUNK_BYTES // (2 * cache.slot_nbytes))


def _decode_chunks(lengths: torch.Tensor, max_slots: int | None) -> list[torch.Tensor | None]:
    """Split single-token rows with ``lengths`` keys into batches of at most ``max_slots``
    gathered keys: rows by increasing length (so each batch pads little), as many as fit.

    Returns each batch's row indices, or ``[None]``: every row in one batch, in order.
    """
    if max_slots is None:
        return [None]
    sizes = lengths.tolist()
    order = sorted(range(len(sizes)), key=sizes.__getitem__)
    chunks: list[torch.Tensor | None] = []
    first = 0
    for i in range(1, len(order) + 1):
        # rows first .. i-1 fit; with row i (the longest yet) each would pad to its length
        if i == len(order) or (i + 1 - first) * sizes[order[i]] > max_slots:
            chunks.append(torch.tensor(order[first:i], dtype=torch.long))
            first = i
    return chunks if len(chunks) > 1 else [None]


def _shared_prefix_blocks(tables: list[tuple[int, ...]]) -> int:
    """How many leading blocks every table holds in common (0 if not worth sharing).

    Prefix caching maps a common prompt prefix to the same physical blocks, so decode rows
    behind one system prompt share their first blocks; the last block of a row is never
    counted (it is still being written).
    """
    if len(tables) < 2:
        return 0
    shared = min(len(t) for t in tables) - 1
    first = tables[0]
    for table in tables[1:]:
        common = 0
        while common < shared and table[common] == first[common]:
            common += 1
        shared = common
        if not shared:
            return 0
    return shared


def _block_table(rows: list[RowSpec], group: int, null: int) -> torch.Tensor:
    width = max(1, max(len(r.block_ids[group]) for r in rows))
    return torch.tensor(
        [list(r.block_ids[group]) + [null] * (width - len(r.block_ids[group])) for r in rows],
        dtype=torch.long,
    )


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
