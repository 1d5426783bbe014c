"""Launch the two ranks of ``tests/distributed/_ranks.py`` the way torchrun would, with a deadline."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORLD_SIZE = 2


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Ranks:
    """What the two ranks wrote (None: nothing) and how they exited."""

    driver: dict[str, Any] | None
    follower: dict[str, Any] | None
    exit_codes: list[int]


def launch(scenario: str, model_dir: Path, out_dir: Path, *, deadline: float = 120.0) -> Ranks:
    """Run both ranks and return what they wrote.

    Fails the test (and kills both ranks) when they are not done after ``deadline``
    seconds, so a hang fails instead of blocking the suite.
    """
    port = str(free_port())
    procs: list[subprocess.Popen[bytes]] = []
    logs = [out_dir / f"rank{rank}.log" for rank in range(WORLD_SIZE)]
    for rank in range(WORLD_SIZE):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(WORLD_SIZE),
            "LOCAL_WORLD_SIZE": str(WORLD_SIZE),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(ROOT),
            "HF_HUB_OFFLINE": "1",
        }
        command = [sys.executable, "-m", "tests.distributed._ranks", scenario, str(model_dir), str(out_dir)]
        with logs[rank].open("wb") as log:
            procs.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    end = time.monotonic() + deadline
    try:
        for proc in procs:
            proc.wait(timeout=max(end - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        tails = "\n".join(f"--- rank {r}:\n{_tail(log)}" for r, log in enumerate(logs))
        pytest.fail(f"the {scenario!r} ranks were not done after {deadline} s (a hang):\n{tails}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    records: list[dict[str, Any] | None] = []
    for rank in range(WORLD_SIZE):
        path = out_dir / f"rank{rank}.json"
        records.append(json.loads(path.read_text()) if path.exists() else None)
    return Ranks(records[0], records[1], [proc.returncode for proc in procs])


def logs_of(out_dir: Path) -> str:
    """Both ranks' output, for assertion messages."""
    return "\n".join(f"--- rank {r}:\n{_tail(out_dir / f'rank{r}.log')}" for r in range(WORLD_SIZE))


def _tail(path: Path, chars: int = 6000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no output)"
