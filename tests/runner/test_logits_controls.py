"""Batched logits controls against transformers' own processors, row by row."""

from __future__ import annotations

import random
from collections import Counter

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
)

from aiocb.core.sequences import SequenceMatcher, matched_sequence_bias
from aiocb.runner.logits_controls import LogitsControls, apply_controls, apply_min_p

VOCAB = 40
INF = float("inf")


def _logits(rows: int, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


def _flat(per_row: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row id lists as the flat ``(rows, ids)`` pair the controls take."""
    rows = [r for r, ids in enumerate(per_row) for _ in ids]
    return torch.tensor(rows, dtype=torch.long), torch.tensor([i for ids in per_row for i in ids], dtype=torch.long)


def _history(prompts: list[list[int]], outputs: list[list[int]]) -> dict[str, torch.Tensor]:
    rows, ids = _flat([p + o for p, o in zip(prompts, outputs, strict=True)])
    flags = [[False] * len(p) + [True] * len(o) for p, o in zip(prompts, outputs, strict=True)]
    is_output = torch.tensor([flag for row in flags for flag in row])
    return {"history_rows": rows, "history_ids": ids, "history_is_output": is_output}


def _bias(pairs: list[list[tuple[int, float]]]) -> dict[str, torch.Tensor]:
    rows, ids = _flat([[t for t, _ in row] for row in pairs])
    values = torch.tensor([b for row in pairs for _, b in row], dtype=torch.float32)
    return {"bias_rows": rows, "bias_ids": ids, "bias_values": values}


def _bans(per_row: list[list[int]]) -> dict[str, torch.Tensor]:
    rows, ids = _flat(per_row)
    return {"ban_rows": rows, "ban_ids": ids}


def _row(processor: object, history: list[int], scores: torch.Tensor) -> torch.Tensor:
    """One row through a transformers processor, with its history as ``input_ids``."""
    assert callable(processor)
    result: torch.Tensor = processor(torch.tensor([history], dtype=torch.long), scores[None].clone())
    return result[0]


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=0.0, atol=1e-5)


def test_repetition_penalty_matches_transformers() -> None:
    prompts = [[1, 2, 3], [4, 4, 5, 9], [6, 7], [8, 8, 8]]
    outputs = [[2], [5, 5, 10], [7, 6, 11], [8, 12]]
    penalties = [1.0, 1.3, 0.7, 2.5]
    logits = _logits(4)
    controls = LogitsControls(repetition_penalty=torch.tensor(penalties), **_history(prompts, outputs))
    result = apply_controls(logits, controls)
    assert torch.equal(result[0], logits[0])
    for i in range(1, 4):
        history = prompts[i] + outputs[i]
        expected = _row(RepetitionPenaltyLogitsProcessor(penalties[i]), history, logits[i])
        _close(result[i], expected)
        assert not torch.equal(result[i], logits[i])
        # Tokens outside the history are untouched.
        untouched = torch.ones(VOCAB, dtype=torch.bool)
        untouched[history] = False
        assert torch.equal(result[i][untouched], logits[i][untouched])


def test_frequency_and_presence_penalties_count_output_tokens_only() -> None:
    prompts = [[1, 2], [3, 3, 4], [5, 6, 6], [7]]
    outputs = [[1], [4, 4, 8, 9, 9, 9], [6, 10, 10], [7, 7]]
    frequency = [0.0, 0.5, -0.3, 0.0]
    presence = [0.0, 1.5, 0.0, -0.8]
    logits = _logits(4, seed=1)
    controls = LogitsControls(
        frequency_penalty=torch.tensor(frequency), presence_penalty=torch.tensor(presence), **_history(prompts, outputs)
    )
    result = apply_controls(logits, controls)
    assert torch.equal(result[0], logits[0])
    for i in range(1, 4):
        expected = logits[i].clone()
        for token, count in Counter(outputs[i]).items():
            expected[token] -= frequency[i] * count + presence[i] * (count > 0)
        _close(result[i], expected)
        assert not torch.equal(result[i], logits[i])
    # Prompt-only tokens are not penalised.
    assert result[1, 3] == logits[1, 3] and result[2, 5] == logits[2, 5]


def test_sequence_bias_matches_transformers() -> None:
    histories = [[1, 2, 3], [4, 5], [6], [7, 8, 9]]
    sequences: list[list[tuple[tuple[int, ...], float]]] = [
        # (3, 12) is listed twice: the last bias wins, as in transformers' dict.
        [((10,), 2.0), ((2, 3, 11), -1.5), ((3, 12), 0.75), ((9, 13), 4.0), ((3, 12), -0.25)],
        # (4, 5, 14): one longer than the history, its prefix is the whole history: it applies.
        # (1, 4, 5, 15): its prefix is longer than the history: skipped.
        [((4, 5, 14), 3.0), ((1, 4, 5, 15), -2.0), ((14,), 1.0)],
        [],
        [((8, 9, 16), -3.0), ((16,), 0.5), ((7, 9, 17), 5.0), ((17, 18), 1.0)],
    ]
    pairs = [matched_sequence_bias(h, s) for h, s in zip(histories, sequences, strict=True)]
    assert pairs[1] == [(14, 3.0), (14, 1.0)]
    logits = _logits(4, seed=2)
    result = apply_controls(logits, LogitsControls(**_bias(pairs)))
    assert torch.equal(result[2], logits[2])
    for i in (0, 1, 3):
        processor = SequenceBiasLogitsProcessor(sequence_bias=[[list(s), b] for s, b in sequences[i]])
        _close(result[i], _row(processor, histories[i], logits[i]))
        assert not torch.equal(result[i], logits[i])


def test_bans_match_bad_words_and_min_new_tokens() -> None:
    eos = 0
    histories = [[1, 2, 3], [4, 5, 6], [7, 8]]
    bad_words = [[[5], [2, 3], [3, 20], [eos]], [[eos, 9], [5, 6, 21], [22]], [[8, eos], [23]]]
    # The caller drops the bad words that are exactly one EOS token, as transformers does.
    pairs = [
        matched_sequence_bias(h, [(tuple(w), -INF) for w in words if w != [eos]])
        for h, words in zip(histories, bad_words, strict=True)
    ]
    logits = _logits(4, seed=3)
    result = apply_controls(logits, LogitsControls(**_bans([[t for t, _ in p] for p in pairs] + [[]])))
    for i in range(3):
        expected = _row(NoBadWordsLogitsProcessor(bad_words[i], eos_token_id=eos), histories[i], logits[i])
        _close(result[i], expected)
    assert result[0, 5] == -INF and result[0, 2] == logits[0, 2] and result[0, eos] == logits[0, eos]
    assert result[2, eos] == -INF
    assert torch.equal(result[3], logits[3])

    # min_new_tokens: the EOS ids are banned while a row has generated too few tokens.
    eos_ids = [0, 7]
    prompt_length, min_new_tokens, generated = 3, 4, [2, 4]
    banned = [eos_ids if n < min_new_tokens else [] for n in generated]
    result = apply_controls(logits[:2], LogitsControls(**_bans(banned)))
    for i, n in enumerate(generated):
        processor = MinNewTokensLengthLogitsProcessor(prompt_length, min_new_tokens, eos_ids)
        expected = _row(processor, list(range(prompt_length + n)), logits[i])
        assert torch.equal(result[i], expected)
    assert result[0, 7] == -INF and torch.equal(result[1], logits[1])


def test_allowed_tokens_keep_only_their_values() -> None:
    allowed = [[3, 5, 5, 30], [], [0, 39]]
    restrict = torch.tensor([True, False, True])
    rows, ids = _flat(allowed)
    logits = _logits(3, seed=4)
    result = apply_controls(logits, LogitsControls(restrict_rows=restrict, allow_rows=rows, allow_ids=ids))
    assert torch.equal(result[1], logits[1])
    for i in (0, 2):
        finite = result[i].isfinite().nonzero()[:, 0].tolist()
        assert finite == sorted(set(allowed[i]))
        assert torch.equal(result[i, finite], logits[i, finite])
        assert (result[i][~result[i].isfinite()] == -INF).all()


def test_min_p_matches_transformers_after_temperature() -> None:
    temperatures = [0.7, 1.0, 1.5, 0.5]
    min_p = [0.1, 0.0, 0.05, 0.3]
    logits = _logits(4, seed=5, scale=3.0)
    scaled = torch.stack([_row(TemperatureLogitsWarper(t), [], logits[i]) for i, t in enumerate(temperatures)])
    # Entries a previous filter (top-k) already removed stay removed.
    scaled[3, :5] = -INF
    result = apply_min_p(scaled, torch.tensor(min_p))
    assert torch.equal(result[1], scaled[1])
    for i in (0, 2, 3):
        expected = _row(MinPLogitsWarper(min_p[i]), [], scaled[i])
        _close(result[i], expected)
        removed = result[i] == -INF
        assert removed.sum() > (scaled[i] == -INF).sum()
        assert not removed[scaled[i].argmax()]


def test_combined_row_follows_transformers_order() -> None:
    history = [1, 2, 3, 2, 4]
    bias = [((2,), 1.5), ((4,), -2.0), ((3, 4, 5), 3.0), ((6,), 0.5)]
    bad_words = [[6], [4, 7], [9, 9]]
    penalty = 1.4
    logits = _logits(3, seed=6)
    bias_pairs = matched_sequence_bias(history, bias)
    bans = [t for t, _ in matched_sequence_bias(history, [(tuple(w), -INF) for w in bad_words])]
    controls = LogitsControls(
        repetition_penalty=torch.tensor([1.0, penalty, 1.0]),
        **_bias([[], bias_pairs, []]),
        **_history([[], history, []], [[], [], []]),
        **_bans([[], bans, []]),
    )
    result = apply_controls(logits, controls)
    processors = LogitsProcessorList(
        [
            SequenceBiasLogitsProcessor(sequence_bias=[[list(s), b] for s, b in bias]),
            RepetitionPenaltyLogitsProcessor(penalty),
            NoBadWordsLogitsProcessor(bad_words),
        ]
    )
    _close(result[1], _row(processors, history, logits[1]))
    assert result[1, 6] == -INF and result[1, 7] == -INF
    assert torch.equal(result[0], logits[0]) and torch.equal(result[2], logits[2])


def test_rows_without_controls_are_bitwise_unchanged_and_input_is_untouched() -> None:
    logits = _logits(4, seed=7)
    logits[3, 0] = -0.0
    before = logits.clone()
    allow_rows, allow_ids = _flat([[], [], [1, 2], []])
    controls = LogitsControls(
        repetition_penalty=torch.tensor([1.2, 1.0, 1.0, 1.0]),
        frequency_penalty=torch.tensor([0.0, 0.4, 0.0, 0.0]),
        presence_penalty=torch.tensor([0.0, 0.6, 0.0, 0.0]),
        restrict_rows=torch.tensor([False, False, True, False]),
        allow_rows=allow_rows,
        allow_ids=allow_ids,
        **_history([[1, 2], [3], [], []], [[2, 5], [3, 6], [], []]),
        **_bias([[(1, 0.5)], [], [(0, -1.0)], []]),
        **_bans([[], [9], [], []]),
    )
    result = apply_controls(logits, controls)
    assert torch.equal(logits, before)
    assert torch.equal(result[3], logits[3]) and torch.equal(result[3].signbit(), logits[3].signbit())
    for i in range(3):
        assert not torch.equal(result[i], logits[i])
    assert apply_controls(logits, LogitsControls()) is logits
    assert torch.equal(apply_min_p(logits, torch.zeros(4)), logits)
    assert torch.equal(logits, before)


def test_an_indexed_matcher_gives_every_pair_in_order_as_history_grows() -> None:
    """One :class:`SequenceMatcher` per request, asked at every step as its history grows,
    gives the pairs comparing every sequence would give, in the sequences' order (a token's
    biases add up in that order), with duplicates' last bias and too-long prefixes skipped."""

    def every_sequence(history: list[int], sequences: list[tuple[tuple[int, ...], float]]) -> list[tuple[int, float]]:
        pairs = []
        for sequence, bias in dict(sequences).items():
            prefix = sequence[:-1]
            if len(prefix) <= len(history) and tuple(history[len(history) - len(prefix) :]) == prefix:
                pairs.append((sequence[-1], bias))
        return pairs

    rng = random.Random(5)
    for _ in range(30):
        sequences = [
            (tuple(rng.randrange(4) for _ in range(rng.randint(1, 5))), float(rng.randint(-3, 3))) for _ in range(40)
        ]
        matcher = SequenceMatcher(sequences)
        history: list[int] = []
        for _ in range(40):
            assert matcher.matches(history) == every_sequence(history, sequences), (history, sequences)
            history.append(rng.randrange(4))
