"""What a request produces: :class:`GenerationOutput` and :class:`RequestStatus`."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING


class RequestStatus(enum.IntEnum):
    """Where a request is in its life. Values at or above ``FINISHED`` are terminal."""

    PENDING = 0
    PREFILLING = 1
    DECODING = 2
    FINISHED = 3
    FAILED = 4
    CANCELLED = 5

    def is_finished(self) -> bool:
        """Whether the request has ended (finished, failed or cancelled)."""
        return self >= RequestStatus.FINISHED


class FinishReason(enum.StrEnum):
    """Why a request ended."""

    STOP = "stop"  # an EOS or stop token (the last generated token), or a stop string
    LENGTH = "length"  # max_new_tokens or the model's context length was reached
    CANCELLED = "cancelled"  # cancel_request(), a cancelled awaiter, or a closed stream
    TIMEOUT = "timeout"  # the request's deadline passed (queue time included)
    ABORTED = "aborted"  # stop(hard_stop=True)
    ERROR = "error"  # the engine failed, or the request did (its controls left its grammar no token)


class _DeferredTokens:
    """The slot in which an engine's output keeps where its ``generated_tokens`` come from
    until they are first read (not a dataclass field: no constructor argument, no
    ``asdict`` key)."""

    __slots__ = ("_tokens_from",)
    #: ``(tokens, start, stop)``: ``generated_tokens`` is ``tokens[start:stop]``
    _tokens_from: tuple[list[int], int, int]

    def _take_tokens_from(self, tokens: list[int], start: int, stop: int) -> None:
        self._tokens_from = (tokens, start, stop)


@dataclass(slots=True)
class GenerationOutput(_DeferredTokens):
    """A request's output so far, or its final output once ``status.is_finished()``.

    ``generated_tokens`` always holds every token generated so far (not a delta), as in
    transformers' continuous batching. Past 1,024 tokens the engine's outputs make
    that list when it is first read, so a stream of a long generation does not copy
    every token at every step; :meth:`tokens_since` reads the new ones alone.

    ``logprobs[i]`` is the log-probability of ``generated_tokens[i]`` under the model's raw
    distribution (a log-softmax of its logits, before temperature, top-k or top-p; after
    them with ``logprobs_mode="processed"``), present when logprobs were requested;
    ``top_logprobs[i]`` maps the most likely tokens at that step to theirs. With
    ``prompt_logprobs``, ``prompt_logprobs[j]`` is the log-probability of prompt token
    ``j`` given the ones before it (None for the first),
    set once the prompt is computed. With a tokenizer, ``text`` is the generated text so
    far and ``text_delta`` what it gained since the previous output of the same consumer;
    a character split across tokens appears once it is complete, and a possible stop
    string is held back until it is known not to be one.
    """

    request_id: str
    prompt_ids: list[int]
    generated_tokens: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[dict[int, float] | None] | None = None
    #: the generated text so far, when the manager has a tokenizer (the stop string or
    #: stop token that ended it left out, unless ``include_stop_str_in_output``)
    text: str | None = None
    #: the text added since the previous output handed to the same consumer
    text_delta: str | None = None
    status: RequestStatus = RequestStatus.PENDING
    finish_reason: FinishReason | None = None
    #: what stopped the request (``finish_reason`` "stop"): the stop token id or stop string
    stop_reason: int | str | None = None
    error: str | None = None
    #: prompt tokens whose KV came from the prefix cache instead of being computed
    num_cached_tokens: int = 0
    #: when the request was queued, first admitted into a step, got its first token and
    #: ended (``time.perf_counter()`` values)
    created_time: float = 0.0
    scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    #: with ``record_timestamps``: when each of ``generated_tokens`` came (``time.perf_counter()``)
    timestamps: list[float] | None = None

    @property
    def lifespan(self) -> tuple[float, float]:
        """``(scheduled_time, finished_time)`` as transformers gives it: -1 for each not yet reached."""
        return (
            -1.0 if self.scheduled_time is None else self.scheduled_time,
            -1.0 if self.finished_time is None else self.finished_time,
        )

    def is_finished(self) -> bool:
        """Whether this is the request's final output."""
        return self.status.is_finished()

    def tokens_since(self, start: int) -> list[int]:
        """``generated_tokens[start:]``, without making the whole list first."""
        try:
            generated: list[int] = object.__getattribute__(self, "generated_tokens")  # (no __getattr__)
        except AttributeError:  # deferred: slice the source directly
            tokens, first, stop = self._tokens_from
            if start < 0:
                start = max(0, stop - first + start)
            return tokens[first + start : stop]
        return generated[start:]

    if not TYPE_CHECKING:  # (mypy would take any attribute name as valid)

        def __getattr__(self, name: str) -> list[int]:
            # Reached only for an unset slot: an engine output's deferred generated_tokens.
            if name != "generated_tokens":
                raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
            tokens, start, stop = self._tokens_from
            generated = self.generated_tokens = tokens[start:stop]
            return generated


def defer_generated_tokens(output: GenerationOutput, tokens: list[int], start: int, stop: int) -> None:
    """Make ``output.generated_tokens`` read as ``tokens[start:stop]``, copied on first read.

    ``tokens`` must only ever be appended to (a request's token list is).
    """
    del output.generated_tokens
    output._take_tokens_from(tokens, start, stop)
