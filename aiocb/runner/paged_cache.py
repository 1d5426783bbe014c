"""The physical paged KV cache: one K and one V tensor per layer."""

from __future__ import annotations

import torch

from aiocb.runner.memory import CachePlan
from aiocb.runner.model_spec import ModelSpec


class PagedKVCache:
    """Per layer ``key[i]`` and ``value[i]`` of shape ``[num_blocks + 2, page_size, kv_heads, head_dim]``.

    Block ids ``0 .. num_blocks-1`` belong to the layer's cache group's pool. Two more
    blocks follow: the *null* block, kept at zero, which padded reads point to, and the
    *trash* block, which padded writes (CUDA-graph padding rows) go to, so padding never
    touches a request's KV.
    """

    def __init__(self, spec: ModelSpec, plan: CachePlan) -> None:
        self.page_size = plan.page_size
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.layer_group = [0] * spec.num_layers
        self.group_windows: list[int | None] = []
        self.group_num_blocks = list(plan.num_blocks)
        for g, (window, layers) in enumerate(spec.group_layers()):
            self.group_windows.append(window)
            for layer in layers:
                self.layer_group[layer] = g
        self.key: list[torch.Tensor] = []
        self.value: list[torch.Tensor] = []
        for layer in range(spec.num_layers):
            shape = (self.group_num_blocks[self.layer_group[layer]] + 2, self.page_size, spec.num_kv_heads, spec.head_dim)
            k = torch.empty(shape, dtype=spec.dtype, device=spec.device)
            v = torch.empty(shape, dtype=spec.dtype, device=spec.device)
            null = self.null_block(self.layer_group[layer])
            k[null].zero_()
            v[null].zero_()
            self.key.append(k)
            self.value.append(v)

    def null_block(self, group: int) -> int:
        """The always-zero block of ``group`` that padded reads point to."""
        return self.group_num_blocks[group]

    def trash_block(self, group: int) -> int:
        """The block of ``group`` that padded writes go to."""
        return self.group_num_blocks[group] + 1

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V viewed as ``[slots, kv_heads, head_dim]`` (slot = block * page + offset)."""
        shape = (-1, self.num_kv_heads, self.head_dim)
        return self.key[layer].view(shape), self.value[layer].view(shape)

    @property
    def nbytes(self) -> int:
        """Bytes the K and V tensors take."""
        return sum(t.numel() * t.element_size() for t in (*self.key, *self.value))
