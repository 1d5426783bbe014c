"""A request's mutable state, owned by the scheduler."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiocb.core.params import ResolvedParams
from aiocb.outputs import FinishReason, GenerationOutput, RequestStatus, defer_generated_tokens


class TextState(Protocol):
    """A request's generated text (``aiocb.detokenize.TextTracker``), when a tokenizer is given."""

    #: the stop string found, once one was
    matched: str | None

    @property
    def text(self) -> str: ...

    def add(self, token_id: int, num_output_tokens: int, *, last: bool = False) -> str | None: ...

    def finish(self) -> None: ...


class GrammarState(Protocol):
    """A constrained request's place in its grammar (``aiocb.structured.GrammarState``)."""

    #: whether a token the grammar did not allow came
    rejected: bool

    def accept(self, token: int) -> bool: ...

    def fill(self, bitmask: Any, row: int) -> None: ...

    def only_ends(self, bitmask: Any, row: int, ends: Collection[int]) -> bool: ...


_FINISHED = RequestStatus.FINISHED
#: Outputs with at most this many generated tokens get their own copy at once; longer ones
#: copy on first read (:func:`defer_generated_tokens`), which saves a stream of a long
#: generation from copying every token at every step. Below this a copy costs less than
#: deferring: making an output and reading its new tokens took 1.6 µs (16 tokens) to
#: 3.4 µs (1,024) with the copy and 3.4-3.6 µs deferred, on the 2-core development machine.
EAGER_TOKENS = 1024
#: what a long output's ``generated_tokens`` is built with (a required field), until
#: :func:`defer_generated_tokens` unsets it right after
_NOT_YET: list[int] = []
#: A list field most requests never fill, until one does (:meth:`Request.__post_init__`
#: makes those its parameters fill; the others, the code that first fills them). A list
#: is an object the cyclic garbage collector walks: a batch of 20,480 requests with seven
#: more empty lists each made every full collection some twice as long. Empty and
#: immutable: an append to it fails loudly.
NONE_YET: Any = ()


@dataclass(eq=False, slots=True)
class Request:
    """One generation request as the scheduler sees it.

    ``token_ids`` is the prompt followed by every generated token. The KV cache holds the
    first ``num_computed_tokens`` of them; the scheduler's one rule is to let
    ``num_computed_tokens`` catch up with ``len(token_ids)``, which covers prefill, chunked
    prefill, prefix hits, recompute after preemption and decode alike.
    """

    request_id: str
    prompt_ids: list[int]
    params: ResolvedParams
    arrival_time: float
    deadline: float | None = None
    #: the generated text and its stop strings (None without a tokenizer)
    text: TextState | None = None
    #: the grammar its output follows (json_schema, regex, choice, grammar); None: free
    grammar: GrammarState | None = None
    #: the stop token id or stop string that ended the request
    stop_reason: int | str | None = None
    #: more samples of this prompt (``n``), forked from this request once it computed the prompt
    children: list[Request] = NONE_YET
    #: of a sample of another request (``n``): that request's id
    sample_of: str | None = None
    #: the model runner's own state of the request (opaque here): its token history as a
    #: host tensor, kept up to date a token at a time, when penalties need it
    runner_state: object = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = NONE_YET
    #: per generated token, the most likely tokens and their log-probabilities
    top_logprobs: list[dict[int, float]] = NONE_YET
    #: per prompt position, the token's log-probability given the ones before (None first)
    prompt_logprobs: list[float | None] = NONE_YET
    prompt_top_logprobs: list[dict[int, float] | None] = NONE_YET
    #: with ``record_timestamps``: when each generated token came
    timestamps: list[float] = NONE_YET
    status: RequestStatus = RequestStatus.PENDING
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_computed_tokens: int = 0
    #: tokens a step in flight will sample for this request (async batching: 0 or 1)
    num_pending_tokens: int = 0
    #: per cache group, the physical blocks holding this request's KV, in order
    block_ids: list[list[int]] = NONE_YET
    #: per cache group, the fewest blocks ``block_ids`` was cut back to since the runner
    #: last copied them (speculation gives rejected positions back); None: never cut
    block_cuts: list[int] | None = None
    #: chained hashes of this request's full blocks (prefix caching), in order
    block_hashes: list[bytes] = NONE_YET
    #: how many of this request's blocks were offered to the prefix cache
    num_registered_blocks: int = 0
    #: per cache group, host blocks holding the KV of this (preempted, offloaded) request
    host_block_ids: list[list[int]] = NONE_YET
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    #: tokens it had computed when a preemption threw its KV away (until it is readmitted)
    num_lost_tokens: int = 0
    #: when the request was first admitted into a step (its queue time ends)
    scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    #: the prompt as outputs carry it: one copy shared by all of them
    output_prompt: list[int] | None = None
    #: speculative decoding: what proposes this request's tokens (opaque here), and
    #: whether a step in flight verifies a proposal (its next input is not known before)
    proposer: object = None
    speculating: bool = False
    #: whether every token of it takes a longrope model's long setting (its prompt, or
    #: for some models its sequence, passed the original length: see
    #: :mod:`aiocb.runner.long_rope`)
    long_rope: bool = False

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)
        params = self.params
        if params.return_logprobs and not self.logprobs:
            self.logprobs = []
        if params.top_logprobs and not self.top_logprobs:
            self.top_logprobs = []
        if params.prompt_logprobs and not self.prompt_logprobs:
            self.prompt_logprobs = [None]
            self.prompt_top_logprobs = [None]
        if params.record_timestamps and not self.timestamps:
            self.timestamps = []

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length."""
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        """The generated tokens (a new list)."""
        return self.token_ids[len(self.prompt_ids) :]

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens including those still being sampled by a step in flight."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        """How many tokens were generated."""
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def is_finished(self) -> bool:
        """Whether the request has ended."""
        return self.status >= _FINISHED  # (not is_finished(): this runs per row per step)

    def to_output(self) -> GenerationOutput:
        """A snapshot of the request as the public output type.

        Every output of the request shares one copy of the prompt list and the same
        top-logprob dictionaries, so a streamed output costs little more than its new
        tokens; consumers must not change those in place.
        """
        params = self.params
        prompt_done = params.prompt_logprobs and len(self.prompt_logprobs) == len(self.prompt_ids)
        if self.output_prompt is None:
            self.output_prompt = list(self.prompt_ids)
        # Positional, in GenerationOutput's field order: keywords cost more than half the
        # call (tests/engine/test_outputs.py checks every field by name).
        tokens, start, stop = self.token_ids, len(self.prompt_ids), len(self.token_ids)
        eager = stop - start <= EAGER_TOKENS
        output = GenerationOutput(
            self.request_id,
            self.output_prompt,
            tokens[start:stop] if eager else _NOT_YET,  # generated_tokens
            list(self.logprobs) if params.return_logprobs else None,
            list(self.top_logprobs) if params.top_logprobs else None,
            list(self.prompt_logprobs) if prompt_done else None,
            list(self.prompt_top_logprobs) if prompt_done and params.top_logprobs else None,
            None if self.text is None else self.text.text,
            None,  # text_delta: the consumer's own
            self.status,
            self.finish_reason,
            self.stop_reason,
            self.error,
            self.num_cached_tokens,
            self.arrival_time,
            self.scheduled_time,
            self.first_token_time,
            self.finished_time,
            list(self.timestamps) if params.record_timestamps else None,
        )
        if not eager:
            defer_generated_tokens(output, tokens, start, stop)
        return output
