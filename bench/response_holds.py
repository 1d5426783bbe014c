"""How long the server's event loop is held while it answers one very large response, or
takes one very large prompt.

Each scenario sends one request to the OpenAI app over raw ASGI (the body is counted and
dropped, as a server writes it to a socket: a test client that assembles a 50 MB body holds
the loop itself), with a 1 ms heartbeat on the loop and the cyclic garbage collector on, as
in a server. It reports the response's size, its wall time, the five longest heartbeat lags
and the full collections made meanwhile. The model is the bundled one, on a 4,096-block cache.

* ``chat``: one chat completion, ``n`` 64, 512 tokens each, ``top_logprobs`` 20 (about
  47 MB of JSON, 33,000 logprob entries with 20 alternatives each);
* ``echo``: one completion, ``n`` 64, echoing a 600-token prompt with ``logprobs`` 20 and
  one new token (about 25 MB);
* ``prompt``: one completion of a 6-million-character text prompt (Python code, about
  2 million tokens, near the default 8 MiB body limit) cut to its last 64 tokens
  (``truncate_prompt_tokens``), one new token. ``--tokenize-in-process`` tokenizes it in
  the server's process, as every prompt was before the tokenizer process;
* ``ids``: one completion whose prompt is 2.5 million token ids (a 7.5 MB body, parsed a
  run of elements at a time in the tokenizer thread, then refused: longer than the
  context), answered 400;
* ``tools``: one chat completion offering 256 tools (8 string arguments each) under
  ``tool_choice`` ``required``, its rendered prompt cut to its last 256 tokens, 16 tokens:
  the tools' structural tag (every schema) checked and written as JSON, and compiled;
* ``stream`` and ``stream_usage``: one streamed chat completion, ``n`` 64, 256 tokens each
  (some 16,000 chunks), with ``stream_options`` ``include_usage``, and for the second
  ``continuous_usage_stats`` too (each chunk carries its choice's usage): the loop
  thread's CPU time of the two tells what the usage in every chunk costs.

A request's body is written as JSON before the heartbeat starts.

    python bench/response_holds.py                  # every scenario, once each
    python bench/response_holds.py --scenarios chat --repeat 3
    python bench/response_holds.py --scenarios prompt --repeat 3 --tokenize-in-process
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/response_holds.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiocb
from aiocb import tokenizer_process
from aiocb.default_model import load_default_model
from aiocb.server import build_app
from bench.common import machine_info

SCENARIOS = ("chat", "echo", "prompt", "ids", "tools", "stream", "stream_usage")
MODEL_NAME = "bundled"


def _bodies(vocab_size: int) -> dict[str, tuple[str, dict[str, Any]]]:
    rng = random.Random(1)
    prompt = [rng.randrange(3, vocab_size) for _ in range(600)]
    chat = {
        "messages": [{"role": "user", "content": "Write a function."}],
        "n": 64,
        "max_tokens": 512,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 20,
        "temperature": 1.0,
    }
    echo = {"prompt": prompt, "n": 64, "echo": True, "logprobs": 20, "max_tokens": 1, "temperature": 1.0}
    words = ["def", " return", " self", " x", " import", " foo", " bar", "(", ")", ":", "\n", "    ", " 1234", " print"]
    text = "".join(rng.choice(words) for _ in range(1_500_000))
    long = {"prompt": text, "truncate_prompt_tokens": 64, "max_tokens": 1, "temperature": 1.0}
    arguments = {f"a{j}": {"type": "string", "description": "x" * 30} for j in range(8)}
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": "does a thing " * 20,
                "parameters": {"type": "object", "properties": arguments},
            },
        }
        for i in range(256)
    ]
    called = {
        "messages": [{"role": "user", "content": "Call one."}],
        "tools": tools,
        "tool_choice": "required",
        "truncate_prompt_tokens": 256,
        "max_tokens": 16,
    }
    streamed = {
        "messages": [{"role": "user", "content": "Write a function."}],
        "n": 64,
        "max_tokens": 256,
        "ignore_eos": True,
        "temperature": 1.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    usage = {**streamed, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    return {
        "chat": ("/v1/chat/completions", chat),
        "stream": ("/v1/chat/completions", streamed),
        "stream_usage": ("/v1/chat/completions", usage),
        "echo": ("/v1/completions", echo),
        "prompt": ("/v1/completions", long),
        "ids": ("/v1/completions", {"prompt": [7] * 2_500_000, "max_tokens": 1}),
        "tools": ("/v1/chat/completions", called),
    }


def _payload(body: dict[str, Any]) -> bytes:
    return json.dumps({"model": MODEL_NAME, **body}).encode()


async def _post(app: Any, path: str, payload: bytes) -> tuple[int, int]:
    """``(status, body bytes)`` of one POST of ``payload`` through ``app``, the response's
    body dropped as it comes."""
    received = False
    status, size = 0, 0

    async def receive() -> dict[str, Any]:
        nonlocal received
        if not received:
            received = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await asyncio.Event().wait()  # (the client stays: no disconnect)
        raise AssertionError

    async def send(message: dict[str, Any]) -> None:
        nonlocal status, size
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            size += len(message.get("body", b""))

    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 1),
        "server": ("bench", 80),
        "state": {},
    }
    await app(scope, receive, send)
    return status, size


async def _beat(lags: list[float], done: asyncio.Event) -> None:
    """Sleep a millisecond at a time until ``done``, appending how late each wake-up is."""
    while not done.is_set():
        before = time.perf_counter()
        await asyncio.sleep(0.001)
        lags.append(time.perf_counter() - before - 0.001)


async def run(scenarios: list[str], repeat: int) -> None:
    model, tokenizer = load_default_model()
    config = aiocb.ContinuousBatchingConfig(num_blocks=4096, page_size=16)
    bodies = _bodies(len(tokenizer))
    async with aiocb.Manager(model, tokenizer=tokenizer, continuous_batching_config=config) as manager:
        app = build_app(manager, tokenizer, MODEL_NAME)
        await _post(app, "/v1/completions", _payload({"prompt": "warm up", "max_tokens": 4}))
        for _ in range(repeat):
            for name in scenarios:
                path, body = bodies[name]
                payload = _payload(body)
                lags: list[float] = []
                done = asyncio.Event()
                heart = asyncio.create_task(_beat(lags, done))
                full_before = gc.get_stats()[2]["collections"]
                began, cpu = time.perf_counter(), time.thread_time()
                status, size = await _post(app, path, payload)
                took, cpu = time.perf_counter() - began, time.thread_time() - cpu
                await asyncio.sleep(0.02)
                done.set()
                await heart
                longest = ", ".join(f"{lag * 1e3:.0f}" for lag in sorted(lags)[-5:])
                print(
                    f"{name}: {status}, {size / 1e6:.0f} MB in {took:.1f} s (loop thread CPU {cpu:.2f} s); "
                    f"longest loop lags {longest} ms; "
                    f"{gc.get_stats()[2]['collections'] - full_before} full collections",
                    flush=True,
                )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, of {SCENARIOS}")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument(
        "--tokenize-in-process", action="store_true", help="tokenize long prompts in the server's process"
    )
    args = parser.parse_args(argv)
    if args.tokenize_in_process:
        tokenizer_process.PROCESS_PROMPT_CHARS = sys.maxsize
    scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = sorted(set(scenarios) - set(SCENARIOS))
    if unknown:
        parser.error(f"unknown scenarios {unknown}; choose from {SCENARIOS}")
    print(machine_info())
    asyncio.run(run(scenarios, args.repeat))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
