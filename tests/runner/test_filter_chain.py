"""The rarer sampling filters (top-h, typical-p, epsilon and eta cutoffs): each one as
transformers' ``LogitsProcessor`` computes it, the whole chain in ``GenerationConfig``'s
order, and seeded draws that follow the filtered softmax as ``torch.multinomial``'s do."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    LogitsProcessor,
    TopHLogitsWarper,
    TypicalLogitsWarper,
)

from aiocb.runner.filter_chain import (
    OFF,
    apply_epsilon_cutoff,
    apply_eta_cutoff,
    apply_top_h,
    apply_typical_p,
    filter_chain,
)
from aiocb.runner.sampler import SamplingTensors, sample
from tests.runner.test_distribution import (
    CHUNK,
    DRAWS,
    MARGIN,
    Setting,
    multinomial_tv,
    realistic_logits,
    total_variation,
)
from tests.runner.test_sampler import Row

ROWS, VOCAB = 6, 512


def _logits(seed: int, masked: bool = True) -> torch.Tensor:
    """Rows of random logits of several spreads; with ``masked``, some tokens already at
    -inf, as an earlier filter or a ban leaves them."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(ROWS, VOCAB, generator=gen) * torch.linspace(0.5, 4.0, ROWS)[:, None]
    if masked:
        logits[torch.rand(ROWS, VOCAB, generator=gen) < 0.2] = float("-inf")
    return logits


FILTERS = {
    "top_h": (apply_top_h, TopHLogitsWarper, (0.05, 0.3, 0.7, 1.0)),
    "typical_p": (apply_typical_p, TypicalLogitsWarper, (0.05, 0.2, 0.5, 0.95)),
    "epsilon_cutoff": (apply_epsilon_cutoff, EpsilonLogitsWarper, (1e-4, 1e-3, 0.01, 0.2)),
    "eta_cutoff": (apply_eta_cutoff, EtaLogitsWarper, (1e-4, 1e-3, 0.01, 0.2)),
}


@pytest.mark.parametrize("name", FILTERS)
@pytest.mark.parametrize("masked", [False, True], ids=["whole", "masked"])
def test_each_filter_is_transformers_processor_row_by_row(name: str, masked: bool) -> None:
    """Rows with different values in one call: each comes out as transformers' processor
    makes it for that value alone (the same -inf tokens, the rest untouched), and rows
    whose value is off come out bitwise unchanged."""
    apply, warper, values = FILTERS[name]
    off = OFF[list(FILTERS).index(name)]
    logits = _logits(3, masked)
    per_row = torch.tensor([values[0], off, values[1], values[2], off, values[3]])
    ours = apply(logits, per_row)
    dropped_any = False
    for row, value in enumerate(per_row.tolist()):
        if value == off:
            assert torch.equal(ours[row], logits[row])
            continue
        processor: LogitsProcessor = warper(value)
        theirs = processor(torch.zeros(1, 1, dtype=torch.long), logits[row : row + 1].clone())[0]
        assert torch.equal(ours[row], theirs), f"row {row}, {name}={value}"
        dropped_any |= bool((theirs.isinf() & ~logits[row].isinf()).any())
        assert not theirs.isinf().all()
    assert dropped_any, "no value dropped a token: the comparison proves nothing"


def test_top_h_leaves_out_tokens_of_probability_zero() -> None:
    """Tokens whose probability underflows to 0 are dropped by top-h, as transformers'
    NaN entropy terms drop them (the processed logprobs report -inf for them)."""
    logits = torch.tensor([[0.0, -120.0, -130.0, -1.0]])
    theirs = TopHLogitsWarper(0.9)(torch.zeros(1, 1, dtype=torch.long), logits.clone())
    assert torch.equal(apply_top_h(logits, torch.tensor([0.9])), theirs)
    assert theirs[0, 1:3].isinf().all()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_chain_is_generation_configs_in_its_order(qwen3: PreTrainedModel, seed: int) -> None:
    """Every filter together, one value per row: each row as transformers' own warpers,
    built by ``generate`` from a GenerationConfig of that row's values, make it (top-h
    before top-k; typical-p, epsilon and eta after min-p)."""
    settings = [
        {"top_h": 0.6, "top_k": 40, "typical_p": 0.9, "epsilon_cutoff": 1e-3, "eta_cutoff": 1e-3},
        {"top_k": 20, "top_p": 0.9, "typical_p": 0.5},
        {"top_h": 0.3, "min_p": 0.05},
        {"top_p": 0.8, "min_p": 0.02, "eta_cutoff": 0.02},
        {"typical_p": 0.3, "epsilon_cutoff": 0.01},
        {},
    ]
    temperature = 0.8
    logits = _logits(10 + seed, masked=False)
    scaled = logits / temperature
    top_k = torch.tensor([s.get("top_k", 0) for s in settings])
    top_p = torch.tensor([s.get("top_p", 1.0) for s in settings])
    min_p = torch.tensor([s.get("min_p", 0.0) for s in settings])
    names = ("top_h", "typical_p", "epsilon_cutoff", "eta_cutoff")
    filters = torch.tensor([[s.get(n, off) for n, off in zip(names, OFF, strict=True)] for s in settings])
    ours = filter_chain(scaled, top_k, top_p, min_p, filters, (True, True, True, True))
    for row, setting in enumerate(settings):
        config = GenerationConfig(do_sample=True, temperature=temperature, **{"top_k": 0, **setting})
        warpers = qwen3._get_logits_processor(generation_config=config, device="cpu")
        theirs = warpers(torch.zeros(1, 1, dtype=torch.long), logits[row : row + 1].clone())[0]
        assert torch.equal(ours[row].isinf(), theirs.isinf()), f"row {row}: {setting}"
        kept = ~theirs.isinf()
        torch.testing.assert_close(ours[row][kept], theirs[kept], rtol=0, atol=0)


