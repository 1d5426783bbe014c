"""Prefix caching: many requests behind one long system prompt, sharing on and off.

Workload (from the issue): 256 requests sharing a 1,000-token system prompt, each with
its own 32-token suffix, 32 new tokens each, greedy, EOS disabled, on the benchmark's
tiny Qwen3 (``bench/common.py``). Engines, in one process:

* ``aiocb-sharing``     - ``allow_block_sharing=True`` (prefix caching);
* ``aiocb-no-sharing``  - ``allow_block_sharing=False``;
* ``transformers-cb``   - transformers' ``generate_batch`` (its default block sharing on,
                          sdpa, ``max_batch_tokens=2048``), with a time limit.

Reported: prompt tokens the engine computed (aiocb's statistics: computed tokens minus one
decode token per generated token after the first), prefix-hit tokens, wall time, tokens/s.

    python bench/prefix.py [--page-size 64] [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/prefix.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiocb
from bench.common import MODEL_CONFIG, PAD_TOKEN_ID, build_model, machine_info, markdown_table, timed

HF_TIME_LIMIT_S = 900


def workload(requests: int, prefix_len: int, suffix_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = MODEL_CONFIG["vocab_size"]
    prefix = [rng.randrange(1, vocab) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(1, vocab) for _ in range(suffix_len)] for _ in range(requests)]


def run_aiocb(model: Any, prompts: list[list[int]], new: int, page_size: int, sharing: bool) -> dict[str, Any]:
    config = aiocb.ContinuousBatchingConfig(page_size=page_size, allow_block_sharing=sharing)

    async def main() -> tuple[dict[str, aiocb.GenerationOutput], int, int]:
        async with aiocb.Manager(model, continuous_batching_config=config) as manager:
            await manager.generate_batch(prompts[:2], max_new_tokens=2)  # warm-up
            before = manager.statistics()
            outputs = await manager.generate_batch(prompts, max_new_tokens=new)
            after = manager.statistics()
            assert after.free_blocks == after.total_blocks
        computed = after.tokens_computed - before.tokens_computed
        return outputs, computed, after.prefix_hit_tokens - before.prefix_hit_tokens

    (outputs, computed, hits), seconds = timed(lambda: asyncio.run(main()))
    tokens = sum(len(o.generated_tokens) for o in outputs.values())
    assert tokens == len(prompts) * new
    return {
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "prompt_tokens_computed": computed - len(prompts) * (new - 1),
        "prefix_hit_tokens": hits,
        "outputs": [o.generated_tokens for o in outputs.values()],
    }


def _transformers_child(prompts: list[list[int]], new: int, queue: Any) -> None:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    model = build_model()
    generation = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=PAD_TOKEN_ID)
    blocks = sum(-(-(len(p) + new) // 256) for p in prompts) * 2
    config = ContinuousBatchingConfig(max_batch_tokens=2048, num_blocks=blocks, auto_switch_to_flash=False)
    outputs, seconds = timed(
        lambda: model.generate_batch(
            inputs=prompts, generation_config=generation, continuous_batching_config=config, progress_bar=False
        )
    )
    queue.put({"seconds": seconds, "tokens_per_s": sum(len(o.generated_tokens) for o in outputs.values()) / seconds})


def run_transformers(prompts: list[list[int]], new: int) -> dict[str, Any]:
    queue: Any = multiprocessing.get_context("spawn").Queue()
    child = multiprocessing.get_context("spawn").Process(target=_transformers_child, args=(prompts, new, queue))
    child.start()
    child.join(HF_TIME_LIMIT_S)
    if child.is_alive():
        child.kill()
        return {"error": f"not finished within {HF_TIME_LIMIT_S} s"}
    return dict(queue.get()) if not queue.empty() else {"error": f"exit code {child.exitcode}"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prefix", type=int, default=1000)
    parser.add_argument("--suffix", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="16 requests, 200-token prefix, 8 new tokens")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.quick:
        args.requests, args.prefix, args.max_new_tokens = 16, 200, 8
    prompts = workload(args.requests, args.prefix, args.suffix)
    model = build_model()
    results: dict[str, Any] = {
        "aiocb-sharing": run_aiocb(model, prompts, args.max_new_tokens, args.page_size, True),
        "aiocb-no-sharing": run_aiocb(model, prompts, args.max_new_tokens, args.page_size, False),
    }
    if not args.skip_transformers:
        results["transformers-cb"] = run_transformers(prompts, args.max_new_tokens)
    same = results["aiocb-sharing"]["outputs"] == results["aiocb-no-sharing"]["outputs"]
    base = results["aiocb-no-sharing"]
    rows = []
    for name, row in results.items():
        if "error" in row:
            rows.append([name, row["error"], "", "", "", ""])
            continue
        computed = row.get("prompt_tokens_computed")
        rows.append(
            [
                name,
                "" if computed is None else f"{computed:,}",
                "" if computed is None else f"{1 - computed / base['prompt_tokens_computed']:.1%}",
                f"{row['seconds']:.2f}",
                f"{row['tokens_per_s']:.0f}",
                f"{base['seconds'] / row['seconds']:.2f}x",
            ]
        )
    info = machine_info()
    print(info.describe())
    print(
        f"workload: {args.requests} requests, {args.prefix}-token shared prefix + {args.suffix}-token suffixes, "
        f"{args.max_new_tokens} new tokens; aiocb page_size={args.page_size}; "
        f"greedy outputs identical with and without sharing: {same}"
    )
    headers = ["engine", "prompt tokens computed", "fewer than no sharing", "wall s", "tokens/s", "speed vs no sharing"]
    print(markdown_table(headers, rows))
    if args.json:
        for row in results.values():
            row.pop("outputs", None)
        args.json.write_text(json.dumps({"machine": info.as_dict(), "results": results}, indent=2))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
