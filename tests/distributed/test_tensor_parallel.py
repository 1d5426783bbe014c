"""Two ranks on CPU (gloo), a tiny Llama sharded over both: rank 0 drives an aiocb.Manager.

Each test launches two Python processes that import torch and transformers (~5-10 s).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from transformers import PreTrainedModel

from tests.conftest import reference_generate
from tests.distributed._ranks import MAX_NEW_TOKENS, PROMPTS
from tests.distributed.launch import Ranks, launch, logs_of

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(
        not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"
    ),
]


def _both_ran(scenario: str, llama_dir: Path, tmp_path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The reports of both ranks of ``scenario``, each rank having exited 0."""
    ranks = launch(scenario, llama_dir, tmp_path)
    assert ranks.driver is not None and ranks.follower is not None, logs_of(tmp_path)
    assert ranks.exit_codes == [0, 0], logs_of(tmp_path)
    return ranks.driver, ranks.follower


def test_two_ranks_match_one_process_and_follow_every_control(
    llama_model: PreTrainedModel, llama_dir: Path, tmp_path: Path
) -> None:
    ranks = launch("main", llama_dir, tmp_path)
    driver, follower = ranks.driver, ranks.follower
    assert driver is not None, logs_of(tmp_path)
    assert follower is not None, logs_of(tmp_path)
    assert ranks.exit_codes == [0, 0], logs_of(tmp_path)
    expected = [reference_generate(llama_model, p, MAX_NEW_TOKENS) for p in PROMPTS]

    assert driver["before_start"].startswith("ManagerClosedError: the manager is not started: under tensor parallelism")
    assert driver["kv_heads_per_shard"] == 1, "2 KV heads over 2 ranks: the cache holds one per rank"
    assert driver["ranks_on_host"] == [2], "both ranks on this machine share its host memory"
    assert driver["greedy"] == expected
    assert driver["after_idle"] == expected
    assert driver["finished_during_stop"] == expected[1], "a graceful stop finishes what runs"
    assert driver["after_restart"] == expected
    assert driver["async_batching"] == expected
    assert driver["prompt_lookup"] == expected and driver["draft_tokens"] > 0, driver["draft_tokens"]
    assert driver["persistent"] == [expected] * 3
    assert driver["cancel_returned"] is True
    assert driver["hard_stop_error"] == "RequestAbortedError"

    assert follower["error"] is None, logs_of(tmp_path)
    assert follower["manager_here"].startswith("InvalidRequestError: this process is tensor-parallel rank 1")
    report = follower["report"]
    assert report["steps"] == driver["steps"], "every step rank 0 ran reached the follower"
    assert [driver["cancelled_id"], "cancelled"] in report["cancelled"]
    assert driver["timed_out_reason"] == "timeout"
    assert [driver["timed_out_id"], "timeout"] in report["cancelled"]
    assert report["cancellations"] == len(report["cancelled"])
    assert any(reason == "aborted" for _, reason in report["cancelled"]), "the hard stop's abort"
    assert report["stops"] == 6, "stop() and five `async with` exits"
    assert report["hard_stops"] == 1
    assert report["inits"] == 7, "a cache per non-persistent session, the persistent one's twice"
    assert report["sessions"] == 7
    assert report["heartbeats"] >= 1, "idle for longer than cpu_group_timeout, kept alive by heartbeats"
    assert report["plan"]["num_blocks"] == [128]


