"""Paged attention, plugged into transformers through its ``AttentionInterface``.

The model runs on one flat sequence holding every scheduled token of the step. For each
layer, transformers hands this function the step's queries, keys and values (RoPE and
norms applied); it writes the new keys and values into the paged cache and attends, for
each request, over that request's own cached context and new tokens. No dense mask over
the flattened batch is built: the cost of a request grows with its own length only.

In the portable ``reference`` backend single-token rows (decode) are attended in batches,
each row's keys gathered and padded to the longest in its batch (on CPU, batches of rows of
similar length small enough to stay in the processor's cache; on GPUs one batch), and
multi-token rows (prefill chunks) one by one, each over its own keys. The ``cpu`` backend
(float32 on the CPU) reads the rows' keys where the cache holds them, through C kernels:
single-token rows in one call per layer, and the short multi-token rows in another (in
layers without a sliding window); longer rows, compute-bound, go the reference way.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from aiocb.core.kv_cache import ring_size
from aiocb.errors import InvalidConfigError
from aiocb.gil import yield_gil
from aiocb.runner import long_rope, native
from aiocb.runner.backends import Backend, paged_kernel
from aiocb.runner.inputs import AttentionMetadata, GroupAttention
from aiocb.runner.paged_cache import PagedKVCache

#: The name the attention function is registered under.
ATTENTION_NAME = "aiocb_paged"
#: The keyword argument that carries :class:`AttentionMetadata` through the model.
METADATA_KWARG = "aiocb_metadata"
_FALLBACK_ATTR = "_aiocb_fallback_attention"


@torch.compiler.disable  # type: ignore[untyped-decorator]  # per-step Python metadata: compiled models call it eagerly
def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention over the paged cache; ``query [1, Hq, T, D]``, ``key/value [1, Hkv, T, D]``.

    Returns ``[1, T, Hq, D]``. Called without aiocb's metadata (a plain ``model(...)`` or
    ``model.generate`` while a manager holds the model), it defers to the model's
    original attention implementation, with the mask transformers made for that one
    (:func:`original_mask`).
    """
    metadata: AttentionMetadata | None = kwargs.pop(METADATA_KWARG, None)
    probe: _Probe | None = getattr(_local, "probe", None)
    if metadata is None:
        if probe is not None:  # (in aiocb's own pass: its layers dropped the keyword arguments)
            probe.unpassed.add(type(module).__name__)
        fallback = _fallback_for(module)
        output, _ = fallback(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        return output, None
    layer: int = module.layer_idx  # type: ignore[assignment]
    if probe is not None:
        probe.take(module, key, metadata.cache)
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    softcap = kwargs.get("softcap")
    sinks = _sinks(module, kwargs.get("s_aux"), query.shape[1])
    q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)
    group = metadata.groups[metadata.cache.layer_group[layer]]
    if group.backend in (Backend.REFERENCE, Backend.CPU):
        out = reference_paged_attention(layer, q, k, v, metadata, scale, softcap, sinks)
    else:
        key_cache, value_cache = metadata.cache.flat(layer)
        key_cache.index_copy_(0, group.slot_mapping, k)
        value_cache.index_copy_(0, group.slot_mapping, v)
        out = paged_kernel(group.backend)(
            q,
            metadata.cache.key[layer],
            metadata.cache.value[layer],
            group.block_table,
            metadata.query_start,
            metadata.seq_lens,
            metadata.max_query_len,
            metadata.max_seq_len,
            scale,
            softcap,
            group.window,
            None if group.window is None else ring_size(group.window, metadata.cache.page_size),
            sinks,
        )
    return out[None], None


