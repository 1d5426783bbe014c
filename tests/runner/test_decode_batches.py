"""How single-token rows are split into attention batches on CPU, and the gather buffers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from aiocb.runner.inputs import _decode_chunk_slots, _decode_chunks
from aiocb.runner.memory import CachePlan
from aiocb.runner.model_spec import model_spec
from aiocb.runner.paged_cache import PagedKVCache
from tests.conftest import tiny_qwen3
from tests.fuzzing import fuzz_settings


def test_a_gpu_s_batches_are_bounded_too() -> None:
    """Their gathered keys are memory the cache plan does not reserve: a sliding window of
    4,096 over 1,024 rows of a Mistral-7B layer (8 KV heads of 128 in bf16) would gather
    16 GiB in one batch."""
    layer = SimpleNamespace(device=torch.device("cuda"), slot_nbytes=8 * 128 * 2)
    slots = _decode_chunk_slots(layer)  # type: ignore[arg-type]
    assert 2 * slots * layer.slot_nbytes == 256 << 20
    chunks = _decode_chunks(torch.full((1024,), 4096), slots)
    assert len(chunks) == 64 and all(chunk is not None and len(chunk) == 16 for chunk in chunks)


def test_one_batch_in_order_when_every_row_fits() -> None:
    assert _decode_chunks(torch.tensor([5, 1, 3]), 15) == [None]


def test_rows_by_increasing_length_as_many_as_fit() -> None:
    chunks = _decode_chunks(torch.tensor([50, 10, 30, 20, 40]), 60)
    # 10, 20 pad to 20 each (40); 30 would make 3 x 30 = 90. 30, 40 -> 80 > 60: alone.
    assert [c.tolist() for c in chunks if c is not None] == [[1, 3], [2], [4], [0]]


@fuzz_settings(100)
@given(lengths=st.lists(st.integers(1, 400), min_size=1, max_size=80), max_slots=st.integers(1, 3000))
def test_batches_cover_every_row_once_within_the_budget(lengths: list[int], max_slots: int) -> None:
    chunks = _decode_chunks(torch.tensor(lengths), max_slots)
    if chunks == [None]:  # every row in one batch: they fit, or there is one
        assert len(lengths) == 1 or len(lengths) * max(lengths) <= max_slots
        return
    rows = [r for c in chunks if c is not None for r in c.tolist()]
    assert sorted(rows) == list(range(len(lengths)))
    assert [lengths[r] for r in rows] == sorted(lengths)
    for chunk in chunks:
        assert chunk is not None
        members = chunk.tolist()
        # a row alone may exceed the budget (it must be attended all the same)
        assert len(members) == 1 or len(members) * max(lengths[r] for r in members) <= max_slots


@pytest.fixture
def cache() -> PagedKVCache:
    spec = model_spec(tiny_qwen3())
    plan = CachePlan(
        page_size=4, num_blocks=[8], max_batch_tokens=256, max_requests_per_batch=4, budget_bytes=0, num_host_blocks=[0]
    )
    return PagedKVCache(spec, plan)


def test_gather_reads_the_slots_into_reused_buffers(cache: PagedKVCache) -> None:
    for layer in range(len(cache.key)):
        cache.key[layer].normal_()
        cache.value[layer].normal_()
    slots = torch.tensor([3, 17, 0, 31, 17])
    keys, values = cache.gather(1, slots)
    flat_k, flat_v = cache.flat(1)
    assert torch.equal(keys, flat_k[slots]) and torch.equal(values, flat_v[slots])
    again_k, _ = cache.gather(0, slots[:2])
    assert again_k.data_ptr() == keys.data_ptr(), "the second gather reuses the first one's buffer"
    assert torch.equal(again_k, cache.flat(0)[0][slots[:2]])
    longer = torch.arange(20)
    grown_k, grown_v = cache.gather(0, longer)
    assert torch.equal(grown_k, cache.flat(0)[0][:20]) and torch.equal(grown_v, cache.flat(0)[1][:20])
