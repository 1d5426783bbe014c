"""A destroyed manager frees its runner and KV cache, by reference counting alone.

On a GPU the cache is most of the device memory: a runner kept alive by a reference
cycle (or by ``gc.freeze()``, which puts the cycle out of the collector's reach) holds it
for the life of the process.
"""

from __future__ import annotations

import gc
import io
import json
import logging
import subprocess
import sys
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import PreTrainedModel

import aiocb
from aiocb.runner.model_runner import ModelRunner
from tests.conftest import arm_failure, random_prompts, tiny_qwen3

PROMPTS = random_prompts(4, 8, 40, seed=11)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_cyclic_gc() -> Iterator[None]:
    """Only reference counting frees objects during the test."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _runner_refs(runner: ModelRunner | None) -> list[weakref.ref[object]]:
    """Weak references to the runner and to every K and V tensor of its paged cache."""
    assert runner is not None
    return [weakref.ref(runner), *(weakref.ref(t) for t in (*runner.cache.key, *runner.cache.value))]


def _alive(refs: list[weakref.ref[object]]) -> list[str]:
    return [repr(ref())[:80] for ref in refs if ref() is not None]


def _join_worker_threads() -> None:
    """After a failed step the worker threads exit on their own, without the loop waiting."""
    for thread in threading.enumerate():
        if thread.name.startswith(("aiocb-step", "aiocb-wait")):
            thread.join(timeout=5)


async def _some_traffic(manager: aiocb.Manager) -> None:
    """Awaited, streamed, cancelled and logprob requests, so every path has run."""
    await manager.generate(PROMPTS[0], max_new_tokens=3, return_logprobs=True, top_logprobs=2)
    rid = await manager.add_request(PROMPTS[1], max_new_tokens=4)
    async for _ in manager.stream(rid):
        pass
    cancelled = await manager.add_request(PROMPTS[2], max_new_tokens=50)
    manager.cancel_request(cancelled)
    await manager.generate_batch(PROMPTS, max_new_tokens=2, prompt_logprobs=True)


async def test_destroy_frees_the_runner_while_the_manager_is_kept(qwen3: PreTrainedModel, no_cyclic_gc: None) -> None:
    manager = aiocb.Manager(qwen3)
    manager.start()
    await _some_traffic(manager)
    refs = _runner_refs(manager._runner)
    await manager.destroy()
    assert _alive(refs) == []
    stats = manager.statistics()
    assert stats.steps > 0 and stats.free_blocks == stats.total_blocks, "the last statistics are kept"


async def test_leaving_async_with_frees_the_runner(qwen3: PreTrainedModel, no_cyclic_gc: None) -> None:
    async with aiocb.Manager(qwen3) as manager:
        await _some_traffic(manager)
        refs = _runner_refs(manager._runner)
        manager_ref = weakref.ref(manager)
    assert _alive(refs) == []
    del manager
    assert manager_ref() is None, "nothing holds the manager in a reference cycle"


async def test_stop_of_a_plain_manager_frees_the_runner(qwen3: PreTrainedModel, no_cyclic_gc: None) -> None:
    manager = aiocb.Manager(qwen3)
    manager.start()
    await _some_traffic(manager)
    refs = _runner_refs(manager._runner)
    await manager.stop()
    assert _alive(refs) == [], "start() builds a new cache; the ended session's is freed"
    manager.start()  # and the manager still works
    assert len((await manager.generate(PROMPTS[0], max_new_tokens=2)).generated_tokens) == 2
    await manager.destroy()


async def test_a_persistent_manager_keeps_its_runner_until_destroyed(
    qwen3: PreTrainedModel, no_cyclic_gc: None
) -> None:
    async with aiocb.Manager(qwen3, persistent_manager=True) as manager:
        await _some_traffic(manager)
        refs = _runner_refs(manager._runner)
    assert _alive(refs) != [], "kept between sessions"
    async with aiocb.Manager(qwen3, persistent_manager=True) as again:
        assert again is manager
        await _some_traffic(again)
    await manager.destroy()
    assert _alive(refs) == []


async def test_destroying_a_dead_manager_frees_the_runner(no_cyclic_gc: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # pytest's log capture keeps every record, and the failure's record holds its
    # traceback; an ordinary handler formats the record and lets it go.
    manager_logger = logging.getLogger("aiocb.engine.manager")
    monkeypatch.setattr(manager_logger, "propagate", False)
    monkeypatch.setattr(manager_logger, "handlers", [logging.StreamHandler(io.StringIO())])
    model = tiny_qwen3()  # its own model: the armed failure stays on it
    switch = arm_failure(model)
    manager = aiocb.Manager(model)
    manager.start()
    await manager.generate(PROMPTS[0], max_new_tokens=2)
    refs = _runner_refs(manager._runner)
    switch["fail"] = True
    with pytest.raises(aiocb.EngineDeadError) as raised:
        await manager.generate(PROMPTS[1], max_new_tokens=4)
    assert manager.is_dead
    await manager.destroy()
    _join_worker_threads()
    assert _alive(refs) == []
    # The error (kept by the caller) still says where the step failed, as text.
    cause = raised.value.cause
    assert isinstance(cause, RuntimeError) and cause.__traceback__ is None
    assert "injected failure" in str(cause) and "in hook" in "".join(cause.__notes__)


_FIRST_MANAGER = """
import asyncio, gc, json, weakref
import aiocb
from aiocb import Manager
from tests.conftest import tiny_qwen3

