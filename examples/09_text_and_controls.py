"""Text in, text out, with the controls a Python caller reaches for.

With `tokenizer=`, prompts are text (or chat messages) and outputs carry `text`; stop
strings end a request in the step that completes them. One `aiocb.SamplingParams` holds
every control; `n` samples share one computation of their prompt; `priority` lets an
urgent request overtake a queue.
"""

from __future__ import annotations

import asyncio

import aiocb
from aiocb import Manager
from aiocb.default_model import load_default_model


async def main() -> None:
    model, tokenizer = load_default_model()
    async with Manager(model, tokenizer=tokenizer) as manager:
        # Stop at the end of the function; the penalty keeps the model from looping.
        params = aiocb.SamplingParams(max_new_tokens=96, stop="\n\n", repetition_penalty=1.3)
        output = await manager.generate("def parse_header(line):\n", sampling_params=params)
        print(f"--- stopped by {output.stop_reason!r} after {len(output.generated_tokens)} tokens\n{output.text}")

        # Streamed text: each chunk's text_delta never splits a character.
        rid = await manager.add_request("class LRUCache:\n", max_new_tokens=48, temperature=0.7, seed=3)
        print("--- streamed: ", end="")
        async for chunk in manager.stream(rid):
            print(chunk.text_delta, end="", flush=True)
        print()

        # Four samples of one prompt: computed once, each with its own seed (3, 4, 5, 6).
        before = manager.statistics().prefix_hit_tokens
        samples = await manager.generate("import ", n=4, max_new_tokens=8, temperature=1.0, seed=3)
        shared = manager.statistics().prefix_hit_tokens - before
        print(f"--- 4 samples, {shared} prompt tokens reused:", [s.text for s in samples])

        # Bias, bans and penalties together, sampled and still reproducible.
        banned = [tokenizer.encode(word) for word in ("self", " self")]
        controlled = aiocb.SamplingParams(
            max_new_tokens=32, temperature=0.9, seed=11, presence_penalty=0.8, bad_words_ids=banned, min_tokens=8
        )
        first = await manager.generate("def __init__(", sampling_params=controlled)
        again = await manager.generate("def __init__(", sampling_params=controlled)
        print(f"--- no 'self': {first.text!r} (same again: {first.text == again.text})")

    # A queue of background work (eight requests a step, here), then an urgent request (a
    # lower priority runs first): admitted before the ones still queued, it is answered
    # while they wait.
    config = aiocb.ContinuousBatchingConfig(max_requests_per_batch=8)
    async with Manager(model, tokenizer=tokenizer, continuous_batching_config=config) as manager:
        background = [
            asyncio.ensure_future(manager.generate(f"# task {i}\n", max_new_tokens=32, priority=1)) for i in range(64)
        ]
        await asyncio.sleep(0)  # (the background requests are queued first)
        await manager.generate("def main():", max_new_tokens=8, priority=-1)
        print(f"--- urgent request answered with {sum(t.done() for t in background)} of 64 background ones done")
        await asyncio.gather(*background)


if __name__ == "__main__":
    asyncio.run(main())
