"""The batched sampler: distributions, filters and seeded reproducibility."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from aiocb.runner import noise
from aiocb.runner.noise import (
    GUMBEL_BOUND,
    bits_to_uniform,
    gumbel,
    gumbel_argmax,
    random_bits,
    random_bits_at,
    uniform_noise,
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


def test_noise_depends_only_on_seed_offset_and_vocab_id() -> None:
    seed = torch.tensor([5, 6, 5])
    offset = torch.tensor([0, 0, 1])
    noise = uniform_noise(seed, offset, 64)
    again = uniform_noise(seed.flip(0), offset.flip(0), 64).flip(0)
    assert torch.equal(noise, again)
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])
    assert float(noise.min()) > 0.0 and float(noise.max()) < 1.0
    # Roughly uniform.
    big = uniform_noise(torch.arange(64), torch.zeros(64, dtype=torch.long), 1024)
    assert abs(float(big.mean()) - 0.5) < 0.01


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


def test_extreme_bit_patterns_map_strictly_inside_zero_and_one() -> None:
    # Every pattern whose top 23 bits are all ones or all zeros, through the real mapping.
    patterns = torch.tensor([0, 1, 0x1FF, 0x200, 0xFFFFFE00, 0xFFFFFEFF, 0xFFFFFF00, 0xFFFFFFFF, 1 << 31])
    uniform = bits_to_uniform(patterns)
    assert uniform.dtype == torch.float32
    assert bool((uniform > 0.0).all()) and bool((uniform < 1.0).all())
    assert float(uniform[0]) == 2.0**-24 and float(uniform[7]) == 1.0 - 2.0**-24
    noise = gumbel(uniform)
    assert bool(torch.isfinite(noise).all()), noise
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
    assert bool(torch.isfinite(gumbel(uniform_noise(params.seed, params.offset, vocab))).all())
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
    extreme = gumbel(bits_to_uniform(torch.tensor([0xFFFFFFFF, 0])))
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
    reference = (scaled + gumbel(uniform_noise(seed, offset, vocab))).argmax(dim=-1)
    assert torch.equal(gumbel_argmax(scaled, seed, offset), reference)


def test_blockwise_cpu_draw_breaks_ties_and_nans_as_argmax() -> None:
    seed, offset = torch.tensor([1, 2]), torch.tensor([0, 0])
    scaled = torch.randn(2, 300, generator=torch.Generator().manual_seed(0))
    # Scores equal at two ids of different blocks (the noise vanishes next to 1e30): the
    # first id wins, as torch.argmax's.
    scaled[:, 10] = scaled[:, 250] = 1e30
    scaled[1, 280] = float("nan")  # torch.argmax picks a NaN
    reference = (scaled + gumbel(uniform_noise(seed, offset, 300))).argmax(dim=-1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(noise, "BLOCK_ELEMENTS", 128)
        assert torch.equal(gumbel_argmax(scaled, seed, offset), reference)
    assert reference.tolist() == [10, 280]
