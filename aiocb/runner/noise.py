"""Counter-based randomness: a pure function of ``(request seed, token index, vocab id)``.

A request's draws depend on its seed alone, never on which requests share its batch or
in which order, and computing the noise of a few vocabulary entries gives the same values
as computing the whole row's (:func:`random_bits_at`), so a sampler may look only at its
candidates.
"""

from __future__ import annotations

import math

import torch

_MASK32 = 0xFFFFFFFF

#: Above any Gumbel noise :func:`gumbel` returns: ``-log(-log(1 - 2**-24))`` (the largest
#: uniform of :func:`bits_to_uniform`), about 16.64, with room for float32's rounding.
GUMBEL_BOUND = -math.log(-math.log1p(-(2.0**-24))) + 1e-3


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """``(x * constant) mod 2**32`` for 32-bit values in int64 without overflow."""
    low = x * (constant & 0xFFFF)
    high = ((x * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) with good avalanche."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def random_bits(seed: torch.Tensor, offset: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[S, V]`` 32-bit values (in int64), a pure function of (seed, offset, vocab id)."""
    return random_bits_at(seed, offset, torch.arange(vocab, device=seed.device, dtype=torch.long)[None, :])


def random_bits_at(seed: torch.Tensor, offset: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The values of :func:`random_bits` at vocabulary ids ``ids`` (``[S, K]``, or ``[1, K]`` for all rows)."""
    row_key = _mix32(_mix32(seed) ^ _mix32((offset + 0x9E3779B9) & _MASK32))
    second_key = _mix32(row_key ^ 0x5BD1E995)
    return _mix32(_mix32(ids ^ row_key[:, None]) ^ second_key[:, None])


def bits_to_uniform(bits: torch.Tensor) -> torch.Tensor:
    """32-bit values to float32 uniforms strictly inside (0, 1): ``(top 23 bits + 0.5) / 2**23``.

    23 bits, not 24: ``2**24 - 1 + 0.5`` has no float32 form and rounds up to ``2**24``,
    which would make a draw exactly 1.0 and its Gumbel noise infinite (that token would
    win whatever its probability, a masked one included). With 23 bits every value and
    the mapping are exact: the extremes are ``2**-24`` and ``1 - 2**-24``.
    """
    return ((bits >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def uniform_noise(seed: torch.Tensor, offset: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[S, V]`` uniform values strictly inside (0, 1), a pure function of (seed, offset, vocab id)."""
    return bits_to_uniform(random_bits(seed, offset, vocab))


def gumbel(uniform: torch.Tensor) -> torch.Tensor:
    """Gumbel noise ``-log(-log(u))``, finite for every ``u`` of :func:`bits_to_uniform`."""
    return -torch.log(-torch.log(uniform))


def gumbel_at(seed: torch.Tensor, offset: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The Gumbel noise of rows ``(seed, offset)`` at vocabulary ids ``ids``."""
    return gumbel(bits_to_uniform(random_bits_at(seed, offset, ids)))
