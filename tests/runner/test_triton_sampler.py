"""The Triton sampler against ``draw_full``: the same noise, the same picks.

On the CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set in
``conftest.py``), which costs milliseconds per row: a few rows per case, small
vocabularies, blocks smaller than the GPU's so that rows span several blocks. The ``gpu``
test repeats the comparison at a real vocabulary on CUDA.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable

import pytest
import torch

pytest.importorskip("triton")

import aiocb
from aiocb.runner import sampler, triton_sampler
from aiocb.runner.draw import draw_full
from aiocb.runner.noise import gumbel_at, gumbel_noise, random_bits
from aiocb.runner.sampler import SamplingTensors, draw_on_device, sample
from aiocb.runner.triton_sampler import is_available, triton_draw, triton_noise
from tests.runner.test_draw import tie_inclusive_pick
from tests.runner.test_sampler import Row

needs_kernel = pytest.mark.skipif(
    not is_available(torch.device("cpu")), reason="Triton interpreter not enabled (TRITON_INTERPRET=1)"
)

BLOCK = 256  # (the GPU's is larger; vocabularies below are not multiples of it)


def _inputs(rows: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row temperatures, 32-bit seeds and offsets."""
    temperature = torch.rand(rows, generator=gen) + 0.5
    seed = torch.randint(0, 2**32, (rows,), generator=gen)
    offset = torch.randint(0, 5000, (rows,), generator=gen)
    return temperature, seed, offset


