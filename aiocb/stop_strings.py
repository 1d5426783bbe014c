"""An automaton that finds any of a set of stop strings in text fed a piece at a time.

:class:`StopStrings` is an Aho-Corasick automaton over a tuple of stop strings: feeding it
one character costs the same however many stop strings there are, and its state says at
once how much of the text so far could still begin one (the text a stream holds back).
Searching for each stop string in each token's text instead cost about 4 µs a token with
four stop strings, 100 µs with 200; the automaton takes about 2 µs for either.

The trie is kept in flat arrays rather than a dictionary a node (about 24 bytes a
character of the stop strings, not 270), since a request may bring 64 stop strings of
1,024 characters: a node's children are numbered consecutively, so that finding the child
for a character is one ``str.find`` in the string of the nodes' characters.

Building one costs about 1 µs a node: :func:`stop_strings` keeps the ones used last (and
finds any still held), and :func:`prepare_stop_strings` builds a large one on a worker
thread, so that a request that brings many long stop strings does not hold the event loop.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import weakref
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Any

from aiocb.core.params import c_array
from aiocb.gil import pause, pausing_call

#: Stop strings of more characters than this in all are built off the event loop (about
#: 1 µs a character) by :func:`prepare_stop_strings`.
BUILT_ON_THE_LOOP = 1_000
#: The automata kept for reuse (requests of one client often bring the same stop strings),
#: in trie nodes (about 24 bytes each) ...
_KEPT_NODES = 1 << 20
#: ... each charged this many more for its own objects (some 800 bytes): at most 4,096 are
#: kept, however small.
_ENTRY_NODES = 256
#: List items freed at once (a fraction of a millisecond).
_ARRAY_SLICE = 4096


def _array(values: list[int]) -> array[int]:
    """``values`` as an array of C ints (:func:`~aiocb.core.params.c_array`), emptying
    ``values`` a slice at a time too (65,000 of them made in one go, or freed, held the GIL
    a millisecond)."""
    made = c_array("i", values)
    _free(values)
    return made


def _free(values: list[Any]) -> None:
    """Empty ``values``, a slice at a time."""
    while values:
        del values[-_ARRAY_SLICE:]
        pause()


class StopStrings:
    """The Aho-Corasick automaton of ``stops`` (non-empty strings, no two equal).

    A state is a node of the trie of the stop strings: the longest end of the text fed so
    far that begins one of them (node 0: none), :meth:`depth` characters long. :meth:`scan`
    moves it along a piece of text and finds the stop strings that end in it.
    """

    __slots__ = ("__weakref__", "_chars", "_depth", "_end", "_fail", "_first", "_found", "_lengths", "longest", "stops")

    def __init__(self, stops: Sequence[str]) -> None:
        """Build the automaton (on a worker thread inside :func:`~aiocb.gil.pausing`,
        letting the event loop's thread have the GIL every half millisecond of it)."""
        if not stops or not all(stops) or len(set(stops)) < len(stops):
            raise ValueError("stop strings must be at least one, non-empty and distinct")
        self.stops = tuple(stops)
        self._lengths = tuple(map(len, self.stops))
        #: the length of the longest stop string
        self.longest = max(self._lengths)
        self._build_trie()
        self._link()

    def _build_trie(self) -> None:
        """The trie, its nodes numbered so that each node's children are consecutive."""
        stops = self.stops
        ordered = sorted(range(len(stops)), key=stops.__getitem__)  # (a node's stop strings are a run)
        chars = ["\0"]  # node i's character is chars[i]; the root has none
        first, end, depth, found = [0], [0], [0], [-1]
        # A node to give children, with the run of ``ordered`` whose strings begin with its
        # text, of length d: [lo, hi).
        todo = [(0, 0, len(ordered), 0)]
        while todo:
            node, lo, hi, d = todo.pop()
            if len(stops[ordered[lo]]) == d:  # (the shortest sorts first)
                found[node] = ordered[lo]
                lo += 1
            first[node] = len(chars)
            if hi - lo == 1:  # one stop string left: the rest of it is a chain of nodes
                rest = stops[ordered[lo]][d:]
                start = len(chars)
                chars.extend(rest)
                first.extend(range(start + 1, start + len(rest) + 1))
                end.extend(range(start + 2, start + len(rest) + 2))
                end[-1] = first[-1] = start + len(rest)  # (the leaf has no children)
                depth.extend(range(d + 1, d + len(rest) + 1))
                found.extend([-1] * len(rest))
                found[-1] = ordered[lo]
                end[node] = start + 1
            else:
                while lo < hi:
                    char = stops[ordered[lo]][d]
                    run_end = lo + 1
                    while run_end < hi and stops[ordered[run_end]][d] == char:
                        run_end += 1
                    todo.append((len(chars), lo, run_end, d + 1))
                    chars.append(char)
                    first.append(0)
                    end.append(0)
                    depth.append(d + 1)
                    found.append(-1)
                    lo = run_end
                end[node] = len(chars)
            pause()  # (a node with its children, or a chain of them: some 0.1 ms at most)
        self._chars = "".join(chars)
        _free(chars)
        self._first, self._end = _array(first), _array(end)
        self._depth, self._found = _array(depth), _array(found)

    def _link(self) -> None:
        """The failure links (a node's longest proper end that is a node too), in breadth-
        first order, and with them the stop string that ends at each node."""
        chars, first, end, found = self._chars, self._first, self._end, self._found
        fail = self._fail = array("i", bytes(4 * len(chars)))
        queue = deque(range(first[0], end[0]))  # (the root's children fail to the root)
        linked = 0
        while queue:
            node = queue.popleft()
            for child in range(first[node], end[node]):
                char = chars[child]
                link = fail[node]
                while (target := chars.find(char, first[link], end[link])) < 0 and link:
                    link = fail[link]
                fail[child] = max(target, 0)
                if found[child] < 0:  # the longest stop string that ends here: its own, or its link's
                    found[child] = found[fail[child]]
                queue.append(child)
            linked += 1
            if not linked & 15:
                pause()

    def scan(self, node: int, text: str, offset: int, count: bool) -> tuple[int, int, int]:
        """Feed ``text`` from state ``node``; returns the state after it and, when ``count``,
        the stop string found in it that begins first (the first given of those that begin
        there): where it begins, counting ``offset`` characters before ``text``, and its
        index in :attr:`stops` (-1, -1: none).
        """
        chars, first, end, fail, found, lengths = (
            self._chars,
            self._first,
            self._end,
            self._fail,
            self._found,
            self._lengths,
        )
        begins = which = -1
        ends = offset
        for char in text:
            while (target := chars.find(char, first[node], end[node])) < 0 and node:
                node = fail[node]
            node = max(target, 0)
            ends += 1
            if count and (stop := found[node]) >= 0:
                at = ends - lengths[stop]
                if which < 0 or at < begins or (at == begins and stop < which):
                    begins, which = at, stop
        return node, begins, which

    def depth(self, node: int) -> int:
        """How many characters of text ``node`` stands for."""
        return self._depth[node]

    def shorter(self, node: int) -> int:
        """The longest proper end of ``node``'s text that begins a stop string."""
        return self._fail[node]

    @property
    def nodes(self) -> int:
        """The number of trie nodes (the root too)."""
        return len(self._chars)


#: The automata kept for reuse, least recently used first, and what they cost in nodes
#: (each charged :data:`_ENTRY_NODES` more for its own objects).
_kept: OrderedDict[tuple[str, ...], StopStrings] = OrderedDict()
_kept_nodes = 0
#: Every automaton still held (by a request's matcher, or by a caller between
#: :func:`prepare_stop_strings` and the requests it makes), found here once the cache has
#: let it go.
_live: weakref.WeakValueDictionary[tuple[str, ...], StopStrings] = weakref.WeakValueDictionary()
#: Guards the two (managers may run on loops in several threads).
_lock = threading.Lock()


def stop_strings(stops: tuple[str, ...]) -> StopStrings:
    """The automaton of ``stops`` (non-empty, distinct: see :func:`distinct`), built now
    unless kept or still held."""
    built = _found(stops)
    if built is None:
        built = StopStrings(stops)
        _keep(built)
    return built


def _found(stops: tuple[str, ...]) -> StopStrings | None:
    with _lock:
        built = _kept.get(stops)
        if built is not None:
            _kept.move_to_end(stops)
            return built
        return _live.get(stops)


def _keep(built: StopStrings) -> None:
    """Keep ``built``, letting the least recently used go, one by one, while the cache is full."""
    global _kept_nodes
    cost = built.nodes + _ENTRY_NODES
    with _lock:
        _live[built.stops] = built
        if built.stops in _kept or cost > _KEPT_NODES:
            return
        while _kept and _kept_nodes + cost > _KEPT_NODES:
            _, dropped = _kept.popitem(last=False)
            _kept_nodes -= dropped.nodes + _ENTRY_NODES
        _kept[built.stops] = built
        _kept_nodes += cost


def distinct(stops: Sequence[str]) -> tuple[str, ...]:
    """``stops`` without empty strings and repeats, in their order."""
    return tuple(dict.fromkeys(stop for stop in stops if stop))


#: Automata being built off the loop, so that requests that bring the same stop strings
#: at once (the samples of one, the choices of a server's) wait for one build.
_building: dict[tuple[str, ...], asyncio.Task[StopStrings]] = {}


async def prepare_stop_strings(stops: Sequence[str] | None) -> StopStrings | None:
    """The automaton of ``stops``, built on a worker thread when it is large (past
    :data:`BUILT_ON_THE_LOOP` characters); None when they are few or none. A caller holds
    it while it makes the matchers that use it: :func:`stop_strings` then finds it, however
    many others have filled the cache since."""
    key = distinct(stops or ())
    if not key or sum(map(len, key)) <= BUILT_ON_THE_LOOP:
        return None
    found = _found(key)
    if found is not None:
        return found
    loop = asyncio.get_running_loop()
    building = _building.get(key)
    if building is None or building.get_loop() is not loop:  # (another loop's: build again)
        building = _building[key] = loop.create_task(_build(key))
        building.add_done_callback(functools.partial(_built, key))
    return await asyncio.shield(building)  # (a caller cancelled leaves the build to the others)


async def _build(key: tuple[str, ...]) -> StopStrings:
    built = await asyncio.to_thread(pausing_call, StopStrings, key)
    _keep(built)
    return built


def _built(key: tuple[str, ...], task: asyncio.Task[StopStrings]) -> None:
    if _building.get(key) is task:
        del _building[key]
    if not task.cancelled():
        task.exception()  # (retrieved: every caller may have been cancelled meanwhile)
