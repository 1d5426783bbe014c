"""Tensor parallelism: one aiocb manager over several processes, each holding a shard of the model.

    torchrun --nproc-per-node 2 examples/tp_torchrun.py                 # a tiny random Llama, CPU or GPU
    torchrun --nproc-per-node 2 examples/tp_torchrun.py --model PATH    # your model (its tokenizer too)

Every rank loads its shard; rank 0 runs the asyncio manager (scheduler, API), the others
run ``aiocb.distributed.run_follower``, which replays each step rank 0 broadcasts. GPUs
talk over NCCL, CPUs over gloo. Across machines, start the same command on each node with
``--nnodes``, ``--node-rank`` and ``--rdzv-endpoint`` (see the README).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

import aiocb
import aiocb.distributed
from aiocb import Manager

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]


def tiny_model_dir() -> Path:
    """A random tiny Llama saved once on this machine (rank 0 writes it, the others wait)."""
    path = Path(tempfile.gettempdir()) / "aiocb-tp-example-llama"
    if dist.get_rank() == 0 and not (path / "config.json").exists():
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=512,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=4,  # tp_size 1, 2 or 4 divides it
            initializer_range=0.3,
            eos_token_id=None,
            bos_token_id=None,
            pad_token_id=0,
        )
        LlamaForCausalLM(config).save_pretrained(path)
    dist.barrier()
    return path


async def serve(
    model: PreTrainedModel, prompts: list[list[int]], config: aiocb.ContinuousBatchingConfig
) -> list[list[int]]:
    """Rank 0: what a server would do, with a few concurrent requests."""
    async with Manager(model, continuous_batching_config=config) as manager:
        started = time.perf_counter()
        outputs = await asyncio.gather(*(manager.generate(ids, max_new_tokens=24) for ids in prompts))
        print(f"{len(outputs)} requests in {time.perf_counter() - started:.2f} s")
        return [output.generated_tokens for output in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a model folder or hub id (default: a tiny random Llama)")
    args = parser.parse_args()

    # Build the config before the process group: it sets NCCL_GRAPH_MIXING_SUPPORT=0 under torchrun.
    config = aiocb.ContinuousBatchingConfig(cpu_group_timeout=60.0)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # The model's own collectives wait as long as the group's timeout: cpu_group_timeout's,
    # so that a rank left inside one (rank 0's forward failed midway) fails in that time too.
    timeout = datetime.timedelta(seconds=60.0)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=timeout)
    rank, world_size = dist.get_rank(), dist.get_world_size()

    path = args.model or tiny_model_dir()
    model = aiocb.distributed.load_model(path, tp_size=world_size, dtype="auto")
    if aiocb.distributed.is_driver(model):
        tokenizer = None
        if args.model:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(args.model)
        # The tiny random model has no tokenizer: it gets made-up token ids.
        prompts = [tokenizer(p).input_ids if tokenizer else [ord(c) % 500 + 1 for c in p] for p in PROMPTS]
        outputs = asyncio.run(serve(model, prompts, config))
        for prompt, tokens in zip(PROMPTS, outputs, strict=True):
            print(f"[rank 0] {prompt!r} -> {tokenizer.decode(tokens) if tokenizer else tokens}")
        aiocb.distributed.shutdown()  # the followers' run_follower returns
    else:
        report = aiocb.distributed.run_follower(model, config)
        print(f"[rank {rank}] followed {report.steps} steps of {report.sessions} session(s)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
