"""What a generated token costs the incremental detokenizer, as the output grows.

Each case adds ``--tokens`` tokens one at a time to an ``IncrementalDetokenizer`` after a
short prompt and reports microseconds per token, for the byte-level BPE and the
byte-fallback test tokenizers (``tests/server/conftest.py``), through the tokenizers
library's decode stream and through the window method (a tokenizer with only ``decode``):

* ``text``: the tokens of ordinary multilingual text, repeated;
* ``stray bytes``: one token that is a lone UTF-8 continuation byte (no character can
  take it; a client's ``allowed_token_ids`` can ask for nothing else);
* ``skipped specials``: a special token, skipped from the text.

It also reports how many characters came before the end (``flush``). ``--ahead`` measures
the detokenizer as it runs where stop strings are looked for (``release_ahead``: the
characters of a held token before its incomplete one released at once).

    python bench/detokenize.py [--tokens 2000,8000] [--ahead]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/detokenize.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aiocb.detokenize import IncrementalDetokenizer
from bench.common import machine_info
from tests.server.conftest import DecodeOnly, build_byte_fallback_tokenizer, build_tokenizer

TEXT = "Héllo wörld, 你好，世界！ Emoji: 😀 🚀 and Привет, мир. "


def _cases(tokenizer: Any, fallback: bool, size: int) -> dict[str, list[int]]:
    text = tokenizer.encode(TEXT, add_special_tokens=False)
    stray = tokenizer.convert_tokens_to_ids("<0x80>") if fallback else tokenizer.encode("\u0100")[-1]
    return {
        "text": (text * (size // len(text) + 1))[:size],
        "stray bytes": [stray] * size,
        "skipped specials": [tokenizer.all_special_ids[0]] * size,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="2000,8000", help="comma-separated output lengths")
    parser.add_argument("--ahead", action="store_true", help="release_ahead, as with stop strings")
    args = parser.parse_args(argv)
    print(machine_info().describe())
    print("| tokenizer | method | case | tokens | µs per token | characters before the end |")
    print("| :--- | :--- | :--- | ---: | ---: | ---: |")
    for name, tokenizer, fallback in (
        ("byte-level BPE", build_tokenizer(), False),
        ("byte fallback", build_byte_fallback_tokenizer(), True),
    ):
        prompt = tokenizer.encode("Once upon a time", add_special_tokens=False)
        for size in map(int, args.tokens.split(",")):
            for case, ids in _cases(tokenizer, fallback, size).items():
                for method, wrapped in (("stream", tokenizer), ("window", DecodeOnly(tokenizer))):
                    detokenizer = IncrementalDetokenizer(wrapped, prompt, release_ahead=args.ahead)
                    started = time.perf_counter()
                    streamed = sum(len(detokenizer.add(token)) for token in ids)
                    elapsed = time.perf_counter() - started
                    detokenizer.flush()
                    print(f"| {name} | {method} | {case} | {size:,} | {1e6 * elapsed / size:.1f} | {streamed:,} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