def test_generate_batch_on_every_rank_runs_once_and_returns_rank_0_s_outputs_everywhere(
    llama_model: PreTrainedModel, llama_dir: Path, tmp_path: Path
) -> None:
    driver, follower = _both_ran("generate_batch", llama_dir, tmp_path)
    expected = [reference_generate(llama_model, p, MAX_NEW_TOKENS) for p in PROMPTS]

    assert driver["first"] == {"ids": ["req_0", "req_1", "req_2"], "tokens": expected}
    assert follower["first"] == driver["first"], "the follower returns rank 0's outputs"
    assert driver["refused"]["error"].startswith("InvalidRequestError")
    assert "temperature" in driver["refused"]["error"]
    assert follower["refused"] == driver["refused"], "rank 0's exception is raised on every rank"
    assert driver["diverged"]["tokens"] == expected, "rank 0 runs its own arguments"
    assert follower["diverged"]["error"].startswith("InvalidRequestError: generate_batch() on tensor-parallel rank 1")
    assert driver["refused_here"]["tokens"] == expected
    assert follower["refused_here"]["error"].startswith("InvalidRequestError: generate_batch() on tensor-parallel rank")
    assert all(t % 2 == 0 for tokens in driver["generator"]["tokens"] for t in tokens), driver["generator"]
    assert follower["generator"] == driver["generator"], "the same arguments: no divergence seen"
    assert driver["persistent"]["tokens"] == driver["persistent_again"]["tokens"] == expected
    assert follower["persistent_again"] == driver["persistent_again"]
    assert driver["empty"] == follower["empty"] == {"ids": [], "tokens": []}
    assert driver["again"]["tokens"] == expected[1:]
    assert follower["again"] == driver["again"], "the ranks are still in step after a refusal and a divergence"
    rank0_log = (tmp_path / "rank0.log").read_text()
    assert "could not release" not in rank0_log, "rank 0 sent nothing after the last return: the followers left"


def test_generate_batch_on_rank_0_alone_leaves_run_follower_following(
    llama_model: PreTrainedModel, llama_dir: Path, tmp_path: Path
) -> None:
    ranks = launch("generate_batch_alone", llama_dir, tmp_path)
    driver, follower = ranks.driver, ranks.follower
    assert driver is not None and follower is not None, logs_of(tmp_path)
    assert follower["error"] is None, logs_of(tmp_path)
    assert ranks.exit_codes == [0, 0], logs_of(tmp_path)
    expected = [reference_generate(llama_model, p, MAX_NEW_TOKENS) for p in PROMPTS]
    assert driver["generate_batch"] == driver["after"] == expected
    assert follower["report"]["heartbeats"] >= 1, "idle for longer than cpu_group_timeout, kept alive by heartbeats"
    assert follower["report"]["sessions"] == 2
    assert "could not release" not in (tmp_path / "rank0.log").read_text(), "shutdown() released the follower"


def test_shutdown_releases_the_followers_when_no_manager_ran(llama_dir: Path, tmp_path: Path) -> None:
    """Rank 0's shutdown() released only the followers of a live driver: without a manager,
    run_follower() waited out cpu_group_timeout for the channel, then raised a store error."""
    _, follower = _both_ran("no_manager", llama_dir, tmp_path)
    assert follower["error"] is None, follower
    assert follower["report"]["sessions"] == 0


def test_one_manager_at_a_time_runs_on_the_ranks(llama_model: PreTrainedModel, llama_dir: Path, tmp_path: Path) -> None:
    driver, follower = _both_ran("two_managers", llama_dir, tmp_path)
    expected = [reference_generate(llama_model, p, MAX_NEW_TOKENS) for p in PROMPTS]

    for refused in ("second", "kept_again"):  # a new manager, and a persistent one between sessions
        assert driver[refused].startswith("InvalidRequestError: "), driver[refused]
        assert "one manager at a time" in driver[refused], driver[refused]
    assert driver["queued_on_refused"].startswith("InvalidRequestError: "), "a request made during the refused start"
    assert "one manager at a time" in driver["queued_on_refused"]
    assert driver["refused_running"] is False
    assert driver["first"] == expected, "the running manager's steps ran on its own cache everywhere"
    assert driver["kept"] == driver["kept_after"] == driver["after"] == expected
    assert follower["error"] is None, logs_of(tmp_path)


