"""Outputs are snapshots: a stream's outputs keep their tokens (a long generation's made when first read)."""

from __future__ import annotations

import copy
import dataclasses
import pickle

from transformers import PreTrainedModel

import aiocb
from aiocb.core.params import ResolvedParams
from aiocb.core.request import EAGER_TOKENS, Request
from tests.conftest import random_prompts, reference_generate

PROMPT = random_prompts(1, 5, 12, seed=7)[0]


class _CountingSlices(list[int]):
    """A token list that counts the slices taken of it."""

    slices = 0

    def __getitem__(self, index):  # type: ignore[no-untyped-def,override]
        if isinstance(index, slice):
            type(self).slices += 1
        return super().__getitem__(index)


async def test_streamed_outputs_read_late_hold_the_tokens_of_their_step(qwen3: PreTrainedModel) -> None:
    async with aiocb.Manager(qwen3) as manager:
        rid = await manager.add_request(PROMPT, max_new_tokens=12)
        chunks = [chunk async for chunk in manager.stream(rid)]
    # None of them was read while the request went on: each still holds only its own tokens.
    expected = reference_generate(qwen3, PROMPT, 12)
    lengths = [len(c.generated_tokens) for c in chunks]
    assert len(lengths) > 1 and lengths == sorted(set(lengths)) and lengths[-1] == 12
    for chunk in chunks:
        n = len(chunk.generated_tokens)
        assert chunk.generated_tokens == expected[:n]
        assert chunk.tokens_since(n - 1) == expected[n - 1 : n]


def test_a_long_output_copies_the_token_list_once_and_only_when_read() -> None:
    n = EAGER_TOKENS + 6  # generated tokens: past the length copied at once
    tokens = _CountingSlices(range(4 + n))
    request = Request("r", list(range(4)), ResolvedParams(max_new_tokens=2 * n), 0.0, token_ids=tokens)
    _CountingSlices.slices = 0
    output = request.to_output()
    assert _CountingSlices.slices == 0, "made before anyone read it"
    last = 4 + n - 1
    assert output.tokens_since(n - 2) == [last - 1, last] and output.tokens_since(-1) == [last]
    assert output.tokens_since(n) == []
    assert _CountingSlices.slices == 3  # (each a slice of the new tokens alone)
    tokens.append(last + 1)  # the request goes on: the output does not
    assert output.generated_tokens == list(range(4, last + 1))
    assert output.generated_tokens is output.generated_tokens  # made once
    assert _CountingSlices.slices == 4
    assert output.tokens_since(n - 2) == [last - 1, last] and output.tokens_since(-2) == [last - 1, last]


def test_a_short_output_holds_its_own_copy_at_once() -> None:
    tokens = _CountingSlices(range(4 + EAGER_TOKENS))
    request = Request("r", list(range(4)), ResolvedParams(max_new_tokens=2 * EAGER_TOKENS), 0.0, token_ids=tokens)
    _CountingSlices.slices = 0
    output = request.to_output()
    assert _CountingSlices.slices == 1
    tokens.append(4 + EAGER_TOKENS)
    assert output.generated_tokens == list(range(4, 4 + EAGER_TOKENS))
    assert output.tokens_since(-1) == [3 + EAGER_TOKENS] and _CountingSlices.slices == 1


def test_a_deferred_output_behaves_as_a_plain_one() -> None:
    generated = list(range(3, 3 + EAGER_TOKENS + 1))  # (long enough to be copied when read)
    request = Request("r", [1, 2], ResolvedParams(max_new_tokens=2 * EAGER_TOKENS), 0.0, token_ids=[1, 2, *generated])
    plain = dataclasses.replace(request.to_output(), generated_tokens=generated)
    for make in (
        request.to_output,
        lambda: copy.copy(request.to_output()),
        lambda: copy.deepcopy(request.to_output()),
        lambda: pickle.loads(pickle.dumps(request.to_output())),
        lambda: dataclasses.replace(request.to_output()),
    ):
        output = make()
        assert output == plain and repr(output) == repr(plain)
        assert dataclasses.asdict(output) == dataclasses.asdict(plain)
    assert "_tokens_from" not in dataclasses.asdict(request.to_output())
    fresh = aiocb.GenerationOutput("x", [1], [7, 8])
    assert fresh.generated_tokens == [7, 8] and fresh.tokens_since(1) == [8]


def test_an_output_carries_each_field_of_its_request() -> None:
    params = ResolvedParams(
        max_new_tokens=20, return_logprobs=True, top_logprobs=1, prompt_logprobs=True, record_timestamps=True
    )
    request = Request("r", [1, 2], params, 1.5, token_ids=[1, 2, 3], timestamps=[3.5])
    request.logprobs, request.top_logprobs = [-0.5], [{3: -0.5}]
    request.prompt_logprobs, request.prompt_top_logprobs = [None, -0.25], [None, {2: -0.25}]
    request.status, request.finish_reason = aiocb.RequestStatus.FINISHED, aiocb.FinishReason.STOP
    request.stop_reason, request.error, request.num_cached_tokens = 3, "none", 1
    request.scheduled_time, request.first_token_time, request.finished_time = 2.5, 3.5, 4.5
    assert dataclasses.asdict(request.to_output()) == {
        "request_id": "r",
        "prompt_ids": [1, 2],
        "generated_tokens": [3],
        "logprobs": [-0.5],
        "top_logprobs": [{3: -0.5}],
        "prompt_logprobs": [None, -0.25],
        "prompt_top_logprobs": [None, {2: -0.25}],
        "text": None,
        "text_delta": None,
        "status": aiocb.RequestStatus.FINISHED,
        "finish_reason": aiocb.FinishReason.STOP,
        "stop_reason": 3,
        "error": "none",
        "num_cached_tokens": 1,
        "created_time": 1.5,
        "scheduled_time": 2.5,
        "first_token_time": 3.5,
        "finished_time": 4.5,
        "timestamps": [3.5],
    }
