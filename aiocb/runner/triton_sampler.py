"""A Triton sampler: :func:`~aiocb.runner.draw.draw_full`'s pick without sorting the vocabulary.

One program per row. Noise is the hash of :mod:`aiocb.runner.noise`, computed in
registers (never stored). A row's support after top-k, top-p and min-p is an upper set
of its scaled logits ``s = l / T``: every token with ``s`` at least some threshold. The
Gumbel-max winner over the support is then the winner over any superset whose winner
lies in the support, which gives a sorting-free rejection loop (FlashInfer's rejection
sampling, with fixed noise instead of fresh draws):

1. One pass: the row max ``m``, the top-k set's mass ``Z_k = sum exp(s - m)`` and the
   winner ``c = argmax(s + g)`` over the top-k set.
2. While ``c`` may be outside the support: one pass for the mass of the tokens above
   ``c`` (its top-p test: ``mass < top_p * Z_k``; no noise), and only if the test fails
   (or ``c`` fails min-p), one more for the winner among the tokens above ``c`` that pass
   top-k and min-p (the support lies above a rejected candidate), the next candidate.

Top-k enters as a per-row threshold on the raw logits (the k-th largest, from
:func:`largest`), so a candidate is always in the top-k set,
and min-p as ``s - m >= log(min_p)`` (:func:`~aiocb.runner.draw.draw`'s form), known
once ``m`` is. Rows without top-p need one pass, or two when the first winner fails
min-p; rows with top-p two (the second without noise), two more each time a candidate
falls outside the nucleus. Noise is computed only in blocks that hold an eligible token:
in the first pass a top-k row skips the blocks without a top-k token, in a winner pass
every row skips the blocks without a token above its candidate (most of them, past a
peaked row's head), as a mass pass does. And the noise's two logarithms, most of its
cost, are taken only in blocks where some token's hash leaves it a chance to beat the best
score so far (``_block_winner``): a few blocks a row.

A top-k row whose top-k set, ties included, lies within its :data:`_LANES` largest logits
(those :func:`largest` found for its threshold; the usual top-k of 50 or less, unless more
than a dozen logits tie at the k-th) skips the vocabulary altogether: the support is
computed over those lanes at once (each lane's mass above it, a ``[lanes, lanes]``
comparison) and the winner drawn among them, with the noise of their ids. Its pick is the
one the passes would make, since every token of its support is a lane.

Ties (common in a bf16 model's upcast logits): at a top-k tie (several tokens equal to
the k-th largest logit) this keeps all of them, and tokens tied with a candidate are not
ranked before it for top-p, so a tie at the nucleus's edge stays whole, as in
``draw_full``. Rows with ``top_p >= 1`` skip the top-p test. The two differ only where
a float32 test lands within rounding of its threshold. On the GPU the division is the
IEEE-rounded one (``div_rn``) and the logarithm libdevice's, as torch computes them
there, so the scores should match torch's bit for bit (the ``gpu`` test compares the
picks); the masses use Triton's fast exponential, which can matter only at a threshold.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import NamedTuple

import torch

from aiocb.runner.noise import GUMBEL_BOUND
from aiocb.runner.triton_support import interpreted, runs_on

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    HAS_TRITON = False

__all__ = ["HAS_TRITON", "LOGITS_DTYPES", "compile_draw", "is_available", "triton_draw", "triton_noise"]

#: Logits per block on the GPU and the launch width that goes with it (sm_90: 73 to 80
#: registers a thread by ptxas, no spills; not tuned by timing).
_BLOCK = 2048
_NUM_WARPS = 8
#: Largest logits a top-k row may draw from without reading its vocabulary (a power of two:
#: a top-k of 50, the most common, with 14 to spare for logits tied at the 50th).
_LANES = 64
#: The logits' dtypes :func:`triton_draw` reads.
LOGITS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


if HAS_TRITON:
    #: Above every Gumbel noise of the hash (noise.GUMBEL_BOUND), as a kernel constant.
    _NOISE_CEILING = tl.constexpr(GUMBEL_BOUND)

    @triton.jit
    def _mix32(x):  # type: ignore[no-untyped-def]
        """lowbias32 on uint32 (multiplies wrap mod 2**32), as noise._mix32 computes on int32 bits."""
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x846CA68B
        return x ^ (x >> 16)

    @triton.jit
    def _row_keys(seed_ptr, offset_ptr, row):  # type: ignore[no-untyped-def]
        """The two per-row keys of noise.random_bits_at."""
        seed = tl.load(seed_ptr + row).to(tl.uint32)  # (32-bit values in int64)
        # int64 addition, then truncation: (offset + 0x9E3779B9) mod 2**32.
        offset = (tl.load(offset_ptr + row) + 0x9E3779B9).to(tl.uint32)
        row_key = _mix32(_mix32(seed) ^ _mix32(_mix32(offset)))
        return row_key, _mix32(row_key ^ 0x5BD1E995)

    @triton.jit  # type: ignore[untyped-decorator]
    def _log(x, PRECISE: tl.constexpr):  # type: ignore[no-untyped-def]
        # libdevice's logf is the one torch uses on CUDA; the interpreter has no libdevice.
        if PRECISE:
            return libdevice.log(x)
        else:
            return tl.log(x)

    @triton.jit
    def _bits(ids, row_key, second_key):  # type: ignore[no-untyped-def]
        """noise.random_bits_at at vocabulary ids ``ids`` (uint32)."""
        return _mix32(_mix32(ids.to(tl.uint32) ^ row_key) ^ second_key)

    @triton.jit  # type: ignore[untyped-decorator]
    def _gumbel(bits, PRECISE: tl.constexpr):  # type: ignore[no-untyped-def]
        """noise.gumbel_of_bits: the same float32 operations in the same order."""
        x = ((bits ^ 0xFFFFFFFF).to(tl.float32) + 0.5) * 2.3283064365386963e-10  # (~bits; times 2**-32: exact)
        x = tl.minimum(x, 0.99999994039535522)  # (float32's largest below 1)
        w = 1.0 - x
        whole = w == 1.0  # (no 0 / 0 in the branch not taken: the interpreter evaluates both)
        ratio = tl.where(whole, 1.0, tl.div_rn(-_log(w, PRECISE), tl.where(whole, 1.0, 1.0 - w)))
        return -_log(x * ratio, PRECISE)

    @triton.jit  # type: ignore[untyped-decorator]
    def _noise_kernel(  # type: ignore[no-untyped-def]
        seed_ptr,
        offset_ptr,
        bits_ptr,
        noise_ptr,
        VOCAB: tl.constexpr,
        BLOCK: tl.constexpr,
        PRECISE: tl.constexpr,
    ):
        row = tl.program_id(0)
        row_key, second_key = _row_keys(seed_ptr, offset_ptr, row)
        base = row.to(tl.int64) * VOCAB
        for start in range(0, VOCAB, BLOCK):
            ids = start + tl.arange(0, BLOCK)
            bits = _bits(ids, row_key, second_key)
            noise = _gumbel(bits, PRECISE)
            tl.store(bits_ptr + base + ids, bits.to(tl.int64), mask=ids < VOCAB)
            tl.store(noise_ptr + base + ids, noise, mask=ids < VOCAB)

    @triton.jit  # type: ignore[untyped-decorator]
    def _block_winner(  # type: ignore[no-untyped-def]
        eligible, logits, temperature, top, ids, start, best, cand, row_key, second_key, PRECISE: tl.constexpr
    ):
        """Fold one block's ``argmax(logits / temperature + noise)`` over ``eligible`` into
        ``(best, cand)``, taking the noise's logarithms only in a block where some token may
        beat ``best`` (``top``: at least the block's largest eligible scaled logit).

        A token's noise ``-log(E)``, with ``E = -log(1 - x)`` (:func:`_gumbel`), is at most
        ``-log(x)`` (as ``E >= x``), so it can beat ``best`` only if ``x < exp(scaled -
        best)``: the hash and one fast
        exponential a token instead of two logarithms, and past a row's first blocks few
        blocks hold such a token (the chance that a block beats the best of those before it
        falls as the best grows: about 5 blocks of 75 take logarithms in a row of 151,936
        random logits). The test divides by a product with the reciprocal, the scores by
        the IEEE-rounded division (only where logarithms are taken). The slack (in the
        exponent) covers the rounding of the scores, of that product, of the fast
        exponential and of the logarithms, so a dropped token could not have won. A block
        whose largest value could not win even with the largest noise skips the hash too.
        (A NaN logit's pick is unspecified here, as it was before.)
        """
        bar = best - (0.01 + tl.minimum(tl.abs(best), 3.0e38) * 1e-6)  # (-inf best: -inf bar)
        if top + _NOISE_CEILING > bar:  # (never with a best of +inf: nothing beats it)
            bits = _bits(ids, row_key, second_key)
            may_win = eligible
            if bar > float("-inf"):  # (before a row's first score every token may win)
                x = ((bits ^ 0xFFFFFFFF).to(tl.float32) + 0.5) * 2.3283064365386963e-10  # (_gumbel's x)
                # (capped far above any x: the exponential stays finite)
                near = logits * (1.0 / temperature) - bar
                may_win = eligible & (x < tl.exp(tl.minimum(near, 20.0)))
            if tl.max(may_win.to(tl.int32), 0) > 0:
                scaled = tl.math.div_rn(logits, temperature)
                score = tl.where(eligible, scaled + _gumbel(bits, PRECISE), float("-inf"))
                block_best = tl.max(score, 0)
                # Leftmost in a block, strictly greater across blocks: the first index among
                # ties, as torch's argmax.
                take = block_best > best
                cand = tl.where(take, start + tl.argmax(score, 0, tie_break_left=True), cand)
                best = tl.maximum(best, block_best)
        return best, cand

    @triton.jit  # type: ignore[untyped-decorator]
    def _lanes_pick(  # type: ignore[no-untyped-def]
        values_ptr,
        ids_ptr,
        width,
        threshold,
        temperature,
        top_p,
        log_min_p,
        row_key,
        second_key,
        LANES: tl.constexpr,
        USE_TOP_P: tl.constexpr,
        PRECISE: tl.constexpr,
    ):
        """The pick of a top-k row from its ``width`` largest logits ``values`` (decreasing)
        at vocabulary ids ``ids``, which hold its whole top-k set: the Gumbel winner over the
        support, computed over the lanes at once."""
        lanes = tl.arange(0, LANES)
        valid = lanes < width
        logits = tl.load(values_ptr + lanes, mask=valid, other=float("-inf")).to(tl.float32)
        ids = tl.load(ids_ptr + lanes, mask=valid, other=0).to(tl.int32)
        scaled = tl.math.div_rn(logits, temperature)
        m = tl.max(scaled, 0)  # (the row's largest logit is lane 0)
        # `scaled >= m` keeps a +inf logit's lane, which `inf - inf` (NaN) would drop.
        support = valid & (logits >= threshold) & ((scaled >= m) | ((scaled - m) >= log_min_p))
        if USE_TOP_P:
            # A lane's mass is that of the tokens strictly above it over the top-k set's:
            # both sums lie within the lanes (a token above a top-k token is one).
            weight = tl.where(valid & (logits >= threshold), tl.where(scaled >= m, 1.0, tl.exp(scaled - m)), 0.0)
            above = tl.sum(tl.where(scaled[None, :] > scaled[:, None], weight[None, :], 0.0), 1)
            bound = tl.where(top_p < 1.0, top_p * tl.sum(weight, 0), float("inf"))  # (top_p 1: no test)
            # (below top_p, as transformers; the largest always, however small top_p is)
            support = support & ((above < bound) | (above == 0.0))
        noise = _gumbel(_bits(ids, row_key, second_key), PRECISE)
        score = tl.where(support, scaled + noise, float("-inf"))
        best = tl.max(score, 0)
        # The first vocabulary id among tied scores, as the passes (and torch's argmax) pick.
        return tl.min(tl.where(valid & (score == best), ids, 2147483647), 0)

    @triton.jit  # type: ignore[untyped-decorator]
    def _vocabulary_pick(  # type: ignore[no-untyped-def]
        row_ptr,
        threshold,
        temperature,
        top_p,
        log_min_p,
        row_key,
        second_key,
        VOCAB: tl.constexpr,
        BLOCK: tl.constexpr,
        USE_TOP_P: tl.constexpr,
        PRECISE: tl.constexpr,
    ):
        """A row's pick in passes over its vocabulary (the module's steps 1 and 2)."""
        offs = tl.arange(0, BLOCK)

        # Pass 1: row max, top-k mass (online: rescaled as the max grows) and the winner
        # over the top-k set. A finite start keeps exp(m - m_new) finite on -inf blocks.
        m = -1.0e30
        mass_k = 0.0
        best = float("-inf")
        cand = tl.zeros((), tl.int32)  # torch's argmax of an all -inf row
        for start in range(0, VOCAB, BLOCK):
            ids = start + offs
            logits = tl.load(row_ptr + ids, mask=ids < VOCAB, other=float("-inf")).to(tl.float32)
            in_k = logits >= threshold
            # The block's largest scaled logit, with one division: the IEEE-rounded one (as
            # torch's logits / temperature; `/` may lower to an approximation) is monotone.
            top = tl.math.div_rn(tl.max(logits, 0), temperature)
            m_new = tl.maximum(m, top)
            if USE_TOP_P:
                # (a mass: the product with the reciprocal, as rounded as the fast exponential)
                scaled = logits * (1.0 / temperature)
                mass_k = mass_k * tl.exp(m - m_new) + tl.sum(tl.where(in_k, tl.exp(scaled - m_new), 0.0), 0)
            m = m_new
            # Outside the top-k set no noise is needed (most blocks of a top-k row).
            if tl.max(in_k.to(tl.int32), 0) > 0:
                best, cand = _block_winner(
                    in_k, logits, temperature, top, ids, start, best, cand, row_key, second_key, PRECISE
                )

        # draw_full keeps a token when the mass ranked before it is below top_p (the tokens
        # tied with it are not before it).
        bound = top_p * mass_k
        nucleus = top_p < 1.0
        cand_logit = tl.load(row_ptr + cand).to(tl.float32)
        cand_scaled = tl.math.div_rn(cand_logit, temperature)
        passes_min_p = (cand_scaled - m) >= log_min_p
        pending = (~passes_min_p) | nucleus
        while pending:
            # The candidate's top-p test first, one pass summing the mass above it: no noise,
            # which is most of a pass's work where many tokens lie above the candidate (a
            # flat row), and most candidates pass. A candidate that fails min-p moves anyway.
            accepted = passes_min_p
            if USE_TOP_P:  # noqa: SIM102 (a compile-time branch, then a run-time one)
                if passes_min_p:
                    above_mass = 0.0
                    for start in range(0, VOCAB, BLOCK):
                        ids = start + offs
                        logits = tl.load(row_ptr + ids, mask=ids < VOCAB, other=float("-inf")).to(tl.float32)
                        # Past a peaked row's head most blocks hold nothing above the candidate,
                        # which their logits tell without a division: the rounded division is
                        # monotone, so a score above the candidate's comes of a larger logit.
                        if tl.max((logits > cand_logit).to(tl.int32), 0) > 0:
                            scaled = tl.math.div_rn(logits, temperature)
                            above = scaled > cand_scaled
                            above_mass += tl.sum(tl.where(above, tl.exp(scaled - m), 0.0), 0)
                    accepted = (above_mass < bound) | (above_mass == 0.0)  # (the largest always)
            # Only for a rejected candidate, a pass for the winner among the tokens above it
            # that pass top-k and min-p (the support lies above a rejected candidate).
            next_best = float("-inf")
            next_cand = cand
            rejected = ~accepted
            if rejected:
                for start in range(0, VOCAB, BLOCK):
                    ids = start + offs
                    logits = tl.load(row_ptr + ids, mask=ids < VOCAB, other=float("-inf")).to(tl.float32)
                    if tl.max((logits > cand_logit).to(tl.int32), 0) > 0:  # (as in the test above)
                        scaled = tl.math.div_rn(logits, temperature)
                        eligible = (scaled > cand_scaled) & (logits >= threshold) & ((scaled - m) >= log_min_p)
                        if tl.max(eligible.to(tl.int32), 0) > 0:
                            top = tl.max(tl.where(eligible, scaled, float("-inf")), 0)
                            next_best, next_cand = _block_winner(
                                eligible, logits, temperature, top, ids, start, next_best, next_cand,
                                row_key, second_key, PRECISE,
                            )  # fmt: skip
            # The row max is always in the support, so a rejected candidate has an eligible
            # token above it; the guard only ends the loop on invalid parameters (min_p > 1).
            move = rejected & (next_best > float("-inf"))
            cand = tl.where(move, next_cand, cand)
            cand_logit = tl.load(row_ptr + cand).to(tl.float32)
            cand_scaled = tl.math.div_rn(cand_logit, temperature)
            # A new candidate passes top-k and min-p by construction: only top-p is left.
            passes_min_p = passes_min_p | move
            pending = move & nucleus
        return cand

    # The per-row parameters arrive as views into one packed buffer (HostToDevice), whose
    # offsets depend on the batch's size: a kernel specialised on their 16-byte alignment
    # would be compiled again, mid-serving, for each alignment a batch happens to give them
    # (the warm-up's compile_draw could not cover them all). One-element loads gain nothing
    # from it; the lanes' loads little (64 values a row), and without top-k some of those
    # views stand in for them.
    @triton.jit(  # type: ignore[untyped-decorator]
        do_not_specialize_on_alignment=[
            "temperature_ptr", "seed_ptr", "offset_ptr", "threshold_ptr", "top_p_ptr", "log_min_p_ptr", "out_ptr",
            "values_ptr", "ids_ptr", "lanes_ptr",
        ],
        do_not_specialize=["width", "use_min_p"],
    )  # fmt: skip
    def _sample_kernel(  # type: ignore[no-untyped-def]
        logits_ptr,
        stride_row,
        temperature_ptr,
        seed_ptr,
        offset_ptr,
        threshold_ptr,
        top_p_ptr,
        log_min_p_ptr,
        out_ptr,
        values_ptr,
        ids_ptr,
        lanes_ptr,
        width,
        use_min_p,
        VOCAB: tl.constexpr,
        BLOCK: tl.constexpr,
        LANES: tl.constexpr,
        USE_TOP_K: tl.constexpr,
        USE_TOP_P: tl.constexpr,
        PRECISE: tl.constexpr,
    ):
        row = tl.program_id(0)
        temperature = tl.load(temperature_ptr + row)
        row_key, second_key = _row_keys(seed_ptr, offset_ptr, row)
        threshold = float("-inf")  # the smallest raw logit of the top-k set
        on_lanes = tl.zeros((), tl.int32)
        if USE_TOP_K:
            threshold = tl.load(threshold_ptr + row).to(tl.float32)
            on_lanes = tl.load(lanes_ptr + row).to(tl.int32)
        # Min-p is a run-time flag (a load and a compare where it is on), not a variant of
        # its own: each variant is a compile at warm-up, for each dtype of logits.
        log_min_p = float("-inf")
        if use_min_p != 0:
            log_min_p = tl.load(log_min_p_ptr + row)
        top_p = 1.0
        if USE_TOP_P:
            top_p = tl.load(top_p_ptr + row)
        if on_lanes != 0:
            lane_base = row.to(tl.int64) * width
            cand = _lanes_pick(
                values_ptr + lane_base, ids_ptr + lane_base, width, threshold, temperature, top_p, log_min_p,
                row_key, second_key, LANES, USE_TOP_P, PRECISE,
            )  # fmt: skip
        else:
            cand = _vocabulary_pick(
                logits_ptr + row.to(tl.int64) * stride_row, threshold, temperature, top_p, log_min_p,
                row_key, second_key, VOCAB, BLOCK, USE_TOP_P, PRECISE,
            )  # fmt: skip
        tl.store(out_ptr + row, cand.to(tl.int64))


def is_available(device: torch.device) -> bool:
    """Whether :func:`triton_draw` can run on tensors of ``device``: on CUDA when triton
    imports, on the CPU in Triton's interpreter (see :mod:`aiocb.runner.triton_support`)."""
    return runs_on(_sample_kernel if HAS_TRITON else None, device)


def top_k_thresholds(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int | None = None) -> torch.Tensor:
    """Each row's k-th largest logit (``-inf`` where ``top_k`` is 0 or at least the vocabulary).

    ``max_top_k`` (a host int, so no synchronisation) is at least every row's ``top_k``
    below the vocabulary size; None takes the whole row (a sort). A row asking for a top-k
    of at least the vocabulary means no top-k, but next to smaller ones it makes the
    caller's bound that large.
    """
    return top_k_lanes(logits, top_k, max_top_k).threshold


class TopKLanes(NamedTuple):
    """What the draw kernel needs of the rows' top-k: thresholds, and each row's largest
    logits, from which the rows marked ``on_lanes`` draw without reading their vocabulary."""

    #: ``[R]`` each row's k-th largest logit (``-inf``: no top-k)
    threshold: torch.Tensor
    #: ``[R, width]`` each row's largest logits, in decreasing order, and their ids
    values: torch.Tensor
    ids: torch.Tensor
    #: ``[R]`` int32, 1 where the row's whole top-k set (ties at the k-th included) is
    #: among at most :data:`_LANES` of those logits
    on_lanes: torch.Tensor


def top_k_lanes(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int | None) -> TopKLanes:
    """The rows' top-k thresholds from their ``max(max_top_k, _LANES)`` largest logits (at
    most the vocabulary), and which rows draw from those.

    A row's top-k set is every logit at least its threshold; it lies within the largest
    ``width`` when the last of them is below the threshold (or they are the whole row).
    """
    vocab = logits.shape[-1]
    width = vocab if max_top_k is None else min(vocab, max(max_top_k, _LANES, 1))
    values, ids = largest(logits, width)
    active = (top_k > 0) & (top_k < vocab)
    index = (torch.where(active, top_k, 1) - 1).clamp(max=width - 1)
    kth = values.gather(1, index[:, None])[:, 0]
    threshold = torch.where(active, kth, float("-inf"))
    if width > _LANES:
        on_lanes = torch.zeros_like(active)
    elif width == vocab:
        on_lanes = active
    else:
        on_lanes = active & (values[:, -1] < threshold)
    return TopKLanes(threshold, values, ids, on_lanes.to(torch.int32))


#: Logits per chunk of :func:`largest`'s first level.
_CHUNK = 128


def largest(logits: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``width`` largest values of each row of ``logits [rows, V]``, in decreasing order,
    and their ids: ``logits.topk(width)``'s values, found without selecting over the whole
    vocabulary (which of several tied ids comes first is unspecified, as with ``topk``).

    Each row is cut into chunks of :data:`_CHUNK` logits; the ``width`` largest values lie
    in the ``width`` chunks of the largest maxima and the tail past the last whole chunk (a
    value in any other chunk has ``width`` chunk maxima at least as large above it), so one
    read for the maxima, a ``topk`` over them, and one over ``width`` chunks' logits give
    the same values, ties included. On the H200 ``torch.topk`` of the 50 largest of 1,024 x
    151,936 logits took 1.97 ms, most of a sampled step's draw (``bench/RESULTS.md``,
    2026-12-04); the maxima read the logits once. A plain ``topk`` where the chunks would
    not be few against the vocabulary.
    """
    rows, vocab = logits.shape
    chunks = vocab // _CHUNK
    if width * _CHUNK * 4 > vocab:
        found = logits.topk(width, dim=-1)
        return found.values, found.indices
    body = logits[:, : chunks * _CHUNK].reshape(rows, chunks, _CHUNK)  # (a view of contiguous rows)
    picked = body.amax(-1).topk(width, dim=-1).indices  # [rows, width]: chunks of the largest maxima
    candidates = body.gather(1, picked[:, :, None].expand(rows, width, _CHUNK)).flatten(1)
    offsets = torch.arange(_CHUNK, device=logits.device)
    candidate_ids = (picked[:, :, None] * _CHUNK + offsets).flatten(1)
    if chunks * _CHUNK < vocab:
        candidates = torch.cat((candidates, logits[:, chunks * _CHUNK :]), 1)
        tail_ids = torch.arange(chunks * _CHUNK, vocab, device=logits.device)
        candidate_ids = torch.cat((candidate_ids, tail_ids.expand(rows, -1)), 1)
    found = candidates.topk(width, dim=-1)
    return found.values, candidate_ids.gather(1, found.indices)


def triton_draw(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    offset: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    max_top_k: int | None = None,
    *,
    block: int = _BLOCK,
) -> torch.Tensor:
    """The pick of ``draw_full(logits / temperature[:, None], seed, offset, top_k, top_p, min_p)``.

    ``logits [R, V]`` (float32, or a model's bfloat16 or float16, upcast as they load:
    exactly ``logits.float()``), ``temperature [R]`` (positive), ``seed`` and ``offset``
    ``[R]`` (int64); a filter that no row uses may be None. ``max_top_k`` bounds the rows'
    ``top_k`` (see :func:`top_k_thresholds`). Differences from ``draw_full`` are limited
    to ties (see the module's docstring). No host synchronisation: the launch depends on
    shapes and on which filters are given, never on the values. ``block`` (a power of
    two) is the number of logits a program reads at once.
    """
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed")
    if logits.dim() != 2 or logits.dtype not in LOGITS_DTYPES:
        raise ValueError(
            f"expected float32, bfloat16 or float16 logits [R, V], got {logits.dtype} {tuple(logits.shape)}"
        )
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.long, device=logits.device)
    if rows == 0:
        return out
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    temperature = temperature.to(torch.float32)
    # A filter no row uses is never read by the kernel (top-k and top-p are compiled out,
    # min-p is off by a run-time flag), so any tensor stands in for its argument.
    if top_k is None:
        threshold, values, ids, on_lanes, width = temperature, logits, seed, seed, 1
    else:
        threshold, values, ids, on_lanes = top_k_lanes(logits, top_k, max_top_k)
        width = values.shape[1]
    log_min_p = temperature if min_p is None else torch.log(min_p)  # log(0) = -inf: off
    _sample_kernel[(rows,)](
        logits,
        # (a single row's stride is never read, and may be anything: the vocabulary keeps
        # it the value the warm-up compiled for, as the kernel specialises on it)
        logits.stride(0) if rows > 1 else vocab,
        temperature.contiguous(),
        seed.contiguous(),
        offset.contiguous(),
        threshold.contiguous(),
        (temperature if top_p is None else top_p).contiguous(),
        log_min_p.contiguous(),
        out,
        values,
        ids,
        on_lanes,
        width,
        int(min_p is not None),
        VOCAB=vocab,
        BLOCK=block,
        LANES=_LANES,
        USE_TOP_K=top_k is not None,
        USE_TOP_P=top_p is not None,
        PRECISE=not interpreted(_sample_kernel),
        num_warps=_NUM_WARPS,
    )
    return out


def compile_draw(vocab: int, device: torch.device, dtypes: Iterable[torch.dtype]) -> None:
    """Compile :func:`triton_draw`'s kernel for logits ``vocab`` wide of each of ``dtypes``
    on ``device``, once for each combination of top-k and top-p (each is a kernel of its
    own; min-p is not), by drawing from one row.

    Run before serving: otherwise the first step that samples with a new combination
    compiles it in the middle of serving (seconds on a cold cache, seen on the H200, with
    the compiler's Python holding the GIL, so the event loop stalls too).
    """
    one = torch.ones(1, device=device)
    zero = torch.zeros(1, dtype=torch.long, device=device)
    for dtype in dtypes:
        logits = torch.zeros(1, vocab, device=device, dtype=dtype)
        for top_k, top_p in itertools.product((None, zero + 1), (None, one / 2)):
            triton_draw(logits, one, zero, zero, top_k, top_p, None, max_top_k=1)


def triton_noise(
    seed: torch.Tensor, offset: torch.Tensor, vocab: int, *, block: int = _BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' noise for rows ``(seed, offset)``: ``[R, V]`` random bits (int64) and
    Gumbel noise (float32), to compare with :mod:`aiocb.runner.noise`."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed")
    rows = seed.shape[0]
    bits = torch.empty(rows, vocab, dtype=torch.long, device=seed.device)
    noise = torch.empty(rows, vocab, dtype=torch.float32, device=seed.device)
    if rows:
        precise = not interpreted(_sample_kernel)
        _noise_kernel[(rows,)](
            seed.contiguous(), offset.contiguous(), bits, noise, VOCAB=vocab, BLOCK=block, PRECISE=precise
        )
    return bits, noise
