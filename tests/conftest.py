"""Shared fixtures: tiny seeded models and `model.generate` references."""

from __future__ import annotations

import asyncio
import itertools
import os

if not os.environ.get("AIOCB_GPU_TESTS"):
    os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run on CPU tensors in CI

import random
import time
import weakref
from collections.abc import Callable, Sequence

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, Qwen3Config, Qwen3ForCausalLM

VOCAB = 512
MAX_NEW_TOKENS = 24
_TINY: dict[str, object] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "initializer_range": 0.3,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": 0,
}


def tiny_qwen3(seed: int = 0, **overrides: object) -> PreTrainedModel:
    """A 2-layer Qwen3 with seeded random weights (fp32, CPU, no EOS)."""
    torch.manual_seed(seed)
    config = Qwen3Config(**{**_TINY, "head_dim": 16, **overrides})
    return Qwen3ForCausalLM(config).eval()


def tiny_llama(seed: int = 0, **overrides: object) -> PreTrainedModel:
    """A 2-layer Llama with seeded random weights (fp32, CPU, no EOS)."""
    torch.manual_seed(seed)
    config = LlamaConfig(**{**_TINY, **overrides})
    return LlamaForCausalLM(config).eval()


def random_prompts(count: int, min_len: int, max_len: int, seed: int = 0, vocab: int = VOCAB) -> list[list[int]]:
    """Seeded prompts of uniformly drawn lengths; the first is min_len long, the second max_len."""
    rng = random.Random(seed)
    lengths = [min_len, max_len] + [rng.randint(min_len, max_len) for _ in range(count - 2)]
    return [[rng.randrange(1, vocab) for _ in range(n)] for n in lengths[:count]]


_REFERENCES: weakref.WeakKeyDictionary[PreTrainedModel, dict[tuple[object, ...], list[int]]] = (
    weakref.WeakKeyDictionary()
)


def reference_generate(
    model: PreTrainedModel, prompt: Sequence[int], max_new_tokens: int, **kwargs: object
) -> list[int]:
    """Greedy tokens `model.generate` gives for one prompt alone (cached per model)."""
    key = (tuple(prompt), max_new_tokens, tuple(sorted((k, repr(v)) for k, v in kwargs.items())))
    cache = _REFERENCES.setdefault(model, {})
    if key not in cache:
        cache[key] = _generate_alone(model, prompt, max_new_tokens, **kwargs)
    return list(cache[key])


def _generate_alone(model: PreTrainedModel, prompt: Sequence[int], max_new_tokens: int, **kwargs: object) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([list(prompt)]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            **kwargs,
        )
    return [int(t) for t in out[0, len(prompt) :]]


def arm_failure(model: PreTrainedModel, error: type[BaseException] = RuntimeError) -> dict[str, bool]:
    """Make the model's first layer raise ``error`` once ``switch["fail"]`` is set."""
    switch = {"fail": False}

    def hook(module: torch.nn.Module, args: object) -> None:
        if switch["fail"]:
            raise error("injected failure")

    model.model.layers[0].register_forward_pre_hook(hook)
    return switch


ModelFactory = Callable[..., PreTrainedModel]
MODELS: dict[str, ModelFactory] = {"llama": tiny_llama, "qwen3": tiny_qwen3}


@pytest.fixture(scope="session")
def qwen3() -> PreTrainedModel:
    return tiny_qwen3()


@pytest.fixture(scope="session")
def llama() -> PreTrainedModel:
    return tiny_llama()


def gil_turn() -> None:
    """Let the step thread have the GIL: a coroutine that never sleeps keeps the loop thread
    running Python, and the step thread's forward pass would get the GIL only once per
    switch interval (5 ms) between its operations."""
    time.sleep(0)


class LoopTurns:
    """While open, a coroutine that counts the loop iterations it gets (:attr:`turns`)."""

    def __init__(self) -> None:
        self.turns = 0
        self._open = False
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> LoopTurns:
        self._open = True
        self._task = asyncio.create_task(self._count())
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._open = False
        assert self._task is not None
        await self._task

    async def _count(self) -> None:
        while self._open:
            await asyncio.sleep(0)
            self.turns += 1
            gil_turn()

    def gave_back(self, marks: list[int]) -> int:
        """How many times the count moved between consecutive ``marks`` (turns read at each)."""
        return sum(1 for a, b in itertools.pairwise(marks) if b > a)