SETTINGS = {
    "typical-p": Setting(1.0, filters=(0.0, 0.5, 0.0, 0.0)),
    "epsilon": Setting(0.9, top_k=200, filters=(0.0, 1.0, 2e-3, 0.0)),
    "eta": Setting(1.0, filters=(0.0, 1.0, 0.0, 2e-3)),
    "top-h": Setting(0.8, filters=(0.5, 1.0, 0.0, 0.0)),
    "all": Setting(0.9, top_k=300, top_p=0.95, min_p=0.001, filters=(0.0, 0.9, 1e-4, 1e-3)),
}


def _target(logits: torch.Tensor, setting: Setting, dtype: torch.dtype) -> torch.Tensor:
    """The distribution transformers' own warpers leave, in ``dtype``."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    top_h, typical_p, epsilon, eta = setting.filters
    chain: list[LogitsProcessor] = [TemperatureLogitsWarper(setting.temperature)]
    chain += [TopHLogitsWarper(top_h)] if top_h else []
    chain += [TopKLogitsWarper(setting.top_k)] if setting.top_k else []
    chain += [TopPLogitsWarper(setting.top_p)] if setting.top_p < 1.0 else []
    chain += [MinPLogitsWarper(setting.min_p)] if setting.min_p else []
    chain += [TypicalLogitsWarper(typical_p)] if typical_p < 1.0 else []
    chain += [EpsilonLogitsWarper(epsilon)] if epsilon else []
    chain += [EtaLogitsWarper(eta)] if eta else []
    scores = LogitsProcessorList(chain)(torch.zeros(1, 1, dtype=torch.long), logits[None].to(dtype))[0]
    return scores.double().softmax(-1)


def _draws(logits: torch.Tensor, setting: Setting, count: int) -> torch.Tensor:
    rows = [
        Row(setting.temperature, setting.top_k, setting.top_p, setting.min_p, s, 0, filters=setting.filters)
        for s in range(count)
    ]
    chunks = [rows[i : i + CHUNK] for i in range(0, count, CHUNK)]
    drawn = []
    for chunk in chunks:
        batch = logits.expand(len(chunk), -1).contiguous()
        drawn.append(sample(batch, SamplingTensors.from_rows(chunk, batch.device)).tokens)
    return torch.cat(drawn)


@pytest.mark.parametrize("name", SETTINGS)
def test_draws_follow_the_filtered_softmax(name: str) -> None:
    """20,000 seeded draws through ``sample``: none outside the kept set, and a TV to
    transformers' filtered softmax at most ``torch.multinomial``'s plus 0.01; a sampler 10%
    off in temperature would fail."""
    setting = SETTINGS[name]
    logits = realistic_logits(4096)
    distribution = _target(logits, setting, torch.float64)
    support = distribution > 0
    assert torch.equal(support, _target(logits, setting, torch.float32) > 0), "the support is ambiguous"
    assert 1 < int(support.sum()) < 4000, "the filters do not matter here"
    draws = _draws(logits, setting, DRAWS)
    outside = draws[~support[draws]]
    assert outside.numel() == 0, f"{outside.numel()} draws outside the support"
    ours, reference = total_variation(draws, distribution), multinomial_tv(distribution, DRAWS)
    assert ours <= reference + MARGIN, f"TV {ours:.4f} against multinomial's {reference:.4f}"
    hotter = dataclasses.replace(setting, temperature=setting.temperature * 1.1)
    biased = torch.multinomial(_target(logits, hotter, torch.float64), DRAWS, True, generator=torch.Generator())
    assert total_variation(biased, distribution) > reference + MARGIN, "the check has no power here"


#: Rows with and without the rarer filters (a greedy one among them), for one batch.
MIXED_ROWS = [
    Row(1.0, seed=1, filters=(0.0, 0.5, 0.0, 0.0)),
    Row(0.7, top_k=30, seed=2),
    Row(0.0),
    Row(1.2, top_p=0.9, seed=3, offset=4, filters=(0.4, 1.0, 1e-3, 0.0)),
    Row(1.0, min_p=0.1, seed=4),
    Row(0.9, seed=5, filters=(0.0, 1.0, 0.0, 0.01)),
    Row(1.0, top_k=50, seed=6, filters=(0.0, 0.9, 1e-4, 1e-3)),
    Row(1.1, seed=7),
]


def test_a_rows_picks_do_not_depend_on_its_batch_mates() -> None:
    """Rows with and without the rarer filters, sampled together, pick what each picks
    alone (its own seed and offset), and greedy rows keep the argmax."""
    logits = _logits(5, masked=False)
    rows = MIXED_ROWS[:ROWS]
    together = sample(logits, SamplingTensors.from_rows(rows, logits.device)).tokens
    alone = [
        int(sample(logits[i : i + 1], SamplingTensors.from_rows([r], logits.device)).tokens) for i, r in enumerate(rows)
    ]
    assert together.tolist() == alone
    assert int(together[2]) == int(logits[2].argmax())


def test_a_filter_that_keeps_one_token_draws_the_argmax() -> None:
    """A filter that keeps only the most likely token leaves nothing to chance, whatever the
    seed: top-h that small, an epsilon cutoff above every other probability."""
    logits = _logits(6, masked=False)
    for filters in [(1e-6, 1.0, 0.0, 0.0), (0.0, 1.0, 0.99, 0.0)]:
        rows = [Row(1.0, seed=s, filters=filters) for s in range(ROWS)]
        picked = sample(logits, SamplingTensors.from_rows(rows, logits.device)).tokens
        assert picked.tolist() == logits.argmax(-1).tolist(), filters


def test_processed_logprobs_are_of_the_filtered_distribution() -> None:
    """A row asking for the processed logprobs gets those of the distribution it was drawn
    from: -inf outside the kept set, the renormalised softmax inside."""
    logits = _logits(7, masked=False)
    row = Row(0.8, top_k=100, seed=9, logprobs=True, top_logprobs=5, filters=(0.0, 0.6, 0.0, 1e-3))
    params = SamplingTensors.from_rows([row] * ROWS, logits.device)
    params.processed_logprobs = torch.ones(ROWS, dtype=torch.bool)
    picked = sample(logits, params)
    assert picked.logprobs is not None and picked.top_logprobs is not None
    setting = Setting(0.8, top_k=100, filters=(0.0, 0.6, 0.0, 1e-3))
    for r in range(ROWS):
        expected = _target(logits[r], setting, torch.float32).log()
        token = int(picked.tokens[r])
        assert math.isfinite(float(expected[token]))
        assert float(picked.logprobs[r]) == pytest.approx(float(expected[token]), abs=1e-5)
        kept = int(expected.isfinite().sum())
        tops = picked.top_logprobs[r]
        assert tops[: min(5, kept)].isfinite().all() and tops[kept:].isinf().all()


def test_the_chain_over_a_top_ks_candidates_is_the_chain_over_the_vocabulary(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a top-k on every row, the chain runs over each row's largest logits only: the
    same tokens are kept with the same logits as over the whole vocabulary, and the same
    tokens are drawn; a tie with a k-th largest logit that reaches the last candidate
    takes the whole vocabulary."""
    from aiocb.runner import sampler
    from aiocb.runner.filter_chain import candidates

    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(6, 8192, generator=gen) * torch.linspace(0.5, 4.0, 6)[:, None]
    top_k, top_p = torch.tensor([50, 5, 200, 50, 120, 30]), torch.tensor([1.0, 0.9, 0.95, 1.0, 0.8, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.01, 0.0, 0.0, 0.05])
    values = torch.tensor([(0.6, 0.9, 0.0, 1e-3), OFF, (0.0, 0.5, 1e-3, 0.0), (0.3, 1.0, 0.0, 0.0), OFF, OFF])
    used = (True, True, True, True)
    block = candidates(logits, top_k, used)
    assert block is not None and block[0].shape[1] == 216
    over_block = torch.full_like(logits, float("-inf")).scatter_(
        1, block[1], filter_chain(block[0], top_k, top_p, min_p, values, used)
    )
    whole = filter_chain(logits, top_k, top_p, min_p, values, used)
    assert torch.equal(over_block.isinf(), whole.isinf())
    assert torch.equal(over_block[~whole.isinf()], whole[~whole.isinf()])
    # the picks: sample() with and without the candidates
    rows = [Row(1.0, top_k=40, seed=s, filters=(0.0, 0.7, 0.0, 2e-3)) for s in range(64)]
    batch = logits[2:3].expand(64, -1).contiguous()
    fast = sample(batch, SamplingTensors.from_rows(rows, batch.device)).tokens
    monkeypatch.setattr(sampler, "candidates", lambda *args: None)
    slow = sample(batch, SamplingTensors.from_rows(rows, batch.device)).tokens
    assert fast.tolist() == slow.tolist() and len(set(fast.tolist())) > 5
    tied = logits.clone()
    tied[0, tied[0].topk(300).indices[49:]] = tied[0].topk(50).values[-1]  # (the 50th to the 300th)
    assert candidates(tied, top_k, used) is None
