"""Triton MoE: the softmax top-k router, and the fused expert computation (routed tokens grouped by
expert, grouped GEMMs, weighted top-k sum).

Router: one program per token (or a few), softmax over the experts in float32 and top-k by k rounds
of argmax-and-mask in registers; one launch instead of torch's cast / softmax / sort / gather /
renormalise kernels.

Fused MoE, three paths, all without host syncs:
- sorted (the general one): (token, slot) pairs are grouped per local expert into BLOCK_M-row blocks
  padded with a sentinel (moe_align style, built on device: up to ALIGN_ONE_LAUNCH_MAX pairs by one
  single-program kernel, histogram + scan + one in-register sort, deterministic; above it by
  zeros -> count -> scan -> scatter, 4 launches); the gate/up grouped GEMM writes silu(gate) * up
  per pair, the down grouped GEMM writes weight * down(act) per pair, and a reduce kernel sums each
  token's top-k slots.
- pairs (a handful of routed pairs, i.e. decode): GEMV kernels on CUDA cores, no sorting. Up: one
  program per (pair, BLOCK_N rows of the expert width) streams those gate and up rows with 16-byte
  loads; down: one program per (token, BLOCK_H rows of the hidden size) streams its top-k experts'
  rows and sums them in registers. Thin row blocks put several programs on every SM even at
  batch 1, and the pair index is the fastest grid axis, so two tokens routed to one expert read its
  rows at about the same time (the second read mostly hits L2).
- pairs_mma: the previous pairs path (tl.dot on 16-row tiles whose row 0 is the pair), kept to
  compare against.
Experts outside [expert_offset, expert_offset + E) are skipped (expert parallelism).
The shared expert (`shared=`): one more slot of the pairs path's down GEMV; on the sorted path its
activation kernel, a cuBLAS down projection, and its gated sum inside the routed sum kernel.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..device import ticket_counters
from ..norm.triton_norm import add_rms_norm_row
from ..pdl import pdl_launch, pdl_wait
from ..tickets import last_to_arrive
from .naive import AddNorm, NormedOut, SharedExpert, apply_add_norm, check_shared

# at or under this many routed pairs the pairs path wins: no sorting launches. Above it repeated
# experts cost the pairs path re-reads: at batch 16 (128 pairs) on the H200 the sorted path took 164 us
# a call against 185 us (16 graph-captured calls, NOTES.md), so batch 8 at top-8 is the last on pairs
PAIRS_PATH_MAX = 64

# at or under this many routed pairs (batch 128 at top-8) align_pairs is one single-program launch
# holding every pair's sort key in registers (NOTES.md). Its registers stay ~40 a thread up to 2048
# keys (8 warps, sm_90), but its bitonic sort does not spread: ~620 SASS instructions a warp and 22
# barriers at 128 pairs, ~2100 and 49 at 1024, ~4100 and 58 at 2048, where it would near the 4-op
# path (zeros, count, scan, place: 5.6 us a layer at 128 pairs, mostly launch latency, and
# little more at 2048 pairs since those kernels spread over programs). Unmeasured.
ALIGN_ONE_LAUNCH_MAX = 1024


# --- router -----------------------------------------------------------------------------------------


@triton.jit
def _topk_softmax(
    logits,
    t,
    t_ok,
    num_experts,
    s_lt,
    TOPK: tl.constexpr,
    TOPK_P: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """(weights, ids) [BLOCK_T, TOPK_P] of tokens t: the top-k of softmax(logits[t]) in float32,
    descending, ties to the lower expert; padding slots hold 0. Selection runs on the logits
    (softmax is monotonic), one argmax-and-mask round per slot."""
    e = tl.arange(0, BLOCK_E)
    e_ok = e < num_experts
    x = tl.load(logits + t.to(tl.int64)[:, None] * s_lt + e[None, :], mask=t_ok[:, None] & e_ok[None, :], other=0.0)
    x = tl.where(e_ok[None, :], x.to(tl.float32), float("-inf"))
    m = tl.max(x, 1)
    denom = tl.sum(tl.exp(x - m[:, None]), 1)
    slots = tl.arange(0, TOPK_P)
    top_w = tl.zeros([BLOCK_T, TOPK_P], tl.float32)
    top_i = tl.zeros([BLOCK_T, TOPK_P], tl.int32)
    for j in tl.static_range(TOPK):
        v, i = tl.max(x, 1, return_indices=True, return_indices_tie_break_left=True)
        p = tl.exp(v - m) / denom
        top_w = tl.where(slots[None, :] == j, p[:, None], top_w)
        top_i = tl.where(slots[None, :] == j, i[:, None], top_i)
        x = tl.where(e[None, :] == i[:, None], float("-inf"), x)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, 1)[:, None]  # padding slots hold 0
    return top_w, top_i


@triton.jit
def _pair_expert(logits, t, slot, num_experts, s_lt, BLOCK_E: tl.constexpr):
    """The expert of token t's top-k slot `slot`: the argmax-and-mask rounds of _topk_softmax (the
    same float32 values and tie rule, so the same expert), only as many as the slot needs."""
    e = tl.arange(0, BLOCK_E)
    e_ok = e < num_experts
    x = tl.load(logits + t.to(tl.int64) * s_lt + e, mask=e_ok, other=0.0)
    x = tl.where(e_ok, x.to(tl.float32), float("-inf"))
    for _ in range(0, slot):
        _, i = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
        x = tl.where(e == i, float("-inf"), x)
    _, i = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
    return i


# values that change from pass to pass: one compile serves them all (kernels/__init__.py)
@triton.jit(do_not_specialize=["num_tokens"])
def _router_kernel(
    logits,
    weights,
    ids,
    num_tokens,
    num_experts,
    s_lt,
    TOPK: tl.constexpr,
    TOPK_P: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """weights[t], ids[t] = top-k of softmax(logits[t]) in float32, descending; among equal values the
    lower expert index comes first. Selection runs on the logits (softmax is monotonic), one
    argmax-and-mask round per slot."""
    pdl_wait(USE_PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < num_tokens
    top_w, top_i = _topk_softmax(logits, t, t_ok, num_experts, s_lt, TOPK, TOPK_P, RENORMALIZE, BLOCK_T, BLOCK_E)
    slots = tl.arange(0, TOPK_P)
    dst = t.to(tl.int64)[:, None] * TOPK + slots[None, :]
    ok = t_ok[:, None] & (slots[None, :] < TOPK)
    tl.store(weights + dst, top_w, mask=ok)
    tl.store(ids + dst, top_i.to(tl.int64), mask=ok)


def route_topk_softmax(
    *, router_logits: torch.Tensor, top_k: int, renormalize: bool, config: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts (float32), top-k, optional renormalisation; see naive.route_topk_softmax.
    router_logits: [T, E] (any float dtype) -> (weights [T, top_k] float32, ids [T, top_k] int64).
    One launch, no host sync (runs inside CUDA graphs). `config` (block_t, num_warps) overrides the
    choice made from the shapes."""
    num_tokens, num_experts = router_logits.shape
    assert 0 < top_k <= num_experts, "top_k must be in 1..num_experts"
    if router_logits.stride(-1) != 1:
        router_logits = router_logits.contiguous()
    device = router_logits.device
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int64, device=device)
    if num_tokens == 0:
        return weights, ids
    cfg = config or _router_config(num_tokens, router_logits.is_cuda)
    _router_kernel[(triton.cdiv(num_tokens, cfg["block_t"]),)](
        router_logits,
        weights,
        ids,
        num_tokens,
        num_experts,
        router_logits.stride(0),
        TOPK=top_k,
        TOPK_P=triton.next_power_of_2(top_k),
        RENORMALIZE=renormalize,
        BLOCK_T=cfg["block_t"],
        BLOCK_E=triton.next_power_of_2(num_experts),
        num_warps=cfg["num_warps"],
        **pdl_launch(router_logits),
    )
    return weights, ids


