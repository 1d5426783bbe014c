"""A request's resolved generation parameters (plain values, no torch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Everything that decides which tokens a request produces and when it stops.

    ``temperature == 0`` means greedy decoding; ``top_k == 0`` and ``top_p == 1.0`` turn
    those filters off. ``seed`` selects the request's own random stream, so its samples do
    not depend on which other requests share its batch.
    """

    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    return_logprobs: bool = False
    #: how many most likely alternatives (id, logprob) to return with each generated token
    top_logprobs: int = 0
    #: return the log-probability of every prompt token given the ones before it
    prompt_logprobs: bool = False

    @property
    def greedy(self) -> bool:
        """Whether the request picks the most likely token at every step."""
        return self.temperature == 0.0 or self.top_k == 1
