"""The ``cpu`` backend's C decode attention equals attention over gathered keys, and the
backend is what a CPU float32 model runs on by default."""

from __future__ import annotations

import ctypes
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch
from transformers import PreTrainedModel

import aiocb
from aiocb.runner import native
from aiocb.runner.backends import Backend, select_backends
from tests.conftest import reference_generate
from tests.runner.test_native_draw import built_kernels

#: a cache the kernel takes
FLOAT32 = {"dtype": torch.float32, "head_dim": 64}


@pytest.fixture(scope="module")
def kernel() -> ctypes.CDLL:
    return built_kernels()


@pytest.fixture
def posix_threads(kernel: ctypes.CDLL) -> Iterator[None]:
    """The kernels on threads of their own instead of torch's OpenMP team."""
    kernel.aiocb_use_openmp(None, None, None)
    try:
        yield
    finally:
        kernel.aiocb_use_openmp(*native._openmp_entry_points())


def _cache(blocks: int, page: int, kv_heads: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (blocks * page, kv_heads, dim)
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


def _expected(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    table: torch.Tensor,
    table_rows: torch.Tensor | None,
    first: torch.Tensor,
    count: torch.Tensor,
    page: int,
    ring: int | None,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Row by row over gathered keys, in float64 (``sinks``: a logit per head in each softmax)."""
    rows, heads, _ = query.shape
    group = heads // key_cache.shape[1]
    out = []
    for r in range(rows):
        positions = torch.arange(int(first[r]), int(first[r] + count[r]))
        columns = positions // page if ring is None else positions // page % ring
        blocks = table[r if table_rows is None else int(table_rows[r])].long()[columns]
        slots = blocks * page + positions % page
        k = key_cache[slots].double().repeat_interleave(group, dim=1)  # [n, Hq, D]
        v = value_cache[slots].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", query[r].double(), k) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        out.append(torch.einsum("hn,nhd->hd", _softmax(scores, sinks), v))
    return torch.stack(out).float()


def _softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """``scores [H, n]``'s softmax, its denominators joined by each head's sink (as gpt-oss's)."""
    if sinks is None:
        return scores.softmax(-1)
    return torch.cat((scores, sinks.double()[:, None]), -1).softmax(-1)[:, :-1]


#: (softcap, whether the heads have sinks) of the scores the kernels take
SCORING = [(None, False), (5.0, False), (None, True)]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "page"),
    [
        (8, 4, 32, 16),  # grouped queries
        (4, 4, 16, 4),  # one query head per KV head
        (8, 1, 64, 16),  # one KV head for all
        (6, 2, 12, 8),  # a head narrower than two vectors, and no multiple of one
        (3, 3, 5, 4),
        (40, 8, 128, 16),  # more query floats than a unit holds: a row in two units
    ],
)
@pytest.mark.parametrize(("softcap", "with_sinks"), SCORING)
def test_decode_attention_equals_attention_over_gathered_keys(
    kernel: ctypes.CDLL, heads: int, kv_heads: int, dim: int, page: int, softcap: float | None, with_sinks: bool
) -> None:
    generator = torch.Generator().manual_seed(heads * dim)
    rows, blocks_per_row = 9, 40
    key_cache, value_cache = _cache(rows * blocks_per_row + 1, page, kv_heads, dim, seed=dim)
    table = torch.randperm(rows * blocks_per_row, generator=generator).view(rows, blocks_per_row).to(torch.int32)
    # one key, a partial tile, several tiles, a whole table's worth
    count = torch.tensor([1, 2, 7, 63, 64, 65, 150, 301, blocks_per_row * page]).clamp_max(blocks_per_row * page)
    first = torch.zeros(rows, dtype=torch.long)
    query = torch.randn(rows, heads, dim, generator=generator) * 2
    sinks = torch.randn(heads, generator=generator) * 3 if with_sinks else None
    cache = (key_cache, value_cache, table, None, first, count, page, None, dim**-0.5, softcap)
    out = native.decode_attention(kernel, query, *cache, sinks=sinks)
    torch.testing.assert_close(out, _expected(query, *cache, sinks), rtol=1e-5, atol=1e-5)


def test_rows_read_other_table_rows_and_a_sliding_windows_ring(kernel: ctypes.CDLL) -> None:
    """A step's single-token rows among its prompt rows (``table_rows``), each over the
    last ``window`` positions of a ring of blocks."""
    heads, kv_heads, dim, page, window = 4, 2, 16, 8, 20
    ring = math.ceil((window - 1) / page) + 1
    key_cache, value_cache = _cache(64, page, kv_heads, dim, seed=3)
    table = torch.randperm(64)[: 6 * ring].view(6, ring).to(torch.int32)
    table_rows = torch.tensor([5, 0, 3])
    positions = torch.tensor([100, 7, 45])  # each row's new token
    first = (positions - window + 1).clamp_min(0)
    count = positions - first + 1
    query = torch.randn(3, heads, dim)
    cache = (key_cache, value_cache, table, table_rows, first, count, page, ring, 0.3, None)
    out = native.decode_attention(kernel, query, *cache)
    torch.testing.assert_close(out, _expected(query, *cache), rtol=1e-5, atol=1e-5)
    sinks = torch.tensor([0.5, -2.0, 4.0, 1.0])  # (gpt-oss's sliding layers have them)
    out = native.decode_attention(kernel, query, *cache, sinks=sinks)
    torch.testing.assert_close(out, _expected(query, *cache, sinks), rtol=1e-5, atol=1e-5)


def test_large_scores_stay_finite_and_a_nan_row_spoils_only_itself(kernel: ctypes.CDLL) -> None:
    heads, kv_heads, dim, page = 4, 2, 32, 16
    key_cache, value_cache = _cache(16, page, kv_heads, dim, seed=5)
    table = torch.arange(16, dtype=torch.int32).view(4, 4)
    first, count = torch.zeros(4, dtype=torch.long), torch.tensor([64, 10, 33, 1])
    query = torch.randn(4, heads, dim) * 200  # scores in the thousands: e^score overflows float32
    query[1, 2, 3] = float("nan")
    cache = (key_cache, value_cache, table, None, first, count, page, None, 1.0, None)
    out = native.decode_attention(kernel, query, *cache)
    expected = _expected(query, *cache)
    assert out[1].isnan().any()
    rest = torch.tensor([0, 2, 3])
    assert out[rest].isfinite().all()
    torch.testing.assert_close(out[rest], expected[rest], rtol=1e-4, atol=1e-4)
    # sinks far above and below the scores: the weights of the values tend to 0 and to the softmax's
    sinks = torch.tensor([1e6, -1e6, 0.0, 1e6])
    out = native.decode_attention(kernel, query, *cache, sinks=sinks)
    assert out[rest].isfinite().all()
    torch.testing.assert_close(out[rest], _expected(query, *cache, sinks)[rest], rtol=1e-4, atol=1e-4)


def _assert_same_on_any_threads(kernel: ctypes.CDLL, attend: Callable[[], torch.Tensor]) -> None:
    """``attend()`` gives the same floats on threads of the kernel's own (the fixture
    ``posix_threads`` set them up), on torch's OpenMP team and on one thread."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        on_own_threads = attend()
        kernel.aiocb_use_openmp(*native._openmp_entry_points())
        on_the_team = attend()
        torch.set_num_threads(1)
        alone = attend()
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(on_own_threads, alone)
    assert torch.equal(on_the_team, alone)


def test_threads_split_the_rows_without_changing_a_bit(kernel: ctypes.CDLL, posix_threads: None) -> None:
    """Each row is computed whole by one thread: one thread, torch's team or threads of the
    kernel's own give the same floats."""
    heads, kv_heads, dim, page, rows = 8, 4, 32, 16, 64
    key_cache, value_cache = _cache(rows * 20, page, kv_heads, dim, seed=7)
    table = torch.randperm(rows * 20).view(rows, 20).to(torch.int32)
    first = torch.zeros(rows, dtype=torch.long)
    count = torch.randint(1, 20 * page, (rows,), generator=torch.Generator().manual_seed(8))
    query = torch.randn(rows, heads, dim)

    cache = (key_cache, value_cache, table, None, first, count, page, None, 0.2)

    def attend() -> torch.Tensor:
        return native.decode_attention(kernel, query, *cache)

    _assert_same_on_any_threads(kernel, attend)


def _expected_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    table: torch.Tensor,
    table_rows: torch.Tensor | None,
    token: torch.Tensor,
    start: torch.Tensor,
    length: torch.Tensor,
    page: int,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> dict[int, torch.Tensor]:
    """Each multi-token row's output tokens, query by query over gathered keys, in float64."""
    group = query.shape[1] // key_cache.shape[1]
    out = {}
    for r in range(len(length)):
        row = table[r if table_rows is None else int(table_rows[r])].long()
        for i in range(int(length[r])):
            positions = torch.arange(int(start[r]) + i + 1)
            slots = row[positions // page] * page + positions % page
            k = key_cache[slots].double().repeat_interleave(group, dim=1)
            v = value_cache[slots].double().repeat_interleave(group, dim=1)
            q = query[int(token[r]) + i].double()
            scores = torch.einsum("hd,nhd->hn", q, k) * scale
            if softcap:
                scores = torch.tanh(scores / softcap) * softcap
            out[int(token[r]) + i] = torch.einsum("hn,nhd->hd", _softmax(scores, sinks), v).float()
    return out


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "page"),
    [
        (8, 4, 32, 16),
        (4, 4, 16, 4),
        (8, 1, 64, 16),
        (6, 2, 12, 8),
        (3, 3, 5, 4),
        (40, 8, 128, 16),
        (80, 1, 8, 8),  # a KV head's group wider than a unit: split
    ],
)
@pytest.mark.parametrize(("softcap", "with_sinks"), SCORING)
def test_prefill_attention_equals_causal_attention_over_gathered_keys(
    kernel: ctypes.CDLL, heads: int, kv_heads: int, dim: int, page: int, softcap: float | None, with_sinks: bool
) -> None:
    """Prompt chunks and proposed tokens among a step's single-token rows: fresh prompts of
    every length around a tile of queries and of keys, chunks after cached keys, rows read
    through other rows of the table; tokens of other rows are left untouched."""
    generator = torch.Generator().manual_seed(heads + dim)
    blocks_per_row, rows = -(-160 // page), 7
    key_cache, value_cache = _cache(rows * blocks_per_row + 3, page, kv_heads, dim, seed=heads)
    table = torch.randperm(rows * blocks_per_row, generator=generator).view(rows, blocks_per_row).to(torch.int32)
    table_rows = torch.tensor([6, 0, 2, 5, 1])
    start = torch.tensor([0, 0, 0, 37, 150])
    length = torch.tensor([2, 31, 97, 20, 5])
    # a single-token row's token between every two multi-token rows
    token = torch.cumsum(torch.cat((torch.tensor([1]), length[:-1] + 1)), 0)
    tokens = int(token[-1] + length[-1] + 1)
    # (head-major, as the model hands queries over: the kernel reads the transposed view)
    query = (torch.randn(heads, tokens, dim, generator=generator) * 2).transpose(0, 1)
    out = torch.full(query.shape, 7.0)
    sinks = torch.randn(heads, generator=generator) * 3 if with_sinks else None
    cache = (key_cache, value_cache, table, table_rows, token, start, length, page, dim**-0.5, softcap)
    native.prefill_attention(kernel, query, *cache, out, sinks=sinks)
    expected = _expected_prefill(query, *cache, sinks)
    for index in range(tokens):
        if index in expected:
            torch.testing.assert_close(out[index], expected[index], rtol=1e-5, atol=1e-5)
        else:
            assert bool((out[index] == 7.0).all()), f"token {index} belongs to no multi-token row"


def test_prefill_threads_split_the_work_without_changing_a_bit(kernel: ctypes.CDLL, posix_threads: None) -> None:
    heads, kv_heads, dim, page = 8, 4, 32, 16
    key_cache, value_cache = _cache(200, page, kv_heads, dim, seed=11)
    table = torch.randperm(200).view(8, 25).to(torch.int32)
    length = torch.randint(2, 150, (8,), generator=torch.Generator().manual_seed(12))
    start = torch.randint(0, 200, (8,), generator=torch.Generator().manual_seed(13))
    token = torch.cumsum(length, 0) - length
    query = torch.randn(int(length.sum()), heads, dim)
    cache = (key_cache, value_cache, table, None, token, start, length, page, 0.2, None)

    def attend() -> torch.Tensor:
        out = torch.empty_like(query)
        native.prefill_attention(kernel, query, *cache, out)
        return out

    _assert_same_on_any_threads(kernel, attend)


def test_decode_attention_refuses_what_it_cannot_read(kernel: ctypes.CDLL) -> None:
    key_cache, value_cache = _cache(4, 16, 2, 8, seed=9)
    table = torch.zeros(1, 4, dtype=torch.int32)
    first, count = torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.long)
    rest = (table, None, first, count, 16, None, 1.0)
    with pytest.raises(ValueError, match="bfloat16 key cache"):
        native.decode_attention(kernel, torch.randn(1, 4, 8), key_cache.bfloat16(), value_cache, *rest)
    with pytest.raises(ValueError, match="3 heads of 8 over 2 KV heads"):
        native.decode_attention(kernel, torch.randn(1, 3, 8), key_cache, value_cache, *rest)
    one = torch.ones(1, dtype=torch.long)
    prefill = (table, None, first, first, one * 2, 16, 1.0, None)
    query = torch.randn(2, 4, 8)
    with pytest.raises(ValueError, match="float64 query"):
        native.prefill_attention(kernel, query.double(), key_cache, value_cache, *prefill, query.double())
    with pytest.raises(ValueError, match="contiguous output shaped as the query"):
        native.prefill_attention(kernel, query, key_cache, value_cache, *prefill, torch.empty(2, 4, 4))
    with pytest.raises(ValueError, match=r"one sink per query head \(4\), not \(2,\)"):
        native.prefill_attention(kernel, query, key_cache, value_cache, *prefill, query, sinks=torch.zeros(2))


