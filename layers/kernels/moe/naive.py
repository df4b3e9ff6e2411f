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
from ..fp8.naive import ACT_GROUP, dequantize_weight, expand_scale, gemm_quantizes_x, quantize_act, scale_block
from ..low_rank import PairLowRank, low_rank_rows
from ..precision import acc_dtype


class SharedExpert(NamedTuple):
    """The shared expert's part of an MoE block, for fused_moe: gate_up [T, 2 * I] (the gate then
    the up projection of the block's input, rows may be strided column slices of a fused
    projection), w2 [H, I] (its down projection) and gate_logit [T, 1] (its sigmoid gate's logit);
    w2_scale: w2 is FP8 with these block scales (kernels.fp8). lora: a low-rank addition to its down
    projection's output, under the sigmoid gate (its adapters: keys [T], each token's slot, v [T, R]
    and b [S, H, R]), so that the block's last kernel still applies the next norm."""

    gate_up: torch.Tensor
    w2: torch.Tensor
    gate_logit: torch.Tensor
    w2_scale: torch.Tensor | None = None
    lora: PairLowRank | None = None


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
    before the routing weight. Pair p = token * top_k + k; pairs routed to other ranks are never read.
    The pairs path (CUDA, decode sizes) takes the same additions in low-rank form instead, which its
    GEMVs expand: `low_rank_gate_up(topk_ids)`, then `low_rank_down(act)`."""

    def gate_up(self, topk_ids: torch.Tensor) -> torch.Tensor: ...

    def down(self, act: torch.Tensor) -> torch.Tensor: ...

    def low_rank_gate_up(self, topk_ids: torch.Tensor) -> PairLowRank: ...

    def low_rank_down(self, act: torch.Tensor) -> PairLowRank: ...


def apply_add_norm(out: torch.Tensor, add_norm: AddNorm | None, pdl: bool = True) -> torch.Tensor | NormedOut:
    """out itself, or NormedOut of out under add_norm (the norm op: its own kernel on CUDA)."""
    if add_norm is None:
        return out
    normed, summed = norm.fused_add_rms_norm(
        x=out, residual=add_norm.residual, weight=add_norm.weight, eps=add_norm.eps, pdl=pdl
    )
    return NormedOut(normed, summed)


def check_fp8(w13: torch.Tensor, w2: torch.Tensor, w13_scale, w2_scale) -> None:
    """FP8 experts come with both block scales; float8 weights without them are an error."""
    if (w13_scale is None) != (w2_scale is None):
        raise ValueError("w13_scale, w2_scale: FP8 experts need both")
    if w13_scale is None and torch.float8_e4m3fn in (w13.dtype, w2.dtype):
        raise ValueError("w13 / w2: float8 values need their w13_scale / w2_scale")


def check_shared(shared: SharedExpert, num_tokens: int, hidden_size: int) -> None:
    """Shapes and layouts every fused_moe implementation relies on; errors name the tensor."""
    inter = shared.w2.shape[1]
    if shared.w2.shape[0] != hidden_size:
        raise ValueError(f"shared.w2: expected [{hidden_size}, I], got {list(shared.w2.shape)}")
    if shared.gate_up.shape != (num_tokens, 2 * inter):
        raise ValueError(f"shared.gate_up: expected [{num_tokens}, {2 * inter}], got {list(shared.gate_up.shape)}")
    if shared.w2_scale is None and shared.w2.dtype == torch.float8_e4m3fn:
        raise ValueError("shared.w2: float8 values need shared.w2_scale")
    if shared.gate_logit.shape != (num_tokens, 1):
        raise ValueError(f"shared.gate_logit: expected [{num_tokens}, 1], got {list(shared.gate_logit.shape)}")
    for name in ("gate_up", "w2"):
        if getattr(shared, name).stride(-1) != 1:
            raise ValueError(f"shared.{name}: the last dim must be contiguous")
    if shared.lora is not None:
        keys, v, b = shared.lora
        if keys.shape != (num_tokens,) or v.shape[0] != num_tokens or b.shape[1] != hidden_size:
            raise ValueError(
                f"shared.lora: keys [{num_tokens}], v [{num_tokens}, R], b [S, {hidden_size}, R] expected, got "
                f"{list(keys.shape)}, {list(v.shape)}, {list(b.shape)}"
            )


def route_topk_softmax(*, router_logits, top_k, renormalize):
    """The reference of moe.route_topk_softmax (torch.topk: ties may come in another order)."""
    probs = torch.softmax(router_logits.to(acc_dtype(router_logits)), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


# FP8 experts' activations under fp8_activations="auto": quantized above this many routed rows an
# expert, where tiles.SORTED_TILES_FP8's tiles start (64 rows and up: wgmma on e4m3); below, the tiles have
# 16 or 32 rows and Triton widens e4m3 operands to f16 for mma.sync, so quantizing buys nothing
FP8_ACT_QUANT_MIN_ROWS = 24


def quantizes_fp8_acts(mode: str, num_pairs: int, num_experts: int) -> bool:
    """Whether the sorted path's FP8 GEMMs quantize their activations (W8A8) for `num_pairs` routed
    pairs over `num_experts` local experts, under KernelOptions.fp8_activations `mode`. A rule of
    shapes alone, so that every device and the CPU reference decide alike."""
    if mode == "auto":
        return num_pairs / max(1, num_experts) > FP8_ACT_QUANT_MIN_ROWS
    return mode == "quantized"


def fused_moe(
    *, hidden, w13, w2, topk_weights, topk_ids, expert_offset=0, shared=None, add_norm=None, w13_scale=None,
    w2_scale=None, deltas=None, quantize: bool | None = None, fp8_quantize_acts: bool = True,
):  # fmt: skip
    """The reference of moe.fused_moe: float32 throughout, one rounding at the end. FP8 weights
    (w13_scale / w2_scale: their block scales) are dequantized; above PAIRS_PATH_MAX routed pairs
    (the GPU's sorted path) the expert inputs (x, and silu(gate) * up) are quantized per row and
    1 x 128 group first (unless fp8_quantize_acts is False) and the shared expert's down projection
    takes linear's path for its rows, as on the GPU (`quantize` forces the path: the reference of
    a path the test forced). The deltas read the unquantized activations."""
    check_fp8(w13, w2, w13_scale, w2_scale)
    num_local, inter = w13.shape[0], w2.shape[2]
    acc = acc_dtype(hidden)
    if quantize is None:
        quantize = topk_ids.numel() > PAIRS_PATH_MAX
    quantize = quantize and w13_scale is not None  # the sorted path over FP8 experts
    quant_acts = quantize and fp8_quantize_acts and fp8_dots_fit(w13, w13_scale, w2, w2_scale)
    out = torch.zeros(hidden.shape, dtype=acc, device=hidden.device)
    local_ids = topk_ids - expert_offset
    top_k = topk_ids.shape[1]
    x_all = _fake_quant(hidden, acc) if quant_acts else hidden.to(acc)
    experts = [e for e in torch.unique(local_ids).tolist() if 0 <= e < num_local]
    members = {e: torch.where(local_ids == e) for e in experts}
    d13 = deltas.gate_up(topk_ids) if deltas is not None else None
    acts = {}
    for e, (token_idx, k_idx) in members.items():
        gate_up = x_all[token_idx] @ _weight(w13[e], None if w13_scale is None else w13_scale[e], acc).t()
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
        act = acts[e]
        if quant_acts:  # the GPU stores act in hidden's dtype, then quantizes it
            act = _fake_quant(act.to(hidden.dtype), acc)
        elif quantize:  # stored in hidden's dtype, read as it is
            act = act.to(hidden.dtype).to(acc)
        y = act @ _weight(w2[e], None if w2_scale is None else w2_scale[e], acc).t()
        if d2 is not None:
            y = y + d2[token_idx * top_k + k_idx].to(acc)
        out.index_add_(0, token_idx, y * topk_weights[token_idx, k_idx, None].to(acc))
    if shared is not None:
        check_shared(shared, hidden.shape[0], hidden.shape[1])
        # linear's rule for its rows (the sorted path's fp8_gemm: shared_fp8_gemm)
        quantize_shared = quantize and gemm_quantizes_x(hidden.shape[0], shared_fp8_gemm(fp8_quantize_acts))
        combined = shared_expert_combine(routed=out, **shared._asdict(), quantize_x=quantize_shared)
        return apply_add_norm(combined.to(hidden.dtype), add_norm)
    return apply_add_norm(out.to(hidden.dtype), add_norm)


def shared_fp8_gemm(quantize_acts: bool) -> str:
    """linear's fp8_gemm for the shared expert's down projection on the sorted path: its default, or
    "w8a16" (x never quantized) when the block's experts leave their activations unquantized."""
    return "dequant" if quantize_acts else "w8a16"