def _sinks(module: torch.nn.Module, sinks: object, num_heads: int) -> torch.Tensor | None:
    """A layer's attention sinks (gpt-oss's ``s_aux``: a learned logit per query head that
    joins each softmax's denominator and weighs no value), as float32 ``[Hq]``; None without."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor) or sinks.shape != (num_heads,):
        shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise InvalidConfigError(
            f"{type(module).__name__} passes attention sinks (s_aux) of shape {shape}, where aiocb's paged "
            f"attention takes one per query head of the layer ({num_heads}): the model is not supported"
        )
    return sinks.detach().float()


def reference_paged_attention(
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The portable backend, and the ``cpu`` one, whose rows the C kernels attend where its
    metadata says so: ``query [T, Hq, D]``, ``key/value [T, Hkv, D]`` -> ``[T, Hq, D]``;
    ``sinks`` (float32 ``[Hq]``, see :func:`_sinks`) join each softmax's denominator."""
    cache = metadata.cache
    group = metadata.groups[cache.layer_group[layer]]
    key_cache, value_cache = cache.flat(layer)

    # In a sliding-window ring a chunk's own tokens may land on slots of positions it
    # still needs, so there a chunk reads its past before the step writes. Full layers
    # write first: a request may reuse prefix blocks another computes in this same step.
    sliding_past: list[tuple[torch.Tensor, torch.Tensor]] = []
    if group.window is not None:
        for slots in group.prefill_read_slots:
            sliding_past.append((key_cache.index_select(0, slots), value_cache.index_select(0, slots)))
    key_cache.index_copy_(0, group.slot_mapping, key)
    value_cache.index_copy_(0, group.slot_mapping, value)

    decode_only = metadata.max_query_len == 1
    if decode_only:
        out = query  # (every row replaced below)
    elif group.prefill_keys is not None:
        # (contiguous, as the kernel writes it: its multi-token rows now, single-token ones below)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        _attend_prefill_in_place(query, key_cache, value_cache, group, cache.page_size, scale, softcap, sinks, out)
    else:
        out = torch.empty_like(query)
    if metadata.decode_token_index is not None:
        # In a decode-only step the rows are the step's tokens, in order.
        q = query if decode_only else query.index_select(0, metadata.decode_token_index)
        if group.decode_keys is None:
            decoded = _attend_decode(layer, q, group, cache, scale, softcap, sinks)
        else:
            decoded = _attend_decode_in_place(q, key_cache, value_cache, group, cache, scale, softcap, sinks)
        if decode_only:
            return decoded
        out.index_copy_(0, metadata.decode_token_index, decoded)

    for i, ((first, length), read_slots, prefill_mask) in enumerate(
        zip(group.prefill_rows, group.prefill_read_slots, group.prefill_masks, strict=True)
    ):
        new_k, new_v = key[first : first + length], value[first : first + length]
        if not len(read_slots):  # a fresh prompt: its keys are this step's, no copy needed
            k, v = new_k, new_v
        elif group.window is not None:
            k, v = torch.cat((sliding_past[i][0], new_k)), torch.cat((sliding_past[i][1], new_v))
        else:  # the new keys are in the cache already: one gather reads the past and them
            k, v = cache.gather(layer, read_slots)
        k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        q = query[first : first + length].transpose(0, 1)[None]
        attended = _attend(q, k, v, prefill_mask, scale, softcap, sinks, causal=prefill_mask is None)
        out[first : first + length] = attended[0].transpose(0, 1)
    return out


