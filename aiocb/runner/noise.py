"""Counter-based randomness: a pure function of ``(request seed, token index, vocab id)``.

A request's draws depend on its seed alone, never on which requests share its batch or
in which order, and computing the noise of a few vocabulary entries gives the same values
as computing the whole row's (:func:`random_bits_at`), so a sampler may look only at its
candidates.

:func:`gumbel_argmax` is the whole-vocabulary draw on a CPU: the same values, computed
a cache-sized block of the vocabulary at a time and in place, instead of some thirty
``[rows, vocab]`` temporaries (ten to twenty times faster).
"""

from __future__ import annotations

import math

import torch

_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF

#: Above any Gumbel noise :func:`gumbel` returns: ``-log(-log(1 - 2**-24))`` (the largest
#: uniform of :func:`bits_to_uniform`), about 16.64, with room for float32's rounding.
GUMBEL_BOUND = -math.log(-math.log1p(-(2.0**-24))) + 1e-3


def seed_key(seed: int) -> int:
    """The 32-bit key of a request's random stream.

    A seed in ``[0, 2**32)`` is its own key. Any other (negative, or 64-bit) is mixed down
    by Fibonacci hashing of its 64-bit two's complement, so that seeds differing only in
    their high bits get unrelated streams, not one stream that masking would give them.
    """
    if 0 <= seed <= _MASK32:
        return seed
    return ((seed & _MASK64) * 0x9E3779B97F4A7C15 & _MASK64) >> 32


def _signed32(constant: int) -> int:
    return constant - (1 << 32) if constant >= 1 << 31 else constant


_M1, _M2 = _signed32(0x7FEB352D), _signed32(0x846CA68B)


def _as_int32(values: torch.Tensor) -> torch.Tensor:
    """32-bit values held in int64 as the int32 with the same bits."""
    return torch.where(values >= 1 << 31, values - (1 << 32), values).to(torch.int32)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) with good avalanche, on int32 bits: int32 products
    wrap mod 2**32, and torch's ``>>`` is arithmetic, so each shift is masked to be logical."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * _M1
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * _M2
    return x ^ ((x >> 16) & 0xFFFF)


def _row_keys(seed: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two int32 keys of each row ``(seed, offset)`` (``[S]`` int64, seeds 32-bit)."""
    row_key = _mix32(_mix32(_as_int32(seed)) ^ _mix32(_as_int32((offset + 0x9E3779B9) & _MASK32)))
    return row_key, _mix32(row_key ^ 0x5BD1E995)


def random_bits(seed: torch.Tensor, offset: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[S, V]`` 32-bit values (in int64), a pure function of (seed, offset, vocab id)."""
    return random_bits_at(seed, offset, torch.arange(vocab, device=seed.device, dtype=torch.long)[None, :])


def random_bits_at(seed: torch.Tensor, offset: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The values of :func:`random_bits` at vocabulary ids ``ids`` (``[S, K]``, or ``[1, K]`` for all rows)."""
    first, second = _row_keys(seed, offset)
    bits = _mix32(_mix32(ids.to(torch.int32) ^ first[:, None]) ^ second[:, None])
    return bits.to(torch.int64) & _MASK32


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


#: Elements of one block of :func:`gumbel_argmax` (its three scratch tensors, 3 MiB in
#: all, stay in a core's cache; fewer would spend more on torch's per-call overhead).
BLOCK_ELEMENTS = 1 << 18


def _xorshift_(x: torch.Tensor, shift: int, scratch: torch.Tensor) -> None:
    """``x ^= x >>> shift`` on int32 bits (torch's ``>>`` is arithmetic: the mask makes it logical)."""
    torch.bitwise_right_shift(x, shift, out=scratch)
    scratch &= (1 << (32 - shift)) - 1
    x ^= scratch


def _mix32_(x: torch.Tensor, scratch: torch.Tensor) -> None:
    """:func:`_mix32` in place, with a scratch tensor of the same shape."""
    _xorshift_(x, 16, scratch)
    x *= _M1
    _xorshift_(x, 15, scratch)
    x *= _M2
    _xorshift_(x, 16, scratch)


def gumbel_argmax(scaled: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """``argmax(scaled + gumbel(uniform_noise(seed, offset, V)), dim=-1)`` for CPU rows
    ``scaled [R, V]`` (float32), without the ``[R, V]`` noise: bit for bit the same noise
    and the same pick (ties and NaNs as ``torch.argmax``: the first index wins)."""
    rows, vocab = scaled.shape
    first, second = (key[:, None] for key in _row_keys(seed, offset))
    width = min(vocab, max(64, BLOCK_ELEMENTS // max(rows, 1)))
    ids = torch.arange(width, dtype=torch.int32)
    bits = torch.empty(rows, width, dtype=torch.int32)
    scratch = torch.empty_like(bits)
    score = torch.empty(rows, width, dtype=torch.float32)
    best = torch.full((rows,), float("-inf"))
    token = torch.zeros(rows, dtype=torch.long)
    for start in range(0, vocab, width):
        n = min(width, vocab - start)
        x, s, f = (bits, scratch, score) if n == width else (bits[:, :n], scratch[:, :n], score[:, :n])
        # random_bits_at: mix(mix(ids ^ first) ^ second)
        torch.bitwise_xor(ids[:n] + start, first, out=x)
        _mix32_(x, s)
        x ^= second
        _mix32_(x, s)
        # bits_to_uniform, then gumbel: the same float32 operations in the same order
        torch.bitwise_right_shift(x, 9, out=s)
        s &= 0x7FFFFF
        f.copy_(s)
        f += 0.5
        f *= 1.0 / (1 << 23)
        f.log_().neg_().log_().neg_()
        f += scaled[:, start : start + n]
        value, index = f.max(dim=-1)
        better = (value > best) | (value.isnan() & ~best.isnan())
        best = torch.where(better, value, best)
        token = torch.where(better, index + start, token)
    return token
