"""Where aiocb holds the event loop: every callback that runs longer than a threshold.

Loop lag (``bench/loop_lag.py``) says how late a heartbeat wakes; this says which piece of
work made it late. Every callback the loop runs is timed (``asyncio.Handle._run`` is
wrapped), and those longer than ``--threshold-ms`` are listed by the task that ran them;
with ``--stacks`` a watcher thread also samples the loop thread's stack while a long
callback is still running (Python's switch interval is lowered to 0.1 ms so that it gets
the GIL in time: the timings are a little worse with it). Garbage collections on the
loop's thread longer than 0.5 ms are counted beside them: they run inside whichever
callback allocated.

Scenarios, each on a fresh Manager with ``bench/overhead.py``'s near-zero-compute model
(1 layer, hidden 16, vocab 4,096) and 16-token pages, after a warm-up request; inputs are built before timing:

* ``prefix``: ``generate_batch`` of ``--rows`` prompts of 512 tokens sharing a 480-token
  prefix (prefix caching on: every prompt block hashed, looked up and registered), 8 new
  tokens each;
* ``pages``: ``--rows`` 16-token prompts, 32 new tokens: every row fills a page in the same
  step (prefix caching on: the batch registers its blocks together);
* ``streams``: ``--rows`` 16-token requests of 24 new tokens, each read through
  ``manager.stream``;
* ``cancel``: ``--rows`` 16-token requests of up to 200 new tokens, all cancelled once the
  last added has 8 (the script's own loop over ``cancel_request`` is one callback of
  ``run_scenario``);
* ``samples``: one 16-token request with ``--rows`` samples (``n``), sampled, 8 new tokens:
  its samples made, queued and forked from the prompt together;
* ``bad_words``: one 16-token request with 64 samples, sampled, 8 new tokens, and 2,048
  two-token bad words (the 4,096 tokens ``aiocb serve`` allows by default), given as
  keyword arguments: the words checked, resolved and indexed;
* ``stop_strings``: ``--rows`` 16-token requests of 32 new tokens over a byte-level BPE
  tokenizer of 640 tokens (the model's vocabulary to match), each with the 64 stop strings of
  1,024 characters that ``aiocb serve`` allows (none is written): every token's text
  searched for them all;
* ``long_ids``: one request whose prompt is 100,000 token ids (a model of 131,072 positions),
  cut to its last 16 (``truncate_prompt_tokens``), 4 new tokens: the ids checked;
* ``big_batch``: ``generate_batch`` of 20 x ``--rows`` 4-token prompts (20,480 by default),
  4 new tokens each: the prompts sorted, their requests made, looked up, collected and freed;
* ``cancel_batch``: ``generate_batch`` of 20 x ``--rows`` 4-token prompts of up to 64 new
  tokens, cancelled once all are queued: its requests cancelled (the script waits 0.2 s
  for the steps after);
* ``min_tokens``: one request with 64 samples, sampled, of 32 new tokens, all under
  ``min_tokens`` with 4,000 stop token ids (``aiocb serve`` allows 4,096): the stop tokens banned
  at every step;
* ``scored``: one 4,000-token prompt scored with ``prompt_logprobs`` and 20 alternatives a
  position, 1 new token: a step scores up to ``--rows`` of its positions, and records them;
* ``batch_bad_words``: ``generate_batch`` of ``--rows`` / 16 16-token prompts, 8 new tokens,
  with 1,000 bad words of 2 to 4 tokens given once: the words resolved for each prompt and
  indexed;
* ``batch_sequence_bias``: ``generate_batch`` of ``--rows`` / 4 16-token prompts, 8 new
  tokens, with a ``sequence_bias`` of 900 two-token sequences;
* ``json_logit_bias``: 16 requests at once, 8 new tokens each, with a ``logit_bias`` of
  3,997 entries keyed by JSON object keys (strings), as a client's body gives them;
* ``required_tools``: the OpenAI app over the bundled model (raw ASGI, bodies written
  before timing): 8 chat completions at once, each offering 256 tools (8 string arguments
  each) under ``tool_choice`` ``required``, the rendered prompt cut to its last 256 tokens,
  8 tokens (after one such round, untimed, that compiles their structural tag).

Callbacks are listed by their task: ``run_scenario`` is the caller's (aiocb's
``generate_batch`` and ``add_requests`` run inside it), ``Manager._run_steps`` the step loop,
``_post`` an HTTP request's; with the loop thread's own CPU time in each (less than the wall
time where it waited for the GIL that worker threads held).

    python bench/loop_holds.py                      # all scenarios, 1,024 rows
    python bench/loop_holds.py --scenarios prefix --stacks
"""

