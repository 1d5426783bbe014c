"""The physical paged KV cache: one K and one V tensor per layer."""

from __future__ import annotations

import math
import mmap

import torch

from aiocb.runner.memory import CachePlan
from aiocb.runner.model_spec import ModelSpec


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor. In host memory, an anonymous mapping, whose pages the kernel zeroes
    when first touched: ``torch.zeros`` writes every byte, which for a draft model's cache
    of gigabytes took 10 s of a manager's start, and committed all of its memory at once,
    where most of it is never written (the tensor keeps the mapping)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # (private: a forked child writes its own copies of the pages, not the parent's)
    private = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    memory = mmap.mmap(-1, nbytes, flags=private) if private else mmap.mmap(-1, nbytes)
    return torch.frombuffer(memory, dtype=dtype).view(shape)


class PagedKVCache:
    """Per layer ``key[i]`` and ``value[i]`` of shape ``[num_blocks + 2, page_size, kv_heads, head_dim]``.

    Block ids ``0 .. num_blocks-1`` belong to the layer's cache group's pool. Two more
    blocks follow: the *null* block, kept at zero, which padded reads point to, and the
    *trash* block, which padded writes (CUDA-graph padding rows) go to, so padding never
    touches a request's KV.
    """

    def __init__(self, spec: ModelSpec, plan: CachePlan, *, zeroed: bool = False) -> None:
        """``zeroed``: every block starts at zero, for a cache some of whose rows may be read
        where they were never written (a draft model's)."""
        self.device = spec.device
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
        # CPU: reused buffers for gathered keys and values (see gather()).
        self._workspace: tuple[torch.Tensor, torch.Tensor] | None = None
        # CPU offloading: the same layout in (pinned, on CUDA) host memory.
        self.host_key: list[torch.Tensor | None] = []
        self.host_value: list[torch.Tensor | None] = []
        pinned = spec.device.type == "cuda"
        for layer in range(spec.num_layers):
            shape = (
                self.group_num_blocks[self.layer_group[layer]] + 2,
                self.page_size,
                spec.num_kv_heads,
                spec.head_dim,
            )
            allocate = zeros if zeroed else torch.empty
            k = allocate(shape, dtype=spec.dtype, device=spec.device)
            v = allocate(shape, dtype=spec.dtype, device=spec.device)
            null = self.null_block(self.layer_group[layer])
            k[null].zero_()
            v[null].zero_()
            self.key.append(k)
            self.value.append(v)
            host_blocks = plan.num_host_blocks[self.layer_group[layer]]
            for store in (self.host_key, self.host_value):
                store.append(
                    torch.empty((host_blocks, *shape[1:]), dtype=spec.dtype, pin_memory=pinned) if host_blocks else None
                )

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
    def slot_nbytes(self) -> int:
        """Bytes one slot's keys take in one layer (its values take as many)."""
        return self.num_kv_heads * self.head_dim * self.key[0].element_size()

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V at ``slots`` (``[N]``), each ``[N, kv_heads, head_dim]``.

        On CPU they are written into buffers reused from one call to the next (valid until
        the next call): a fresh multi-megabyte tensor per call would come from the system
        allocator as new pages, and faulting them in costs more than the copy itself.
        """
        key_cache, value_cache = self.flat(layer)
        if self.device.type != "cpu":
            return key_cache.index_select(0, slots), value_cache.index_select(0, slots)
        count = slots.numel()
        if self._workspace is None or self._workspace[0].shape[0] < count:
            # with headroom: a lone long request's keys grow a slot per step
            shape = (count + count // 4, self.num_kv_heads, self.head_dim)
            self._workspace = (torch.empty(shape, dtype=key_cache.dtype), torch.empty(shape, dtype=key_cache.dtype))
        key_buffer, value_buffer = self._workspace
        return (
            torch.index_select(key_cache, 0, slots, out=key_buffer[:count]),
            torch.index_select(value_cache, 0, slots, out=value_buffer[:count]),
        )

    def move_blocks(
        self,
        copies: list[list[tuple[int, int]]],
        swap_out: list[list[tuple[int, int]]],
        swap_in: list[list[tuple[int, int]]],
    ) -> None:
        """A step's block moves, before its forward pass: forks, then swaps out, then in.

        The step may reuse the blocks that were swapped out, and reads the ones swapped in.
        Forks copy before any swap, as a fork's source block may be freed in the same plan
        and handed to a request being swapped in.
        """
        if any(copies):
            self.copy_blocks(copies)
        if any(swap_out):
            self.swap_out(swap_out)
        if any(swap_in):
            self.swap_in(swap_in)

    def copy_blocks(self, copies: list[list[tuple[int, int]]]) -> None:
        """Copy ``(source block, destination block)`` pairs of each group within the cache."""
        for layer, group in enumerate(self.layer_group):
            pairs = copies[group] if group < len(copies) else []
            if not pairs:
                continue
            device = self.key[layer].device
            sources = _indices([s for s, _ in pairs], device)
            targets = _indices([d for _, d in pairs], device)
            for cache in (self.key[layer], self.value[layer]):
                cache.index_copy_(0, targets, cache.index_select(0, sources))

    def swap_out(self, copies: list[list[tuple[int, int]]]) -> None:
        """Copy ``(device block, host block)`` pairs of each group to host memory.

        Blocking: the device blocks may be handed to another request right after.
        """
        for layer, group in enumerate(self.layer_group):
            pairs = copies[group] if group < len(copies) else []
            if not pairs:
                continue
            device_ids = torch.tensor([d for d, _ in pairs], device=self.key[layer].device)
            host_ids = torch.tensor([h for _, h in pairs])
            for cache, host in ((self.key[layer], self.host_key[layer]), (self.value[layer], self.host_value[layer])):
                assert host is not None
                host.index_copy_(0, host_ids, cache.index_select(0, device_ids).cpu())

    def swap_in(self, copies: list[list[tuple[int, int]]]) -> None:
        """Copy ``(host block, device block)`` pairs of each group back into the cache."""
        for layer, group in enumerate(self.layer_group):
            pairs = copies[group] if group < len(copies) else []
            if not pairs:
                continue
            device = self.key[layer].device
            host_ids = torch.tensor([h for h, _ in pairs])
            device_ids = torch.tensor([d for _, d in pairs], device=device)
            for cache, host in ((self.key[layer], self.host_key[layer]), (self.value[layer], self.host_value[layer])):
                assert host is not None
                cache.index_copy_(0, device_ids, host.index_select(0, host_ids).to(device))

    @property
    def nbytes(self) -> int:
        """Bytes the K and V tensors take."""
        return sum(t.numel() * t.element_size() for t in (*self.key, *self.value))


def _indices(values: list[int], device: torch.device) -> torch.Tensor:
    """Block ids on ``device`` without waiting for the device: a copy from pageable memory
    would wait for the step in flight (async batching launches the next one meanwhile)."""
    host = torch.tensor(values)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
