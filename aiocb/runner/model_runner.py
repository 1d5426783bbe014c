"""Runs one step of a transformers model over the paged cache (torch only, no asyncio)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from aiocb.config import ContinuousBatchingConfig
from aiocb.runner import attention
from aiocb.runner.inputs import StepBatch, prepare_inputs
from aiocb.runner.memory import CachePlan, plan_cache
from aiocb.runner.model_spec import ModelSpec, model_spec
from aiocb.runner.paged_cache import PagedKVCache
from aiocb.runner.sampler import sample


@dataclass(frozen=True, slots=True)
class StepResult:
    """The sampled token (and its log-probability) of each sampled row, in row order."""

    token_ids: list[int]
    logprobs: list[float] | None


class ModelRunner:
    """Owns the model's paged cache and turns a :class:`StepBatch` into sampled tokens."""

    def __init__(
        self,
        model: PreTrainedModel,
        config: ContinuousBatchingConfig,
        *,
        num_requests_hint: int | None = None,
    ) -> None:
        self.model = model
        self.spec: ModelSpec = model_spec(model)
        self.plan: CachePlan = plan_cache(self.spec, config, num_requests_hint=num_requests_hint)
        self.cache = PagedKVCache(self.spec, self.plan)
        self._original_attention: str | None = None

    @property
    def device(self) -> torch.device:
        """Where the model and its cache live."""
        return self.spec.device

    def attach(self) -> None:
        """Route the model's attention through the paged cache (idempotent)."""
        if self._original_attention is None:
            self._original_attention = attention.install(self.model)

    def detach(self) -> None:
        """Give the model back its original attention implementation (idempotent)."""
        if self._original_attention is not None:
            attention.uninstall(self.model, self._original_attention)
            self._original_attention = None

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> StepResult:
        """Run one forward pass and sample; blocks until the tokens are on the host."""
        inputs = prepare_inputs(batch, self.cache, self.device)
        output = self.model(
            input_ids=inputs.input_ids[None],
            position_ids=inputs.position_ids[None],
            use_cache=False,
            logits_to_keep=inputs.logits_indices,
            **{attention.METADATA_KWARG: inputs.attention},
        )
        if batch.num_sampled == 0:
            return StepResult([], None)
        logits = output.logits[0].float()
        tokens, logprobs = sample(logits, inputs.sampling)
        return StepResult(tokens.tolist(), None if logprobs is None else logprobs.tolist())