def _router_config(num_tokens: int, on_gpu: bool) -> dict:
    """One warp per token while tokens are few (the batch-1 latency is k warp reductions); 4 tokens
    per 4-warp program for large batches."""
    if not on_gpu:
        return dict(block_t=min(16, triton.next_power_of_2(num_tokens)), num_warps=4)
    if num_tokens <= 1024:
        return dict(block_t=1, num_warps=1)
    return dict(block_t=4, num_warps=4)


# --- fused MoE --------------------------------------------------------------------------------------


# values that change from pass to pass: one compile serves them all (kernels/__init__.py)
@triton.jit(do_not_specialize=["num_pairs"])
def _count_kernel(
    topk_ids, counts, ranks, expert_offset, num_experts, num_pairs, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
):
    """Per pair: its rank within its expert (atomic increment; order within an expert is free)."""
    pdl_wait(USE_PDL)
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(topk_ids + p, mask=p < num_pairs, other=-1).to(tl.int32) - expert_offset
    local = (p < num_pairs) & (e >= 0) & (e < num_experts)
    rank = tl.atomic_add(counts + e, 1, mask=local, sem="relaxed")
    tl.store(ranks + p, rank, mask=local)


@triton.jit
def _scan_kernel(counts, offsets, num_experts, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, USE_PDL: tl.constexpr):
    """offsets[e] = start of expert e's padded rows; offsets[E] = all padded rows."""
    pdl_wait(USE_PDL)
    e = tl.arange(0, BLOCK_E)
    c = tl.load(counts + e, mask=e < num_experts, other=0)
    padded = tl.cdiv(c, BLOCK_M) * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(offsets + e, ends - padded, mask=e < num_experts)
    tl.store(offsets + num_experts, tl.sum(padded, 0))


