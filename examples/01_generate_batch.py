"""Blocking batch generation with a progress bar: the simplest way in, from a script."""

from __future__ import annotations

import aiocb
from aiocb.default_model import load_default_model

PROMPTS = [
    "def read_config(path):\n",
    "class Stack:\n    def push(self, item):\n",
    "import os\n\n\ndef ",
    "for line in",
]


def main() -> None:
    model, tokenizer = load_default_model()
    inputs = [tokenizer(p).input_ids for p in PROMPTS * 8]  # 32 requests
    outputs = aiocb.generate_batch(model, inputs, max_new_tokens=40, progress=True)
    for prompt, output in list(zip(PROMPTS, outputs.values(), strict=False))[:4]:
        print(f"--- {output.request_id} ({output.finish_reason}) ---")
        print(prompt + tokenizer.decode(output.generated_tokens))


if __name__ == "__main__":
    main()