# the fewest K columns of an FP8 (e4m3) dot (Triton's bound on sm_89+): the sorted path's K step is one
# scale block, so narrower blocks leave the activations unquantized
FP8_DOT_MIN_K = 32


def fp8_dots_fit(w13: torch.Tensor, w13_scale, w2: torch.Tensor, w2_scale) -> bool:
    """Whether the sorted path's GEMMs over these FP8 experts run FP8 dots on quantized activations:
    both weights' scale blocks span at least FP8_DOT_MIN_K columns."""
    if w13_scale is None or w2_scale is None:
        return False
    up = scale_block(w13.shape[-2], w13.shape[-1], tuple(w13_scale.shape[-2:]))
    down = scale_block(w2.shape[-2], w2.shape[-1], tuple(w2_scale.shape[-2:]))
    return min(up[1], down[1]) >= FP8_DOT_MIN_K


# at or under this many routed pairs the GPU takes the pairs path (FP8 weights: x as it is), above
# it the sorted path (FP8: quantized activations); triton_moe.py takes it from here
PAIRS_PATH_MAX = 64


def _weight(w: torch.Tensor, scale: torch.Tensor | None, acc: torch.dtype) -> torch.Tensor:
    return w.to(acc) if scale is None else dequantize_weight(w, scale, acc)