from __future__ import annotations

import argparse
import asyncio
import asyncio.events
import collections
import gc
import json
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/loop_holds.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiocb
from aiocb.default_model import load_default_model
from aiocb.server import build_app
from bench.common import build_model, machine_info
from bench.overhead import TINY_SHAPE
from bench.response_holds import _post
from tests.server.conftest import build_tokenizer

SCENARIOS = (
    "prefix",
    "pages",
    "streams",
    "cancel",
    "samples",
    "bad_words",
    "stop_strings",
    "long_ids",
    "big_batch",
    "cancel_batch",
    "min_tokens",
    "scored",
    "batch_bad_words",
    "batch_sequence_bias",
    "json_logit_bias",
    "required_tools",
)
#: The scenarios whose model has more positions than ``TINY_SHAPE``'s.
CONTEXTS = {"long_ids": 131_072}
#: The scenarios whose manager has a tokenizer (and a model of its vocabulary).
TOKENIZED = ("stop_strings",)
#: The scenarios served by the bundled model and its tokenizer (a chat template with tools).
BUNDLED = ("required_tools",)
GC_REPORTED_S = 0.0005


class HoldRecorder:
    """Times every loop callback while :attr:`active`; samples stacks of long ones."""

    def __init__(self, threshold_s: float, stacks: bool) -> None:
        self.threshold_s = threshold_s
        self.active = False
        self.holds: list[tuple[float, str, float]] = []  # (seconds, task or callback, started)
        self.stacks: dict[float, list[str]] = collections.defaultdict(list)
        self.gc_pauses: list[tuple[int, float]] = []  # (generation, seconds)
        #: the loop thread's own CPU time in each long callback, by its start (less than its
        #: wall time where the thread waited for the GIL, which worker threads held)
        self.cpu: dict[float, float] = {}
        self._current: tuple[asyncio.Handle, float] | None = None
        self._gc_started = 0.0
        self._loop_thread = threading.get_ident()
        original = asyncio.events.Handle._run
        recorder = self

        def timed_run(handle: asyncio.Handle) -> None:
            started, used = time.perf_counter(), time.thread_time()
            recorder._current = (handle, started)
            try:
                original(handle)
            finally:
                recorder._current = None
                held = time.perf_counter() - started
                if recorder.active and held > recorder.threshold_s:
                    recorder.holds.append((held, _owner(handle), started))
                    recorder.cpu[started] = time.thread_time() - used

        asyncio.events.Handle._run = timed_run  # type: ignore[method-assign]
        gc.callbacks.append(self._on_gc)
        if stacks:
            sys.setswitchinterval(1e-4)
            threading.Thread(target=self._watch, args=(threading.get_ident(),), daemon=True).start()

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if threading.get_ident() != self._loop_thread:
            return  # (the step thread's collections do not hold the loop)
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self.active and (paused := time.perf_counter() - self._gc_started) > GC_REPORTED_S:
            self.gc_pauses.append((info["generation"], paused))

    def _watch(self, loop_thread: int) -> None:
        while True:
            time.sleep(0.0003)
            current = self._current
            if self.active and current is not None and time.perf_counter() - current[1] > self.threshold_s:
                frame = sys._current_frames().get(loop_thread)
                if frame is not None:
                    frames = traceback.extract_stack(frame)[-8:]
                    self.stacks[current[1]].append(" < ".join(f"{f.name}:{f.lineno}" for f in reversed(frames)))

    def report(self, label: str) -> str:
        holds = sorted(self.holds, reverse=True)
        lines = [f"## {label}", ""]
        by_owner = collections.Counter(owner for _, owner, _ in holds)
        lines.append(f"callbacks over {self.threshold_s * 1e3:g} ms: {len(holds)} ({dict(by_owner)})")
        for held, owner, started in holds[:5]:
            lines.append(f"- {held * 1e3:.2f} ms ({self.cpu.get(started, 0.0) * 1e3:.2f} ms CPU) in {owner}")
            for stack, count in collections.Counter(self.stacks.get(started, [])).most_common(2):
                lines.append(f"    {count}x {stack}")
        by_cpu = sorted(((self.cpu.get(started, 0.0), owner) for _, owner, started in holds), reverse=True)
        if by_cpu:
            longest = ", ".join(f"{cpu * 1e3:.2f} ms in {owner}" for cpu, owner in by_cpu[:3])
            lines.append(f"longest in the loop thread's CPU time: {longest}")
        pauses = sorted(self.gc_pauses, key=lambda p: -p[1])
        if pauses:
            per_gen = collections.Counter(gen for gen, _ in pauses)
            longest = ", ".join(f"gen {gen} {s * 1e3:.2f} ms" for gen, s in pauses[:4])
            lines.append(f"garbage collections over 0.5 ms: {len(pauses)} {dict(per_gen)}; longest {longest}")
        self.holds.clear()
        self.stacks.clear()
        self.gc_pauses.clear()
        return "\n".join(lines)


