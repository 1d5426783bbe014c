"""What the runtime needs to know about a transformers causal LM, read from its config."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from aiocb.core.kv_cache import CacheGroup
from aiocb.errors import InvalidConfigError
from aiocb.runner.long_rope import long_rope_length, recomputes_at_length, rotary_modules
from aiocb.runner.tp_layout import shard_heads


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Shapes of a model's attention and cache, per layer where they differ.

    Under tensor parallelism the head counts are this rank's shard of them.
    """

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int | None
    #: per layer, the sliding window (None for full attention)
    layer_windows: tuple[int | None, ...]
    dtype: torch.dtype
    device: torch.device
    #: tensor-parallel ranks the attention heads are split over
    tp_size: int = 1
    #: whether the attention has sinks (gpt-oss's learned logit per head in each softmax)
    sinks: bool = False
    #: a longrope model's original length, past which its long setting applies
    #: (:mod:`aiocb.runner.long_rope`); None for other models ...
    long_rope_from: int | None = None
    #: ... and whether a request whose sequence passes it is computed again, all long
    #: (Phi-3's and PhiMoE's ``generate`` do so)
    long_rope_recomputes: bool = False

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element of the cache."""
        return torch.empty((), dtype=self.dtype).element_size()

    def cache_groups(self, num_blocks: list[int], num_host_blocks: list[int] | None = None) -> list[CacheGroup]:
        """The cache groups, full attention first, then one per window size."""
        host = num_host_blocks or [0] * len(num_blocks)
        return [
            CacheGroup(layer_ids=layers, num_blocks=n, sliding_window=window, num_host_blocks=h)
            for (window, layers), n, h in zip(self.group_layers(), num_blocks, host, strict=True)
        ]

    def group_layers(self) -> list[tuple[int | None, tuple[int, ...]]]:
        """``(window, layer ids)`` per cache group, full attention first."""
        windows = sorted({w for w in self.layer_windows}, key=lambda w: -1 if w is None else w)
        return [(w, tuple(i for i, lw in enumerate(self.layer_windows) if lw == w)) for w in windows]

    def bytes_per_block(self, page_size: int, num_layers: int) -> int:
        """Bytes of K and V for one block of ``num_layers`` layers."""
        return 2 * num_layers * page_size * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def group_block_bytes(self, page_size: int) -> list[int]:
        """Bytes of one block of each cache group, in :meth:`group_layers` order."""
        return [self.bytes_per_block(page_size, len(layers)) for _, layers in self.group_layers()]


def model_spec(model: PreTrainedModel) -> ModelSpec:
    """Read a model's attention layout from its (text) config; refuse, naming it, a model
    whose attention aiocb cannot route through its paged cache."""
    name = type(model).__name__
    # (whether its attention goes through transformers' AttentionInterface at all is found
    # by its first pass: see attention._Probe)
    config = model.config.get_text_config()
    long_rope_from = long_rope_length(config)
    if long_rope_from is not None and not rotary_modules(model):
        raise InvalidConfigError(
            f"{type(model).__name__}'s config has a longrope scaling, but none of its modules is a rotary "
            "embedding transformers names longrope (rope_type): aiocb cannot choose its setting per request"
        )
    try:
        num_layers = int(config.num_hidden_layers)
        num_heads = int(config.num_attention_heads)
        num_kv_heads = int(getattr(config, "num_key_value_heads", None) or num_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // num_heads)
    except (AttributeError, TypeError) as exc:  # (a state-space model's config; per-layer head sizes)
        raise InvalidConfigError(
            f"{name} has no attention layout aiocb's paged cache can hold (its config: {exc}): the model is not "
            "supported"
        ) from None
    if num_layers < 1:
        raise InvalidConfigError(f"{name} has no layers (num_hidden_layers={num_layers}): nothing to cache")
    if getattr(config, "kv_lora_rank", None) or getattr(config, "v_head_dim", None) not in (None, head_dim):
        # (DeepSeek-V2/V3's config gives head_dim as the rotary part alone: a cache of that
        # width would take keys of another, and fail at the first step)
        raise InvalidConfigError(
            f"{type(model).__name__}'s attention has keys and values of other widths than head_dim={head_dim} "
            "(multi-head latent attention: kv_lora_rank, qk_nope_head_dim + qk_rope_head_dim, v_head_dim), "
            "which aiocb's paged cache does not hold"
        )
    tp_size, num_heads, num_kv_heads = shard_heads(model, num_heads, num_kv_heads)
    param = next(model.parameters())
    return ModelSpec(
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        hidden_size=int(config.hidden_size),
        intermediate_size=int(getattr(config, "intermediate_size", None) or 4 * config.hidden_size),
        vocab_size=int(config.vocab_size),
        max_position_embeddings=context_length(config),
        layer_windows=_layer_windows(config, num_layers),
        dtype=param.dtype,
        device=param.device,
        tp_size=tp_size,
        sinks=any(isinstance(getattr(module, "sinks", None), torch.Tensor) for module in model.modules()),
        long_rope_from=long_rope_from,
        long_rope_recomputes=long_rope_from is not None and recomputes_at_length(model),
    )


def served_context(config: object, max_model_len: int | None) -> int | None:
    """The longest sequence a model's requests may reach: its :func:`context_length`, or
    ``max_model_len`` (a :class:`~aiocb.ContinuousBatchingConfig` field) where given, which
    may not be more (InvalidConfigError)."""
    context = context_length(config)
    if max_model_len is None:
        return context
    if context is not None and max_model_len > context:
        raise InvalidConfigError(f"max_model_len={max_model_len} is more than the model's context length ({context})")
    return max_model_len


def context_length(config: object) -> int | None:
    """The longest sequence of a model's requests: its ``max_position_embeddings``, or, for
    a longrope scaling per layer type, its ``original_max_position_embeddings`` where that
    is shorter: transformers picks the long frequencies by the longest position of a
    forward pass, and one request past that length would switch every other request of
    aiocb's shared passes to them (a single longrope scaling, Phi-3's, is chosen per
    request instead: :mod:`aiocb.runner.long_rope`)."""
    length = getattr(config, "max_position_embeddings", None)
    length = int(length) if isinstance(length, int) else None
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    per_layer_type = bool(rope) and all(isinstance(v, dict) for v in rope.values())  # (as Gemma 3's)
    for params in rope.values() if per_layer_type else []:
        if params.get("rope_type") == "longrope":
            original = params.get("original_max_position_embeddings") or getattr(
                config, "original_max_position_embeddings", None
            )
            if isinstance(original, int) and (length is None or original < length):
                length = original
    return length


#: The kinds of layer (a config's ``layer_types``) whose attention the paged cache keeps.
_ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention"})


def _layer_windows(config: object, num_layers: int) -> tuple[int | None, ...]:
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        other = sorted(set(layer_types) - _ATTENTION_LAYERS)
        if other:  # (Llama 4's chunked attention read as full attention would see past its chunk)
            raise InvalidConfigError(
                f"the model has {', '.join(other)} layers, which aiocb's paged attention does not support "
                f"(it takes {', '.join(sorted(_ATTENTION_LAYERS))})"
            )
        return tuple(window if t == "sliding_attention" and window else None for t in layer_types)
    if window and getattr(config, "use_sliding_window", True):
        return (int(window),) * num_layers  # Mistral: every layer slides
    return (None,) * num_layers
