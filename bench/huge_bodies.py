"""Huge chat bodies beside ordinary requests: ``aiocb serve`` keeps serving the others.

Serves the bundled model (``python -m aiocb serve --torch-threads 1``, a subprocess on
127.0.0.1), then for each scenario sends one huge request, megabytes of

* ``tools``: a chat with 30,000 tools (2.79 MiB), refused (its prompt cannot fit the context);
* ``messages``: a chat of 270,000 one-word messages (7.98 MiB), refused likewise;
* ``prompt``: a completion of a 7.5 MB prompt cut to its last 64 tokens (tokenized in a
  child process: seconds), answered;

and, half a second in, an ordinary request, streamed: for the chats a chat (a 2.6 KB
system prompt, 4 greedy tokens), for the prompt a completion of a 100 KB prompt cut to
its last 64 tokens (also tokenized in a child process), while a thread of its own asks
``/health`` every 20 ms. It reports when the ordinary request's headers and last chunk
came, how long the huge one took to be answered, and the slowest ``/health`` answer during
it, from a process of its own (a server whose event loop is held answers late).

    python bench/huge_bodies.py               # every scenario, twice each
    python bench/huge_bodies.py --repeats 1 --scenarios tools
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/huge_bodies.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from bench.common import REPO_ROOT, machine_info, markdown_table
from bench.serve_load import free_port, stop_server, wait_healthy

_TOOL = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}
_ORDINARY_CHAT = {
    "max_tokens": 4,
    "temperature": 0,
    "stream": True,
    "messages": [{"role": "system", "content": "def f(a):\n    return a\n" * 110}, {"role": "user", "content": "hi"}],
}
_WORDS = "def f(a):\n    return a\n"
_ORDINARY_COMPLETION = {
    "max_tokens": 4,
    "temperature": 0,
    "stream": True,
    "prompt": _WORDS * (100_000 // len(_WORDS)),
    "truncate_prompt_tokens": 64,
}
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def huge_request(scenario: str) -> tuple[str, bytes]:
    """The scenario's endpoint and body, as compact JSON."""
    body: dict[str, Any] = {"max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    if scenario == "tools":
        body["tools"] = [{**_TOOL, "function": {**_TOOL["function"], "name": f"f{i}"}} for i in range(30_000)]
    elif scenario == "messages":
        body["messages"] = body["messages"] * 270_000
    else:
        body = {"max_tokens": 1, "prompt": _WORDS * (7_500_000 // len(_WORDS)), "truncate_prompt_tokens": 64}
    return (COMPLETIONS if scenario == "prompt" else CHAT), json.dumps(body, separators=(",", ":")).encode()


#: The ``/health`` prober, a process of its own (a thread here timed this process's own
#: work on the huge body too: 100-150 ms where a prober beside it saw 24 ms at most): asks
#: every 20 ms from "ready" until its input closes, then prints its slowest answer (s).
_PROBE = """
import sys, threading, time, httpx
done, slowest = threading.Event(), 0.0
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
with httpx.Client(base_url=sys.argv[1], timeout=30) as http:
    print("ready", flush=True)
    while not done.is_set():
        started = time.perf_counter()
        http.get("/health")
        slowest = max(slowest, time.perf_counter() - started)
        done.wait(0.02)
print(slowest)
"""


async def ordinary_request(http: httpx.AsyncClient, endpoint: str) -> tuple[float, float]:
    """The ordinary request, streamed: when its headers and its last chunk came (seconds)."""
    started = time.perf_counter()
    body = _ORDINARY_CHAT if endpoint == CHAT else _ORDINARY_COMPLETION
    async with http.stream("POST", endpoint, json=body) as response:
        headers = time.perf_counter() - started
        async for _ in response.aiter_lines():
            pass
    if response.status_code != 200:
        raise RuntimeError(f"the ordinary request failed: {response.status_code}")
    return headers, time.perf_counter() - started


async def run_scenario(base: str, scenario: str) -> list[str]:
    endpoint, body = huge_request(scenario)
    async with httpx.AsyncClient(base_url=base, timeout=600) as http:
        await ordinary_request(http, endpoint)  # (warm: the tokenizer process started)
        pipe = asyncio.subprocess.PIPE
        prober = await asyncio.create_subprocess_exec(sys.executable, "-c", _PROBE, base, stdin=pipe, stdout=pipe)
        assert prober.stdout is not None
        await prober.stdout.readline()  # ("ready")
        started = time.perf_counter()
        huge = asyncio.create_task(http.post(endpoint, content=body, headers={"content-type": "application/json"}))
        await asyncio.sleep(0.5)
        headers, last = await ordinary_request(http, endpoint)
        refused = await huge
        refused_s = time.perf_counter() - started
        assert prober.stdin is not None
        prober.stdin.close()  # (its end: communicate() closes it only when given input)
        slowest = float((await prober.communicate())[0].split()[-1])
    expected = 200 if scenario == "prompt" else 400
    if refused.status_code != expected:
        raise RuntimeError(f"the huge request got {refused.status_code}, not {expected}: {refused.text[:200]}")
    return [
        f"{scenario} ({len(body) / 2**20:.2f} MiB)",
        f"{headers:.3f} s",
        f"{last:.2f} s",
        f"{refused_s:.2f} s",
        f"{slowest * 1e3:.0f} ms",
    ]


async def measure(base: str, server: subprocess.Popen[bytes], args: argparse.Namespace) -> list[list[str]]:
    async with httpx.AsyncClient(base_url=base) as http:
        await wait_healthy(http, server)
    return [await run_scenario(base, s) for _ in range(args.repeats) for s in args.scenarios]


def main(args: argparse.Namespace) -> None:
    port = free_port()
    command = [sys.executable, "-m", "aiocb", "serve", "--port", str(port), "--torch-threads", "1", "--log-level"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    with open(args.server_log, "wb") as log:
        server = subprocess.Popen([*command, "warning"], env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            rows = asyncio.run(measure(f"http://127.0.0.1:{port}", server, args))
        finally:
            stop_server(server)
    print(machine_info())
    headers = ["huge request", "ordinary one's headers", "its last chunk", "huge one answered", "slowest /health"]
    print(markdown_table(headers, rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    scenarios = ["tools", "messages", "prompt"]
    parser.add_argument("--scenarios", nargs="+", choices=scenarios, default=scenarios)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--server-log", default=os.devnull, help="where the server's output goes")
    main(parser.parse_args())
