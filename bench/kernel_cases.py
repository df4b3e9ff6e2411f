"""What a kernel benchmark case is: how to run ours, the reference and (optionally) a peer, how to
check agreement, and the bytes / FLOPs that give its hardware floor."""

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
