"""Logits controls (penalties, biases, bad words, n-grams, min tokens) match ``model.generate`` greedily.

Each control is given once through a ``GenerationConfig`` and once through
``aiocb.SamplingParams`` / keyword arguments, under plain, pipelined (async batching, the
decode input and the penalty history taken from the step before on the device) and
preempting schedules, with requests that use no control sharing the batch.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from transformers import GenerationConfig, PreTrainedModel

import aiocb
from aiocb import sampling
from aiocb.core import sequences
from tests.conftest import MODELS, VOCAB, random_prompts, reference_generate

PROMPTS = random_prompts(6, 3, 60, seed=21)
NEW = 20

SCHEDULES: dict[str, dict[str, Any]] = {
    "plain": {},
    "async_batching": {"use_async_batching": True, "max_batch_tokens": 64},
    "preemption": {"page_size": 16, "num_blocks": 24, "max_batch_tokens": 64},
}


# (llama's cases run with `nox -s slow`; the gate checks llama's parity in tests/runner/test_parity.py)
@pytest.fixture(
    scope="module",
    params=[name if name == "qwen3" else pytest.param(name, marks=pytest.mark.slow) for name in sorted(MODELS)],
)
def model(request: pytest.FixtureRequest) -> PreTrainedModel:
    return MODELS[request.param]()


def _eos_for(model: PreTrainedModel, prompt: list[int]) -> int:
    """A token the model generates early for ``prompt``: as EOS it would end the request at once."""
    return reference_generate(model, prompt, NEW)[2]


def _cases(model: PreTrainedModel) -> dict[str, dict[str, Any]]:
    """generate() kwargs per control; the tokens are picked from the plain outputs so that each
    control changes them."""
    plain = reference_generate(model, PROMPTS[0], NEW)
    return {
        "repetition_penalty": {"repetition_penalty": 1.8},
        "repetition_penalty_below_one": {"repetition_penalty": 0.7},
        "bad_words": {"bad_words_ids": [[plain[1]], [plain[4], plain[5]], [PROMPTS[0][-1], plain[0]]]},
        "sequence_bias": {"sequence_bias": {(plain[3],): -5.0, (plain[0], plain[1]): -50.0, (7,): 4.0}},
        "min_new_tokens": {"min_new_tokens": 6, "eos_token_id": _eos_for(model, PROMPTS[0])},
        "no_repeat_ngram": {"no_repeat_ngram_size": 1},
        "combined": {
            "repetition_penalty": 1.3,
            "no_repeat_ngram_size": 2,
            "bad_words_ids": [[plain[2]]],
            "sequence_bias": {(plain[5],): -3.0},
            "min_new_tokens": 4,
            "eos_token_id": _eos_for(model, PROMPTS[0]),
        },
    }


def _as_sampling_params(kwargs: dict[str, Any]) -> aiocb.SamplingParams:
    mapped = dict(kwargs)
    if "min_new_tokens" in mapped:
        mapped["min_tokens"] = mapped.pop("min_new_tokens")
    bias = mapped.get("sequence_bias")
    if bias is not None:  # the one-token entries as OpenAI's logit_bias, the rest as sequence_bias
        mapped["logit_bias"] = {ids[0]: b for ids, b in bias.items() if len(ids) == 1}
        mapped["sequence_bias"] = {ids: b for ids, b in bias.items() if len(ids) > 1}
    return aiocb.SamplingParams(**mapped)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("via", ["generation_config", "sampling_params"])
async def test_controls_match_generate(model: PreTrainedModel, schedule: str, via: str) -> None:
    config = aiocb.ContinuousBatchingConfig(**SCHEDULES[schedule])
    for name, kwargs in _cases(model).items():
        references = [reference_generate(model, p, NEW, **kwargs) for p in PROMPTS]
        plain = [reference_generate(model, p, NEW) for p in PROMPTS]
        if name != "repetition_penalty_below_one":
            assert references != plain, f"{name} changes nothing: the test would not notice it broken"
        if via == "generation_config":
            gen = GenerationConfig(do_sample=False, max_new_tokens=NEW, **kwargs)
            manager = aiocb.Manager(model, gen, config)
            params: dict[str, Any] = {}
        else:
            manager = aiocb.Manager(model, GenerationConfig(do_sample=False), config)
            params = {"sampling_params": _as_sampling_params(kwargs), "max_new_tokens": NEW}
        async with manager:
            # Every other request uses no control: those must come out as plain greedy.
            ids = []
            for i, prompt in enumerate(PROMPTS):
                extra = params if i % 2 == 0 or via == "generation_config" else {"max_new_tokens": NEW}
                ids.append(await manager.add_request(prompt, **extra))
            outputs = {}
            async for output in manager:
                outputs[output.request_id] = output
                if len(outputs) == len(ids):
                    break
        for i, rid in enumerate(ids):
            expected = references[i] if i % 2 == 0 or via == "generation_config" else plain[i]
            assert outputs[rid].generated_tokens == expected, f"{name}, prompt {i}"
        stats = manager.statistics()
        assert stats.free_blocks == stats.total_blocks


async def test_stop_reason_is_the_stop_token(model: PreTrainedModel) -> None:
    eos = _eos_for(model, PROMPTS[0])
    async with aiocb.Manager(model, GenerationConfig(do_sample=False)) as manager:
        stopped = await manager.generate(PROMPTS[0], max_new_tokens=NEW, stop_token_ids=[eos])
        later = await manager.generate(PROMPTS[0], max_new_tokens=NEW, stop_token_ids=[eos], min_tokens=5)
    assert stopped.generated_tokens[-1] == eos and len(stopped.generated_tokens) == 3
    assert stopped.finish_reason is aiocb.FinishReason.STOP and stopped.stop_reason == eos
    assert len(later.generated_tokens) > 5 and eos not in later.generated_tokens[:5]


async def test_a_bad_word_that_is_an_eos_is_banned_only_when_the_eos_is_ignored(model: PreTrainedModel) -> None:
    """transformers keeps a one-token bad word that is an EOS reachable (the request can
    still end); with ``ignore_eos`` that EOS is a token as any other, and banned as one."""
    plain = reference_generate(model, PROMPTS[0], NEW)
    eos = plain[0]
    banned = reference_generate(model, PROMPTS[0], NEW, bad_words_ids=[[eos]])
    async with aiocb.Manager(model, GenerationConfig(do_sample=False)) as manager:
        kept = await manager.generate(PROMPTS[0], max_new_tokens=NEW, eos_token_id=eos, bad_words_ids=[[eos]])
        ignored = await manager.generate(
            PROMPTS[0], max_new_tokens=NEW, eos_token_id=eos, bad_words_ids=[[eos]], ignore_eos=True
        )
    assert kept.generated_tokens == [eos] and kept.finish_reason is aiocb.FinishReason.STOP
    assert ignored.generated_tokens == banned and eos not in banned
    assert ignored.finish_reason is aiocb.FinishReason.LENGTH


async def test_allowed_token_ids_and_penalties_restrict_outputs(model: PreTrainedModel) -> None:
    allowed = [5, 17, 99, 300]
    async with aiocb.Manager(model, GenerationConfig(do_sample=False)) as manager:
        greedy = await manager.generate(PROMPTS[1], max_new_tokens=NEW, allowed_token_ids=allowed)
        sampled = await manager.generate(PROMPTS[1], max_new_tokens=NEW, allowed_token_ids=allowed, temperature=1.0)
        # A presence penalty of 2 on a tiny random model forbids almost every repeat.
        free = await manager.generate(PROMPTS[1], max_new_tokens=NEW, temperature=0.0)
        penalized = await manager.generate(PROMPTS[1], max_new_tokens=NEW, presence_penalty=2.0, frequency_penalty=2.0)
    assert set(greedy.generated_tokens) <= set(allowed)
    assert set(sampled.generated_tokens) <= set(allowed)
    repeats = len(free.generated_tokens) - len(set(free.generated_tokens))
    assert len(penalized.generated_tokens) - len(set(penalized.generated_tokens)) < repeats


@pytest.mark.parametrize("many", [False, True])
async def test_requests_with_the_same_bad_words_index_them_once(
    qwen3: PreTrainedModel, many: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One index of the sequences for all n samples, and for the next requests with the same
    # ones (the prompts of a batch: each used to build its own, a thousand bad words about
    # a millisecond each time, on the loop); past 32, built on a worker thread before the
    # request is queued.
    built: list[str] = []
    matcher = sequences.SequenceMatcher

    class Counted(matcher):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any) -> None:
            built.append(threading.current_thread().name)
            super().__init__(*args)

    monkeypatch.setattr(sequences, "SequenceMatcher", Counted)
    checked: list[str] = []  # (the words checked and split: once too, for the same ones)
    checked_ids = sampling._checked_ids
    monkeypatch.setattr(
        sampling, "_checked_ids", lambda name, *a, **k: checked.append(name) or checked_ids(name, *a, **k)
    )
    plain = reference_generate(qwen3, PROMPTS[0], NEW)
    words = [[plain[1], plain[2]], [PROMPTS[0][-1], plain[0]]]
    if many:
        words += [[VOCAB - 1 - i % 50, i % VOCAB] for i in range(40)]
    controls: dict[str, Any] = {"bad_words_ids": words, "sequence_bias": {(plain[3], plain[4]): -50.0}}
    params = {"max_new_tokens": NEW, **controls}
    async with aiocb.Manager(qwen3, GenerationConfig(do_sample=False)) as manager:
        samples = await manager.generate(PROMPTS[0], n=4, temperature=1.0, seed=3, **params)
        alone = await manager.generate(PROMPTS[0], **params)
        batch = await manager.generate_batch([PROMPTS[0]] * 3 + [PROMPTS[1]], **params)
        assert len(built) == 2  # (the sequence biases' and the bad words' matchers)
        assert checked.count("bad_words_ids") == 1
        other = {**params, "bad_words_ids": words[:1]}
        await manager.generate(PROMPTS[0], **other)
    loop_thread = threading.current_thread().name
    assert len(built) == 4
    assert (built[0] != loop_thread) is many and (built[1] != loop_thread) is many
    assert [output.generated_tokens for output in batch.values()][:3] == [alone.generated_tokens] * 3
    expected = reference_generate(
        qwen3, PROMPTS[0], NEW, sequence_bias={(plain[3], plain[4]): -50.0}, bad_words_ids=words
    )
    assert alone.generated_tokens == expected
    assert len({tuple(s.generated_tokens) for s in samples}) > 1  # (sampled, each its own stream)
    for sample in samples:
        history = [*PROMPTS[0], *sample.generated_tokens]
        for i in range(len(PROMPTS[0]), len(history) - 1):
            assert [history[i], history[i + 1]] not in words[:2]


@pytest.mark.parametrize("schedule", ["plain", "async_batching"])
async def test_controls_that_leave_no_token_are_refused_or_fail_the_request(schedule: str) -> None:
    """A request whose own controls ban every token its first step could pick is refused,
    naming them; one whose bans grow to cover every token it may pick (an n-gram ban over
    a one-token allow-list) fails at that step with an error, not with a token it forbade
    (transformers' greedy search gives token 0 there); the request beside it keeps its
    output, and every block comes back."""
    from tests.conftest import tiny_qwen3

    config = aiocb.ContinuousBatchingConfig(**SCHEDULES[schedule])
    async with aiocb.Manager(tiny_qwen3(), GenerationConfig(do_sample=False), config) as manager:
        with pytest.raises(aiocb.InvalidRequestError, match=r"no token is left.*bad_words_ids") as refused:
            await manager.generate(PROMPTS[0], max_new_tokens=4, allowed_token_ids=[5, 6], bad_words_ids=[[5], [6]])
        assert refused.value.param == "allowed_token_ids"
        with pytest.raises(aiocb.InvalidRequestError, match=r"no token is left.*min_tokens"):
            await manager.generate(
                PROMPTS[0], max_new_tokens=4, allowed_token_ids=[7], stop_token_ids=[7], min_tokens=3
            )
        alone = await manager.generate(PROMPTS[1], max_new_tokens=6)
        for params in ({}, {"temperature": 1.0, "seed": 2}):
            failed, mate = await asyncio.gather(
                manager.generate(PROMPTS[0], max_new_tokens=6, allowed_token_ids=[5], no_repeat_ngram_size=1, **params),
                manager.generate(PROMPTS[1], max_new_tokens=6),
            )
            assert failed.generated_tokens == [5], params
            assert failed.status is aiocb.RequestStatus.FAILED and failed.finish_reason is aiocb.FinishReason.ERROR
            assert failed.error is not None and "no token is left" in failed.error
            assert mate.generated_tokens == alone.generated_tokens
        stats = manager.statistics()
    assert stats.free_blocks == stats.total_blocks


async def test_unsupported_generation_config_fields_are_named() -> None:
    model = MODELS["qwen3"]()
    strict = aiocb.ContinuousBatchingConfig(drop_unsupported_processors=False)
    with pytest.raises(aiocb.InvalidRequestError, match=r"num_beams, .*encoder_no_repeat_ngram_size"):
        aiocb.Manager(model, GenerationConfig(num_beams=2, encoder_no_repeat_ngram_size=3), strict)
    with pytest.raises(aiocb.InvalidRequestError, match="stop_strings"):
        aiocb.Manager(model, GenerationConfig(stop_strings=["\n"]), strict)


async def test_generation_configs_rarer_filters_are_honoured() -> None:
    """top-h, typical-p, epsilon and eta cutoffs from a GenerationConfig apply to every
    request (a strict manager takes them): a filter that keeps only the most likely token
    gives ``generate``'s greedy tokens whatever the seed, and a request's own values in
    their place give the same tokens as the config's."""
    model = MODELS["qwen3"]()
    strict = aiocb.ContinuousBatchingConfig(drop_unsupported_processors=False)
    prompt = PROMPTS[0]
    reference = reference_generate(model, prompt, NEW)
    for narrow in ({"top_h": 1e-6}, {"epsilon_cutoff": 0.99}):
        config = GenerationConfig(do_sample=True, max_new_tokens=NEW, **narrow)  # type: ignore[arg-type]
        async with aiocb.Manager(model, config, strict) as manager:
            outputs = await asyncio.gather(*(manager.generate(prompt, seed=s) for s in range(3)))
            # A request's own "off" values turn the config's filter off.
            off = {"top_h": 0.0} if "top_h" in narrow else {"epsilon_cutoff": 0.0}
            free = await manager.generate(prompt, seed=0, **off)
        assert all(o.generated_tokens == reference for o in outputs), narrow
        assert free.generated_tokens != reference, narrow
    async with aiocb.Manager(model) as manager:
        # (a top-h below float32's smallest number is not rounded to 0, off)
        tiny = await manager.generate(prompt, max_new_tokens=NEW, temperature=1.0, top_h=1e-46, seed=1)
    assert tiny.generated_tokens == reference
    rare = {"typical_p": 0.7, "eta_cutoff": 0.003, "top_h": 0.9}
    config = GenerationConfig(do_sample=True, temperature=1.2, max_new_tokens=NEW, **rare)  # type: ignore[arg-type]
    async with aiocb.Manager(model, config, strict) as manager:
        from_config = await manager.generate(prompt, seed=4)
    async with aiocb.Manager(model) as manager:
        own = await manager.generate(prompt, max_new_tokens=NEW, temperature=1.2, seed=4, **rare)
        unfiltered = await manager.generate(prompt, max_new_tokens=NEW, temperature=1.2, seed=4)
    assert from_config.generated_tokens == own.generated_tokens
    assert own.generated_tokens != unfiltered.generated_tokens, "the filters changed nothing here"


async def test_generation_config_filter_values_transformers_ignores_or_refuses() -> None:
    """Values transformers builds no processor for (typical_p 1.5, an epsilon cutoff of 1)
    are off, as there; values its processors refuse (top_h 1.5, typical_p 0) are named,
    dropped with a warning or refused by a strict manager."""
    model = MODELS["qwen3"]()
    strict = aiocb.ContinuousBatchingConfig(drop_unsupported_processors=False)
    ignored = GenerationConfig(do_sample=True, max_new_tokens=NEW, typical_p=1.5, epsilon_cutoff=1.0, eta_cutoff=-1.0)
    async with aiocb.Manager(model, ignored, strict) as manager:
        output = await manager.generate(PROMPTS[0], seed=3)
    async with aiocb.Manager(model, GenerationConfig(do_sample=True, max_new_tokens=NEW)) as manager:
        plain = await manager.generate(PROMPTS[0], seed=3)
    assert output.generated_tokens == plain.generated_tokens
    for refused in ({"top_h": 1.5}, {"typical_p": 0.0}):
        name = next(iter(refused))
        with pytest.raises(aiocb.InvalidRequestError, match=rf"{name} \(.*which transformers refuses"):
            aiocb.Manager(model, GenerationConfig(do_sample=True, **refused), strict)  # type: ignore[arg-type]


def test_unsupported_generation_config_fields_are_dropped_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    model = MODELS["qwen3"]()
    with caplog.at_level("WARNING", logger="aiocb"):
        aiocb.Manager(model, GenerationConfig(encoder_no_repeat_ngram_size=3, do_sample=True))
    warnings = [r for r in caplog.records if "encoder_no_repeat_ngram_size" in r.getMessage()]
    assert len(warnings) == 1 and "dropped" in warnings[0].getMessage()


MIXED: list[dict[str, Any]] = [
    {"temperature": 1.0, "seed": 11, "repetition_penalty": 1.4},
    {"temperature": 0.8, "top_k": 40, "seed": 12, "presence_penalty": 1.0, "frequency_penalty": 0.5},
    {"temperature": 1.2, "top_p": 0.9, "min_p": 0.05, "seed": 13, "logit_bias": {7: 3.0, 9: -2.0}},
    {"temperature": 1.0, "seed": 14, "bad_words_ids": [[5], [8, 9]], "sequence_bias": {(3, 4): 2.0}},
    {"temperature": 1.0, "seed": 15, "allowed_token_ids": list(range(0, 512, 3)), "min_tokens": 4},
    {"temperature": 0.0, "repetition_penalty": 1.3},
    {"temperature": 1.0, "seed": 16},
    {"temperature": 0.9, "seed": 17, "typical_p": 0.6, "eta_cutoff": 0.002},
    {"temperature": 1.1, "seed": 18, "top_h": 0.7, "epsilon_cutoff": 0.001, "top_k": 30},
    {"temperature": 1.0, "seed": 19, "no_repeat_ngram_size": 1, "top_k": 0},
]


@pytest.mark.parametrize("schedule", ["plain", "async_batching"])
async def test_seeded_outputs_do_not_depend_on_the_batch(schedule: str) -> None:
    """Each request, alone, gives the same tokens as in a batch where every control is mixed."""
    model = MODELS["qwen3"]()
    config = aiocb.ContinuousBatchingConfig(**SCHEDULES[schedule])
    prompts = random_prompts(len(MIXED), 4, 40, seed=33)
    async with aiocb.Manager(model, GenerationConfig(), config) as manager:
        alone = [await manager.generate(p, max_new_tokens=NEW, **kw) for p, kw in zip(prompts, MIXED, strict=True)]
        together = await asyncio.gather(
            *(manager.generate(p, max_new_tokens=NEW, **kw) for p, kw in zip(prompts, MIXED, strict=True)),
            # and neighbours using no control
            *(manager.generate(p, max_new_tokens=NEW, temperature=1.0, seed=99) for p in prompts[:3]),
        )
    for i, (a, b) in enumerate(zip(alone, together, strict=False)):
        assert a.generated_tokens == b.generated_tokens, f"request {i}: {MIXED[i]}"
    assert set(alone[4].generated_tokens) <= set(range(0, 512, 3))
    assert "no_repeat_ngram_size" in MIXED[-1]
    sequence = prompts[-1] + alone[-1].generated_tokens
    for at in range(len(prompts[-1]), len(sequence)):
        assert sequence[at] not in sequence[:at], "no_repeat_ngram_size=1: a token came twice"


def _generate_plain(model: PreTrainedModel, prompt: list[int], **kwargs: Any) -> list[int]:
    """``model.generate`` greedy with only ``kwargs`` (no max_new_tokens of the tests' own)."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, pad_token_id=0, **kwargs)
    return [int(t) for t in out[0, len(prompt) :]]


@pytest.mark.filterwarnings("ignore:Using the model-agnostic default `max_length`")
async def test_lengths_default_as_in_generate(model: PreTrainedModel) -> None:
    """No length anywhere: 20 new tokens whatever the prompt's length (transformers counts
    none of the prompt); a GenerationConfig's ``max_length`` counts the prompt; its
    ``min_new_tokens`` wins over its ``min_length``."""
    eos = _eos_for(model, PROMPTS[0])
    configs = [
        GenerationConfig(),
        GenerationConfig(max_length=45),
        GenerationConfig(max_new_tokens=12, min_new_tokens=2, min_length=40, eos_token_id=eos),
        GenerationConfig(max_new_tokens=12, min_length=len(PROMPTS[0]) + 6, eos_token_id=eos),
    ]
    for config in configs:
        prompts = [p for p in PROMPTS if config.max_length is None or len(p) < config.max_length]
        expected = [_generate_plain(model, p, generation_config=config) for p in prompts]
        async with aiocb.Manager(model, generation_config=config) as manager:
            outputs = await asyncio.gather(*(manager.generate(p) for p in prompts))
            if config.max_length is not None:
                with pytest.raises(aiocb.InvalidRequestError, match="max_length"):
                    await manager.generate(list(range(1, config.max_length + 1)))
        assert [o.generated_tokens for o in outputs] == expected, config
    assert [len(e) for e in (_generate_plain(model, p) for p in PROMPTS)] == [20] * len(PROMPTS)


async def test_a_given_generation_config_keeps_the_models_own_fields(model: PreTrainedModel) -> None:
    """As ``generate(generation_config=...)``: fields the given config leaves unset (an
    instruct model's end-of-turn EOS here) come from ``model.generation_config``."""
    eos = _eos_for(model, PROMPTS[0])
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = eos
    try:
        config = GenerationConfig(max_new_tokens=12)
        expected = _generate_plain(model, PROMPTS[0], generation_config=config)
        async with aiocb.Manager(model, generation_config=config) as manager:
            output = await manager.generate(PROMPTS[0])
    finally:
        model.generation_config.eos_token_id = saved
    assert expected[-1] == eos and len(expected) < 12
    assert output.generated_tokens == expected
