"""Outputs a program can parse: JSON under a schema (or a pydantic model), a regular
expression, a choice of strings, a grammar.

Needs `pip install 'aiocb[structured]' pydantic` (xgrammar). The bundled model writes Python-like
text, yet every constrained output here is valid by construction; free requests in the
same batch are not affected by their constrained neighbours.
"""

from __future__ import annotations

import asyncio
import json

from pydantic import BaseModel, Field

from aiocb import Manager
from aiocb.default_model import load_default_model


class Task(BaseModel):
    title: str = Field(max_length=24)
    priority: int = Field(ge=1, le=5)
    done: bool


async def main() -> None:
    model, tokenizer = load_default_model()
    async with Manager(model, tokenizer=tokenizer) as manager:
        # A pydantic model as the schema: the text parses back into it.
        tasks = await manager.generate("todo = ", max_new_tokens=96, json_schema=Task, temperature=1.0, seed=0, n=3)
        for sample in tasks:
            print("task:", Task.model_validate_json(sample.text or ""))

        # A plain JSON schema, a regex, a choice and a grammar, all in one batch with a free request.
        schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 4}
        outputs = await asyncio.gather(
            manager.generate("values = ", max_new_tokens=32, json_schema=schema, temperature=1.0, seed=1),
            manager.generate("version = ", max_new_tokens=16, regex=r"v[0-9]\.[0-9]{1,2}", temperature=1.0, seed=2),
            manager.generate("mode = ", max_new_tokens=8, choice=["read", "write", "append"], temperature=1.0, seed=3),
            manager.generate(
                "pair = ", max_new_tokens=16, grammar='root ::= "(" [a-z]+ ", " [0-9]+ ")"', temperature=1.0, seed=4
            ),
            manager.generate("def main():", max_new_tokens=24, temperature=1.0, seed=5),  # free
        )
        values, version, mode, pair, free = outputs
        print("values:", json.loads(values.text or ""), "| version:", version.text, "| mode:", mode.text)
        print("pair:", pair.text, "| free text:", repr(free.text))


if __name__ == "__main__":
    asyncio.run(main())
