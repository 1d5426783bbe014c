"""lm-evaluation-harness (``local-completions``) scores the served tiny model offline.

Two local JSONL tasks under ``lm_eval_tasks/``: a ``generate_until`` one (greedy text,
stop strings) and a multiple-choice one (loglikelihood: ``echo`` + ``logprobs``). The
tokenizer comes from the server's ``/tokenize`` endpoints or from a local path. Run by
``nox -s lm_eval`` (or ``pytest -m slow tests/server/test_lm_eval.py -s``); the scores
of a random model mean nothing, the run is what is tested.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import pytest

from tests.server.conftest import API_KEY, MODEL_NAME, LiveServer, wait_until_idle

TASK_DIR = Path(__file__).parent / "lm_eval_tasks"
TASKS = ["aiocb_tiny_qa", "aiocb_tiny_mc"]


def evaluate(base_url: str, backend: str, tokenizer_dir: Path) -> dict[str, Any]:
    """Run lm-eval on both tasks (blocking: call it from a worker thread)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    model_args: dict[str, Any] = {
        "model": MODEL_NAME,
        "base_url": f"{base_url}/v1/completions",
        "tokenizer_backend": backend,
        "num_concurrent": 4,
        "max_retries": 1,
        "max_length": 2048,
        "auth_token": API_KEY,
    }
    if backend == "huggingface":
        model_args["tokenizer"] = str(tokenizer_dir)
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=model_args,
        tasks=TASKS,
        task_manager=TaskManager(include_path=str(TASK_DIR)),
        batch_size=1,
        log_samples=False,
        bootstrap_iters=0,
    )
    assert results is not None
    scores: dict[str, Any] = results["results"]
    return scores


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["remote", "huggingface"])
async def test_lm_eval_scores_the_served_model(
    server: LiveServer, tokenizer_dir: Path, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("lm_eval", reason="lm-eval is in the 'eval' dependency group (nox -s lm_eval)")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)  # local-completions sends it as the bearer token
    monkeypatch.chdir(TASK_DIR)  # the task YAMLs name their JSONL files relative to here
    # lm-eval blocks while it waits for the server, which runs on this loop: give it a thread.
    scores = await asyncio.to_thread(evaluate, server.url, backend, tokenizer_dir)
    print(f"\nlm-eval local-completions, tokenizer backend {backend}:")
    for task in TASKS:
        print(f"  {task}: {scores[task]}")
    generated = scores["aiocb_tiny_qa"]
    assert 0.0 <= generated["exact_match,none"] <= 1.0
    choice = scores["aiocb_tiny_mc"]
    assert 0.0 <= choice["acc,none"] <= 1.0
    assert 0.0 <= choice["acc_norm,none"] <= 1.0
    assert not math.isnan(choice["acc,none"])
    stats = await wait_until_idle(server.manager)
    assert stats.free_blocks == stats.total_blocks
