"""Runs one step of a transformers model over the paged cache (torch only, no asyncio)."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from aiocb.config import ContinuousBatchingConfig
from aiocb.core.scheduler import StepResult
from aiocb.runner import attention
from aiocb.runner.inputs import StepBatch, StepInputs, prepare_inputs
from aiocb.runner.memory import CachePlan, plan_cache
from aiocb.runner.model_spec import ModelSpec, model_spec
from aiocb.runner.paged_cache import PagedKVCache
from aiocb.runner.sampler import sample, score


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
        logits = output.logits[0].float()
        num_sampled = batch.num_sampled
        picked = sample(logits[:num_sampled], inputs.sampling)
        return StepResult(
            token_ids=picked.tokens.tolist(),
            logprobs=None if picked.logprobs is None else picked.logprobs.tolist(),
            top_logprobs=_pairs(picked.top_ids, picked.top_logprobs),
            prompt_logprobs=self._score_prompts(logits[num_sampled:], inputs, batch),
        )

    def _score_prompts(
        self, logits: torch.Tensor, inputs: StepInputs, batch: StepBatch
    ) -> list[tuple[list[float], list[list[tuple[int, float]]] | None]] | None:
        if not inputs.prompt_counts:
            return None
        top = max(r.top_logprobs for r in batch.rows if r.prompt_targets)
        chosen, ids, values = score(logits, inputs.prompt_targets, top)
        chosen_list = chosen.tolist()
        pairs = _pairs(ids, values)
        scored: list[tuple[list[float], list[list[tuple[int, float]]] | None]] = []
        start = 0
        for count in inputs.prompt_counts:
            end = start + count
            scored.append((chosen_list[start:end], None if pairs is None else pairs[start:end]))
            start = end
        return scored


def _pairs(ids: torch.Tensor | None, values: torch.Tensor | None) -> list[list[tuple[int, float]]] | None:
    """``[N, k]`` ids and values as N lists of ``(id, value)``."""
    if ids is None or values is None:
        return None
    return [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
