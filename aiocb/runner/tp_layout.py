"""Where a process sits in its model's tensor-parallel group, and its shard of the attention heads.

Read from the model's device mesh and TP plan alone: nothing here talks to another rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from transformers import PreTrainedModel

from aiocb.errors import InvalidConfigError

#: Names of the modules that project the attention's keys and values, in TP plans.
_KV_PROJECTIONS = frozenset({"k_proj", "v_proj", "qkv_proj", "query_key_value"})


@dataclass(frozen=True, slots=True)
class TensorParallelLayout:
    """Where this process sits in its model's tensor-parallel group."""

    #: ranks in the group
    size: int
    #: this process's rank within the group (0 drives)
    rank: int
    #: the group's global ranks, in group order: ``ranks[0]`` is the driver
    ranks: tuple[int, ...]

    @property
    def is_driver(self) -> bool:
        """Whether this process runs the scheduler and the API (group rank 0)."""
        return self.rank == 0

    @property
    def followers(self) -> tuple[int, ...]:
        """The global ranks that replay rank 0's steps."""
        return self.ranks[1:]


def tensor_parallel_layout(model: PreTrainedModel) -> TensorParallelLayout | None:
    """The model's tensor-parallel group, or None when its weights are not sharded.

    Raises :class:`~aiocb.InvalidConfigError` for what aiocb cannot run (see
    :func:`_tp_mesh`).
    """
    mesh = _tp_mesh(model)
    if mesh is None:
        return None
    ranks = tuple(int(r) for r in dist.get_process_group_ranks(mesh.get_group()))
    return TensorParallelLayout(size=int(mesh.size()), rank=int(mesh.get_local_rank()), ranks=ranks)


def _tp_mesh(model: PreTrainedModel) -> Any:
    """The model's (1-D) tensor-parallel device mesh, or None without tensor parallelism.

    Raises :class:`~aiocb.InvalidConfigError` for a TP size that does not divide the
    model's ``num_key_value_heads``, for FSDP or pipeline parallelism, and for a
    ``device_map`` next to tensor parallelism. Uses no process group.
    """
    mesh = getattr(model, "_device_mesh", None)
    declared = int(getattr(model, "tp_size", None) or 1)
    if mesh is None:
        if declared > 1:
            raise InvalidConfigError(f"the model reports tp_size={declared} but has no device mesh")
        return None
    names = mesh.mesh_dim_names
    if names:
        for name in names:
            if name != "tp" and mesh[name].size() > 1:
                raise InvalidConfigError(
                    f"aiocb runs tensor parallelism only; the model's device mesh also splits {name!r} "
                    f"over {mesh[name].size()} ranks"
                )
        if "tp" not in names:
            return None
        mesh = mesh["tp"]
    size = int(mesh.size())
    if size <= 1:
        return None
    text = model.config.get_text_config()
    check_tp_size(size, int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads))
    device_map = getattr(model, "hf_device_map", None)
    if device_map and len(set(device_map.values())) > 1:
        raise InvalidConfigError(
            f"the model was loaded with a device_map over several devices and with tensor parallelism "
            f"(tp_size={size}); they are mutually exclusive: drop the device_map"
        )
    return mesh


def check_tp_size(tp_size: int, num_kv_heads: int) -> None:
    """Raise :class:`~aiocb.InvalidConfigError` unless ``tp_size`` divides ``num_kv_heads``."""
    if tp_size < 1 or num_kv_heads % tp_size:
        divisors = [d for d in range(1, num_kv_heads + 1) if num_kv_heads % d == 0]
        raise InvalidConfigError(
            f"tp_size={tp_size} does not divide the model's num_key_value_heads={num_kv_heads}: every "
            f"tensor-parallel rank must hold whole KV heads; use a tp_size in {divisors}"
        )


def shard_heads(model: PreTrainedModel, num_heads: int, num_kv_heads: int) -> tuple[int, int, int]:
    """``(tp_size, query heads, KV heads)`` of this rank's shard of the attention.

    Heads are split when the model's TP plan shards the outputs of its K and V
    projections (``colwise``, as Llama's ``k_proj``); a plan that gathers them again
    (Phi-3's ``qkv_proj: colwise_gather_output``) leaves every head on every rank.
    """
    mesh = _tp_mesh(model)
    if mesh is None:
        return 1, num_heads, num_kv_heads
    size = int(mesh.size())
    plan: dict[str, str] = getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None) or {}
    styles = [style for key, style in plan.items() if key.rsplit(".", 1)[-1] in _KV_PROJECTIONS]
    if not styles or not all("colwise" in style and "gather" not in style for style in styles):
        return size, num_heads, num_kv_heads
    return size, num_heads // size, num_kv_heads // size
