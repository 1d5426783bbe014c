"""The Triton paged-attention kernel against a dense torch reference.

On the CPU the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``, set in
``conftest.py``), which is slow: shapes here are small. The ``gpu`` test repeats the
comparison with realistic shapes on CUDA and times decode.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from aiocb.runner import triton_attention
from aiocb.runner.triton_attention import (
    DEFAULT_SM_COUNT,
    MIN_PARTITION,
    MOST_SPLIT_QUERIES,
    _Config,
    _launch,
    _launch_partitions,
    _sm_count,
    choose_num_splits,
    is_available,
    triton_paged_attention,
)

PAGE = 16

needs_kernel = pytest.mark.skipif(
    not is_available(torch.device("cpu")), reason="Triton interpreter not enabled (TRITON_INTERPRET=1)"
)


@dataclass
class Case:
    """A step's inputs plus each row's logical (unpaged) keys and values."""

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor
    query_start: torch.Tensor
    seq_lens: torch.Tensor
    max_query_len: int
    keys: list[torch.Tensor]  # per row [seq_len, Hkv, D]
    values: list[torch.Tensor]
    q_lens: list[int]


def make_case(
    rows: list[tuple[int, int]],
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    page: int = PAGE,
    dtype: torch.dtype = torch.float32,
    ring: int | None = None,
    device: str = "cpu",
    seed: int = 0,
) -> Case:
    """``rows`` are ``(seq_len, q_len)``; blocks are handed out in shuffled order.

    Unused blocks hold garbage, the null block zeros, so reading a wrong block shows.
    With ``ring``, a row's block table is a ring of ``ring`` blocks (sliding layers).
    """
    gen = torch.Generator().manual_seed(seed)
    counts = [min(-(-seq // page), ring) if ring else -(-seq // page) for seq, _ in rows]
    num_blocks = sum(counts) + 3
    null = num_blocks
    order = torch.randperm(num_blocks, generator=gen).tolist()
    key_cache = torch.randn(num_blocks + 2, page, num_kv_heads, head_dim, generator=gen)
    value_cache = torch.randn(num_blocks + 2, page, num_kv_heads, head_dim, generator=gen)
    key_cache[null] = 0
    value_cache[null] = 0
    width = max(counts, default=0) + 1  # one padding column at least
    block_table = torch.full((len(rows), width), null, dtype=torch.int32)
    keys, values = [], []
    for b, ((seq, _), count) in enumerate(zip(rows, counts, strict=True)):
        ids = torch.tensor(order[:count], dtype=torch.long)
        order = order[count:]
        block_table[b, :count] = ids.to(torch.int32)
        k = torch.randn(seq, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(seq, num_kv_heads, head_dim, generator=gen)
        # A ring keeps the last ring * page positions only (the ones written last).
        pos = torch.arange(max(0, seq - ring * page) if ring else 0, seq)
        column = pos // page % ring if ring else pos // page
        key_cache[ids[column], pos % page] = k[pos]
        value_cache[ids[column], pos % page] = v[pos]
        keys.append(k.to(dtype))
        values.append(v.to(dtype))
    q_lens = [q for _, q in rows]
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen)
    query_start = torch.tensor([0, *torch.tensor(q_lens, dtype=torch.long).cumsum(0).tolist()], dtype=torch.int32)
    return Case(
        query=query.to(device, dtype),
        key_cache=key_cache.to(device, dtype),
        value_cache=value_cache.to(device, dtype),
        block_table=block_table.to(device),
        query_start=query_start.to(device),
        seq_lens=torch.tensor([s for s, _ in rows], dtype=torch.int32, device=device),
        max_query_len=max(q_lens, default=0),
        keys=[k.to(device) for k in keys],
        values=[v.to(device) for v in values],
        q_lens=q_lens,
    )


def reference(
    case: Case,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
    acc: torch.dtype = torch.float64,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Row by row: explicit bottom-right causal (and window) mask over the row's keys; each
    head's sink, when given, one more logit in its softmax, weighing no value (as gpt-oss's)."""
    query = case.query.to(acc)
    out = torch.zeros_like(query)
    group = query.shape[1] // case.keys[0].shape[1] if case.keys else 1
    first = 0
    for k, v, q_len in zip(case.keys, case.values, case.q_lens, strict=True):
        if q_len == 0:
            continue
        seq = k.shape[0]
        q = query[first : first + q_len]
        k = k.to(acc).repeat_interleave(group, dim=1)
        v = v.to(acc).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(seq - q_len, seq, device=q.device)[:, None]
        k_pos = torch.arange(seq, device=q.device)[None, :]
        mask = k_pos <= q_pos
        if window is not None:
            mask &= k_pos > q_pos - window
        scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is None:
            probs = scores.softmax(-1)
        else:
            sink = sinks.to(acc).view(-1, 1, 1).expand(-1, q_len, 1)
            probs = torch.cat((scores, sink), -1).softmax(-1)[..., :-1]
        out[first : first + q_len] = torch.einsum("hqk,khd->qhd", probs, v)
        first += q_len
    return out