def _attend_decode(
    layer: int,
    q: torch.Tensor,
    group: GroupAttention,
    cache: PagedKVCache,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Single-token rows ``q [Bd, Hq, D]``, batch by batch, each row over its own keys
    (after the blocks every row shares, when they share a prefix)."""
    shared: tuple[torch.Tensor, torch.Tensor] | None = None
    if group.decode_shared_slots is not None:  # read once for every batch
        key_cache, value_cache = cache.flat(layer)
        slots = group.decode_shared_slots
        shared = key_cache.index_select(0, slots), value_cache.index_select(0, slots)
    decoded = torch.empty_like(q)
    for chunk in group.decode_chunks:
        rows = q if chunk.rows is None else q.index_select(0, chunk.rows)
        keys, values = cache.gather(layer, chunk.slots)
        shape = (rows.shape[0], chunk.width, *keys.shape[1:])
        k, v = keys.view(shape).transpose(1, 2), values.view(shape).transpose(1, 2)
        if shared is not None:
            attended = _attend_shared_prefix(rows, *shared, k, v, chunk.valid, scale, softcap, sinks)
        else:
            mask = None if chunk.valid is None else chunk.valid[:, None, None, :]
            attended = _attend(rows[:, :, None, :], k, v, mask, scale, softcap, sinks)[:, :, 0, :]
        if chunk.rows is None:
            return attended
        decoded.index_copy_(0, chunk.rows, attended)
    return decoded


def _attend_decode_in_place(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    group: GroupAttention,
    cache: PagedKVCache,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Single-token rows ``q [Bd, Hq, D]`` through the C kernel, which reads their keys in
    the cache (``[slots, Hkv, D]``) through the group's block table."""
    keys = group.decode_keys
    assert keys is not None
    library = _library()
    page = cache.page_size
    ring = ring_size(group.window, page) if group.window is not None else None
    return native.decode_attention(
        library, q, key_cache, value_cache, group.block_table, keys.table_rows, keys.first, keys.count,
        page, ring, scale, softcap, sinks=sinks,
    )  # fmt: skip


def _attend_prefill_in_place(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    group: GroupAttention,
    page: int,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    """The step's multi-token rows of ``query [T, Hq, D]`` through the C kernel, into their
    rows of ``out``: each query over its row's keys in the cache, from position 0 to its own."""
    keys = group.prefill_keys
    assert keys is not None
    native.prefill_attention(
        _library(), query, key_cache, value_cache, group.block_table, keys.table_rows, keys.token, keys.start,
        keys.length, page, scale, softcap, out, sinks=sinks,
    )  # fmt: skip


def _library() -> ctypes.CDLL:
    library = native.library()
    if library is None:
        raise RuntimeError("the cpu attention backend needs aiocb's C kernels, which did not build")
    return library


def _attend_shared_prefix(
    q: torch.Tensor,
    shared_k: torch.Tensor,
    shared_v: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    valid: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention over a prefix all rows share plus each row's own keys.

    ``q [B, Hq, D]``; ``shared_k/v [S, Hkv, D]`` read once for every row (no per-row copy
    of the prefix); ``k/v [B, Hkv, L, D]`` each row's keys after it, ``valid [B, L]`` (None:
    all). One softmax spans both parts (and the head's sink, when given). Returns ``[B, Hq, D]``.
    """
    rows, heads, dim = q.shape
    kv_heads = shared_k.shape[1]
    group = heads // kv_heads
    grouped = (q.float() * scale).view(rows, kv_heads, group, dim)
    # The shared part KV-head major, [Hkv, B * G, S]: one matrix product per KV head, and
    # the large weights never need a transposed copy.
    flat_q = grouped.permute(1, 0, 2, 3).reshape(kv_heads, rows * group, dim)
    shared_scores = torch.bmm(flat_q, shared_k.float().permute(1, 2, 0))
    own_scores = torch.matmul(grouped, k.float().transpose(-1, -2))  # [B, Hkv, G, L]
    if softcap:
        shared_scores = torch.tanh(shared_scores / softcap) * softcap
        own_scores = torch.tanh(own_scores / softcap) * softcap
    if valid is not None:
        own_scores = own_scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    own_scores = own_scores.permute(1, 0, 2, 3).reshape(kv_heads, rows * group, -1)
    peak = torch.maximum(shared_scores.amax(-1, keepdim=True), own_scores.amax(-1, keepdim=True))
    sink = None
    if sinks is not None:  # (in the layout of the scores' rows: KV head, row, head of its group)
        sink = sinks.view(kv_heads, 1, group).expand(kv_heads, rows, group).reshape(kv_heads, rows * group, 1)
        peak = torch.maximum(peak, sink)
    shared_weights = shared_scores.sub_(peak).exp_()
    own_weights = own_scores.sub_(peak).exp_()
    total = shared_weights.sum(-1, keepdim=True) + own_weights.sum(-1, keepdim=True)
    if sink is not None:
        total += (sink - peak).exp_()
    mixed = torch.bmm(shared_weights, shared_v.float().transpose(0, 1))  # [Hkv, B * G, D]
    own_mixed = torch.matmul(own_weights.view(kv_heads, rows, group, -1), v.float().transpose(0, 1))
    mixed += own_mixed.view(kv_heads, rows * group, dim)
    out = (mixed / total).view(kv_heads, rows, group, dim).permute(1, 0, 2, 3)
    return out.reshape(rows, heads, dim).to(q.dtype)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
    *,
    causal: bool = False,
) -> torch.Tensor:
    """``q [B, Hq, Lq, D]`` over ``k/v [B, Hkv, Lk, D]`` with grouped heads; mask is boolean
    (``[.., Lq or 1, Lk]``); ``sinks [Hq]`` join each softmax's denominator, weighing no value."""
    if not softcap and sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
    batch, heads, lq, _ = q.shape
    lk = k.shape[-2]
    groups = heads // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    if causal:
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    out = torch.empty((batch, heads, lq, v.shape[-1]), dtype=q.dtype, device=q.device)
    # The scores are written out whole: a long chunk's queries go a slice at a time, so that
    # they stay within _MOST_SCORES floats.
    step = max(1, _MOST_SCORES // (batch * heads * lk))
    for start in range(0, lq, step):
        stop = min(lq, start + step)
        scores = torch.matmul(q[:, :, start:stop], k.transpose(-1, -2)) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        if mask is not None:
            scores = scores.masked_fill(~(mask if mask.shape[-2] == 1 else mask[..., start:stop, :]), float("-inf"))
        if sinks is not None:  # (in float32, as transformers' eager attention keeps float32 sinks)
            sink = sinks.view(1, heads, 1, 1).expand(batch, heads, stop - start, 1)
            scores = torch.cat((scores.float(), sink), dim=-1)
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
        if sinks is not None:
            probs = probs[..., :-1]
        out[:, :, start:stop] = torch.matmul(probs, v)
    return out


#: The most attention scores (floats) :func:`_attend` writes out at once (64 MiB of float32)
_MOST_SCORES = 1 << 24


def _fallback_for(module: torch.nn.Module) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    name = getattr(module, _FALLBACK_ATTR, "sdpa")
    if name in AttentionInterface._global_mapping:
        return AttentionInterface._global_mapping[name]  # type: ignore[no-any-return]
    # "eager" is not registered: each transformers model module defines its own.
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    return eager if callable(eager) else sdpa_attention_forward


#: Configs of installed models (by id: a config is not hashable, and an attribute on it
#: would be saved with it) -> the name of the model's original attention. The mask
#: function sees only the config; the attention sees its module, which carries the name
#: itself. An entry leaves with its config, so a later config at the same id never finds it.
_ORIGINALS: dict[int, str] = {}
#: Configs routed through aiocb's attention (by id) -> how many holders have them, and the
#: setting to give back when the last lets go; changed under ``_holding``: runners attach
#: on worker threads, and detach on others.
_HOLDS: dict[int, tuple[int, str]] = {}
#: Configs whose records :func:`_forget` drops when they go (watched once each)
_WATCHED: set[int] = set()
_holding = threading.Lock()
#: Per device, the 4D stand-in mask of aiocb's own passes (:func:`forward`).
_NO_MASK: dict[torch.device, torch.Tensor] = {}


def original_mask(**kwargs: Any) -> Any:
    """The mask function registered for aiocb's attention: the original attention's own.

    transformers builds no mask for an attention without a mask function, so a plain
    ``model(...)`` or ``model.generate`` while a manager holds the model would reach the
    original eager attention with no causal mask, and SDPA with neither padding nor a
    sliding window. aiocb's own passes never get here: they bring a 4D stand-in mask,
    which transformers passes through untouched (a mask is never built for them).
    """
    config = kwargs.get("config")
    # (a config not held names aiocb's attention only when copied from one that was, and
    # its modules' attention is not known here: the eager mask, which every attention takes)
    name = _ORIGINALS.get(id(config), "eager")
    function = cast(Callable[..., Any], AttentionMaskInterface._global_mapping.get(name, sdpa_mask))
    return function(**kwargs)


def forward(
    model: Any,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    logits_indices: torch.Tensor,
    metadata: AttentionMetadata,
) -> torch.Tensor:
    """One forward pass of an installed model over a step (``input_ids [1, T]``): the
    logits ``[len(logits_indices), V]`` of the kept positions. A model's first pass is
    watched (:class:`_Probe`): a model whose attention does not reach the paged cache as
    it must is refused, naming it, rather than run over no cache."""
    device = input_ids.device
    stand_in = _NO_MASK.get(device)
    if stand_in is None:
        stand_in = _NO_MASK[device] = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device)
    probe = _local.probe = None if model in _PROBED else _Probe()
    try:
        with long_rope.step(metadata.long_rope):
            output = model(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=stand_in,
                use_cache=False,
                logits_to_keep=logits_indices,
                **{METADATA_KWARG: metadata},
            )
    except Exception as exc:
        if probe is None or probe.calls or probe.unpassed or _compiling_failed(exc) or _out_of_memory(exc):
            raise
        # (no layer reached aiocb's attention: most likely the model's own failed on
        # aiocb's inputs, though what failed may have come before any attention)
        raise probe.outside(model, f"its first pass failed before any layer called it: {exc!r}") from exc
    finally:
        _local.probe = None
    if probe is not None:
        probe.check(model, len(metadata.cache.layer_group))
        _PROBED.add(model)
    logits: torch.Tensor = output.logits[0]
    return logits


def _compiling_failed(exc: Exception) -> bool:
    """Whether ``exc`` is torch.compile's own failure (not the model's: it comes in its words)."""
    from torch._dynamo.exc import TorchDynamoException

    return isinstance(exc, TorchDynamoException)


def _out_of_memory(exc: Exception) -> bool:
    """Whether ``exc`` says the device or the host ran out of memory (a first pass that
    fails so says nothing of the model's attention)."""
    return isinstance(exc, (torch.OutOfMemoryError, MemoryError))


def _name(model: Any) -> str:
    """A model's class name (a compiled model's, its original's)."""
    return type(getattr(model, "_orig_mod", model)).__name__


#: Models (or their compiled forms) whose first pass the probe found right
_PROBED: weakref.WeakSet[Any] = weakref.WeakSet()
#: The probe of the pass under way on this thread (None: no pass is watched)
_local = threading.local()


class _Probe:
    """What aiocb's attention saw of a model's first pass: transformers' AttentionInterface
    alone does not make a model's attention reach the paged cache. Each attention layer
    must call it exactly once a pass (DiffLlama calls it twice, the second call's values
    overwriting the first's in the cache), with aiocb's metadata (StableLM's and Nemotron's
    decoder layers drop the keyword arguments that carry it: their attention would run the
    model's own, over no cache and no causal mask), and keys of the cache's heads and width
    (JetMoE's are not its config's ``num_key_value_heads``). A model none of whose layers
    calls it at all does not look it up in the interface (GPT-J, Falcon, Bloom, MPT): its
    own attention runs, over no cache and no causal mask, or fails on aiocb's inputs."""

    def __init__(self) -> None:
        self.calls: dict[int, int] = {}
        #: attention modules called without aiocb's metadata
        self.unpassed: set[str] = set()

    def take(self, module: torch.nn.Module, key: torch.Tensor, cache: PagedKVCache) -> None:
        """A call of the paged attention with aiocb's metadata (refused at once where its
        keys could not be written to the cache)."""
        layer: int = module.layer_idx  # type: ignore[assignment]
        self.calls[layer] = self.calls.get(layer, 0) + 1
        if (key.shape[1], key.shape[-1]) != (cache.num_kv_heads, cache.head_dim):
            raise InvalidConfigError(
                f"{type(module).__name__} gives keys of {key.shape[1]} heads of {key.shape[-1]} (layer {layer}), where "
                f"its config says {cache.num_kv_heads} of {cache.head_dim}, as aiocb's paged cache holds them: "
                "the model is not supported"
            )

    def outside(self, model: Any, why: str) -> InvalidConfigError:
        """The refusal of a model none of whose layers called aiocb's attention."""
        return InvalidConfigError(
            f"{_name(model)}'s attention does not go through transformers' AttentionInterface, which aiocb's paged "
            f"attention plugs into ({why}): the model is not supported"
        )

    def check(self, model: Any, num_layers: int) -> None:
        """Refuse ``model`` unless each of its ``num_layers`` layers attended once, as aiocb's."""
        if not self.calls and not self.unpassed:  # (GPT-J, Falcon, MPT: their own attention ran)
            raise self.outside(model, f"none of its {num_layers} layers called it")
        name = _name(model)
        problems: list[str] = []
        if self.unpassed:
            problems.append(
                f"its attention ({', '.join(sorted(self.unpassed))}) was called without the keyword arguments "
                "aiocb passes the model (its layers drop them)"
            )
        twice = sorted(layer for layer, count in self.calls.items() if count > 1)
        if twice:
            problems.append(f"layer {twice[0]} called attention {self.calls[twice[0]]} times in one pass")
        missing = sorted(set(range(num_layers)) - set(self.calls))
        if missing and not self.unpassed:
            problems.append(f"{len(missing)} of its {num_layers} layers never called aiocb's attention")
        if problems:
            raise InvalidConfigError(
                f"{name}'s attention does not work through aiocb's paged cache: {'; '.join(problems)}. "
                "The model is not supported"
            )


def hold(model: PreTrainedModel, long_rope_from: int | None) -> None:
    """Ready ``model`` for aiocb's passes, for one more holder: its attention routed
    (:func:`install`) and, for a longrope model (``long_rope_from``: its original length),
    its rotary embeddings choosing each token's setting (:mod:`aiocb.runner.long_rope`)."""
    install(model)
    if long_rope_from is not None:
        long_rope.install(model, long_rope_from)


def let_go(model: PreTrainedModel, long_rope_from: int | None) -> None:
    """One holder of ``model`` (see :func:`hold`) lets go."""
    uninstall(model)
    if long_rope_from is not None:
        long_rope.uninstall(model)


def install(model: PreTrainedModel) -> None:
    """Route the model's attention through the paged function, for one more holder.

    The routing lives on the model's configs (its own and its modules'), which other models
    may share (a model made from another's config object, a draft built from the target's
    layers): each config keeps aiocb's attention until every :func:`install` of a model
    that has it has had its :func:`uninstall` (several managers may hold one model, or
    models that share a config, at once)."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, original_mask)
    with _holding:
        configs = _configs(model)
        fresh = [config for config in configs if id(config) not in _HOLDS]
        for config in fresh:
            if id(config) not in _WATCHED:
                _WATCHED.add(id(config))
                weakref.finalize(config, _forget, id(config))
            setting = str(config._attn_implementation)
            if setting == ATTENTION_NAME:
                # A config made naming aiocb's attention (a copy of a held model's): the
                # attention its modules came with stands for its own, and is given back.
                setting = _copied_fallback(model, config) or ATTENTION_NAME
            _HOLDS[id(config)] = (0, setting)
            _ORIGINALS[id(config)] = setting if setting != ATTENTION_NAME else "sdpa"
        for config in configs:
            holders, setting = _HOLDS[id(config)]
            _HOLDS[id(config)] = (holders + 1, setting)
        # What a plain call of the model runs instead (see _fallback_for): each attention
        # module its config's original. (Each walk over a large model's modules takes a
        # millisecond or so: on a worker thread, the event loop's thread gets the GIL
        # between them.)
        yield_gil()
        fresh_ids = {id(config) for config in fresh}
        for module in model.modules():
            if hasattr(module, "layer_idx"):
                config_id = id(getattr(module, "config", model.config))
                if config_id in fresh_ids or not hasattr(module, _FALLBACK_ATTR):
                    setattr(module, _FALLBACK_ATTR, _ORIGINALS.get(config_id, _ORIGINALS[id(model.config)]))
        if any(config._attn_implementation_internal != ATTENTION_NAME for config in fresh):
            yield_gil()
            model.set_attn_implementation(ATTENTION_NAME)
            # (a config the model's own walk misses: another model's, on a layer it shares)
            for config in fresh:
                if config._attn_implementation_internal != ATTENTION_NAME:
                    config._attn_implementation_internal = ATTENTION_NAME


def uninstall(model: PreTrainedModel) -> None:
    """One holder lets go of the model: each of its configs that no other holder has gets
    its original attention back."""
    with _holding:
        for config in _configs(model):
            held = _HOLDS.get(id(config))
            if held is None:
                continue
            holders, own = held
            if holders > 1:
                _HOLDS[id(config)] = (holders - 1, own)
                continue
            del _HOLDS[id(config)]
            _ORIGINALS.pop(id(config), None)
            if own != ATTENTION_NAME and config._attn_implementation_internal == ATTENTION_NAME:
                # (each config its own: a multimodal model's may differ; set_attn_implementation
                # would give them all one, and reach configs that others still hold)
                config._attn_implementation_internal = own


def _copied_fallback(model: PreTrainedModel, config: Any) -> str | None:
    """The attention the modules of ``model`` that read ``config`` defer to, when they came
    with it (copied from a model aiocb held)."""
    for module in model.modules():
        if getattr(module, "config", None) is config and hasattr(module, _FALLBACK_ATTR):
            return str(getattr(module, _FALLBACK_ATTR))
    return None


def _forget(config_id: int) -> None:
    """A config went: its records go with it (a later config at its id must not find them)."""
    _ORIGINALS.pop(config_id, None)
    _HOLDS.pop(config_id, None)
    _WATCHED.discard(config_id)


def _configs(model: PreTrainedModel) -> list[Any]:
    """The model's config and its modules' (a multimodal model's text config among them)."""
    configs = {id(model.config): model.config}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None:
            configs[id(config)] = config
    return list(configs.values())
