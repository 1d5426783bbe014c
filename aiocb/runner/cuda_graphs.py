"""CUDA graphs of decode-only steps, one per padded batch size.

A decode step's shapes depend only on its number of rows, so graphs are keyed by a
batch-size bucket: the step is padded up to the next bucket, with padding rows that
write to the cache's trash block and read its zero block, so padding never touches a
request's KV. All graphs share one memory pool and read static input buffers, which each
replay fills from the step's inputs with a few device copies (no host sync).

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
from collections.abc import Callable
from typing import Any

import torch

from aiocb.runner.inputs import AttentionMetadata, GroupAttention, StepInputs
from aiocb.runner.paged_cache import PagedKVCache
from aiocb.runner.step_batch import StepBatch

logger = logging.getLogger(__name__)

#: ``forward(input_ids [1, T], position_ids [1, T], logits_indices [S], metadata) -> logits [S, V]``
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


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
    """Captures and replays the forward pass of decode-only steps."""

    def __init__(
        self,
        forward: Forward,
        cache: PagedKVCache,
        backends: list[str],
        max_rows: int,
        max_blocks_per_request: int,
        device: torch.device,
    ) -> None:
        self._forward = forward
        self._cache = cache
        self._backends = backends
        self.buckets = batch_buckets(max_rows)
        self.max_blocks = max_blocks_per_request
        self._device = device
        self._pool: Any = None  # torch.cuda.graph_pool_handle()
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        #: graphs captured over this object's life (a bucket captured again counts again)
        self.captures = 0
        #: wall seconds the last :meth:`capture_all` took (None: nothing captured yet)
        self.capture_seconds: float | None = None
        rows = self.buckets[-1]
        groups = len(cache.group_windows)
        long, int32 = torch.long, torch.int32
        self._input_ids = torch.zeros(rows, dtype=long, device=device)
        self._positions = torch.zeros(rows, dtype=long, device=device)
        self._slots = [torch.zeros(rows, dtype=long, device=device) for _ in range(groups)]
        self._tables = [torch.zeros(rows, max_blocks_per_request, dtype=int32, device=device) for _ in range(groups)]
        self._query_start = torch.arange(rows + 1, dtype=int32, device=device)
        self._seq_lens = torch.ones(rows, dtype=int32, device=device)
        self._logits_indices = torch.arange(rows, dtype=long, device=device)
        self._pad_rows = torch.arange(rows + 1, dtype=int32, device=device)

    def eligible(self, batch: StepBatch, inputs: StepInputs) -> bool:
        """Whether the step (with its inputs made) is a decode step a graph can run."""
        return (
            batch.is_decode
            and batch.num_rows <= self.buckets[-1]
            and all(group.block_table.shape[1] <= self.max_blocks for group in inputs.attention.groups)
        )

    @property
    def captured(self) -> bool:
        """Whether every bucket has its graph."""
        return len(self._graphs) == len(self.buckets)

    def run(self, inputs: StepInputs, num_rows: int) -> torch.Tensor:
        """Logits ``[num_rows, V]`` of a decode step, replaying its bucket's graph (the first
        call captures every bucket's graph first)."""
        if not self.captured:
            self.capture_all()
        bucket = self.buckets[bisect.bisect_left(self.buckets, num_rows)]
        graph, logits = self._graphs[bucket]
        self._fill(inputs, num_rows, bucket)
        graph.replay()
        return logits[:num_rows]

    def capture_all(self) -> None:
        """Capture every missing bucket, largest first so smaller ones reuse its memory.

        The order depends on the buckets alone, so ranks that agree on the cache plan
        capture (and run the collectives of the warm-up passes) in the same order.
        """
        missing = [bucket for bucket in reversed(self.buckets) if bucket not in self._graphs]
        if not missing:
            return
        started = time.perf_counter()
        for bucket in missing:
            self._capture(bucket)
        self.capture_seconds = time.perf_counter() - started
        logger.info(
            "captured %d decode CUDA graphs (%d to %d rows) in %.2f s",
            len(missing), missing[-1], missing[0], self.capture_seconds,
        )  # fmt: skip

    def release(self) -> None:
        """Drop every graph (and their memory pool): the next decode step captures them again.

        Under tensor parallelism, rank 0 does this when the followers build a new cache,
        so that every rank captures again at the same step.
        """
        self._graphs.clear()
        self._pool = None

    def _fill(self, inputs: StepInputs, n: int, bucket: int) -> None:
        cache = self._cache
        page = cache.page_size
        self._input_ids[:n].copy_(inputs.input_ids)
        self._input_ids[n:bucket].zero_()
        self._positions[:n].copy_(inputs.position_ids)
        self._positions[n:bucket].zero_()
        self._seq_lens[:n].copy_(inputs.attention.seq_lens)
        self._seq_lens[n:bucket].fill_(1)
        # Padding rows hold one query token each: row i of the bucket starts at token i.
        self._query_start[: bucket + 1].copy_(self._pad_rows[: bucket + 1])
        for g, group in enumerate(inputs.attention.groups):
            self._slots[g][:n].copy_(group.slot_mapping)
            self._slots[g][n:bucket].fill_(cache.trash_block(g) * page)
            table = self._tables[g]
            table[:bucket].fill_(cache.null_block(g))
            width = group.block_table.shape[1]
            table[:n, :width].copy_(group.block_table)

    def _metadata(self, bucket: int) -> AttentionMetadata:
        groups = [
            GroupAttention(
                window=window,
                backend=self._backends[g],
                slot_mapping=self._slots[g][:bucket],
                block_table=self._tables[g][:bucket],
            )
            for g, window in enumerate(self._cache.group_windows)
        ]
        return AttentionMetadata(
            cache=self._cache,
            groups=groups,
            num_tokens=bucket,
            query_start=self._query_start[: bucket + 1],
            seq_lens=self._seq_lens[:bucket],
            max_query_len=1,
            max_seq_len=self.max_blocks * self._cache.page_size,
            decode_token_index=None,
        )

    def eager_cost(self, eager: Forward, repeats: int = 5) -> float:
        """How many times as long the smallest bucket's forward pass takes run by ``eager``
        as replayed from its graph (medians of ``repeats`` timed runs, on padding inputs):
        what a step no graph can run (a speculative one: several query tokens a row) costs
        against a decode step of a few rows. At least 1."""
        bucket = self.buckets[0]
        graph, _ = self._graphs[bucket]  # (after capture_all)
        args = self._padding_args(bucket)

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

        replay = seconds(graph.replay)
        return max(1.0, seconds(lambda: eager(*args)) / max(replay, 1e-9))

    def _synchronize(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)

    def _padding_args(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
        """A forward pass's arguments for ``bucket`` rows of padding: one token each, written
        to the trash block, reading nothing (capture's inputs: they must not touch real KV)."""
        cache = self._cache
        for g in range(len(cache.group_windows)):
            self._slots[g][:bucket].fill_(cache.trash_block(g) * cache.page_size)
            self._tables[g][:bucket].fill_(cache.null_block(g))
        self._seq_lens[:bucket].fill_(1)
        self._query_start[: bucket + 1].copy_(self._pad_rows[: bucket + 1])
        metadata = self._metadata(bucket)
        return self._input_ids[None, :bucket], self._positions[None, :bucket], self._logits_indices[:bucket], metadata

    def _capture(self, bucket: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        graph, logits = self._record(self._padding_args(bucket))
        self._graphs[bucket] = (graph, logits)
        self.captures += 1
        logger.debug("captured the decode CUDA graph for %d rows", bucket)
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
                self._forward(*args)
        torch.cuda.current_stream(self._device).wait_stream(side)
        with capture:
            logits = self._forward(*args)
        return graph, logits
