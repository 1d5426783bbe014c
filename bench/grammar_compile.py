"""How long xgrammar takes to compile JSON schemas of growing shapes, and what compiling a
long constraint in a child process first (``grammar_compile_timeout``) costs.

Against the bundled model's tokenizer (4,096 tokens), one compiler thread, each schema
compiled once in this process (``GrammarCompiler.compile`` with no deadline):

* ``optional``: an object of N optional integer properties;
* ``nested``: N levels of objects, each holding the next as its one required property;
* ``any_of``: N levels of ``anyOf`` between an object and an array of the level below (the
  schema's text doubles a level).

Then, with the default deadline: the first long constraint's wait (the child's start, its
compile there, the compile here), a second one's (a warm child), and how long a schema
past the deadline takes to be refused, and to be refused again.

    python bench/grammar_compile.py            # the shapes up to a few seconds each
    python bench/grammar_compile.py --full     # and the largest (10-18 s each on a 2-core EPYC)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/grammar_compile.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from aiocb.default_model import load_default_model
from aiocb.errors import InvalidRequestError
from aiocb.structured import GrammarCompiler
from bench.common import machine_info


def optional(count: int) -> dict[str, Any]:
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(count)}}


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def any_of(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        branch = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
        schema = {"anyOf": [branch, {"type": "array", "items": schema}]}
    return schema


SHAPES = {
    "optional": (optional, (250, 500), (1000,)),
    "nested": (nested, (100, 200), (400,)),
    "any_of": (any_of, (8, 10), (12,)),
}


def _timed_compile(compiler: GrammarCompiler, schema: dict[str, Any]) -> tuple[float, str]:
    began = time.perf_counter()
    try:
        compiler.compile(("json_schema", json.dumps(schema)))
        outcome = "compiled"
    except InvalidRequestError as error:
        outcome = f"refused: {str(error)[:60]}..."
    return time.perf_counter() - began, outcome


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="also the largest shapes (10-18 s each on a 2-core EPYC)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(machine_info())
    model, tokenizer = load_default_model()
    vocab = model.config.vocab_size
    in_process = GrammarCompiler(tokenizer, vocab, compile_timeout=None)
    print("\n| shape | N | schema | compile |\n| :--- | ---: | ---: | ---: |")
    for name, (make, sizes, largest) in SHAPES.items():
        for size in (*sizes, *(largest if args.full else ())):
            schema = make(size)
            took, _ = _timed_compile(in_process, schema)
            print(f"| {name} | {size:,} | {len(json.dumps(schema)) / 1024:.1f} KB | {took:.2f} s |", flush=True)
    probed = GrammarCompiler(tokenizer, vocab, compile_timeout=10.0)
    print("\nwith grammar_compile_timeout 10 s (a child process first):")
    for label, schema in (
        ("first long constraint (the child starts)", optional(150)),
        ("second (a warm child)", optional(151)),
        ("past the deadline", optional(2000)),
        ("past the deadline, again", optional(2000)),
    ):
        took, outcome = _timed_compile(probed, schema)
        print(f"- {label}: {took:.2f} s, {outcome}", flush=True)
    alone, _ = _timed_compile(in_process, optional(152))
    print(f"- the second's shape compiled in this process alone: {alone:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