def test_start_leaves_the_event_loop_free_while_it_reaches_a_late_follower(
    llama_model: PreTrainedModel, llama_dir: Path, tmp_path: Path
) -> None:
    driver, follower = _both_ran("late_follower", llama_dir, tmp_path)
    assert follower["error"] is None, logs_of(tmp_path)
    # (the follower comes 2 s late; the bounds leave room for a busy machine)
    assert driver["start_s"] < 0.5, "start() waited for the follower on the event loop"
    assert driver["longest_stall_s"] < 0.5, "the event loop was held while the ranks agreed on a cache"
    expected = [reference_generate(llama_model, p, MAX_NEW_TOKENS) for p in PROMPTS]
    assert driver["greedy"] == driver["restarted"] == driver["again"] == expected
    assert driver["stopped_while_starting"] is True
    assert driver["abandoned_running"] is False, "and the next manager ran: the ranks were left free"


def test_a_runner_that_fails_to_build_on_any_rank_fails_the_start_at_once(
    llama_model: PreTrainedModel, llama_dir: Path, tmp_path: Path
) -> None:
    """Rank 0's own build failing leaves the ranks free for the next manager (its half-built
    runner held them); a follower's failing is told to rank 0, which fails the start with
    its reason at once, and the ranks go on in step."""
    driver, follower = _both_ran("failed_builds", llama_dir, tmp_path)
    first, second = driver["rank0_failed"], driver["follower_failed"]
    assert first["type"] == "RuntimeError" and first["message"] == "rank 0's cache build 1 failed", first
    assert second["type"] == "DistributedError", second
    assert second["message"] == (
        "tensor-parallel rank 1 could not build its runner: RuntimeError: rank 1's cache build 2 failed"
    ), second
    assert second["seconds"] < 1.9, "before cpu_group_timeout (2 s)"
    expected = [reference_generate(llama_model, p, MAX_NEW_TOKENS) for p in PROMPTS]
    assert driver["slow_build"] == driver["after"] == expected
    assert follower["error"] is None, logs_of(tmp_path)
    assert follower["report"]["inits"] == 3, "rank 0's first manager's, and the last two"
    assert follower["report"]["sessions"] == 2


@pytest.fixture(scope="module")
def released(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Ranks, Path]:
    """Managers destroyed on rank 0, with the follower's runners watched (one launch for the tests below)."""
    out = tmp_path_factory.mktemp("release")
    return launch("release", llama_dir, out), out


def test_rank_0_frees_a_destroyed_manager_s_cache_while_idle(released: tuple[Ranks, Path]) -> None:
    ranks, out = released
    assert ranks.driver is not None and ranks.exit_codes == [0, 0], logs_of(out)
    assert ranks.driver["plain_alive"] == 0, "the driver thread, idle, still held the last session's runner"


def test_destroying_a_persistent_manager_frees_its_cache_on_every_rank(released: tuple[Ranks, Path]) -> None:
    ranks, out = released
    driver, follower = ranks.driver, ranks.follower
    assert driver is not None and follower is not None and ranks.exit_codes == [0, 0], logs_of(out)
    assert driver["persistent_alive"] == 0, "rank 0's driver still referred to the destroyed manager's runner"
    freed = follower["runners_freed_at"]
    assert len(freed) == 2, "the plain manager's runner and the persistent one's"
    assert max(freed) < driver["destroyed_at"], "the follower kept the cache until shutdown()"


def test_shutdown_while_a_manager_runs_fails_its_requests_naming_it(llama_dir: Path, tmp_path: Path) -> None:
    ranks = launch("shutdown_mid_session", llama_dir, tmp_path)
    driver, follower = ranks.driver, ranks.follower
    assert driver is not None and follower is not None, logs_of(tmp_path)
    assert follower["error"] is None, "the follower was released"
    error = driver["error"]
    assert error["type"] == "EngineDeadError" and error["cause_type"] == "DistributedError", error
    assert "shutdown() released the follower ranks" in error["cause_message"], error


def test_a_killed_follower_fails_rank_0_with_a_clear_error(llama_dir: Path, tmp_path: Path) -> None:
    ranks = launch("kill_follower", llama_dir, tmp_path)
    driver = ranks.driver
    assert driver is not None, logs_of(tmp_path)
    assert ranks.exit_codes[0] == 0, logs_of(tmp_path)
    assert driver["seconds_to_fail"] < 10.0 + 5.0, "within cpu_group_timeout (10 s), with slack"
    for error in driver["errors"]:
        assert error["type"] == "EngineDeadError", error
        assert error["cause_type"] == "DistributedError", error
        assert "rank 1 stopped responding" in error["cause_message"], error
    assert driver["after_death"] == "EngineDeadError"


