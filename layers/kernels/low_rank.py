"""A low-rank addition per row, for kernels that add LoRA adapters to their own output (the MoE's
GEMVs and GEMMs, its last kernel, the norm after a projection): row p with key k >= 0 adds
b[k] @ v[p, slice] to its output. Here its type and plain-torch reference."""

from __future__ import annotations

from typing import NamedTuple

import torch


class PairLowRank(NamedTuple):
    """A low-rank addition per row (a routed pair, or a token): row p with keys[p] >= 0 adds
    b[keys[p], n] . v[p, j * R : j * R + R] to its output column n of slice j (the experts' gate_up:
    the gate columns read slice 0, the up columns slice 1; otherwise one slice). keys [P] int32 (-1:
    none; v's row unset), v [P, J * R] float32, b [G, N, R] with R a power of two."""

    keys: torch.Tensor
    v: torch.Tensor
    b: torch.Tensor


def low_rank_rows(low: PairLowRank, acc: torch.dtype) -> torch.Tensor:
    """[P, N] in acc: row p's b[keys[p]] @ v[p, :R] (zero without a key), one matmul per key."""
    keys = low.keys.reshape(-1)
    rank = low.b.shape[2]
    out = torch.zeros((keys.shape[0], low.b.shape[1]), dtype=acc, device=low.v.device)
    for k in torch.unique(keys).tolist():
        if k >= 0:
            rows = torch.nonzero(keys == k).flatten()
            out[rows] = low.v[rows, :rank].to(acc) @ low.b[k].to(acc).t()
    return out
