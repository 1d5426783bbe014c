"""Development sessions: `nox -s tests` is what CI runs."""

from __future__ import annotations

import os
from pathlib import Path

import nox

nox.options.sessions = ["tests", "lint", "typecheck"]
nox.options.reuse_existing_virtualenvs = True
nox.options.default_venv_backend = "venv"

CONSTRAINTS = ("-c", "constraints.txt")
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _install(session: nox.Session, *groups: str) -> None:
    session.install("pip>=25.1")  # dependency groups (--group) need a recent pip
    session.install(*CONSTRAINTS, "-e", ".[serve]")
    for group in groups:
        session.install(*CONSTRAINTS, "--group", group)


def _workers() -> str:
    """Test worker processes: one a core this process may use, at most four (each holds its
    own models and caches)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return str(min(cores, 4))


@nox.session
def tests(session: nox.Session) -> None:
    """Run the test suite on CPU (no slow or GPU tests), in a worker process a core."""
    _install(session, "test")
    # A test file's tests run in one worker (its module fixtures, the models, built once);
    # one torch thread a worker, as more than a core each would only contend. The slowest
    # tests are listed: the session must stay well under 15 minutes on 2 cores.
    session.run(
        "pytest",
        *("-n", _workers(), "--dist", "loadfile"),
        *("-m", "not slow and not gpu and not multiprocess", "--durations=25"),
        *session.posargs,
        env={"OMP_NUM_THREADS": "1"},
    )


@nox.session
def multiprocess(session: nox.Session) -> None:
    """Run the tests that launch processes: tensor-parallel ranks under torchrun, Ray Serve
    replicas, the server's API workers (the slow ones among them run with `nox -s slow`)."""
    _install(session, "test")
    session.run("pytest", "-m", "multiprocess and not slow and not gpu", "--durations=10", *session.posargs)


@nox.session
def fuzz(session: nox.Session) -> None:
    """Run the property-based tests on many random examples: ``AIOCB_FUZZ_SCALE`` (default 50,
    or the first argument) times the fixed set that the default session runs."""
    _install(session, "test")
    scale = session.posargs[0] if session.posargs else "50"
    session.run("pytest", "-m", "hypothesis and not slow and not gpu", env={"AIOCB_FUZZ_SCALE": scale})


@nox.session
def slow(session: nox.Session) -> None:
    """Run the slow tests (torch.compile, lm-evaluation-harness against the server, a 3-minute soak)."""
    _install(session, "test", "eval")
    session.run("pytest", "-m", "slow", *session.posargs, env=OFFLINE)


@nox.session
def lm_eval(session: nox.Session) -> None:
    """Score the served tiny test model with lm-evaluation-harness, offline (local JSONL tasks)."""
    _install(session, "test", "eval")
    session.run("pytest", "-m", "slow", "-s", "tests/server/test_lm_eval.py", *session.posargs, env=OFFLINE)


@nox.session
def examples(session: nox.Session) -> None:
    """Run every example in examples/ on the bundled model (the tensor-parallel one under torchrun)."""
    _install(session, "test")
    for script in sorted(Path("examples").glob("[0-9]*.py")):
        session.run("python", str(script), env=OFFLINE)
    session.run("torchrun", "--nproc-per-node", "2", "examples/tp_torchrun.py", env=OFFLINE)


@nox.session
def lint(session: nox.Session) -> None:
    """Check style and common bugs with ruff."""
    session.install("pip>=25.1")
    session.install(*CONSTRAINTS, "--group", "lint")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """Type-check the package with mypy (strict)."""
    _install(session, "lint")
    session.install(*CONSTRAINTS, "-e", ".[ray]")
    session.run("mypy")
    session.run("mypy", "tests/typed_use.py")  # (the public API as users type-check it)


@nox.session
def bench(session: nox.Session) -> None:
    """Run a CPU benchmark: the script and its arguments (default ``bench/throughput.py``)."""
    _install(session, "test")
    session.run("python", *(session.posargs or ["bench/throughput.py"]))
