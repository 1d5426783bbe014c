"""Bad input is refused with InvalidRequestError naming the problem, and harms nobody."""

from __future__ import annotations

import asyncio
import collections
import copy
from typing import Any

import pytest
import torch
from transformers import GenerationConfig, PreTrainedModel

import aiocb
from tests.conftest import VOCAB, random_prompts, reference_generate

GOOD = random_prompts(1, 30, 30, seed=13)[0]

BAD_REQUESTS: list[tuple[str, Any, dict[str, Any], str]] = [
    ("empty prompt", [], {}, "empty"),
    ("negative id", [1, -2, 3], {}, r"input_ids\[1\] = -2 is outside the vocabulary"),
    (
        "id beyond vocab in a tuple",
        (1, 2, VOCAB + 5, 3),
        {},
        rf"input_ids\[2\] = {VOCAB + 5} is outside the vocabulary",
    ),
    ("a long prompt's last id beyond vocab", [1] * 50_000 + [VOCAB], {}, rf"input_ids\[50000\] = {VOCAB} is outside"),
    ("id beyond vocab", [1, VOCAB], {}, "outside the vocabulary"),
    # (past LONG_ID_PROMPT ids: checked on a worker thread, a slice at a time)
    ("a long prompt's float id", [1] * 30_000 + [2.0], {}, r"input_ids\[30000\] is 2.0 \(float\)"),
    ("a long tensor's id beyond vocab", torch.tensor([1] * 20_000 + [VOCAB]), {}, rf"input_ids\[20000\] = {VOCAB} "),
    ("a long 2-d tensor", torch.ones(20_000, 2, dtype=torch.long), {}, "one-dimensional"),
    ("a long set", set(range(1, 20_001)), {}, "must be a list of token ids, got set"),
    ("float id", [1, 2.0, 3], {}, r"input_ids\[1\].*must be ints"),
    ("bool id", [1, 2, True], {}, r"input_ids\[2\] is True \(bool\)"),
    ("id beyond vocab, late in a long prompt", [1] * 500 + [VOCAB + 7], {}, r"input_ids\[500\] = \d+ is outside"),
    ("string prompt", "hello", {}, "needs a tokenizer"),
    ("chat prompt", [{"role": "user", "content": "hi"}], {}, "needs a tokenizer"),
    ("dict prompt", {"a": 1}, {}, "list of token ids"),
    ("2-d tensor", torch.ones(2, 3, dtype=torch.long), {}, "one-dimensional"),
    ("meta tensor", torch.empty(3, dtype=torch.long, device="meta"), {}, "cannot be read as token ids"),
    ("beyond context", [1] * 2000, {"max_new_tokens": 100}, "context length"),
    ("max_new_tokens zero", [1, 2], {"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
    ("max_new_tokens float", [1, 2], {"max_new_tokens": 2.5}, "max_new_tokens must be an int"),
    ("negative temperature", [1, 2], {"temperature": -0.1}, "temperature"),
    ("tiny temperature", [1, 2], {"temperature": 1e-9}, r"temperature must be 0 \(greedy\) or at least 1e-06"),
    ("top_p zero", [1, 2], {"top_p": 0.0}, "top_p"),
    ("top_p above one", [1, 2], {"top_p": 1.5}, "top_p"),
    ("negative top_k", [1, 2], {"top_k": -1}, "top_k must be >= 0"),
    ("unknown parameter", [1, 2], {"temprature": 0.5}, "unknown request parameter.*temprature"),
    ("bad stop token", [1, 2], {"stop_token_ids": [VOCAB + 1]}, "stop_token_ids"),
    ("bad timeout", [1, 2], {"timeout": -1}, "timeout"),
    ("bad seed", [1, 2], {"seed": "x"}, "seed must be an int"),
    ("stop without tokenizer", [1, 2], {"stop": "\n"}, "stop strings need a tokenizer"),
    ("bad_words without tokenizer", [1, 2], {"bad_words": ["hello"]}, "bad_words need a tokenizer"),
    (
        "skip_special_tokens without tokenizer",
        [1, 2],
        {"skip_special_tokens": False},
        "skip_special_tokens shapes text, which needs a tokenizer",
    ),
    (
        "include_stop_str_in_output without tokenizer",
        [1, 2],
        {"include_stop_str_in_output": True},
        "include_stop_str_in_output shapes text",
    ),
    ("logprobs_mode without logprobs", [1, 2], {"logprobs_mode": "processed"}, "logprobs_mode='processed' says"),
    (
        "logprobs_mode with prompt logprobs alone",
        [1, 2],
        {"logprobs_mode": "raw", "prompt_logprobs": True},
        "does not ask for",
    ),
    ("blank bad word", [1, 2], {"bad_words": ["  "]}, "bad_words holds '  ', which holds no word"),
    ("empty stop string", [1, 2], {"stop": [""]}, "empty string"),
    ("presence penalty too big", [1, 2], {"presence_penalty": 3.0}, r"presence_penalty must be in \[-2.0, 2.0\]"),
    ("frequency penalty nan", [1, 2], {"frequency_penalty": float("nan")}, "frequency_penalty must be a finite"),
    ("repetition penalty zero", [1, 2], {"repetition_penalty": 0.0}, "repetition_penalty must be in"),
    ("min_p above one", [1, 2], {"min_p": 1.5}, "min_p"),
    ("typical_p zero", [1, 2], {"typical_p": 0.0}, r"typical_p must be in \(0.0, 1.0\]"),
    ("epsilon_cutoff one", [1, 2], {"epsilon_cutoff": 1.0}, r"epsilon_cutoff must be in \[0.0, 1.0\)"),
    ("negative eta_cutoff", [1, 2], {"eta_cutoff": -0.1}, "eta_cutoff must be in"),
    ("top_h above one", [1, 2], {"top_h": 1.5}, "top_h must be in"),
    ("negative min_tokens", [1, 2], {"min_tokens": -1}, "min_tokens must be >= 0"),
    ("logit_bias out of range", [1, 2], {"logit_bias": {3: 101}}, r"logit_bias\[3\]"),
    ("logit_bias beyond vocab", [1, 2], {"logit_bias": {VOCAB: 1.0}}, "logit_bias.*outside the vocabulary"),
    ("flat bad_words_ids", [1, 2], {"bad_words_ids": [3, 4]}, "list of lists"),
    ("bad word beyond vocab", [1, 2], {"bad_words_ids": [[VOCAB]]}, "bad_words_ids.*outside the vocabulary"),
    (
        "last of many bad words beyond vocab",
        [1, 2],
        {"bad_words_ids": [[1, 2]] * 5000 + [[3, VOCAB]]},
        f"bad_words_ids {VOCAB} is outside the vocabulary",
    ),
    (
        "sequence bias beyond vocab",
        [1, 2],
        {"sequence_bias": {(1, 2): 1.0, (3, VOCAB): -1.0}},
        f"sequence_bias {VOCAB} is outside the vocabulary",
    ),
    ("empty allowed_token_ids", [1, 2], {"allowed_token_ids": []}, "allowed_token_ids is empty"),
    ("truncate to nothing", [1, 2], {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be at least 1"),
    ("truncate below -1", [1, 2], {"truncate_prompt_tokens": -2}, "truncate_prompt_tokens must be >= -1"),
    ("negative no_repeat_ngram_size", [1, 2], {"no_repeat_ngram_size": -1}, "no_repeat_ngram_size must be >= 0"),
    (
        "sampling_params not a SamplingParams",
        [1, 2],
        {"sampling_params": {"temperature": 1.0}},
        "sampling_params must be",
    ),
]


@pytest.mark.parametrize(("name", "prompt", "params", "message"), BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
async def test_bad_request_is_refused_and_harms_nobody(
    qwen3: PreTrainedModel, name: str, prompt: Any, params: dict[str, Any], message: str
) -> None:
    async with aiocb.Manager(qwen3) as manager:
        healthy = asyncio.create_task(manager.generate(GOOD, max_new_tokens=10))
        await asyncio.sleep(0)
        with pytest.raises(aiocb.InvalidRequestError, match=message) as caught:
            await manager.add_request(prompt, **params)
        assert caught.value.param, "the refusal names no parameter (the server could not name the body's field)"
        with pytest.raises(ValueError, match=message):
            await manager.generate(prompt, **params)
        with pytest.raises(aiocb.InvalidRequestError, match=message):
            manager.add_request_nowait(prompt, **params)
        output = await healthy
        assert output.generated_tokens == reference_generate(qwen3, GOOD, 10)
        stats = manager.statistics()
        assert stats.free_blocks == stats.total_blocks


async def test_parameters_repeated_request_after_request_are_each_honoured_and_checked(
    qwen3: PreTrainedModel,
) -> None:
    # (the manager keeps its last merge of SamplingParams and max_new_tokens: it must never
    # hand one request's parameters to another, nor let a value it refuses through)
    async with aiocb.Manager(qwen3) as manager:
        logprobs = aiocb.SamplingParams(return_logprobs=True)
        firsts = [await manager.add_request(GOOD, max_new_tokens=n) for n in (3, 3, 5)]
        with_logprobs = await manager.add_request(GOOD, sampling_params=logprobs, max_new_tokens=5)
        again = await manager.add_request(GOOD, max_new_tokens=1)
        with pytest.raises(aiocb.InvalidRequestError, match="max_new_tokens must be an int"):
            await manager.add_request(GOOD, max_new_tokens=True)
        outputs = [await manager.get_result(r) for r in (*firsts, with_logprobs, again)]
    assert [len(o.generated_tokens) for o in outputs] == [3, 3, 5, 5, 1]
    assert [o.logprobs is not None for o in outputs] == [False, False, False, True, False]
    assert outputs[2].generated_tokens == outputs[3].generated_tokens == reference_generate(qwen3, GOOD, 5)


async def test_a_prompt_that_cannot_fit_the_cache_is_refused(qwen3: PreTrainedModel) -> None:
    config = aiocb.ContinuousBatchingConfig(page_size=16, num_blocks=4)  # 64 tokens in all
    async with aiocb.Manager(qwen3, continuous_batching_config=config) as manager:
        with pytest.raises(aiocb.InvalidRequestError, match="cannot fit the whole KV cache"):
            await manager.add_request([1] * 65, max_new_tokens=1)
        with pytest.raises(aiocb.InvalidRequestError, match="cannot fit the whole KV cache"):
            await manager.add_request([1] * 40, max_new_tokens=30)
        output = await manager.generate([1] * 40, max_new_tokens=24)
        assert len(output.generated_tokens) == 24


@pytest.mark.parametrize("speculative", [None, "ngram", "draft"])
async def test_a_request_whose_last_token_is_past_the_cache_fits(
    qwen3: PreTrainedModel, speculative: str | None
) -> None:
    """The last token is sampled, never attended to: a request needs a slot for each of its
    tokens but that one (a prompt of the cache's size takes one token), with every sample of
    it, steps planned ahead and proposals (prompt lookup's, a draft model's)."""
    config = aiocb.ContinuousBatchingConfig(page_size=16, num_blocks=4, use_async_batching=True)
    spec = None
    if speculative is not None:
        how: dict[str, Any] = {"prompt_lookup_min": 1}
        if speculative == "draft":
            how = {"method": "draft", "draft_model": copy.deepcopy(qwen3)}
        spec = aiocb.SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=None, **how)
    prompts = [random_prompts(1, 64, 64, seed=3)[0], [5, 6, 7, 8] * 10]
    async with aiocb.Manager(qwen3, continuous_batching_config=config, speculative_config=spec) as manager:
        with pytest.raises(aiocb.InvalidRequestError, match=r"\(65 tokens\) cannot fit the whole KV cache"):
            await manager.add_request(prompts[1], max_new_tokens=26)
        for prompt, new in zip(prompts, (1, 25), strict=True):
            output = await manager.generate(prompt, max_new_tokens=new, ignore_eos=True)
            assert output.generated_tokens == reference_generate(qwen3, prompt, new)
            first, second = await manager.generate(prompt, max_new_tokens=new, ignore_eos=True, n=2)
            assert first.generated_tokens == second.generated_tokens == output.generated_tokens
        assert manager.statistics().free_blocks == 4


async def test_max_model_len_bounds_every_request_below_the_model_s_context(qwen3: PreTrainedModel) -> None:
    config = aiocb.ContinuousBatchingConfig(page_size=16, max_model_len=48)
    prompt = random_prompts(1, 40, 40)[0]
    async with aiocb.Manager(qwen3, continuous_batching_config=config) as manager:
        assert manager.max_model_len == 48 < (qwen3.config.max_position_embeddings or 0)
        with pytest.raises(aiocb.InvalidRequestError, match="is 49 tokens, beyond the model's context length of 48"):
            await manager.add_request(prompt, max_new_tokens=9)
        with pytest.raises(aiocb.InvalidRequestError, match=r"truncate_prompt_tokens \(49\) is more than"):
            await manager.add_request(prompt, max_new_tokens=1, truncate_prompt_tokens=49)
        output = await manager.generate(prompt, max_new_tokens=8, ignore_eos=True)
        assert output.generated_tokens == reference_generate(qwen3, prompt, 8)
        assert manager.continuous_batching_config.max_model_len == 48
        # (the decode graphs' block tables hold the longest request: 3 pages of 16, and one)
        assert manager.continuous_batching_config.max_blocks_per_request == 4
    # A GenerationConfig's max_length past the bound: a request's default length stops at it.
    longer = GenerationConfig(max_length=100, eos_token_id=None)
    async with aiocb.Manager(qwen3, longer, continuous_batching_config=config) as manager:
        output = await manager.generate(prompt)
        assert output.generated_tokens == reference_generate(qwen3, prompt, 8)
    # ... and so does its max_new_tokens (a request's own is refused past it, as above)
    more = GenerationConfig(max_new_tokens=100, eos_token_id=None)
    async with aiocb.Manager(qwen3, more, continuous_batching_config=config) as manager:
        output = await manager.generate(prompt)
        assert output.generated_tokens == reference_generate(qwen3, prompt, 8)
        with pytest.raises(aiocb.InvalidRequestError, match="is 140 tokens, beyond the model's context length"):
            await manager.add_request(prompt, max_new_tokens=100)
    with pytest.raises(aiocb.InvalidConfigError, match=r"max_model_len=99999 is more than the model's context length"):
        aiocb.Manager(qwen3, continuous_batching_config=aiocb.ContinuousBatchingConfig(max_model_len=99999))
    with pytest.raises(aiocb.InvalidConfigError, match="max_model_len"):
        aiocb.ContinuousBatchingConfig(max_model_len=0)


async def test_duplicate_live_request_id_is_refused(qwen3: PreTrainedModel) -> None:
    async with aiocb.Manager(qwen3) as manager:
        await manager.add_request(GOOD, request_id="mine", max_new_tokens=50)
        with pytest.raises(aiocb.InvalidRequestError, match="already in use") as in_use:
            await manager.add_request(GOOD, request_id="mine")
        with pytest.raises(aiocb.InvalidRequestError, match="request_id") as empty:
            await manager.add_request(GOOD, request_id="")
        assert in_use.value.param == empty.value.param == "request_id"
        first = await manager.get_result("mine")
        assert first is not None and len(first.generated_tokens) == 50
        # Once delivered, the id is free again.
        await manager.add_request(GOOD, request_id="mine", max_new_tokens=1)


async def test_one_bad_prompt_in_a_batch_queues_none_of_it(qwen3: PreTrainedModel) -> None:
    async with aiocb.Manager(qwen3) as manager:
        with pytest.raises(aiocb.InvalidRequestError, match=r"^inputs\[1\]: .*empty"):
            await manager.add_requests([GOOD, []])
        # (which of a thousand prompts it was, and where in it)
        with pytest.raises(
            aiocb.InvalidRequestError, match=rf"^inputs\[500\]: input_ids\[2\] = {VOCAB} is outside"
        ) as caught:
            await manager.generate_batch([GOOD] * 500 + [[1, 2, VOCAB]] + [GOOD] * 499)
        assert caught.value.param == "input_ids"
        assert manager.statistics().waiting_requests == 0
        assert await manager.get_result(timeout=0.05) is None


def test_invalid_config_fails_at_construction() -> None:
    with pytest.raises(aiocb.InvalidRequestError, match=r"unknown ContinuousBatchingConfig field.*page_sise"):
        aiocb.ContinuousBatchingConfig(page_sise=16)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="page_size"):
        aiocb.ContinuousBatchingConfig(page_size=2)


async def test_the_request_keeps_its_own_copy_of_the_prompt(qwen3: PreTrainedModel) -> None:
    prompt = list(GOOD)
    async with aiocb.Manager(qwen3) as manager:
        request_id = await manager.add_request(prompt, max_new_tokens=3)
        prompt[:] = [0] * len(prompt)  # the caller reuses its list
        output = await manager.get_result(request_id, timeout=30)
    assert output is not None
    assert output.prompt_ids == GOOD
    assert output.generated_tokens == reference_generate(qwen3, GOOD, 3)


async def test_numpy_and_tensor_integers_are_token_ids(qwen3: PreTrainedModel) -> None:
    """``list(array)`` makes NumPy integers, iterating a tensor one-element tensors: taken
    as the ints they hold (they were refused as prompts and token-id lists), bools not."""
    import numpy as np

    prompt = random_prompts(1, 12, 12, seed=4)[0]
    expected = reference_generate(qwen3, prompt, 6)
    eos = expected[2]
    async with aiocb.Manager(qwen3) as manager:
        for given in (list(np.array(prompt)), list(torch.tensor(prompt)), tuple(np.array(prompt, dtype=np.int32))):
            output = await manager.generate(given, max_new_tokens=6, stop_token_ids=list(np.array([eos])))
            assert output.generated_tokens == expected[:3] and output.stop_reason == eos
        for bools in ([np.bool_(True)], [torch.tensor(True)]):
            with pytest.raises(aiocb.InvalidRequestError, match="input_ids\\[0\\]"):
                await manager.generate(bools, max_new_tokens=2)


async def test_a_long_prompt_of_token_ids_is_checked_off_the_loop(
    qwen3: PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt of more than ``LONG_ID_PROMPT`` token ids (a list, a tuple, a tensor) is
    checked on a worker thread, a slice at a time (100,000 ids in one go held the event
    loop 6-7 ms), and is the prompt it was: cut by ``truncate_prompt_tokens``, it gives
    what its last tokens give, through ``generate`` and ``generate_batch``."""
    import threading

    from aiocb.engine import requests
    from aiocb.sampling import LONG_ID_PROMPT

    threads: list[str] = []
    kept: list[int] = []
    checked = requests.checked_long_prompt

    def recorded(*args: Any) -> Any:
        threads.append(threading.current_thread().name)
        result = checked(*args)
        kept.append(len(result.ids))  # (cut there too: the ids not kept are freed off the loop)
        return result

    monkeypatch.setattr(requests, "checked_long_prompt", recorded)
    prompt = [(i * 7) % (VOCAB - 1) + 1 for i in range(LONG_ID_PROMPT + 5_000)]
    expected = reference_generate(qwen3, prompt[-8:], 5)
    async with aiocb.Manager(qwen3) as manager:
        for given in (prompt, tuple(prompt), torch.tensor(prompt), collections.deque(prompt)):
            output = await manager.generate(given, max_new_tokens=5, truncate_prompt_tokens=8)
            assert output.prompt_ids == prompt[-8:] and output.generated_tokens == expected
        batch = await manager.generate_batch([prompt], max_new_tokens=5, truncate_prompt_tokens=8)
        assert [o.generated_tokens for o in batch.values()] == [expected]
    # (a deque, which cannot be sliced, is checked on the loop as it always was)
    assert len(threads) == 4 and threading.current_thread().name not in threads and kept == [8] * 4


# ---------------------------------------------------------------- lists of prompts, and the call's other arguments


@pytest.fixture(scope="module")
def bundled() -> tuple[Any, Any]:
    from aiocb.default_model import load_default_model

    return load_default_model()


ONE_PROMPT = [
    ("hello", "inputs is a text, one prompt"),
    ([{"role": "user", "content": "hi"}], "inputs is a chat conversation, one prompt"),
    (GOOD, "inputs are token ids, one prompt"),
    (torch.tensor(GOOD), "inputs are token ids, one prompt"),
    (None, "inputs is None"),
    (7, "inputs must be a list of prompts, got int"),
]


@pytest.mark.parametrize(("inputs", "message"), ONE_PROMPT)
async def test_one_prompt_given_for_a_list_of_them_is_refused(
    bundled: tuple[Any, Any], inputs: Any, message: str
) -> None:
    """Taken for a list, a text was one request per character."""
    model, tokenizer = bundled
    async with aiocb.Manager(model, tokenizer=tokenizer) as manager:
        for call in (manager.generate_batch(inputs), manager.add_requests(inputs)):
            with pytest.raises(aiocb.InvalidRequestError, match=message) as caught:
                await call
            assert caught.value.param == "inputs"
        stats = manager.statistics()
        assert stats.waiting_requests == stats.running_requests == 0
        rows = await manager.generate_batch(torch.tensor([GOOD, GOOD]), max_new_tokens=2)  # (a tensor's rows)
    assert len(rows) == 2


@pytest.mark.parametrize(("inputs", "message"), ONE_PROMPT)
def test_one_prompt_given_to_the_blocking_call_is_refused(bundled: tuple[Any, Any], inputs: Any, message: str) -> None:
    model, tokenizer = bundled
    with pytest.raises(aiocb.InvalidRequestError, match=message):
        aiocb.generate_batch(model, inputs, tokenizer=tokenizer)


def test_the_blocking_call_checks_what_it_is_given_with_no_prompts_too(qwen3: PreTrainedModel) -> None:
    with pytest.raises(aiocb.InvalidRequestError, match="unknown"):
        aiocb.generate_batch(qwen3, [], bogus=1)
    with pytest.raises(aiocb.InvalidRequestError, match="temperature"):
        aiocb.generate_batch(qwen3, [], temperature="hot")
    with pytest.raises(aiocb.InvalidConfigError, match="continuous_batching_config must be"):
        aiocb.generate_batch(qwen3, [], continuous_batching_config="x")  # type: ignore[arg-type]
    for inputs in ([], [GOOD]):
        with pytest.raises(aiocb.InvalidRequestError, match=r"sampling_params must be an aiocb\.SamplingParams"):
            aiocb.generate_batch(qwen3, inputs, sampling_params={"temperature": 0.5})  # type: ignore[arg-type]
        with pytest.raises(aiocb.InvalidConfigError, match="generation_config must be a transformers"):
            aiocb.generate_batch(qwen3, inputs, {"max_new_tokens": 3})  # type: ignore[arg-type]
        with pytest.raises(aiocb.InvalidRequestError, match="record_timestamps"):
            aiocb.generate_batch(qwen3, inputs, record_timestamps="no")  # type: ignore[arg-type]
    assert aiocb.generate_batch(qwen3, []) == {}


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"generation_config": {"max_new_tokens": 3}}, "generation_config must be a transformers GenerationConfig"),
        ({"generation_config": aiocb.ContinuousBatchingConfig()}, "a ContinuousBatchingConfig goes third"),
        ({"tokenizer": "some/path"}, "tokenizer must be a tokenizer"),
        ({"grammar_tokenizer": 5}, "grammar_tokenizer must be a tokenizer"),
        ({"num_requests_hint": "5"}, "num_requests_hint must be an int of at least 1"),
        ({"num_requests_hint": -5}, "num_requests_hint must be an int of at least 1"),
        ({"speculative_config": {"method": "ngram"}}, "speculative_config must be an aiocb.SpeculativeConfig"),
    ],
)
def test_a_manager_s_arguments_of_the_wrong_kind_are_refused_when_it_is_made(
    qwen3: PreTrainedModel, arguments: dict[str, Any], message: str
) -> None:
    with pytest.raises(aiocb.InvalidConfigError, match=message):
        aiocb.Manager(qwen3, **arguments)


async def test_a_sampling_filter_asks_for_sampling(qwen3: PreTrainedModel) -> None:
    """As ``temperature``, ``top_k`` and ``top_p`` do: on a greedy request it went unused."""
    async with aiocb.Manager(qwen3) as manager:
        for name, value in (("typical_p", 0.05), ("min_p", 0.9), ("epsilon_cutoff", 0.5), ("top_h", 0.05)):
            given = await manager.generate(GOOD, max_new_tokens=6, seed=3, **{name: value})
            sampled = await manager.generate(GOOD, max_new_tokens=6, seed=3, do_sample=True, **{name: value})
            assert given.generated_tokens == sampled.generated_tokens, name
        # (a filter that keeps few tokens at temperature 1 draws otherwise than the argmax somewhere)
        kept = await manager.generate(GOOD, max_new_tokens=24, seed=3, epsilon_cutoff=1e-4)
    assert kept.generated_tokens != reference_generate(qwen3, GOOD, 24)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"sequence_bias": {(5,): float("inf")}}, "sequence_bias of \\[5\\] must be at most float32's largest"),
        ({"sequence_bias": {(5, 6): 1e300}}, "sequence_bias of \\[5, 6\\] must be at most"),
        ({"repetition_penalty": 1e-300}, "repetition_penalty must be in \\[1e-30, 1e\\+30\\]"),
        ({"repetition_penalty": 1e300}, "repetition_penalty must be in"),
        ({"bad_words_ids": [[5, 6], []]}, "bad_words_ids is empty: one of its sequences holds no token"),
        ({"sequence_bias": {(): 1.0}}, "sequence_bias is empty: one of its sequences holds no token"),
        ({"top_logprobs": 2, "return_logprobs": False}, "top_logprobs=2 asks for log-probabilities"),
    ],
)
async def test_values_that_would_make_nans_or_mislead_are_refused(
    qwen3: PreTrainedModel, params: dict[str, Any], message: str
) -> None:
    async with aiocb.Manager(qwen3) as manager:
        with pytest.raises(aiocb.InvalidRequestError, match=message):
            await manager.generate(GOOD, max_new_tokens=2, **params)
        banned = await manager.generate(GOOD, max_new_tokens=4, sequence_bias={(5,): float("-inf")})
        assert 5 not in banned.generated_tokens  # (-inf still bans)
        with pytest.raises(aiocb.InvalidRequestError, match="timeout must be a number of seconds"):
            await manager.get_result("nobody", timeout="1")  # type: ignore[arg-type]


async def test_a_generation_config_asking_for_more_than_tokens_is_told_what_outputs_carry(
    qwen3: PreTrainedModel, caplog: pytest.LogCaptureFixture
) -> None:
    from transformers import GenerationConfig

    config = GenerationConfig(output_scores=True, return_dict_in_generate=True, max_new_tokens=3)
    with caplog.at_level("WARNING", logger="aiocb"):
        async with aiocb.Manager(qwen3, config) as manager:
            await manager.generate(GOOD)
    assert "output_scores, return_dict_in_generate" in caplog.text and "return_logprobs" in caplog.text
    strict = aiocb.ContinuousBatchingConfig(drop_unsupported_processors=False)
    with pytest.raises(aiocb.InvalidRequestError, match="output_scores"):
        aiocb.Manager(qwen3, config, strict)


async def test_filters_a_greedy_request_gives_are_warned_of_once(
    qwen3: PreTrainedModel, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy decoding takes the most likely token: a request's top_p or typical_p went
    unused without a word (transformers' generate warns); the output is generate's."""
    from aiocb import sampling

    monkeypatch.setattr(sampling, "_WARNED_FILTERS", set())
    plain = reference_generate(qwen3, GOOD, 4)
    with caplog.at_level("WARNING", logger="aiocb"):
        async with aiocb.Manager(qwen3) as manager:
            for _ in range(2):
                got = await manager.generate(GOOD, max_new_tokens=4, do_sample=False, temperature=0.3, typical_p=0.5)
                assert got.generated_tokens == plain
            await manager.generate(GOOD, max_new_tokens=4, temperature=0.0, top_p=0.2)
            await manager.generate(GOOD, max_new_tokens=4, temperature=0.0, top_p=1.0, top_k=50)  # (filters nothing)
            await manager.generate(GOOD, max_new_tokens=4, do_sample=False, temperature=0.0)  # (a server's greedy)
    warnings = [r.getMessage() for r in caplog.records if "greedy decoding" in r.getMessage()]
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith(
        "do_sample=False is greedy decoding, which does not use temperature=0.3, typical_p=0.5"
    )
    assert warnings[1].startswith("temperature=0 is greedy decoding, which does not use top_p=0.2")