def _both(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    offset: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's picks and draw_full's."""
    max_top_k = None if top_k is None else int(top_k.max())
    got = triton_draw(logits, temperature, seed, offset, top_k, top_p, min_p, max_top_k, block=BLOCK)
    want = draw_full(logits / temperature[:, None], seed, offset, top_k, top_p, min_p)
    return got, want


@needs_kernel
@pytest.mark.parametrize("vocab", [151_936, 4_096 + 77, 20_000])
def test_the_largest_logits_are_found_through_chunk_maxima(vocab: int) -> None:
    """``largest`` gives ``topk``'s values exactly, and ids that hold them: rows of random,
    tied (bf16-rounded), mostly masked and all-equal logits, widths from 1 up to where it
    defers to ``topk``, a tail past the last whole chunk."""
    gen = torch.Generator().manual_seed(31)
    logits = torch.randn(6, vocab, generator=gen) * 4
    logits[1] = logits[1].to(torch.bfloat16).float().round()  # (many ties)
    logits[2, : vocab - 40] = float("-inf")  # (the finite ones in the tail)
    logits[3] = 0.5
    logits[4, torch.randperm(vocab, generator=gen)[:300]] += 30  # (the largest spread over chunks)
    logits[5, 5 * 128 : 7 * 128] += 50  # (the largest crowded into two chunks)
    for width in (1, 2, 50, 64, vocab // (4 * triton_sampler._CHUNK), 1000):
        got, ids = triton_sampler.largest(logits, width)
        assert torch.equal(got, logits.topk(width, dim=-1).values), width
        assert torch.equal(logits.gather(1, ids), got), width
        assert all(len(set(row)) == width for row in ids.tolist()), "each id once"
    top_k = torch.tensor([1, 50, 0, 7, 40, vocab])
    want = logits.topk(50, dim=-1).values.gather(1, (top_k.clamp(1, 50) - 1)[:, None])[:, 0]
    want[[2, 5]] = float("-inf")  # (no top-k: 0, or the whole vocabulary)
    assert torch.equal(triton_sampler.top_k_thresholds(logits, top_k, 50), want)


def test_noise_is_the_noise_modules() -> None:
    seed = torch.tensor([0, 1, 5, 0xFFFFFFFF, 123456789, 2**31])
    offset = torch.tensor([0, 0, 3, 7, 2**33 + 5, 4095])
    vocab = 1000
    bits, noise = triton_noise(seed, offset, vocab, block=BLOCK)
    assert torch.equal(bits, random_bits(seed, offset, vocab))
    ids = torch.arange(vocab)[None, :]
    torch.testing.assert_close(noise, gumbel_at(seed, offset, ids), rtol=1e-6, atol=1e-6)
    assert torch.equal(gumbel_noise(seed, offset, vocab), gumbel_at(seed, offset, ids))


CASES = {
    # name: (vocab, top_k, top_p, min_p, logit scale, fraction masked to -inf)
    "temperature": (1000, 0, 1.0, 0.0, 3.0, 0.0),
    "temperature-flat": (1000, 0, 1.0, 0.0, 0.3, 0.0),
    "top-k": (1000, 20, 1.0, 0.0, 3.0, 0.0),
    "top-k-flat": (1000, 300, 1.0, 0.0, 0.5, 0.0),
    "top-p": (1000, 0, 0.9, 0.0, 3.0, 0.0),
    "top-p-flat": (1000, 0, 0.5, 0.0, 0.3, 0.0),  # many tokens above the nucleus: several passes
    "top-p-peaked": (1000, 0, 0.9, 0.0, 8.0, 0.0),
    "top-p-small": (1000, 0, 0.2, 0.0, 1.0, 0.0),
    "top-k-top-p": (1000, 50, 0.9, 0.0, 3.0, 0.0),
    "top-k-top-p-flat": (1000, 400, 0.6, 0.0, 0.5, 0.0),
    "min-p": (1000, 0, 1.0, 0.1, 3.0, 0.0),
    "min-p-flat": (1000, 0, 1.0, 0.5, 0.3, 0.0),
    "all-three": (1000, 40, 0.9, 0.05, 2.0, 0.0),
    "masked": (1000, 30, 0.8, 0.0, 3.0, 0.6),  # a bias / ban / allow-list leaves -inf entries
    "masked-min-p": (1000, 0, 1.0, 0.1, 3.0, 0.9),
    "one-block": (200, 10, 0.95, 0.0, 3.0, 0.0),
    "exact-blocks": (1024, 50, 0.9, 0.0, 3.0, 0.0),
    # Rows of 79 blocks, where most blocks' noise is skipped (no token may beat the best).
    "temperature-long": (20_000, 0, 1.0, 0.0, 3.0, 0.0),
    "temperature-long-flat": (20_000, 0, 1.0, 0.0, 0.3, 0.0),
    "top-p-long": (20_000, 0, 0.9, 0.0, 1.0, 0.0),
    "top-k-long": (20_000, 5_000, 1.0, 0.0, 2.0, 0.0),
}


@needs_kernel
@pytest.mark.parametrize("case", CASES)
def test_picks_what_draw_full_picks(case: str) -> None:
    vocab, k, p, mp, scale, masked = CASES[case]
    rows = 16 if vocab < 10_000 else 4  # (interpreted: seconds a long row)
    gen = torch.Generator().manual_seed(sum(map(ord, case)))
    logits = torch.randn(rows, vocab, generator=gen) * scale
    if masked:
        drop = torch.rand(rows, vocab, generator=gen) < masked
        drop[:, 0] = False  # (at least one finite logit per row)
        logits = logits.masked_fill(drop, float("-inf"))
    temperature, seed, offset = _inputs(rows, gen)
    filtered = k > 0 or p < 1.0
    top_k = torch.full((rows,), k) if filtered else None
    top_p = torch.full((rows,), p) if filtered else None
    min_p = torch.full((rows,), mp) if mp else None
    got, want = _both(logits, temperature, seed, offset, top_k, top_p, min_p)
    assert torch.equal(got, want), (got, want)


@needs_kernel
@pytest.mark.parametrize("margin", [1e-3, -1e-3, 1e-5, -1e-5])
def test_a_late_token_that_beats_the_best_by_a_hair_wins(margin: float) -> None:
    """The kernel takes a block's logarithms only where a token may beat the best score so
    far; a token in the last block given the block's largest noise and a score a hair above
    (or below) the best of the rest must still win (or lose), as in ``draw_full``."""
    vocab, rows = 4_000, 4
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    temperature, seed, offset = _inputs(rows, gen)
    noise = gumbel_at(seed, offset, torch.arange(vocab)[None, :])
    last = vocab - vocab % BLOCK  # (the last block's first id)
    late = last + noise[:, last:].argmax(-1)  # (its largest noise: a low logit that may win)
    best = (logits / temperature[:, None] + noise).amax(-1)
    logits[torch.arange(rows), late] = (best + margin - noise[torch.arange(rows), late]) * temperature
    got, want = _both(logits, temperature, seed, offset, None, None, None)
    assert torch.equal(got, want), (got, want)
    assert (want == late).tolist() == [margin > 0] * rows


@needs_kernel
def test_a_token_far_below_the_top_wins_with_its_tail_noise() -> None:
    """A token past a row's first block whose noise lies in the tail that 32 bits reach
    (above 17: 23-bit uniforms stopped at 16.6) wins over a token 17 to 23 above it when its
    noise says so: the kernel's test for skipping a block bounds the noise with the same bits."""
    vocab, found = 4_096, []
    for start in range(0, 400_000, 2_000):  # (rows whose largest noise past the first block is over 17)
        seeds = torch.arange(start, start + 2_000)
        noise = gumbel_noise(seeds, torch.zeros_like(seeds), vocab)
        top, late = noise[:, BLOCK:].max(dim=-1)
        found += [(int(seeds[r]), int(late[r]) + BLOCK, noise[r]) for r in (top > 17.0).nonzero()[:, 0].tolist()]
        if len(found) >= 4:
            break
    seed, late = torch.tensor([f[0] for f in found]), torch.tensor([f[1] for f in found])
    logits = torch.full((len(found), vocab), -1e4)
    logits[:, 0] = 0.0
    for row, (_, at, row_noise) in enumerate(found):
        logits[row, at] = row_noise[0] - row_noise[at] + 0.5  # (beats token 0 by 0.5)
    got, want = _both(logits, torch.ones(len(found)), seed, torch.zeros_like(seed), None, None, None)
    assert torch.equal(got, want) and torch.equal(want, late), (got, want, late)


@needs_kernel
def test_rows_with_different_filters_in_one_batch() -> None:
    vocab = 700
    # (top_k, top_p, min_p, scale): filters off, each alone, together, top-k of the whole
    # vocabulary and beyond it (off), peaked and flat rows.
    params = [
        (0, 1.0, 0.0, 3.0),
        (5, 1.0, 0.0, 3.0),
        (0, 0.7, 0.0, 3.0),
        (0, 1.0, 0.2, 3.0),
        (50, 0.9, 0.0, 0.5),
        (vocab, 0.9, 0.0, 3.0),
        (vocab + 100, 1.0, 0.0, 1.0),
        (300, 0.3, 0.1, 0.2),
        (2, 0.5, 0.0, 10.0),
        (0, 0.99, 0.05, 0.1),
        (0, 1.0, 0.0, 0.1),
        (100, 1.0, 0.3, 6.0),
    ]
    gen = torch.Generator().manual_seed(5)
    scale = torch.tensor([s for *_, s in params])
    logits = torch.randn(len(params), vocab, generator=gen) * scale[:, None]
    temperature, seed, offset = _inputs(len(params), gen)
    top_k = torch.tensor([k for k, *_ in params])
    top_p = torch.tensor([p for _, p, *_ in params])
    min_p = torch.tensor([m for *_, m, _ in params])
    got, want = _both(logits, temperature, seed, offset, top_k, top_p, min_p)
    assert torch.equal(got, want), (got, want)
    for i in range(len(params)):
        alone = triton_draw(
            logits[i : i + 1], temperature[i : i + 1], seed[i : i + 1], offset[i : i + 1],
            top_k[i : i + 1], top_p[i : i + 1], min_p[i : i + 1], int(top_k[i]), block=BLOCK,
        )  # fmt: skip
        assert int(alone[0]) == int(got[i]), "a row's pick must not depend on its batch-mates"


@needs_kernel
def test_rows_with_few_finite_logits() -> None:
    """Allow-lists leave a handful of finite logits; a single one always wins."""
    vocab = 600
    gen = torch.Generator().manual_seed(8)
    logits = torch.full((6, vocab), float("-inf"))
    for row, count in enumerate([1, 1, 2, 3, 5, 40]):
        ids = torch.randperm(vocab, generator=gen)[:count]
        logits[row, ids] = torch.randn(count, generator=gen) * 2
    temperature, seed, offset = _inputs(6, gen)
    for top_k, top_p, min_p in [
        (None, None, None),
        (torch.full((6,), 3), torch.full((6,), 0.5), None),
        (None, None, torch.full((6,), 0.3)),
    ]:
        got, want = _both(logits, temperature, seed, offset, top_k, top_p, min_p)
        assert torch.equal(got, want), (got, want)
        assert torch.isfinite(logits.gather(1, got[:, None])).all()


@needs_kernel
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # (inf - inf, then masked)
def test_a_row_with_infinite_logits_picks_the_first_of_them() -> None:
    """Half-precision logits overflow to +inf: every filter, on the top-k lanes and in the
    passes over the vocabulary, picks a row's first +inf token, as draw_full does."""
    vocab, rows = 1000, 4
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[:, 123] = float("inf")
    logits[1, 77] = float("inf")
    logits[2, 900] = float("inf")
    temperature, seed, offset = _inputs(rows, gen)
    first = torch.tensor([123, 77, 123, 123])
    for k, p, m in itertools.product([None, 50], [None, 0.9], [None, 0.1]):
        top_k = None if k is None else torch.full((rows,), k)
        top_p = None if p is None else torch.full((rows,), p)
        min_p = None if m is None else torch.full((rows,), m)
        for max_top_k in [k] if k is None else [k, 2 * triton_sampler._LANES]:  # (lanes, passes)
            got = triton_draw(logits, temperature, seed, offset, top_k, top_p, min_p, max_top_k, block=BLOCK)
            assert torch.equal(got, first), (k, p, m, max_top_k, got)
        assert torch.equal(draw_full(logits / temperature[:, None], seed, offset, top_k, top_p, min_p), first)


@needs_kernel
def test_ties_are_kept_whole() -> None:
    """bf16 logits (a model's, upcast) tie often: at the k-th largest and at the nucleus's
    edge the kernel keeps the whole tie, as draw_full does."""
    vocab, rows, k, p = 300, 12, 20, 0.8
    gen = torch.Generator().manual_seed(9)
    logits = (torch.randn(rows, vocab, generator=gen) * 2).round(decimals=1)  # ~50 distinct values
    assert (logits.topk(k + 1, dim=-1).values[:, -2:].diff(dim=-1) == 0).any(), "some row ties at the k-th"
    temperature, seed, offset = _inputs(rows, gen)
    top_k, top_p = torch.full((rows,), k), torch.full((rows,), p)
    got = triton_draw(logits, temperature, seed, offset, top_k, top_p, None, k, block=BLOCK)
    want, support = tie_inclusive_pick(logits, temperature, seed, offset, k, p)
    assert torch.equal(got, want), (got, want)
    assert support.gather(1, got[:, None]).all()
    assert torch.equal(draw_full(logits / temperature[:, None], seed, offset, top_k, top_p, None), want)


@needs_kernel
@pytest.mark.parametrize("vocab", [1000, pytest.param(40_000, marks=pytest.mark.slow)])  # (the larger: 11 s)
def test_top_k_rows_draw_from_their_largest_logits_when_those_hold_the_top_k_set(vocab: int) -> None:
    """A top-k row whose top-k set, ties included, lies within the kernel's lanes draws from
    them alone, and picks what the passes over its vocabulary pick (the same kernel with a
    ``max_top_k`` beyond the lanes); a row whose tie at the k-th spills past the lanes, a
    row with fewer finite logits than its k and a row without top-k read the vocabulary.
    At 40,000 the largest logits come through chunk maxima."""
    lanes = triton_sampler._LANES
    # (top_k, top_p, min_p): each row's filters; rows 6 and 7 tie at the k-th.
    params = [
        (50, 1.0, 0.0), (50, 0.9, 0.0), (1, 1.0, 0.0), (lanes - 1, 0.5, 0.0), (20, 0.95, 0.1),
        (10, 0.3, 0.0), (50, 0.9, 0.0), (30, 1.0, 0.0), (40, 0.8, 0.0), (0, 0.9, 0.0), (5, 0.2, 0.3),
    ]  # fmt: skip
    rows = len(params)
    gen = torch.Generator().manual_seed(21)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    ids = torch.randperm(vocab, generator=gen)
    logits[6, ids[:45]] = 20 + torch.arange(45.0)  # (45 above a tie of 100 at the 50th: spills)
    logits[6, ids[45:145]] = 19.0
    logits[7, ids[:25]] = 20 + torch.arange(25.0)  # (a tie of 10 at the 30th: fits)
    logits[7, ids[25:35]] = 19.0
    logits[8, ids[30:]] = float("-inf")  # (30 finite logits, a top-k of 40)
    temperature, seed, offset = _inputs(rows, gen)
    top_k = torch.tensor([k for k, _, _ in params])
    top_p = torch.tensor([p for _, p, _ in params])
    min_p = torch.tensor([m for _, _, m in params])

    found = triton_sampler.top_k_lanes(logits, top_k, int(top_k.max()))
    assert found.on_lanes.tolist() == [1, 1, 1, 1, 1, 1, 0, 1, 0, 0, 1]
    got = triton_draw(logits, temperature, seed, offset, top_k, top_p, min_p, int(top_k.max()), block=BLOCK)
    assert not triton_sampler.top_k_lanes(logits, top_k, 2 * lanes).on_lanes.any()
    passes = triton_draw(logits, temperature, seed, offset, top_k, top_p, min_p, 2 * lanes, block=BLOCK)
    assert torch.equal(got, passes), (got, passes)
    untied = [i for i in range(rows) if i not in (6, 7, 8)]  # (draw_full keeps exactly k of a tie)
    want = draw_full(logits[untied] / temperature[untied, None], seed[untied], offset[untied],
                     top_k[untied], top_p[untied], min_p[untied])  # fmt: skip
    assert torch.equal(got[untied], want), (got[untied], want)
    assert logits[7, got[7]] >= 19.0 and torch.isfinite(logits[8, got[8]])


@needs_kernel
def test_the_device_path_matches_the_cpu_sampler() -> None:
    """sample()'s GPU path (here on CPU tensors, the kernel interpreted) picks what its CPU
    path picks, greedy rows included."""
    vocab = 500
    rows = [
        Row(temperature=0.0),
        Row(temperature=0.8, seed=1, offset=3),
        Row(temperature=1.2, top_k=1, seed=2),  # top-k 1: the argmax (no tie here)
        Row(temperature=0.7, top_k=50, top_p=0.9, seed=3),
        Row(temperature=1.0, min_p=0.1, seed=4, offset=100),
        Row(temperature=1.5, top_p=0.5, seed=5),
        Row(temperature=0.9, top_k=vocab + 5, seed=6),
    ]
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(6)) * 3
    params = SamplingTensors.from_rows(rows, logits.device)
    assert params.max_top_k == vocab + 5
    tokens = draw_on_device(logits, params)
    assert torch.equal(tokens, sample(logits, params).tokens)
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_models_half_precision_logits_are_read_as_they_are(dtype: torch.dtype) -> None:
    """The kernel reads bfloat16 or float16 logits itself (no float32 copy of them): the
    picks are those of the same logits upcast first, for every filter, top-k rows drawing
    from their lanes included (half-precision logits tie often)."""
    vocab, rows = 1_200, 4
    gen = torch.Generator().manual_seed(17)
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)
    temperature, seed, offset = _inputs(rows, gen)
    full = torch.ones(rows)
    for top_k, top_p, min_p in [
        (None, None, None),
        (full.long() * 40, full * 0.9, None),
        (None, full * 0.8, None),
        (None, None, full * 0.05),
        (full.long() * 500, full * 0.7, full * 0.02),
    ]:
        max_top_k = None if top_k is None else int(top_k.max())
        got = triton_draw(logits, temperature, seed, offset, top_k, top_p, min_p, max_top_k, block=BLOCK)
        upcast = triton_draw(logits.float(), temperature, seed, offset, top_k, top_p, min_p, max_top_k, block=BLOCK)
        assert torch.equal(got, upcast), (top_k is not None, top_p is not None, min_p is not None)
        if top_k is None:  # (draw_full keeps exactly k of a tie at the k-th)
            want = draw_full(logits.float() / temperature[:, None], seed, offset, top_k, top_p, min_p)
            assert torch.equal(got, want)