def _owner(handle: asyncio.Handle) -> str:
    callback = handle._callback  # type: ignore[attr-defined]
    task = getattr(callback, "__self__", None)
    if isinstance(task, asyncio.Task):
        return str(task.get_coro().__qualname__)  # type: ignore[union-attr]
    return str(getattr(callback, "__qualname__", type(callback).__name__))


async def run_scenario(
    recorder: HoldRecorder, name: str, rows: int, work: Callable[[aiocb.Manager], Awaitable[None]]
) -> str:
    if name in BUNDLED:
        model, tokenizer = load_default_model()
    else:
        tokenizer = build_tokenizer() if name in TOKENIZED else None
        vocab = 4096 if tokenizer is None else len(tokenizer)
        shape = {**TINY_SHAPE, "max_position_embeddings": CONTEXTS.get(name, TINY_SHAPE["max_position_embeddings"])}
        model = build_model(seed=0, vocab_size=vocab, num_hidden_layers=1, **shape)
    config = aiocb.ContinuousBatchingConfig(
        num_blocks=rows * 40 + 64,
        page_size=16,
        max_batch_tokens=16384,
        max_requests_per_batch=rows,
        allow_block_sharing=True,
    )
    async with aiocb.Manager(
        model, tokenizer=tokenizer, continuous_batching_config=config, num_requests_hint=rows
    ) as manager:
        await manager.generate([1, 2, 3], max_new_tokens=2)
        if name in BUNDLED:
            await work(manager)  # (once untimed: its constraint compiled, the app's first requests made)
        # Fenced by loop turns: the callbacks that begin and end the work are timed whole
        # (the one that turned the recorder off was never recorded).
        await asyncio.sleep(0)
        recorder.active = True
        started = time.perf_counter()
        try:
            await work(manager)
            await asyncio.sleep(0)
        finally:
            recorder.active = False
            wall = time.perf_counter() - started
    return recorder.report(f"{name}: {rows} rows, {wall:.2f} s")


