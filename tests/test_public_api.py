"""The public surface of ``aiocb``, and the core's promise to import neither torch nor asyncio."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import aiocb

EXPECTED_PUBLIC_NAMES = [
    "AiocbError",
    "ContinuousBatchingConfig",
    "DistributedError",
    "EngineDeadError",
    "FinishReason",
    "GenerationOutput",
    "InvalidConfigError",
    "InvalidRequestError",
    "Manager",
    "ManagerClosedError",
    "ManagerStatistics",
    "RequestAbortedError",
    "RequestStatus",
    "RequestStream",
    "SamplingParams",
    "SpeculativeConfig",
    "WorkloadHints",
    "WouldBlock",
    "WrongEventLoopError",
    "__version__",
    "generate_batch",
]

PACKAGE_DIR = Path(aiocb.__file__).resolve().parent
HEAVY_MODULES = ["asyncio", "numpy", "torch", "transformers"]


def test_all_is_exactly_the_public_names() -> None:
    assert len(set(aiocb.__all__)) == len(aiocb.__all__), "duplicate names in __all__"
    assert sorted(aiocb.__all__) == EXPECTED_PUBLIC_NAMES


def test_every_public_name_resolves() -> None:
    for name in aiocb.__all__:
        assert getattr(aiocb, name) is not None, name
    namespace: dict[str, object] = {}
    exec("from aiocb import *", namespace)
    assert sorted(k for k in namespace if k != "__builtins__") == EXPECTED_PUBLIC_NAMES


def test_version_is_the_package_version() -> None:
    assert isinstance(aiocb.__version__, str)
    assert aiocb.__version__ == "0.1.0"


def test_error_tree() -> None:
    assert issubclass(aiocb.InvalidRequestError, ValueError)
    assert issubclass(aiocb.InvalidConfigError, ValueError)
    for name in (
        "ManagerClosedError",
        "RequestAbortedError",
        "EngineDeadError",
        "WrongEventLoopError",
        "DistributedError",
    ):
        assert issubclass(getattr(aiocb, name), RuntimeError), name
    errors = [getattr(aiocb, n) for n in aiocb.__all__ if n.endswith("Error") or n == "WouldBlock"]
    assert len(errors) == 9
    for error in errors:
        assert issubclass(error, aiocb.AiocbError), error
    assert not issubclass(aiocb.WouldBlock, (ValueError, RuntimeError))
    with pytest.raises(ValueError, match="bad prompt"):
        raise aiocb.InvalidRequestError("bad prompt")


def test_engine_dead_error_keeps_its_cause() -> None:
    cause = KeyError("x")
    error = aiocb.EngineDeadError("the step loop died", cause)
    assert error.cause is cause
    assert error.__cause__ is cause


def _heavy_modules_after(script: str) -> list[str]:
    """Run ``script`` in a fresh interpreter that refuses to import HEAVY_MODULES.

    An import of one fails at once, with a traceback naming the import that wanted it;
    the script prints a JSON list of the heavy modules that got imported all the same.
    """
    done = subprocess.run(
        [sys.executable, "-c", _BLOCK_HEAVY_IMPORTS.format(heavy=HEAVY_MODULES) + script],
        cwd=PACKAGE_DIR.parent,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


_BLOCK_HEAVY_IMPORTS = """
import importlib, json, pkgutil, sys
HEAVY = {heavy!r}
assert not [m for m in HEAVY if m in sys.modules], "imported at interpreter start"


class _RefuseHeavy:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HEAVY:
            raise ImportError("aiocb.core must not import " + name)
        return None


sys.meta_path.insert(0, _RefuseHeavy())
"""

_IMPORT_CORE = """
import aiocb.core
names = sorted(m.name for m in pkgutil.iter_modules(aiocb.core.__path__))
assert {"block_pool", "kv_cache", "params", "request", "scheduler"} <= set(names), names
for name in names:
    importlib.import_module("aiocb.core." + name)
print(json.dumps(sorted(m for m in HEAVY if m in sys.modules)))
"""

# Stand in for the top-level package so that only aiocb.core (and what it imports) runs.
_BYPASS_PACKAGE_INIT = """
import types
package = types.ModuleType("aiocb")
package.__path__ = [{path!r}]
sys.modules["aiocb"] = package
"""


def test_the_core_modules_import_neither_torch_nor_asyncio() -> None:
    bypass = _BYPASS_PACKAGE_INIT.format(path=str(PACKAGE_DIR))
    assert _heavy_modules_after(bypass + _IMPORT_CORE) == []


def test_importing_aiocb_core_imports_neither_torch_nor_asyncio() -> None:
    assert _heavy_modules_after(_IMPORT_CORE) == []


def test_the_package_declares_its_type_hints() -> None:
    """PEP 561: without ``py.typed`` a user's type checker sees every aiocb name as Any."""
    assert (Path(aiocb.__file__).parent / "py.typed").is_file()