async def test_a_cpu_float32_model_attends_with_the_kernel(
    kernel: ctypes.CDLL, qwen3: PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default on CPU: every decode step's single-token rows go through the kernel, and
    so do short prompt chunks (whole prompts, and a prompt's last chunk after its cached
    keys), while a longer chunk is attended by SDPA; the tokens are ``generate``'s."""
    assert select_backends(torch.device("cpu"), aiocb.ContinuousBatchingConfig(), [None, 64], 16, **FLOAT32) == [
        Backend.CPU,
        Backend.CPU,
    ]
    calls = {"decode": 0, "prefill": 0}
    prefill_rows: list[tuple[int, int]] = []  # (start, length) of the rows the kernel took
    decode, prefill = native.decode_attention, native.prefill_attention

    def counting_decode(*args: object, **kwargs: object) -> torch.Tensor:
        calls["decode"] += 1
        return decode(*args, **kwargs)  # type: ignore[arg-type]

    def counting_prefill(*args: object, **kwargs: object) -> None:
        calls["prefill"] += 1
        start, length = args[7], args[8]
        assert isinstance(start, torch.Tensor) and isinstance(length, torch.Tensor)
        prefill_rows.extend(zip(start.tolist(), length.tolist(), strict=True))
        prefill(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(native, "decode_attention", counting_decode)
    monkeypatch.setattr(native, "prefill_attention", counting_prefill)
    prompts = [[5, 9, 11, 3], [7] * 30, list(range(1, 60))]
    # 70 tokens a step, in order: the 4- and 30-token prompts whole, 36 tokens of the
    # 59-token one (SDPA's), whose other 23 come in the next step, after its cached keys
    # (queued before the start: the first step sees all three, whenever the runner is ready)
    config = aiocb.ContinuousBatchingConfig(page_size=16, max_batch_tokens=70)
    manager = aiocb.Manager(qwen3, continuous_batching_config=config)
    ids = [manager.add_request_nowait(prompt, max_new_tokens=12) for prompt in prompts]
    async with manager:
        outputs = [await manager.get_result(request_id) for request_id in ids]
    assert [o.generated_tokens for o in outputs if o] == [reference_generate(qwen3, p, 12) for p in prompts]
    assert calls["decode"] >= 11 * qwen3.config.num_hidden_layers
    assert calls["prefill"] >= qwen3.config.num_hidden_layers
    assert {(0, 4), (0, 30), (36, 23)} == set(prefill_rows)  # (the 36 tokens went to SDPA)


def test_without_the_kernels_cpu_models_use_the_reference_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "_tried", True)
    monkeypatch.setattr(native, "_library", None)
    assert select_backends(torch.device("cpu"), aiocb.ContinuousBatchingConfig(), [None], 16, **FLOAT32) == [
        Backend.REFERENCE
    ]


@pytest.fixture
def unloaded(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The kernels as in a new process (not loaded yet), their build noted: the names of
    the threads that built them."""
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_library", None)
    return []


async def test_a_start_leaves_the_kernels_build_to_the_step_thread(
    kernel: ctypes.CDLL, qwen3: PreTrainedModel, unloaded: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first build on a machine runs the C compiler for a second or more: a manager's
    runner picks the cpu backend without waiting for it, and the step thread's warm-up
    builds the kernels (here a pause, then the cached library) before the first step."""

    def slow_build() -> ctypes.CDLL:
        unloaded.append(threading.current_thread().name)
        time.sleep(0.5)
        return kernel

    monkeypatch.setattr(native, "_build", slow_build)
    prompt = [5, 9, 11, 3, 8]
    manager = aiocb.Manager(qwen3)
    began = time.perf_counter()
    manager.start()
    assert time.perf_counter() - began < 0.25, "start() waited for the build"
    try:
        await manager.wait_started()
        assert manager._runner is not None and manager._runner.backends == [Backend.CPU]
        output = await manager.generate(prompt, max_new_tokens=8)
    finally:
        await manager.stop()
    assert output.generated_tokens == reference_generate(qwen3, prompt, 8)
    assert len(unloaded) == 1 and unloaded[0].startswith("aiocb-step")


async def test_kernels_that_do_not_build_leave_their_groups_to_the_reference_backend(
    qwen3: PreTrainedModel, unloaded: list[str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def failing_build() -> ctypes.CDLL:
        unloaded.append(threading.current_thread().name)
        raise RuntimeError("no C compiler 'cc' on PATH")

    monkeypatch.setattr(native, "_build", failing_build)
    prompt = [5, 9, 11, 3, 8]
    with caplog.at_level(logging.WARNING, logger="aiocb.runner.native"):
        async with aiocb.Manager(qwen3) as manager:
            output = await manager.generate(prompt, max_new_tokens=8)
            assert manager._runner is not None and manager._runner.backends == [Backend.REFERENCE]
    assert output.generated_tokens == reference_generate(qwen3, prompt, 8)
    assert "no C compiler 'cc' on PATH" in caplog.text
    assert len(unloaded) == 1 and unloaded[0].startswith("aiocb-step")


def test_the_openmp_runtime_is_torchs_own_or_none(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels join torch's OpenMP team when torch runs on OpenMP, and start threads of
    their own otherwise (another parallel backend, or no /proc to find the runtime in)."""
    if "parallel backend: OpenMP" in torch.__config__.parallel_info():
        assert all(native._openmp_entry_points())
    monkeypatch.setattr(torch.__config__, "parallel_info", lambda: "ATen parallel backend: native thread pool")
    assert native._openmp_entry_points() == (None, None, None)
