"""``aiocb demo``: several concurrent generations streamed live, then a summary."""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from typing import TextIO

import torch
from transformers import PreTrainedModel, Qwen3Config, Qwen3ForCausalLM

import aiocb


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``aiocb demo``."""
    parser.add_argument("--requests", type=int, default=12, help="requests to generate (default 12)")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight at once (default 4)")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens per request (default 48)")
    parser.add_argument("--plain", action="store_true", help="plain line output instead of a live view")
    parser.add_argument("--seed", type=int, default=0)


def demo_model(seed: int = 0) -> PreTrainedModel:
    """A small random-weight Qwen3 that needs no download."""
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=4096,
        initializer_range=0.3,
        bos_token_id=None,
        eos_token_id=None,
    )
    return Qwen3ForCausalLM(config).eval()


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo; returns the process exit status."""
    return asyncio.run(_demo(args, sys.stdout))


async def _demo(args: argparse.Namespace, out: TextIO) -> int:
    model = demo_model(args.seed)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(1, 2048) for _ in range(rng.randint(8, 64))] for _ in range(args.requests)]
    slots = asyncio.Semaphore(args.concurrency)
    ttfts: list[float] = []
    tokens = 0
    started = time.perf_counter()

    async with aiocb.Manager(model) as manager:

        async def one(index: int, prompt: list[int]) -> None:
            nonlocal tokens
            async with slots:
                sent = time.perf_counter()
                rid = await manager.add_request(prompt, max_new_tokens=args.max_new_tokens, temperature=0.8, seed=index)
                first = None
                async for chunk in manager.stream(rid):
                    if first is None:
                        first = time.perf_counter() - sent
                        ttfts.append(first)
                    if not args.plain:
                        out.write(f"\r[{rid:>7}] {len(chunk.generated_tokens):3d} tokens {chunk.generated_tokens[-6:]}")
                        out.flush()
                final = chunk
                tokens += len(final.generated_tokens)
                out.write(f"\r[{rid:>7}] done: {len(final.generated_tokens)} tokens ({final.finish_reason})\n")

        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    elapsed = time.perf_counter() - started
    out.write(
        f"summary: requests={len(prompts)} tokens={tokens} tokens_per_s={tokens / elapsed:.1f} "
        f"ttft_median_ms={statistics.median(ttfts) * 1000:.1f}\n"
    )
    return 0
