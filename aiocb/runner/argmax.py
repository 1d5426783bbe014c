"""A row-wise argmax that is fast on CPU.

torch's CPU ``argmax`` over the last dimension is not vectorised: at 256 x 4,096 fp32 it
takes about 0.8 ms on the development machine, against 0.04 ms for an ``amax`` over the
same data, and a greedy step's pick is a large share of a small model's step.
:func:`argmax_rows` first reduces each row to the maxima of fixed-width chunks
(vectorised), then takes the argmax of those maxima and of the one winning chunk: the
same index as torch's, at about a fifth of the cost.
"""

from __future__ import annotations

import torch

#: Chunk width of :func:`argmax_rows`; a row narrower than two chunks takes torch's argmax.
CHUNK = 64


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a 2-D tensor, with the same ties and NaNs: the first index of
    a row's largest value, a NaN counting as larger than any number."""
    rows, width = x.shape
    if x.device.type != "cpu" or width < 2 * CHUNK or x.stride(-1) != 1 or not rows:
        return x.argmax(dim=-1)
    full = width // CHUNK
    chunk_max = x.as_strided((rows, full, CHUNK), (x.stride(0), CHUNK, 1)).amax(dim=-1)
    if full * CHUNK < width:  # (the last, narrower chunk)
        chunk_max = torch.cat((chunk_max, x[:, full * CHUNK :].amax(dim=-1, keepdim=True)), dim=1)
    # The first chunk holding the row's largest value holds its first occurrence (a NaN
    # makes its chunk's maximum NaN, which argmax ranks first too).
    chunk = chunk_max.argmax(dim=-1)
    # Positions past the row's end repeat its last element, which comes earlier in the
    # same chunk: the first occurrence is never one of them.
    within = (chunk[:, None] * CHUNK + torch.arange(CHUNK, device=x.device)).clamp_max_(width - 1)
    return within.gather(1, x.gather(1, within).argmax(dim=-1, keepdim=True))[:, 0]
