"""What parsing streamed tool calls costs the event loop, per step, as a call grows.

Each case streams ``--choices`` chat choices at once, each writing one call whose
arguments are about ``--chars`` characters (a file's text, as an agent's ``write_file``
call holds), ``--piece`` characters a delta; a step feeds every choice one delta, as the
server does when the engine's step brings each a token. It reports the loop time of a
step (milliseconds) near the call's start, in its middle and near its end, the worst
step, and the loop time of the whole stream. A cost that grows with the call's length
(its text rescanned or decoded on each delta) shows as the end's steps costing more
than the start's.

Cases: every format (``hermes``, ``llama3_json``, ``mistral`` in its list and ``[ARGS]``
forms, gpt-oss's ``harmony``), with plain arguments and with arguments whose strings hold
the format's closing markup (a file that mentions ``</tool_call>``).

    python bench/tool_calls.py [--choices 64,256] [--chars 12000] [--piece 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/tool_calls.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aiocb.server.chat_output import ChoiceOutput
from aiocb.server.harmony import HarmonyOutput
from aiocb.server.tool_parsers import HermesParser, Llama3JsonParser, MistralParser
from bench.common import machine_info

Parser = ChoiceOutput | HarmonyOutput

#: each format: the call's text around its arguments, and a parser of one choice
FORMATS: dict[str, tuple[str, Callable[[], Parser]]] = {
    "hermes": (
        '<tool_call>\n{"name": "write_file", "arguments": %s}\n</tool_call>',
        lambda: ChoiceOutput(None, HermesParser(["write_file"])),
    ),
    "llama3_json": (
        '{"name": "write_file", "parameters": %s}',
        lambda: ChoiceOutput(None, Llama3JsonParser(["write_file"])),
    ),
    "mistral list": (
        '[TOOL_CALLS][{"name": "write_file", "arguments": %s}]',
        lambda: ChoiceOutput(None, MistralParser(["write_file"])),
    ),
    "mistral [ARGS]": (
        "[TOOL_CALLS]write_file[ARGS]%s",
        lambda: ChoiceOutput(None, MistralParser(["write_file"])),
    ),
    "harmony": (
        "<|channel|>commentary to=functions.write_file <|constrain|>json<|message|>%s<|call|>",
        lambda: HarmonyOutput(["write_file"], json_kinds={"call"}),
    ),
}


def arguments(chars: int, markup: bool) -> str:
    """A call's arguments: a file's text of about ``chars`` characters (``markup``: whose
    lines mention every format's closing markup)."""
    line = 'print("</tool_call> <|call|> }]")\n' if markup else "x = [1, {2: 3}]\n"
    return json.dumps({"path": "a.py", "content": line * max(1, chars // len(line))})


def run(text: str, make: Callable[[], Parser], choices: int, piece: int) -> list[float]:
    """Each step's loop time (seconds): every choice fed its next delta of ``text``."""
    parsers = [make() for _ in range(choices)]
    steps = []
    for at in range(0, len(text), piece):
        delta = text[at : at + piece]
        start = time.perf_counter()
        for parser in parsers:
            parser.feed(delta)
        steps.append(time.perf_counter() - start)
    for parser in parsers:
        parser.finish()
    return steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--choices", default="64,256", help="choices streaming at once (comma-separated)")
    parser.add_argument("--chars", type=int, default=12_000, help="characters of each call's arguments")
    parser.add_argument("--piece", type=int, default=4, help="characters a delta")
    args = parser.parse_args(argv)
    print(machine_info().describe())
    print("| format | arguments | choices | start ms | middle ms | end ms | worst ms | stream s |")
    print("| :--- | :--- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for choices in (int(c) for c in args.choices.split(",")):
        for name, (shape, make) in FORMATS.items():
            for markup in (False, True):
                steps = run(shape % arguments(args.chars, markup), make, choices, args.piece)
                tenth = max(1, len(steps) // 10)
                start, end = statistics.median(steps[:tenth]), statistics.median(steps[-tenth:])
                middle = statistics.median(steps[len(steps) // 2 - tenth // 2 : len(steps) // 2 + tenth // 2 + 1])
                kind = "closing markup in strings" if markup else "plain"
                print(
                    f"| {name} | {kind} | {choices} | {1e3 * start:.2f} | {1e3 * middle:.2f} | {1e3 * end:.2f} "
                    f"| {1e3 * max(steps):.2f} | {sum(steps):.2f} |"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
