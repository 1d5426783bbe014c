"""The batched sampler: distributions, filters and seeded reproducibility."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from aiocb.runner import noise
from aiocb.runner.noise import (
    GUMBEL_BOUND,
    gumbel_argmax,
    gumbel_noise,
    gumbel_of_bits,
    random_bits,
    random_bits_at,
)
from aiocb.runner.sampler import SamplingTensors, sample


@dataclass
class Row:
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    offset: int = 0
    logprobs: bool = False
    top_logprobs: int = 0
    #: top-h, typical-p, epsilon and eta cutoffs (None: off)
    filters: tuple[float, float, float, float] | None = None


def _draw(logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    return sample(logits, SamplingTensors.from_rows(rows, logits.device)).tokens


def test_min_p_samples_follow_the_renormalized_distribution() -> None:
    """min-p keeps the tokens with at least min_p times the top probability (after the
    temperature), and the draws follow the softmax over those alone."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -3.0])
    temperature, min_p = 0.9, 0.3
    probs = (logits / temperature).softmax(-1)
    kept = probs >= min_p * probs.max()
    assert 1 < int(kept.sum()) < len(logits)  # the filter matters here
    expected = torch.where(kept, probs, 0.0) / probs[kept].sum()
    rows = [Row(temperature=temperature, min_p=min_p, seed=s) for s in range(4000)]
    draws = _draw(logits.expand(len(rows), -1).contiguous(), rows)
    freq = torch.bincount(draws, minlength=len(logits)).float() / len(rows)
    assert torch.all(freq[~kept] == 0)
    assert torch.allclose(freq, expected, atol=0.03), (freq, expected)


def test_samples_follow_the_softmax_distribution() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, -3.0])
    temperature = 0.8
    rows = [Row(temperature=temperature, seed=s) for s in range(4000)]
    tokens = _draw(logits.expand(len(rows), -1).contiguous(), rows)
    observed = torch.bincount(tokens, minlength=5).float() / len(rows)
    expected = (logits / temperature).softmax(-1)
    assert torch.allclose(observed, expected, atol=0.03)


def test_top_k_and_top_p_restrict_the_support() -> None:
    logits = torch.tensor([3.0, 2.9, 2.8, 0.0, -1.0, -2.0])
    rows_k = [Row(top_k=2, seed=s) for s in range(500)]
    tokens_k = _draw(logits.expand(500, -1).contiguous(), rows_k)
    assert set(tokens_k.tolist()) == {0, 1}
    # The first three tokens hold ~95% of the mass: top_p=0.9 keeps exactly them.
    rows_p = [Row(top_p=0.9, seed=s) for s in range(500)]
    tokens_p = _draw(logits.expand(500, -1).contiguous(), rows_p)
    assert set(tokens_p.tolist()) == {0, 1, 2}


def test_greedy_rows_take_the_argmax_next_to_sampled_rows() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    rows = [Row(temperature=0.0), Row(temperature=3.0, seed=1), Row(top_k=1, temperature=2.0)] * 2
    tokens = _draw(logits, rows)
    argmax = logits.argmax(-1)
    for i in (0, 2, 3, 5):
        assert tokens[i] == argmax[i]


def test_top_k_1_draws_among_tied_maxima_as_transformers_warper_keeps_them() -> None:
    """transformers' top-k warper keeps every logit tied with the k-th: sampled with top-k
    1, tied maxima are drawn alike (they were taken as greedy: always the first of them);
    a greedy row (temperature 0) still takes the first."""
    logits = torch.tensor([[0.5, 2.0, 2.0, 1.0, 2.0]]).expand(3000, -1).contiguous()
    tokens = _draw(logits, [Row(top_k=1, temperature=0.8, seed=s) for s in range(3000)])
    counts = torch.bincount(tokens, minlength=5).tolist()
    assert counts[0] == counts[3] == 0 and all(900 < counts[i] < 1100 for i in (1, 2, 4)), counts
    assert _draw(logits[:2], [Row(temperature=0.0)] * 2).tolist() == [1, 1]


