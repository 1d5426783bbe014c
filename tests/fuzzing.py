"""Hypothesis settings shared by the property-based tests.

The default test session is a gate: it runs a fixed set of examples (``derandomize``), so a
run on one machine fails exactly where it fails on another. ``nox -s fuzz`` sets
``AIOCB_FUZZ_SCALE`` to run many more examples drawn at random; a failure there prints the
``@reproduce_failure`` blob to replay it.
"""

from __future__ import annotations

import os
from typing import Any

from hypothesis import HealthCheck, settings

FUZZ_SCALE = int(os.environ.get("AIOCB_FUZZ_SCALE", "0"))


def fuzz_settings(max_examples: int, *, suppress: tuple[HealthCheck, ...] = ()) -> Any:
    """``@settings`` for a property test: ``max_examples`` fixed examples by default, or
    ``max_examples * AIOCB_FUZZ_SCALE`` random ones when fuzzing."""
    return settings(
        max_examples=max_examples * max(FUZZ_SCALE, 1),
        derandomize=FUZZ_SCALE == 0,
        deadline=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, *suppress],
    )
