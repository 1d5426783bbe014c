"""Soak test of ``aiocb serve``: mixed traffic for a long while, watching for leaks, 5xx and hangs.

``aiocb serve`` runs in a subprocess on 127.0.0.1 (a free port; by default on the bundled
model, ``aiocb/assets/pycode-tiny``; ``--model`` serves another) with its log in a file.
Once it is ready (``GET /ready`` when the server has it, else ``GET /health``),
``--concurrency`` clients (``httpx.AsyncClient`` on one event loop) send requests one after
another for ``--minutes``, drawn at random from these categories:

* ``completion``, ``completion_stream``, ``chat``, ``chat_stream``: text or token-id prompts
  (sometimes two prompts at once), ``n`` up to 3, ``logprobs`` (with ``echo`` at times),
  ``stop`` strings, ``seed``, temperatures, ``top_p`` / ``top_k``, ``ignore_eos``; chat only
  when ``GET /tokenizer_info`` shows a chat template (else counted as skipped);
* ``long_prompt``: token prompts of 80-95% of the context length, ``max_tokens`` within it;
* ``cancel_request``: a non-stream request the client abandons after a random delay;
* ``disconnect_stream``: a stream closed by the client after a few chunks;
* ``bad:*``: inputs that must be refused with a 4xx, never a 5xx: invalid JSON, a JSON
  array, an unknown model, a negative ``max_tokens``, ``temperature`` as a string, deeply
  nested JSON, thousands of stop strings, a prompt far beyond the context length, and a
  body over the server's request-size limit (a 413 or 400, or the server closing the
  connection, all count as refused).

Meanwhile it samples every ``--sample-interval`` seconds the server's RSS (psutil on its
pid) and ``GET /metrics`` (free and total KV blocks, running and waiting requests), and a
separate thread sends ``GET /health`` every 100 ms: the latency of those probes is the
server's event-loop lag as seen from outside (the client process adds a little of its own).

When the time is up, no new request starts; the ones in flight end (or count as hung past
``--request-timeout``); after a quiet wait every KV block must be free. Reported: requests
per category and outcome, status codes, 5xx, hangs, broken responses (a stream without
``[DONE]``, an error event, a malformed body, an unexpected status for a valid request),
bad inputs accepted with a 2xx (a warning; a failure with ``--strict``), leaked blocks,
the server's RSS at start, after the warm-up, at the end and its peak, the RSS slope (a
least-squares fit of RSS against finished requests after the first ``--warmup-fraction``
of the run, in MiB per 10,000 requests) and the probe latencies (p50 / p99 / max).

The exit status is 1 on any 5xx, hang, broken response, leaked block, a server that died,
or an RSS slope over ``--max-rss-slope``; 2 when the run could not be made. The server is
always stopped (SIGTERM, then SIGKILL after ``--kill-timeout``), on errors and Ctrl-C too.

    python bench/soak.py --minutes 0.2                      # a quick check
    python bench/soak.py                                    # 30 minutes
    python bench/soak.py --minutes 2 --json soak.json       # what the slow test runs
    python bench/soak.py --server-arg=--num-blocks --server-arg=64
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/soak.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx
import psutil

from bench.common import REPO_ROOT, CpuContention, machine_info, markdown_table
from bench.serve_load import free_port, percentile, scrape

#: The model folder shipped inside the package (see ``aiocb/default_model.py``).
BUNDLED_MODEL = REPO_ROOT / "aiocb" / "assets" / "pycode-tiny"
MIB = 2**20

#: Outcomes that fail the run; ``accepted`` (a bad input answered with a 2xx) only warns.
FAILURES = ("server-error", "hang", "broken")

#: Beginnings of Python code, what the bundled model writes.
_SNIPPETS = (
    "def fibonacci(n):",
    "class Stack:\n    def __init__(self):",
    "import os\nimport sys\n\n",
    "for i in range(10):",
    "if __name__ == '__main__':",
    "    return self._",
    "with open(path) as f:",
    "try:\n    import",
    "def __repr__(self):",
    "raise ValueError(",
    "    def close(self):\n        ",
    "from collections import",
    "# Copyright",
    "while True:\n    line = ",
    '"""Return the',
    "    @property\n    def",
)
_STOPS = ("\n\n", "\ndef ", "return", ")", ":", "self")
_MESSAGES = ("Write a function that adds two numbers.", "What does this code do?", "Sort a list in Python.", "hi")


# --------------------------------------------------------------------------- the server