def test_noise_depends_only_on_seed_offset_and_vocab_id() -> None:
    seed = torch.tensor([5, 6, 5])
    offset = torch.tensor([0, 0, 1])
    noise = gumbel_noise(seed, offset, 64)
    again = gumbel_noise(seed.flip(0), offset.flip(0), 64).flip(0)
    assert torch.equal(noise, again)
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])
    # Roughly Gumbel: its mean is the Euler-Mascheroni constant, its variance pi**2 / 6.
    big = gumbel_noise(torch.arange(64), torch.zeros(64, dtype=torch.long), 1024)
    assert abs(float(big.mean()) - 0.5772) < 0.02 and abs(float(big.var()) - 1.6449) < 0.05


def test_samples_with_nearby_seeds_draw_unrelated_noise() -> None:
    """A request's ``n`` samples have seeds ``seed + i``. Where the row key combined one
    hash of the seed with one of the offset, symmetrically, samples with seeds in ``[c, c +
    n)`` (c = 0x9E3779B9) drew sample a's token b with the noise of sample b's token a."""
    c = 0x9E3779B9
    for base in (c, 0, 12345):
        seeds = torch.arange(base, base + 8)
        offsets = torch.arange(8)
        swapped = [
            torch.equal(
                random_bits(seeds[a : a + 1], offsets[b : b + 1], 64),
                random_bits(seeds[b : b + 1], offsets[a : a + 1], 64),
            )
            for a in range(8)
            for b in range(8)
            if a != b
        ]
        assert not any(swapped), base


def test_the_noise_has_the_gumbel_distributions_upper_tail() -> None:
    """The share of the 2**32 bit patterns whose noise exceeds t is the Gumbel's P(G > t),
    out to t = 19 (a 23-bit uniform stopped the noise at 16.6: a token 18 below the top of a
    151,936-token row was drawn a sixth as often as it should be, one 20 below never)."""
    import math

    def share_above(t: float) -> float:
        low, high = 0, (1 << 32) - 1  # (the noise increases with the bits)
        while low < high:
            middle = (low + high) // 2
            if float(gumbel_of_bits(torch.tensor([middle]))) > t:
                high = middle
            else:
                low = middle + 1
        return ((1 << 32) - low) / 2**32

    for t in (1.0, 5.0, 10.0, 15.0, 17.0, 18.0, 19.0):
        exact = -math.expm1(-math.exp(-t))
        assert abs(share_above(t) / exact - 1) < 0.01, t


def test_logprobs_are_the_raw_log_softmax() -> None:
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(1))
    rows = [Row(temperature=0.0, logprobs=True), Row(temperature=0.5, seed=3), Row(top_k=5, seed=4, top_logprobs=3)]
    picked = sample(logits, SamplingTensors.from_rows(rows, logits.device))
    assert picked.logprobs is not None and picked.top_ids is not None and picked.top_logprobs is not None
    full = logits.log_softmax(-1)
    assert torch.allclose(picked.logprobs, full.gather(1, picked.tokens[:, None])[:, 0])
    best = full.topk(3, -1)
    assert torch.equal(picked.top_ids, best.indices)
    assert torch.allclose(picked.top_logprobs, best.values)


def test_extreme_bit_patterns_give_finite_noise_increasing_in_the_bits() -> None:
    import math

    patterns = torch.tensor([0, 1, 0x1FF, 0x200, 1 << 31, 0xFFFFFE00, 0xFFFFFF00, 0xFFFFFF80, 0xFFFFFFFE, 0xFFFFFFFF])
    noise = gumbel_of_bits(patterns)
    assert noise.dtype == torch.float32
    assert bool(torch.isfinite(noise).all()), noise
    assert bool((noise[1:] >= noise[:-1]).all()) and noise[-1] > noise[-2], noise
    assert abs(float(noise[-1]) - 33 * math.log(2)) < 1e-5  # -log(2**-33)
    assert abs(float(noise[0]) + math.log(24 * math.log(2))) < 1e-3  # x = 1 - 2**-24
    # The Gumbel quantile of each pattern's x, to float32's precision.
    x = ((0xFFFFFFFF - patterns).to(torch.float32) + 0.5) * 2**-32
    exact = -torch.log(-torch.log1p(-x.clamp(max=1 - 2**-24).double()))
    assert torch.allclose(noise.double(), exact, rtol=0, atol=1e-5)
    # A masked logit stays masked: -inf plus finite noise is -inf, never NaN.
    assert bool(((torch.full_like(noise, float("-inf")) + noise) == float("-inf")).all())


