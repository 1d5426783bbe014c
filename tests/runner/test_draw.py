"""The CPU's draw from a row's largest logits gives the same pick as the whole-vocabulary one,
in torch ops and in the C kernels (:mod:`aiocb.runner.native`, tested on their own in
``test_native_draw.py``)."""

from __future__ import annotations

import pytest
import torch

from aiocb.runner import native
from aiocb.runner.draw import CANDIDATES, draw, draw_full
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
