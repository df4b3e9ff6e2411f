"""The shared expert folded into the fused MoE's last kernel, for the sorted path (the pairs path
folds it into its down GEMV, triton_moe._down_gemv_kernel).

out[t] = sum_j y[t * top_k + j] + sigmoid(gate_logit[t]) * (silu(gate[t]) * up[t]) @ w2.T

y holds the down kernel's weighted per-pair rows. Before this kernel the block ended with the
routed sum kernel and then six launches for the shared expert's tail (silu, mul, the down GEMM,
sigmoid, mul, add): at batch 16 about 15 us per layer of mostly launch gaps in the decode graph.

Grid (H / BLOCK_N, T / BLOCK_T): a program forms the activation of BLOCK_T tokens from the gate/up
projection's output (float32, rounded to the weights' dtype for the tensor cores), multiplies it by
BLOCK_N rows of w2 with tl.dot, scales each token's row by its gate, adds the token's routed slots
and rounds once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..pdl import pdl_launch, pdl_prefetch, pdl_wait, prefetch_l2


@triton.jit
def _sum_shared_kernel(
    y,
    topk_ids,
    gate_up,
    w2,
    gate_logit,
    out,
    expert_offset,
    num_experts,
    num_tokens,
    s_yp,
    s_gu,
    s_w2,
    s_gl,
    s_ot,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    TOPK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_IEEE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < num_tokens
    t64 = tl.where(t_ok, t, 0).to(tl.int64)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < HIDDEN
    k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    for k0 in tl.static_range(0, INTER, BLOCK_K):
        k_ok = k0 + k < INTER
        a_ok = t_ok[:, None] & k_ok[None, :]
        g_ptr = gate_up + t64[:, None] * s_gu + (k0 + k)[None, :]
        g = tl.load(g_ptr, mask=a_ok, other=0.0).to(tl.float32)
        u = tl.load(g_ptr + INTER, mask=a_ok, other=0.0).to(tl.float32)
        a = (g * tl.sigmoid(g) * u).to(w2.dtype.element_ty)
        w_ptr = w2 + n[None, :].to(tl.int64) * s_w2 + (k0 + k)[:, None]
        w = tl.load(w_ptr, mask=n_ok[None, :] & k_ok[:, None], other=0.0, eviction_policy="evict_first")
        if DOT_IEEE:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    scale = tl.sigmoid(tl.load(gate_logit + t64 * s_gl, mask=t_ok, other=0.0).to(tl.float32))
    acc = acc * scale[:, None]
    for j in tl.static_range(TOPK):
        pair = t64 * TOPK + j
        e = tl.load(topk_ids + pair, mask=t_ok, other=0).to(tl.int32) - expert_offset
        local = t_ok & (e >= 0) & (e < num_experts)  # other ranks' slots were never written
        routed = tl.load(y + pair[:, None] * s_yp + n[None, :], mask=local[:, None] & n_ok[None, :], other=0.0)
        acc += routed.to(tl.float32)
    dst = out + t64[:, None] * s_ot + n[None, :]
    tl.store(dst, acc.to(out.dtype.element_ty), mask=t_ok[:, None] & n_ok[None, :])


@triton.jit
def _sum_shared_gemv_kernel(
    y,
    topk_ids,
    gate_up,
    w2,
    gate_logit,
    out,
    expert_offset,
    num_experts,
    num_tokens,
    s_yp,
    s_gu,
    s_w2,
    s_gl,
    s_ot,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    TOPK: tl.constexpr,
    MAX_TOKENS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_I: tl.constexpr,
    USE_PDL: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """The GEMV form: one program per BLOCK_H rows of w2, every token in turn (unrolled up to
    MAX_TOKENS), the weight chunk re-read from L1 for each token after the first; activations are
    loaded broadcast to the weight tile's shape (same addresses per row: L1 hits)."""
    h = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ld = tl.minimum(h, HIDDEN - 1).to(tl.int64)
    i = tl.arange(0, BLOCK_I)
    cols = i[None, :] + 0 * h[:, None]  # [BLOCK_H, BLOCK_I], every row the same columns
    if PREFETCH:
        prefetch_l2(w2 + h_ld[:, None] * s_w2 + tl.minimum(cols, INTER - 1))
    pdl_wait(USE_PDL)
    for t in tl.static_range(MAX_TOKENS):
        # tokens past num_tokens: empty column and row ranges (masked loads, no store)
        inter_t = tl.where(t < num_tokens, INTER, 0)
        acc = tl.zeros([BLOCK_H, BLOCK_I], tl.float32)
        for i0 in tl.static_range(0, INTER, BLOCK_I):
            a_ok = i0 + cols < inter_t
            g = tl.load(gate_up + t * s_gu + i0 + cols, mask=a_ok, other=0.0).to(tl.float32)
            u = tl.load(gate_up + t * s_gu + INTER + i0 + cols, mask=a_ok, other=0.0).to(tl.float32)
            w = tl.load(w2 + h_ld[:, None] * s_w2 + i0 + cols, mask=a_ok, other=0.0)
            acc += w.to(tl.float32) * (g * tl.sigmoid(g) * u)
        t_ld = tl.minimum(t, num_tokens - 1)
        total = tl.sum(acc, 1) * tl.sigmoid(tl.load(gate_logit + t_ld * s_gl).to(tl.float32))
        for j in tl.static_range(TOPK):
            e = tl.load(topk_ids + t_ld * TOPK + j).to(tl.int32) - expert_offset
            local = (e >= 0) & (e < num_experts)
            row_ok = h < tl.where(local & (t < num_tokens), HIDDEN, 0)
            total += tl.load(y + (t_ld * TOPK + j) * s_yp + h, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(out + t_ld * s_ot + h, total.to(out.dtype.element_ty), mask=h < tl.where(t < num_tokens, HIDDEN, 0))


GEMV_MAX_TOKENS = 16  # the GEMV form unrolls its token loop; larger batches take the MMA form


def sum_pairs_with_shared(
    *,
    y: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_offset: int,
    num_experts: int,
    gate_up: torch.Tensor,
    w2: torch.Tensor,
    gate_logit: torch.Tensor,
    out: torch.Tensor,
    config: dict | None = None,
) -> None:
    """out[t] = sum of token t's local rows of y [T * top_k, H] + sigmoid(gate_logit[t]) *
    (silu(gate) * up)[t] @ w2.T. topk_ids: [T, top_k] (contiguous); gate_up: [T, 2 * I] and
    gate_logit: [T, 1] may be column slices of one projection (strided rows); w2: [H, I];
    out: [T, H]. `config` overrides the form ("gemv" up to GEMV_MAX_TOKENS tokens, the default
    there; "mma") and its tiles (gemv: block_h, num_warps; mma: block_t, block_n, block_k,
    num_warps)."""
    num_tokens, hidden = out.shape
    top_k, inter = topk_ids.shape[1], w2.shape[1]
    assert y.shape == (num_tokens * top_k, hidden) and w2.shape[0] == hidden, "shapes"
    assert gate_up.shape == (num_tokens, 2 * inter) and gate_logit.shape == (num_tokens, 1), "shared shapes"
    for name, t in (("y", y), ("gate_up", gate_up), ("w2", w2), ("out", out)):
        assert t.stride(-1) == 1, f"{name}: contiguous last dim"
    if num_tokens == 0:
        return
    form = (config or {}).get("form") or ("gemv" if num_tokens <= GEMV_MAX_TOKENS else "mma")
    if form == "gemv":
        assert num_tokens <= GEMV_MAX_TOKENS, "the GEMV form takes up to GEMV_MAX_TOKENS tokens"
        block_h = (config or {}).get("block_h", 4 if out.is_cuda else 8)
        block_i = min(512 if out.is_cuda else 32, triton.next_power_of_2(inter))
        _sum_shared_gemv_kernel[(triton.cdiv(hidden, block_h),)](
            y,
            topk_ids,
            gate_up,
            w2,
            gate_logit,
            out,
            expert_offset,
            num_experts,
            num_tokens,
            y.stride(0),
            gate_up.stride(0),
            w2.stride(0),
            gate_logit.stride(0),
            out.stride(0),
            HIDDEN=hidden,
            INTER=inter,
            TOPK=top_k,
            MAX_TOKENS=triton.next_power_of_2(num_tokens),
            BLOCK_H=block_h,
            BLOCK_I=block_i,
            num_warps=(config or {}).get("num_warps", 4),
            PREFETCH=pdl_prefetch(w2),
            **pdl_launch(y),
        )
        return
    block_k = max(16, min(128 if out.is_cuda else 32, triton.next_power_of_2(inter)))
    block_t = max(16, min(64, triton.next_power_of_2(num_tokens)))
    tiles = dict(block_t=block_t, block_n=32 if out.is_cuda else 16, block_k=block_k, num_warps=4)
    config = {**tiles, **(config or {})}
    grid = (triton.cdiv(hidden, config["block_n"]), triton.cdiv(num_tokens, config["block_t"]))
    _sum_shared_kernel[grid](
        y,
        topk_ids,
        gate_up,
        w2,
        gate_logit,
        out,
        expert_offset,
        num_experts,
        num_tokens,
        y.stride(0),
        gate_up.stride(0),
        w2.stride(0),
        gate_logit.stride(0),
        out.stride(0),
        HIDDEN=hidden,
        INTER=inter,
        TOPK=top_k,
        BLOCK_T=config["block_t"],
        BLOCK_N=config["block_n"],
        BLOCK_K=config["block_k"],
        DOT_IEEE=w2.dtype == torch.float32,
        num_warps=config["num_warps"],
        **pdl_launch(y),
    )
