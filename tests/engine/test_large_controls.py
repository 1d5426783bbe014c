"""Controls that list many token ids (a ``logit_bias``, ``allowed_token_ids`` or
``bad_words_ids`` over much of a vocabulary) are checked on a worker thread, a slice at a
time with pauses for the event loop, and decode exactly as the same controls given short."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from transformers import GenerationConfig, PreTrainedModel

import aiocb
from aiocb import gil
from aiocb.engine.requests import LARGE_CONTROLS, RequestFactory, has_large_controls
from aiocb.params import SLICE
from aiocb.sampling import RequestLimits
from tests.conftest import VOCAB, random_prompts, reference_generate

PROMPT = random_prompts(1, 12, 12, seed=5)[0]
NEW = 12
#: more ids than LARGE_CONTROLS, over several slices
MANY = 2 * SLICE + 5


@pytest.fixture
def checked_on(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each request's check ran on the event loop's thread (recorded in order)."""
    on_loop: list[bool] = []
    loop_thread = threading.get_ident()
    check = RequestFactory.check

    def recording(self: RequestFactory, *args: Any) -> Any:
        on_loop.append(threading.get_ident() == loop_thread)
        return check(self, *args)

    monkeypatch.setattr(RequestFactory, "check", recording)
    return on_loop


def _repeated(ids: list[Any]) -> list[Any]:
    return (ids * (MANY // len(ids) + 1))[:MANY]


async def test_large_controls_are_checked_off_the_loop_and_match_generate(
    qwen3: PreTrainedModel, checked_on: list[bool]
) -> None:
    assert MANY > LARGE_CONTROLS
    plain = reference_generate(qwen3, PROMPT, NEW)
    banned = [[plain[0]], [plain[2]], [plain[3], plain[4]]]
    eos = plain[5]
    allowed = sorted({*plain[:8], 7, 99, 300})
    cases: list[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]] = [
        # (the short form, its long form with repeats, generate's kwargs)
        ({"bad_words_ids": banned}, {"bad_words_ids": _repeated(banned)}, {"bad_words_ids": banned}),
        (
            {"min_tokens": 8, "eos_token_id": eos},
            {"min_tokens": 8, "eos_token_id": _repeated([eos])},
            {"min_new_tokens": 8, "eos_token_id": eos},
        ),
        ({"allowed_token_ids": allowed}, {"allowed_token_ids": _repeated(allowed)}, {}),
    ]
    async with aiocb.Manager(qwen3, GenerationConfig(do_sample=False)) as manager:
        for short, long, kwargs in cases:
            small = await manager.generate(PROMPT, max_new_tokens=NEW, **short)
            large = await manager.generate(PROMPT, max_new_tokens=NEW, **long)
            assert large.generated_tokens == small.generated_tokens, short
            if kwargs:
                assert small.generated_tokens == reference_generate(qwen3, PROMPT, NEW, **kwargs), short
            else:
                assert set(small.generated_tokens) <= set(allowed)
        assert checked_on == [True, False] * len(cases)


async def test_a_bad_id_in_large_controls_is_refused_by_name(qwen3: PreTrainedModel, checked_on: list[bool]) -> None:
    async with aiocb.Manager(qwen3, GenerationConfig(do_sample=False)) as manager:
        alone = await manager.generate(PROMPT, max_new_tokens=4)
        for name, value in (
            ("allowed_token_ids", [*_repeated([5, 6]), VOCAB]),
            ("stop_token_ids", [*_repeated([5]), VOCAB]),
            ("bad_words_ids", [*_repeated([[5]]), [VOCAB]]),
        ):
            with pytest.raises(aiocb.InvalidRequestError, match=rf"{name} {VOCAB} is outside the vocabulary") as e:
                await manager.generate(PROMPT, max_new_tokens=4, **{name: value})
            assert e.value.param == name
        assert (await manager.generate(PROMPT, max_new_tokens=4)).generated_tokens == alone.generated_tokens
        stats = manager.statistics()
        assert stats.free_blocks == stats.total_blocks
    assert checked_on == [True, False, False, False, True]


async def test_a_logit_bias_of_json_keys_is_large_sooner(qwen3: PreTrainedModel, checked_on: list[bool]) -> None:
    """A token id written as a JSON object key costs some three times an int's check: 1,500
    of them (a request body's ``logit_bias``) are checked on a worker thread, as ints are
    past 4,096."""
    keys = {str(i): 1.0 for i in range(1_500)}
    assert has_large_controls(None, {"logit_bias": keys}) and not has_large_controls(
        None, {"logit_bias": dict(enumerate(keys.values()))}
    )
    assert not has_large_controls(aiocb.SamplingParams(logit_bias={"3": 1.0}), {})
    async with aiocb.Manager(qwen3, GenerationConfig(do_sample=False)) as manager:
        with pytest.raises(aiocb.InvalidRequestError, match=r"logit_bias 1499 is outside the vocabulary"):
            await manager.generate(PROMPT, max_new_tokens=4, logit_bias=keys)
        stats = manager.statistics()
        assert stats.free_blocks == stats.total_blocks
    assert checked_on == [False]


async def test_an_eos_token_id_given_as_a_zero_dimensional_array_is_one_id(qwen3: PreTrainedModel) -> None:
    """Counting a request's control ids takes a 0-d tensor or NumPy array (which has no
    length) as the one id its check takes it for."""
    async with aiocb.Manager(qwen3, GenerationConfig(do_sample=False)) as manager:
        plain = await manager.generate(PROMPT, max_new_tokens=4, eos_token_id=3)
        for value in (torch.tensor(3), np.array(3)):
            assert (await manager.generate(PROMPT, max_new_tokens=4, eos_token_id=value)).generated_tokens == (
                plain.generated_tokens
            )


@pytest.mark.parametrize("params", [{}, {"seed": 5}])
def test_a_request_checked_off_the_loop_draws_from_the_managers_seeds_when_built(params: dict[str, Any]) -> None:
    """Checked on a worker thread, a request draws from the manager's seeds (``seed`` of
    the config) when it is built on the loop, as one checked there does: the draws follow
    the order requests are built in, whatever the thread's timing."""
    limits = RequestLimits(VOCAB, 4096, 100_000)
    made = []
    for off_the_loop in (False, True):
        factory = RequestFactory(GenerationConfig(), aiocb.ContinuousBatchingConfig(seed=3), None, frozenset([0]))
        state = factory._seeds.getstate()
        checked = factory.check([1, 2, 3], 4, None, params, limits, off_the_loop)
        assert (factory._seeds.getstate() == state) is off_the_loop
        request, _ = factory.build(checked, None, in_use=set())
        after, _ = factory.build(factory.check([1, 2, 3], 4, None, {}, limits), None, in_use=set())
        made.append((request.params.seed, after.params.seed))
    assert made[0] == made[1]
    assert made[0][0] == params.get("seed", made[0][0])


def test_long_controls_are_normalised_as_short_ones() -> None:
    ids = list(range(3 * SLICE))
    random.Random(0).shuffle(ids)
    biases = {token: (token % 7 if token % 2 else token / 1000) for token in ids}  # ints and floats
    assert aiocb.SamplingParams(logit_bias=biases).logit_bias == tuple(
        (token, float(bias)) for token, bias in sorted(biases.items())
    )
    in_order = {token: 1.5 for token in range(3 * SLICE)}
    assert aiocb.SamplingParams(logit_bias=in_order).logit_bias == tuple(in_order.items())
    with pytest.raises(aiocb.InvalidRequestError, match=r"logit_bias\[\d+\] must be a number"):
        aiocb.SamplingParams(logit_bias={**in_order, 3 * SLICE - 1: float("nan")})
    words = [[i % 500, (i + 1) % 500][: 1 + i % 2] for i in range(3 * SLICE)]
    assert aiocb.SamplingParams(bad_words_ids=words).bad_words_ids == tuple(map(tuple, words))
    with pytest.raises(aiocb.InvalidRequestError, match="bad_words_ids must hold token ids"):
        aiocb.SamplingParams(bad_words_ids=[*words, ["x"]])
    with pytest.raises(aiocb.InvalidRequestError, match=r"stop_token_ids holds a negative token id \(-4\)"):
        aiocb.SamplingParams(stop_token_ids=[*range(3 * SLICE), -4])


def test_updated_checks_the_fields_it_is_given() -> None:
    """A copy with a few fields changed checks those (and the rule between structure
    fields), and keeps the others as they were checked, not checked again."""
    from aiocb.params import _CHECKS, FIELD_NAMES

    assert set(_CHECKS) == FIELD_NAMES  # (a field without a check would go unchecked in a copy)
    given = aiocb.SamplingParams(logit_bias={i: 1.0 for i in range(SLICE)}, stop="x")
    copy = given.updated(temperature=1, max_new_tokens=3)
    assert copy.temperature == 1.0 and isinstance(copy.temperature, float) and copy.max_new_tokens == 3
    assert copy.logit_bias is given.logit_bias and copy.stop == ("x",)
    with pytest.raises(aiocb.InvalidRequestError, match="temperature must be in") as e:
        given.updated(temperature=-1.0)
    assert e.value.param == "temperature"
    with pytest.raises(aiocb.InvalidRequestError, match="at most one of"):
        aiocb.SamplingParams(regex="a+").updated(choice=["yes", "no"])


@pytest.mark.parametrize("inside", [False, True])
def test_pause_lets_the_gil_go_only_inside_pausing(monkeypatch: pytest.MonkeyPatch, inside: bool) -> None:
    yields: list[int] = []
    monkeypatch.setattr(gil, "yield_gil", lambda: yields.append(threading.get_ident()))
    monkeypatch.setattr(gil, "PAUSE_EVERY", 0.0)

    def work() -> None:
        for _ in range(3):
            gil.pause()

    run: Callable[[], None] = (lambda: gil.pausing_call(work)) if inside else work
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert len(yields) == (3 if inside else 0)
