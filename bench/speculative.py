"""Speculative decoding (prompt lookup, a draft model) against none: output tokens per
second, in turn.

Two workloads, each run without speculation, with ``aiocb.SpeculativeConfig()`` (prompt
lookup) and with a draft model (interleaved, ``--repeats`` rounds, median and range
reported), greedy, outputs checked identical. The draft is the model's own first layer
under its final norm and head (an early exit: no draft was trained, so it shows the
machinery's cost and what a weak draft's acceptance buys, not a good draft's gain):

* copy-heavy, on the bundled model: a function from the standard library followed by
  its first line again, so that a continuation that copies repeats what the prompt
  holds (the bundled model copies through a circuit set into its weights before
  training, ``scripts/copying_circuit.py``); at batch 1 (requests one after another),
  8 and 64 (that many at once);
* W1, on ``bench/common.py``'s random tiny Qwen3: 64 requests, prompts of 16..256
  tokens, 64 new tokens each, no EOS: nothing to copy.

    python bench/speculative.py [--repeats 3] [--new-tokens 96] [--threads N]
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import copy
import statistics
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any, NamedTuple

if __package__ in (None, ""):  # run as `python bench/speculative.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiocb
from aiocb.default_model import HELD_OUT_FILES, load_default_model
from bench.common import build_model, machine_info, make_workload


def copy_prompts(tokenizer: Any, count: int, max_tokens: int) -> list[list[int]]:
    """Prompts that hold a function and the first line of its copy (held-out files first);
    the line ends without its newline, which the model writes itself (as it was trained)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    names = [*HELD_OUT_FILES, "string.py", "glob.py", "bisect.py", "heapq.py", "calendar.py"]
    prompts: list[list[int]] = []
    for name in names:
        source = (stdlib / name).read_text(encoding="utf-8")
        for node in ast.parse(source).body:
            if not isinstance(node, ast.FunctionDef):
                continue
            text = ast.get_source_segment(source, node) or ""
            ids = tokenizer.encode(f"{text}\n\n\n{text.splitlines()[0]}")
            if 40 <= len(ids) <= max_tokens:
                prompts.append(ids)
            if len(prompts) == count:
                return prompts
    return prompts


class _Run(NamedTuple):
    wall: float
    tokens: int
    outputs: list[list[int]]
    stats: aiocb.ManagerStatistics
    #: what speculation's back-off charges a step that verifies proposals, in decode steps
    #: (1 on a CPU)
    verify_cost: float
    #: steps that verified proposals by replaying a CUDA graph (0 on a CPU)
    graph_replays: int


async def _run(
    model: Any,
    prompts: list[list[int]],
    new: int,
    batch: int,
    speculative: aiocb.SpeculativeConfig | None,
    config: aiocb.ContinuousBatchingConfig | None = None,
) -> _Run:
    """``prompts``, ``batch`` requests at once (greedy, ``new`` tokens each), timed."""
    params: dict[str, Any] = {"max_new_tokens": new, "do_sample": False, "eos_token_id": []}
    async with aiocb.Manager(model, continuous_batching_config=config, speculative_config=speculative) as manager:
        await manager.generate(prompts[0], max_new_tokens=4)  # warm-up (kernels of a whole prompt too)
        started = time.perf_counter()
        outputs: list[list[int]] = []
        for first in range(0, len(prompts), batch):
            group = prompts[first : first + batch]
            done = await asyncio.gather(*(manager.generate(p, **params) for p in group))
            outputs += [list(o.generated_tokens) for o in done]
        wall = time.perf_counter() - started
        stats = manager.statistics()
        runner = manager._runner
        assert runner is not None
        replays = 0 if runner.graphs is None else runner.graphs.wide_replays
    return _Run(wall, sum(len(o) for o in outputs), outputs, stats, runner.verify_cost, replays)


def early_exit_draft(model: Any, layers: int = 1) -> Any:
    """A draft made of ``model``'s first ``layers`` decoder layers, its final norm and head."""
    draft = copy.deepcopy(model)
    draft.model.layers = draft.model.layers[:layers]
    config = draft.config
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    return draft