def test_a_hung_follower_fails_rank_0_within_the_timeout(
    llama_model: PreTrainedModel, llama_dir: Path, tmp_path: Path
) -> None:
    driver = launch("hang_follower", llama_dir, tmp_path).driver
    assert driver is not None, logs_of(tmp_path)
    # Before: the follower stopped for 1.5 s while a session ended, and while a persistent
    # manager was destroyed (each a message to it; the destroy waits until it freed its cache).
    assert driver["stop_s"] < 0.5 and driver["stop_stall_s"] < 0.5, "stop() waited for the follower on the loop"
    assert driver["destroy_stall_s"] < 0.5, "destroy() waited for the follower on the event loop"
    assert driver["destroy_s"] > 1.0, "destroy() returned before the follower had freed its cache"
    assert driver["kept"] == [reference_generate(llama_model, p, MAX_NEW_TOKENS) for p in PROMPTS]
    assert driver["seconds_to_fail"] < 4.0 + 4.0, "within cpu_group_timeout (4 s), with slack"
    [error] = driver["errors"]
    assert error["type"] == "EngineDeadError", error
    assert error["cause_type"] == "DistributedError", error
    assert "rank 1 stopped responding" in error["cause_message"], error
    assert "cpu_group_timeout=4.0" in error["cause_message"], error


@pytest.mark.slow  # (17 s of the default session, waiting out a group timeout)
def test_a_follower_left_in_the_models_collective_fails_within_the_groups_timeout(
    llama_dir: Path, tmp_path: Path
) -> None:
    """Rank 0's forward pass failed midway and rank 0 lives on: the follower, inside the
    model's all-reduce, fails within the process group's timeout (4 s), as the README
    advises setting it, and long before rank 0 exits."""
    ranks = launch("driver_forward_fails", llama_dir, tmp_path)
    driver, follower = ranks.driver, ranks.follower
    assert driver is not None and follower is not None, logs_of(tmp_path)
    [error] = driver["errors"]
    assert error["type"] == "EngineDeadError" and "rank 0's forward failed" in error["cause_message"], error
    assert follower["error"]["type"] == "DistributedError", follower
    assert follower["ended_at"] - driver["failed_at"] < 4.0 + 4.0, "within the group's timeout, with slack"
    assert follower["ended_at"] < driver["exiting_at"]


@pytest.mark.slow  # (12 s of the default session, waiting out a release)
def test_a_manager_after_shutdown_names_the_release_when_the_follower_does_not_follow_again(
    llama_dir: Path, tmp_path: Path
) -> None:
    driver, follower = _both_ran("restart_after_shutdown", llama_dir, tmp_path)
    assert follower["error"] is None and follower["report"] is not None
    assert driver["after_shutdown"].startswith("DistributedError"), driver
    assert "shutdown() released them before" in driver["after_shutdown"], driver


@pytest.mark.slow
def test_a_dead_rank_0_fails_the_follower_with_a_clear_error(llama_dir: Path, tmp_path: Path) -> None:
    follower = launch("kill_driver", llama_dir, tmp_path).follower
    assert follower is not None, logs_of(tmp_path)
    assert follower["report"] is None
    assert follower["error"]["type"] == "DistributedError"
    assert "rank 0" in follower["error"]["message"]


def test_attention_sinks_are_sharded_with_their_heads(tmp_path: Path) -> None:
    """Granite-SWA's TP plan shards its attention sinks over the ranks as it does the query
    heads: each rank's sinks are its own heads', and greedy outputs equal one process's."""
    from tests.runner.test_architectures import tiny_with_sinks

    model = tiny_with_sinks("granite_swa")
    model.save_pretrained(tmp_path / "model")
    driver, _ = _both_ran("generate_batch", tmp_path / "model", tmp_path)
    assert driver["first"]["tokens"] == [reference_generate(model, p, MAX_NEW_TOKENS) for p in PROMPTS]
