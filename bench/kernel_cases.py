"""What a kernel benchmark case is: how to run ours, the reference and (optionally) a peer, how to
check agreement, and the bytes / FLOPs that give its hardware floor; and `graphed`, the CUDA-graph
capture the cases time their calls in."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Case:
    op: str  # e.g. "gdn_chunk"
    shape: str  # e.g. "T=8192 Hv=32 K=V=128"
    ours: Callable[[], object]
    reference: Callable[[], object] | None  # plain-torch or torch baseline, timed in the same run
    reference_label: str
    check: Callable[[], float]  # max error of ours vs the float32 reference (runs once)
    tolerance: float
    bytes_moved: int = 0  # fewest bytes through HBM (each input read once, each output written once)
    flops: int = 0
    peer: Callable[[], object] | None = None  # e.g. fla, when importable
    peer_label: str = ""
    target: str = ""  # the target, in words


def graphed(calls: list[Callable[[], object]]) -> Callable[[], None]:
    """The calls captured, in order, into one CUDA graph (each run once first on a side stream, as
    capture requires, so Triton compiles and ticket buffers are allocated outside it); returns its
    replay."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return graph.replay
