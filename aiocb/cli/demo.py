"""``aiocb demo``: concurrent generations from the packaged model, streamed live, then a summary.

Each of ``--concurrency`` slots runs one request at a time through one shared
:class:`aiocb.Manager`: it submits a prompt, streams the tokens as the step loop batches
them with the other slots' requests, and takes the next prompt as soon as its request
ends. Requests draw different token limits, so they end at different times and new ones
join the running batch mid-flight: that is continuous batching.

On a terminal the slots are redrawn in place with plain ANSI escape codes; with
``--plain``, or when stdout is not a terminal, each request prints one line when it ends.
Either way the run ends with one ``summary:`` line of ``key=value`` pairs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import random
import shutil
import statistics
import sys
import time
import unicodedata
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

import aiocb
from aiocb import Manager
from aiocb.cli.serve import device_problems
from aiocb.default_model import load_default_model

#: Openings of Python code for the model to continue.
PROMPTS: tuple[str, ...] = (
    "def ",
    "import os\n",
    "class Config:\n    def __init__(self",
    "def read_file(path):\n",
    "if __name__ == '__main__':\n",
    "    def __repr__(self):\n        return",
    "try:\n    import",
    "class Error(Exception):\n",
    "def parse_args(argv=None):\n",
    "with open(filename",
    "    @property\n    def name(self):\n",
    "        raise ValueError(",
    "    def __eq__(self, other):\n",
    "import sys\nimport re\n\n",
    "        for key, value in",
    'class Node:\n    """',
    "def _check(self, value):\n        if not isinstance(value,",
    "        return [x for x in",
    "    while True:\n        line =",
    "    @classmethod\n    def from_dict(cls,",
    "def main():\n    parser = argparse.",
    "    def __init__(self, name, value=None):\n        self.",
)

