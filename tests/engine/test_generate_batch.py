"""The blocking aiocb.generate_batch."""

from __future__ import annotations

import pytest
from transformers import PreTrainedModel

import aiocb
from tests.conftest import random_prompts, reference_generate

PROMPTS = random_prompts(5, 3, 40, seed=14)


def test_blocking_generate_batch_with_progress_bar(qwen3: PreTrainedModel, capsys: pytest.CaptureFixture[str]) -> None:
    outputs = aiocb.generate_batch(qwen3, PROMPTS, max_new_tokens=4, progress=True)
    assert list(outputs) == [f"req_{i}" for i in range(5)]
    assert [o.generated_tokens for o in outputs.values()] == [reference_generate(qwen3, p, 4) for p in PROMPTS]
    assert "5/5" in capsys.readouterr().err


def test_blocking_generate_batch_of_nothing(qwen3: PreTrainedModel) -> None:
    assert aiocb.generate_batch(qwen3, []) == {}


async def test_blocking_generate_batch_refuses_a_running_loop(qwen3: PreTrainedModel) -> None:
    with pytest.raises(RuntimeError, match=r"await manager\.generate_batch"):
        aiocb.generate_batch(qwen3, PROMPTS)


def test_sampling_parameters_apply_to_every_prompt(qwen3: PreTrainedModel) -> None:
    first = aiocb.generate_batch(qwen3, PROMPTS[:2], max_new_tokens=6, temperature=1.0, seed=5, return_logprobs=True)
    again = aiocb.generate_batch(qwen3, PROMPTS[:2], max_new_tokens=6, temperature=1.0, seed=5, return_logprobs=True)
    assert [o.generated_tokens for o in first.values()] == [o.generated_tokens for o in again.values()]
    assert all(o.logprobs is not None and len(o.logprobs) == 6 for o in first.values())
