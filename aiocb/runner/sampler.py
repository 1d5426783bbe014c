"""Batched per-request sampling: controls, greedy, temperature, top-k, top-p and min-p in one pass.

Randomness comes from a counter-based hash of ``(request seed, token index, vocab id)``
rather than a shared generator, so a request's samples depend on its seed alone, not on
which requests share its batch or in which order, and no host synchronisation is needed.
A token is drawn with the Gumbel-max trick: ``argmax(logits / T + Gumbel noise)`` over
the tokens that survive top-k and top-p.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from aiocb.runner.logits_controls import LogitsControls, apply_controls, apply_min_p

_MASK32 = 0xFFFFFFFF


class _SamplingRow(Protocol):
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    offset: int
    logprobs: bool
    top_logprobs: int


@dataclass(slots=True)
class SamplingTensors:
    """Per-row sampling parameters of one step, as tensors on the device."""

    temperature: torch.Tensor  # [S] float32, 0 for greedy rows
    top_k: torch.Tensor  # [S] int64, 0 = off
    top_p: torch.Tensor  # [S] float32, 1 = off
    seed: torch.Tensor  # [S] int64, 32-bit values
    offset: torch.Tensor  # [S] int64, tokens the request generated before
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_logprobs: bool
    #: the most alternatives any row asked for (0: none)
    max_top_logprobs: int
    #: [S] float32, 0 = off; None when no sampled row uses min-p
    min_p: torch.Tensor | None = None
    #: biases, penalties, bans and allow-lists; None when no row uses one
    controls: LogitsControls | None = None
    #: entries of ``controls.history_ids`` still being sampled by the previous step, and
    #: which of its sampled rows each comes from (async batching)
    history_carry: torch.Tensor | None = None
    history_carry_rows: torch.Tensor | None = None

    @staticmethod
    def host_tensors(rows: Sequence[_SamplingRow]) -> dict[str, torch.Tensor]:
        """The per-row parameters as host tensors, named for :meth:`from_device`."""
        host = {
            "temperature": torch.tensor([0.0 if _greedy(r) else r.temperature for r in rows], dtype=torch.float32),
            "top_k": torch.tensor([r.top_k for r in rows], dtype=torch.long),
            "top_p": torch.tensor([r.top_p for r in rows], dtype=torch.float32),
            "seed": torch.tensor([r.seed & _MASK32 for r in rows], dtype=torch.long),
            "offset": torch.tensor([r.offset for r in rows], dtype=torch.long),
        }
        if any(r.min_p > 0.0 and not _greedy(r) for r in rows):
            host["min_p"] = torch.tensor([0.0 if _greedy(r) else r.min_p for r in rows], dtype=torch.float32)
        return host

    @classmethod
    def from_rows(cls, rows: Sequence[_SamplingRow], device: torch.device) -> SamplingTensors:
        """Gather the sampled rows' parameters onto ``device``."""
        host = cls.host_tensors(rows)
        return cls.from_device({name: t.to(device) for name, t in host.items()}, rows)

    @classmethod
    def from_device(cls, tensors: dict[str, torch.Tensor], rows: Sequence[_SamplingRow]) -> SamplingTensors:
        """Wrap :meth:`host_tensors` moved to the device, with the rows' batch-wide flags."""
        greedy = [_greedy(r) for r in rows]
        return cls(
            temperature=tensors["temperature"],
            top_k=tensors["top_k"],
            top_p=tensors["top_p"],
            seed=tensors["seed"],
            offset=tensors["offset"],
            all_greedy=all(greedy),
            any_top_k=any(r.top_k > 1 for r, g in zip(rows, greedy, strict=True) if not g),
            any_top_p=any(r.top_p < 1.0 for r, g in zip(rows, greedy, strict=True) if not g),
            any_logprobs=any(r.logprobs or r.top_logprobs for r in rows),
            max_top_logprobs=max((r.top_logprobs for r in rows), default=0),
            min_p=tensors.get("min_p"),
            controls=_controls(tensors),
            history_carry=tensors.get("c_history_carry"),
            history_carry_rows=tensors.get("c_history_carry_rows"),
        )


def _controls(tensors: dict[str, torch.Tensor]) -> LogitsControls | None:
    """The ``c_*`` tensors of :func:`~aiocb.runner.inputs.controls_host_tensors` as controls."""
    if not any(name.startswith("c_") for name in tensors):
        return None
    return LogitsControls(**{f.name: tensors.get(f"c_{f.name}") for f in dataclasses.fields(LogitsControls)})


@dataclass(slots=True)
class Sampled:
    """One step's picks: ``tokens [S]``; with logprobs, theirs ``[S]`` and the top ``[S, k]``."""

    tokens: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


def _greedy(row: _SamplingRow) -> bool:
    return row.temperature == 0.0 or row.top_k == 1


def sample(logits: torch.Tensor, params: SamplingTensors) -> Sampled:
    """Pick one token per row of ``logits [S, V]`` (float32).

    When any row asked for them, also the log-probabilities of the picks and the most
    likely alternatives, under the raw distribution (log-softmax of ``logits``).
    """
    raw = logits
    if params.controls is not None:
        logits = apply_controls(logits, params.controls)
    greedy_tokens = logits.argmax(dim=-1)
    if params.all_greedy:
        tokens = greedy_tokens
    else:
        is_greedy = params.temperature == 0.0
        temperature = torch.where(is_greedy, 1.0, params.temperature)
        scaled = logits / temperature[:, None]
        if params.any_top_k or params.any_top_p:
            scaled = _apply_top_k_top_p(scaled, params.top_k, params.top_p)
        if params.min_p is not None:
            scaled = apply_min_p(scaled, params.min_p)
        noise = _gumbel(params.seed, params.offset, logits.shape[-1])
        sampled = (scaled + noise).argmax(dim=-1)
        tokens = torch.where(is_greedy, greedy_tokens, sampled)
    result = Sampled(tokens)
    if params.any_logprobs:
        result.logprobs, result.top_ids, result.top_logprobs = score(raw, tokens, params.max_top_logprobs)
    return result


def score(
    logits: torch.Tensor, targets: torch.Tensor, top: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Log-probabilities of ``targets [N]`` under ``logits [N, V]``, and the ``top`` best."""
    logprobs = logits.log_softmax(dim=-1)
    chosen = logprobs.gather(1, targets[:, None])[:, 0]
    if top <= 0:
        return chosen, None, None
    values, ids = logprobs.topk(min(top, logprobs.shape[-1]), dim=-1)
    return chosen, ids, values


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set every logit outside a row's top-k, then outside its top-p mass, to -inf."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab)
    sorted_logits = sorted_logits.masked_fill(ranks >= k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # The most likely token always survives, whatever top_p is.
    drop = (mass_before > top_p[:, None]) & (ranks > 0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


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
    row_key = _mix32(_mix32(seed) ^ _mix32((offset + 0x9E3779B9) & _MASK32))
    second_key = _mix32(row_key ^ 0x5BD1E995)
    ids = torch.arange(vocab, device=seed.device, dtype=torch.long)[None, :]
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


def _gumbel(seed: torch.Tensor, offset: torch.Tensor, vocab: int) -> torch.Tensor:
    return gumbel(uniform_noise(seed, offset, vocab))
