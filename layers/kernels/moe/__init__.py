"""MoE routing and the fused expert computation.

Expert weights are fused per expert the way transformers holds them in memory: w13 [E, 2 * I, H]
(gate rows then up rows) and w2 [E, H, I]. Under expert parallelism a rank holds experts
[expert_offset, expert_offset + E) and skips the (token, slot) pairs routed elsewhere.
"""

from __future__ import annotations

import torch

from ..options import KernelOptions
from . import naive
from .naive import (
    PAIRS_PATH_MAX,
    AddNorm,
    NormedOut,
    PairDeltas,
    PairLowRank,
    SharedExpert,
    apply_add_norm,
    quantizes_fp8_acts,
)

__all__ = [
    "PAIRS_PATH_MAX", "AddNorm", "NormedOut", "PairDeltas", "PairLowRank", "SharedExpert", "apply_add_norm",
    "fused_moe", "quantizes_fp8_acts", "route_topk_softmax", "routed_moe",
]  # fmt: skip


def route_topk_softmax(
    *, router_logits: torch.Tensor, top_k: int, renormalize: bool, pdl: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts (float32), top-k, optional renormalisation.

    Args:
        router_logits: [T, E], any float dtype. top_k: in 1..E. renormalize: the k weights sum to 1.
        pdl: CUDA: launch under programmatic dependent launch (sm_90+).

    Returns:
        (weights [T, top_k] float32, expert ids [T, top_k] int64), descending; CUDA: among equal
        values the lower expert first, one launch.
    """
    if router_logits.is_cuda:
        from .router import route_topk_softmax as impl

        return impl(router_logits=router_logits, top_k=top_k, renormalize=renormalize, pdl=pdl)
    return naive.route_topk_softmax(router_logits=router_logits, top_k=top_k, renormalize=renormalize)


def fused_moe(
    *,
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_offset: int = 0,
    shared: SharedExpert | None = None,
    add_norm: AddNorm | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    pdl: bool = True,
    deltas: PairDeltas | None = None,
    fp8_quantize_acts: bool = True,
    prefill_gemm: str = "triton",
    shared_stream: bool = True,
) -> torch.Tensor | NormedOut:
    """sum_k weight[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)) over the experts this rank holds
    (e = topk_ids[t, k]), float32 accumulation, one rounding.

    Args:
        hidden: [T, H] (H contiguous). w13: [E, 2 * I, H]. w2: [E, H, I].
        w13_scale, w2_scale: FP8 experts (w13 and w2 float8_e4m3fn, both or neither): their block
            scales [E, ceil(rows / bn), ceil(cols / bk)] (kernels.fp8). Up to PAIRS_PATH_MAX routed
            pairs the GEMVs dequantize them in registers; above, the grouped GEMMs run FP8 dots on
            x and silu(gate) * up quantized per row and 1 x 128 group (fp8.quantize_act), and the
            shared expert's down projection takes linear's FP8 path for T rows.
        fp8_quantize_acts: False: the grouped GEMMs over FP8 experts leave x and the activation in
            their dtype and convert the weights in registers instead (W8A16).
        prefill_gemm: CUDA, above PAIRS_PATH_MAX pairs: "triton" (our grouped GEMMs, gathering x
            inside) or "torch" (torch's grouped GEMM on x gathered into expert order, for bf16
            experts without deltas; others keep ours).
        topk_weights: [T, top_k], any float dtype. topk_ids: [T, top_k] int (global expert ids).
        shared: the shared expert, added as sigmoid(gate_logit) * down(silu(gate) * up).
        add_norm: the residual add + zero-centred RMSNorm after the block, in the block's last
            kernel on CUDA (rows up to fused_norm.MAX_NORM_HIDDEN wide; else the norm kernel).
        pdl: CUDA: launch under programmatic dependent launch (sm_90+).
        deltas: per-pair additions to the gate / up and down projections (the experts' LoRA
            adapters, kernels/lora); CUDA: the pairs path's GEMVs take them in low-rank form.
        shared_stream: CUDA, the sorted path: the shared expert's activation and down projection
            on a side stream beside the routed work (KernelOptions.moe_shared_stream; the same bits).

    Returns:
        [T, H] in hidden's dtype; with add_norm, NormedOut(normed, residual) of it.
    """
    args = dict(
        hidden=hidden, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids, expert_offset=expert_offset,
        shared=shared, add_norm=add_norm, w13_scale=w13_scale, w2_scale=w2_scale, deltas=deltas,
        fp8_quantize_acts=fp8_quantize_acts,
    )  # fmt: skip
    if hidden.is_cuda:
        from .triton_moe import fused_moe as impl

        return impl(**args, pdl=pdl, prefill_gemm=prefill_gemm, shared_stream=shared_stream)
    return naive.fused_moe(**args)


def routed_moe(
    *,
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    expert_offset: int = 0,
    shared: SharedExpert | None = None,
    add_norm: AddNorm | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    route_in_up_max_tokens: int = KernelOptions.route_in_up_max_tokens,
    sorted_block_m: int = 0,
    sorted_persistent: str = "",
    pdl: bool = True,
    deltas: PairDeltas | None = None,
    fp8_quantize_acts: bool = True,
    prefill_gemm: str = "triton",
    shared_stream: bool = True,
) -> torch.Tensor | NormedOut:
    """The MoE block's expert part from its router logits: route_topk_softmax, then fused_moe.

    Args:
        router_logits: [T, E_total] (E_total >= expert_offset + E), any float dtype.
        route_in_up_max_tokens: CUDA: batches of up to this many tokens on the pairs path route
            inside the experts' up GEMV (no router launch); 0 always launches the router.
        sorted_block_m: CUDA: the sorted path's tile rows (tiles.SORTED_TILES' entry of that
            block_m); 0: the entry for the rows per expert.
        sorted_persistent: CUDA: the sorted path's GEMMs as persistent programs, "loop" or "flat"
            (KernelOptions.moe_sorted_persistent); "": one program a tile.
        the rest: as fused_moe.

    Returns:
        As fused_moe.
    """
    args = dict(
        hidden=hidden, w13=w13, w2=w2, router_logits=router_logits, top_k=top_k, renormalize=renormalize,
        expert_offset=expert_offset, shared=shared, add_norm=add_norm, w13_scale=w13_scale, w2_scale=w2_scale,
        deltas=deltas, fp8_quantize_acts=fp8_quantize_acts,
    )  # fmt: skip
    if hidden.is_cuda:
        from .triton_moe import routed_moe as impl

        return impl(
            **args, route_in_up_max_tokens=route_in_up_max_tokens, sorted_block_m=sorted_block_m,
            sorted_persistent=sorted_persistent, pdl=pdl, prefill_gemm=prefill_gemm, shared_stream=shared_stream,
        )  # fmt: skip
    return naive.routed_moe(**args)
