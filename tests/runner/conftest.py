"""CUDA graphs stood in for on the CPU: the graph logic (padding, buckets, when graphs are
captured and replayed) runs with the Triton kernels under the interpreter."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from aiocb.runner.backends import Backend
from aiocb.runner.cuda_graphs import DecodeGraphs
from aiocb.runner.inputs import AttentionMetadata
from aiocb.runner.model_runner import ModelRunner

Args = tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]


class EagerGraph:
    """Stands in for a CUDA graph on the CPU: replay re-runs the forward on the static
    buffers, into the logits buffer that every graph of its :class:`DecodeGraphs` shares
    (as ``_record`` makes it), after filling that whole buffer with NaN, as another graph's
    replay overwrites it: a step that read logits of an earlier replay would draw from NaN."""

    def __init__(self, graphs: DecodeGraphs, args: Args) -> None:
        self.forward: Callable[[], torch.Tensor] = lambda: graphs._forward(*args)
        warm = self.forward()  # the "capture": one pass on the padding inputs
        self.out = graphs._output(warm)[: args[2].shape[0]]
        self.out.copy_(warm)
        self.shared = graphs._output(warm)
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        self.shared.fill_(float("nan"))
        self.out.copy_(self.forward())


def record_eagerly(graphs: DecodeGraphs, args: Args) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """``DecodeGraphs._record`` on the CPU: an :class:`EagerGraph` of the forward on ``args``."""
    graph = EagerGraph(graphs, args)
    return graph, graph.out  # type: ignore[return-value]


@pytest.fixture
def graphs_on_cpu(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Runners built from here on use decode graphs on the CPU (Triton interpreter kernel,
    eager stand-in for the capture); returns the token slots of each graph captured, in order."""
    pytest.importorskip("triton")
    monkeypatch.setenv("AIOCB_ATTENTION_BACKEND", Backend.TRITON)
    monkeypatch.setattr(ModelRunner, "_decode_graphs_wanted", lambda self: True)
    captured: list[int] = []

    def record(self: DecodeGraphs, args: Args) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        captured.append(args[0].shape[1])
        return record_eagerly(self, args)

    monkeypatch.setattr(DecodeGraphs, "_record", record)
    return captured
