"""CUDA graphs of decode steps, one per padded batch size, and of the steps that verify
speculative proposals.

A decode step's shapes depend only on its number of rows, so graphs are keyed by a
batch-size bucket: the step is padded up to the next bucket, with padding rows that
write to the cache's trash block and read its zero block, so padding never touches a
request's KV. All graphs share one memory pool and read static input buffers, which each
replay fills from the step's inputs with a few device copies (no host sync).

With speculative decoding, a step whose rows each bring their last token and up to ``k``
proposed ones (every row sampled, no prompt scored) replays a graph too, keyed by its row
bucket and a query width ``q`` (1 + 1, 2, 4, ... proposed tokens, and 1 + ``k``) at
least its longest row: the graph holds ``bucket x q`` token slots and a grid for rows of
``q`` tokens. The step's tokens keep their places; the slots after them are padding
tokens that belong to no row (written to the trash block, their outputs never read), and
rows past the step's have no token. Without these graphs a step that verifies proposals
ran eagerly, and on the H200 the eager passes of a small model are launch-bound: prompt
lookup at 0.6 acceptance ran at 0.42x no speculation (``bench/RESULTS.md``, 2026-12-04).

Every bucket is captured at once, largest first, on the step thread before the first
step (``ModelRunner.warm_up``): steps only replay, so no capture lands in the middle of
serving. Under tensor parallelism the warm-up passes run collectives, so every rank
captures at the first decode step instead (all ranks run it): the same buckets in the
same order at the same step, and the collectives pair up.
"""

from __future__ import annotations

import bisect
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from aiocb.runner.inputs import AttentionMetadata, GroupAttention, StepInputs
from aiocb.runner.paged_cache import PagedKVCache
from aiocb.runner.step_batch import StepBatch

logger = logging.getLogger(__name__)

#: ``forward(input_ids [1, T], position_ids [1, T], logits_indices [S], metadata) -> logits [S, V]``
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def query_widths(num_speculative_tokens: int) -> list[int]:
    """Query tokens per row of the graphs of steps that verify proposals of at most
    ``num_speculative_tokens`` tokens: the row's last token and 1, 2, 4, ... proposed ones,
    and the most, so a row is padded by less than its own length."""
    widths = {1 + num_speculative_tokens}
    proposed = 1
    while proposed < num_speculative_tokens:
        widths.add(1 + proposed)
        proposed *= 2
    return sorted(widths)