def run_kernel(
    case: Case,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
    ring: int | None = None,
    config: _Config | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    if config is None:
        return triton_paged_attention(
            case.query, case.key_cache, case.value_cache, case.block_table, case.query_start, case.seq_lens,
            case.max_query_len, scale, softcap=softcap, sliding_window=window, ring_blocks=ring, sinks=sinks,
        )  # fmt: skip
    return _launch(
        case.query, case.key_cache, case.value_cache, case.block_table, case.query_start, case.seq_lens,
        case.max_query_len, scale, softcap, window, ring, torch.empty_like(case.query), config,
        None if sinks is None else sinks.float(),
    )  # fmt: skip


def check(
    case: Case,
    *,
    softcap: float | None = None,
    window: int | None = None,
    ring: int | None = None,
    config: _Config | None = None,
    sinks: torch.Tensor | None = None,
    atol: float = 1e-5,
    rtol: float = 1e-5,
) -> None:
    scale = case.query.shape[-1] ** -0.5
    got = run_kernel(case, scale, softcap, window, ring, config, sinks)
    assert got.dtype == case.query.dtype
    assert got.shape == case.query.shape
    want = reference(case, scale, softcap, window, sinks=sinks)
    torch.testing.assert_close(got.to(want.dtype), want, atol=atol, rtol=rtol)


# (seq_len, q_len): decode rows, prefill chunks after a cached past, a first chunk,
# zero-length padding rows (empty, and with cached keys), a 1-token context.
MIXED = [(37, 1), (53, 20), (0, 0), (17, 17), (1, 1), (70, 1), (9, 0), (40, 3)]


@needs_kernel
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 2), (2, 2)], ids=["gqa", "mha"])
def test_mixed_batch_matches_reference(num_heads: int, num_kv_heads: int) -> None:
    check(make_case(MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads))


@needs_kernel
def test_softcap() -> None:
    case = make_case(MIXED, seed=1)
    case.query *= 4  # large logits, so the cap matters
    check(case, softcap=5.0)


