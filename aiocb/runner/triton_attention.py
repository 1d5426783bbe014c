"""A Triton paged-attention kernel that reads the KV cache in place through block tables.

One kernel serves every row of a step, decode rows (one new token) and prefill chunks
(several new tokens after a cached past) alike, so a mixed batch is one launch and no
keys are gathered into a dense copy first.

Layout (see :mod:`aiocb.runner.paged_cache`): per layer a K and a V tensor
``[num_blocks + 2, page_size, kv_heads, head_dim]``; the key at position ``p`` of row
``b`` lives in block ``block_table[b, p // page_size]`` at offset ``p % page_size``.

Work split: the grid is ``(rows, kv_heads, query tiles)``. A program owns ``BLOCK_Q``
consecutive query tokens of one row times the ``G = Hq // Hkv`` query heads that share
one KV head, flattened into a ``BLOCK_M = BLOCK_Q * G_PAD`` tile (token-major). Packing
the head group into the tile is what keeps decode efficient: a single token still gives
the matrix units ``G`` live rows, and each K/V tile is read from memory once for the
whole group. The program walks the row's keys in ``BLOCK_N`` tiles up to the causal
limit of its last query (from the window start of its first query when a sliding window
is set) with an online, flash-attention style softmax accumulated in fp32.

Split KV ("flash-decoding"): a decode step at small batch has fewer ``(row, KV head)``
programs than the GPU has SMs, each streaming a whole long context on its own. There the
launch adds a split axis: every query tile divides its key range into ``num_splits``
partitions (per row, from the row's own length, in whole ``BLOCK_N`` tiles so page
alignment is kept), each program writes its partial output normalised by its own softmax
sum plus the partition's log-sum-exp, and a second kernel merges the partials exactly:
``out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M)`` with ``M = max_s lse_s``.
:func:`choose_num_splits` decides from host ints only and splits decode-only steps
(``max_query_len == 1``); steps with prefill chunks keep the single-pass kernel (the
kernel itself splits any query tile, but a chunk's partials would be as large as its
queries, and its query tiles already multiply the programs).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from aiocb.runner.triton_support import interpreted, runs_on

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    HAS_TRITON = False

__all__ = [
    "DEFAULT_SM_COUNT",
    "HAS_TRITON",
    "MAX_SPLITS",
    "MIN_PARTITION",
    "choose_num_splits",
    "is_available",
    "triton_paged_attention",
]

#: SM count assumed where the tensors are not on a CUDA device (the interpreter on the CPU):
#: an H200's, so CPU runs take the decisions the target GPU would.
DEFAULT_SM_COUNT = 132
#: Fewest keys a split-KV partition covers: shorter ones would spend more on writing and
#: merging partials than they gain in parallelism.
MIN_PARTITION = 256
#: Most partitions per query tile (bounds the partial buffers and the merge's work).
MAX_SPLITS = 16
#: Most query tokens a row of a step that splits may hold: a decode row's one, or a row
#: verifying speculative proposals (its last token and up to 15 proposed ones), whose
#: keys are read once for all its queries, so splitting helps it as it does a decode row.
MOST_SPLIT_QUERIES = 16


if HAS_TRITON:

    @triton.jit  # type: ignore[untyped-decorator]
    def _attend_tile(  # type: ignore[no-untyped-def]
        start_n,
        q,
        q_pos,
        m_i,
        l_i,
        acc,
        kv_lo,
        kv_end,
        table_row,
        k_head,
        v_head,
        stride_kb,
        stride_kp,
        stride_vb,
        stride_vp,
        scale,
        softcap,
        window,
        ring_blocks,
        offs_n,
        offs_d,
        d_valid,
        PAGE_SIZE: tl.constexpr,
        USE_SOFTCAP: tl.constexpr,
        USE_WINDOW: tl.constexpr,
        USE_RING: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        UPCAST_DOT: tl.constexpr,
        TILE_IN_PAGE: tl.constexpr,
    ):
        """One BLOCK_N tile of keys: scores, mask, online-softmax update of (m_i, l_i, acc)."""
        key_pos = start_n + offs_n
        key_valid = key_pos < kv_end
        if USE_WINDOW:
            # Keys before the tile's first window start are never read: in a ring their
            # slots may hold a newer page not written that far (its values unset, and a
            # masked score's zero weight times a NaN value is NaN).
            key_valid = key_valid & (key_pos >= kv_lo)
        in_page = key_pos % PAGE_SIZE
        if TILE_IN_PAGE:
            # BLOCK_N divides the page and tiles start aligned: the whole tile is in one
            # block. One scalar lookup; per-element offsets stay int32 (fewer registers).
            column = start_n // PAGE_SIZE
            if USE_RING:
                column = column % ring_blocks
            block = tl.load(table_row + column).to(tl.int64)  # int64: big caches overflow int32
            k_tile = k_head + block * stride_kb
            v_tile = v_head + block * stride_vb
            k_ptrs = k_tile + in_page[None, :] * stride_kp + offs_d[:, None]
            v_ptrs = v_tile + in_page[:, None] * stride_vp + offs_d[None, :]
        else:
            # The tile may straddle pages: one block-table lookup per key.
            column = key_pos // PAGE_SIZE
            if USE_RING:
                column = column % ring_blocks
            blocks = tl.load(table_row + column, mask=key_valid, other=0).to(tl.int64)
            k_ptrs = k_head + blocks[None, :] * stride_kb + in_page[None, :] * stride_kp + offs_d[:, None]
            v_ptrs = v_head + blocks[:, None] * stride_vb + in_page[:, None] * stride_vp + offs_d[None, :]
        # K is loaded transposed, [D, N], ready for q @ k.
        k = tl.load(k_ptrs, mask=key_valid[None, :] & d_valid[:, None], other=0.0)
        if UPCAST_DOT:
            k = k.to(tl.float32)

        s = tl.dot(q, k, input_precision=DOT_PRECISION)
        if USE_SOFTCAP:
            s = s * scale
            # tanh through exp: libdevice (tl.extra.*.tanh) is missing in the interpreter.
            # exp(-2|x|) never overflows.
            x = s / softcap
            e = tl.exp(-2.0 * tl.abs(x))
            t = (1.0 - e) / (1.0 + e)
            s = tl.where(x < 0, -t, t) * softcap
            s = s * 1.4426950408889634  # log2(e): the softmax below runs on exp2
        else:
            s = s * (scale * 1.4426950408889634)

        visible = (key_pos[None, :] <= q_pos[:, None]) & key_valid[None, :]
        if USE_WINDOW:
            visible = visible & (key_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))

        # Online softmax in the log2 domain (exp2 is the native instruction).
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)

        v = tl.load(v_ptrs, mask=key_valid[:, None] & d_valid[None, :], other=0.0)
        # P is rounded to the cache dtype, as the tensor cores want both operands alike.
        p = p.to(v.dtype)
        if UPCAST_DOT:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None]
        acc = tl.dot(p, v, acc=acc, input_precision=DOT_PRECISION)
        return m_new, l_i, acc

    # Triton compiles a kernel anew for each integer argument's "equal to 1" and "divisible
    # by 16": the block table's width (an eager step's longest row, in pages) and the
    # split count (and the log-sum-exps' strides that follow it) change from step to step,
    # so a kernel specialised on them would be compiled again mid-serving (1.2 s on the
    # host, the loop stalled up to 75 ms through the GIL) for a run's first 2-page table.
    # Scalar loads gain nothing from the hints.
    @triton.jit(do_not_specialize=["num_splits", "stride_lt", "stride_lh", "stride_bt"])  # type: ignore[untyped-decorator]
    def _paged_attention_kernel(  # type: ignore[no-untyped-def]
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        out_ptr,
        part_ptr,
        lse_ptr,
        block_table_ptr,
        query_start_ptr,
        seq_lens_ptr,
        sinks_ptr,
        scale,
        softcap,
        window,
        ring_blocks,
        num_splits,
        min_partition,
        stride_qt,
        stride_qh,
        stride_ot,
        stride_oh,
        stride_pt,
        stride_ph,
        stride_ps,
        stride_lt,
        stride_lh,
        stride_kb,
        stride_kp,
        stride_kh,
        stride_vb,
        stride_vp,
        stride_vh,
        stride_bt,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        USE_SOFTCAP: tl.constexpr,
        USE_WINDOW: tl.constexpr,
        USE_RING: tl.constexpr,
        USE_SINKS: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        INTERPRETED: tl.constexpr,
        TILE_IN_PAGE: tl.constexpr,
        SPLIT: tl.constexpr,
    ):
        """Attention of one query tile of one row and KV head group over the paged keys.

        The grid is (query tile, KV head, row): the query tiles of a long prefill chunk on
        the first axis, the only one that may exceed 65,535 programs. Unsplit (``SPLIT``
        false) the program writes the final output. Split: the first axis is
        ``q_tile * num_splits + split``; the
        program covers one partition of the tile's keys and writes its normalised partial
        output to ``part_ptr`` and its log2-domain log-sum-exp to ``lse_ptr`` (``-inf`` for a
        partition with no visible key), for :func:`_merge_splits_kernel`, which adds the
        heads' sinks (``USE_SINKS``) to the merged denominators; unsplit, the program adds them.
        """
        row = tl.program_id(2)
        kv_head = tl.program_id(1)
        if SPLIT:
            q_tile = tl.program_id(0) // num_splits
            split = tl.program_id(0) % num_splits
        else:
            q_tile = tl.program_id(0)

        q_begin = tl.load(query_start_ptr + row)
        q_len = tl.load(query_start_ptr + row + 1) - q_begin
        # The grid is sized for the longest row; shorter rows (and q_len == 0 padding
        # rows) leave their surplus programs here without touching memory.
        if q_tile * BLOCK_Q >= q_len:
            return
        seq_len = tl.load(seq_lens_ptr + row)
        context_start = seq_len - q_len  # position of the row's first new token

        # Tile row m is query token m // GROUP_PAD of this tile, head m % GROUP_PAD of the group.
        offs_m = tl.arange(0, BLOCK_M)
        token = q_tile * BLOCK_Q + offs_m // GROUP_PAD
        group_idx = offs_m % GROUP_PAD
        head = kv_head * GROUP + group_idx
        row_valid = (token < q_len) & (group_idx < GROUP)
        q_pos = context_start + token

        offs_d = tl.arange(0, HEAD_DIM_PAD)
        d_valid = offs_d < HEAD_DIM

        q_rows = (q_begin + token).to(tl.int64)
        q_ptrs = q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=row_valid[:, None] & d_valid[None, :], other=0.0)
        if INTERPRETED:
            # The 3.6 interpreter multiplies bf16 operands of tl.dot as their raw uint16
            # bits; it gets fp32 operands (values rounded to the cache dtype first).
            q = q.to(tl.float32)

        # Keys this tile needs: up to its last query's position (causal), and from its
        # first query's window start on. The lower bound is aligned down to BLOCK_N so
        # tiles stay aligned to pages when BLOCK_N divides the page size.
        last_token = tl.minimum(q_len, (q_tile + 1) * BLOCK_Q)
        kv_end = context_start + last_token
        kv_lo = 0
        kv_begin = 0
        if USE_WINDOW:
            first_pos = context_start + q_tile * BLOCK_Q
            kv_lo = tl.maximum(first_pos - window + 1, 0)
            kv_begin = (kv_lo // BLOCK_N) * BLOCK_N
        # Keys this program walks: the whole range, or one partition of it. Partitions are
        # sized from this row's own range (not the step's longest), so a short row is not
        # left to one program while others idle, in whole BLOCK_N tiles from the (aligned)
        # range start so no tile straddles two partitions and tiles stay page-aligned. The
        # rounding can leave the last partitions short or empty; ``min_partition`` (a
        # multiple of BLOCK_N) leaves a short row in fewer, longer partitions.
        loop_begin = kv_begin
        loop_end = kv_end
        if SPLIT:
            part = tl.cdiv(tl.cdiv(kv_end - kv_begin, num_splits), BLOCK_N) * BLOCK_N
            part = tl.maximum(part, min_partition)
            loop_begin = kv_begin + split * part
            loop_end = tl.minimum(loop_begin + part, kv_end)

        # Running max starts finite (not -inf) so fully masked tiles give exp2(-inf) = 0
        # instead of exp2(-inf + inf) = NaN.
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)

        offs_n = tl.arange(0, BLOCK_N)
        table_row = block_table_ptr + row.to(tl.int64) * stride_bt
        k_head = k_cache_ptr + kv_head * stride_kh
        v_head = v_cache_ptr + kv_head * stride_vh
        if INTERPRETED:
            # Triton 3.6's interpreter converts range() bounds with int() on shape-[1]
            # arrays, which NumPy >= 2.4 rejects; a while loop compares instead. Compiled
            # kernels take the for loop (constexpr branch), which the compiler pipelines.
            start_n = loop_begin
            while start_n < loop_end:
                m_i, l_i, acc = _attend_tile(
                    start_n, q, q_pos, m_i, l_i, acc, kv_lo, kv_end, table_row, k_head, v_head,
                    stride_kb, stride_kp, stride_vb, stride_vp, scale, softcap, window, ring_blocks,
                    offs_n, offs_d, d_valid, PAGE_SIZE, USE_SOFTCAP, USE_WINDOW, USE_RING, DOT_PRECISION, INTERPRETED,
                    TILE_IN_PAGE,
                )  # fmt: skip
                start_n += BLOCK_N
        else:
            for start_n in range(loop_begin, loop_end, BLOCK_N):
                m_i, l_i, acc = _attend_tile(
                    start_n, q, q_pos, m_i, l_i, acc, kv_lo, kv_end, table_row, k_head, v_head,
                    stride_kb, stride_kp, stride_vb, stride_vp, scale, softcap, window, ring_blocks,
                    offs_n, offs_d, d_valid, PAGE_SIZE, USE_SOFTCAP, USE_WINDOW, USE_RING, DOT_PRECISION, INTERPRETED,
                    TILE_IN_PAGE,
                )  # fmt: skip

        # Unsplit, every valid row sees at least its own key, so l_i > 0 there; padding rows
        # of the tile are not stored but must not divide by zero either. Split, a partition
        # may hold no key a row can see (empty, before the window, after a prefill token's
        # causal limit): its partial is 0 with weight 2^-inf = 0 in the merge.
        if USE_SINKS and not SPLIT:
            # A head's sink joins the denominator and weighs no value (in the log2 domain,
            # as the running max; padding rows, whose max is still -1e30, add nothing).
            sink = tl.load(sinks_ptr + head, mask=row_valid, other=0.0) * 1.4426950408889634
            l_i = l_i + tl.where(row_valid, tl.exp2(sink - m_i), 0.0)
        seen = l_i > 0.0
        l_safe = tl.where(seen, l_i, 1.0)
        acc = acc / l_safe[:, None]
        if SPLIT:
            lse = tl.where(seen, m_i + tl.log2(l_safe), float("-inf"))
            lse_ptrs = lse_ptr + q_rows * stride_lt + head * stride_lh + split
            tl.store(lse_ptrs, lse, mask=row_valid)
            part_ptrs = (
                part_ptr + q_rows[:, None] * stride_pt + head[:, None] * stride_ph + split * stride_ps + offs_d[None, :]
            )
            tl.store(part_ptrs, acc, mask=row_valid[:, None] & d_valid[None, :])
        else:
            out_ptrs = out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_valid[None, :])

    @triton.jit(do_not_specialize=["num_splits", "stride_lt", "stride_lh"])  # type: ignore[untyped-decorator]
    def _merge_splits_kernel(  # type: ignore[no-untyped-def]
        part_ptr,
        lse_ptr,
        out_ptr,
        query_start_ptr,
        sinks_ptr,
        num_splits,
        stride_pt,
        stride_ph,
        stride_ps,
        stride_lt,
        stride_lh,
        stride_ot,
        stride_oh,
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr,
        SPLITS_PAD: tl.constexpr,
        USE_SINKS: tl.constexpr,
    ):
        """Exact merge of one query token's (grid: token of the row, query head, row) partials.

        With ``o_s`` each partition's output normalised by its own sum ``l_s`` and
        ``lse_s = m_s + log2(l_s)``, the full softmax weighs ``o_s`` by ``l_s 2^m_s``, i.e. by
        ``2^lse_s`` relative to any common shift; shifting by the largest keeps it in range.
        A head's sink (``USE_SINKS``) joins the denominator as one more such term, with no value.
        """
        t = tl.program_id(0)
        head = tl.program_id(1)
        row = tl.program_id(2)
        q_begin = tl.load(query_start_ptr + row)
        q_len = tl.load(query_start_ptr + row + 1) - q_begin
        if t >= q_len:  # grid sized for the longest row; rows of out owned by none stay as they are
            return
        token = (q_begin + t).to(tl.int64)

        offs_s = tl.arange(0, SPLITS_PAD)
        s_valid = offs_s < num_splits
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        d_valid = offs_d < HEAD_DIM
        lse = tl.load(lse_ptr + token * stride_lt + head * stride_lh + offs_s, mask=s_valid, other=float("-inf"))
        # A valid token sees its own key, so one partition at least has a finite lse.
        peak = tl.max(lse, 0)
        weight = tl.exp2(lse - peak)
        part_ptrs = part_ptr + token * stride_pt + head * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :]
        parts = tl.load(part_ptrs, mask=s_valid[:, None] & d_valid[None, :], other=0.0)
        total = tl.sum(weight, 0)
        if USE_SINKS:
            total += tl.exp2(tl.load(sinks_ptr + head) * 1.4426950408889634 - peak)
        merged = tl.sum(parts * weight[:, None], 0) / total
        out_ptrs = out_ptr + token * stride_ot + head * stride_oh + offs_d
        tl.store(out_ptrs, merged.to(out_ptr.dtype.element_ty), mask=d_valid)


def is_available(device: torch.device) -> bool:
    """Whether :func:`triton_paged_attention` can run on tensors of ``device``: on CUDA when triton
    imports, on the CPU in Triton's interpreter (see :mod:`aiocb.runner.triton_support`)."""
    return runs_on(_paged_attention_kernel if HAS_TRITON else None, device)


