"""What a large body's work changes while it runs: full collections put off
(``aiocb.collector``), the GIL handed over sooner (``aiocb.gil``)."""

from __future__ import annotations

import gc
import sys
import threading
from collections.abc import Iterator

import pytest

from aiocb import collector, gil
from aiocb.collector import full_collections_deferred


@pytest.fixture(autouse=True)
def thresholds() -> Iterator[tuple[int, int, int]]:
    before = gc.get_threshold()
    yield before
    gc.set_threshold(*before)


def test_full_collections_wait_for_the_last_block_to_end(thresholds: tuple[int, int, int]) -> None:
    young, middle, _ = thresholds
    entered, release = threading.Event(), threading.Event()

    def other() -> None:
        with full_collections_deferred():
            entered.set()
            release.wait(10)

    thread = threading.Thread(target=other)
    with full_collections_deferred():
        assert gc.get_threshold() == (young, middle, collector._NEVER)
        thread.start()
        assert entered.wait(10)
        with full_collections_deferred():  # (nested on one thread too)
            assert gc.get_threshold()[2] == collector._NEVER
    assert gc.get_threshold()[2] == collector._NEVER, "the other thread's block still runs"
    release.set()
    thread.join()
    assert gc.get_threshold() == thresholds


def test_no_full_collection_runs_inside_and_one_that_came_due_runs_in_the_next() -> None:
    full_starts: list[int] = []

    def record(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 2:
            full_starts.append(1)

    young, middle, _ = gc.get_threshold()
    gc.collect()
    gc.freeze()  # (what lives now out of the way: the objects made here decide alone)
    gc.collect()  # (and a full collection that found nothing in view since)
    gc.callbacks.append(record)
    try:
        gc.set_threshold(young, middle, 1)
        kept = [[i] for i in range(100_000)]
        assert full_starts, "100,000 lists kept bring full collections"
        del kept
        gc.collect()
        full_starts.clear()
        with full_collections_deferred():
            kept = [[i] for i in range(100_000)]  # (young collections only)
        assert not full_starts and gc.get_count()[2] > 1
        del kept
        with full_collections_deferred():
            assert len(full_starts) == 1, "the full collection put off runs first in the next block"
    finally:
        gc.callbacks.remove(record)
        gc.unfreeze()


def test_thresholds_set_meanwhile_are_left_alone(thresholds: tuple[int, int, int]) -> None:
    with full_collections_deferred():
        gc.set_threshold(500, 5, 5)
    assert gc.get_threshold() == (500, 5, 5)


def test_the_switch_interval_is_short_until_the_last_block_ends() -> None:
    before = sys.getswitchinterval()
    entered, release = threading.Event(), threading.Event()

    def other() -> None:
        with gil.switching_often():
            entered.set()
            release.wait(10)

    thread = threading.Thread(target=other)
    try:
        with gil.switching_often():
            assert sys.getswitchinterval() == gil.OFTEN
            thread.start()
            assert entered.wait(10)
        assert sys.getswitchinterval() == gil.OFTEN, "the other thread's block still runs"
        release.set()
        thread.join()
        assert sys.getswitchinterval() == before
        with gil.switching_often():
            sys.setswitchinterval(0.002)
        assert sys.getswitchinterval() == 0.002, "an interval set meanwhile is left alone"
    finally:
        sys.setswitchinterval(before)
