"""What a large body's work changes while it runs: full collections put off
(``aiocb.collector``), the GIL handed over sooner (``aiocb.gil``)."""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
import warnings
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


@pytest.fixture
def full_starts() -> Iterator[list[int]]:
    """A list that gets an entry as each full collection begins (until the test ends)."""
    starts: list[int] = []

    def record(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 2:
            starts.append(1)

    gc.callbacks.append(record)
    yield starts
    gc.callbacks.remove(record)


def test_no_full_collection_runs_inside_and_one_put_off_comes_after(full_starts: list[int]) -> None:
    young, middle, _ = gc.get_threshold()
    gc.collect()
    gc.freeze()  # (what lives now out of the way: the objects made here decide alone)
    gc.collect()  # (and a full collection that found nothing in view since)
    # (what this test froze stays frozen, as aiocb's import left what it froze)
    gc.set_threshold(young, middle, 1)
    kept = [[i] for i in range(100_000)]
    assert full_starts, "100,000 lists kept bring full collections"
    del kept
    gc.collect()
    full_starts.clear()
    with full_collections_deferred():
        kept = [[i] for i in range(100_000)]  # (young collections only)
    assert not full_starts and gc.get_count()[2] > 1
    more = [[i] for i in range(20_000)]
    assert full_starts, "the full collection put off comes once the threshold is back"
    del kept, more


def test_blocks_back_to_back_let_one_run_when_overdue(monkeypatch: pytest.MonkeyPatch, full_starts: list[int]) -> None:
    monkeypatch.setattr(collector, "LONGEST_DEFERRAL_S", 0.0)
    with full_collections_deferred():
        assert not full_starts
        time.sleep(0.001)
        with full_collections_deferred():
            assert len(full_starts) == 1


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


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork")
def test_a_child_forked_inside_the_blocks_begins_without_them(thresholds: tuple[int, int, int]) -> None:
    interval = sys.getswitchinterval()
    with full_collections_deferred(), gil.switching_often():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # (a fork beside threads)
            child = os.fork()
        if child == 0:  # the child: checks, then leaves at once, whatever happens
            status = 1
            try:
                ok = gc.get_threshold() == thresholds and sys.getswitchinterval() == interval
                with full_collections_deferred(), gil.switching_often():
                    ok = ok and gc.get_threshold()[2] == collector._NEVER and sys.getswitchinterval() == gil.OFTEN
                status = 0 if ok and gc.get_threshold() == thresholds else 1
            finally:
                os._exit(status)
        _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child kept the parent's blocks"
    assert gc.get_threshold() == thresholds and sys.getswitchinterval() == interval
