"""Where a Triton kernel of aiocb's can run (shared by the attention and sampler kernels)."""

from __future__ import annotations

import torch


def interpreted(kernel: object) -> bool:
    """Whether ``kernel`` was built by Triton's interpreter (``TRITON_INTERPRET=1`` set
    before its module was imported): it then runs on CPU tensors."""
    return type(kernel).__name__ == "InterpretedFunction"


def runs_on(kernel: object | None, device: torch.device) -> bool:
    """Whether ``kernel`` (None where triton does not import) can run on tensors of
    ``device``: on CUDA when a device is there, on the CPU when it is interpreted."""
    if kernel is None:
        return False
    if device.type == "cuda":
        return torch.cuda.is_available()
    return device.type == "cpu" and interpreted(kernel)