def methods(model: Any) -> dict[str, aiocb.SpeculativeConfig | None]:
    """The configurations compared: none, prompt lookup and an early-exit draft."""
    draft = aiocb.SpeculativeConfig(method="draft", draft_model=early_exit_draft(model))
    return {"off": None, "ngram": aiocb.SpeculativeConfig(), "draft": draft}


def compare(
    label: str,
    model: Any,
    prompts: list[list[int]],
    new: int,
    batch: int,
    repeats: int,
    *,
    config: aiocb.ContinuousBatchingConfig | None = None,
    exact: bool = True,
    configs: dict[str, aiocb.SpeculativeConfig | None] | None = None,
) -> dict[str, Any]:
    """``prompts`` (``batch`` at once, greedy) without speculation and with each method
    (``configs``, :func:`methods` by default; "off" is none), ``repeats`` rounds in turn:
    tokens/s of each, the ratios to none, the acceptance, the runners' ``verify_cost`` and,
    on a GPU, how many of each method's steps that verified proposals replayed a graph.
    The outputs must agree; without ``exact`` (bf16 on a GPU, where verification runs
    other kernels than decoding) the requests whose outputs differ are counted instead."""
    configs = methods(model) if configs is None else configs
    rates: dict[str, list[float]] = {name: [] for name in configs}
    outputs: dict[str, list[list[int]]] = {}
    acceptance: dict[str, list[float]] = {name: [] for name in configs if name != "off"}
    replays: dict[str, list[int]] = {name: [] for name in acceptance}
    verify_costs: list[float] = []
    for _ in range(repeats):
        for name, spec in configs.items():
            run = asyncio.run(_run(model, prompts, new, batch, spec, config))
            verify_costs.append(run.verify_cost)
            rates[name].append(run.tokens / run.wall)
            outputs.setdefault(name, run.outputs)
            if spec is not None:
                replays[name].append(run.graph_replays)
                if run.stats.acceptance_rate is not None:
                    acceptance[name].append(run.stats.acceptance_rate)
            print(f"[{label}] {name}: {run.tokens / run.wall:.0f} tokens/s", file=sys.stderr)
    differing = {name: sum(a != b for a, b in zip(outputs["off"], outputs[name], strict=True)) for name in acceptance}
    if exact:
        for name, count in differing.items():
            assert not count, f"{label}: speculation ({name}) changed the outputs of {count} requests"
    off = statistics.median(rates["off"])
    return {
        "label": label,
        **({} if exact else {f"{name} differing requests": count for name, count in differing.items()}),
        **rates,
        **{f"{name} / off": statistics.median(rates[name]) / off for name in acceptance},
        **{f"{name} acceptance": statistics.median(a) if a else None for name, a in acceptance.items()},
        **{f"{name} graph replays": r for name, r in replays.items() if any(r)},
        "verify_cost": statistics.median(verify_costs),
    }


def _cell(values: list[float]) -> str:
    return f"{statistics.median(values):.0f} ({min(values):.0f}–{max(values):.0f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=96, help="tokens per copy-heavy request")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's own)")
    args = parser.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    model, tokenizer = load_default_model()
    context = model.config.max_position_embeddings
    prompts = copy_prompts(tokenizer, 64, context - args.new_tokens - 8)
    rows = []
    for batch in (1, 8, 64):
        chosen = prompts[:8] if batch == 1 else prompts[: max(batch, 8)]
        rows.append(compare(f"copy-heavy, batch {batch}", model, chosen, args.new_tokens, batch, args.repeats))
    w1_model = build_model(seed=0)
    w1 = make_workload(64, 16, 256, seed=0)
    rows.append(compare("W1 (64 requests at once)", w1_model, w1, 64, 64, args.repeats))
    print(machine_info().describe())
    print(f"\n{len(prompts)} copy-heavy prompts; greedy; {args.repeats} interleaved rounds\n")
    print("| workload | tokens/s off | ngram | draft | ngram / off | draft / off | acceptance ngram, draft |")
    print("| :--- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        accepted = ", ".join(
            "–" if row[f"{m} acceptance"] is None else f"{row[f'{m} acceptance']:.0%}" for m in ("ngram", "draft")
        )
        print(
            f"| {row['label']} | {_cell(row['off'])} | {_cell(row['ngram'])} | {_cell(row['draft'])} "
            f"| {row['ngram / off']:.2f}x | {row['draft / off']:.2f}x | {accepted} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