_RESET, _BOLD, _DIM, _GREEN, _CYAN = "\x1b[0m", "\x1b[1m", "\x1b[2m", "\x1b[32m", "\x1b[36m"
_HIDE_CURSOR, _SHOW_CURSOR, _CLEAR_LINE = "\x1b[?25l", "\x1b[?25h", "\x1b[2K"
_FRAME_SECONDS = 1 / 30


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _seed(text: str) -> int:
    """``--seed``: a request's seed, an int in [-2**63, 2**64)."""
    value = int(text)
    if not -(2**63) <= value < 2**64:
        raise argparse.ArgumentTypeError(f"must be in [-2**63, 2**64), got {value}")
    return value


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the flags of ``aiocb demo`` to ``parser``."""
    parser.add_argument("--requests", type=_positive_int, default=24, help="requests to generate (default 24)")
    parser.add_argument(
        "--concurrency", type=_positive_int, default=6, help="requests in flight at once, one per slot (default 6)"
    )
    parser.add_argument(
        "--max-new-tokens",
        type=_positive_int,
        default=80,
        help="most tokens per request (default 80); each request draws its own limit between half of this "
        "and this, so that requests end at different times",
    )
    parser.add_argument("--device", default="cpu", help="torch device to run on: cpu (default), cuda, cuda:1, ...")
    parser.add_argument("--seed", type=_seed, default=0, help="seeds the prompt order and the sampling (default 0)")
    parser.add_argument(
        "--plain",
        action="store_true",
        help="one line per finished request instead of the live view (default when stdout is not a terminal)",
    )
    parser.add_argument("--model", default=None, help="another model folder to use (default: the packaged pycode-tiny)")


def run_demo(args: argparse.Namespace) -> int:
    """Run ``aiocb demo`` with parsed ``args``; returns the process exit status."""
    out = sys.stdout
    live = not args.plain and _can_draw_live(out, args.concurrency)
    threads = torch.get_num_threads()
    if not os.environ.get("OMP_NUM_THREADS"):
        # The model's matmuls are far too small to gain from intra-op threads, and on a busy
        # machine OpenMP threads that spin-wait for each other make every step many times
        # slower (20x measured on 2 shared cores). Restored on return: tests call this.
        torch.set_num_threads(1)
    try:
        return asyncio.run(_demo(args, out, live=live))
    except KeyboardInterrupt:
        out.write("\ninterrupted\n")
        return 130
    finally:
        torch.set_num_threads(threads)
        if live:
            out.write(_SHOW_CURSOR)
            out.flush()


def _can_draw_live(out: TextIO, slots: int) -> bool:
    """Whether ``out`` is a terminal that can redraw ``slots`` lines in place."""
    if not out.isatty() or os.environ.get("TERM") == "dumb":
        return False
    return shutil.get_terminal_size().lines >= slots + 3


# ---------------------------------------------------------------------------- state


@dataclass
class _Slot:
    """What one slot shows: its current (or last) request."""

    request_id: str = ""
    prompt: str = ""
    text: str = ""
    tokens: int = 0
    finished: bool = False


@dataclass
class _Tally:
    """Counters for the summary, over the timed part of the run."""

    started: float = 0.0
    finished: int = 0
    tokens: int = 0
    ttfts: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class _Job:
    index: int
    prompt: str
    max_new_tokens: int
    seed: int


def _jobs(args: argparse.Namespace) -> list[_Job]:
    """The requests to run: prompts in a seeded order, each with its own token limit and seed."""
    rng = random.Random(args.seed)
    order = list(PROMPTS)
    rng.shuffle(order)
    low = max(1, args.max_new_tokens // 2)
    return [
        _Job(i, order[i % len(order)], rng.randint(low, args.max_new_tokens), rng.getrandbits(32))
        for i in range(args.requests)
    ]


# ---------------------------------------------------------------------------- the run


async def _demo(args: argparse.Namespace, out: TextIO, *, live: bool) -> int:
    problems = device_problems(args.device, choices="cpu, cuda or cuda:N")
    if problems:
        print(f"aiocb demo: {problems[0]}", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    loading = time.perf_counter()
    try:
        model, tokenizer = load_default_model(device, path=args.model)
    except FileNotFoundError as exc:
        print(f"aiocb demo: {exc}", file=sys.stderr)
        return 1
    jobs = _jobs(args)
    prompt_tokens = max(len(tokenizer.encode(job.prompt)) for job in jobs)
    context = model.config.max_position_embeddings
    if prompt_tokens + args.max_new_tokens > context:
        print(
            f"aiocb demo: --max-new-tokens {args.max_new_tokens} does not fit the model's context of {context} "
            f"tokens after the longest prompt ({prompt_tokens} tokens): at most {context - prompt_tokens}",
            file=sys.stderr,
        )
        return 2
    name = Path(str(model.name_or_path)).name
    params = sum(p.numel() for p in model.parameters())
    out.write(
        f"aiocb demo: {name} ({params / 1e6:.1f}M parameters) on {device}, loaded in "
        f"{time.perf_counter() - loading:.1f}s; {args.requests} requests, {args.concurrency} at a time, "
        f"up to {args.max_new_tokens} new tokens each\n"
    )
    out.flush()

    # The cache only has to hold the requests in flight (twice over, for the scheduler's
    # safety margin); left to itself it would take a share of all free memory.
    page = 64
    longest = prompt_tokens + args.max_new_tokens
    config = aiocb.ContinuousBatchingConfig(
        page_size=page, num_blocks=2 * args.concurrency * (math.ceil(longest / page) + 1), seed=args.seed
    )
    slots = [_Slot() for _ in range(args.concurrency)]
    tally = _Tally()
    glyphs = _Glyphs.for_stream(out)
    async with Manager(model, continuous_batching_config=config, num_requests_hint=args.concurrency) as manager:
        # One short request first: the first forward pass pays one-off costs (allocation,
        # kernel selection, CUDA graph capture) that would otherwise distort the timings.
        await manager.generate(tokenizer.encode(PROMPTS[0]), max_new_tokens=2, seed=args.seed)
        warm_up_steps = manager.statistics().steps
        pending = iter(jobs)
        view = _LiveView(out, slots, glyphs, tally, len(jobs)) if live else None
        tally.started = time.perf_counter()
        workers = [
            asyncio.create_task(_run_slot(manager, tokenizer, pending, slot, tally, view, out)) for slot in slots
        ]
        drawing = asyncio.create_task(view.run()) if view is not None else None
        try:
            await asyncio.gather(*workers)
        finally:
            for worker in workers:
                worker.cancel()
            if view is not None and drawing is not None:
                view.stop()
                await drawing
        steps = manager.statistics().steps - warm_up_steps
    elapsed = time.perf_counter() - tally.started
    out.write(_summary(tally, elapsed, steps) + "\n")
    out.flush()
    return 0


async def _run_slot(
    manager: aiocb.Manager,
    tokenizer: Any,
    pending: Iterator[_Job],
    slot: _Slot,
    tally: _Tally,
    view: _LiveView | None,
    out: TextIO,
) -> None:
    """Run jobs one after the other in ``slot`` until none is left."""
    # All slots draw from one iterator, so each job runs once, in the first slot to free up.
    for job in pending:
        prompt_ids = tokenizer.encode(job.prompt)
        sent = time.perf_counter()
        request_id = await manager.add_request(
            prompt_ids, request_id=f"req_{job.index}", max_new_tokens=job.max_new_tokens, seed=job.seed
        )
        slot.request_id, slot.prompt, slot.text, slot.tokens, slot.finished = request_id, job.prompt, "", 0, False
        first_token: float | None = None
        output: aiocb.GenerationOutput | None = None
        async for output in manager.stream(request_id):
            if first_token is None and output.generated_tokens:
                first_token = time.perf_counter() - sent
            slot.text = tokenizer.decode(output.generated_tokens, skip_special_tokens=True)
            slot.tokens = len(output.generated_tokens)
        assert output is not None
        slot.finished = True
        tally.finished += 1
        tally.tokens += len(output.generated_tokens)
        if first_token is not None:
            tally.ttfts.append(first_token)
        ttft = f"{first_token * 1000:.0f} ms" if first_token is not None else "-"
        said = f"[{request_id}] {slot.tokens} tokens ({output.finish_reason}), time to first token {ttft}: "
        if view is not None:
            view.log(said, job.prompt, slot.text)
        else:
            out.write(f"{said}{job.prompt!r} + {slot.text!r}\n")
            out.flush()


def _summary(tally: _Tally, elapsed: float, steps: int) -> str:
    """The final ``key=value`` line (tests and scripts parse it)."""
    ttfts = sorted(tally.ttfts)
    median = statistics.median(ttfts) * 1000 if ttfts else float("nan")
    p90 = ttfts[math.ceil(0.9 * len(ttfts)) - 1] * 1000 if ttfts else float("nan")
    return (
        f"summary: requests={tally.finished} tokens={tally.tokens} elapsed_s={elapsed:.2f} "
        f"tokens_per_s={tally.tokens / elapsed:.1f} ttft_median_ms={median:.1f} ttft_p90_ms={p90:.1f} steps={steps}"
    )


# ---------------------------------------------------------------------------- live view


@dataclass(frozen=True)
class _Glyphs:
    """Symbols of the live view, with ASCII stand-ins for terminals that lack them."""

    newline: str
    tab: str
    ellipsis: str
    running: str
    done: str

    @classmethod
    def for_stream(cls, out: TextIO) -> _Glyphs:
        fancy = cls(newline="⏎", tab="⇥", ellipsis="…", running="▸", done="✓")
        try:
            "".join(vars(fancy).values()).encode(getattr(out, "encoding", None) or "ascii")
        except (UnicodeEncodeError, LookupError):
            return cls(newline="\\n", tab="\\t", ellipsis="~", running=">", done="*")
        return fancy


def _visible(text: str, glyphs: _Glyphs) -> str:
    """``text`` on one line, every character one terminal cell wide."""
    chars = []
    for ch in text:
        if ch == "\n":
            chars.append(glyphs.newline)
        elif ch == "\t":
            chars.append(glyphs.tab)
        elif not ch.isprintable() or unicodedata.east_asian_width(ch) in "WF" or unicodedata.combining(ch):
            chars.append("?")  # control, double-width or zero-width: would break the column count
        else:
            chars.append(ch)
    return "".join(chars)


def _fit(prompt: str, text: str, width: int, ellipsis: str) -> tuple[str, str]:
    """The tail of ``prompt + text`` that fits in ``width`` cells, split back into its two parts.

    The tail, because the newest tokens are what a reader watches.
    """
    if width <= 0:
        return "", ""
    if len(prompt) + len(text) <= width:
        return prompt, text
    keep = width - len(ellipsis)
    if len(text) >= keep:
        return "", ellipsis + text[len(text) - keep :]
    return ellipsis + prompt[len(prompt) - (keep - len(text)) :], text


class _LiveView:
    """Redraws one line per slot, in place, at most 30 times a second; each finished
    request's line goes above them, for good (however short-lived, every request is seen)."""

    def __init__(self, out: TextIO, slots: Sequence[_Slot], glyphs: _Glyphs, tally: _Tally, total: int) -> None:
        self._out = out
        self._slots = slots
        self._glyphs = glyphs
        self._tally = tally
        self._total = total
        self._colors = not os.environ.get("NO_COLOR")
        self._drawn_lines = 0
        self._last_frame: list[str] = []
        self._finished: list[tuple[str, str, str]] = []
        self._stopping = asyncio.Event()

    def log(self, said: str, prompt: str, text: str) -> None:
        """Write a finished request's line above the slots with the next frame."""
        self._finished.append((said, prompt, text))

    def stop(self) -> None:
        """Draw a last frame and end :meth:`run`."""
        self._stopping.set()

    async def run(self) -> None:
        """Draw until :meth:`stop`; the slots change under it as tokens arrive."""
        self._out.write(_HIDE_CURSOR)
        try:
            while not self._stopping.is_set():
                self._draw()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), _FRAME_SECONDS)
            self._draw()
        finally:
            self._out.write(_SHOW_CURSOR)
            self._out.flush()

    def _draw(self) -> None:
        width = shutil.get_terminal_size().columns - 1  # never the last column: some terminals wrap there
        frame = [self._line(i, slot, width) for i, slot in enumerate(self._slots)]
        frame.append(self._footer(width))
        if frame == self._last_frame and not self._finished:
            return
        parts = [f"\x1b[{self._drawn_lines}F"] if self._drawn_lines else []
        parts.extend(f"{_CLEAR_LINE}{self._logged(*finished, width)}\n" for finished in self._finished)
        self._finished.clear()
        parts.extend(f"{_CLEAR_LINE}{line}\n" for line in frame)
        self._out.write("".join(parts))
        self._out.flush()
        self._drawn_lines = len(frame)
        self._last_frame = frame

    def _line(self, index: int, slot: _Slot, width: int) -> str:
        g = self._glyphs
        if not slot.request_id:
            return self._paint(_DIM, f"{index + 1:>2} waiting"[:width])
        mark = g.done if slot.finished else g.running
        head = f"{index + 1:>2} {mark} {slot.request_id:<7} {slot.tokens:>3} "
        prompt, text = _fit(_visible(slot.prompt, g), _visible(slot.text, g), width - len(head), g.ellipsis)
        head_color = _GREEN if slot.finished else _CYAN
        return self._paint(head_color, head[:width]) + self._paint(_DIM, prompt) + self._paint(_BOLD, text)

    def _logged(self, said: str, prompt: str, text: str, width: int) -> str:
        g = self._glyphs
        prompt, text = _fit(_visible(prompt, g), _visible(text, g), width - len(said), g.ellipsis)
        return self._paint(_GREEN, said[:width]) + self._paint(_DIM, prompt) + self._paint(_BOLD, text)

    def _footer(self, width: int) -> str:
        tally = self._tally
        tokens = tally.tokens + sum(slot.tokens for slot in self._slots if not slot.finished)
        rate = tokens / max(time.perf_counter() - tally.started, 1e-9)
        line = f"   {tally.finished}/{self._total} requests done, {tokens} tokens, {rate:.0f} tokens/s"
        return self._paint(_DIM, line[:width])

    def _paint(self, color: str, text: str) -> str:
        return f"{color}{text}{_RESET}" if self._colors and text else text
