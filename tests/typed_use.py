"""The public API's types as a user's type checker sees them (checked by ``nox -s typecheck``,
not run): ``generate`` returns one output or the list of ``n`` samples' outputs."""

from __future__ import annotations

from typing import assert_type

import aiocb


async def generations(manager: aiocb.Manager, params: aiocb.SamplingParams, n: int) -> None:
    assert_type(await manager.generate([1, 2]), aiocb.GenerationOutput)
    assert_type(await manager.generate([1, 2], temperature=0.5), aiocb.GenerationOutput)
    assert_type(await manager.generate([1, 2], n=1), aiocb.GenerationOutput)
    assert_type(await manager.generate([1, 2], n=4), list[aiocb.GenerationOutput])
    assert_type(await manager.generate([1, 2], sampling_params=params, n=n), list[aiocb.GenerationOutput])
    # (the params' own n decides)
    either = await manager.generate([1, 2], sampling_params=params)
    assert_type(either, aiocb.GenerationOutput | list[aiocb.GenerationOutput])
    assert_type(await manager.generate_batch([[1, 2]], 4), dict[str, aiocb.GenerationOutput])
    request_id = await manager.add_request("a prompt", max_new_tokens=4)
    assert_type(request_id, str)
    async for chunk in manager.stream(request_id):
        assert_type(chunk, aiocb.GenerationOutput)
