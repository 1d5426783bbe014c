"""How long building a manager holds a running event loop, and its first long prompt,
with a vocabulary of 151,000 tokens (Qwen's size).

Each repeat is a fresh process (the garbage collector's freezes happen once a process):
it imports ``aiocb.Manager`` before its event loop runs, as a program does at its top,
loads the bundled model and a synthetic byte-level BPE tokenizer of 151,000 tokens (made
by this script in a temporary folder), then, on a loop with a 1 ms heartbeat, builds the
manager with that tokenizer, starts it and awaits one 52,000-character text prompt cut to
its last 8 tokens (``truncate_prompt_tokens``: tokenized in the tokenizer process).
``--source memory`` gives the manager a tokenizer made in memory from the file's contents
(no file to load: the child gets a copy). ``--model qwen3-0.6b`` serves a model of
Qwen3-0.6B's shape (28 layers, bf16, seeded random weights: no download) instead of the
bundled one, whose KV cache the default plan makes gigabytes; ``--kernels fresh`` gives
each repeat an empty kernel cache directory (``$AIOCB_CACHE_DIR``), so the CPU C kernels
are compiled as on a machine's first run.

    python bench/startup_holds.py --repeat 3
    python bench/startup_holds.py --repeat 3 --source memory
    python bench/startup_holds.py --repeat 3 --model qwen3-0.6b --kernels fresh
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/startup_holds.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO_ROOT, machine_info

VOCAB_SIZE = 151_000
PROMPT = "hello world, " * 4_000


def write_tokenizer(folder: Path) -> None:
    """A byte-level BPE tokenizer of :data:`VOCAB_SIZE` tokens (seeded merges of printable
    characters), saved by transformers into ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    alphabet = [chr(c) for c in range(33, 127)] + ["Ġ"]
    vocab = {c: i for i, c in enumerate(alphabet)}
    tokens = list(alphabet)
    merges: list[tuple[str, str]] = []
    while len(vocab) < VOCAB_SIZE:
        left, right = rng.choice(tokens), rng.choice(alphabet)
        if len(left) <= 12 and left + right not in vocab:
            vocab[left + right] = len(vocab)
            merges.append((left, right))
            tokens.append(left + right)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="Ġ").save_pretrained(folder)


async def _beat(lags: list[tuple[float, float]], done: asyncio.Event) -> None:
    """Sleep a millisecond at a time until ``done``, appending (when, how late) for each."""
    while not done.is_set():
        before = time.perf_counter()
        await asyncio.sleep(0.001)
        lags.append((before, time.perf_counter() - before - 0.001))


def _longest(lags: list[tuple[float, float]], start: float, end: float) -> float:
    return max((lag for when, lag in lags if start <= when < end), default=0.0) * 1e3


async def _measure(model: Any, tokenizer: Any) -> dict[str, float]:
    from aiocb import Manager

    lags: list[tuple[float, float]] = []
    done = asyncio.Event()
    heart = asyncio.create_task(_beat(lags, done))
    await asyncio.sleep(0.02)
    began = time.perf_counter()
    manager = Manager(model, tokenizer=tokenizer)
    built = time.perf_counter()
    await asyncio.sleep(0.02)  # (the beats apart: a beat waiting through both counts in one)
    starting = time.perf_counter()
    manager.start()
    returned = time.perf_counter()
    await manager.wait_started()
    started = time.perf_counter()
    await asyncio.sleep(0.02)
    asking = time.perf_counter()
    await manager.generate(PROMPT, max_new_tokens=2, truncate_prompt_tokens=8)
    answered = time.perf_counter()
    await asyncio.sleep(0.02)
    done.set()
    await heart
    await manager.destroy()
    return {
        "build_ms": (built - began) * 1e3,
        "build_lag_ms": _longest(lags, began - 0.002, built),
        "start_call_ms": (returned - starting) * 1e3,
        "start_lag_ms": _longest(lags, starting - 0.002, started),
        "prompt_ms": (answered - asking) * 1e3,
        "prompt_lag_ms": _longest(lags, asking - 0.002, answered + 0.02),
    }


def qwen3_shaped_model() -> Any:
    """A model of Qwen3-0.6B's shape in bf16, its weights seeded random."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    config = Qwen3Config(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151_936, max_position_embeddings=40_960,
        tie_word_embeddings=True,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()


def child(folder: str, source: str, model_name: str) -> None:
    """One repeat, in its own process: prints its figures as JSON."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from aiocb import Manager  # noqa: F401 (before the loop, as at a program's top)
    from aiocb.default_model import load_default_model

    model = qwen3_shaped_model() if model_name == "qwen3-0.6b" else load_default_model()[0]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if source == "memory":
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, eos_token="Ġ")
    print(json.dumps(asyncio.run(_measure(model, tokenizer))))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--source", choices=("file", "memory"), default="file")
    parser.add_argument("--model", choices=("bundled", "qwen3-0.6b"), default="bundled")
    parser.add_argument("--kernels", choices=("cached", "fresh"), default="cached")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.source, args.model)
        return 0
    print(machine_info())
    with tempfile.TemporaryDirectory() as folder:
        write_tokenizer(Path(folder))
        for _ in range(args.repeat):
            with tempfile.TemporaryDirectory() as kernels:
                env = {**os.environ, "AIOCB_CACHE_DIR": kernels} if args.kernels == "fresh" else None
                run = subprocess.run(
                    [sys.executable, __file__, "--child", folder, "--source", args.source, "--model", args.model],
                    cwd=REPO_ROOT,
                    capture_output=True,
                    text=True,
                    check=True,
                    env=env,
                )
            figures = json.loads(run.stdout.strip().splitlines()[-1])
            print(
                f"Manager(): {figures['build_ms']:.1f} ms, longest lag {figures['build_lag_ms']:.1f} ms; "
                f"start(): {figures['start_call_ms']:.1f} ms, until started: longest lag "
                f"{figures['start_lag_ms']:.1f} ms; first long prompt: "
                f"{figures['prompt_ms']:.0f} ms, longest lag {figures['prompt_lag_ms']:.1f} ms",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