@needs_kernel
def test_the_device_path_draws_from_a_models_logits_without_a_float_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device draw hands the kernel the model's bfloat16 logits as they are (``sample``
    makes no float32 copy for it on a GPU), mixes in greedy rows' argmax only when some row
    is greedy, and picks what the float32 logits give, on either path."""
    vocab = 400
    logits = (torch.randn(4, vocab, generator=torch.Generator().manual_seed(2)) * 3).to(torch.bfloat16)
    seen: list[torch.dtype] = []
    kernel = triton_sampler.triton_draw

    def spy(logits: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        seen.append(logits.dtype)
        return kernel(logits, *args, **kwargs)  # type: ignore[arg-type]  # (the same arguments)

    monkeypatch.setattr(triton_sampler, "triton_draw", spy)
    sampled = [Row(temperature=0.8, top_p=0.9, seed=i, offset=i) for i in range(4)]
    mixed = [Row(temperature=0.0), *sampled[1:]]
    for rows in (sampled, mixed):
        params = SamplingTensors.from_rows(rows, logits.device)
        assert params.any_greedy == (rows is mixed)
        # (on a CPU sample() upcasts for its own draw, so the device path is called here)
        got = draw_on_device(logits, params)
        assert torch.equal(got, draw_on_device(logits.float(), params))
        assert torch.equal(got, sample(logits.float(), params).tokens)
    assert seen == [torch.bfloat16, torch.float32] * 2


@needs_kernel
def test_a_kernel_that_fails_gives_way_to_the_sorted_draw(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A kernel that cannot run (say it does not compile on some GPU) is reported once and
    replaced by draw_full, with the same picks."""
    calls = 0

    def broken(*args: object) -> torch.Tensor:
        nonlocal calls
        calls += 1
        raise RuntimeError("no kernel here")

    monkeypatch.setattr(triton_sampler, "triton_draw", broken)
    monkeypatch.setattr(sampler, "_kernel_failed", False)
    rows = [Row(temperature=0.8, top_k=20, top_p=0.9, seed=i) for i in range(4)]
    logits = torch.randn(len(rows), 300, generator=torch.Generator().manual_seed(8)) * 3
    params = SamplingTensors.from_rows(rows, logits.device)
    expected = sample(logits, params).tokens
    with caplog.at_level("ERROR"):
        assert torch.equal(draw_on_device(logits, params), expected)
        assert torch.equal(draw_on_device(logits, params), expected)
    assert calls == 1 and "Triton sampler failed" in caplog.text