@dataclass(frozen=True, slots=True)
class _Config:
    """Tile sizes and launch options."""

    block_m: int  # query rows per program: BLOCK_Q tokens x GROUP_PAD heads
    block_n: int  # keys per inner-loop tile
    num_warps: int
    num_stages: int
    num_splits: int = 1  # key partitions per query tile; 1 is the single-pass kernel
    min_partition: int = 0  # fewest keys per partition when split (rounded up to block_n)


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1


def _choose_config(
    max_query_len: int, group_pad: int, head_dim_pad: int, page_size: int, dtype: torch.dtype
) -> _Config:
    """Pick tiles from the step's shape (host ints only: no device sync).

    Sizes were checked by compiling for sm_90 (no spills, cp.async pipelining, wgmma for
    64-row tiles), not tuned by timing.
    """
    # tl.dot needs every dim >= 16. Decode-only steps fill the tile with the head group;
    # longer chunks get a taller tile so each K/V tile is reused across more queries.
    wide = head_dim_pad > 128
    if dtype == torch.float32:
        # fp32 goes through exact (FMA, not tensor-core) dots: small tiles or it spills.
        tall, block_n, stages = 16, (16 if wide else 32), (1 if wide else 2)
    else:
        tall, block_n, stages = (32 if wide else 64), (32 if wide else 64), 2
    block_m = max(16, group_pad, min(tall, _next_pow2(max_query_len * group_pad)))
    if page_size >= 16 and page_size & (page_size - 1) == 0:
        # Keep each K/V tile inside one page (aligned tiles never straddle): one
        # block-table entry per tile.
        block_n = min(block_n, page_size)
    return _Config(block_m=block_m, block_n=block_n, num_warps=4, num_stages=stages)


