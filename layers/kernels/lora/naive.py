"""Plain-torch LoRA: the reference of the segmented projection op and of the experts' per-pair
deltas, and the CPU path.

A projection's adapter slots: a [S, J * R, K] (slice j's A in rows j * R .. j * R + R, zero past
its rank) and b [S, N, R] (the scaling folded in, zero past the rank). Output row n belongs to
slice j when bounds[j] <= n < bounds[j + 1]; its delta for a token of slot s is
b[s, n] . (a[s, j * R : (j + 1) * R] @ x). Tokens of slot -1 have no adapter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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


def _glu(x: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    half = x.shape[1] // 2
    return F.silu(x[:, :half].to(acc)) * x[:, half:].to(acc)


def shrink(*, x, a, keys, glu=False):
    """The reference of lora.shrink: v [T, RA] (float32, float64 when an input is), row t's x (glu:
    silu(gate) * up of x = [gate | up]) times a[keys[t]]; zero rows without a key."""
    acc = acc_dtype(x, a)
    flat = keys.reshape(-1)
    v = torch.zeros((x.shape[0], a.shape[1]), dtype=acc, device=x.device)
    for s in torch.unique(flat).tolist():
        if s >= 0:
            rows = torch.nonzero(flat == s).flatten()
            xs = _glu(x[rows], acc) if glu else x[rows].to(acc)
            v[rows] = xs @ a[s].to(acc).t()
    return v


def add_lora(*, y, x, a, b, bounds, token_slots, glu=False, row_gate=None):
    """The reference of lora.add_lora: y[:, :bounds[-1]] += each token's adapter delta, in place
    (glu: of silu(gate) * up of x = [gate | up]; row_gate: times sigmoid(row_gate[t]))."""
    n = bounds[-1]
    for s in torch.unique(token_slots).tolist():
        if s < 0:
            continue
        rows = torch.nonzero(token_slots == s).flatten()
        xs = x[rows]
        if glu:
            xs = _glu(xs, acc_dtype(x, a, b))
        delta = lora_delta(xs, a[s], b[s], bounds)
        if row_gate is not None:
            delta = delta * torch.sigmoid(row_gate[rows].to(delta.dtype))
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


def pair_shrink(x: torch.Tensor, a: torch.Tensor, keys: torch.Tensor, row_div: int) -> torch.Tensor:
    """The reference of the pairs path's shrink: v [P, RA] float32, pair p's row x[p // row_div]
    times a[keys[p]] ([G, RA, K]); zero rows for pairs without a key (the GPU leaves them unset)."""
    flat = keys.reshape(-1).to(torch.int64)
    acc = acc_dtype(x, a)
    has = flat >= 0
    rows = x[torch.arange(flat.shape[0], device=x.device) // row_div].to(acc)
    v = torch.einsum("pk,prk->pr", rows, a[flat.clamp(min=0)].to(acc))
    return torch.where(has[:, None], v, torch.zeros_like(v))