def batch_buckets(max_rows: int) -> list[int]:
    """Padded batch sizes: powers of two up to 16, then growing by 1.5x and 4/3 in turn, so a
    step of more than 16 rows is padded by at most half its size."""
    sizes = [1, 2, 4, 8, 16]
    while sizes[-1] < max_rows:
        last = sizes[-1]
        sizes.append(last * 3 // 2 if last & (last - 1) == 0 else (last // 3) * 4)
    return sorted({min(s, max_rows) for s in sizes})


#: One stream per device for every warm-up and capture in the process. cuBLAS keeps a
#: workspace (32 MiB on Hopper) for each stream it has run on until the process ends: a new
#: stream per bucket left 17 of them (544 MiB) behind each destroyed manager on the H200.
_CAPTURE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The process's stream for decode-graph warm-ups and captures on ``device``."""
    if device.index is None:  # ("cuda" and "cuda:0" are one device, and one stream)
        device = torch.device(device.type, torch.cuda.current_device())
    if device not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    return _CAPTURE_STREAMS[device]


class DecodeGraphs:
    """Captures and replays the forward pass of decode steps (and, given ``widths``, of
    steps that verify proposals: see the module's docstring)."""

    def __init__(
        self,
        forward: Forward,
        cache: PagedKVCache,
        backends: list[str],
        max_rows: int,
        max_blocks_per_request: int,
        device: torch.device,
        *,
        widths: Sequence[int] = (),
        max_wide_rows: int = 0,
        logits_per_row: bool = False,
    ) -> None:
        self._forward = forward
        self._cache = cache
        self._backends = backends
        self.buckets = batch_buckets(max_rows)
        #: query widths (above one token a row) of the graphs of steps that verify proposals,
        #: and their row buckets (none: such steps run without a graph)
        self.widths = sorted(w for w in widths if w > 1) if max_wide_rows else []
        self.wide_buckets = batch_buckets(max_wide_rows) if self.widths else []
        #: every graph's ``(row bucket, query width)``, in capture order: the most token
        #: slots first, so smaller graphs reuse its memory (the order depends on the buckets
        #: alone, so ranks that agree on the cache plan capture in the same order)
        self.keys = sorted(
            [(b, 1) for b in self.buckets] + [(b, w) for w in self.widths for b in self.wide_buckets],
            key=lambda key: (key[0] * key[1], key[0]),
            reverse=True,
        )
        self.max_blocks = max_blocks_per_request
        #: whether a wide graph keeps the logits of one token a row at most (the draft's pass
        #: over a verifying step wants each speculating row's first proposal's) rather than
        #: of every token (the target's verification)
        self._logits_per_row = logits_per_row
        self._device = device
        self._pool: Any = None  # torch.cuda.graph_pool_handle()
        self._logits_out: torch.Tensor | None = None
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        #: graphs captured over this object's life (a graph captured again counts again)
        self.captures = 0
        #: replays of graphs of steps that verify proposals
        self.wide_replays = 0
        #: wall seconds the last :meth:`capture_all` took (None: nothing captured yet)
        self.capture_seconds: float | None = None
        rows = max(self.buckets[-1], self.wide_buckets[-1] if self.wide_buckets else 0)
        tokens = max(bucket * width for bucket, width in self.keys)
        groups = len(cache.group_windows)
        long, int32 = torch.long, torch.int32
        # Inference tensors, as the eager steps' inputs are (every step runs in inference
        # mode): a compiled decode model guards on the kind, and would compile again for
        # the graphs' inputs were they of the other. (So the methods that write them run in
        # inference mode whoever calls them.)
        with torch.inference_mode():
            self._input_ids = torch.zeros(tokens, dtype=long, device=device)
            self._positions = torch.zeros(tokens, dtype=long, device=device)
            self._slots = [torch.zeros(tokens, dtype=long, device=device) for _ in range(groups)]
            self._tables = [
                torch.zeros(rows, max_blocks_per_request, dtype=int32, device=device) for _ in range(groups)
            ]
            self._query_start = torch.arange(rows + 1, dtype=int32, device=device)
            self._seq_lens = torch.ones(rows, dtype=int32, device=device)
            #: a decode graph's rows each keep their one token's logits; a wide graph's keep
            #: the ones its step asks for (every replay writes them)
            self._decode_logits = torch.arange(rows, dtype=long, device=device)
            self._logits_indices = torch.zeros(tokens, dtype=long, device=device)
            self._pad_rows = torch.arange(rows + 1, dtype=int32, device=device)

    def eligible(self, batch: StepBatch, inputs: StepInputs) -> bool:
        """Whether the step (with its inputs made) is a decode step a graph can run."""
        return (
            batch.is_decode
            and batch.num_rows <= self.buckets[-1]
            and all(group.block_table.shape[1] <= self.max_blocks for group in inputs.attention.groups)
            and self._backends_kept(inputs)
        )

    def _backends_kept(self, inputs: StepInputs) -> bool:
        """Whether the step's groups attend through the backends the graphs were captured
        with (a step whose rows are too long for a sliding group's ring reads it otherwise)."""
        # (a draft model's graphs run over the target's inputs: the groups its own cache has)
        groups = inputs.attention.groups[: len(self._slots)]
        return all(group.backend == backend for group, backend in zip(groups, self._backends, strict=False))

    def width_for(self, batch: StepBatch, inputs: StepInputs) -> int:
        """The query width of the graph that runs a step verifying proposals (every row its
        last token and the proposed ones, every row sampled, no prompt scored), 0 when
        none can: the step is not one, or it has too many rows, or its rows reach past the
        graphs' block tables (the padding tokens after the step's own belong to no row:
        they read nothing)."""
        if not self.widths or batch.num_rows > self.wide_buckets[-1]:
            return 0
        metadata = inputs.attention
        longest = metadata.max_query_len
        if longest < 2 or longest > self.widths[-1] or batch.prompt_targets:
            return 0
        if batch.num_sampled != batch.num_rows or metadata.num_tokens != batch.num_rows + batch.num_drafts:
            return 0
        width = self.widths[bisect.bisect_left(self.widths, longest)]
        if any(group.block_table.shape[1] > self.max_blocks for group in metadata.groups):
            return 0
        return width if self._backends_kept(inputs) else 0

    @property
    def captured(self) -> bool:
        """Whether every graph is captured."""
        return len(self._graphs) == len(self.keys)

    @torch.inference_mode()
    def run(self, inputs: StepInputs, num_rows: int) -> torch.Tensor:
        """Logits ``[num_rows, V]`` of a decode step, replaying its bucket's graph (the first
        call captures every graph first)."""
        if not self.captured:
            self.capture_all()
        bucket = self.buckets[bisect.bisect_left(self.buckets, num_rows)]
        graph, logits = self._graphs[(bucket, 1)]
        self._fill(inputs, num_rows, bucket)
        graph.replay()
        return logits[:num_rows]

    @torch.inference_mode()
    def run_wide(
        self, inputs: StepInputs, num_rows: int, width: int, logits_indices: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits at ``logits_indices`` (default: the step's own) of a step that verifies
        proposals, replaying the graph of its row bucket and ``width`` (from
        :meth:`width_for`)."""
        if not self.captured:
            self.capture_all()
        bucket = self.wide_buckets[bisect.bisect_left(self.wide_buckets, num_rows)]
        graph, logits = self._graphs[(bucket, width)]
        wanted = inputs.logits_indices if logits_indices is None else logits_indices
        kept = self._kept(bucket, width)
        if wanted.shape[0] > kept:
            raise ValueError(f"{wanted.shape[0]} tokens' logits asked of a graph that keeps {kept}")
        self._fill_wide(inputs, num_rows, bucket, width, wanted)
        graph.replay()
        self.wide_replays += 1
        return logits[: wanted.shape[0]]

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every missing graph, in :attr:`keys`' order."""
        missing = [key for key in self.keys if key not in self._graphs]
        if not missing:
            return
        started = time.perf_counter()
        for key in missing:
            self._capture(*key)
        self.capture_seconds = time.perf_counter() - started
        wide = sum(1 for _, width in missing if width > 1)
        logger.info(
            "captured %d decode CUDA graphs (%d to %d rows) and %d of steps with proposals in %.2f s",
            len(missing) - wide, self.buckets[0], self.buckets[-1], wide, self.capture_seconds,
        )  # fmt: skip

    def release(self) -> None:
        """Drop every graph (and their memory pool): the next decode step captures them again.

        Under tensor parallelism, rank 0 does this when the followers build a new cache,
        so that every rank captures again at the same step.
        """
        self._graphs.clear()
        self._pool = None
        self._logits_out = None

    def _fill(self, inputs: StepInputs, n: int, bucket: int) -> None:
        self._fill_tokens(inputs, n, bucket, bucket)
        self._seq_lens[:n].copy_(inputs.attention.seq_lens)
        self._seq_lens[n:bucket].fill_(1)
        # Padding rows hold one query token each: row i of the bucket starts at token i.
        self._query_start[: bucket + 1].copy_(self._pad_rows[: bucket + 1])

    def _fill_wide(self, inputs: StepInputs, n: int, bucket: int, width: int, logits_indices: torch.Tensor) -> None:
        """The static buffers of the ``(bucket, width)`` graph for a step of ``n`` rows: its
        tokens in their places, padding tokens after them (written to the trash block, in
        no row), rows past ``n`` empty (a query of no token, a context of none)."""
        metadata = inputs.attention
        slots, t, k = bucket * width, metadata.num_tokens, logits_indices.shape[0]
        self._fill_tokens(inputs, t, slots, bucket)
        self._query_start[: n + 1].copy_(metadata.query_start)
        self._query_start[n + 1 : bucket + 1].fill_(t)
        self._seq_lens[:n].copy_(metadata.seq_lens)
        self._seq_lens[n:bucket].zero_()
        self._logits_indices[:k].copy_(logits_indices)
        # (a real token's: no padding token's output is read)
        self._logits_indices[k : self._kept(bucket, width)].zero_()

    def _fill_tokens(self, inputs: StepInputs, tokens: int, slots: int, bucket: int) -> None:
        """The step's ``tokens`` tokens (ids, positions, cache slots) in the first of
        ``slots`` token slots, padding tokens after them (written to the trash block), and
        its rows' block tables in the first of ``bucket`` rows (the rest the null block's)."""
        cache = self._cache
        page = cache.page_size
        self._input_ids[:tokens].copy_(inputs.input_ids)
        self._input_ids[tokens:slots].zero_()
        self._positions[:tokens].copy_(inputs.position_ids)
        self._positions[tokens:slots].zero_()
        for g, group in enumerate(inputs.attention.groups[: len(self._slots)]):
            self._slots[g][:tokens].copy_(group.slot_mapping)
            self._slots[g][tokens:slots].fill_(cache.trash_block(g) * page)
            table = self._tables[g]
            table[:bucket].fill_(cache.null_block(g))
            rows, width = group.block_table.shape
            table[:rows, :width].copy_(group.block_table)

    def _metadata(self, bucket: int, width: int = 1) -> AttentionMetadata:
        tokens = bucket * width
        groups = [
            GroupAttention(
                window=window,
                backend=self._backends[g],
                slot_mapping=self._slots[g][:tokens],
                block_table=self._tables[g][:bucket],
            )
            for g, window in enumerate(self._cache.group_windows)
        ]
        return AttentionMetadata(
            cache=self._cache,
            groups=groups,
            num_tokens=tokens,
            query_start=self._query_start[: bucket + 1],
            seq_lens=self._seq_lens[:bucket],
            max_query_len=width,
            max_seq_len=self.max_blocks * self._cache.page_size,
            decode_token_index=None,
        )

    @torch.inference_mode()
    def verify_cost(self, eager: Forward, repeats: int = 5) -> float:
        """How many times as long a step that verifies proposals takes as a decode step of a
        few rows replayed from its graph (medians of ``repeats`` timed runs, on padding
        inputs, of the smallest buckets): replayed from the graph of the widest proposals
        where there are such graphs, else run by ``eager`` (one token a row: a lower bound).
        At least 1."""

        def seconds(run: Callable[[], object]) -> float:
            run()  # (after a capture, the eager path's first pass may still initialise)
            times = []
            for _ in range(repeats):
                self._synchronize()
                started = time.perf_counter()
                run()
                self._synchronize()
                times.append(time.perf_counter() - started)
            return statistics.median(times)

        def replayed(bucket: int, width: int) -> float:
            self._padding_args(bucket, width)  # (the graph's own padding inputs in the buffers)
            graph, _ = self._graphs[(bucket, width)]  # (after capture_all)
            return seconds(graph.replay)

        replay = max(replayed(self.buckets[0], 1), 1e-9)
        if self.widths:
            return max(1.0, replayed(self.wide_buckets[0], self.widths[-1]) / replay)
        args = self._padding_args(self.buckets[0])
        return max(1.0, seconds(lambda: eager(*args)) / replay)

    def _synchronize(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)

    def _padding_args(
        self, bucket: int, width: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
        """A forward pass's arguments for ``bucket`` rows of padding: ``width`` tokens each,
        written to the trash block, reading nothing else (capture's inputs: they must not
        touch real KV)."""
        cache = self._cache
        tokens = bucket * width
        for g in range(len(cache.group_windows)):
            self._slots[g][:tokens].fill_(cache.trash_block(g) * cache.page_size)
            self._tables[g][:bucket].fill_(cache.null_block(g))
        self._seq_lens[:bucket].fill_(width)
        torch.mul(self._pad_rows[: bucket + 1], width, out=self._query_start[: bucket + 1])
        logits_indices = self._decode_logits[:bucket]
        if width > 1:
            logits_indices = self._logits_indices[: self._kept(bucket, width)]
            logits_indices.zero_()
        metadata = self._metadata(bucket, width)
        return self._input_ids[None, :tokens], self._positions[None, :tokens], logits_indices, metadata

    def _capture(self, bucket: int, width: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        graph, logits = self._record(self._padding_args(bucket, width))
        self._graphs[(bucket, width)] = (graph, logits)
        self.captures += 1
        logger.debug("captured the CUDA graph for %d rows of %d tokens", bucket, width)
        return graph, logits

    def _record(
        self, args: tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Capture the forward pass on the static buffers; returns the graph and its output."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread (the step loop's waiter) may synchronise on a CUDA
        # event meanwhile; the default "global" mode would fail that call, or this capture.
        side = _capture_stream(self._device)
        capture = torch.cuda.graph(graph, pool=self._pool, stream=side, capture_error_mode="thread_local")
        # Warm up (lazy initialisations, autotuning) off the current stream, on the stream
        # the capture runs on.
        side.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(side):
            for _ in range(2):
                warm = self._forward(*args)
        torch.cuda.current_stream(self._device).wait_stream(side)
        rows = args[2].shape[0]
        out = self._output(warm)[:rows]
        del warm
        with capture:
            # The forward's own logits are freed after the capture (its pool memory goes to
            # the next graphs): every graph leaves its logits in one shared buffer, which a
            # step reads (samples from) before the next replay.
            out.copy_(self._forward(*args))
        return graph, out

    def _output(self, like: torch.Tensor) -> torch.Tensor:
        """The logits buffer every graph writes (``[most logits a graph keeps, V]``, made at
        the first capture, outside the graphs' pool): one graph's worth instead of one per
        graph (on Qwen3's vocabulary, 871 rows of decode graphs up to 256 rows and 1,653 of
        graphs of steps with proposals up to 32 rows: 0.8 GB in bf16)."""
        if self._logits_out is None:
            slots = max(self._kept(bucket, width) for bucket, width in self.keys)
            self._logits_out = torch.empty(slots, like.shape[-1], dtype=like.dtype, device=like.device)
        return self._logits_out

    def _kept(self, bucket: int, width: int) -> int:
        """How many tokens' logits the ``(bucket, width)`` graph keeps."""
        return bucket if width == 1 or self._logits_per_row else bucket * width
