"""A request's resolved generation parameters (plain values, no torch)."""

from __future__ import annotations

import itertools
import operator
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from aiocb.core.sequences import SequenceBias, SequenceIndex
from aiocb.gil import pause


@dataclass(frozen=True, slots=True)
class ResolvedParams:
    """Everything that decides which tokens a request produces and when it stops, resolved
    from :class:`aiocb.SamplingParams` and the manager's ``GenerationConfig``.

    ``temperature == 0`` means greedy decoding; ``top_k == 0``, ``top_p == 1.0``,
    ``min_p == 0``, ``top_h == 0``, ``typical_p == 1.0``, ``epsilon_cutoff == 0`` and
    ``eta_cutoff == 0`` turn those filters off. ``seed`` selects the request's own random
    stream, so its samples do not depend on which other requests share its batch.
    """

    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    top_h: float = 0.0
    typical_p: float = 1.0
    epsilon_cutoff: float = 0.0
    eta_cutoff: float = 0.0
    seed: int = 0
    #: EOS ids (unless ignored) and the request's stop tokens
    stop_token_ids: frozenset[int] = frozenset()
    #: no stop token or stop string before this many generated tokens
    min_tokens: int = 0
    return_logprobs: bool = False
    #: how many most likely alternatives (id, logprob) to return with each generated token
    top_logprobs: int = 0
    #: return the log-probability of every prompt token given the ones before it
    prompt_logprobs: bool = False
    #: logprobs of the distribution drawn from (after controls, temperature and filters),
    #: not of the model's raw one
    processed_logprobs: bool = False
    #: stamp each generated token with when it came (``time.perf_counter()``)
    record_timestamps: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    #: tokens biased at every step (logit_bias, one-token sequence biases; biases of a token
    #: given twice add up) and their biases, as C arrays: a step gathers a row's whole
    #: list at once (a logit_bias over the vocabulary, pair by pair, took 30 ms a step)
    bias_ids: array[int] = field(default_factory=lambda: c_array("q", ()))
    bias_values: array[float] = field(default_factory=lambda: c_array("f", ()))
    #: multi-token sequences whose last token is biased when the history ends with the others
    sequence_biases: tuple[SequenceBias, ...] = ()
    #: multi-token bad words, each with a bias of 0 (the matcher's form): their last token is
    #: banned when the history ends with the others
    bad_sequences: tuple[SequenceBias, ...] = ()
    #: tokens never generated (one-token bad words, the GenerationConfig's suppress_tokens),
    #: each once; C arrays like the biases, the allowed tokens and the held stops
    bans: array[int] = field(default_factory=lambda: c_array("q", ()))
    #: tokens not generated first (the GenerationConfig's begin_suppress_tokens)
    begin_bans: tuple[int, ...] = ()
    #: no n-gram of this many tokens occurs twice in prompt and output (0: off)
    no_repeat_ngram_size: int = 0
    #: when set, the only tokens that may be generated (each once, in order)
    allowed_token_ids: array[int] | None = None
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    #: the GenerationConfig's ``stop_strings``, with transformers' rules (when the request
    #: gives no ``stop``): matched in the text with special tokens, from the first token
    #: (``min_tokens`` holds off only stop tokens), the text of every token kept
    config_stop: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    #: lower runs first (admission and preemption order); 0 for every request: arrival order
    priority: int = 0
    #: the output's form, ``(kind, text)``: ``("json_schema", schema)``, ``("regex", pattern)``
    #: or ``("grammar", EBNF)``; None: free
    structure: tuple[str, str] | None = None
    #: whether any logits control is used (computed): rows without one cost nothing extra
    uses_controls: bool = field(init=False, default=False)
    #: ``sequence_biases`` and ``bad_sequences`` indexed (made on first use; computed, and
    #: shared by the copies :meth:`with_seed` makes, a request's samples, and with the last
    #: request of the same sequences: :meth:`~aiocb.core.sequences.SequenceIndex.of`)
    sequence_index: SequenceIndex | None = field(init=False, default=None, compare=False, repr=False)
    #: the stop tokens, banned before ``min_tokens`` (computed; empty when it is 0)
    held_stops: array[int] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "held_stops", c_array("q", self.stop_token_ids if self.min_tokens > 0 else ()))
        uses = (
            self.min_tokens > 0
            or self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or bool(self.bias_ids or self.sequence_biases or self.bad_sequences or self.bans or self.begin_bans)
            or self.no_repeat_ngram_size > 0
            or self.allowed_token_ids is not None
        )
        object.__setattr__(self, "uses_controls", uses)
        if self.sequence_biases or self.bad_sequences:
            object.__setattr__(self, "sequence_index", SequenceIndex.of(self.sequence_biases, self.bad_sequences))

    def with_seed(self, seed: int) -> ResolvedParams:
        """A copy with another seed: each of ``n`` samples' own stream (a field-by-field
        copy, a third of what ``dataclasses.replace`` costs, which runs the checks again:
        a thousand samples are made on the event loop in one call)."""
        copy = object.__new__(ResolvedParams)
        for name, value in zip(ResolvedParams.__slots__, _every_field(self), strict=True):
            object.__setattr__(copy, name, value)
        object.__setattr__(copy, "seed", seed)
        return copy

    @property
    def greedy(self) -> bool:
        """Whether the request picks the most likely token at every step (a sampled one
        with ``top_k`` 1 draws among the most likely when they tie, as transformers' top-k
        warper keeps them all)."""
        return self.temperature == 0.0

    @property
    def rare_filters(self) -> tuple[float, float, float, float] | None:
        """``(top_h, typical_p, epsilon_cutoff, eta_cutoff)`` when any of them is on, else None."""
        values = (self.top_h, self.typical_p, self.epsilon_cutoff, self.eta_cutoff)
        if values == (0.0, 1.0, 0.0, 0.0):
            return None
        if 0.0 < self.top_h < _SMALLEST_FLOAT32:  # (it would round to 0, off, on the device)
            values = (_SMALLEST_FLOAT32, *values[1:])
        return values

    @property
    def penalizes(self) -> bool:
        """Whether a step needs the request's token history on the device."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def needs_known_history(self) -> bool:
        """Whether each step's controls depend on the last token itself (multi-token
        sequence biases, bad words, n-grams not to repeat, a grammar), so no step may be
        planned while it is being sampled."""
        return (
            bool(self.sequence_biases or self.bad_sequences)
            or self.no_repeat_ngram_size > 0
            or self.structure is not None
        )


#: float32's smallest positive value
_SMALLEST_FLOAT32 = 1.401298464324817e-45

#: every field of a ResolvedParams in one call (slot order)
_every_field = operator.attrgetter(*ResolvedParams.__slots__)

#: Items put in a C array at once, with a :func:`~aiocb.gil.pause` between slices.
_SLICE = 8192


def c_array(typecode: str, values: Iterable[Any]) -> array[Any]:
    """``values`` as a C array of ``typecode`` (never to be changed), a slice at a time: a
    step gathers a row's ids from it at once, and a hundred thousand of them made into one
    in one go would hold the GIL for milliseconds (see :func:`~aiocb.gil.pause`). Empty,
    the one array of its type that every request shares (the collector tracks every array:
    four of a request's own made each queued request a third more objects for it to walk)."""
    made = array(typecode)
    items = iter(values)
    while part := list(itertools.islice(items, _SLICE)):
        made.fromlist(part)
        pause()
    return made if made else _EMPTY.setdefault(typecode, made)


_EMPTY: dict[str, array[Any]] = {}
