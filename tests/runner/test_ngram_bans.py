"""``no_repeat_ngram_size``'s bans against transformers' ``NoRepeatNGramLogitsProcessor``."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from transformers.generation.logits_process import NoRepeatNGramLogitsProcessor

from aiocb.runner import ngram_bans
from aiocb.runner.ngram_bans import RepeatedNgrams


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_the_bans_are_transformers_at_every_length(size: int) -> None:
    """Grown a token at a time, as a request's history is (sometimes several tokens between
    two calls), the banned tokens are exactly those transformers sets to -inf. A vocabulary
    of 6 makes repeats, and tokens above 255 make byte patterns that straddle two tokens."""
    rng = random.Random(size)
    vocab = [0, 1, 2, 257, 65_536, 2**31 - 1]
    processor = NoRepeatNGramLogitsProcessor(size)
    for _ in range(20):
        tokens: list[int] = []
        ngrams = RepeatedNgrams()
        while len(tokens) < 60:
            tokens += [rng.choice(vocab) for _ in range(rng.choice([1, 1, 1, 3]))]
            ids = torch.tensor([[vocab.index(t) for t in tokens]])
            scores = processor(ids, torch.zeros(1, len(vocab)))
            expected = {vocab[i] for i in torch.nonzero(scores[0] == float("-inf")).flatten().tolist()}
            banned = ngrams.bans(tokens, size)
            assert len(banned) == len(set(banned)) and set(banned) == expected, (tokens, size)


def test_a_match_that_straddles_two_tokens_bans_nothing() -> None:
    """As little-endian int64 bytes, ``[0, 1]`` holds those of 256 seven bytes in (0's last
    byte, then 1's first seven): that is no occurrence of 256, and nothing follows one."""
    assert RepeatedNgrams().bans([0, 1, 5, 256], 2) == []
    assert RepeatedNgrams().bans([0, 1, 256, 7, 256], 2) == [7]


@pytest.mark.parametrize("size", [2, 3, 4])
def test_a_suffix_repeated_thousands_of_times_is_matched_in_one_pass(
    size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past a few hundred occurrences of the suffix (one token over and over, a pattern
    repeated), the rest are found in one vectorised pass: the bans are still transformers'."""
    passes = 0
    following = ngram_bans._following

    def counted(*args: Any) -> list[int]:
        nonlocal passes
        passes += 1
        return following(*args)

    monkeypatch.setattr(ngram_bans, "_following", counted)
    rng = random.Random(size)
    processor = NoRepeatNGramLogitsProcessor(size)
    for history in ([7] * 3000, [1, 2, 3] * 1000, [rng.choice([4, 5]) for _ in range(3000)]):
        ngrams = RepeatedNgrams()
        for length in (len(history) - 5, len(history) - 2, len(history)):  # (grown between calls)
            tokens = history[:length]
            ids = torch.tensor([tokens])
            scores = processor(ids, torch.zeros(1, 8))
            expected = set(torch.nonzero(scores[0] == float("-inf")).flatten().tolist())
            banned = ngrams.bans(tokens, size)
            assert len(banned) == len(set(banned)) and set(banned) == expected, (history[:6], length, size)
    assert passes >= 3