def test_no_draw_escapes_top_k_or_top_p_at_a_large_vocabulary() -> None:
    vocab = 151_936
    # With the old 24-bit mapping each of these seeds (offset 0) drew 1.0, so an infinite
    # noise value, at one vocabulary id: that token won whatever the filters said.
    escaped = [55, 129, 166, 197, 322, 341, 391, 480]
    seeds = [*escaped, *range(1000, 1024)]
    logits = torch.randn(len(seeds), vocab, generator=torch.Generator().manual_seed(7)) * 3
    rows = [Row(top_k=50, top_p=0.8, seed=seed) for seed in seeds]
    params = SamplingTensors.from_rows(rows, logits.device)
    assert bool(torch.isfinite(gumbel_noise(params.seed, params.offset, vocab)).all())
    tokens = sample(logits, params).tokens
    # The filters' own definition: the top 50, then the nucleus of their renormalized mass.
    top_logits, top_ids = logits.topk(50, dim=-1)
    probs = top_logits.softmax(-1)
    allowed = (probs.cumsum(-1) - probs <= 0.8) | (torch.arange(50) == 0)
    picked = top_ids == tokens[:, None]
    assert bool(picked.any(dim=-1).all()), "every pick within its row's top 50"
    assert bool((picked & allowed).any(dim=-1).all()), "and within its nucleus"


def test_noise_at_ids_is_the_rows_noise_there_and_bounded() -> None:
    seed, offset = torch.tensor([3, 99]), torch.tensor([0, 7])
    full = random_bits(seed, offset, 500)
    ids = torch.tensor([[4, 499, 0], [17, 17, 250]])
    assert torch.equal(random_bits_at(seed, offset, ids), full.gather(1, ids))
    extreme = gumbel_of_bits(torch.tensor([0xFFFFFFFF, 0]))
    assert float(extreme.max()) < GUMBEL_BOUND < float(extreme.max()) + 0.01


@pytest.mark.parametrize(("rows", "vocab", "block"), [(5, 1000, 1 << 18), (37, 5000, 4096), (3, 151_936, 1 << 18)])
def test_blockwise_cpu_draw_is_the_whole_noise_argmax(
    rows: int, vocab: int, block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (a small block makes a vocabulary span many blocks, the last one partial)
    monkeypatch.setattr(noise, "BLOCK_ELEMENTS", block)
    generator = torch.Generator().manual_seed(vocab)
    scaled = torch.randn(rows, vocab, generator=generator) * 2
    scaled[0, ::3] = float("-inf")  # a filtered row
    scaled[1, :] = 0.0  # every logit tied: the noise decides
    # seeds and offsets at the ends of their ranges: the int32 arithmetic must wrap as uint32's
    seed = torch.randint(0, 1 << 32, (rows,), generator=generator)
    seed[:2] = torch.tensor([0, (1 << 32) - 1])
    offset = torch.randint(0, 1 << 31, (rows,), generator=generator)
    reference = (scaled + gumbel_noise(seed, offset, vocab)).argmax(dim=-1)
    assert torch.equal(gumbel_argmax(scaled, seed, offset), reference)


def test_blockwise_cpu_draw_breaks_ties_and_nans_as_argmax() -> None:
    seed, offset = torch.tensor([1, 2]), torch.tensor([0, 0])
    scaled = torch.randn(2, 300, generator=torch.Generator().manual_seed(0))
    # Scores equal at two ids of different blocks (the noise vanishes next to 1e30): the
    # first id wins, as torch.argmax's.
    scaled[:, 10] = scaled[:, 250] = 1e30
    scaled[1, 280] = float("nan")  # torch.argmax picks a NaN
    reference = (scaled + gumbel_noise(seed, offset, 300)).argmax(dim=-1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(noise, "BLOCK_ELEMENTS", 128)
        assert torch.equal(gumbel_argmax(scaled, seed, offset), reference)
    assert reference.tolist() == [10, 280]