def choose_num_splits(
    num_rows: int,
    num_kv_heads: int,
    max_query_len: int,
    max_kv_len: int,
    num_sms: int,
    *,
    min_partition: int = MIN_PARTITION,
    max_splits: int = MAX_SPLITS,
) -> int:
    """How many key partitions each ``(row, KV head)`` of a step gets (1: no split).

    Only steps whose rows hold at most :data:`MOST_SPLIT_QUERIES` query tokens split:
    decode steps, and steps that verify speculative proposals (the last token and the
    proposed ones); a step with longer prefill chunks already has a program per query tile,
    and its partial outputs would be as large as its queries. Such a step has at least
    ``num_rows * num_kv_heads`` programs; once that reaches two per SM (``num_sms``) the
    GPU is busy and splitting only adds the merge. Below it, the splits bring the count up
    to about two programs per SM (each SM then has loads of several programs in flight),
    but no partition of the longest key range (``max_kv_len``) gets fewer than
    ``min_partition`` keys and no tile more than ``max_splits`` partitions. Host ints only,
    so choosing never waits on the device.
    """
    if max_query_len > MOST_SPLIT_QUERIES or num_rows <= 0 or num_kv_heads <= 0 or max_kv_len <= 0:
        return 1
    programs = num_rows * num_kv_heads
    target = 2 * max(1, num_sms)
    if programs >= target:
        return 1
    wanted = -(-target // programs)
    by_length = -(-max_kv_len // max(1, min_partition))
    return max(1, min(wanted, by_length, max_splits))


@functools.cache
def _sm_count(device: torch.device) -> int:
    """The device's SM count (a cached host query), :data:`DEFAULT_SM_COUNT` off CUDA."""
    if device.type != "cuda":
        return DEFAULT_SM_COUNT
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def triton_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    softcap: float | None = None,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    *,
    ring_blocks: int | None = None,
    max_seq_len: int | None = None,
    num_sms: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal paged attention of a step's flat queries over the cache, ``-> [T, Hq, D]``.

    ``query [T, Hq, D]`` holds every scheduled token back to back; row ``b`` owns
    ``query[query_start[b]:query_start[b + 1]]`` (``q_len`` tokens, possibly 0), at
    positions ``seq_lens[b] - q_len .. seq_lens[b] - 1``. The step's new K/V must already
    be in ``key_cache``/``value_cache`` (``[num_blocks + 2, page_size, Hkv, D]``), reached
    through ``block_table [B, max_blocks]`` (int32). Each query attends to its row's keys
    at positions ``<= its own`` (and ``> its own - sliding_window`` when given), with
    query head ``h`` reading KV head ``h // (Hq // Hkv)``. ``softcap`` applies
    ``tanh(s / c) * c`` to the scaled logits before masking. ``sinks [Hq]`` (gpt-oss's),
    when given, join each head's softmax denominator as one more logit that weighs no
    value. Accumulation is fp32.

    ``max_query_len`` (a host int, ``>= max q_len``) sizes the grid, so the launch needs
    no device-to-host sync. ``ring_blocks`` is for sliding-window cache groups whose
    block table is a ring (aiocb's layout): the key at ``p`` is then in column
    ``(p // page_size) % ring_blocks``; the caller must make sure no key a query needs was
    overwritten by a later token of the same step.

    Steps of decode rows (or of rows verifying a few proposed tokens) at small batch split
    each row's keys across several programs (see :func:`choose_num_splits`); the results
    are the same up to fp32 rounding. The choice uses ``max_seq_len`` (a host int, ``>= max
    seq_lens``; by default the block table's width in tokens, which bounds it without
    reading ``seq_lens``) and ``num_sms`` (by default the device's SM count,
    :data:`DEFAULT_SM_COUNT` off CUDA). Only the split count depends on them, never which
    keys a query reads: any values are correct, and a CUDA graph captured with an upper
    bound stays correct for shorter contexts.

    Rows not covered by any query (and the rows of ``out`` belonging to no row) are left
    untouched in ``out``.
    """
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed")
    if query.dim() != 3 or key_cache.dim() != 4:
        raise ValueError("expected query [T, Hq, D] and caches [blocks, page, Hkv, D]")
    _, num_heads, head_dim = query.shape
    _, page_size, num_kv_heads, cache_dim = key_cache.shape
    if value_cache.shape != key_cache.shape:
        raise ValueError("key_cache and value_cache shapes differ")
    if cache_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"incompatible heads: query {tuple(query.shape)}, cache {tuple(key_cache.shape)}")
    if not query.dtype == key_cache.dtype == value_cache.dtype:
        raise ValueError(f"query {query.dtype} and caches {key_cache.dtype}/{value_cache.dtype} differ")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError("sliding_window must be >= 1")
    if sinks is not None:
        if sinks.shape != (num_heads,):
            raise ValueError(f"sinks must hold one value per query head ({num_heads}), not {tuple(sinks.shape)}")
        sinks = sinks.to(query.device, torch.float32).contiguous()
    group = num_heads // num_kv_heads

    # The kernel indexes the head dim with unit stride.
    if query.stride(-1) != 1:
        query = query.contiguous()
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("the caches' head dim must be contiguous")
    if out is None:
        out = torch.empty_like(query)
    elif out.shape != query.shape or out.stride(-1) != 1:
        raise ValueError("out must have the query's shape and a contiguous head dim")
    block_table = block_table if block_table.stride(-1) == 1 else block_table.contiguous()

    num_rows = block_table.shape[0]
    if num_rows == 0 or max_query_len <= 0 or query.shape[0] == 0:
        return out

    group_pad = _next_pow2(group)
    head_dim_pad = max(16, _next_pow2(head_dim))
    config = _choose_config(max_query_len, group_pad, head_dim_pad, page_size, query.dtype)
    if max_seq_len is None:
        max_seq_len = block_table.shape[1] * page_size
    max_kv_len = max_seq_len
    if sliding_window is not None:
        # A decode query reads its window, plus the tile-alignment slack before it.
        max_kv_len = min(max_kv_len, sliding_window + config.block_n - 1)
    splits = choose_num_splits(
        num_rows, num_kv_heads, max_query_len, max_kv_len, _sm_count(query.device) if num_sms is None else num_sms
    )
    if splits > 1:
        config = replace(config, num_splits=splits, min_partition=MIN_PARTITION)
        if query.dtype == torch.float32:
            # Compiled for sm_90, the split variant of the exact-fp32 kernel spills with
            # 32-key tiles at two stages; 16-key tiles do not.
            config = replace(config, block_n=min(config.block_n, 16))
    return _launch(
        query, key_cache, value_cache, block_table, query_start, seq_lens, max_query_len, scale,
        softcap, sliding_window, ring_blocks, out, config, sinks,
    )  # fmt: skip


def _launch(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    softcap: float | None,
    sliding_window: int | None,
    ring_blocks: int | None,
    out: torch.Tensor,
    config: _Config,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch with explicit tiles and splits (tests use it to force small, multi-tile and
    split shapes; any ``num_splits`` works for any step, prefill chunks included)."""
    split = config.num_splits > 1
    partials, lse = _launch_partitions(
        query, key_cache, value_cache, block_table, query_start, seq_lens, max_query_len, scale,
        softcap, sliding_window, ring_blocks, out, config, sinks,
    )  # fmt: skip
    if split:
        _merge_partitions(partials, lse, out, query_start, block_table.shape[0], max_query_len, sinks)
    return out


#: CUDA's limit on the programs along a grid's second and third axes (the first's is 2^31 - 1)
GRID_YZ_LIMIT = 65_535


def _grid(x: int, y: int, z: int) -> tuple[int, int, int]:
    """A launch grid, refused with a clear error where CUDA would fail to launch it."""
    if max(y, z) > GRID_YZ_LIMIT:
        raise ValueError(f"a grid of {(x, y, z)} programs exceeds CUDA's {GRID_YZ_LIMIT} on its second or third axis")
    return (x, y, z)


def _launch_partitions(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    softcap: float | None,
    sliding_window: int | None,
    ring_blocks: int | None,
    out: torch.Tensor,
    config: _Config,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention kernel alone. Unsplit it writes ``out``; split it returns the partial
    outputs ``[T, Hq, S, D]`` (fp32, each normalised by its own softmax sum) and their
    log2-domain log-sum-exps ``[T, Hq, S]`` (``-inf`` where a partition saw no key) and
    leaves ``out`` alone. Tests read the partials to see that a step really split."""
    num_heads, head_dim = query.shape[1:]
    page_size, num_kv_heads = key_cache.shape[1:3]
    group = num_heads // num_kv_heads
    group_pad = _next_pow2(group)
    if config.block_m % group_pad or config.block_m < 16 or config.block_n < 16:
        raise ValueError(f"bad tiles {config} for a head group of {group}")
    if config.num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {config.num_splits}")
    split = config.num_splits > 1
    block_q = config.block_m // group_pad
    if split:
        # Rows of queries owned by no request are never written (the merge skips them too).
        partials = torch.empty(
            (query.shape[0], num_heads, config.num_splits, head_dim), device=query.device, dtype=torch.float32
        )
        lse = torch.empty((query.shape[0], num_heads, config.num_splits), device=query.device, dtype=torch.float32)
    else:  # never read: the kernel's pointers need some tensor
        partials = lse = out
    min_partition = triton.cdiv(max(config.min_partition, 1), config.block_n) * config.block_n
    grid = _grid(triton.cdiv(max_query_len, block_q) * config.num_splits, num_kv_heads, block_table.shape[0])
    _paged_attention_kernel[grid](
        query,
        key_cache,
        value_cache,
        out,
        partials,
        lse,
        block_table,
        query_start,
        seq_lens,
        out if sinks is None else sinks,  # (never read without sinks: the pointer needs some tensor)
        float(scale),
        float(softcap) if softcap else 1.0,
        int(sliding_window) if sliding_window is not None else 0,
        int(ring_blocks) if ring_blocks is not None else 1,
        config.num_splits,
        min_partition,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        partials.stride(0),
        partials.stride(1),
        partials.stride(2) if split else 0,
        lse.stride(0),
        lse.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_table.stride(0),
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, _next_pow2(head_dim)),
        PAGE_SIZE=page_size,
        BLOCK_Q=block_q,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        USE_SOFTCAP=bool(softcap),
        USE_WINDOW=sliding_window is not None,
        USE_RING=ring_blocks is not None,
        USE_SINKS=sinks is not None,
        # fp32 inputs would otherwise go through TF32 tensor cores on the GPU (~1e-3 error).
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        INTERPRETED=interpreted(_paged_attention_kernel),
        TILE_IN_PAGE=page_size % config.block_n == 0,
        SPLIT=split,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return partials, lse


def _merge_partitions(
    partials: torch.Tensor,
    lse: torch.Tensor,
    out: torch.Tensor,
    query_start: torch.Tensor,
    num_rows: int,
    max_query_len: int,
    sinks: torch.Tensor | None = None,
) -> None:
    """Merge :func:`_launch_partitions`' split results into ``out`` (only the rows' tokens)."""
    num_tokens, num_heads, num_splits, head_dim = partials.shape
    if num_tokens == 0:
        return
    _merge_splits_kernel[_grid(max_query_len, num_heads, num_rows)](
        partials,
        lse,
        out,
        query_start,
        out if sinks is None else sinks,
        num_splits,
        partials.stride(0),
        partials.stride(1),
        partials.stride(2),
        lse.stride(0),
        lse.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, _next_pow2(head_dim)),
        # (one variant for every count up to MAX_SPLITS: a constexpr per count would be
        # compiled mid-serving the first time a step split that many ways)
        SPLITS_PAD=max(MAX_SPLITS, _next_pow2(num_splits)),
        USE_SINKS=sinks is not None,
        num_warps=4 if head_dim > 64 else 2,
    )
