"""Clear errors at start, in one process: a TP size that does not divide the KV heads,
``device_map`` with tensor parallelism, meshes aiocb cannot run, misplaced calls."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from transformers import GPT2Config, PreTrainedModel

import aiocb
import aiocb.distributed
from aiocb.runner import memory, tp_channel, tp_driver
from aiocb.runner.memory import CachePlan
from aiocb.runner.model_runner import runner_plan
from aiocb.runner.tp_channel import _minimum_plan
from aiocb.runner.tp_follower import _Follower
from aiocb.runner.tp_layout import shard_heads
from tests.conftest import tiny_llama


class _FakeMesh:
    """Just enough of a DeviceMesh for the checks that run before any process group is used."""

    def __init__(self, sizes: dict[str, int]) -> None:
        self._sizes = sizes
        self.mesh_dim_names = tuple(sizes)

    def size(self) -> int:
        total = 1
        for size in self._sizes.values():
            total *= size
        return total

    def __getitem__(self, name: str) -> _FakeMesh:
        return _FakeMesh({name: self._sizes[name]})


def _as_if_sharded(model: PreTrainedModel, **sizes: int) -> PreTrainedModel:
    model._device_mesh = _FakeMesh(sizes)
    model._tp_size = sizes.get("tp", 1)
    return model


def test_a_tp_size_that_does_not_divide_the_kv_heads_fails_before_loading(llama_dir: Path) -> None:
    with pytest.raises(aiocb.InvalidConfigError, match=r"tp_size=4 does not divide .*num_key_value_heads=2"):
        aiocb.distributed.load_model(llama_dir, tp_size=4)
    with pytest.raises(aiocb.InvalidConfigError, match=r"tp_size=3 .*num_key_value_heads=2.*\[1, 2\]"):
        aiocb.distributed.validate_tp(llama_dir, 3)
    assert not dist.is_initialized(), "the check runs before transformers sets up torch.distributed"


def test_a_model_transformers_cannot_shard_fails_before_loading(tmp_path: Path) -> None:
    """GPT-2 has no tensor-parallel plan: validate_tp passed it, then transformers refused
    it with a plain ValueError once loading began."""
    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(aiocb.InvalidConfigError, match="no tensor-parallel plan for GPT2Config"):
        aiocb.distributed.validate_tp(tmp_path, 2)
    aiocb.distributed.validate_tp(tmp_path, 1)  # (one process needs no plan)


def test_device_map_with_tensor_parallelism_is_an_error(llama_dir: Path) -> None:
    with pytest.raises(aiocb.InvalidConfigError, match=r"device_map='cpu' and tensor parallelism \(tp_size=2\)"):
        aiocb.distributed.load_model(llama_dir, tp_size=2, device_map="cpu")
    assert not dist.is_initialized()


def test_bad_tp_sizes_and_arguments(llama_dir: Path) -> None:
    aiocb.distributed.validate_tp(llama_dir, 2)
    aiocb.distributed.validate_tp(llama_dir, 1, device_map="cpu")
    for bad in (0, -2, 1.5, True):
        with pytest.raises(aiocb.InvalidConfigError, match="tp_size must be an int"):
            aiocb.distributed.validate_tp(llama_dir, bad)  # type: ignore[arg-type]
    with pytest.raises(aiocb.InvalidConfigError, match="distributed config"):
        aiocb.distributed.load_model(llama_dir, tp_size=2, tp_plan="auto")


def test_tp_size_1_loads_an_ordinary_model(llama_dir: Path) -> None:
    model = aiocb.distributed.load_model(llama_dir, tp_size=1)
    assert aiocb.distributed.tensor_parallel_layout(model) is None
    assert aiocb.distributed.is_driver(model)
    aiocb.distributed.shutdown()  # nothing to release


async def test_a_manager_checks_an_already_sharded_model_at_start() -> None:
    model = _as_if_sharded(tiny_llama(), pp=1, fsdp=1, tp=4)
    manager = aiocb.Manager(model)
    with pytest.raises(aiocb.InvalidConfigError, match=r"tp_size=4 does not divide .*num_key_value_heads=2"):
        manager.start()
    assert not manager.is_running


async def test_fsdp_and_pipeline_meshes_are_refused() -> None:
    for sizes in ({"fsdp": 2, "tp": 2}, {"pp": 2, "tp": 1}):
        model = _as_if_sharded(tiny_llama(), **sizes)
        with pytest.raises(aiocb.InvalidConfigError, match="tensor parallelism only"):
            aiocb.Manager(model).start()


async def test_a_device_map_over_several_devices_next_to_tp_is_refused() -> None:
    model = _as_if_sharded(tiny_llama(), tp=2)
    model.hf_device_map = {"model": "cpu", "lm_head": "disk"}
    with pytest.raises(aiocb.InvalidConfigError, match=r"device_map .* mutually exclusive"):
        aiocb.Manager(model).start()


def test_a_cpu_group_timeout_beyond_a_year_is_refused() -> None:
    """Waits of ~1e10 s overflow the driver's lock and queue timeouts: None waits forever."""
    aiocb.ContinuousBatchingConfig(cpu_group_timeout=365 * 24 * 3600)
    for too_long in (365 * 24 * 3600 + 1, 1e10):
        with pytest.raises(aiocb.InvalidConfigError, match=r"cpu_group_timeout must be at most 31536000 s"):
            aiocb.ContinuousBatchingConfig(cpu_group_timeout=too_long)


