"""LongRoPE (Phi-3's long-context models) picked per request, not per forward pass.

A longrope rotary embedding has two sets of frequencies: the short ones for sequences of
at most ``original_max_position_embeddings`` tokens, the long ones past that. transformers
picks one set for a whole forward pass, by its longest position: in ``model.generate`` a
prompt longer than the original length is prefilled with the long frequencies, every
token of it; a shorter one with the short frequencies, and each token generated after the
sequence passes that length with the long ones (the cache keeps what came before). One
request's pass is its own there; aiocb's passes pack many requests, so that choice would
depend on the other requests of the step.

Installed on a model (:func:`install`), the rotary embedding chooses token by token what
``generate`` would have chosen for that token's own request: the long frequencies for a
token at position ``p`` when ``p + 1`` passes the original length, or when its request's
prompt does (aiocb's steps say which tokens those are: :attr:`AttentionMetadata.long_rope`).
The cache hashes such requests' blocks apart from the others' (see
:class:`~aiocb.core.kv_cache.KVCacheManager`), since the same prefix holds other keys there.
A plain call of the model while a manager holds it (``model.generate``) runs the original
embedding.
"""

from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Iterator
from typing import Any, cast

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from aiocb.errors import InvalidConfigError

#: the attribute that holds a rotary module's long frequencies while installed
_LONG = "_aiocb_long_inv_freq"
#: the tokens of the forward pass under way that take the long frequencies whatever their
#: position (None: none; unset: no aiocb pass is under way, the original embedding runs)
_local = threading.local()
_UNSET = object()


def long_rope_length(config: Any) -> int | None:
    """The original length of a config's longrope scaling (``original_max_position_embeddings``),
    where its rotary embedding is one longrope for every layer; None otherwise."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(rope, dict) or rope.get("rope_type") != "longrope":
        return None
    original = rope.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", None)
    return original if isinstance(original, int) else None


def _rotary_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if getattr(m, "rope_type", None) == "longrope"]


def install(model: nn.Module, original: int) -> None:
    """Make each longrope rotary embedding of ``model`` choose its frequencies per token
    (idempotent). Each is checked against its original on the positions of a short and a
    long pass first: one that computes anything else is refused, naming it."""
    for module in _rotary_modules(model):
        if hasattr(module, _LONG):
            continue
        inv_freq = getattr(module, "inv_freq", None)
        short = getattr(module, "original_inv_freq", None)
        if not isinstance(inv_freq, torch.Tensor) or not isinstance(short, torch.Tensor):
            raise InvalidConfigError(
                f"{type(module).__name__} is a longrope rotary embedding without transformers' frequency buffers "
                "(inv_freq, original_inv_freq): aiocb cannot choose its frequencies per request"
            )
        long, _ = ROPE_INIT_FUNCTIONS["longrope"](module.config, inv_freq.device, seq_len=original + 1)
        # (as transformers does: copied into the frequencies' buffer, of its dtype)
        setattr(module, _LONG, long.to(device=inv_freq.device, dtype=inv_freq.dtype))
        try:
            _check(module, original)
        except BaseException:
            delattr(module, _LONG)
            raise
        module.forward = types.MethodType(_per_token_forward(original, module.forward), module)


def uninstall(model: nn.Module) -> None:
    """Give each rotary embedding of ``model`` its original forward back (idempotent)."""
    for module in _rotary_modules(model):
        if hasattr(module, _LONG):
            del module.forward  # (the instance's attribute: the class's method again)
            delattr(module, _LONG)


@contextlib.contextmanager
def step(long_tokens: torch.Tensor | None) -> Iterator[None]:
    """Within: an aiocb forward pass, whose tokens ``long_tokens`` (``[T]`` bool; None:
    none) take the long frequencies whatever their position."""
    previous = getattr(_local, "tokens", _UNSET)
    _local.tokens = long_tokens
    try:
        yield
    finally:
        _local.tokens = previous


def _per_token_forward(original: int, plain: Any) -> Any:
    def forward(self: nn.Module, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        forced = getattr(_local, "tokens", _UNSET)
        if forced is _UNSET:  # (a plain call of the model)
            result: tuple[torch.Tensor, torch.Tensor] = plain(x, position_ids)
            return result
        long = position_ids + 1 > original
        if isinstance(forced, torch.Tensor):
            long = long | forced.view_as(position_ids)
        with torch.no_grad():
            short_freq = cast(torch.Tensor, self.original_inv_freq).to(device=x.device, dtype=torch.float)
            long_freq = getattr(self, _LONG).to(device=x.device, dtype=torch.float)
            # (each token's frequencies times its position: the same products transformers'
            # forward makes with the set it picked)
            freqs = position_ids[..., None].float() * torch.where(long[..., None], long_freq, short_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            scaling = cast(float, self.attention_scaling)
            cos = emb.cos() * scaling
            sin = emb.sin() * scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)

    return forward


def _check(module: nn.Module, original: int) -> None:
    """Refuse ``module`` unless the per-token forward equals its own on a short pass and a
    long one (its buffer of frequencies left as it was)."""
    inv_freq: torch.Tensor = module.inv_freq  # type: ignore[assignment]
    saved = inv_freq.clone()
    forward = _per_token_forward(original, module.forward)
    x = torch.zeros(1, dtype=inv_freq.dtype, device=inv_freq.device)
    try:
        for length in (original, original + 2):  # (the longer pass: every token long)
            positions = torch.arange(length, device=inv_freq.device)[None]
            forced = torch.full((length,), length > original, device=inv_freq.device)
            with torch.no_grad():
                expected = module(x, positions)
                with step(forced):
                    got = forward(module, x, positions)
            if not all(torch.equal(a, b) for a, b in zip(expected, got, strict=True)):
                raise InvalidConfigError(
                    f"{type(module).__name__} computes its longrope embedding otherwise than transformers' rotary "
                    "embeddings do: aiocb cannot choose its frequencies per request"
                )
    finally:
        inv_freq.copy_(saved)