def model_argument_optional(env: dict[str, str]) -> bool:
    """Whether ``aiocb serve --help`` shows the model argument as optional (``[model]``)."""
    try:
        done = subprocess.run(
            [sys.executable, "-m", "aiocb", "serve", "--help"],
            capture_output=True,
            text=True,
            timeout=180,
            env=env,
            cwd=REPO_ROOT,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    usage = done.stdout.split("\n\n", 1)[0]
    return done.returncode == 0 and re.search(r"\[\s*model\s*\]", usage, re.IGNORECASE) is not None


class ServerProcess:
    """``aiocb serve`` in a subprocess of its own session; :meth:`stop` always ends it."""

    def __init__(self, command: list[str], env: dict[str, str], log_path: Path, kill_timeout: float) -> None:
        self.command = command
        self.log_path = log_path
        self.kill_timeout = kill_timeout
        self.exit_status: int | None = None
        self.killed = False
        with open(log_path, "ab") as log:
            # A session of its own: a Ctrl-C in the terminal reaches this script, which stops
            # the server itself (and reports), instead of both receiving it at once.
            self.process = subprocess.Popen(
                command, env=env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.pid = self.process.pid

    def alive(self) -> bool:
        """Whether the server process still runs."""
        return self.process.poll() is None

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after ``kill_timeout`` seconds (idempotent)."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=self.kill_timeout)
            except subprocess.TimeoutExpired:
                self.killed = True
                with contextlib.suppress(ProcessLookupError):
                    self.process.kill()
                self.process.wait()
        self.exit_status = self.process.returncode

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of the server's log."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.strip().splitlines()[-lines:])

    def log_counts(self) -> dict[str, int]:
        """Lines of the server's log that report errors and tracebacks."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return {"error_lines": 0, "tracebacks": 0}
        lines = text.splitlines()
        return {
            "error_lines": sum(line.startswith(("ERROR", "CRITICAL")) for line in lines),
            "tracebacks": sum(line.startswith("Traceback") for line in lines),
        }


def rss_bytes(pid: int) -> int | None:
    """The resident memory of process ``pid`` (None once it is gone)."""
    try:
        rss: int = psutil.Process(pid).memory_info().rss
    except psutil.Error:
        return None
    return rss


def peak_rss_bytes(pid: int) -> int | None:
    """The kernel's high-water mark of the resident memory of ``pid`` (``VmHWM``), if readable."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


# --------------------------------------------------------------------------- instruments


class HealthProber:
    """A thread that sends ``GET /health`` every ``interval`` seconds and records the latencies.

    A thread with its own connection, so that the clients' event loop does not delay the
    probes (only the GIL is shared with it).
    """

    def __init__(self, url: str, interval: float = 0.1, timeout: float = 30.0) -> None:
        self.url = url
        self.interval = interval
        self.timeout = timeout
        #: (monotonic time sent, latency seconds, answered 200)
        self.probes: list[tuple[float, float, bool]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-health-prober", daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=self.timeout) as http:
            while not self._stop.is_set():
                sent = time.monotonic()
                try:
                    ok = http.get(self.url).status_code == 200
                except httpx.HTTPError:
                    ok = False
                latency = time.monotonic() - sent
                self.probes.append((sent, latency, ok))
                self._stop.wait(max(0.0, self.interval - latency))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.timeout + 5)

    def between(self, start: float, end: float) -> list[tuple[float, float, bool]]:
        """The probes sent in ``[start, end]`` (monotonic times)."""
        return [p for p in self.probes if start <= p[0] <= end]


@dataclass
class Sample:
    """One look at the server."""

    elapsed_s: float
    phase: str  # "start", "traffic", "end"
    finished_requests: int
    rss_bytes: int | None
    free_blocks: int | None = None
    total_blocks: int | None = None
    running: int | None = None
    waiting: int | None = None
    generated_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Result:
    """How one request ended: ``outcome``, the status (``"200"``, ``"closed"``, ...), a detail."""

    outcome: str
    status: str
    detail: str = ""


@dataclass
class Tally:
    """Counts of the whole run."""

    sent: Counter[str] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)
    outcomes: dict[str, Counter[str]] = field(default_factory=dict)
    status_codes: Counter[str] = field(default_factory=Counter)
    #: a few examples of each failing or warning outcome: "category: detail; request"
    examples: dict[str, list[str]] = field(default_factory=dict)
    #: (monotonic start, end, category) of every request, to see what ran during a slow probe
    spans: list[tuple[float, float, str]] = field(default_factory=list)
    finished: int = 0

    def record(self, category: str, result: Result, request: str) -> None:
        self.outcomes.setdefault(category, Counter())[result.outcome] += 1
        self.status_codes[result.status] += 1
        self.finished += 1
        if result.outcome in (*FAILURES, "accepted"):
            examples = self.examples.setdefault(result.outcome, [])
            if len(examples) < 10:
                examples.append(f"{category} -> {result.status}: {result.detail[:300]}; request {request[:300]}")

    def count(self, outcome: str) -> int:
        return sum(c[outcome] for c in self.outcomes.values())

    def by_category(self, outcome: str) -> dict[str, int]:
        return {name: c[outcome] for name, c in sorted(self.outcomes.items()) if c[outcome]}


# --------------------------------------------------------------------------- request bodies


def _describe(body: Any) -> str:
    """A short description of a request body for the report."""
    if isinstance(body, bytes):
        return f"{len(body):,} bytes: {body[:80]!r}"
    text = json.dumps(body)
    return text if len(text) <= 300 else f"{text[:300]}... ({len(text):,} characters)"


async def _oversized_chunks(size: int, model: str) -> AsyncIterator[bytes]:
    """A valid JSON body of ``size`` bytes, made as it is sent: only the size is wrong."""
    head = json.dumps({"model": model, "prompt": "def f():", "max_tokens": 1})[:-1].encode() + b', "padding": "'
    tail = b'"}'
    filler = b"a" * MIB
    remaining = max(0, size - len(head) - len(tail))
    yield head
    while remaining > 0:
        chunk = filler if remaining >= len(filler) else filler[:remaining]
        remaining -= len(chunk)
        yield chunk
    yield tail


def _longest(body: dict[str, Any], max_tokens: int) -> None:
    """Give ``body`` ``max_tokens`` under the name it already uses (a chat request may use
    ``max_completion_tokens``; both at once are refused)."""
    body["max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"] = max_tokens


def _check_body(data: Any, choices: int, max_tokens: int, logprobs: bool) -> str | None:
    """What is wrong with a 200 response body, or None."""
    if not isinstance(data, dict) or not isinstance(data.get("choices"), list):
        return f"not a completion: {str(data)[:200]}"
    got = data["choices"]
    if len(got) != choices:
        return f"{len(got)} choices instead of {choices}"
    for choice in got:
        if choice.get("finish_reason") not in ("stop", "length"):
            return f"finish_reason {choice.get('finish_reason')!r}"
        if logprobs and choice.get("logprobs") is None:
            return "logprobs asked for, none returned"
    usage = data.get("usage")
    if not isinstance(usage, dict) or not 0 <= usage.get("completion_tokens", -1) <= choices * max_tokens:
        return f"usage {usage!r} for {choices} choices of at most {max_tokens} tokens"
    return None


# --------------------------------------------------------------------------- the traffic


class Soak:
    """The clients, the samples and the tally of one run."""

    def __init__(self, args: argparse.Namespace, server: ServerProcess, base_url: str) -> None:
        self.args = args
        self.server = server
        self.base_url = base_url
        self.rng = random.Random(args.seed)
        self.tally = Tally()
        self.samples: list[Sample] = []
        self.model = ""
        self.context: int | None = None
        self.vocab = 2
        self.chat_template = False
        self.readiness_path = "/ready"
        self.started_requests = 0
        self.max_requests = args.max_requests or max(1000, math.ceil(args.minutes * 60 * 1000))
        self.server_died: str | None = None
        self.traffic_start = 0.0
        self.traffic_end = 0.0
        self.quiet_wait_s = 0.0
        self.workers_left = 0
        #: exceptions that ended a client (a bug of this script, or of a response it could not read)
        self.client_errors: list[str] = []
        self._categories: dict[str, tuple[float, Callable[[httpx.AsyncClient], Awaitable[tuple[Result, str]]]]] = {
            "completion": (20, lambda h: self._completion(h, stream=False)),
            "completion_stream": (20, lambda h: self._completion(h, stream=True)),
            "chat": (8, lambda h: self._chat(h, stream=False)),
            "chat_stream": (8, lambda h: self._chat(h, stream=True)),
            "long_prompt": (8, self._long_prompt),
            "cancel_request": (8, self._cancel_request),
            "disconnect_stream": (8, self._disconnect_stream),
            "bad:invalid_json": (1.5, lambda h: self._bad(h, b'{"prompt": "def f(", "max_tokens": 8', any_path=True)),
            "bad:json_array": (1.5, lambda h: self._bad(h, b'[{"prompt": "def f():"}]', any_path=True)),
            "bad:unknown_model": (1.5, lambda h: self._bad(h, {"model": "no-such-model", "prompt": "x"})),
            "bad:negative_max_tokens": (1.5, lambda h: self._bad(h, {"prompt": "def f():", "max_tokens": -5})),
            "bad:string_temperature": (1.5, lambda h: self._bad(h, {"prompt": "def f():", "temperature": "0.7"})),
            "bad:nested_json": (1.5, lambda h: self._bad(h, self._nested, any_path=True)),
            "bad:many_stop_strings": (1.5, lambda h: self._bad(h, self._many_stops)),
            "bad:prompt_too_long": (1.5, self._prompt_too_long),
            "bad:oversized_body": (args.oversized_weight, self._oversized),
        }
        depth = args.nested_depth
        self._nested = b"[" * depth + b"]" * depth
        self._many_stops: dict[str, Any] = {
            "prompt": "def f():",
            "max_tokens": 4,
            "stop": [f"stop-{i:05d}" for i in range(args.stop_strings)],
        }

    # ------------------------------------------------------------------ setup

    async def wait_ready(self, http: httpx.AsyncClient) -> None:
        """Poll ``/ready`` until it answers 200 (``/health`` when the server has no ``/ready``)."""
        deadline = time.monotonic() + self.args.startup_timeout
        while time.monotonic() < deadline:
            if not self.server.alive():
                raise RuntimeError(f"the server exited with status {self.server.process.returncode} while starting")
            try:
                response = await http.get(self.readiness_path, timeout=5)
                if response.status_code == 200:
                    return
                if response.status_code in (404, 405) and self.readiness_path == "/ready":
                    self.readiness_path = "/health"
                    continue
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.25)
        raise TimeoutError(f"the server was not ready within {self.args.startup_timeout:g} s")

    async def discover(self, http: httpx.AsyncClient) -> None:
        """The served model's name, context length, vocabulary size and chat template."""
        models = (await http.get("/v1/models")).json()["data"][0]
        info = (await http.get("/tokenizer_info")).json()
        self.model = models["id"]
        self.context = models.get("max_model_len") or info.get("model_max_length")
        if self.context is not None and self.context > 10**7:  # "no limit" sentinels
            self.context = None
        self.vocab = max(2, int(info.get("vocab_size") or 2))
        self.chat_template = bool(info.get("chat_template"))

    # ------------------------------------------------------------------ bodies

    def _max_tokens(self) -> int:
        top = self.args.max_tokens
        return self.rng.randint(max(1, top // 4), top)

    def _text(self) -> str:
        return "".join(self.rng.choice(_SNIPPETS) for _ in range(self.rng.randint(1, 4)))

    def _token_ids(self, count: int) -> list[int]:
        return [self.rng.randrange(1, self.vocab) for _ in range(count)]

    def _sampling(self, body: dict[str, Any], *, stream: bool) -> None:
        rng = self.rng
        if rng.random() < 0.5:
            body["temperature"] = rng.choice((0.0, 0.7, 1.0))
        if rng.random() < 0.5:
            body["seed"] = rng.randrange(2**31)
        if rng.random() < 0.4:
            body["stop"] = rng.sample(_STOPS, rng.randint(1, 3))
        if rng.random() < 0.3:
            body["ignore_eos"] = True
        if rng.random() < 0.15:
            body["top_p"] = 0.9
            body["top_k"] = 20
        if stream:
            body["stream"] = True
            if rng.random() < 0.5:
                body["stream_options"] = {"include_usage": True}

    def completion_body(self, *, stream: bool) -> tuple[dict[str, Any], int, bool]:
        """A valid completions body, the choices it asks for and whether it asks for logprobs."""
        rng = self.rng
        draw = rng.random()
        prompt: Any
        prompts = 1
        if draw < 0.6:
            prompt = self._text()
        elif draw < 0.85:
            prompt = self._token_ids(rng.randint(4, 64))
        else:
            prompt, prompts = [self._text(), self._text()], 2
        n = rng.choice((1, 1, 1, 2, 3))
        body: dict[str, Any] = {"model": self.model, "prompt": prompt, "max_tokens": self._max_tokens(), "n": n}
        logprobs = rng.random() < 0.3
        if logprobs:
            body["logprobs"] = rng.choice((0, 1, 5))
            if rng.random() < 0.3:
                body["echo"] = True
        self._sampling(body, stream=stream)
        return body, n * prompts, logprobs

    def chat_body(self, *, stream: bool) -> tuple[dict[str, Any], int, bool]:
        """A valid chat completions body, the choices it asks for and whether it asks for logprobs."""
        rng = self.rng
        messages = [{"role": "user", "content": rng.choice(_MESSAGES)}]
        if rng.random() < 0.3:
            messages.insert(0, {"role": "system", "content": "You write Python."})
        n = rng.choice((1, 1, 1, 2, 3))
        key = rng.choice(("max_tokens", "max_completion_tokens"))
        body: dict[str, Any] = {"model": self.model, "messages": messages, key: self._max_tokens(), "n": n}
        logprobs = rng.random() < 0.3
        if logprobs:
            body["logprobs"] = True
            body["top_logprobs"] = rng.choice((0, 2))
        self._sampling(body, stream=stream)
        return body, n, logprobs

    # ------------------------------------------------------------------ categories

    async def _completion(self, http: httpx.AsyncClient, *, stream: bool) -> tuple[Result, str]:
        body, choices, logprobs = self.completion_body(stream=stream)
        return await self._valid(http, "/v1/completions", body, choices, logprobs), _describe(body)

    async def _chat(self, http: httpx.AsyncClient, *, stream: bool) -> tuple[Result, str]:
        body, choices, logprobs = self.chat_body(stream=stream)
        return await self._valid(http, "/v1/chat/completions", body, choices, logprobs), _describe(body)

    async def _long_prompt(self, http: httpx.AsyncClient) -> tuple[Result, str]:
        assert self.context is not None
        length = self.rng.randint(int(0.80 * self.context), int(0.95 * self.context))
        max_tokens = max(1, min(self._max_tokens(), self.context - length))
        body: dict[str, Any] = {"model": self.model, "prompt": self._token_ids(length), "max_tokens": max_tokens}
        self._sampling(body, stream=self.rng.random() < 0.5)
        return await self._valid(http, "/v1/completions", body, 1, False), _describe(body)

    async def _cancel_request(self, http: httpx.AsyncClient) -> tuple[Result, str]:
        path, (body, choices, logprobs) = self._either_endpoint(stream=False)
        _longest(body, self.args.max_tokens)
        body["ignore_eos"] = True
        delay = self.rng.uniform(0.02, self.args.cancel_within)
        try:
            async with asyncio.timeout(delay):
                result = await self._valid(http, path, body, choices, logprobs)
        except TimeoutError:
            return Result("cancelled", "none"), _describe(body)
        if result.outcome == "ok":
            result = Result("answered-before-cancel", result.status)
        return result, _describe(body)

    async def _disconnect_stream(self, http: httpx.AsyncClient) -> tuple[Result, str]:
        path, (body, choices, _) = self._either_endpoint(stream=True)
        _longest(body, self.args.max_tokens)
        body["ignore_eos"] = True
        after = self.rng.randint(1, 4)
        async with http.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                return self._unexpected(response.status_code, await response.aread()), _describe(body)
            result = await self._read_stream(response, choices, stop_after=after)
        return result, _describe(body)

    def _either_endpoint(self, *, stream: bool) -> tuple[str, tuple[dict[str, Any], int, bool]]:
        if self.chat_template and self.rng.random() < 0.3:
            return "/v1/chat/completions", self.chat_body(stream=stream)
        return "/v1/completions", self.completion_body(stream=stream)

    async def _prompt_too_long(self, http: httpx.AsyncClient) -> tuple[Result, str]:
        assert self.context is not None
        body = {"model": self.model, "prompt": self._token_ids(4 * self.context), "max_tokens": 4}
        return await self._bad(http, body)

    async def _oversized(self, http: httpx.AsyncClient) -> tuple[Result, str]:
        size = self.args.oversized_bytes
        path = self.rng.choice(("/v1/completions", "/v1/chat/completions"))
        description = f"POST {path} with a valid JSON body of {size:,} bytes"
        headers = {"content-type": "application/json", "content-length": str(size)}
        try:
            response = await http.post(path, content=_oversized_chunks(size, self.model), headers=headers)
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError, httpx.CloseError) as exc:
            return Result("refused", "closed", f"{type(exc).__name__}: {exc}"), description
        return self._bad_status(response), description

    async def _bad(self, http: httpx.AsyncClient, body: Any, *, any_path: bool = False) -> tuple[Result, str]:
        path = self.rng.choice(("/v1/completions", "/v1/chat/completions")) if any_path else "/v1/completions"
        if isinstance(body, dict) and "model" not in body:
            body = {"model": self.model, **body}
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        response = await http.post(path, content=content, headers={"content-type": "application/json"})
        return self._bad_status(response), f"POST {path} {_describe(body)}"

    # ------------------------------------------------------------------ answers

    def _bad_status(self, response: httpx.Response) -> Result:
        status = response.status_code
        text = response.text[:300]
        if 400 <= status < 500:
            return Result("refused", str(status))
        if status >= 500:
            return Result("server-error", str(status), text)
        return Result("accepted", str(status), "a 4xx was expected")

    @staticmethod
    def _unexpected(status: int, content: bytes) -> Result:
        text = content[:300].decode(errors="replace")
        if status == 429:
            return Result("busy", "429")
        if status >= 500:
            return Result("server-error", str(status), text)
        return Result("broken", str(status), f"a valid request answered {status}: {text}")

    async def _valid(
        self, http: httpx.AsyncClient, path: str, body: dict[str, Any], choices: int, logprobs: bool
    ) -> Result:
        try:
            if body.get("stream"):
                async with http.stream("POST", path, json=body) as response:
                    if response.status_code != 200:
                        return self._unexpected(response.status_code, await response.aread())
                    return await self._read_stream(response, choices)
            response = await http.post(path, json=body)
        except httpx.TransportError as exc:
            return Result("broken", "closed", f"{type(exc).__name__}: {exc}")
        if response.status_code != 200:
            return self._unexpected(response.status_code, response.content)
        try:
            data = response.json()
        except ValueError:
            return Result("broken", "200", f"not JSON: {response.text[:200]}")
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or 0
        problem = _check_body(data, choices, max_tokens, logprobs)
        return Result("broken", "200", problem) if problem else Result("ok", "200")

    @staticmethod
    async def _read_stream(response: httpx.Response, choices: int, stop_after: int | None = None) -> Result:
        """Read server-sent events to ``[DONE]``, or close after ``stop_after`` chunks."""
        finished: set[int] = set()
        chunks = 0
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[len("data:") :].strip()
            if payload == "[DONE]":
                missing = sorted(set(range(choices)) - finished)
                if missing:
                    return Result("broken", "200", f"[DONE] before choices {missing} finished")
                return Result("ok" if stop_after is None else "finished-before-disconnect", "200")
            try:
                chunk = json.loads(payload)
            except ValueError:
                return Result("broken", "200", f"an event that is not JSON: {payload[:200]}")
            if "error" in chunk:
                return Result("broken", "200", f"an error event in the stream: {payload[:300]}")
            for choice in chunk.get("choices") or ():
                if choice.get("finish_reason"):
                    finished.add(choice.get("index", 0))
            chunks += 1
            if stop_after is not None and chunks >= stop_after:
                return Result("disconnected", "200")
        return Result("broken", "200", "the stream ended without [DONE]")

    # ------------------------------------------------------------------ the run

    def _available(self, name: str) -> bool:
        if name.startswith("chat") and not self.chat_template:
            return False
        return not (name in ("long_prompt", "bad:prompt_too_long") and self.context is None)

    async def _one(self, http: httpx.AsyncClient, name: str) -> None:
        _, run = self._categories[name]
        self.tally.sent[name] += 1
        request = name
        started = time.monotonic()
        try:
            async with asyncio.timeout(self.args.request_timeout):
                result, request = await run(http)
        except TimeoutError:
            result = Result("hang", "none", f"no answer within {self.args.request_timeout:g} s")
        except httpx.HTTPError as exc:
            result = Result("broken", "closed", f"{type(exc).__name__}: {exc}")
        self.tally.record(name, result, request)
        self.tally.spans.append((started, time.monotonic(), name))

    async def _worker(self, http: httpx.AsyncClient, deadline: float) -> None:
        names = list(self._categories)
        weights = [self._categories[n][0] for n in names]
        while time.monotonic() < deadline and self.started_requests < self.max_requests and self.server_died is None:
            name = self.rng.choices(names, weights)[0]
            if not self._available(name):
                self.tally.skipped[name] += 1
                await asyncio.sleep(0)
                continue
            self.started_requests += 1
            await self._one(http, name)

    async def sample(self, http: httpx.AsyncClient, phase: str) -> Sample:
        """RSS and the cache gauges now."""
        elapsed = time.monotonic() - self.traffic_start if self.traffic_start else 0.0
        sample = Sample(elapsed, phase, self.tally.finished, rss_bytes(self.server.pid))
        try:
            values = scrape((await http.get("/metrics", timeout=30)).text)
        except (httpx.HTTPError, ValueError):
            values = {}
        if "aiocb_kv_cache_free_blocks" in values:
            sample.free_blocks = int(values["aiocb_kv_cache_free_blocks"])
            sample.total_blocks = int(values["aiocb_kv_cache_total_blocks"])
            sample.running = int(values["aiocb_num_requests_running"])
            sample.waiting = int(values["aiocb_num_requests_waiting"])
            sample.generated_tokens = int(values.get("aiocb_engine_generated_tokens_total", 0))
        self.samples.append(sample)
        return sample

    async def _sampler(self, http: httpx.AsyncClient) -> None:
        while True:
            await asyncio.sleep(self.args.sample_interval)
            if not self.server.alive():
                self.server_died = f"the server exited with status {self.server.process.returncode} during the run"
                return
            await self.sample(http, "traffic")

    async def run(self) -> None:
        """Drive the server for ``--minutes``, then drain and wait until it is idle."""
        args = self.args
        limits = httpx.Limits(max_connections=args.concurrency + 8, max_keepalive_connections=args.concurrency + 8)
        timeout = httpx.Timeout(args.request_timeout + 5)
        async with httpx.AsyncClient(base_url=self.base_url, limits=limits, timeout=timeout) as http:
            await self.wait_ready(http)
            await self.discover(http)
            await self.sample(http, "start")
            self.traffic_start = time.monotonic()
            deadline = self.traffic_start + args.minutes * 60
            sampler = asyncio.create_task(self._sampler(http))
            workers = [asyncio.create_task(self._worker(http, deadline)) for _ in range(args.concurrency)]
            try:
                # Workers stop starting requests at the deadline; the last ones end within their timeout.
                _, pending = await asyncio.wait(workers, timeout=args.minutes * 60 + args.request_timeout + 30)
                self.workers_left = len(pending)
            finally:  # also on Ctrl-C: no task may outlive the client
                self.traffic_end = time.monotonic()
                for task in (*workers, sampler):
                    task.cancel()
                for outcome in await asyncio.gather(*workers, sampler, return_exceptions=True):
                    if isinstance(outcome, Exception):
                        self.client_errors.append(f"{type(outcome).__name__}: {outcome}")
            if self.server.alive():
                await self._quiet(http)

    async def _quiet(self, http: httpx.AsyncClient) -> None:
        """Wait up to ``--quiet-wait`` seconds for nothing running or waiting and every block free."""
        started = time.monotonic()
        while True:
            sample = await self.sample(http, "end")
            idle = sample.running == 0 and sample.waiting == 0 and sample.free_blocks == sample.total_blocks
            if (idle and sample.free_blocks is not None) or time.monotonic() - started >= self.args.quiet_wait:
                break
            self.samples.pop()
            await asyncio.sleep(0.25)
        self.quiet_wait_s = time.monotonic() - started


# --------------------------------------------------------------------------- the report


def rss_slope(samples: list[Sample], warmup_s: float) -> tuple[float | None, int]:
    """Least-squares slope of RSS against finished requests after the warm-up, MiB per 10,000 requests."""
    points = [
        (s.finished_requests, s.rss_bytes)
        for s in samples
        if s.phase == "traffic" and s.elapsed_s >= warmup_s and s.rss_bytes is not None
    ]
    if len(points) < 3:
        return None, len(points)
    mean_x = sum(p[0] for p in points) / len(points)
    mean_y = sum(p[1] for p in points) / len(points)
    sxx = sum((p[0] - mean_x) ** 2 for p in points)
    if sxx == 0:
        return None, len(points)
    slope = sum((p[0] - mean_x) * (p[1] - mean_y) for p in points) / sxx  # bytes per request
    return slope * 10_000 / MIB, len(points)


def slowest_probes(
    probes: list[tuple[float, float, bool]], spans: list[tuple[float, float, str]], origin: float, count: int = 5
) -> list[dict[str, Any]]:
    """The slowest probes, each with the bad inputs and long prompts in flight meanwhile."""
    slowest = sorted(probes, key=lambda p: -p[1])[:count]
    found = []
    for sent, latency, ok in slowest:
        during = Counter(
            name
            for start, end, name in spans
            if start <= sent + latency and end >= sent and (name.startswith("bad:") or name == "long_prompt")
        )
        in_flight = sum(1 for start, end, _ in spans if start <= sent + latency and end >= sent)
        found.append(
            {
                "at_s": round(sent - origin, 2),
                "latency_ms": round(latency * 1000, 1),
                "ok": ok,
                "requests_in_flight": in_flight,
                "bad_inputs_and_long_prompts_in_flight": dict(during),
            }
        )
    return found


def build_report(soak: Soak, prober: HealthProber, cpu: CpuContention, command: list[str]) -> dict[str, Any]:
    """The numbers of the run, as written to ``--json``."""
    args = soak.args
    tally = soak.tally
    samples = soak.samples
    duration = max(1e-9, soak.traffic_end - soak.traffic_start)
    warmup_s = args.warmup_fraction * duration
    slope, slope_points = rss_slope(samples, warmup_s)
    start = next((s for s in samples if s.phase == "start"), None)
    after_warmup = next((s for s in samples if s.phase == "traffic" and s.elapsed_s >= warmup_s), None)
    end = next((s for s in reversed(samples) if s.phase == "end"), None)
    rss_values = [s.rss_bytes for s in samples if s.rss_bytes is not None]
    peak = max([*rss_values, peak_rss_bytes(soak.server.pid) or 0], default=0)
    used = [s.total_blocks - s.free_blocks for s in samples if s.total_blocks is not None and s.free_blocks is not None]
    probes = prober.between(soak.traffic_start, soak.traffic_end)
    lags = [p[1] * 1000 for p in probes if p[2]]
    leaked = None
    if end is not None and end.free_blocks is not None and end.total_blocks is not None:
        leaked = end.total_blocks - end.free_blocks
    generated = None
    if start is not None and end is not None and None not in (start.generated_tokens, end.generated_tokens):
        generated = (end.generated_tokens or 0) - (start.generated_tokens or 0)

    def mib(value: int | None) -> float | None:
        return None if value is None else round(value / MIB, 1)

    report: dict[str, Any] = {
        "minutes": args.minutes,
        "concurrency": args.concurrency,
        "model": soak.model,
        "context_length": soak.context,
        "chat_template": soak.chat_template,
        "readiness_path": soak.readiness_path,
        "server_command": command,
        "server_log": str(soak.server.log_path),
        "traffic_s": round(duration, 1),
        "requests_finished": tally.finished,
        "requests_per_s": round(tally.finished / duration, 2),
        "generated_tokens": generated,
        "sent": dict(sorted(tally.sent.items())),
        "skipped": dict(sorted(tally.skipped.items())),
        "outcomes": {name: dict(sorted(c.items())) for name, c in sorted(tally.outcomes.items())},
        "status_codes": dict(sorted(tally.status_codes.items())),
        "server_errors": tally.count("server-error"),
        "server_errors_by_category": tally.by_category("server-error"),
        "hangs": tally.count("hang") + soak.workers_left,
        "broken": tally.count("broken"),
        "broken_by_category": tally.by_category("broken"),
        "bad_inputs_accepted": tally.by_category("accepted"),
        "examples": tally.examples,
        "leaked_blocks": leaked,
        "total_blocks": None if end is None else end.total_blocks,
        "running_after": None if end is None else end.running,
        "waiting_after": None if end is None else end.waiting,
        "quiet_wait_s": round(soak.quiet_wait_s, 2),
        "peak_used_blocks": max(used, default=None),
        "rss_start_mib": mib(start.rss_bytes if start else None),
        "rss_after_warmup_mib": mib(after_warmup.rss_bytes if after_warmup else None),
        "rss_end_mib": mib(end.rss_bytes if end else None),
        "rss_peak_mib": mib(peak or None),
        "rss_slope_mib_per_10k_requests": None if slope is None else round(slope, 3),
        "rss_slope_points": slope_points,
        "warmup_s": round(warmup_s, 1),
        "loop_lag_probes": len(probes),
        "loop_lag_failed_probes": sum(not p[2] for p in probes),
        "loop_lag_p50_ms": round(percentile(lags, 50), 2) if lags else None,
        "loop_lag_p99_ms": round(percentile(lags, 99), 2) if lags else None,
        "loop_lag_max_ms": round(max(lags), 2) if lags else None,
        "loop_lag_slowest": slowest_probes(probes, tally.spans, soak.traffic_start),
        "client_cores": round(cpu.own_cores, 2),
        "server_and_other_cores": round(cpu.other_cores, 2),
        "server_died": soak.server_died,
        "client_errors": soak.client_errors,
        "server_exit_status": soak.server.exit_status,
        "server_killed": soak.server.killed,
        "server_log_counts": soak.server.log_counts(),
        "samples": [asdict(s) for s in samples],
    }
    report["failures"] = failures(report, args)
    report["warnings"] = warnings(report)
    report["ok"] = not report["failures"]
    return report


def failures(report: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """Why the run failed (empty when it passed)."""
    why: list[str] = []
    if report["server_died"]:
        why.append(report["server_died"])
    if report["client_errors"]:
        why.append(f"{len(report['client_errors'])} clients failed: {report['client_errors'][:3]}")
    if report["server_errors"]:
        why.append(f"{report['server_errors']} 5xx responses: {report['server_errors_by_category']}")
    if report["hangs"]:
        why.append(f"{report['hangs']} requests hung (no answer within {args.request_timeout:g} s)")
    if report["broken"]:
        why.append(f"{report['broken']} broken responses: {report['broken_by_category']}")
    if report["leaked_blocks"] is None:
        why.append("the KV blocks could not be read from /metrics at the end")
    elif report["leaked_blocks"] or report["running_after"] or report["waiting_after"]:
        why.append(
            f"{report['leaked_blocks']} KV blocks not free after a {report['quiet_wait_s']:g} s quiet wait "
            f"(running {report['running_after']}, waiting {report['waiting_after']})"
        )
    slope = report["rss_slope_mib_per_10k_requests"]
    if slope is not None and slope > args.max_rss_slope:
        why.append(f"RSS grows {slope:.2f} MiB per 10,000 requests after the warm-up (limit {args.max_rss_slope:g})")
    if args.strict and report["bad_inputs_accepted"]:
        why.append(f"bad inputs accepted with a 2xx: {report['bad_inputs_accepted']}")
    return why


def warnings(report: dict[str, Any]) -> list[str]:
    """What looks wrong without failing the run."""
    notes: list[str] = []
    if report["bad_inputs_accepted"]:
        notes.append(f"bad inputs accepted with a 2xx (a 4xx was expected): {report['bad_inputs_accepted']}")
    if report["rss_slope_mib_per_10k_requests"] is None:
        notes.append(f"too few samples after the warm-up for an RSS slope ({report['rss_slope_points']})")
    if report["loop_lag_failed_probes"]:
        notes.append(f"{report['loop_lag_failed_probes']} GET /health probes failed")
    if report["server_killed"]:
        notes.append("the server did not stop on SIGTERM and was killed")
    elif report["server_exit_status"] not in (0, None, -signal.SIGTERM):
        notes.append(f"the server exited with status {report['server_exit_status']} on SIGTERM")
    counts = report["server_log_counts"]
    if counts["error_lines"] or counts["tracebacks"]:
        notes.append(
            f"the server log has {counts['error_lines']} ERROR lines and {counts['tracebacks']} tracebacks: "
            f"{report['server_log']}"
        )
    return notes


def summary(report: dict[str, Any], args: argparse.Namespace) -> str:
    """The human-readable report."""

    def num(value: Any, unit: str = "", digits: int = 1) -> str:
        if value is None:
            return "n/a"
        return f"{value:,.{digits}f}{unit}" if isinstance(value, float) else f"{value:,}{unit}"

    rows = []
    for name in sorted(set(report["sent"]) | set(report["skipped"])):
        outcomes = report["outcomes"].get(name, {})
        text = ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items(), key=lambda kv: -kv[1]))
        skipped = report["skipped"].get(name, 0)
        if skipped:
            text = (text + "; " if text else "") + f"skipped {skipped}"
        rows.append([name, str(report["sent"].get(name, 0)), text])
    lines = [
        f"soak of aiocb serve: {report['model']} (context {report['context_length']}), {args.concurrency} clients, "
        f"{report['traffic_s']:.0f} s of traffic",
        f"server: {' '.join(report['server_command'])}",
        f"server log: {report['server_log']} ({report['server_log_counts']['error_lines']} ERROR lines, "
        f"{report['server_log_counts']['tracebacks']} tracebacks); exit status {report['server_exit_status']}"
        + (" (killed)" if report["server_killed"] else ""),
        "",
        markdown_table(["category", "sent", "outcomes"], rows),
        "",
        "status codes:     " + ", ".join(f"{k} {v}" for k, v in report["status_codes"].items()),
        f"requests:         {num(report['requests_finished'])} finished, {num(report['requests_per_s'])}/s; "
        f"{num(report['generated_tokens'])} tokens generated by the engine",
        f"5xx:              {report['server_errors']} {report['server_errors_by_category'] or ''}",
        f"hangs:            {report['hangs']} (request timeout {args.request_timeout:g} s)",
        f"broken responses: {report['broken']} {report['broken_by_category'] or ''}",
        f"bad inputs accepted (expected a 4xx): {report['bad_inputs_accepted'] or 'none'}",
        f"KV blocks:        {num(report['leaked_blocks'])} leaked of {num(report['total_blocks'])} after a "
        f"{report['quiet_wait_s']:g} s quiet wait (running {report['running_after']}, waiting "
        f"{report['waiting_after']}); peak in use {num(report['peak_used_blocks'])}",
        f"server RSS:       start {num(report['rss_start_mib'], ' MiB')}, after warm-up "
        f"{num(report['rss_after_warmup_mib'], ' MiB')}, end {num(report['rss_end_mib'], ' MiB')}, "
        f"peak {num(report['rss_peak_mib'], ' MiB')}",
        f"RSS slope:        {num(report['rss_slope_mib_per_10k_requests'], ' MiB', 2)} per 10,000 requests after "
        f"the first {report['warmup_s']:g} s ({report['rss_slope_points']} samples; limit {args.max_rss_slope:g})",
        f"loop lag:         GET /health p50 {num(report['loop_lag_p50_ms'], ' ms')}, p99 "
        f"{num(report['loop_lag_p99_ms'], ' ms')}, max {num(report['loop_lag_max_ms'], ' ms')} "
        f"({report['loop_lag_probes']} probes, {report['loop_lag_failed_probes']} failed)",
        f"CPU:              clients {report['client_cores']:.2f} cores, server and the rest "
        f"{report['server_and_other_cores']:.2f} cores",
        "slowest probes:   "
        + "; ".join(
            f"{p['latency_ms']:g} ms at {p['at_s']:g} s ({p['requests_in_flight']} in flight"
            + "".join(f", {k} {v}" for k, v in p["bad_inputs_and_long_prompts_in_flight"].items())
            + ")"
            for p in report["loop_lag_slowest"][:3]
        ),
    ]
    for outcome, examples in report["examples"].items():
        lines.append(f"examples of {outcome}:")
        lines += [f"  {example}" for example in examples[:5]]
    lines += [f"warning: {note}" for note in report["warnings"]]
    lines.append("")
    if report["failures"]:
        lines.append("FAILED:")
        lines += [f"  {why}" for why in report["failures"]]
    else:
        lines.append("OK: no 5xx, no hang, no broken response, no leaked block, RSS slope within the limit")
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def server_command(args: argparse.Namespace, port: int, env: dict[str, str]) -> list[str]:
    """The ``aiocb serve`` command line; ``--server-arg`` values come last, so they win."""
    command = [sys.executable, "-m", "aiocb", "serve"]
    if args.model is not None:
        command.append(args.model)
    elif not model_argument_optional(env):
        command.append(str(BUNDLED_MODEL))
    command += ["--host", "127.0.0.1", "--port", str(port), "--log-level", args.server_log_level]
    if args.torch_threads:
        command += ["--torch-threads", str(args.torch_threads)]
    if args.num_blocks:
        command += ["--num-blocks", str(args.num_blocks)]
    return command + list(args.server_arg)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--minutes", type=float, default=30.0, help="minutes of traffic (default 30)")
    parser.add_argument("--concurrency", type=int, default=32, help="concurrent clients (default 32)")
    parser.add_argument("--model", default=None, help="model to serve (default: the bundled pycode-tiny)")
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for aiocb serve, repeatable (--server-arg=--page-size --server-arg=64)",
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=2,
        help="server --torch-threads (default 2: on a 2-core machine 62 requests/s against 46 with 1, at the same "
        "loop lag, the clients taking ~0.15 core; 0: torch's choice)",
    )
    parser.add_argument(
        "--num-blocks",
        type=int,
        default=512,
        help="server --num-blocks (default 512, touched within the warm-up, so that the RSS slope shows "
        "leaks rather than a cache sized from free RAM being touched for the first time; 0: the server's sizing)",
    )
    parser.add_argument("--max-tokens", type=int, default=32, help="largest max_tokens of a request (default 32)")
    parser.add_argument("--request-timeout", type=float, default=120.0, help="seconds before a request is hung")
    parser.add_argument(
        "--cancel-within", type=float, default=1.5, help="cancelled requests are abandoned within this (s)"
    )
    parser.add_argument(
        "--oversized-bytes", type=int, default=64 * MIB, help="size of the oversized body (default 64 MiB)"
    )
    parser.add_argument(
        "--oversized-weight", type=float, default=0.2, help="share of oversized bodies, next to 20 for completions"
    )
    parser.add_argument("--nested-depth", type=int, default=100_000, help="depth of the nested JSON (100,000)")
    parser.add_argument("--stop-strings", type=int, default=10_000, help="stop strings of that bad input (10,000)")
    parser.add_argument("--max-requests", type=int, default=0, help="stop after this many (0: 1,000 per second)")
    parser.add_argument("--sample-interval", type=float, default=2.0, help="seconds between samples (default 2)")
    parser.add_argument("--probe-interval", type=float, default=0.1, help="seconds between /health probes")
    parser.add_argument("--warmup-fraction", type=float, default=0.2, help="share of the run left out of the slope")
    parser.add_argument(
        "--max-rss-slope", type=float, default=1.0, help="MiB per 10,000 requests allowed after warm-up (1.0)"
    )
    parser.add_argument("--quiet-wait", type=float, default=10.0, help="seconds to wait for every block free")
    parser.add_argument("--startup-timeout", type=float, default=300.0, help="seconds the server may take to start")
    parser.add_argument("--kill-timeout", type=float, default=30.0, help="SIGKILL the server this long after SIGTERM")
    parser.add_argument("--server-log", type=Path, default=None, help="the server's log file (default: a temp file)")
    parser.add_argument(
        "--server-log-level", default="warning", help="server --log-level (default warning: no access log)"
    )
    parser.add_argument("--strict", action="store_true", help="also fail when a bad input gets a 2xx")
    parser.add_argument("--seed", type=int, default=0, help="seed of the traffic's random choices")
    parser.add_argument("--json", type=Path, default=None, help="write the numbers to this file")
    args = parser.parse_args(argv)
    if args.minutes <= 0 or args.concurrency < 1 or args.max_tokens < 1:
        parser.error("--minutes, --concurrency and --max-tokens must be positive")
    return args


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # stop the server on `kill` too
    machine = machine_info()
    print(machine.describe(), file=sys.stderr, flush=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    if args.server_log is None:
        handle, name = tempfile.mkstemp(prefix="aiocb-soak-", suffix=".log")
        os.close(handle)
        args.server_log = Path(name)
    port = free_port()
    command = server_command(args, port, env)
    print(f"starting: {' '.join(command)}\nserver log: {args.server_log}", file=sys.stderr, flush=True)
    server = ServerProcess(command, env, args.server_log, args.kill_timeout)
    soak = Soak(args, server, f"http://127.0.0.1:{port}")
    prober = HealthProber(f"http://127.0.0.1:{port}/health", interval=args.probe_interval)
    runner: Callable[[Any], Any] = asyncio.run
    with contextlib.suppress(ImportError):
        import uvloop

        runner = uvloop.run
    try:
        prober.start()
        with CpuContention() as cpu:
            runner(soak.run())
    except (Exception, KeyboardInterrupt) as exc:
        print(f"soak: the run stopped: {type(exc).__name__}: {exc}", file=sys.stderr)
        tail = server.log_tail()
        if tail:
            print(f"server log ({args.server_log}), last lines:\n{tail}", file=sys.stderr)
        return 130 if isinstance(exc, KeyboardInterrupt) else 2
    finally:
        prober.stop()
        server.stop()
    report = build_report(soak, prober, cpu, command)
    report["machine"] = machine.as_dict()
    report["args"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(summary(report, args))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
