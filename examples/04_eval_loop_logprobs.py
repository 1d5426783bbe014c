"""An asyncio evaluation loop: score multiple-choice candidates by their log-likelihood.

Each candidate continuation is scored with `prompt_logprobs=True` (the log-probability of
every prompt token given the ones before); the best-scoring candidate is the prediction.
All questions and candidates are scored concurrently.
"""

from __future__ import annotations

import asyncio

from aiocb import Manager
from aiocb.default_model import load_default_model

QUESTIONS = [
    ("import os\nprint(os.path.", ["join('a', 'b'))", "banana split))", "42 + ))"]),
    ("def add(a, b):\n    return", [" a + b", " ))((", " the end"]),
    ("for i in range(10):\n    ", ["print(i)", "}}}{{{", "def class"]),
    ("if __name__ == ", ["'__main__':", "17 then", "else else"]),
]


async def main() -> None:
    model, tokenizer = load_default_model()
    async with Manager(model) as manager:

        async def loglikelihood(context: str, continuation: str) -> float:
            context_ids = tokenizer(context).input_ids
            ids = context_ids + tokenizer(continuation).input_ids
            output = await manager.generate(ids, max_new_tokens=1, prompt_logprobs=True)
            assert output.prompt_logprobs is not None
            return sum(lp for lp in output.prompt_logprobs[len(context_ids) :] if lp is not None)

        async def pick(context: str, candidates: list[str]) -> int:
            scores = await asyncio.gather(*(loglikelihood(context, c) for c in candidates))
            return max(range(len(candidates)), key=scores.__getitem__)

        picks = await asyncio.gather(*(pick(context, candidates) for context, candidates in QUESTIONS))
    for (context, candidates), choice in zip(QUESTIONS, picks, strict=True):
        print(f"{context!r:40} -> {candidates[choice]!r}")
    print(f"accuracy: {sum(p == 0 for p in picks)}/{len(QUESTIONS)} (the first candidate is the right one)")


if __name__ == "__main__":
    asyncio.run(main())
