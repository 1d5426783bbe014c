"""Multi-token sequence biases and bad words: which tokens a row's history biases or bans.

transformers' ``SequenceBiasLogitsProcessor`` and ``NoBadWordsLogitsProcessor`` compare
every sequence with the end of the history at every step. Here a request's sequences are
indexed once (:class:`SequenceMatcher`), and the index is shared by the request's samples
(:class:`SequenceIndex`, which :class:`~aiocb.core.params.ResolvedParams` carries): a
request with ``n`` samples and a list of thousands of bad words builds it once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

#: A sequence of token ids and the bias added to its last token when the history ends with the rest.
SequenceBias = tuple[tuple[int, ...], float]

#: sequences indexed between two calls of the ``pause`` given to :class:`SequenceMatcher`
_PAUSE_EVERY = 1_000


def matched_sequence_bias(token_ids: Sequence[int], sequences: Sequence[SequenceBias]) -> list[tuple[int, float]]:
    """The ``(token id, bias)`` pairs that transformers' ``SequenceBiasLogitsProcessor`` adds for one row.

    ``token_ids`` is the row's whole history (prompt, then generated tokens) and
    ``sequences`` the non-empty biased sequences with their biases. A one-token sequence
    always biases its token; a longer one biases its last token when the history ends
    with its other tokens, so that the next token would complete it. As in transformers,
    a sequence whose prefix (all but its last token) is longer than the history is
    skipped, and when a sequence is listed twice the last bias wins (transformers keys
    them in a dict). Several pairs may name one token: their biases add up.

    Bad words are the same with a bias of ``-inf``. transformers'
    ``NoBadWordsLogitsProcessor`` first drops every bad word that is exactly one EOS token
    (``[eos]``, for each EOS id), so that a request can always end; a longer bad word that
    contains or ends with EOS is kept. This helper does not know the EOS ids: the caller
    removes such ``[eos]`` bad words before calling it.
    """
    return SequenceMatcher(sequences).matches(token_ids)


class SequenceMatcher:
    """:func:`matched_sequence_bias` for one request's sequences, indexed once: each step
    looks its history's last tokens up once per distinct prefix length, rather than
    comparing every sequence (a list of 800 bad words cost 0.26 ms a row a step so)."""

    __slots__ = ("_by_length",)

    def __init__(self, sequences: Sequence[SequenceBias], pause: Callable[[], None] | None = None) -> None:
        #: per prefix length, each prefix's ``(place in the list, last token, bias)``s
        self._by_length: dict[int, dict[tuple[int, ...], list[tuple[int, int, float]]]] = {}
        for place, (sequence, bias) in enumerate(dict(sequences).items()):
            prefix = sequence[:-1]
            self._by_length.setdefault(len(prefix), {}).setdefault(prefix, []).append((place, sequence[-1], bias))
            if pause is not None and place % _PAUSE_EVERY == _PAUSE_EVERY - 1:
                pause()

    def matches(self, token_ids: Sequence[int]) -> list[tuple[int, float]]:
        """The ``(token id, bias)`` pairs for a row whose history is ``token_ids``, in the
        sequences' order."""
        found: list[tuple[int, int, float]] = []
        end = len(token_ids)
        lengths = 0
        for length, prefixes in self._by_length.items():
            if length > end:
                continue  # (transformers skips a sequence whose prefix is longer than the history)
            entries = prefixes.get(tuple(token_ids[end - length : end]))
            if entries:
                found += entries
                lengths += 1
        if lengths > 1:
            found.sort()
        return [(token, bias) for _, token, bias in found]


class SequenceIndex:
    """A request's sequence biases and bad words, indexed on first use (:meth:`matchers`)
    or ahead of it (:meth:`build`), once for all of its samples."""

    __slots__ = ("_bad", "_biases", "_matchers")

    def __init__(self, biases: Sequence[SequenceBias], bad: Sequence[SequenceBias]) -> None:
        self._biases = biases
        self._bad = bad
        self._matchers: tuple[SequenceMatcher, SequenceMatcher] | None = None

    @classmethod
    def of(cls, biases: Sequence[SequenceBias], bad: Sequence[SequenceBias]) -> SequenceIndex:
        """The index of these sequence biases and bad words: the last one made, where they
        are its (the prompts of a batch, a completion's, or a client's requests one by one
        nearly always repeat them, and an index of a thousand sequences costs a millisecond
        to build, its tuples a garbage collection more, where comparing them costs some
        30 µs, nothing where they are the same objects)."""
        global _last_index
        last = _last_index
        if last is not None and last.indexes(biases, bad):
            return last
        _last_index = index = cls(biases, bad)
        return index

    def __len__(self) -> int:
        return len(self._biases) + len(self._bad)

    @property
    def built(self) -> bool:
        """Whether the sequences are indexed."""
        return self._matchers is not None

    def indexes(self, biases: Sequence[SequenceBias], bad: Sequence[SequenceBias]) -> bool:
        """Whether this index is of these sequence biases and bad words (another request's
        with the same ones may share it)."""
        return (biases is self._biases or biases == self._biases) and (bad is self._bad or bad == self._bad)

    def build(self, pause: Callable[[], None] | None = None) -> None:
        """Index the sequences now (a worker thread may, calling ``pause`` now and then to
        let the event loop's thread have the GIL)."""
        if self._matchers is None:
            self._matchers = (SequenceMatcher(self._biases, pause), SequenceMatcher(self._bad, pause))

    def matchers(self) -> tuple[SequenceMatcher, SequenceMatcher]:
        """The sequence biases' and the bad words' matchers."""
        if self._matchers is None:
            self.build()
            assert self._matchers is not None
        return self._matchers


#: the index :meth:`SequenceIndex.of` made last
_last_index: SequenceIndex | None = None