@needs_kernel
def test_compile_draw_runs_every_variant_of_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each dtype of logits and each combination of top-k and top-p is a kernel of its own:
    all are run (so compiled); min-p is a run-time flag of each."""
    seen: list[tuple[torch.dtype, bool, bool]] = []

    def spy(logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor,
            top_k: torch.Tensor | None, top_p: torch.Tensor | None, min_p: torch.Tensor | None,
            max_top_k: int | None = None) -> torch.Tensor:  # fmt: skip
        assert logits.shape == (1, 96)
        assert min_p is None
        seen.append((logits.dtype, top_k is not None, top_p is not None))
        return triton_draw(logits, temperature, seed, offset, top_k, top_p, min_p, max_top_k, block=BLOCK)

    monkeypatch.setattr(triton_sampler, "triton_draw", spy)
    dtypes = (torch.float32, torch.bfloat16)
    triton_sampler.compile_draw(96, torch.device("cpu"), dtypes)
    flags = (False, True)
    assert sorted(seen, key=str) == sorted(itertools.product(dtypes, flags, flags), key=str)


def test_the_runner_compiles_the_sampler_on_cuda_only_and_gives_up_on_a_failure(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``sampler.compile_draw`` compiles where ``draw_on_device`` would use the kernel (CUDA),
    never on a CPU; a compile that fails is reported and the sorted draw used from then on."""
    compiled: list[tuple[int, torch.device, list[torch.dtype]]] = []

    def spy(vocab: int, device: torch.device, dtypes: Iterable[torch.dtype]) -> None:
        compiled.append((vocab, device, list(dtypes)))

    monkeypatch.setattr(sampler, "_kernel_failed", False)
    monkeypatch.setattr(triton_sampler, "is_available", lambda device: True)
    monkeypatch.setattr(triton_sampler, "compile_draw", spy)
    both = [torch.float32, torch.bfloat16]
    sampler.compile_draw(512, torch.device("cpu"), both)
    assert compiled == []
    cuda = torch.device("cuda", 0)
    sampler.compile_draw(512, cuda, both)
    assert compiled == [(512, cuda, both)]
    sampler.compile_draw(512, cuda, [torch.float32, torch.float64])  # (no kernel for float64)
    assert compiled[-1] == (512, cuda, [torch.float32]) and not sampler._kernel_failed
    compiled.clear()

    def broken(vocab: int, device: torch.device, dtypes: Iterable[torch.dtype]) -> None:
        raise RuntimeError("no kernel here")

    monkeypatch.setattr(triton_sampler, "compile_draw", broken)
    with caplog.at_level("ERROR"):
        sampler.compile_draw(512, cuda, both)
    assert sampler._kernel_failed and "failed to compile" in caplog.text
    monkeypatch.setattr(triton_sampler, "compile_draw", spy)
    sampler.compile_draw(512, cuda, both)  # (given up on: not tried again)
    assert compiled == []


