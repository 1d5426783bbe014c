"""The chunked CPU argmax gives torch's argmax exactly: ties, NaNs, -inf rows, ragged chunks."""

from __future__ import annotations

import pytest
import torch

from aiocb.runner.argmax import CHUNK, argmax_rows


@pytest.mark.parametrize("width", [CHUNK, 2 * CHUNK, 2 * CHUNK + 1, 5 * CHUNK - 3, 4096, 4097])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_chunked_argmax_is_torchs(width: int, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(width)
    for trial in range(20):
        # Few distinct values: many ties, often across chunks.
        x = torch.randint(0, 4, (9, width), generator=generator).to(dtype)
        x[1] = float("-inf")
        x[2, width - 1] = 10.0  # the largest value in the last (maybe narrower) chunk
        x[3, torch.randint(0, width, (2,), generator=generator)] = float("nan")
        x[4, width // 2] = float("nan")
        x[5] = torch.randn(width, generator=generator).to(dtype)
        x[6, :] = 7.0  # all tied: the first index
        x[7, trial % width] = 4.0
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1)), trial


def test_a_view_of_wider_rows_and_an_empty_batch() -> None:
    wide = torch.randn(16, 1000, generator=torch.Generator().manual_seed(1))
    view = wide[:, 100:900]  # rows farther apart than their width
    assert torch.equal(argmax_rows(view), view.argmax(dim=-1))
    assert argmax_rows(torch.empty(0, 4096)).shape == (0,)