def test_run_follower_needs_a_sharded_model(llama_model: PreTrainedModel) -> None:
    with pytest.raises(aiocb.InvalidRequestError, match="tensor parallelism"):
        aiocb.distributed.run_follower(llama_model)


@pytest.mark.parametrize(
    ("plan", "expected"),
    [
        ({"model.layers.*.self_attn.k_proj": "colwise", "model.layers.*.self_attn.v_proj": "colwise"}, (2, 2, 1)),
        ({"model.layers.*.self_attn.qkv_proj": "colwise_gather_output"}, (2, 4, 2)),  # Phi-3 gathers q, k, v
        ({"model.layers.*.mlp.up_proj": "colwise"}, (2, 4, 2)),  # attention not in the plan: replicated
    ],
)
def test_the_cache_holds_this_rank_s_share_of_the_kv_heads(
    plan: dict[str, str], expected: tuple[int, int, int]
) -> None:
    model = _as_if_sharded(tiny_llama(), tp=2)
    model._tp_plan = plan
    assert shard_heads(model, 4, 2) == expected


def test_sharded_plans_agree_on_the_smallest_sizes() -> None:
    plans = [
        CachePlan(16, [100, 40], 4096, 256, 10_000, [0, 0]),
        CachePlan(16, [90, 50], 8192, 128, 9_000, [5, 0]),
    ]
    assert _minimum_plan(plans) == CachePlan(16, [90, 40], 4096, 128, 9_000, [0, 0])


@pytest.mark.multiprocess
def test_generate_batch_s_argument_fingerprint_is_the_same_in_every_process() -> None:
    """Sets of strings iterate in another order under another hash seed, and an object's
    default repr names its address: the digest must not change with either."""
    code = (
        "import aiocb, numpy; from aiocb.batch import _fingerprint; "
        "print(_fingerprint([[1, 2], 'text', numpy.arange(2000)], None, aiocb.ContinuousBatchingConfig(), False, 4, "
        "aiocb.SamplingParams(stop={'alpha', 'beta', 'gamma', 'delta'}), None, {'stop': {'x', 'y', 'z'}, 'seed': 1}, "
        "object()))"
    )
    # (the three interpreters start together: importing torch and transformers is most of it)
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed}, stdout=subprocess.PIPE, text=True
        )
        for seed in ("1", "2", "3")
    ]
    digests = {run.communicate(timeout=300)[0].strip() for run in runs}
    assert len(digests) == 1 and len(next(iter(digests))) == 64, digests


def test_generate_batch_s_argument_fingerprint_tells_long_arrays_apart() -> None:
    """A NumPy array of more than 1,000 items prints with its middle left out: arrays are
    told apart by their bytes, as tensors are."""
    import numpy as np

    from aiocb.batch import _fingerprint

    one, other = np.arange(2000), np.arange(2000)
    other[1000] = -1
    assert repr(one) == repr(other)
    assert _fingerprint([one]) != _fingerprint([other])
    assert _fingerprint([one]) == _fingerprint([np.arange(2000)])
    assert _fingerprint([one]) != _fingerprint([one.astype(np.int32)])