def test_the_runners_warm_up_compiles_the_sampler_for_the_model_and_the_draft(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from aiocb.runner import model_runner
    from aiocb.runner.model_runner import ModelRunner
    from tests.conftest import tiny_qwen3

    """The model's logits in its own dtype and in float32 (after controls or a grammar's
    mask), the draft's (always upcast) in float32."""
    widths: list[tuple[int, list[torch.dtype]]] = []

    def spy(vocab: int, device: torch.device, dtypes: Iterable[torch.dtype]) -> None:
        widths.append((vocab, sorted(dtypes, key=str)))

    monkeypatch.setattr(model_runner, "compile_draw", spy)
    config = aiocb.ContinuousBatchingConfig(page_size=16, num_blocks=16)
    ModelRunner(tiny_qwen3(), config).warm_up()
    assert widths == [(512, [torch.float32])]
    widths.clear()
    ModelRunner(tiny_qwen3().to(torch.bfloat16), config).warm_up()
    assert widths == [(512, [torch.bfloat16, torch.float32])]
    widths.clear()
    draft = tiny_qwen3(seed=1, vocab_size=384, num_hidden_layers=1)
    ModelRunner(tiny_qwen3(), config, draft_model=draft).warm_up()
    assert widths == [(384, [torch.float32]), (512, [torch.float32])]


_COMPILE_FOR_HOPPER = """
import itertools, os, sys
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from aiocb.runner.triton_sampler import _BLOCK, _LANES, _NUM_WARPS, _sample_kernel
pointers = {"logits_ptr": "*fp32", "temperature_ptr": "*fp32", "seed_ptr": "*i64", "offset_ptr": "*i64",
            "threshold_ptr": "*fp32", "top_p_ptr": "*fp32", "log_min_p_ptr": "*fp32", "out_ptr": "*i64",
            "values_ptr": "*fp32", "ids_ptr": "*i64", "lanes_ptr": "*i32"}
names = _sample_kernel.arg_names
for dtype, top_k, top_p in itertools.product(("fp32", "bf16"), (False, True), (False, True)):
    # (a model's logits as they are; the top-k values and thresholds are theirs, else stand-ins)
    typed = {"logits_ptr": f"*{dtype}", "values_ptr": f"*{dtype}"}
    if top_k:
        typed["threshold_ptr"] = f"*{dtype}"
    if dtype == "bf16" and not top_p:
        continue  # (every variant compiles for float32; the kinds of load, twice for bfloat16)
    runtime = ("stride_row", "width", "use_min_p")  # (min-p: a run-time flag, not a variant)
    signature = {n: {**pointers, **typed}.get(n, "i32" if n in runtime else "constexpr") for n in names}
    values = {"VOCAB": 151936, "BLOCK": _BLOCK, "LANES": _LANES, "USE_TOP_K": top_k, "USE_TOP_P": top_p,
              "PRECISE": True}
    constexprs = {(names.index(n),): v for n, v in values.items()}
    kernel = triton.compile(ASTSource(_sample_kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": _NUM_WARPS})
    assert "cubin" in kernel.asm, sorted(kernel.asm)
    print("compiled", dtype, top_k, top_p)
"""


def test_the_kernel_compiles_for_the_h200() -> None:
    """Triton's interpreter runs what a GPU compiler may refuse: every variant of the draw
    kernel (top-k and top-p each on or off; min-p is a run-time flag) is compiled ahead of
    time for sm_90 (Triton's own ptxas, no GPU), and the bfloat16 reads with and without
    top-k."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE_FOR_HOPPER], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("compiled") == 6


_CUDA_KERNEL = (
    torch.cuda.is_available() and is_available(torch.device("cuda")) and not is_available(torch.device("cpu"))
)


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA_KERNEL, reason="needs CUDA and a compiled kernel (AIOCB_GPU_TESTS=1)")
def test_gpu_picks_what_draw_full_picks() -> None:
    vocab, rows = 151_936, 64
    gen = torch.Generator().manual_seed(12)
    logits = (torch.randn(rows, vocab, generator=gen) * 3).cuda()
    logits[rows // 2 :, ::7] = float("-inf")
    temperature, seed, offset = (t.cuda() for t in _inputs(rows, gen))
    full = torch.full((rows,), 1, device="cuda")
    for top_k, top_p, min_p in [
        (None, None, None),
        (full * 50, full * 0.9, None),
        (None, full * 0.9, None),
        (None, None, full * 0.05),
        (full * 1000, full * 0.7, full * 0.02),
    ]:
        max_top_k = None if top_k is None else int(top_k.max())
        got = triton_draw(logits, temperature, seed, offset, top_k, top_p, min_p, max_top_k)
        want = draw_full(logits / temperature[:, None], seed, offset, top_k, top_p, min_p)
        mismatched = (got != want).nonzero()[:, 0].tolist()
        assert not mismatched, f"rows {mismatched}: {got[mismatched].tolist()} != {want[mismatched].tolist()}"
        # A model's bfloat16 logits, read as they are: the picks of the same values upcast.
        half = logits.bfloat16()
        got = triton_draw(half, temperature, seed, offset, top_k, top_p, min_p, max_top_k)
        assert torch.equal(got, triton_draw(half.float(), temperature, seed, offset, top_k, top_p, min_p, max_top_k))
    # sample() on the GPU makes no float copy for the draw: the same picks as with one.
    half = logits.bfloat16()
    params = SamplingTensors.from_rows([Row(temperature=0.8, top_p=0.9, seed=i) for i in range(rows)], half.device)
    assert not params.any_greedy
    assert torch.equal(sample(half, params).tokens, sample(half.float(), params).tokens)
