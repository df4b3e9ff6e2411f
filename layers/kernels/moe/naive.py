"""Plain-torch MoE routing and expert computation: the reference and the CPU path.

Expert weights are fused per expert the way transformers holds them in memory:
w13 [E, 2 * I, H] (gate rows then up rows) and w2 [E, H, I]. Under expert parallelism a rank holds
experts [expert_offset, expert_offset + E) and skips tokens routed elsewhere.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F

from .. import norm
from ..precision import acc_dtype


class SharedExpert(NamedTuple):
    """The shared expert's part of an MoE block, for fused_moe: gate_up [T, 2 * I] (the gate then
    the up projection of the block's input, rows may be strided column slices of a fused
    projection), w2 [H, I] (its down projection) and gate_logit [T, 1] (its sigmoid gate's logit)."""

    gate_up: torch.Tensor
    w2: torch.Tensor
    gate_logit: torch.Tensor


class AddNorm(NamedTuple):
    """The norm that follows an MoE block, for fused_moe to apply in its last kernel: the residual
    stream [T, H] to add the block's output to, and the next zero-centred RMSNorm's weight [H] and
    eps. fused_moe then returns NormedOut."""

    residual: torch.Tensor
    weight: torch.Tensor
    eps: float


class NormedOut(NamedTuple):
    """fused_moe's result with add_norm: rms_norm(out + residual) * (1 + weight), and out + residual
    (the new residual stream), both [T, H] in hidden's dtype."""

    normed: torch.Tensor
    residual: torch.Tensor


class PairDeltas(Protocol):
    """Additions to each routed pair's projections inside the experts (the experts' LoRA adapters,
    kernels/lora): `gate_up(topk_ids)` [P, 2 * I] is added to the pair's gate / up projection before
    the activation, then `down(act)` [P, H] (from the pairs' activations [P, I]) to its down projection
    before the routing weight. Pair p = token * top_k + k; pairs routed to other ranks are never read."""

    def gate_up(self, topk_ids: torch.Tensor) -> torch.Tensor: ...

    def down(self, act: torch.Tensor) -> torch.Tensor: ...


def apply_add_norm(out: torch.Tensor, add_norm: AddNorm | None, pdl: bool = True) -> torch.Tensor | NormedOut:
    """out itself, or NormedOut of out under add_norm (the norm op: its own kernel on CUDA)."""
    if add_norm is None:
        return out
    normed, summed = norm.fused_add_rms_norm(
        x=out, residual=add_norm.residual, weight=add_norm.weight, eps=add_norm.eps, pdl=pdl
    )
    return NormedOut(normed, summed)


def check_shared(shared: SharedExpert, num_tokens: int, hidden_size: int) -> None:
    """Shapes and layouts every fused_moe implementation relies on; errors name the tensor."""
    inter = shared.w2.shape[1]
    if shared.w2.shape[0] != hidden_size:
        raise ValueError(f"shared.w2: expected [{hidden_size}, I], got {list(shared.w2.shape)}")
    if shared.gate_up.shape != (num_tokens, 2 * inter):
        raise ValueError(f"shared.gate_up: expected [{num_tokens}, {2 * inter}], got {list(shared.gate_up.shape)}")
    if shared.gate_logit.shape != (num_tokens, 1):
        raise ValueError(f"shared.gate_logit: expected [{num_tokens}, 1], got {list(shared.gate_logit.shape)}")
    for name in ("gate_up", "w2"):
        if getattr(shared, name).stride(-1) != 1:
            raise ValueError(f"shared.{name}: the last dim must be contiguous")


def route_topk_softmax(*, router_logits, top_k, renormalize):
    """The reference of moe.route_topk_softmax (torch.topk: ties may come in another order)."""
    probs = torch.softmax(router_logits.to(acc_dtype(router_logits)), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_moe(*, hidden, w13, w2, topk_weights, topk_ids, expert_offset=0, shared=None, add_norm=None, deltas=None):
    """The reference of moe.fused_moe: float32 throughout, one rounding at the end."""
    num_local, inter = w13.shape[0], w2.shape[2]
    acc = acc_dtype(hidden)
    out = torch.zeros(hidden.shape, dtype=acc, device=hidden.device)
    local_ids = topk_ids - expert_offset
    top_k = topk_ids.shape[1]
    experts = [e for e in torch.unique(local_ids).tolist() if 0 <= e < num_local]
    members = {e: torch.where(local_ids == e) for e in experts}
    d13 = deltas.gate_up(topk_ids) if deltas is not None else None
    acts = {}
    for e, (token_idx, k_idx) in members.items():
        gate_up = hidden[token_idx].to(acc) @ w13[e].to(acc).t()
        if d13 is not None:
            gate_up = gate_up + d13[token_idx * top_k + k_idx].to(acc)
        acts[e] = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    d2 = None
    if deltas is not None:  # the down deltas read every pair's activation
        act_all = torch.zeros((topk_ids.numel(), inter), dtype=acc, device=hidden.device)
        for e, (token_idx, k_idx) in members.items():
            act_all[token_idx * top_k + k_idx] = acts[e]
        d2 = deltas.down(act_all.to(hidden.dtype))
    for e, (token_idx, k_idx) in members.items():
        y = acts[e] @ w2[e].to(acc).t()
        if d2 is not None:
            y = y + d2[token_idx * top_k + k_idx].to(acc)
        out.index_add_(0, token_idx, y * topk_weights[token_idx, k_idx, None].to(acc))
    if shared is not None:
        check_shared(shared, hidden.shape[0], hidden.shape[1])
        return apply_add_norm(shared_expert_combine(routed=out, **shared._asdict()).to(hidden.dtype), add_norm)
    return apply_add_norm(out.to(hidden.dtype), add_norm)


def routed_moe(
    *, hidden, w13, w2, router_logits, top_k, renormalize, expert_offset=0, shared=None, add_norm=None, deltas=None
):  # fmt: skip
    """The reference of moe.routed_moe: route_topk_softmax, then fused_moe."""
    weights, ids = route_topk_softmax(router_logits=router_logits, top_k=top_k, renormalize=renormalize)
    return fused_moe(
        hidden=hidden, w13=w13, w2=w2, topk_weights=weights, topk_ids=ids, expert_offset=expert_offset,
        shared=shared, add_norm=add_norm, deltas=deltas,
    )  # fmt: skip


def shared_expert_combine(
    *, routed: torch.Tensor, gate_up: torch.Tensor, w2: torch.Tensor, gate_logit: torch.Tensor
) -> torch.Tensor:
    """routed + sigmoid(gate_logit) * down(silu(gate) * up): the shared expert's down projection,
    its sigmoid gate and the sum with the routed experts' output, in float32.
    routed: [T, H]; gate_up: [T, 2 * I] (gate columns then up); w2: [H, I]; gate_logit: [T, 1].
    Returns [T, H] in routed's dtype."""
    inter = w2.shape[1]
    acc = acc_dtype(routed, gate_up)
    act = F.silu(gate_up[:, :inter].to(acc)) * gate_up[:, inter:].to(acc)
    shared = act @ w2.to(acc).t()
    return (routed.to(acc) + torch.sigmoid(gate_logit.to(acc)) * shared).to(routed.dtype)