# values that change from pass to pass: one compile serves them all (kernels/__init__.py)
@triton.jit(do_not_specialize=["num_pairs", "max_blocks"])
def _place_kernel(
    topk_ids,
    counts,
    ranks,
    offsets,
    sorted_ids,
    block_expert,
    expert_offset,
    num_experts,
    num_pairs,
    max_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
    CHUNK_E: tl.constexpr,
    CHUNK_B: tl.constexpr,
    BLOCK_E: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program i: scatters pairs chunk i to their rows, fills expert chunk i's padding rows with the
    sentinel num_pairs, and maps block chunk i to its expert (-1 past the last padded row)."""
    pdl_wait(USE_PDL)
    pid = tl.program_id(0)
    p = pid * BLOCK_P + tl.arange(0, BLOCK_P)
    e = tl.load(topk_ids + p, mask=p < num_pairs, other=-1).to(tl.int32) - expert_offset
    local = (p < num_pairs) & (e >= 0) & (e < num_experts)
    row = tl.load(offsets + e, mask=local, other=0) + tl.load(ranks + p, mask=local, other=0)
    tl.store(sorted_ids + row, p, mask=local)

    ec = pid * CHUNK_E + tl.arange(0, CHUNK_E)
    ec_ok = ec < num_experts
    fill_from = tl.load(offsets + ec, mask=ec_ok, other=0) + tl.load(counts + ec, mask=ec_ok, other=0)
    fill_to = tl.load(offsets + ec + 1, mask=ec_ok, other=0)
    pad = fill_from[:, None] + tl.arange(0, BLOCK_M)[None, :]
    tl.store(sorted_ids + pad, tl.zeros_like(pad) + num_pairs, mask=ec_ok[:, None] & (pad < fill_to[:, None]))

    b = pid * CHUNK_B + tl.arange(0, CHUNK_B)
    ea = tl.arange(0, BLOCK_E)
    ends = tl.load(offsets + 1 + ea, mask=ea < num_experts, other=0)
    first_row = b * BLOCK_M
    owner = tl.sum(tl.where((ea < num_experts)[None, :] & (ends[None, :] <= first_row[:, None]), 1, 0), 1)
    owner = tl.where(first_row < tl.load(offsets + num_experts), owner, -1)
    tl.store(block_expert + b, owner, mask=b < max_blocks)


@triton.jit
def _add_pair(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


# values that change from pass to pass: one compile serves them all (kernels/__init__.py)
@triton.jit(do_not_specialize=["num_pairs", "max_blocks"])
def _align_kernel(
    topk_ids,
    sorted_ids,
    block_expert,
    offsets,
    expert_offset,
    num_experts,
    num_pairs,
    max_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK_B: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """align_pairs in one program, no atomics and no scratch (BLOCK_P >= num_pairs): per-expert
    counts by tl.histogram, the padded scan, then one sort of the keys expert * BLOCK_P + pair
    (non-local pairs last) puts the local pairs in expert-then-pair order; sorted position i of
    expert e goes to row i + (padded start - unpadded start of e). Every block starts with a real
    pair (padding only ends an expert's last block), so the pair at a block's first row names its
    expert."""
    pdl_wait(USE_PDL)
    p = tl.arange(0, BLOCK_P)
    e = tl.load(topk_ids + p, mask=p < num_pairs, other=-1).to(tl.int32) - expert_offset
    local = (p < num_pairs) & (e >= 0) & (e < num_experts)
    counts = tl.histogram(e, BLOCK_E, mask=local)
    padded = tl.cdiv(counts, BLOCK_M) * BLOCK_M
    # one scan for both: padded row ends, and the padding rows up to each expert (inclusive)
    ends, spare_ends = tl.associative_scan((padded, padded - counts), 0, _add_pair)
    starts = ends - padded
    total = tl.sum(padded, 0)
    ea = tl.arange(0, BLOCK_E)
    tl.store(offsets + ea, starts, mask=ea < num_experts)
    tl.store(offsets + num_experts, total)
    pad = (starts + counts)[:, None] + tl.arange(0, BLOCK_M)[None, :]
    tl.store(sorted_ids + pad, tl.zeros_like(pad) + num_pairs, mask=pad < ends[:, None])
    shift = spare_ends - (padded - counts)  # padded minus unpadded start of each expert
    key = tl.sort(tl.where(local, e, BLOCK_E) * BLOCK_P + p)
    se = key // BLOCK_P
    ok = se < BLOCK_E
    row = p + tl.gather(shift, tl.minimum(se, BLOCK_E - 1), 0)
    tl.store(sorted_ids + row, key % BLOCK_P, mask=ok)
    tl.store(block_expert + row // BLOCK_M, se, mask=ok & (row % BLOCK_M == 0))
    for b0 in range(0, max_blocks, CHUNK_B):
        b = b0 + tl.arange(0, CHUNK_B)
        tl.store(block_expert + b, tl.full([CHUNK_B], -1, tl.int32), mask=(b < max_blocks) & (b * BLOCK_M >= total))


# values that change from pass to pass: one compile serves them all (kernels/__init__.py)
@triton.jit(do_not_specialize=["num_pairs"])
def _up_kernel(
    hidden,
    w13,
    act,
    sorted_ids,
    block_expert,
    num_padded,
    topk_ids,
    expert_offset,
    num_experts,
    num_pairs,
    s_ht,
    s_we,
    s_wn,
    s_at,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    TOPK: tl.constexpr,
    PAIR_PER_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """act[pair, n] = silu(x @ gate^T) * (x @ up^T) for one block of pairs of one expert and one
    BLOCK_N slice of the expert width; gate and up rows are the two halves of w13[e]."""
    pdl_wait(USE_PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    if PAIR_PER_BLOCK:
        e = tl.load(topk_ids + pid_m).to(tl.int32) - expert_offset
        if (e < 0) | (e >= num_experts):
            return
        pair = tl.where(rows == 0, pid_m, num_pairs)
    else:
        if pid_m * BLOCK_M >= tl.load(num_padded):
            return
        e = tl.load(block_expert + pid_m)
        pair = tl.load(sorted_ids + pid_m * BLOCK_M + rows)
    row_ok = pair < num_pairs
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < INTER
    k = tl.arange(0, BLOCK_K)
    a_ptr = hidden + (pair // TOPK).to(tl.int64)[:, None] * s_ht + k[None, :]
    g_ptr = w13 + e.to(tl.int64) * s_we + n[None, :] * s_wn + k[:, None]
    u_ptr = g_ptr + INTER * s_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        if HIDDEN % BLOCK_K == 0:
            a = tl.load(a_ptr, mask=row_ok[:, None], other=0.0)
            g = tl.load(g_ptr, mask=n_ok[None, :], other=0.0)
            u = tl.load(u_ptr, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = k0 + k < HIDDEN
            a = tl.load(a_ptr, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(g_ptr, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            u = tl.load(u_ptr, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc_g = tl.dot(a, g, acc_g)
        acc_u = tl.dot(a, u, acc_u)
        a_ptr += BLOCK_K
        g_ptr += BLOCK_K
        u_ptr += BLOCK_K
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    dst = act + pair.to(tl.int64)[:, None] * s_at + n[None, :]
    tl.store(dst, h.to(act.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


# values that change from pass to pass: one compile serves them all (kernels/__init__.py)
@triton.jit(do_not_specialize=["num_pairs"])
def _down_kernel(
    act,
    w2,
    y,
    topk_weights,
    sorted_ids,
    block_expert,
    num_padded,
    num_pairs,
    s_at,
    s_we,
    s_wn,
    s_yp,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """y[pair, n] = weight[pair] * act[pair] @ w2[e, n]^T for one block of sorted pairs."""
    pdl_wait(USE_PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded):
        return
    e = tl.load(block_expert + pid_m)
    pair = tl.load(sorted_ids + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pair < num_pairs
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < HIDDEN
    k = tl.arange(0, BLOCK_K)
    a_ptr = act + pair.to(tl.int64)[:, None] * s_at + k[None, :]
    b_ptr = w2 + e.to(tl.int64) * s_we + n[None, :] * s_wn + k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        if INTER % BLOCK_K == 0:
            a = tl.load(a_ptr, mask=row_ok[:, None], other=0.0)
            b = tl.load(b_ptr, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = k0 + k < INTER
            a = tl.load(a_ptr, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptr, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptr += BLOCK_K
        b_ptr += BLOCK_K
    acc *= tl.load(topk_weights + pair, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    dst = y + pair.to(tl.int64)[:, None] * s_yp + n[None, :]
    tl.store(dst, acc.to(y.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _sum_kernel(
    y,
    topk_ids,
    out,
    shared,
    gate_logit,
    expert_offset,
    num_experts,
    s_yp,
    s_ot,
    s_st,
    s_gl,
    residual,
    norm_weight,
    normed_out,
    res_out,
    s_rt,
    eps,
    HIDDEN: tl.constexpr,
    TOPK: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    ADD_NORM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """out[t] = sum of its local slots' rows of y (non-local slots were never written), plus
    sigmoid(gate_logit[t]) * shared[t] (the shared expert's down projection) when HAS_SHARED; one
    rounding. ADD_NORM (BLOCK covers the row): the next norm of the row instead, res_out[t] =
    out[t] + residual[t] and normed_out[t] = its zero-centred RMSNorm (rows of stride s_rt).
    With the shared expert, its two launches run between the routed down GEMM and this kernel, so
    the routed rows (and the ids and gate logits, older still) load before the PDL wait
    (kernels/pdl.py) and only the shared expert's output after it."""
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    if not HAS_SHARED:  # the routed down GEMM is the kernel just before
        pdl_wait(USE_PDL)
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(TOPK):
        pair = t * TOPK + j
        e = tl.load(topk_ids + pair).to(tl.int32) - expert_offset
        local = (e >= 0) & (e < num_experts)
        h_ok = h < tl.where(local, HIDDEN, 0)
        acc += tl.load(y + pair.to(tl.int64) * s_yp + h, mask=h_ok, other=0.0).to(tl.float32)
    if HAS_SHARED:
        scale = tl.sigmoid(tl.load(gate_logit + t.to(tl.int64) * s_gl).to(tl.float32))
        pdl_wait(USE_PDL)
        acc += scale * tl.load(shared + t.to(tl.int64) * s_st + h, mask=h < HIDDEN, other=0.0).to(tl.float32)
    if ADD_NORM:
        row = t.to(tl.int64) * s_rt
        xv = acc.to(out.dtype.element_ty).to(tl.float32)
        add_rms_norm_row(xv, residual + row, res_out + row, normed_out + row, norm_weight, eps, h, h < HIDDEN, HIDDEN)
    else:
        tl.store(out + t.to(tl.int64) * s_ot + h, acc.to(out.dtype.element_ty), mask=h < HIDDEN)


@triton.jit
def _silu_mul_kernel(gate_up, act, s_gt, s_at, INTER: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """act[t, i] = silu(gate[t, i]) * up[t, i] from gate_up [T, 2 * INTER] (strided rows), in float32,
    one rounding."""
    pdl_wait(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = i < INTER
    g = tl.load(gate_up + t * s_gt + i, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gate_up + t * s_gt + INTER + i, mask=ok, other=0.0).to(tl.float32)
    tl.store(act + t * s_at + i, (g * tl.sigmoid(g) * u).to(act.dtype.element_ty), mask=ok)


@triton.jit
def _down_token_kernel(
    act,
    w2,
    out,
    topk_weights,
    topk_ids,
    expert_offset,
    num_experts,
    s_at,
    s_we,
    s_wn,
    s_ot,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    TOPK: tl.constexpr,
    TOPK_P: tl.constexpr,
    NUM_KB: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """out[t, n] = sum_j weight[t, j] * act[t, j] @ w2[e_j, n]^T in one pipelined loop over
    (slot, k-chunk); the act row sits in row 0 of a 16-row tile so the loads feed tl.dot."""
    pdl_wait(USE_PDL)
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < HIDDEN
    rows = tl.arange(0, 16)
    k = tl.arange(0, BLOCK_K)
    # the token's experts and weights are read once up front: no load chain inside the loop, so
    # the weight tiles pipeline as deep as num_stages allows
    slots = tl.arange(0, TOPK_P)
    ids = tl.load(topk_ids + t * TOPK + slots, mask=slots < TOPK, other=0).to(tl.int32) - expert_offset
    wts = tl.load(topk_weights + t * TOPK + slots, mask=slots < TOPK, other=0.0).to(tl.float32)
    acc = tl.zeros([16, BLOCK_N], tl.float32)
    for j in range(0, TOPK * NUM_KB):
        slot = j // NUM_KB
        kk = (j % NUM_KB) * BLOCK_K + k
        e = tl.sum(tl.where(slots == slot, ids, 0), 0)
        w = tl.sum(tl.where(slots == slot, wts, 0.0), 0)
        local = (e >= 0) & (e < num_experts)
        # a non-local slot gets an empty k range: its loads are fully masked (no scalar-mask splat,
        # which the interpreter mistypes)
        k_ok = kk < tl.where(local, INTER, 0)
        a = tl.load(act + (t * TOPK + slot).to(tl.int64) * s_at + kk, mask=k_ok, other=0.0).to(tl.float32)
        a = tl.where(rows[:, None] == 0, a[None, :] * w, 0.0).to(act.dtype.element_ty)
        b_ptr = w2 + tl.where(local, e, 0).to(tl.int64) * s_we + n[None, :] * s_wn + kk[:, None]
        b = tl.load(b_ptr, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(a, b, acc)
    tl.store(out + t.to(tl.int64) * s_ot + n, tl.sum(acc, 0).to(out.dtype.element_ty), mask=n_ok)


@triton.jit
def _up_gemv_kernel(
    hidden,
    w13,
    act,
    topk_ids,
    expert_offset,
    num_experts,
    s_ht,
    s_we,
    s_wn,
    s_at,
    router_logits,
    topk_weights,
    num_routed,
    s_lt,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    TOPK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROUTE: tl.constexpr,
    TOPK_P: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """act[pair, n] = silu(x . gate[n]) * (x . up[n]) for BLOCK_N rows n of one pair's expert.
    ROUTE: the router's work too, so its launch goes. Each program finds its pair's expert from its
    token's logits over the num_routed experts (argmax rounds up to the pair's slot: the router
    kernel's selection); the programs of row block 0 also run the router kernel's whole top-k
    softmax (_topk_softmax) and write topk_ids / topk_weights for the down GEMV. Meant for 1-warp
    programs: a round's reduction then stays in the warp (shuffles, no barrier).
    Pairs routed to another rank's expert exit (their act rows stay unset; the down kernel masks
    them). The K loop is unrolled and accumulates [BLOCK_N, BLOCK_K] partial products, reduced once
    at the end, so no barrier separates one chunk's loads from the next."""
    pdl_wait(USE_PDL)
    pair = tl.program_id(0)
    if ROUTE:
        routed = _pair_expert(router_logits, pair // TOPK, pair % TOPK, num_routed, s_lt, BLOCK_E)
        if tl.program_id(1) == 0:
            t = pair // TOPK + tl.zeros([1], tl.int32)
            top_w, top_i = _topk_softmax(
                router_logits, t, t >= 0, num_routed, s_lt, TOPK, TOPK_P, RENORMALIZE, 1, BLOCK_E
            )
            mine = tl.arange(0, TOPK_P)[None, :] == pair % TOPK
            tl.store(topk_ids + pair, tl.sum(tl.sum(tl.where(mine, top_i, 0), 1), 0).to(tl.int64))
            tl.store(topk_weights + pair, tl.sum(tl.sum(tl.where(mine, top_w, 0.0), 1), 0))
        e = routed - expert_offset
    else:
        e = tl.load(topk_ids + pair).to(tl.int32) - expert_offset
    if (e < 0) | (e >= num_experts):
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < INTER
    k = tl.arange(0, BLOCK_K)
    x_ptr = hidden + (pair // TOPK).to(tl.int64) * s_ht + k
    g_ptr = w13 + e.to(tl.int64) * s_we + n[:, None] * s_wn + k[None, :]
    u_ptr = g_ptr + INTER * s_wn
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in tl.static_range(0, HIDDEN, BLOCK_K):
        if HIDDEN % BLOCK_K == 0:
            x = tl.load(x_ptr + k0).to(tl.float32)
            if INTER % BLOCK_N == 0:
                g = tl.load(g_ptr + k0, eviction_policy="evict_first")
                u = tl.load(u_ptr + k0, eviction_policy="evict_first")
            else:
                g = tl.load(g_ptr + k0, mask=n_ok[:, None], other=0.0, eviction_policy="evict_first")
                u = tl.load(u_ptr + k0, mask=n_ok[:, None], other=0.0, eviction_policy="evict_first")
        else:
            k_ok = k0 + k < HIDDEN
            x = tl.load(x_ptr + k0, mask=k_ok, other=0.0).to(tl.float32)
            w_ok = n_ok[:, None] & k_ok[None, :]
            g = tl.load(g_ptr + k0, mask=w_ok, other=0.0, eviction_policy="evict_first")
            u = tl.load(u_ptr + k0, mask=w_ok, other=0.0, eviction_policy="evict_first")
        acc_g += g.to(tl.float32) * x[None, :]
        acc_u += u.to(tl.float32) * x[None, :]
    gate = tl.sum(acc_g, 1)
    h = gate * tl.sigmoid(gate) * tl.sum(acc_u, 1)
    tl.store(act + pair.to(tl.int64) * s_at + n, h.to(act.dtype.element_ty), mask=n_ok)


@triton.jit
def _down_gemv_kernel(
    act,
    w2,
    out,
    topk_weights,
    topk_ids,
    expert_offset,
    num_experts,
    s_at,
    s_we,
    s_wn,
    s_ot,
    shared_gate_up,
    shared_w2,
    shared_gate_logit,
    s_sgu,
    s_sw2,
    s_sgl,
    residual,
    norm_weight,
    normed_out,
    res_out,
    tickets,
    s_rt,
    eps,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    TOPK: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_I: tl.constexpr,
    SHARED_INTER: tl.constexpr,
    ADD_NORM: tl.constexpr,
    BLOCK_HID: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """out[t, h] = sum_j weight[t, j] * act[t, j] . w2[e_j, h] for BLOCK_H rows h, all top-k slots
    unrolled into one straight run of independent loads. A slot routed to another rank gets an
    empty column range: its loads are fully masked (an empty range instead of a scalar mask, which
    the interpreter mistypes). SHARED_INTER > 0: the shared expert is one more slot, its activation
    silu(gate) * up formed on the fly from its gate/up projection and weighted by sigmoid(gate
    logit), so the block's whole output leaves in one rounding. The shared expert's weights do not
    depend on the routing: when they fit one chunk they are loaded before the PDL wait, while the
    previous kernel finishes.
    ADD_NORM: the next norm of the block's output too (the norm kernel's work, without its launch).
    The last of a token's programs to finish (tickets.last_to_arrive, after a CTA barrier) reads the
    whole row back from L2 and writes res_out = out + residual and normed_out = its zero-centred
    RMSNorm."""
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < HIDDEN
    i = tl.arange(0, BLOCK_I)
    shared_ptr = shared_w2 + h[:, None].to(tl.int64) * s_sw2 + i[None, :]
    PRELOAD_SHARED: tl.constexpr = SHARED_INTER > 0 and SHARED_INTER <= BLOCK_I
    if PRELOAD_SHARED:
        shared_mask = h_ok[:, None] & (i < SHARED_INTER)[None, :]
        shared_b = tl.load(shared_ptr, mask=shared_mask, other=0.0, eviction_policy="evict_first")
    pdl_wait(USE_PDL)
    acc = tl.zeros([BLOCK_H, BLOCK_I], tl.float32)
    for j in tl.static_range(TOPK):
        pair = t * TOPK + j
        e = tl.load(topk_ids + pair).to(tl.int32) - expert_offset
        w = tl.load(topk_weights + pair).to(tl.float32)
        local = (e >= 0) & (e < num_experts)
        limit = tl.where(local, INTER, 0)
        a_ptr = act + pair.to(tl.int64) * s_at + i
        b_ptr = w2 + tl.where(local, e, 0).to(tl.int64) * s_we + h[:, None] * s_wn + i[None, :]
        for i0 in tl.static_range(0, INTER, BLOCK_I):
            i_ok = i0 + i < limit
            a = tl.load(a_ptr + i0, mask=i_ok, other=0.0).to(tl.float32) * w
            b = tl.load(b_ptr + i0, mask=h_ok[:, None] & i_ok[None, :], other=0.0, eviction_policy="evict_first")
            acc += b.to(tl.float32) * a[None, :]
    if SHARED_INTER > 0:
        scale = tl.sigmoid(tl.load(shared_gate_logit + t.to(tl.int64) * s_sgl).to(tl.float32))
        g_ptr = shared_gate_up + t.to(tl.int64) * s_sgu + i
        for i0 in tl.static_range(0, SHARED_INTER, BLOCK_I):
            i_ok = i0 + i < SHARED_INTER
            g = tl.load(g_ptr + i0, mask=i_ok, other=0.0).to(tl.float32)
            u = tl.load(g_ptr + SHARED_INTER + i0, mask=i_ok, other=0.0).to(tl.float32)
            if PRELOAD_SHARED:
                b = shared_b
            else:
                b_mask = h_ok[:, None] & i_ok[None, :]
                b = tl.load(shared_ptr + i0, mask=b_mask, other=0.0, eviction_policy="evict_first")
            acc += b.to(tl.float32) * (g * tl.sigmoid(g) * u * scale)[None, :]
    tl.store(out + t.to(tl.int64) * s_ot + h, tl.sum(acc, 1).to(out.dtype.element_ty), mask=h_ok)
    if ADD_NORM:
        tl.debug_barrier()
        if last_to_arrive(tickets + t, tl.num_programs(1)):
            d = tl.arange(0, BLOCK_HID)
            d_ok = d < HIDDEN
            xv = tl.load(out + t.to(tl.int64) * s_ot + d, mask=d_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
            row = t.to(tl.int64) * s_rt
            add_rms_norm_row(xv, residual + row, res_out + row, normed_out + row, norm_weight, eps, d, d_ok, HIDDEN)


def _pairs_config(hidden_size: int, inter: int, on_gpu: bool) -> dict:
    """Pairs path (GEMV) tiles. Thin row blocks so that batch 1 (8 pairs) already runs 1024 up and
    1024 down programs, several per SM. From the sm_90 compile (NOTES.md): up 4 x 512 / 4 warps
    issues 14 of its 16 16-byte weight loads per thread before the first FMA (104 registers, 4
    programs per SM); down 2 x 512 / 2 warps 11 of 16 (126 registers, 8 programs per SM)."""
    if not on_gpu:
        block_k = min(64, triton.next_power_of_2(hidden_size))
        block_i = min(64, triton.next_power_of_2(inter))
        up = dict(block_n=8, block_k=block_k, num_warps=4)
        return dict(up=up, up_route=up, down=dict(block_h=8, block_i=block_i, num_warps=4))
    return dict(
        up=dict(block_n=4, block_k=min(512, triton.next_power_of_2(hidden_size)), num_warps=4),
        # routing in the up GEMV: one warp a program keeps the top-k's reductions in the warp; one
        # row a program (H200, batch 1, in place: 12.2 us a layer; 2 x 512 12.5, 4 x 512 / 4 warps 13.1)
        up_route=dict(block_n=1, block_k=min(1024, triton.next_power_of_2(hidden_size)), num_warps=1),
        down=dict(block_h=2, block_i=min(512, triton.next_power_of_2(inter)), num_warps=2),
    )


def _pairs_mma_config(on_gpu: bool) -> dict:
    """Previous pairs path tiles: thin N slices so a batch-1 call still spreads the weights over all SMs."""
    if not on_gpu:
        tiles = dict(block_n=16, block_k=16, num_warps=4, num_stages=1)
        return dict(up=tiles, down=tiles)
    return dict(
        up=dict(block_n=16, block_k=256, num_warps=4, num_stages=4),
        down=dict(block_n=16, block_k=512, num_warps=4, num_stages=5),
    )


def _sorted_config(num_pairs: int, num_experts: int, on_gpu: bool) -> dict:
    """Sorted path tiles by the mean rows per expert: thin blocks while weights dominate, square
    tensor-core tiles once each expert has enough rows to be compute-bound."""
    if not on_gpu:
        return dict(
            block_m=16,
            up=dict(block_n=16, block_k=16, num_warps=4, num_stages=1),
            down=dict(block_n=16, block_k=16, num_warps=4, num_stages=1),
        )
    rows = num_pairs / max(1, num_experts)
    if rows <= 24:
        up = dict(block_n=64, block_k=128, num_warps=4, num_stages=4)
        return dict(block_m=16, up=up, down=dict(block_n=64, block_k=128, num_warps=4, num_stages=4))
    if rows <= 64:
        up = dict(block_n=64, block_k=128, num_warps=4, num_stages=3)
        return dict(block_m=32, up=up, down=dict(block_n=64, block_k=128, num_warps=4, num_stages=3))
    if rows <= 192:
        up = dict(block_n=64, block_k=64, num_warps=4, num_stages=4)
        return dict(block_m=64, up=up, down=dict(block_n=128, block_k=64, num_warps=4, num_stages=4))
    up = dict(block_n=64, block_k=64, num_warps=8, num_stages=3)
    return dict(block_m=128, up=up, down=dict(block_n=128, block_k=64, num_warps=8, num_stages=3))


def align_pairs(
    *, topk_ids: torch.Tensor, num_experts: int, expert_offset: int, block_m: int, one_launch: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the (token, slot) pairs of topk_ids [T, top_k] (flat pair = t * top_k + slot) by local expert.

    Returns sorted_ids [max_blocks * block_m] (pair per row, num_pairs = padding; rows past the
    total are unset), block_expert [max_blocks] (local expert per block, -1 = unused) and
    offsets [E + 1] (padded row start per expert; offsets[E] = total padded rows). max_blocks bounds
    sum_e cdiv(count_e, block_m) from shapes alone, so nothing syncs with the host.
    Up to ALIGN_ONE_LAUNCH_MAX pairs: one single-program launch, pairs in ascending order within an
    expert; above it zeros + count + scan + place (order within an expert free). `one_launch`
    overrides the choice (tests)."""
    num_pairs = topk_ids.numel()
    device = topk_ids.device
    max_blocks = triton.cdiv(num_pairs, block_m) + min(num_pairs, num_experts)
    offsets = torch.empty(num_experts + 1, dtype=torch.int32, device=device)
    sorted_ids = torch.empty(max_blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=device)
    block_e = triton.next_power_of_2(num_experts)
    if one_launch is None:
        one_launch = num_pairs <= ALIGN_ONE_LAUNCH_MAX
    if one_launch:
        block_p = max(16, triton.next_power_of_2(num_pairs))
        _align_kernel[(1,)](
            topk_ids,
            sorted_ids,
            block_expert,
            offsets,
            expert_offset,
            num_experts,
            num_pairs,
            max_blocks,
            BLOCK_M=block_m,
            BLOCK_P=block_p,
            BLOCK_E=block_e,
            CHUNK_B=512,
            num_warps=8,
            **pdl_launch(topk_ids),
        )
        return sorted_ids, block_expert, offsets
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    ranks = torch.empty(num_pairs, dtype=torch.int32, device=device)
    block_p = 1024 if device.type == "cuda" else 64
    chunk_e = max(1, 2048 // block_m)
    chunk_b = max(1, 4096 // block_e)
    _count_kernel[(triton.cdiv(num_pairs, block_p),)](
        topk_ids,
        counts,
        ranks,
        expert_offset,
        num_experts,
        num_pairs,
        BLOCK=block_p,
        **pdl_launch(topk_ids),
    )
    _scan_kernel[(1,)](counts, offsets, num_experts, BLOCK_M=block_m, BLOCK_E=block_e, **pdl_launch(counts))
    grid = max(triton.cdiv(num_pairs, block_p), triton.cdiv(num_experts, chunk_e), triton.cdiv(max_blocks, chunk_b))
    _place_kernel[(grid,)](
        topk_ids,
        counts,
        ranks,
        offsets,
        sorted_ids,
        block_expert,
        expert_offset,
        num_experts,
        num_pairs,
        max_blocks,
        BLOCK_M=block_m,
        BLOCK_P=block_p,
        CHUNK_E=chunk_e,
        CHUNK_B=chunk_b,
        BLOCK_E=block_e,
        **pdl_launch(topk_ids),
    )
    return sorted_ids, block_expert, offsets


def _moe_pairs(
    hidden, w13, w2, topk_weights, topk_ids, expert_offset, out, cfg, shared=None, norm=None, route=None
) -> None:
    """route: (router_logits, renormalize) when the up GEMV routes, filling topk_ids / topk_weights."""
    num_tokens, hidden_size = hidden.shape
    num_experts, inter = w13.shape[0], w2.shape[2]
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    act = torch.empty((num_pairs, inter), dtype=hidden.dtype, device=hidden.device)
    up, down = cfg["up"] if route is None else cfg["up_route"], cfg["down"]
    logits, renormalize = route if route is not None else (hidden, False)
    _up_gemv_kernel[(num_pairs, triton.cdiv(inter, up["block_n"]))](
        hidden,
        w13,
        act,
        topk_ids,
        expert_offset,
        num_experts,
        hidden.stride(0),
        w13.stride(0),
        w13.stride(1),
        act.stride(0),
        logits,
        topk_weights,
        logits.shape[1],
        logits.stride(0),
        HIDDEN=hidden_size,
        INTER=inter,
        TOPK=top_k,
        BLOCK_N=up["block_n"],
        BLOCK_K=up["block_k"],
        ROUTE=route is not None,
        TOPK_P=triton.next_power_of_2(top_k),
        RENORMALIZE=renormalize,
        BLOCK_E=triton.next_power_of_2(logits.shape[1]),
        num_warps=up["num_warps"],
        num_stages=1,
        **pdl_launch(hidden),
    )
    shared_inter = 0 if shared is None else shared.w2.shape[1]
    args = (act, w2, out, topk_weights, topk_ids, expert_offset, num_experts)
    args += (act.stride(0), w2.stride(0), w2.stride(1), out.stride(0), *_shared_args(shared, out))
    if norm is not None:
        tickets = ticket_counters(out.device, num_tokens, "moe_down_norm")
        args += (
            norm.add.residual,
            norm.add.weight,
            norm.out.normed,
            norm.out.residual,
            tickets,
            norm.row_stride,
            norm.add.eps,
        )
    else:
        args += (out, out, out, out, out, 0, 0.0)
    _down_gemv_kernel[(num_tokens, triton.cdiv(hidden_size, down["block_h"]))](
        *args,
        HIDDEN=hidden_size,
        INTER=inter,
        TOPK=top_k,
        BLOCK_H=down["block_h"],
        BLOCK_I=down["block_i"],
        SHARED_INTER=shared_inter,
        ADD_NORM=norm is not None,
        BLOCK_HID=triton.next_power_of_2(hidden_size),
        num_warps=down["num_warps"],
        num_stages=1,
        **pdl_launch(act),
    )


def _shared_args(shared: SharedExpert | None, out: torch.Tensor) -> tuple:
    """The down GEMV's shared-expert pointers and row strides (placeholders when there is none)."""
    if shared is None:
        return out, out, out, 0, 0, 0
    return (
        shared.gate_up,
        shared.w2,
        shared.gate_logit,
        shared.gate_up.stride(0),
        shared.w2.stride(0),
        shared.gate_logit.stride(0),
    )


def _moe_pairs_mma(hidden, w13, w2, topk_weights, topk_ids, expert_offset, out, cfg) -> None:
    num_tokens, hidden_size = hidden.shape
    num_experts, inter = w13.shape[0], w2.shape[2]
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    act = torch.empty((num_pairs, inter), dtype=hidden.dtype, device=hidden.device)
    up, down = cfg["up"], cfg["down"]
    _up_kernel[(num_pairs, triton.cdiv(inter, up["block_n"]))](
        hidden,
        w13,
        act,
        act,
        act,
        act,
        topk_ids,
        expert_offset,
        num_experts,
        num_pairs,
        hidden.stride(0),
        w13.stride(0),
        w13.stride(1),
        act.stride(0),
        HIDDEN=hidden_size,
        INTER=inter,
        TOPK=top_k,
        PAIR_PER_BLOCK=True,
        BLOCK_M=16,
        BLOCK_N=up["block_n"],
        BLOCK_K=up["block_k"],
        num_warps=up["num_warps"],
        num_stages=up["num_stages"],
        **pdl_launch(hidden),
    )
    _down_token_kernel[(num_tokens, triton.cdiv(hidden_size, down["block_n"]))](
        act,
        w2,
        out,
        topk_weights,
        topk_ids,
        expert_offset,
        num_experts,
        act.stride(0),
        w2.stride(0),
        w2.stride(1),
        out.stride(0),
        HIDDEN=hidden_size,
        INTER=inter,
        TOPK=top_k,
        TOPK_P=triton.next_power_of_2(top_k),
        NUM_KB=triton.cdiv(inter, down["block_k"]),
        BLOCK_N=down["block_n"],
        BLOCK_K=down["block_k"],
        num_warps=down["num_warps"],
        num_stages=down["num_stages"],
        **pdl_launch(act),
    )


def _moe_sorted(hidden, w13, w2, topk_weights, topk_ids, expert_offset, out, cfg, shared=None, norm=None) -> None:
    num_tokens, hidden_size = hidden.shape
    num_experts, inter = w13.shape[0], w2.shape[2]
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    block_m = cfg["block_m"]
    sorted_ids, block_expert, offsets = align_pairs(
        topk_ids=topk_ids, num_experts=num_experts, expert_offset=expert_offset, block_m=block_m
    )
    num_padded = offsets[num_experts:]
    max_blocks = block_expert.shape[0]
    act = torch.empty((num_pairs, inter), dtype=hidden.dtype, device=hidden.device)
    y = torch.empty((num_pairs, hidden_size), dtype=hidden.dtype, device=hidden.device)
    up, down = cfg["up"], cfg["down"]
    _up_kernel[(max_blocks, triton.cdiv(inter, up["block_n"]))](
        hidden,
        w13,
        act,
        sorted_ids,
        block_expert,
        num_padded,
        topk_ids,
        expert_offset,
        num_experts,
        num_pairs,
        hidden.stride(0),
        w13.stride(0),
        w13.stride(1),
        act.stride(0),
        HIDDEN=hidden_size,
        INTER=inter,
        TOPK=top_k,
        PAIR_PER_BLOCK=False,
        BLOCK_M=block_m,
        BLOCK_N=up["block_n"],
        BLOCK_K=up["block_k"],
        num_warps=up["num_warps"],
        num_stages=up["num_stages"],
        **pdl_launch(hidden),
    )
    _down_kernel[(max_blocks, triton.cdiv(hidden_size, down["block_n"]))](
        act,
        w2,
        y,
        topk_weights,
        sorted_ids,
        block_expert,
        num_padded,
        num_pairs,
        act.stride(0),
        w2.stride(0),
        w2.stride(1),
        y.stride(0),
        HIDDEN=hidden_size,
        INTER=inter,
        BLOCK_M=block_m,
        BLOCK_N=down["block_n"],
        BLOCK_K=down["block_k"],
        num_warps=down["num_warps"],
        num_stages=down["num_stages"],
        **pdl_launch(act),
    )
    shared_out = gate_logit = None
    if shared is not None:  # its down projection on cuBLAS; the gate and the sum in the sum kernel
        shared_out = F.linear(_silu_mul(shared.gate_up, shared.w2.shape[1]), shared.w2)
        gate_logit = shared.gate_logit
    # with the norm a program takes a whole row (a norm needs all of it)
    block_h = (
        triton.next_power_of_2(hidden_size) if norm is not None else min(1024, triton.next_power_of_2(hidden_size))
    )
    if norm is not None:
        norm_args = (
            norm.add.residual,
            norm.add.weight,
            norm.out.normed,
            norm.out.residual,
            norm.row_stride,
            norm.add.eps,
        )
    else:
        norm_args = (out, out, out, out, 0, 0.0)
    _sum_kernel[(num_tokens, triton.cdiv(hidden_size, block_h))](
        y,
        topk_ids,
        out,
        out if shared_out is None else shared_out,
        out if gate_logit is None else gate_logit,
        expert_offset,
        num_experts,
        y.stride(0),
        out.stride(0),
        0 if shared_out is None else shared_out.stride(0),
        0 if gate_logit is None else gate_logit.stride(0),
        *norm_args,
        HIDDEN=hidden_size,
        TOPK=top_k,
        BLOCK=block_h,
        HAS_SHARED=shared is not None,
        ADD_NORM=norm is not None,
        num_warps=4,
        **pdl_launch(y),
    )


def _silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """silu(gate) * up of gate_up [T, 2 * inter] -> [T, inter], one launch."""
    num_tokens = gate_up.shape[0]
    act = torch.empty((num_tokens, inter), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(inter))
    _silu_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
        gate_up, act, gate_up.stride(0), act.stride(0), INTER=inter, BLOCK=block, num_warps=4, **pdl_launch(act)
    )
    return act


def fused_moe(
    *,
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_offset: int = 0,
    shared: SharedExpert | None = None,
    path: str | None = None,
    config: dict | None = None,
    add_norm: AddNorm | None = None,
) -> torch.Tensor | NormedOut:
    """sum_k weight[t, k] * down(silu(gate(x_t)) * up(x_t)) over the experts this rank holds, plus the
    gated shared expert when `shared` is given (naive.fused_moe).

    hidden: [T, H]; w13: [E, 2 * I, H] (gate rows then up rows); w2: [E, H, I];
    topk_weights, topk_ids: [T, top_k] (weights in any float dtype). Returns [T, H] in hidden's dtype.
    The pairs path (decode batches up to 8 tokens at top-8) runs the shared expert inside its down
    GEMV: 16 graph-captured blocks on the H200 took 299 against 499 us at batch 1 and 1.62 against
    1.90 ms at batch 8, against the routed kernels + a six-launch torch composition (docs/PERF.md).
    The sorted path runs its activation (one kernel) and down projection (cuBLAS), and adds it
    with its gate in the routed sum kernel: three launches instead of six. pairs_mma (kept for
    comparison) composes it with torch ops.
    `path` ("pairs", "sorted" or "pairs_mma") and `config` override the choice made from the shapes
    (tests and tuning sweeps).
    add_norm: the residual add + zero-centred RMSNorm that follows the block, done by its last
    kernel (the pairs path's down GEMV, the sorted path's sum) instead of a norm launch; returns
    NormedOut(normed, residual). Needs hidden sizes <= MAX_NORM_HIDDEN (else the norm kernel)."""
    num_tokens, hidden_size = hidden.shape
    num_experts, two_inter, _ = w13.shape
    assert w13.shape[2] == hidden_size and w2.shape == (num_experts, hidden_size, two_inter // 2), "weight shapes"
    assert hidden.stride(-1) == 1 and w13.stride(-1) == 1 and w2.stride(-1) == 1, "contiguous last dims"
    if shared is not None:
        check_shared(shared, num_tokens, hidden_size)
    out = torch.empty_like(hidden)
    if num_tokens == 0:
        return apply_add_norm(out, add_norm)
    norm = _fused_norm(add_norm, hidden)
    topk_ids = topk_ids.contiguous()
    topk_weights = topk_weights.contiguous()
    num_pairs = topk_ids.numel()
    path = path or ("pairs" if num_pairs <= PAIRS_PATH_MAX else "sorted")
    fold_shared = shared if path in ("pairs", "sorted") else None
    on_gpu = hidden.is_cuda
    if path == "pairs":
        cfg = config or _pairs_config(hidden_size, two_inter // 2, on_gpu)
        _moe_pairs(hidden, w13, w2, topk_weights, topk_ids, expert_offset, out, cfg, fold_shared, norm)
    elif path == "pairs_mma":
        norm = None  # the comparison path: the norm kernel after it
        cfg = config or _pairs_mma_config(on_gpu)
        _moe_pairs_mma(hidden, w13, w2, topk_weights, topk_ids, expert_offset, out, cfg)
    else:
        assert path == "sorted", f"unknown path {path!r}"
        cfg = config or _sorted_config(num_pairs, num_experts, on_gpu)
        _moe_sorted(hidden, w13, w2, topk_weights, topk_ids, expert_offset, out, cfg, shared, norm)
    if shared is not None and fold_shared is None:
        inter = shared.w2.shape[1]
        act = F.silu(shared.gate_up[:, :inter]) * shared.gate_up[:, inter:]
        out = out + torch.sigmoid(shared.gate_logit) * F.linear(act, shared.w2)
    if norm is not None:
        return norm.out
    return apply_add_norm(out, add_norm)


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
    path: str | None = None,
    route_in_up: bool | None = None,
) -> torch.Tensor | NormedOut:
    """route_topk_softmax, then fused_moe (naive.routed_moe), in one launch fewer on the pairs path:
    its up GEMV routes. router_logits: [T, E_total] (E_total >= expert_offset + w13's E); the rest
    as fused_moe. `path` forces one ("pairs" routes in the up GEMV; the others route first).
    route_in_up: False routes first on the pairs path too; None: at most ROUTE_IN_UP_MAX_TOKENS
    tokens route in the up GEMV (DELTASERVE_ROUTE_IN_UP_MAX_TOKENS overrides it, read per call so
    that the benchmark's variants can move the cut)."""
    num_tokens = hidden.shape[0]
    path = path or ("pairs" if num_tokens * top_k <= PAIRS_PATH_MAX else "sorted")
    if route_in_up is None:
        route_in_up = num_tokens <= int(os.environ.get("DELTASERVE_ROUTE_IN_UP_MAX_TOKENS", ROUTE_IN_UP_MAX_TOKENS))
    if not route_in_up or path != "pairs" or num_tokens == 0 or router_logits.shape[1] > MAX_ROUTED_EXPERTS:
        weights, ids = route_topk_softmax(router_logits=router_logits, top_k=top_k, renormalize=renormalize)
        return fused_moe(
            hidden=hidden, w13=w13, w2=w2, topk_weights=weights, topk_ids=ids, expert_offset=expert_offset,
            shared=shared, add_norm=add_norm, path=path,
        )  # fmt: skip
    assert 0 < top_k <= router_logits.shape[1], "top_k must be in 1..num_experts"
    assert router_logits.shape[0] == num_tokens, "router_logits: one row per token"
    num_experts, two_inter, hidden_size = w13.shape
    assert hidden.stride(-1) == 1 and w13.stride(-1) == 1 and w2.stride(-1) == 1, "contiguous last dims"
    if shared is not None:
        check_shared(shared, num_tokens, hidden_size)
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=hidden.device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int64, device=hidden.device)
    out = torch.empty_like(hidden)
    norm = _fused_norm(add_norm, hidden)
    cfg = _pairs_config(hidden_size, two_inter // 2, hidden.is_cuda)
    _moe_pairs(hidden, w13, w2, weights, ids, expert_offset, out, cfg, shared, norm, route=(logits, renormalize))
    return norm.out if norm is not None else apply_add_norm(out, add_norm)


# Decode batches up to this many tokens route inside the pairs path's up GEMV. H200, one step of the
# 35B-A3B shape: batch 1 2.33 -> 2.27 ms (the up GEMV 11.7 -> 12.2 us a layer, the 2.3 us router
# launch gone), batch 2 3.25 -> 3.10, batch 4 4.92 -> 4.71; batch 8 6.91 -> 7.35 ms (each of 4,096
# programs redoes a top-k, and the 1-warp tiles stream repeated experts less well).
ROUTE_IN_UP_MAX_TOKENS = 4
# the up GEMV's programs hold a token's logits in registers to route
MAX_ROUTED_EXPERTS = 1024
# the fused norm holds a whole row in one program's registers
MAX_NORM_HIDDEN = 8192


class _FusedNorm(NamedTuple):
    """add_norm with its output buffers, for the kernels (rows of one stride in all four tensors)."""

    add: AddNorm
    out: NormedOut
    row_stride: int


def _fused_norm(add_norm: AddNorm | None, hidden: torch.Tensor) -> _FusedNorm | None:
    """The buffers of a fused add + norm, or None where the norm kernel runs after the block."""
    if add_norm is None or hidden.shape[1] > MAX_NORM_HIDDEN:
        return None
    residual = add_norm.residual.contiguous()
    if residual.shape != hidden.shape or residual.dtype != hidden.dtype:
        raise ValueError(
            f"add_norm.residual: expected {list(hidden.shape)} {hidden.dtype}, got "
            f"{list(residual.shape)} {residual.dtype}"
        )
    if add_norm.weight.shape != (hidden.shape[1],):
        raise ValueError(f"add_norm.weight: expected [{hidden.shape[1]}], got {list(add_norm.weight.shape)}")
    out = NormedOut(torch.empty_like(hidden), torch.empty_like(hidden))
    return _FusedNorm(AddNorm(residual, add_norm.weight, add_norm.eps), out, residual.stride(0))