frozen_at_import = gc.get_freeze_count()
model = tiny_qwen3()
seen = {id(o) for o in gc.get_objects()}
model_seen_before = id(model) in seen and id(model.lm_head) in seen
aiocb.Manager(model)  # (the first manager freezes the model; not itself)
seen = {id(o) for o in gc.get_objects()}
model_seen_after = id(model) in seen or id(model.lm_head) in seen
refs = {}
unfrozen = []

async def main():
    async with aiocb.Manager(model) as manager:
        await manager.generate([1, 2, 3, 4], max_new_tokens=3)
        rid = await manager.add_request([5, 6, 7], max_new_tokens=3)
        async for _ in manager.stream(rid):
            pass
        runner = manager._runner
        refs["runner"] = weakref.ref(runner)
        refs["key"] = weakref.ref(runner.cache.key[0])
        refs["value"] = weakref.ref(runner.cache.value[-1])
        refs["manager"] = weakref.ref(manager)
        # gc.get_objects() lists the objects the collector sees, not the frozen ones.
        seen = {id(o) for o in gc.get_objects()}
        unfrozen.extend(name for name, obj in (("manager", manager), ("runner", runner)) if id(obj) in seen)

asyncio.run(main())
alive = sorted(name for name, ref in refs.items() if ref() is not None)
gc.collect()
alive_after_collect = sorted(name for name, ref in refs.items() if ref() is not None)
report = {
    "frozen_at_import": frozen_at_import,
    "model_seen": [model_seen_before, model_seen_after],
    "frozen": gc.get_freeze_count(),
    "unfrozen": unfrozen,
    "alive": alive,
    "after_collect": alive_after_collect,
}
print(json.dumps(report))
"""


def test_the_first_manager_of_a_process_is_freed_too() -> None:
    # gc.freeze() is process-wide and happens once: only a fresh process sees the first
    # manager, the one the freeze could catch.
    run = subprocess.run(
        [sys.executable, "-c", _FIRST_MANAGER], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout.strip().splitlines()[-1])
    # Torch's and transformers' objects at the manager module's import (commonly before
    # any event loop runs), then the model at the first manager (a few milliseconds then).
    assert report["frozen_at_import"] > 100_000, "the libraries were frozen at import"
    assert report["model_seen"] == [True, False], "the model at the first manager"
    assert report["frozen"] > report["frozen_at_import"]
    assert report["unfrozen"] == ["manager", "runner"], "but not the manager or its runner"
    assert report["after_collect"] == []
    assert report["alive"] == [], "freed by reference counting, without a cyclic collection"