_THAW = """
import gc, json, os, socket
import torch.distributed as dist
import aiocb.distributed
from aiocb import Manager  # (its import freezes torch's and transformers' objects)

frozen = gc.get_freeze_count()
aiocb.distributed.shutdown()  # (no process group: nothing to thaw)
without_group = gc.get_freeze_count()
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
aiocb.distributed.shutdown()
print(json.dumps([frozen, without_group, gc.get_freeze_count()]))
dist.destroy_process_group()
"""


@pytest.mark.multiprocess
def test_shutdown_puts_what_aiocb_froze_back_in_the_collectors_view() -> None:
    """Frozen cycles keep what they refer to of torch.distributed alive past
    destroy_process_group(), to be torn down at exit: shutdown() thaws and collects them
    in a process group (and leaves the freeze alone without one)."""
    run = subprocess.run([sys.executable, "-c", _THAW], capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    frozen, without_group, after = json.loads(run.stdout.strip().splitlines()[-1])
    assert frozen > 100_000 and without_group == frozen and after == 0


def test_every_rank_plans_room_for_the_rows_of_verified_proposals(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's plan (the one it offers the others) and a follower's, from the "init" message
    rank 0 sends, both count the rows a step verifying proposals samples, as one process's
    plan does: a cache that leaves no room for those logits would fail its first wide step."""
    monkeypatch.setattr(memory, "host_memory_bytes", lambda: 2**30)  # (the same free memory for every plan)
    model = tiny_llama()
    config = aiocb.ContinuousBatchingConfig(page_size=16, max_requests_per_batch=256)
    lookup = aiocb.SpeculativeConfig(method="ngram", num_speculative_tokens=8)
    one_process = runner_plan(model, config, speculative=lookup)[1]
    assert one_process != runner_plan(model, config)[1], "(the verified rows take room: the check means something)"

    offered: list[CachePlan | str] = []
    monkeypatch.setattr(tp_driver, "driver_layout", lambda model, draft=None: object())
    monkeypatch.setattr(tp_driver, "DriverRunner", lambda *args, speculative, **kwargs: offered.append(
        tp_channel.own_plan(model, config, kwargs["num_requests_hint"], speculative)
    ))  # fmt: skip
    tp_driver.build_runner(model, config, num_requests_hint=None, speculative=lookup)
    channel = SimpleNamespace(
        layout=None,
        set_timeout=lambda timeout: None,
        agree_on_plan=offered.append,
        gather=lambda answer: [answer],
        ranks_on_host=1,
    )
    follower = _Follower(model, channel)  # type: ignore[arg-type]
    follower._on_init(config, None, lookup, False, None)
    assert offered == [one_process, one_process]


def test_a_follower_keeps_the_ids_of_its_last_thousand_cancellations_only() -> None:
    """A long-running server's cancellations are countless: a follower counts them all and
    keeps the last ids (it kept every one, for as long as it ran)."""
    from aiocb.runner.tp_follower import KEPT_CANCELLATIONS, _Counters

    counters = _Counters()
    counters.record([("cancel", f"r{i}", "cancelled") for i in range(KEPT_CANCELLATIONS + 500)])
    report = counters.report()
    assert report.cancellations == KEPT_CANCELLATIONS + 500
    assert len(report.cancelled) == KEPT_CANCELLATIONS
    assert report.cancelled[-1] == (f"r{KEPT_CANCELLATIONS + 499}", "cancelled")


def test_the_processes_sharing_a_host_count_other_groups_on_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two tensor-parallel groups of two on one node (torchrun's LOCAL_WORLD_SIZE 4): each
    rank plans with a quarter of the host's memory, not half."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert tp_channel.ranks_sharing_host(["a", "a", "b"], "a") == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert tp_channel.ranks_sharing_host(["a", "a"], "a") == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "bogus")
    assert tp_channel.ranks_sharing_host(["a", "b"], "b") == 1