def _fake_quant(x: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """x quantized per row and 1 x 128 group (fp8.quantize_act) and dequantized, in acc."""
    if not x.shape[0]:
        return x.to(acc)
    q, s = quantize_act(x=x, group=ACT_GROUP)
    return (q.float() * expand_scale(s, *x.shape, (1, ACT_GROUP))).to(acc)


def routed_moe(
    *, hidden, w13, w2, router_logits, top_k, renormalize, expert_offset=0, shared=None, add_norm=None,
    w13_scale=None, w2_scale=None, deltas=None, fp8_quantize_acts: bool = True,
):  # fmt: skip
    """The reference of moe.routed_moe: route_topk_softmax, then fused_moe."""
    weights, ids = route_topk_softmax(router_logits=router_logits, top_k=top_k, renormalize=renormalize)
    return fused_moe(
        hidden=hidden, w13=w13, w2=w2, topk_weights=weights, topk_ids=ids, expert_offset=expert_offset,
        shared=shared, add_norm=add_norm, w13_scale=w13_scale, w2_scale=w2_scale, deltas=deltas,
        fp8_quantize_acts=fp8_quantize_acts,
    )  # fmt: skip


def shared_expert_combine(
    *, routed: torch.Tensor, gate_up: torch.Tensor, w2: torch.Tensor, gate_logit: torch.Tensor,
    w2_scale: torch.Tensor | None = None, lora: PairLowRank | None = None, quantize_x: bool = False,
) -> torch.Tensor:  # fmt: skip
    """routed + sigmoid(gate_logit) * down(silu(gate) * up): the shared expert's down projection,
    its sigmoid gate and the sum with the routed experts' output, in float32.
    routed: [T, H]; gate_up: [T, 2 * I] (gate columns then up); w2: [H, I]; gate_logit: [T, 1];
    w2_scale: w2 is FP8 with these block scales. lora: SharedExpert.lora. quantize_x (FP8): the
    activation is quantized per 1 x 128 group first (the sorted path's down projection runs through
    linear: fp8.naive.gemm_quantizes_x, shared_fp8_gemm). Returns [T, H] in routed's dtype."""
    inter = w2.shape[1]
    acc = acc_dtype(routed, gate_up)
    act = F.silu(gate_up[:, :inter].to(acc)) * gate_up[:, inter:].to(acc)
    if w2_scale is not None and quantize_x:  # the GPU stores act in the activations' dtype, then quantizes it
        act = _fake_quant(act.to(gate_up.dtype), acc)
    shared = act @ _weight(w2, w2_scale, acc).t()
    if lora is not None:
        shared = shared + low_rank_rows(lora, acc)
    return (routed.to(acc) + torch.sigmoid(gate_logit.to(acc)) * shared).to(routed.dtype)