@needs_kernel
def test_sinks() -> None:
    """gpt-oss's attention sinks, in full and sliding-window (ring) layers, with a softcap
    and without; one sink far above every score (its head's output tends to zero)."""
    case = make_case(MIXED, num_heads=4, num_kv_heads=2, seed=21)
    sinks = torch.tensor([1.5, -3.0, 0.0, 60.0])
    check(case, sinks=sinks)
    check(case, sinks=sinks, softcap=5.0)
    window = 12
    ring = -(-(window - 1) // PAGE) + 1
    check(make_case(MIXED, ring=ring, seed=22), window=window, ring=ring, sinks=sinks)


@needs_kernel
def test_sliding_window() -> None:
    # Window shorter than a chunk, than a past, and a row shorter than the window.
    rows = [(70, 1), (60, 20), (45, 30), (10, 1), (0, 0), (12, 12)]
    check(make_case(rows, seed=2), window=24)


@needs_kernel
def test_sliding_window_ring_block_table() -> None:
    # aiocb's sliding layers keep a ring of ceil((window - 1) / page) + 1 blocks per row.
    window = 24
    ring = -(-(window - 1) // PAGE) + 1
    rows = [(70, 1), (95, 1), (20, 1), (60, 8), (9, 9)]
    case = make_case(rows, ring=ring, seed=3)
    check(case, window=window, ring=ring)
    # Key tiles wider than a page: per-key block lookups through the ring.
    check(case, window=window, ring=ring, config=_Config(block_m=16, block_n=32, num_warps=4, num_stages=1))


@needs_kernel
def test_ring_slots_before_the_window_are_never_read() -> None:
    # Window 20 over pages of 8, a ring of 4: at position 99 the first ring column holds
    # page 12 (positions 96..103), written only to 99. Tiles start aligned down from the
    # window's start, so its unwritten slots sit in the first tile: read, a NaN there
    # would poison the row even with a zero weight.
    case = make_case([(100, 1)], num_heads=4, num_kv_heads=2, head_dim=32, page=8, ring=4)
    column_0 = int(case.block_table[0, 0])
    case.key_cache[column_0, 4:] = float("nan")
    case.value_cache[column_0, 4:] = float("nan")
    check(case, window=20, ring=4)


@needs_kernel
@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")])
def test_half_precision(dtype: torch.dtype) -> None:
    check(make_case(MIXED, dtype=dtype, seed=4), softcap=None, atol=2e-2, rtol=2e-2)


@needs_kernel
@pytest.mark.parametrize("head_dim", [16, 64, 80, 128, 256])
def test_head_dims(head_dim: int) -> None:
    check(make_case([(33, 1), (30, 9), (0, 0)], head_dim=head_dim, seed=5))


@needs_kernel
def test_group_not_a_power_of_two() -> None:
    # Three query heads per KV head: the tile pads the group to four rows.
    check(make_case(MIXED[:4], num_heads=6, num_kv_heads=2, seed=6))


@needs_kernel
@pytest.mark.parametrize(
    ("page", "config"),
    [
        (PAGE, _Config(block_m=16, block_n=16, num_warps=4, num_stages=1)),  # several query tiles per row
        (32, _Config(block_m=16, block_n=16, num_warps=4, num_stages=1)),  # two key tiles per page
        (PAGE, _Config(block_m=32, block_n=32, num_warps=4, num_stages=1)),  # key tiles straddle pages
    ],
    ids=["small-tiles", "tile-in-page", "tile-across-pages"],
)
def test_tilings(page: int, config: _Config) -> None:
    rows = [(53, 20), (37, 1), (0, 0), (45, 30)]
    check(make_case(rows, page=page, seed=7), config=config)
    check(make_case(rows, page=page, seed=8), window=20, config=config)


@needs_kernel
def test_out_and_padding_rows_untouched() -> None:
    # Trailing query rows owned by no request (CUDA-graph style padding) keep their value.
    case = make_case([(20, 2), (0, 0), (9, 1)], seed=9)
    padded = torch.cat((case.query, torch.zeros(2, *case.query.shape[1:])))
    out = torch.full_like(padded, 7.0)
    result = triton_paged_attention(
        padded, case.key_cache, case.value_cache, case.block_table, case.query_start, case.seq_lens,
        case.max_query_len, 0.2, out=out,
    )  # fmt: skip
    assert result is out
    torch.testing.assert_close(out[:3], reference(case, 0.2).float(), atol=1e-5, rtol=1e-5)
    assert bool((out[3:] == 7.0).all())


@needs_kernel
def test_empty_step() -> None:
    case = make_case([(0, 0), (0, 0)])
    out = triton_paged_attention(
        case.query, case.key_cache, case.value_cache, case.block_table, case.query_start, case.seq_lens, 0, 1.0
    )
    assert out.shape == (0, 4, 32)


# Split KV. Decode rows (q_len 1): with 16-key tiles and 4 splits a row of 100 keys gets
# partitions of 32 (the last 4 keys long), 64 keys four of 16, 40 keys three (the fourth
# empty), 9 keys and 1 key one (shorter than a partition); plus an empty padding row.
SPLIT_ROWS = [(100, 1), (64, 1), (40, 1), (9, 1), (0, 0), (1, 1)]


def split_config(num_splits: int, min_partition: int = 0) -> _Config:
    return _Config(
        block_m=16, block_n=16, num_warps=4, num_stages=1, num_splits=num_splits, min_partition=min_partition
    )


@needs_kernel
@pytest.mark.parametrize(
    ("num_splits", "num_heads", "num_kv_heads"),
    [(2, 8, 2), (3, 8, 2), (4, 8, 2), (3, 6, 2), (4, 4, 2), (4, 2, 2)],
    ids=["gqa4-2", "gqa4-3", "gqa4-4", "gqa3-3", "gqa2-4", "mha-4"],
)
def test_split_decode_matches_reference(num_splits: int, num_heads: int, num_kv_heads: int) -> None:
    case = make_case(SPLIT_ROWS, num_heads=num_heads, num_kv_heads=num_kv_heads, seed=12)
    check(case, config=split_config(num_splits))


def merge_in_torch(parts: torch.Tensor, lse: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """An independent merge of the kernel's partials (``keep [S]`` selects partitions)."""
    if keep is not None:
        parts, lse = parts[:, :, keep], lse[:, :, keep]
    weight = torch.exp2(lse.double() - lse.double().amax(-1, keepdim=True))
    return (parts.double() * weight[..., None]).sum(2) / weight.sum(-1)[..., None]


@needs_kernel
@pytest.mark.parametrize(
    ("min_partition", "expected"),
    [(0, [4, 4, 3, 1, 1]), (32, [4, 2, 2, 1, 1])],
    ids=["even-split", "min-partition"],
)
def test_split_partitions_cover_each_row(min_partition: int, expected: list[int]) -> None:
    # The partitions that saw keys, per decode row: shows the step really split unevenly
    # (with a minimum partition of 32 keys, 64 keys take two and 40 keys a full one and a
    # short one), and that the merge needs every one of them.
    case = make_case(SPLIT_ROWS, seed=13)
    scale = case.query.shape[-1] ** -0.5
    out = torch.full_like(case.query, 7.0)
    parts, lse = _launch_partitions(
        case.query, case.key_cache, case.value_cache, case.block_table, case.query_start, case.seq_lens,
        case.max_query_len, scale, None, None, None, out, split_config(4, min_partition),
    )  # fmt: skip
    assert bool((out == 7.0).all())  # the partition kernel leaves the output to the merge
    assert parts.shape == (*case.query.shape[:2], 4, case.query.shape[2])
    seen = torch.isfinite(lse).sum(-1)  # [T, Hq]: the same for every head of a token
    assert seen.tolist() == [[n] * case.query.shape[1] for n in expected]
    # Empty partitions carry no weight; the shorter ones not written past the row's keys.
    assert bool((parts[~torch.isfinite(lse)] == 0).all())

    want = reference(case, scale)
    torch.testing.assert_close(merge_in_torch(parts, lse), want, atol=1e-5, rtol=1e-5)
    # Dropping any partition that saw keys changes the rows it covered.
    for dropped in range(4):
        keep = torch.arange(4) != dropped
        partial = merge_in_torch(parts, lse, keep)
        split_rows = [i for i, n in enumerate(expected) if n > dropped]
        assert not torch.allclose(partial[split_rows], want[split_rows], atol=1e-3)


@needs_kernel
def test_split_with_min_partition_matches_reference() -> None:
    check(make_case(SPLIT_ROWS, num_heads=8, num_kv_heads=2, seed=14), config=split_config(4, min_partition=32))


@needs_kernel
def test_split_leaves_padding_rows_untouched() -> None:
    # Trailing query rows owned by no request (CUDA-graph style padding): neither the
    # partition kernel nor the merge writes them.
    case = make_case([(40, 1), (0, 0), (20, 1)], seed=23)
    padded = torch.cat((case.query, torch.zeros(2, *case.query.shape[1:])))
    out = torch.full_like(padded, 7.0)
    _launch(
        padded, case.key_cache, case.value_cache, case.block_table, case.query_start, case.seq_lens, 1, 0.2, None,
        None, None, out, split_config(3),
    )  # fmt: skip
    torch.testing.assert_close(out[:2].double(), reference(case, 0.2), atol=1e-5, rtol=1e-5)
    assert bool((out[2:] == 7.0).all())


@needs_kernel
def test_split_sliding_window_and_ring() -> None:
    # Partitions of the (tile-aligned) window: the first may hold only keys before it.
    window = 24
    rows = [(100, 1), (70, 1), (30, 1), (10, 1), (0, 0)]
    check(make_case(rows, num_heads=8, num_kv_heads=2, seed=15), window=window, config=split_config(3))
    ring = -(-(window - 1) // PAGE) + 1
    case = make_case(rows, num_heads=8, num_kv_heads=2, ring=ring, seed=16)
    check(case, window=window, ring=ring, config=split_config(2))


@needs_kernel
def test_split_softcap_and_half_precision() -> None:
    case = make_case(SPLIT_ROWS, seed=17)
    case.query *= 4
    check(case, softcap=5.0, config=split_config(3))
    check(make_case(SPLIT_ROWS, dtype=torch.bfloat16, seed=18), config=split_config(3), atol=2e-2, rtol=2e-2)


@needs_kernel
def test_split_sinks() -> None:
    """The merge adds each head's sink to the partitions' joint denominator, once."""
    sinks = torch.tensor([2.0, -1.0, 0.5, 40.0])
    check(make_case(SPLIT_ROWS, num_heads=4, num_kv_heads=2, seed=23), config=split_config(3), sinks=sinks)
    check(make_case([(53, 20), (37, 1), (0, 0)], num_heads=4, seed=24), config=split_config(2), sinks=sinks)


@needs_kernel
def test_split_kernel_handles_prefill_chunks() -> None:
    # The launcher splits decode-only steps, but the kernel splits any query tile: a causal
    # partition may then be invisible to a tile's early tokens.
    rows = [(53, 20), (37, 1), (0, 0), (40, 3)]
    check(make_case(rows, seed=19), config=split_config(3))
    check(make_case(rows, seed=20), window=20, config=split_config(2))


@needs_kernel
@pytest.mark.parametrize("num_splits", [1, 3])
def test_a_long_chunk_s_query_tiles_go_on_the_grid_axis_without_cuda_s_small_limit(
    monkeypatch: pytest.MonkeyPatch, num_splits: int
) -> None:
    """CUDA launches at most 65,535 programs along a grid's second and third axes: a
    65,536-token prefill chunk has that many query tiles (one token each in fp32 with a
    large head group). Here the limit is 4, the tiles (and tokens to merge) 20 or more."""
    monkeypatch.setattr(triton_attention, "GRID_YZ_LIMIT", 4)
    check(make_case([(53, 40), (12, 1)], seed=21), config=split_config(num_splits))
    with pytest.raises(ValueError, match="exceeds CUDA's 4"):
        check(make_case([(3, 1)] * 5, seed=22), config=split_config(num_splits))


def test_choose_num_splits() -> None:
    sms = 132
    # Large decode batches already fill the GPU: the single-pass kernel.
    assert choose_num_splits(256, 8, 1, 8192, sms) == 1
    assert choose_num_splits(33, 8, 1, 8192, sms) == 1
    # Small batch, long context: split, towards two programs per SM.
    assert choose_num_splits(4, 8, 1, 8192, sms) == 9  # 32 programs -> 288
    assert choose_num_splits(16, 8, 1, 8192, sms) == 3
    assert choose_num_splits(1, 1, 1, 1 << 20, sms) == 16  # capped
    # Short contexts are not cut below a partition's worth of keys.
    assert choose_num_splits(4, 8, 1, MIN_PARTITION, sms) == 1
    assert choose_num_splits(4, 8, 1, 3 * MIN_PARTITION - 1, sms) == 3
    # Rows verifying speculative proposals (a few query tokens each) split as decode rows do.
    assert choose_num_splits(4, 8, 9, 8192, sms) == 9
    assert choose_num_splits(4, 8, MOST_SPLIT_QUERIES, 8192, sms) == 9
    # Longer prefill chunks in the step, or nothing to attend: no split.
    assert choose_num_splits(4, 8, MOST_SPLIT_QUERIES + 1, 8192, sms) == 1
    assert choose_num_splits(0, 8, 1, 8192, sms) == 1
    assert choose_num_splits(4, 8, 1, 0, sms) == 1
    assert _sm_count(torch.device("cpu")) == DEFAULT_SM_COUNT


@pytest.fixture
def merges(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of partitions of every split launch's merge, in order."""
    counts: list[int] = []
    merge = triton_attention._merge_partitions

    def counting_merge(
        parts: torch.Tensor,
        lse: torch.Tensor,
        out: torch.Tensor,
        query_start: torch.Tensor,
        rows: int,
        max_q: int,
        sinks: torch.Tensor | None = None,
    ) -> None:
        counts.append(parts.shape[2])
        merge(parts, lse, out, query_start, rows, max_q, sinks)

    monkeypatch.setattr(triton_attention, "_merge_partitions", counting_merge)
    return counts


@needs_kernel
def test_default_launch_splits_small_decode_steps(merges: list[int]) -> None:
    # 2 rows x 2 KV heads, the longest 600 keys: three partitions of 256 keys at most.
    case = make_case([(600, 1), (300, 1)], seed=21)
    scale = case.query.shape[-1] ** -0.5
    want = reference(case, scale)
    got = triton_paged_attention(
        case.query, case.key_cache, case.value_cache, case.block_table, case.query_start, case.seq_lens, 1, scale,
        max_seq_len=600,
    )  # fmt: skip
    assert merges == [3]
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    # Enough programs for the SMs (here: 2): no split.
    got = triton_paged_attention(
        case.query, case.key_cache, case.value_cache, case.block_table, case.query_start, case.seq_lens, 1, scale,
        max_seq_len=600, num_sms=2,
    )  # fmt: skip
    assert merges == [3]
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@needs_kernel
def test_default_launch_splits_steps_that_verify_proposals(merges: list[int]) -> None:
    """Rows of a few query tokens (the last one and proposed ones) over long contexts split
    at small batch as decode rows do; each query still sees its own causal range."""
    case = make_case([(600, 9), (300, 3), (0, 0), (520, 1)], seed=22)
    scale = case.query.shape[-1] ** -0.5
    got = triton_paged_attention(
        case.query, case.key_cache, case.value_cache, case.block_table, case.query_start, case.seq_lens, 9, scale,
        max_seq_len=600,
    )  # fmt: skip
    assert merges == [3]
    torch.testing.assert_close(got.double(), reference(case, scale), atol=1e-5, rtol=1e-5)


def test_is_available() -> None:
    assert not is_available(torch.device("meta"))
    interpreted = type(triton_attention._paged_attention_kernel).__name__ == "InterpretedFunction"
    assert is_available(torch.device("cpu")) == interpreted


def test_rejects_mismatched_heads() -> None:
    case = make_case([(4, 1)], num_heads=3, num_kv_heads=1)
    with pytest.raises(ValueError, match="incompatible heads"):
        triton_paged_attention(
            case.query, case.key_cache[..., :16], case.value_cache[..., :16], case.block_table, case.query_start,
            case.seq_lens, 1, 1.0,
        )  # fmt: skip


_CUDA_KERNEL = (
    torch.cuda.is_available() and is_available(torch.device("cuda")) and not is_available(torch.device("cpu"))
)


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA_KERNEL, reason="needs CUDA and a compiled kernel (AIOCB_GPU_TESTS=1)")
@pytest.mark.parametrize("page", [64, 256])
def test_gpu_realistic_bf16_and_decode_timing(page: int) -> None:
    heads, kv_heads, head_dim = 16, 8, 128
    gen = torch.Generator().manual_seed(10)
    rows = [(int(n), 1) for n in torch.randint(540, 660, (64,), generator=gen)] + [(700, 512), (512, 512)]
    case = make_case(
        rows, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, page=page, dtype=torch.bfloat16,
        device="cuda", seed=11,
    )  # fmt: skip
    scale = head_dim**-0.5
    want = reference(case, scale, acc=torch.float32)
    got = run_kernel(case, scale)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    got = run_kernel(case, scale, softcap=30.0, window=256)
    torch.testing.assert_close(got.float(), reference(case, scale, 30.0, 256, acc=torch.float32), atol=2e-2, rtol=2e-2)

    # Decode timing: batch 256 x context 768, in place in a bf16 cache.
    batch, context = 256, 768
    query, key_cache, value_cache, block_table, query_start, seq_lens, out = _bf16_decode_step(
        batch, context, page, heads, kv_heads, head_dim
    )

    def step() -> None:
        triton_paged_attention(query, key_cache, value_cache, block_table, query_start, seq_lens, 1, scale, out=out)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    iters = 50
    start = time.perf_counter()
    for _ in range(iters):
        step()
    torch.cuda.synchronize()
    per_call_ms = (time.perf_counter() - start) / iters * 1e3
    kv_bytes = 2 * batch * context * kv_heads * head_dim * 2
    print(
        f"\ntriton paged decode page={page}: {per_call_ms:.3f} ms/call "
        f"({kv_bytes / per_call_ms / 1e6:.0f} GB/s of KV) for batch {batch} x context {context}"
    )
    assert per_call_ms < 5.0


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA_KERNEL, reason="needs CUDA and a compiled kernel (AIOCB_GPU_TESTS=1)")
def test_gpu_block_table_widths_and_split_counts_share_one_compiled_kernel() -> None:
    """An eager step's block table is as wide as its longest row's pages and its split
    count follows its contexts: neither may make Triton compile the kernels again (it
    specialises an integer on being 1 and on dividing by 16), which mid-serving stalls
    the step for a second and the event loop for tens of milliseconds."""
    from aiocb.runner import triton_attention

    def compiled(kernel: Any) -> int:
        return sum(len(caches[0]) for caches in kernel.device_caches.values())

    scale = 32**-0.5
    kernels = ("_paged_attention_kernel", "_merge_splits_kernel")
    before = {name: compiled(getattr(triton_attention, name)) for name in kernels}
    # (block tables 2, 4, 16 and 32 pages wide, a padding column included; 1, 2, 3 and 16 splits)
    for contexts, num_splits in (([10], 1), ([40, 3], 1), ([240, 20], 1), ([40, 3], 2), ([240, 20], 3), ([496], 16)):
        case = make_case([(n, 1) for n in contexts], dtype=torch.bfloat16, device="cuda", seed=num_splits)
        want = reference(case, scale, acc=torch.float32)
        got = run_kernel(case, scale, config=split_config(num_splits))
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    after = {name: compiled(getattr(triton_attention, name)) for name in before}
    # (one variant each: unsplit and split are the attention kernel's two; fewer when an
    # earlier test of this process compiled them)
    assert after["_paged_attention_kernel"] - before["_paged_attention_kernel"] <= 2, after
    assert after["_merge_splits_kernel"] - before["_merge_splits_kernel"] <= 1, after


def _bf16_decode_step(
    batch: int, context: int, page: int, heads: int, kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, ...]:
    """A decode step's CUDA tensors, every row at ``context`` keys in a shuffled bf16 cache:
    ``(query, key_cache, value_cache, block_table, query_start, seq_lens, out)``."""
    blocks_per_row = math.ceil(context / page)
    num_blocks = batch * blocks_per_row
    shape = (num_blocks + 2, page, kv_heads, head_dim)
    key_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    value_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    block_table = torch.randperm(num_blocks, device="cuda").view(batch, blocks_per_row).to(torch.int32)
    query = torch.randn(batch, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    query_start = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    seq_lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    return query, key_cache, value_cache, block_table, query_start, seq_lens, torch.empty_like(query)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


#: Qwen3-0.6B's attention: query heads, KV heads, head size; and the page size used here
_QWEN3_HEADS = (16, 8, 128, 64)


def _qwen3_case(rows: list[tuple[int, int]], seed: int) -> tuple[Case, float, int, _Config]:
    """A bf16 step of Qwen3-0.6B's heads on the device (``rows`` of ``(seq_len, q_len)``),
    its scale, the splits the default launch chooses (more than one), and the one-pass tiles."""
    heads, kv_heads, head_dim, page = _QWEN3_HEADS
    case = make_case(
        rows, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, page=page, dtype=torch.bfloat16,
        device="cuda", seed=seed,
    )  # fmt: skip
    queries = case.max_query_len
    splits = choose_num_splits(len(rows), kv_heads, queries, 8192, _sm_count(case.query.device))
    assert splits > 1
    unsplit = triton_attention._choose_config(queries, 2, head_dim, page, torch.bfloat16)
    assert unsplit.num_splits == 1
    return case, head_dim**-0.5, splits, unsplit


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA_KERNEL, reason="needs CUDA and a compiled kernel (AIOCB_GPU_TESTS=1)")
def test_gpu_split_decode_matches_unsplit_and_is_faster() -> None:
    # Qwen3-0.6B's attention shape, batch 4 decode at up to 8,192 keys: 32 (row, KV head)
    # programs, a quarter of an H200's SMs, so the default launch splits.
    heads, kv_heads, head_dim, page = _QWEN3_HEADS
    rows = [(8192, 1), (8155, 1), (6001, 1), (200, 1)]  # uneven lengths, one below a partition
    case, scale, splits, unsplit_config = _qwen3_case(rows, seed=22)
    for window in (None, 1000):
        want = reference(case, scale, window=window, acc=torch.float32)
        unsplit = run_kernel(case, scale, window=window, config=unsplit_config)
        split = triton_paged_attention(
            case.query, case.key_cache, case.value_cache, case.block_table, case.query_start, case.seq_lens, 1,
            scale, sliding_window=window, max_seq_len=8192,
        )  # fmt: skip
        # Norm-relative errors: outputs of long random contexts are small, so an absolute
        # tolerance would pass nearly anything; a lost partition moves them by tens of %.
        assert relative_error(unsplit, want) < 1e-2
        assert relative_error(split, want) < 1e-2
        assert relative_error(split, unsplit) < 1e-2

    # Timing at batch 4 x context 8,192 in a bf16 cache: split against single-pass.
    batch, context = 4, 8192
    query, key_cache, value_cache, block_table, query_start, seq_lens, out = _bf16_decode_step(
        batch, context, page, heads, kv_heads, head_dim
    )

    def split_step() -> None:
        triton_paged_attention(query, key_cache, value_cache, block_table, query_start, seq_lens, 1, scale, out=out)

    def unsplit_step() -> None:
        _launch(
            query, key_cache, value_cache, block_table, query_start, seq_lens, 1, scale, None, None, None, out,
            unsplit_config,
        )  # fmt: skip

    unsplit_ms, split_ms = _device_ms_per_call(unsplit_step), _device_ms_per_call(split_step)
    kv_bytes = 2 * batch * context * kv_heads * head_dim * 2
    print(
        f"\ntriton paged decode batch {batch} x context {context}: single-pass {unsplit_ms:.3f} ms "
        f"({kv_bytes / unsplit_ms / 1e6:.0f} GB/s), {splits} splits {split_ms:.3f} ms "
        f"({kv_bytes / split_ms / 1e6:.0f} GB/s)"
    )
    assert split_ms < unsplit_ms


def _device_ms_per_call(step: Callable[[], None]) -> float:
    """Device time per call from a CUDA graph of many calls, so the split path's second
    launch costs what it costs on the GPU, not the host's launch overhead (and the split
    path is shown to capture, as the engine's graphs need)."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    calls = 20
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            step()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replays = 5
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / (replays * calls)


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA_KERNEL, reason="needs CUDA and a compiled kernel (AIOCB_GPU_TESTS=1)")
def test_gpu_split_verification_matches_unsplit_and_is_faster() -> None:
    """Rows verifying speculative proposals (9 query tokens: the last one and 8 proposed)
    at batch 4 over contexts up to 8,192 keys, bf16, Qwen3-0.6B's heads: the default launch
    splits; it matches the single pass and the reference, and is faster."""
    case, scale, splits, unsplit_config = _qwen3_case([(8192, 9), (8155, 9), (6001, 5), (200, 2)], seed=23)
    want = reference(case, scale, acc=torch.float32)
    unsplit = run_kernel(case, scale, config=unsplit_config)
    out = torch.empty_like(case.query)

    def split_step() -> None:
        triton_paged_attention(
            case.query, case.key_cache, case.value_cache, case.block_table, case.query_start, case.seq_lens, 9,
            scale, out=out, max_seq_len=8192,
        )  # fmt: skip

    def unsplit_step() -> None:
        _launch(
            case.query, case.key_cache, case.value_cache, case.block_table, case.query_start, case.seq_lens, 9,
            scale, None, None, None, out, unsplit_config,
        )  # fmt: skip

    split_step()
    assert relative_error(unsplit, want) < 1e-2
    assert relative_error(out, want) < 1e-2 and relative_error(out, unsplit) < 1e-2
    unsplit_ms, split_ms = _device_ms_per_call(unsplit_step), _device_ms_per_call(split_step)
    print(
        f"\ntriton paged verification batch 4 x 9 queries, contexts to 8,192: single-pass {unsplit_ms:.3f} ms, "
        f"{splits} splits {split_ms:.3f} ms"
    )
    assert split_ms < unsplit_ms


_COMPILE_FOR_HOPPER = """
import os
os.environ.pop("TRITON_INTERPRET", None)
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from aiocb.runner.triton_attention import _choose_config, _paged_attention_kernel

names = _paged_attention_kernel.arg_names
pointers = {"block_table_ptr": "*i32", "query_start_ptr": "*i32", "seq_lens_ptr": "*i32",
            "part_ptr": "*fp32", "lse_ptr": "*fp32"}
floats = {"scale", "softcap"}
for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
    for max_query_len in (1, 9, 16):
        for split in (False, True):
            config = _choose_config(max_query_len, 2, 128, 256, dtype)
            block_n = min(config.block_n, 16) if split and dtype == torch.float32 else config.block_n
            values = {"GROUP": 2, "GROUP_PAD": 2, "HEAD_DIM": 128, "HEAD_DIM_PAD": 128, "PAGE_SIZE": 256,
                      "BLOCK_Q": config.block_m // 2, "BLOCK_M": config.block_m, "BLOCK_N": block_n,
                      "USE_SOFTCAP": False, "USE_WINDOW": False, "USE_RING": False,
                      "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32", "INTERPRETED": False,
                      "TILE_IN_PAGE": True, "SPLIT": split}
            signature = {n: "constexpr" if n in values else pointers.get(n, "*" + name if n.endswith("_ptr") else
                         ("fp32" if n in floats else "i32")) for n in names}
            constexprs = {(names.index(n),): v for n, v in values.items()}
            kernel = triton.compile(ASTSource(_paged_attention_kernel, signature, constexprs),
                                    target=GPUTarget("cuda", 90, 32),
                                    options={"num_warps": config.num_warps, "num_stages": config.num_stages})
            assert "cubin" in kernel.asm, sorted(kernel.asm)
            print("compiled", name, max_query_len, split)
"""


def test_the_kernel_compiles_for_the_h200() -> None:
    """Triton's interpreter runs what a GPU compiler may refuse: the paged kernel's tiles for
    Qwen3-0.6B's heads (a group of 2, head size 128, pages of 256) in bf16 and fp32, for
    decode rows and rows verifying 8 or 15 proposed tokens, split and not, are compiled
    ahead of time for sm_90 (Triton's own ptxas, no GPU)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE_FOR_HOPPER], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("compiled") == 12