def scenarios(rows: int) -> dict[str, Callable[[aiocb.Manager], Awaitable[None]]]:
    shared = [(i * 13) % 4000 + 1 for i in range(480)]
    long_prompts = [shared + [i % 4000 + 1] * 32 for i in range(rows)]
    short_prompts = [[i % 4000 + 1] * 16 for i in range(rows)]

    async def prefix(manager: aiocb.Manager) -> None:
        await manager.generate_batch(long_prompts, max_new_tokens=8)

    async def pages(manager: aiocb.Manager) -> None:
        await manager.generate_batch(short_prompts, max_new_tokens=32)

    async def streams(manager: aiocb.Manager) -> None:
        ids = await manager.add_requests(short_prompts, max_new_tokens=24)

        async def read(request_id: str) -> None:
            async for _ in manager.stream(request_id):
                pass

        await asyncio.gather(*(read(i) for i in ids))

    async def cancel(manager: aiocb.Manager) -> None:
        ids = await manager.add_requests(short_prompts, max_new_tokens=200)
        async for output in manager.stream(ids[-1]):  # (leaving the stream cancels this one)
            if len(output.generated_tokens) >= 8:
                break
        for request_id in ids:
            manager.cancel_request(request_id)
        await asyncio.sleep(0.2)  # the steps that let the cancelled requests go

    async def samples(manager: aiocb.Manager) -> None:
        await manager.generate(short_prompts[0], max_new_tokens=8, n=rows, do_sample=True, seed=1)

    bad_words = [[(i * 7) % 4000 + 1, (i * 13) % 4000 + 1] for i in range(2048)]

    async def bad_words_(manager: aiocb.Manager) -> None:
        await manager.generate(
            short_prompts[0], max_new_tokens=8, n=64, do_sample=True, seed=1, bad_words_ids=bad_words
        )

    stops = [f"{i:02} never written " * 60 for i in range(64)]

    async def stop_strings(manager: aiocb.Manager) -> None:
        prompts = [[i % 600 + 1] * 16 for i in range(rows)]
        await manager.generate_batch(prompts, max_new_tokens=32, ignore_eos=True, stop=stops)

    long_prompt = [(i * 7) % 4000 + 1 for i in range(100_000)]

    async def long_ids(manager: aiocb.Manager) -> None:
        await manager.generate(long_prompt, max_new_tokens=4, truncate_prompt_tokens=16)

    many_prompts = [[(i * 7) % 4000 + 1, (i * 13) % 4000 + 1, 5, 6] for i in range(20 * rows)]

    async def big_batch(manager: aiocb.Manager) -> None:
        await manager.generate_batch(many_prompts, max_new_tokens=4)

    async def cancel_batch(manager: aiocb.Manager) -> None:
        task = asyncio.ensure_future(manager.generate_batch(many_prompts, max_new_tokens=64))
        for _ in range(6000):  # (a minute at most)
            stats = manager.statistics()
            if stats.waiting_requests + stats.running_requests >= len(many_prompts):
                break
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0.2)

    stop_ids = list(range(4000))

    async def min_tokens(manager: aiocb.Manager) -> None:
        await manager.generate(
            [4095] * 16, max_new_tokens=32, min_tokens=32, stop_token_ids=stop_ids, n=64, do_sample=True, seed=1
        )

    async def scored(manager: aiocb.Manager) -> None:
        prompt = [(i * 7) % 4000 + 1 for i in range(4000)]
        await manager.generate(prompt, max_new_tokens=1, prompt_logprobs=True, top_logprobs=20)

    batch_words = [[(i * 7 + k * 101) % 4000 + 1 for k in range(2 + i % 3)] for i in range(1000)]

    async def batch_bad_words(manager: aiocb.Manager) -> None:
        await manager.generate_batch(short_prompts[: rows // 16], max_new_tokens=8, bad_words_ids=batch_words)

    sequences = {((i * 7) % 4000 + 1, (i * 13) % 4000 + 1): -2.0 for i in range(900)}

    async def batch_sequence_bias(manager: aiocb.Manager) -> None:
        await manager.generate_batch(short_prompts[: rows // 4], max_new_tokens=8, sequence_bias=sequences)

    json_bias = {str(token): -1.0 for token in range(3, 4000)}

    async def json_logit_bias(manager: aiocb.Manager) -> None:
        prompts = short_prompts[:16]
        await asyncio.gather(*(manager.generate(p, max_new_tokens=8, logit_bias=json_bias) for p in prompts))

    arguments = {
        "type": "object",
        "properties": {f"a{j}": {"type": "string", "description": "x" * 30} for j in range(8)},
    }
    tools = [
        {
            "type": "function",
            "function": {"name": f"tool_{i}", "description": "does a thing " * 20, "parameters": arguments},
        }
        for i in range(256)
    ]
    chat = {
        "model": "bundled",
        "messages": [{"role": "user", "content": "Call one."}],
        "tools": tools,
        "tool_choice": "required",
        "truncate_prompt_tokens": 256,
        "max_tokens": 8,
    }
    payload = json.dumps(chat).encode()

    apps: dict[int, Any] = {}  # (made by the untimed round)

    async def required_tools(manager: aiocb.Manager) -> None:
        if id(manager) not in apps:
            apps[id(manager)] = build_app(manager, manager.tokenizer, "bundled")
        app = apps[id(manager)]
        await asyncio.gather(*(_post(app, "/v1/chat/completions", payload) for _ in range(8)))

    return {
        "prefix": prefix,
        "pages": pages,
        "streams": streams,
        "cancel": cancel,
        "samples": samples,
        "bad_words": bad_words_,
        "stop_strings": stop_strings,
        "long_ids": long_ids,
        "big_batch": big_batch,
        "cancel_batch": cancel_batch,
        "min_tokens": min_tokens,
        "scored": scored,
        "batch_bad_words": batch_bad_words,
        "batch_sequence_bias": batch_sequence_bias,
        "json_logit_bias": json_logit_bias,
        "required_tools": required_tools,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, of {SCENARIOS}")
    parser.add_argument("--threshold-ms", type=float, default=1.0)
    parser.add_argument("--stacks", action="store_true", help="sample the loop thread's stack in long callbacks")
    args = parser.parse_args(argv)
    chosen = args.scenarios.split(",")
    unknown = sorted(set(chosen) - set(SCENARIOS))
    if unknown:
        parser.error(f"unknown scenarios {unknown}; choose from {SCENARIOS}")
    recorder = HoldRecorder(args.threshold_ms / 1e3, args.stacks)
    works = scenarios(args.rows)
    print(machine_info().describe())
    for name in chosen:
        print()
        print(asyncio.run(run_scenario(recorder, name, args.rows, works[name])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
