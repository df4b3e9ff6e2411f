"""The fused MoE in Triton: which path a call takes, and the shared checks. Two paths, both without
host syncs: pairs.py (GEMVs, a handful of routed pairs: decode) and sorted.py (pairs grouped per
expert, grouped GEMMs). Experts outside [expert_offset, expert_offset + E) are skipped (expert
parallelism). Tiles: tiles.py."""

from __future__ import annotations

import torch

from ..device import device_info
from ..options import KernelOptions
from . import grouped
from .fused_norm import fused_norm
from .naive import PAIRS_PATH_MAX, apply_add_norm, check_fp8, check_shared
from .pairs import moe_pairs
from .router import route_topk_softmax
from .sorted import moe_sorted
from .tiles import pairs_config, sorted_config

# PAIRS_PATH_MAX (naive.py, where the reference follows it for FP8): at or under this many routed
# pairs the pairs path wins (no sorting launches); above it repeated experts cost it re-reads: at
# batch 16 (128 pairs) on the H200 the sorted path took 164 us a call against 185 (moe/NOTES.md),
# so batch 8 at top-8 is the last on pairs
# the up GEMV's programs hold a token's logits in registers to route
MAX_ROUTED_EXPERTS = 1024
ROUTE_IN_UP_MAX_TOKENS = KernelOptions().route_in_up_max_tokens


