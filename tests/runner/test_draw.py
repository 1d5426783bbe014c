"""The CPU's draw from a row's largest logits gives the same pick as the whole-vocabulary one,
in torch ops and in the C kernels (:mod:`aiocb.runner.native`, tested on their own in
``test_native_draw.py``)."""

from __future__ import annotations

import pytest
import torch

from aiocb.runner import native
from aiocb.runner.draw import CANDIDATES, draw, draw_full
from aiocb.runner.noise import gumbel_at
from tests.runner.test_native_draw import built_kernels


@pytest.fixture(autouse=True, params=["torch", "kernel"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test once in torch ops (as without a C compiler) and once in the kernels."""
    if request.param == "torch":
        monkeypatch.setattr(native, "library", lambda: None)
    else:
        built_kernels()
    return str(request.param)


CASES = [
    # (vocab, top_k, top_p, min_p, logit scale, temperature)
    (300, 0, 1.0, 0.0, 3.0, 1.0),  # fewer tokens than candidates: always exact
    (300, 20, 1.0, 0.0, 3.0, 0.7),
    (300, 40, 0.9, 0.1, 3.0, 1.3),
    (5000, 50, 0.95, 0.0, 4.0, 1.0),
    (5000, 0, 0.9, 0.0, 8.0, 1.0),  # a peaked row: the nucleus lies within the candidates
    (5000, 0, 0.999, 0.0, 0.1, 1.0),  # a flat row: the nucleus runs past them (full draw)
    (5000, 2 * CANDIDATES, 1.0, 0.0, 1.0, 1.0),  # a top-k larger than the candidates
    (5000, 2 * CANDIDATES, 0.9, 0.0, 1.0, 1.0),  # ... with a nucleus: its softmax needs all of it
    (5000, 0, 1.0, 0.0, 12.0, 1.0),  # no filter, peaked: no token left out can win
    (5000, 0, 1.0, 0.0, 1.0, 2.0),  # no filter, flat: one could (full draw)
    (5000, 0, 1.0, 0.05, 3.0, 1.0),  # min-p alone
]


def _full(logits: torch.Tensor, temperature: float, seed: torch.Tensor, k: int, p: float, min_p: float) -> torch.Tensor:
    rows = logits.shape[0]
    return draw_full(
        logits / temperature,
        seed,
        torch.zeros(rows, dtype=torch.long),
        torch.full((rows,), k),
        torch.full((rows,), p),
        torch.full((rows,), min_p) if min_p else None,
    )


@pytest.mark.parametrize(("vocab", "k", "p", "min_p", "scale", "temperature"), CASES)
def test_draw_picks_what_the_full_draw_picks(
    vocab: int, k: int, p: float, min_p: float, scale: float, temperature: float
) -> None:
    rows = 48
    generator = torch.Generator().manual_seed(vocab + k)
    logits = torch.randn(rows, vocab, generator=generator) * scale
    seed = torch.arange(rows) * 7919
    tokens = draw(
        logits,
        torch.full((rows,), temperature),
        seed,
        torch.zeros(rows, dtype=torch.long),
        torch.full((rows,), k),
        torch.full((rows,), p),
        torch.full((rows,), min_p) if min_p else None,
    )
    assert torch.equal(tokens, _full(logits, temperature, seed, k, p, min_p))


def test_rows_with_different_filters_in_one_batch() -> None:
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(len(CASES), 5000, generator=generator) * torch.tensor([c[4] for c in CASES])[:, None]
    seed = torch.arange(len(CASES)) + 11
    offset = torch.zeros(len(CASES), dtype=torch.long)
    temperature = torch.tensor([c[5] for c in CASES])
    k = torch.tensor([c[1] for c in CASES])
    p = torch.tensor([c[2] for c in CASES])
    mp = torch.tensor([c[3] for c in CASES])
    tokens = draw(logits, temperature, seed, offset, k, p, mp)
    for i, (_, ki, pi, mi, _, ti) in enumerate(CASES):
        assert int(tokens[i]) == int(_full(logits[i : i + 1], ti, seed[i : i + 1], ki, pi, mi)[0]), i
        alone = draw(
            logits[i : i + 1],
            temperature[i : i + 1],
            seed[i : i + 1],
            offset[:1],
            k[i : i + 1],
            p[i : i + 1],
            mp[i : i + 1],
        )
        assert int(alone[0]) == int(tokens[i]), "a row's pick must not depend on its batch-mates"


@pytest.mark.parametrize("path", ["torch"], indirect=True)  # (the torch path's fallback)
def test_only_the_rows_that_need_it_take_the_full_draw(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiocb.runner import draw as module

    calls: list[int] = []
    original = module.draw_full

    def counting(scaled: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(scaled.shape[0])
        return original(scaled, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(module, "draw_full", counting)
    generator = torch.Generator().manual_seed(4)
    flat = torch.randn(3, 5000, generator=generator) * 0.05
    logits = torch.cat([flat, torch.randn(5, 5000, generator=generator) * 8])
    rows = logits.shape[0]
    zeros = torch.zeros(rows, dtype=torch.long)
    draw(logits, torch.ones(rows), torch.arange(rows), zeros, zeros, torch.full((rows,), 0.9), None)
    assert calls == [3]
    calls.clear()
    draw(logits[3:], torch.ones(5), torch.arange(5), zeros[:5], torch.full((5,), 50), torch.full((5,), 0.9), None)
    assert calls == []
    # A row a grammar masks down to three tokens: its top-k's -inf "ties" need no full draw.
    masked = torch.full((2, 5000), float("-inf"))
    masked[:, [7, 99, 4000]] = torch.tensor([1.0, 2.0, 0.5])
    picks = draw(masked, torch.ones(2), torch.arange(2), zeros[:2], torch.full((2,), 50), torch.ones(2), None)
    assert calls == [] and set(picks.tolist()) <= {7, 99, 4000}


def test_a_top_k_row_with_fewer_finite_logits_than_k_draws_among_them() -> None:
    """(A grammar's row: most of the vocabulary masked.) The same picks as the full draw,
    spread over the finite tokens, whichever path."""
    rows, vocab = 64, 20_000
    gen = torch.Generator().manual_seed(5)
    logits = torch.full((rows, vocab), float("-inf"))
    finite = torch.randint(0, vocab, (rows, 3), generator=gen)
    logits.scatter_(1, finite, torch.randn(rows, 3, generator=gen))
    seed, offset = torch.arange(rows), torch.zeros(rows, dtype=torch.long)
    top_k, top_p, ones = torch.full((rows,), 50), torch.full((rows,), 0.9), torch.ones(rows)
    for p in (ones, top_p):
        picks = draw(logits, ones, seed, offset, top_k, p, None)
        assert torch.equal(picks, draw_full(logits, seed, offset, top_k, p, None))


def tie_inclusive_pick(
    logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor, k: int, p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Gumbel winner over the support with ties kept whole, and that support.

    Top-k keeps every logit at least the k-th largest (transformers' top-k); top-p keeps a
    token when the mass strictly above it, over the top-k set's total, is below ``p``
    (transformers' top-p, but a tie at the edge is kept whole, not cut by a sort's order).
    """
    scaled = logits / temperature[:, None]
    kth = logits.topk(k, dim=-1).values[:, -1:] if k else torch.full_like(logits[:, :1], float("-inf"))
    in_k = logits >= kth
    weights = torch.where(in_k, (scaled - scaled.amax(-1, keepdim=True)).exp(), 0.0)
    above = (scaled[:, None, :] > scaled[:, :, None]).float()  # [R, i, j]: j above i
    mass_above = (above * weights[:, None, :]).sum(-1)
    support = in_k & ((mass_above < p * weights.sum(-1, keepdim=True)) | (mass_above == 0) | (p >= 1.0))
    ids = torch.arange(logits.shape[-1])[None, :]
    noise = gumbel_at(seed, offset, ids)
    return torch.where(support, scaled + noise, float("-inf")).argmax(-1), support


@pytest.mark.parametrize(("k", "p"), [(2, 1.0), (20, 1.0), (50, 1.0), (0, 0.8), (20, 0.8), (50, 0.5), (5, 0.3)])
def test_ties_at_the_k_th_and_at_the_nucleus_edge_are_kept_whole(k: int, p: float) -> None:
    """bf16 logits (a model's, upcast) tie often: every path keeps the whole tie at the k-th
    largest (as transformers' top-k does) and at the nucleus's edge, whatever a sort's order."""
    vocab, rows = 3000, 16
    gen = torch.Generator().manual_seed(9)
    logits = (torch.randn(rows, vocab, generator=gen) * 2).to(torch.bfloat16).float()
    logits[0, :6] = torch.tensor([0.0, 0.0, 0.0, 0.0, -5.0, -5.0]) + 20  # (four tied at the top)
    temperature = torch.rand(rows, generator=gen) + 0.5
    seed = torch.randint(0, 2**31, (rows,), generator=gen)
    offset = torch.randint(0, 100, (rows,), generator=gen)
    want, support = tie_inclusive_pick(logits, temperature, seed, offset, k, p)
    top_k, top_p = torch.full((rows,), k), torch.full((rows,), p)
    assert torch.equal(draw(logits, temperature, seed, offset, top_k, top_p, None), want)
    assert torch.equal(draw_full(logits / temperature[:, None], seed, offset, top_k, top_p, None), want)
    if k and p == 1.0:
        assert (support.sum(-1) > k).any(), "some row ties at the k-th"


def test_the_nucleus_stops_where_the_mass_before_a_token_reaches_top_p() -> None:
    """As transformers' top-p: the smallest set whose mass reaches top_p (0.5 + 0.25 here),
    not one token more."""
    from transformers.generation.logits_process import TopPLogitsWarper

    logits = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625]).log()[None, :].expand(400, -1).contiguous()
    kept = TopPLogitsWarper(0.75)(torch.zeros(1, 1, dtype=torch.long), logits[:1].clone()).isfinite()[0]
    assert kept.tolist() == [True, True, False, False, False]
    seeds, ones = torch.arange(400), torch.ones(400)
    for way in ("draw", "draw_full"):
        top_k, top_p, offset = torch.zeros(400, dtype=torch.long), torch.full((400,), 0.75), torch.zeros_like(seeds)
        if way == "draw":
            picks = draw(logits, ones, seeds, offset, top_k, top_p, None)
        else:
            picks = draw_full(logits, seeds, offset, None, top_p, None)
        assert set(picks.tolist()) == {0, 1}, way


@pytest.mark.parametrize("min_p", [0.05, 0.1, 0.2, 0.37])
def test_a_token_at_the_min_p_cutoff_is_kept_alike_by_every_path(min_p: float) -> None:
    """A token a float32 step either side of ``log(min_p)`` below the top: the candidates'
    draw, the full draw and :func:`apply_min_p` (processed log-probabilities) agree on it."""
    from aiocb.runner.logits_controls import apply_min_p

    rows, vocab = 400, 64
    cutoff = torch.tensor(min_p).log()
    seeds, offset, ones = torch.arange(rows), torch.zeros(rows, dtype=torch.long), torch.ones(rows)
    top_k, top_p, min_ps = torch.full((rows,), 10), torch.ones(rows), torch.full((rows,), min_p)
    for edge in (torch.nextafter(cutoff, torch.tensor(-1.0)), cutoff, torch.nextafter(cutoff, torch.tensor(0.0))):
        logits = -30.0 - 0.01 * torch.arange(vocab, dtype=torch.float32)
        logits[0], logits[1] = 0.0, edge
        kept = bool(apply_min_p(logits[None, :], torch.tensor([min_p]))[0, 1].isfinite())
        assert kept == bool(edge >= cutoff)
        grid = logits.expand(rows, vocab).contiguous()
        drawn = draw(grid, ones, seeds, offset, top_k, top_p, min_ps)
        assert bool((drawn == 1).any()) == kept, "the candidates' draw"
        assert bool((draw_full(grid, seeds, offset, top_k, top_p, min_ps) == 1).any()) == kept, "the full draw"
