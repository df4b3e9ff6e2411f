"""Plain-torch LoRA: the reference of the segmented projection op and of the experts' per-pair
deltas, and the CPU path.

A projection's adapter slots: a [S, J * R, K] (slice j's A in rows j * R .. j * R + R, zero past
its rank) and b [S, N, R] (the scaling folded in, zero past the rank). Output row n belongs to
slice j when bounds[j] <= n < bounds[j + 1]; its delta for a token of slot s is
b[s, n] . (a[s, j * R : (j + 1) * R] @ x). Tokens of slot -1 have no adapter.
"""

from __future__ import annotations

import torch

from ..precision import acc_dtype


def slice_of_rows(bounds: tuple[int, ...], device) -> torch.Tensor:
    """[bounds[-1]] int64: each output row's slice."""
    rows = torch.arange(bounds[-1], device=device)
    return torch.bucketize(rows, torch.tensor(bounds[1:-1], device=device, dtype=torch.long), right=True)


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bounds: tuple[int, ...]) -> torch.Tensor:
    """One adapter's delta on rows x [M, K]: a [J * R, K], b [N, R] -> [M, N] in the accumulation dtype."""
    acc = acc_dtype(x, a, b)
    rank = b.shape[1]
    v = x.to(acc) @ a.to(acc).t()  # [M, J * R]
    if len(bounds) == 2:
        return v @ b.to(acc).t()
    which = slice_of_rows(bounds, x.device)
    out = torch.empty((x.shape[0], bounds[-1]), dtype=acc, device=x.device)
    for j in range(len(bounds) - 1):
        rows = which == j
        out[:, rows] = v[:, j * rank : (j + 1) * rank] @ b[rows].to(acc).t()
    return out


def add_lora(*, y, x, a, b, bounds, token_slots):
    """The reference of lora.add_lora: y[:, :bounds[-1]] += each token's adapter delta, in place."""
    n = bounds[-1]
    for s in torch.unique(token_slots).tolist():
        if s < 0:
            continue
        rows = torch.nonzero(token_slots == s).flatten()
        delta = lora_delta(x[rows], a[s], b[s], bounds)
        y[rows, :n] = (y[rows, :n].to(delta.dtype) + delta).to(y.dtype)
    return y


def pair_keys(token_slots: torch.Tensor, topk_ids: torch.Tensor, num_local: int, expert_offset: int) -> torch.Tensor:
    """[T, top_k] int32: slot * num_local + local expert of each routed pair, -1 for a pair without an
    adapter or routed to another rank's expert."""
    local = topk_ids.to(torch.int64) - expert_offset
    slots = token_slots.to(torch.int64)[:, None]
    keep = (slots >= 0) & (local >= 0) & (local < num_local)
    return torch.where(keep, slots * num_local + local, torch.full_like(local, -1)).to(torch.int32)


def expert_delta(*, x, a, b, bounds, keys, row_div):
    """Per routed pair p with key k = keys[p] >= 0: the delta of group k (a [G, RA, K], b [G, N, R])
    on x[p // row_div]; zero rows for pairs without a key. Returns [P, N] float32 (float64 when an
    input is)."""
    flat = keys.reshape(-1)
    out = torch.zeros((flat.shape[0], b.shape[1]), dtype=acc_dtype(x, a, b), device=x.device)
    for k in torch.unique(flat).tolist():
        if k < 0:
            continue
        pairs = torch.nonzero(flat == k).flatten()
        out[pairs] = lora_delta(x[pairs // row_div], a[k], b[k], bounds)
    return out