def _check(hidden, w13, w2, shared, w13_scale, w2_scale) -> None:
    num_experts, two_inter, hidden_size = w13.shape
    assert hidden.shape[1] == hidden_size and w2.shape == (num_experts, hidden_size, two_inter // 2), "weight shapes"
    assert hidden.stride(-1) == 1 and w13.stride(-1) == 1 and w2.stride(-1) == 1, "contiguous last dims"
    check_fp8(w13, w2, w13_scale, w2_scale)
    for s in (w13_scale, w2_scale):
        assert s is None or (s.dim() == 3 and s.shape[0] == num_experts and s.stride(-1) == 1), "[E, ., .] scales"
    if shared is not None:
        check_shared(shared, hidden.shape[0], hidden_size)


def fused_moe(
    *, hidden, w13, w2, topk_weights, topk_ids, expert_offset=0, shared=None, add_norm=None, path=None, config=None,
    w13_scale=None, w2_scale=None, sorted_block_m=0, pdl=True, deltas=None, fp8_quantize_acts=True,
    prefill_gemm="triton", sorted_persistent="", shared_stream=True,
):  # fmt: skip
    """moe.fused_moe. `path` ("pairs", "sorted" or "grouped") and `config` override the choice made
    from the shapes (tests and tuning sweeps); sorted_block_m: the sorted path's tile rows (0: by shape);
    sorted_persistent: its GEMMs as persistent programs ("loop", "flat"; "": a program a tile);
    shared_stream: its shared expert on a side stream (sorted.py);
    prefill_gemm "torch": the sorted path's GEMMs on torch's grouped GEMM where it takes the call
    (path "grouped": grouped.py; bf16 experts without deltas), else ours;
    `deltas`: the pairs path's GEMVs expand their low-rank form, the sorted path's GEMMs add them
    (FP8 experts: on quantized activations)."""
    _check(hidden, w13, w2, shared, w13_scale, w2_scale)
    scales = (w13_scale, w2_scale)
    num_tokens, hidden_size = hidden.shape
    num_experts, two_inter, _ = w13.shape
    out = torch.empty_like(hidden)
    if num_tokens == 0:
        return apply_add_norm(out, add_norm, pdl)
    norm = fused_norm(add_norm, hidden)
    topk_ids = topk_ids.contiguous()
    topk_weights = topk_weights.contiguous()
    num_pairs = topk_ids.numel()
    path = path or ("pairs" if num_pairs <= PAIRS_PATH_MAX else "sorted")
    if path == "sorted" and prefill_gemm == "torch" and w13_scale is None and deltas is None:
        path = "grouped" if grouped.supported(hidden, w13) else path
    info = device_info(hidden.device)
    if path == "pairs":
        cfg = config or pairs_config(hidden_size, two_inter // 2, info, fp8=w13_scale is not None)
        moe_pairs(
            hidden, w13, w2, topk_weights, topk_ids, expert_offset, out, cfg, shared, norm, pdl, scales=scales,
            deltas=deltas,
        )  # fmt: skip
    elif path == "grouped":
        assert w13_scale is None and deltas is None and grouped.supported(hidden, w13), "grouped: bf16, no deltas"
        moe_sorted(
            hidden, w13, w2, topk_weights, topk_ids, expert_offset, out, None, shared, norm, pdl, grouped=True,
            shared_stream=shared_stream,
        )  # fmt: skip
    else:
        assert path == "sorted", f"unknown path {path!r}"
        fp8 = w13_scale is not None
        cfg = config or sorted_config(
            num_pairs, num_experts, hidden.element_size(), info, fp8=fp8, block_m=sorted_block_m,
            quantized_acts=fp8_quantize_acts, persistent=sorted_persistent,
        )  # fmt: skip
        moe_sorted(
            hidden, w13, w2, topk_weights, topk_ids, expert_offset, out, cfg, shared, norm, pdl, scales=scales,
            deltas=deltas, quantize_acts=fp8_quantize_acts, shared_stream=shared_stream,
        )  # fmt: skip
    return norm.out if norm is not None else apply_add_norm(out, add_norm, pdl)


def routed_moe(
    *, hidden, w13, w2, router_logits, top_k, renormalize, expert_offset=0, shared=None, add_norm=None,
    route_in_up_max_tokens=ROUTE_IN_UP_MAX_TOKENS, path=None, w13_scale=None, w2_scale=None, sorted_block_m=0,
    pdl=True, deltas=None, fp8_quantize_acts=True, prefill_gemm="triton", sorted_persistent="", config=None,
    shared_stream=True,
):  # fmt: skip
    """moe.routed_moe: on the pairs path, up to route_in_up_max_tokens tokens, the up GEMV routes
    (one launch fewer); otherwise (and with deltas, whose shrink reads the routing) the router
    kernel, then fused_moe. `path` forces one ("pairs" routes in the up GEMV within the token limit;
    "sorted" routes first); `config` forces the path's tiles (tuning sweeps)."""
    num_tokens = hidden.shape[0]
    path = path or ("pairs" if num_tokens * top_k <= PAIRS_PATH_MAX else "sorted")
    route_in_up = 0 < num_tokens <= route_in_up_max_tokens and router_logits.shape[1] <= MAX_ROUTED_EXPERTS
    if not route_in_up or path != "pairs" or deltas is not None:
        weights, ids = route_topk_softmax(router_logits=router_logits, top_k=top_k, renormalize=renormalize, pdl=pdl)
        return fused_moe(
            hidden=hidden, w13=w13, w2=w2, topk_weights=weights, topk_ids=ids, expert_offset=expert_offset,
            shared=shared, add_norm=add_norm, path=path, w13_scale=w13_scale, w2_scale=w2_scale,
            sorted_block_m=sorted_block_m, pdl=pdl, deltas=deltas, fp8_quantize_acts=fp8_quantize_acts,
            prefill_gemm=prefill_gemm, sorted_persistent=sorted_persistent, config=config, shared_stream=shared_stream,
        )  # fmt: skip
    assert 0 < top_k <= router_logits.shape[1], "top_k must be in 1..num_experts"
    assert router_logits.shape[0] == num_tokens, "router_logits: one row per token"
    _check(hidden, w13, w2, shared, w13_scale, w2_scale)
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=hidden.device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int64, device=hidden.device)
    out = torch.empty_like(hidden)
    norm = fused_norm(add_norm, hidden)
    cfg = config or pairs_config(
        hidden.shape[1], w13.shape[1] // 2, device_info(hidden.device), fp8=w13_scale is not None
    )
    moe_pairs(
        hidden, w13, w2, weights, ids, expert_offset, out, cfg, shared, norm, pdl, route=(logits, renormalize),
        scales=(w13_scale, w2_scale),
    )  # fmt: skip
    return norm.out if norm is not None else apply_add_norm(out, add_norm, pdl)
