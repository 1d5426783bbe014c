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

#: The largest ``x`` of :func:`gumbel_of_bits` (``1 - x`` is the uniform whose Gumbel
#: quantile is taken): float32's largest value below 1 (the smallest is ``2**-33``).
_X_HIGH = 1.0 - 2.0**-24
#: Above any Gumbel noise :func:`gumbel_of_bits` returns: ``-log(2**-33)``, about 22.87,
#: with room for float32's rounding.
GUMBEL_BOUND = 33 * math.log(2.0) + 1e-3


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
    """The two int32 keys of each row ``(seed, offset)`` (``[S]`` int64, seeds 32-bit).

    The offset is hashed twice, the seed once: with one hash each, ``mix(seed) ^
    mix(offset + c)`` was symmetric in the two, so the ``n`` samples of a request whose
    seed lay in ``[c, c + n)`` (seeds ``seed + i``) drew sample a's token b with the noise
    of sample b's token a.
    """
    offset_key = _mix32(_mix32(_as_int32((offset + 0x9E3779B9) & _MASK32)))
    row_key = _mix32(_mix32(_as_int32(seed)) ^ offset_key)
    return row_key, _mix32(row_key ^ 0x5BD1E995)


def random_bits(seed: torch.Tensor, offset: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[S, V]`` 32-bit values (in int64), a pure function of (seed, offset, vocab id)."""
    return random_bits_at(seed, offset, torch.arange(vocab, device=seed.device, dtype=torch.long)[None, :])


def random_bits_at(seed: torch.Tensor, offset: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The values of :func:`random_bits` at vocabulary ids ``ids`` (``[S, K]``, or ``[1, K]`` for all rows)."""
    first, second = _row_keys(seed, offset)
    bits = _mix32(_mix32(ids.to(torch.int32) ^ first[:, None]) ^ second[:, None])
    return bits.to(torch.int64) & _MASK32


def gumbel_of_bits(bits: torch.Tensor) -> torch.Tensor:
    """32-bit values (in int64) to float32 Gumbel noise, increasing in the bits.

    The noise is ``-log(E)`` with ``E = -log(1 - x)`` and ``x = (~bits + 0.5) / 2**32``
    (kept below 1): ``x`` is fine near 0, where the upper tail is, so the noise reaches
    ``33 log 2`` (about 22.9) in steps that shrink with it. A uniform ``u`` of 23 bits made
    ``-log(-log(u))`` stop at 16.6, in coarse steps: with 151,936 tokens, one 18 below the
    top was drawn a sixth as often as it should be, one 20 below never. ``E`` is taken as
    ``x * (-log(w) / (1 - w))`` with ``w = 1 - x`` rounded (the ratio 1 where ``w`` is 1):
    exact to a few ulps near ``w = 1`` with ``log`` alone, in the same steps in every
    implementation (the C and Triton kernels compute it in this order too).
    """
    x = (_MASK32 - bits).to(torch.float32)
    x += 0.5
    x *= 2.0**-32
    x.clamp_(max=_X_HIGH)
    w = 1.0 - x
    ratio = torch.where(w == 1.0, 1.0, w.log().neg_() / (1.0 - w))
    return (x * ratio).log_().neg_()


def gumbel_noise(seed: torch.Tensor, offset: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[S, V]`` Gumbel noise, a pure function of (seed, offset, vocab id)."""
    return gumbel_of_bits(random_bits(seed, offset, vocab))


def gumbel_at(seed: torch.Tensor, offset: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The Gumbel noise of rows ``(seed, offset)`` at vocabulary ids ``ids``."""
    return gumbel_of_bits(random_bits_at(seed, offset, ids))


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
    """``argmax(scaled + gumbel_noise(seed, offset, V), dim=-1)`` for CPU rows
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
        # gumbel_of_bits: the same float32 operations in the same order. ~bits, as uint32,
        # made float in two exact halves whose sum rounds once, as one conversion does.
        torch.bitwise_not(x, out=s)
        torch.bitwise_right_shift(s, 16, out=x)
        x &= 0xFFFF
        f.copy_(x)
        f *= 65536.0
        s &= 0xFFFF
        f += s
        f += 0.5
        f *= 2.0**-32
        f.clamp_(max=_X_HIGH)
        w, gap = s.view(torch.float32), x.view(torch.float32)  # (the bits are spent)
        torch.neg(f, out=w)
        w += 1.0
        torch.neg(w, out=gap)
        gap += 1.0
        w.log_().neg_()
        w /= gap
        w.nan_to_num_(nan=1.0)  # (-log(1) / 0: the ratio is 1 where w is 1, and nowhere else NaN)
        f *= w
        f.log_().neg_()
        f += scaled[:, start : start + n]
        value, index = f.max(dim=-1)
        better = (value > best) | (value.isnan() & ~best.isnan())
        best = torch.where(better, value, best)
        token = torch.where(better, index + start, token)
    return token
