"""The CPU sampler's C kernel picks what the torch draw picks, and its absence is harmless."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch

from aiocb.runner import draw as draw_module
from aiocb.runner import native
from aiocb.runner.draw import CANDIDATES, draw, draw_full


def built_kernels() -> ctypes.CDLL:
    """The kernels; a test of them is skipped on a machine without a C compiler (the torch
    path they fall back to is tested there), and fails where one cannot build them."""
    if shutil.which(os.environ.get("CC") or "cc") is None:
        pytest.skip("no C compiler on PATH: the sampler keeps its torch ops")
    library = native.library()
    assert library is not None, "a C compiler is on PATH, yet the kernels did not build (see the warning logged)"
    return library


@pytest.fixture(scope="module")
def kernel() -> ctypes.CDLL:
    return built_kernels()


def _columns(rows: int, k: int, p: float, seed: int = 0) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    temperature = torch.rand(rows, generator=generator) * 1.5 + 0.3
    seeds = torch.randint(0, 2**32, (rows,), generator=generator)
    offsets = torch.randint(0, 10_000, (rows,), generator=generator)
    return temperature, seeds, offsets, torch.full((rows,), k), torch.full((rows,), p)


def _by_kernel(
    kernel: ctypes.CDLL, logits: torch.Tensor, *columns: torch.Tensor, min_p: torch.Tensor | None = None
) -> torch.Tensor:
    temperature, seeds, offsets, k, p = columns
    log_min_p = None if min_p is None else min_p.log()
    return native.draw_filtered(kernel, logits, temperature, k, p, log_min_p, seeds, offsets)


@pytest.mark.parametrize(
    ("vocab", "k", "p", "min_p", "scale"),
    [
        (4096, 50, 0.9, 0.0, 3.0),  # the common setting
        (4096, 50, 1.0, 0.0, 3.0),  # top-k alone
        (4096, 1, 1.0, 0.0, 3.0),
        (5003, 7, 0.5, 0.0, 1.0),  # a vocabulary that is no multiple of the vector width
        (5003, 200, 0.95, 0.05, 2.0),  # with min-p
        (300, 100, 0.9, 0.0, 3.0),  # too few tokens for the groups: every logit a candidate
        (300, 299, 0.8, 0.0, 0.5),
        (65_536, CANDIDATES, 0.9, 0.0, 1.0),
        (5000, 3000, 0.9, 0.0, 1.0),  # a top-k of most of the vocabulary
        (4096, 50, 0.9, 0.0, 0.01),  # nearly flat: the nucleus spans the whole top-k
        (4096, 50, 0.3, 0.0, 10.0),  # peaked: the nucleus is one or two tokens
        # top-p alone: the nucleus within the first 64 candidates, within 1,024, or wider
        (4096, 0, 0.9, 0.0, 8.0),
        (4096, 0, 0.9, 0.0, 1.5),
        (4096, 0, 0.99, 0.0, 0.01),
        (5003, 0, 0.8, 0.05, 3.0),
        (151_936, 0, 0.95, 0.0, 2.0),
    ],
)
def test_the_kernel_picks_what_the_full_draw_picks(
    kernel: ctypes.CDLL, vocab: int, k: int, p: float, min_p: float, scale: float
) -> None:
    rows = 64
    generator = torch.Generator().manual_seed(vocab + k)
    logits = torch.randn(rows, vocab, generator=generator) * scale
    columns = _columns(rows, k, p, seed=k)
    mp = torch.full((rows,), min_p) if min_p else None
    tokens = _by_kernel(kernel, logits, *columns, min_p=mp)
    temperature, seeds, offsets, ks, ps = columns
    expected = draw_full(logits / temperature[:, None], seeds, offsets, ks, ps, mp)
    assert torch.equal(tokens, expected)
    assert torch.equal(draw(logits, temperature, seeds, offsets, ks, ps, mp), expected)


def test_picks_do_not_depend_on_batch_mates_threads_or_layout(kernel: ctypes.CDLL) -> None:
    rows, vocab = 96, 8192
    wide = torch.randn(rows, vocab + 5) * 3
    logits = wide[:, 3 : 3 + vocab]  # (rows not contiguous in memory)
    columns = _columns(rows, 40, 0.9)
    together = _by_kernel(kernel, logits, *columns)  # (on torch's OpenMP team)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = _by_kernel(kernel, logits, *columns)
        torch.set_num_threads(max(2, threads))
        kernel.aiocb_use_openmp(None, None, None)
        own_threads = _by_kernel(kernel, logits, *columns)
    finally:
        torch.set_num_threads(threads)
        kernel.aiocb_use_openmp(*native._openmp_entry_points())
    assert torch.equal(together, one_thread)
    assert torch.equal(own_threads, one_thread)
    for row in (0, 37, rows - 1):
        alone = _by_kernel(kernel, logits[row : row + 1].clone(), *(c[row : row + 1] for c in columns))
        assert int(alone[0]) == int(together[row])


@pytest.mark.parametrize("k", [50, 0])  # with a top-k, or a top-p alone
def test_nan_and_masked_logits_rank_as_torch_ranks_them(kernel: ctypes.CDLL, k: int) -> None:
    rows, vocab = 4, 4096
    logits = torch.randn(rows, vocab) * 3
    logits[0, 1234] = float("nan")  # a NaN ranks first and wins (as torch.topk and max rank it)
    logits[1, :] = float("-inf")  # an allow-list of ten tokens: fewer than the top-k
    allowed = torch.tensor([5, 77, 300, 301, 1000, 2047, 2048, 3000, 4000, 4095])
    logits[1, allowed] = torch.randn(10)
    logits[2, :] = float("-inf")  # a single allowed token
    logits[2, 999] = 0.0
    columns = _columns(rows, k, 0.9)
    tokens = _by_kernel(kernel, logits, *columns)
    temperature, seeds, offsets, ks, ps = columns
    assert int(tokens[0]) == 1234
    assert int(tokens[1]) in allowed.tolist()
    assert int(tokens[2]) == 999
    torch_path = draw_module._draw_from_candidates(logits, temperature, seeds, offsets, ks, ps, None)
    assert torch.equal(tokens[1:], torch_path[1:])


def test_tied_logits_keep_a_top_k_set(kernel: ctypes.CDLL) -> None:
    rows, vocab, k = 32, 4096, 50
    logits = torch.randint(0, 8, (rows, vocab)).float()  # ties everywhere, at the k-th too
    tokens = _by_kernel(kernel, logits, *_columns(rows, k, 1.0))
    kth = logits.topk(k, dim=-1).values[:, -1]
    assert bool((logits.gather(1, tokens[:, None])[:, 0] >= kth).all())


def test_batches_mixing_the_kernel_and_torch_ways(kernel: ctypes.CDLL) -> None:
    rows, vocab = 12, 5000
    logits = torch.randn(rows, vocab) * 3
    temperature, seeds, offsets, _, _ = _columns(rows, 0, 1.0)
    k = torch.tensor([50, 0, 0, 2 * CANDIDATES, 10, 0, 50, 0, 3000, 20, 0, 1])
    p = torch.tensor([0.9, 1.0, 0.8, 1.0, 1.0, 0.95, 1.0, 1.0, 0.9, 0.5, 0.7, 1.0])
    tokens = draw(logits, temperature, seeds, offsets, k, p, None)
    assert torch.equal(tokens, draw_full(logits / temperature[:, None], seeds, offsets, k, p, None))


@pytest.fixture
def fresh_build(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The loader as in a new process, building into an empty cache directory."""
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setenv("AIOCB_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_the_kernel_is_built_once_into_the_cache_directory(kernel: ctypes.CDLL, fresh_build: Path) -> None:
    library = native.library()
    assert library is not None
    built = list(fresh_build.glob("aiocb-native-*.so"))
    assert len(built) == 1
    assert native.library() is library
    assert not [p for p in fresh_build.iterdir() if p not in built], "no partial build is left behind"


def test_without_a_compiler_the_torch_path_picks_the_same_tokens(
    fresh_build: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", "no-such-compiler")
    rows, vocab = 16, 4096
    logits = torch.randn(rows, vocab) * 3
    temperature, seeds, offsets, k, p = _columns(rows, 50, 0.9)
    with caplog.at_level(logging.WARNING, logger="aiocb.runner.native"):
        tokens = draw(logits, temperature, seeds, offsets, k, p, None)
    assert native.library() is None
    assert "no-such-compiler" in caplog.text
    assert not list(fresh_build.iterdir())
    assert torch.equal(tokens, draw_full(logits / temperature[:, None], seeds, offsets, k, p, None))


def test_the_kernel_can_be_turned_off(fresh_build: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOCB_NATIVE", "0")
    assert native.library() is None
    assert not list(fresh_build.iterdir())


@pytest.mark.parametrize(
    ("vocab", "scale", "min_p"),
    [
        (4096, 3.0, 0.0),
        (4099, 0.01, 0.0),  # nearly flat, and no multiple of the vector width
        (4096, 0.0, 0.0),  # all equal: the noise alone decides
        (32_768, 40.0, 0.0),  # a language model's spread: most tokens cannot win, not even hashed
        (3, 1.0, 0.0),  # narrower than one vector
        (4096, 3.0, 0.05),  # with a min-p
        (32_768, 2.0, 0.3),
    ],
)
def test_the_whole_vocabulary_draw_picks_what_the_torch_one_picks(
    kernel: ctypes.CDLL, vocab: int, scale: float, min_p: float
) -> None:
    rows = 40
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(rows, vocab, generator=generator) * scale
    temperature, seeds, offsets, _, _ = _columns(rows, 0, 1.0, seed=vocab)
    mp = torch.full((rows,), min_p) if min_p else None
    tokens = native.draw_whole(kernel, logits, temperature, None if mp is None else mp.log(), seeds, offsets)
    assert torch.equal(tokens, draw_full(logits / temperature[:, None], seeds, offsets, None, None, mp))
    unfiltered = torch.zeros(rows, dtype=torch.long)
    assert torch.equal(draw(logits, temperature, seeds, offsets, unfiltered, torch.ones(rows), mp), tokens)


def test_a_token_far_below_the_top_wins_by_its_tail_noise(kernel: ctypes.CDLL) -> None:
    """The whole-vocabulary draw hashes no token that only noise from the far tail (past
    16.6) could make win; such tokens' ids are found by inverting the hash: a token 17 to
    23 below the top whose noise says it wins, wins (ties too: the first index), and peaked
    rows (most tokens more than 16.6 below the top) pick what the torch draw picks."""
    from aiocb.runner.noise import gumbel_noise

    vocab, found = 151_936, []
    for start in range(0, 40_000, 200):  # (rows with some noise over 17)
        seeds = torch.arange(start, start + 200)
        noise = gumbel_noise(seeds, torch.zeros_like(seeds), vocab)
        top, at = noise.max(dim=-1)
        found += [(int(seeds[r]), int(at[r]), noise[r]) for r in (top > 17.0).nonzero()[:, 0].tolist()]
        if len(found) >= 6:
            break
    rows = len(found)
    seeds, offsets = torch.tensor([f[0] for f in found]), torch.zeros(rows, dtype=torch.long)
    logits = torch.full((rows, vocab), -40.0)
    for row, (_, at, noise) in enumerate(found):
        other = (at + 7) % vocab
        logits[row, other] = 0.0
        # beats the top by 0.25, ties with it, or loses by 0.25
        logits[row, at] = noise[other] - noise[at] + (0.25, 0.0, -0.25)[row % 3]
    temperature = torch.ones(rows)
    tokens = native.draw_whole(kernel, logits, temperature, None, seeds, offsets)
    assert torch.equal(tokens, draw_full(logits, seeds, offsets, None, None, None))
    assert [int(t) == f[1] for t, f in zip(tokens, found, strict=True)] == [
        row % 3 == 0 or (row % 3 == 1 and f[1] < (f[1] + 7) % vocab) for row, f in enumerate(found)
    ]
    peaked = torch.randn(32, vocab, generator=torch.Generator().manual_seed(1)) * 8
    temperature, seeds, offsets, _, _ = _columns(32, 0, 1.0, seed=1)
    tokens = native.draw_whole(kernel, peaked, temperature, None, seeds, offsets)
    assert torch.equal(tokens, draw_full(peaked / temperature[:, None], seeds, offsets, None, None, None))


def test_the_whole_vocabulary_draw_ranks_nan_and_masked_logits_as_torch_does(kernel: ctypes.CDLL) -> None:
    rows, vocab = 4, 1000
    logits = torch.randn(rows, vocab)
    logits[0, 500] = float("nan")
    logits[0, 700] = float("nan")  # the first NaN wins (as torch.argmax)
    logits[1, :] = float("-inf")  # nothing allowed: the first index, as torch.argmax
    logits[2, :] = float("-inf")
    logits[2, [3, 999]] = 0.0
    logits[3, 10] = float("inf")
    temperature, seeds, offsets, _, _ = _columns(rows, 0, 1.0)
    tokens = native.draw_whole(kernel, logits, temperature, None, seeds, offsets)
    assert tokens[0] == 500 and tokens[1] == 0 and int(tokens[2]) in (3, 999) and tokens[3] == 10
    assert torch.equal(tokens, draw_full(logits / temperature[:, None], seeds, offsets, None, None, None))


def test_the_kernels_refuse_logits_they_cannot_read(kernel: ctypes.CDLL) -> None:
    temperature, seeds, offsets, k, p = _columns(2, 5, 0.9)
    with pytest.raises(ValueError, match=r"float32 CPU logits, not torch\.float64"):
        native.draw_filtered(kernel, torch.randn(2, 100, dtype=torch.float64), temperature, k, p, None, seeds, offsets)
    with pytest.raises(ValueError, match=r"not torch\.bfloat16"):
        native.draw_whole(kernel, torch.randn(2, 100).bfloat16(), temperature, None, seeds, offsets)
