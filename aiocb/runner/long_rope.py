"""LongRoPE (Phi-3's long-context models) picked per request, not per forward pass.

A longrope rotary embedding has two settings: the short one for sequences of at most
``original_max_position_embeddings`` tokens, the long one past that (other frequencies, or
for PhiMoE another scale). transformers picks one for a whole forward pass, by its longest
position: in ``model.generate`` a prompt longer than the original length is prefilled with
the long setting, every token of it; a shorter one with the short setting, and once the
sequence passes the length the tokens after it take the long one. Phi-3 and PhiMoE go
further: at that point their ``generate`` drops the cache and computes the whole sequence
again with the long setting (:func:`recomputes_at_length`). One request's pass is its own
there; aiocb's passes pack many requests, so that choice would hang on the step's other
requests.

Installed on a model (:func:`install`), the rotary embedding chooses token by token what
``generate`` chose for that token in its own request: the long setting for a token at
position ``p`` when ``p + 1`` passes the original length, or when its request is long
(its prompt passes the length, or, for Phi-3 and PhiMoE, its sequence did: the scheduler
computes it again then); aiocb's steps mark those tokens
(:attr:`~aiocb.runner.inputs.AttentionMetadata.long_rope`). Each setting comes from the
module's own forward, so whatever it computes is what transformers computes. The cache
hashes long requests' blocks apart from the others' (the same prefix holds other keys).
A plain call of the model while a manager holds it (``model.generate``) runs the module
as transformers made it.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import types
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

#: how many runners hold each installed rotary module (not an attribute of it: a copy of a
#: held model, which carries the installed forward, is held by none)
_HOLDERS: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()
#: held while they change (runners attach and detach on their own threads)
_holding = threading.Lock()
#: attributes a rotary module holds while installed: the original length, and the instance
#: forward it had before (an accelerate hook's), if any
_ORIGINAL = "_aiocb_long_rope_from"
_SAVED_FORWARD = "_aiocb_saved_forward"
#: the tokens of the forward pass under way that take the long setting whatever their
#: position (None: none; unset: no aiocb pass is under way, the original embedding runs)
_local = threading.local()
_UNSET = object()


def long_rope_length(config: Any) -> int | None:
    """The original length of a config's longrope scaling (``original_max_position_embeddings``),
    where its rotary embedding is one longrope for every layer; None otherwise."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(rope, dict) or rope.get("rope_type", rope.get("type")) != "longrope":
        return None
    original = rope.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", None)
    return original if isinstance(original, int) else None


def recomputes_at_length(model: nn.Module) -> bool:
    """Whether ``model.generate`` computes a sequence again once it passes the original
    length (Phi-3's and PhiMoE's ``prepare_inputs_for_generation`` drop the cache there, so
    that every token's keys have the long setting)."""
    prepare = getattr(type(model), "prepare_inputs_for_generation", None)
    if prepare is None or not hasattr(getattr(model, "config", None), "original_max_position_embeddings"):
        return False
    try:
        source = inspect.getsource(prepare)
    except (OSError, TypeError):
        return False
    return "original_max_position_embeddings" in source and "past_key_values = None" in source


def rotary_modules(model: nn.Module) -> list[nn.Module]:
    """The longrope rotary embeddings of ``model`` (those transformers' ``rope_type`` names so)."""
    return [m for m in model.modules() if getattr(m, "rope_type", None) == "longrope"]


def install(model: nn.Module, original: int) -> None:
    """Make each longrope rotary embedding of ``model`` choose its setting per token, for
    one more holder (each :func:`install` wants its :func:`uninstall`)."""
    with _holding:
        _install(model, original)


def _install(model: nn.Module, original: int) -> None:
    for module in rotary_modules(model):
        holders = _HOLDERS.get(module, 0)
        if not holders:
            current = module.__dict__.get("forward")  # (an instance's own: an accelerate hook's)
            if getattr(current, "__func__", None) is not _per_token_forward:  # (a held model's copy has it)
                setattr(module, _SAVED_FORWARD, current)
            setattr(module, _ORIGINAL, original)
            module.forward = types.MethodType(_per_token_forward, module)
        _HOLDERS[module] = holders + 1


def uninstall(model: nn.Module) -> None:
    """One holder fewer: the last gives each rotary embedding its forward back."""
    with _holding:
        _uninstall(model)


def _uninstall(model: nn.Module) -> None:
    for module in rotary_modules(model):
        holders = _HOLDERS.get(module, 0)
        if holders > 1:
            _HOLDERS[module] = holders - 1
        elif holders == 1:
            del _HOLDERS[module]
            saved = module.__dict__.pop(_SAVED_FORWARD, None)
            module.__dict__.pop(_ORIGINAL, None)
            if saved is None:
                del module.forward  # (the class's method again)
            else:
                module.forward = saved


@contextlib.contextmanager
def step(long_tokens: torch.Tensor | None) -> Iterator[None]:
    """Within: an aiocb forward pass, whose tokens ``long_tokens`` (``[T]`` bool; None:
    none) take the long setting whatever their position."""
    previous = getattr(_local, "tokens", _UNSET)
    _local.tokens = long_tokens
    try:
        yield
    finally:
        _local.tokens = previous


def _per_token_forward(
    self: nn.Module, x: torch.Tensor, position_ids: torch.Tensor, *args: Any, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """An installed rotary module's forward (looked up on the module itself at each call: a
    copy of it runs on its own buffers)."""
    saved = self.__dict__.get(_SAVED_FORWARD)
    plain = saved if saved is not None else types.MethodType(type(self).forward, self)
    forced = getattr(_local, "tokens", _UNSET)
    if forced is _UNSET:  # (a plain call of the model)
        result: tuple[torch.Tensor, torch.Tensor] = plain(x, position_ids, *args, **kwargs)
        return result
    original: int = self.__dict__[_ORIGINAL]
    long = position_ids + 1 > original
    if isinstance(forced, torch.Tensor):
        long = long | forced.view_as(position_ids)
    # The module's own pass with its longest position within the length (the tokens past
    # it, clamped, are not taken from it) and past it (one position more, dropped after):
    # each position's embedding depends on its position and the setting alone.
    short_cos, short_sin = plain(x, position_ids.clamp(max=original - 1), *args, **kwargs)
    past = position_ids.new_full((*position_ids.shape[:-1], 1), original)
    long_cos, long_sin = plain(x, torch.cat((position_ids, past), dim=-1), *args, **kwargs)
    keep = long[..., None]
    return torch.where(keep, long_cos[..., :-1, :], short_cos), torch.where(keep, long_sin[..., :-1, :], short_sin)
