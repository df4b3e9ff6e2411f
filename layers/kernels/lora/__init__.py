"""LoRA adapters on the projections and on the routed experts, several adapters in one batch.

Adapter weights sit in slots: per projection a [S, J * R, K] (slice j's A in rows j * R ..) and
b [S, N, R] (the adapter's scaling folded in; rows and columns past an adapter's rank are zero),
per MoE layer the experts' ExpertLoraWeights. Each row of a pass (token) names its slot, -1 for
none. On CUDA the rows are grouped by slot on the device (triton_lora.py: punica / S-LoRA style
segments; no host sync, so a decode pass's grouping runs inside its CUDA graph) and two grouped
GEMMs apply the adapters; on CPU the plain-torch reference (naive.py) runs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..low_rank import PairLowRank
from . import naive
from .naive import pair_keys


class LoraRows(NamedTuple):
    """The rows of a pass and their adapter keys: keys [M] or [M, W] int32 (-1: no adapter; flat row
    = m * W + w), num_keys (keys are < it); groups: the rows grouped by key on CUDA (None on CPU)."""

    keys: torch.Tensor
    num_keys: int
    groups: object | None


class ExpertLoraWeights(NamedTuple):
    """One MoE layer's expert adapter slots (S slots, E local experts, rank R, I_local = the local
    expert width): a13 [S, E, 2R, H] (the gate's A in rows 0..R, the up projection's in R..2R),
    b13 [S, E, 2 * I_local, R] (gate rows, then up rows), a2 [S, E, R, I_local], b2 [S, E, H, R]."""

    a13: torch.Tensor
    b13: torch.Tensor
    a2: torch.Tensor
    b2: torch.Tensor


def lora_rows(*, keys: torch.Tensor, num_keys: int, pdl: bool = True) -> LoraRows:
    """Group rows by adapter key once, for every op of a pass that reads the same rows.

    Args:
        keys: [M] or [M, W] integer (-1 or any value outside [0, num_keys): no adapter).
        num_keys: how many keys there are (slots, or slots x local experts).
        pdl: CUDA: launch under programmatic dependent launch (sm_90+).

    Returns:
        LoraRows; on CUDA the grouping is device work only (no host sync).
    """
    groups = None
    if keys.is_cuda:
        from .triton_lora import group_rows

        groups = group_rows(keys if keys.dim() == 2 else keys[:, None], num_keys, pdl)
    return LoraRows(keys, num_keys, groups)


def add_lora(
    *,
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    bounds: tuple[int, ...],
    rows: LoraRows,
    pdl: bool = True,
    glu: bool = False,
    row_gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """y[t, :N] += b[s, n] . (a[s, slice(n)] @ x[t]) for each row t of slot s = rows.keys[t] >= 0, in place.

    Args:
        y: [T, >= N] the projection's output (its last dim contiguous), x's dtype.
        x: [T, K] the projection's input (last dim contiguous); with glu [T, 2 K].
        a: [S, J * R, K], b: [S, N, R] in x's dtype; R a power of two >= 16.
        bounds: (0, b_1, .., N): output rows [bounds[j], bounds[j + 1]) read slice j (J <= 4).
        rows: lora_rows of the pass's tokens (keys [T], num_keys = S).
        pdl: as lora_rows.
        glu: x is [gate | up] and the adapter reads silu(gate) * up (float32; a gated MLP's down
            projection without its activation's launch).
        row_gate: [T, 1]: row t's delta is scaled by sigmoid(row_gate[t]) (the shared expert's gate).

    Returns:
        y, with float32 accumulation and one rounding per element.
    """
    if y.is_cuda:
        from .triton_lora import add_lora as impl

        return impl(
            y=y, x=x, a=a, b=b, bounds=bounds, groups=rows.groups, pdl=pdl, glu=glu, row_gate=row_gate, keys=rows.keys
        )
    return naive.add_lora(y=y, x=x, a=a, b=b, bounds=bounds, token_slots=rows.keys, glu=glu, row_gate=row_gate)


def shrink(*, x: torch.Tensor, a: torch.Tensor, rows: LoraRows, glu: bool = False, pdl: bool = True) -> torch.Tensor:
    """The first half of add_lora, for a kernel that expands the adapters itself (low_rank.PairLowRank).

    Args:
        x: [T, K] (last dim contiguous); with glu [T, 2 K], read as silu(gate) * up.
        a: [S, RA, K] in x's dtype. rows: lora_rows of the pass's tokens (keys [T], num_keys = S).
        pdl: as lora_rows.

    Returns:
        v [T, RA] float32: row t's input times a[keys[t]]; rows without a key are unset on CUDA
        (their readers check the key) and zero on CPU.
    """
    if x.is_cuda:
        from .triton_lora import shrink as impl

        return impl(x, a, rows.groups, pdl=pdl, glu=glu, keys=rows.keys)
    return naive.shrink(x=x, a=a, keys=rows.keys, glu=glu)


class ExpertDeltas:
    """The experts' adapters as per-pair additions inside the MoE (moe.PairDeltas). On CUDA (both
    paths) the kernels take the low-rank form: `low_rank_gate_up(topk_ids)`, one launch for the
    pairs' keys and gate / up shrink, then `low_rank_down(act)`, one for the down shrink; the GEMVs
    and GEMMs expand them. The reference (naive.fused_moe) reads the dense `gate_up` / `down`.
    Built per MoE layer and pass from the rows' slots."""

    def __init__(
        self,
        *,
        hidden: torch.Tensor,
        token_slots: torch.Tensor,
        weights: ExpertLoraWeights,
        expert_offset: int,
        pdl: bool = True,
        triton: bool | None = None,
    ):
        """triton: the Triton kernels for the low-rank form (default: on CUDA tensors; tests run
        them interpreted)."""
        self.hidden, self.token_slots, self.weights = hidden, token_slots, weights
        self.expert_offset, self.pdl = expert_offset, pdl
        self.triton = hidden.is_cuda if triton is None else triton
        self.keys: torch.Tensor | None = None  # [P] int32, from the gate / up step
        self.groups = None  # the pairs grouped by key (Triton, prefill sizes), from the gate / up step
        self.extra = None  # a ShrinkJob for low_rank_down's launch (fold_shrink)

    def fold_shrink(self, *, x: torch.Tensor, a: torch.Tensor, keys: torch.Tensor, glu: bool = False) -> torch.Tensor:
        """Another shrink (as `shrink`: v [M, RA] float32, row m's x times a[keys[m]], rows without a
        key unset) run inside low_rank_down's launch with the Triton kernels: one launch fewer for a
        reader after the experts' down projection (the shared expert's adapter); computed now
        otherwise. Returns v (on CUDA written by that launch)."""
        if not self.triton:
            return naive.shrink(x=x, a=a, keys=keys, glu=glu)
        from .triton_lora import ShrinkJob

        assert self.extra is None, "ExpertDeltas.fold_shrink: one shrink a layer"
        v = torch.empty((keys.numel(), a.shape[1]), dtype=torch.float32, device=x.device)
        self.extra = ShrinkJob(x, a, keys.reshape(-1), v, glu)
        return v

    def gate_up(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """[P, 2 * I_local] float32 (pair p = token * top_k + k; zero for pairs without an adapter)."""
        w = self.weights
        slots, experts, inter2, rank = w.b13.shape
        self.keys = pair_keys(self.token_slots, topk_ids, experts, self.expert_offset).reshape(-1)
        a = w.a13.reshape(slots * experts, 2 * rank, -1)
        b = w.b13.reshape(slots * experts, inter2, rank)
        return naive.expert_delta(
            x=self.hidden, a=a, b=b, bounds=(0, inter2 // 2, inter2), keys=self.keys, row_div=topk_ids.shape[1]
        )

    def down(self, act: torch.Tensor) -> torch.Tensor:
        """[P, H] float32 from the pairs' activations act [P, I_local] (after gate_up)."""
        assert self.keys is not None, "ExpertDeltas.gate_up runs before down"
        w = self.weights
        slots, experts, hidden, rank = w.b2.shape
        a = w.a2.reshape(slots * experts, rank, -1)
        b = w.b2.reshape(slots * experts, hidden, rank)
        return naive.expert_delta(x=act, a=a, b=b, bounds=(0, hidden), keys=self.keys, row_div=1)

    def low_rank_gate_up(self, topk_ids: torch.Tensor) -> PairLowRank:
        """The gate / up deltas in low-rank form: each pair's key, its x row times its key's gate and
        up A ([P, 2R] float32), and the B [S * E, 2 * I_local, R]."""
        w = self.weights
        experts = w.b13.shape[1]
        a = w.a13.flatten(0, 1)
        if self.triton:
            from .triton_lora import expert_shrink_gate_up

            self.keys, v, self.groups = expert_shrink_gate_up(
                self.hidden, a, self.token_slots, topk_ids, experts, self.expert_offset, self.pdl
            )
        else:
            self.keys = pair_keys(self.token_slots, topk_ids, experts, self.expert_offset).reshape(-1)
            v = naive.pair_shrink(self.hidden, a, self.keys, topk_ids.shape[1])
        return PairLowRank(self.keys, v, w.b13.flatten(0, 1))

    def low_rank_down(self, act: torch.Tensor) -> PairLowRank:
        """The down deltas in low-rank form from the pairs' activations act [P, I_local] (after
        low_rank_gate_up): [P, R] float32 and the B [S * E, H, R]."""
        assert self.keys is not None, "ExpertDeltas.low_rank_gate_up runs before low_rank_down"
        w = self.weights
        a = w.a2.flatten(0, 1)
        if self.triton:
            from .triton_lora import expert_shrink_down

            v = expert_shrink_down(act, a, self.keys, self.groups, self.pdl, extra=self.extra)
        else:
            v = naive.pair_shrink(act, a, self.keys, 1)
        return PairLowRank(self.keys, v, w.b2.flatten(0, 1))


__all__ = [
    "ExpertDeltas", "ExpertLoraWeights", "LoraRows", "PairLowRank", "add_lora", "lora_rows", "pair_keys", "shrink",
]  # fmt: skip
