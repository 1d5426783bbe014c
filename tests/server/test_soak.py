"""A 3-minute soak of ``aiocb serve`` on the bundled model (``bench/soak.py``), run by ``nox -s slow``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

#: RSS slope allowed in a short run, in MiB per 10,000 requests. For its first couple of
#: thousand requests the server's RSS still climbs as its allocators warm up to every
#: shape the traffic brings (with the bundled model's 1,024-token context, long prompts
#: included, for about 100 s here: 424 MiB at the start, 986 at 65 s, then 1,000-1,016
#: for the next five minutes of a 6-minute run), and over ~2,000 requests the sampling
#: noise alone is worth tens of MiB per 10,000: the 1.0 default is for the 30-minute
#: soak. A leak of a few KiB per request still shows; leaked KV blocks are checked exactly.
SHORT_RUN_MAX_RSS_SLOPE = 200.0
#: The share of the short run left out of the slope: its first 108 s.
SHORT_RUN_WARMUP_FRACTION = 0.6


@pytest.mark.slow
def test_soak_three_minutes(tmp_path: Path) -> None:
    report_path = tmp_path / "soak.json"
    command = [
        sys.executable,
        str(REPO_ROOT / "bench" / "soak.py"),
        "--minutes",
        "3",
        "--warmup-fraction",
        str(SHORT_RUN_WARMUP_FRACTION),
        "--max-rss-slope",
        str(SHORT_RUN_MAX_RSS_SLOPE),
        "--json",
        str(report_path),
        "--server-log",
        str(tmp_path / "server.log"),
    ]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"soak failed:\n{done.stdout[-6000:]}\n{done.stderr[-3000:]}"
    report = json.loads(report_path.read_text())
    assert report["server_errors"] == 0, report["examples"]
    assert report["leaked_blocks"] == 0
    assert report["hangs"] == 0
    assert report["requests_finished"] > 0
