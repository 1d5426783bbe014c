"""Event-loop lag while aiocb runs a large batch of a near-zero-compute model.

A 1-layer Qwen3 (hidden 16, vocab 256) generates 32 tokens for each of ``--rows``
16-token prompts in one batch, while a heartbeat sleeps 1 ms at a time on the same loop
and records how late it wakes: the time aiocb's own work (planning, snapshots, updates,
delivery) held the loop.

    python bench/loop_lag.py [--rows 1024] [--repeats 3] [--torch-threads N]
    python bench/loop_lag.py --samples 1024    # one sampled request with that many samples
    python bench/loop_lag.py --burst           # a generate task per prompt

With ``--samples`` the batch is one request with ``n`` samples instead: the heartbeat
then also sees the request's samples being made and queued (``await add_request``). With
``--burst`` each prompt is its own ``manager.generate`` task, all gathered at once (an
agent's fan-out): the heartbeat also sees their admission.

On a machine with few cores, torch's own threads (one per core by default) and the
event loop's thread compete for them: ``--torch-threads`` (the cores less one) leaves the
loop a core of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/loop_lag.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import aiocb
from bench.loop_watch import Heartbeat


async def _run(model: Qwen3ForCausalLM, rows: int, samples: int, burst: bool) -> str:
    rows = max(rows, samples)
    config = aiocb.ContinuousBatchingConfig(
        max_requests_per_batch=rows, num_blocks=rows * 4 + 8, page_size=16, max_batch_tokens=max(rows * 16, 2048)
    )
    async with aiocb.Manager(model, continuous_batching_config=config, num_requests_hint=rows) as manager:
        await manager.generate_batch([[1] * 16] * 8, max_new_tokens=4)  # warm-up
        async with Heartbeat() as beat:
            started = time.perf_counter()
            if samples:
                await manager.generate([7] * 16, max_new_tokens=32, n=samples, do_sample=True, seed=1)
            elif burst:
                await asyncio.gather(*(manager.generate([i % 200 + 1] * 16, max_new_tokens=32) for i in range(rows)))
            else:
                await manager.generate_batch([[i % 200 + 1] * 16 for i in range(rows)], max_new_tokens=32)
            wall = time.perf_counter() - started
    what = f"one request, n {samples}" if samples else f"rows {rows}{' (a task each)' if burst else ''}"
    return f"{what}: wall {wall:.2f} s; {beat.summary()}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--samples", type=int, default=0, help="one request with this many samples (0: --rows requests)"
    )
    parser.add_argument("--burst", action="store_true", help="a manager.generate task per prompt, gathered")
    parser.add_argument("--torch-threads", type=int, default=0, help="torch's intra-op threads (0: its default)")
    args = parser.parse_args(argv)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=256,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=512,
    )
    model = Qwen3ForCausalLM(config).eval()
    for _ in range(args.repeats):
        print(asyncio.run(_run(model, args.rows, args.samples, args.burst)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
