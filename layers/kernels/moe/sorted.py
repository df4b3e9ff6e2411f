"""The fused MoE's sorted path (above a handful of routed pairs): the pairs grouped per local
expert (align.py), the gate/up grouped GEMM writing silu(gate) * up per pair, the down grouped GEMM
writing weight * down(act) per pair, and a kernel summing each token's top-k slots (with the
shared expert's gated output and the next norm when asked). The shared expert: its activation
kernel and a cuBLAS down projection (bf16 on CUDA: on a side stream beside the routed work), its
gate and sum inside the sum kernel (three launches, not six)."""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from .. import linear as linear_kernels
from ..device import SMEM_SCRATCH, DeviceInfo, device_info, side_stream
from ..fp8 import ACT_GROUP, quantize_act, scale_block
from ..norm.triton_norm import add_rms_norm_row
from ..pdl import pdl_launch, pdl_wait
from .activation import silu_mul
from .align import align_pairs
from .fused_norm import norm_kernel_args
from .grouped import grouped_gemms
from .naive import SharedExpert, fp8_dots_fit, shared_fp8_gemm
from .pairs import low_rank_args

_NO_KEY = tl.constexpr(2147483647)  # past every key: a row without a low-rank addition, or one already added


@triton.jit
def _block_low_rank(
    keys, v, b, s_v, s_bg, s_bn, pair, row_ok, n, n_ok, V_OFFSET: tl.constexpr, R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """[BLOCK_M, BLOCK_N] float32: row m's b[key, n] . v[pair[m], V_OFFSET : V_OFFSET + R] for the
    block's pairs (low_rank.PairLowRank), zero for rows without a key: one [BLOCK_M, R] x [R, BLOCK_N]
    dot per distinct key of the block (a block holds one expert, so its keys are its rows' slots;
    each key's B rows are read once). v is rounded to b's dtype for the dot, as lora's expand."""
    key = tl.load(keys + pair, mask=row_ok, other=-1)
    rest = tl.where(key >= 0, key, _NO_KEY)
    r = tl.arange(0, R)
    v_ptr = v + pair.to(tl.int64)[:, None] * s_v + V_OFFSET + r[None, :]
    b_ptr = b + n[None, :].to(tl.int64) * s_bn + r[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k = tl.min(rest, 0)
    while k < _NO_KEY:
        mine = rest == k
        bt = tl.load(b_ptr + k.to(tl.int64) * s_bg, mask=n_ok[None, :], other=0.0)
        vt = tl.load(v_ptr, mask=mine[:, None], other=0.0).to(bt.dtype)
        acc = tl.dot(vt, bt, acc)
        rest = tl.where(mine, _NO_KEY, rest)
        k = tl.min(rest, 0)
    return acc


@triton.jit
def _block_ids(N_MAJOR: tl.constexpr):
    """(row block, N block) of this program: the grid is (N blocks, row blocks) when N_MAJOR."""
    if N_MAJOR:
        pid_m = tl.program_id(1)
        pid_n = tl.program_id(0)
    else:
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
    return pid_m, pid_n


# a grid's second dimension holds at most this many programs (CUDA)
MAX_GRID_Y = 65535


def _grid(
    row_blocks: int, n_blocks: int, n_major: bool, per_sm: int = 0, num_sms: int = 1
) -> tuple[tuple[int, ...], bool]:
    """The launch grid and whether it is N-major (not when the row blocks outnumber a grid's y);
    per_sm > 0: persistent programs, per_sm a multiprocessor and at most one a tile (N-major)."""
    if per_sm > 0:
        return (min(row_blocks * n_blocks, per_sm * num_sms),), True
    n_major = n_major and row_blocks <= MAX_GRID_Y
    return ((n_blocks, row_blocks) if n_major else (row_blocks, n_blocks)), n_major


# values that change from pass to pass: one compile serves them all (kernels/__init__.py)
@triton.jit(do_not_specialize=["num_pairs"])
def _up_kernel(
    hidden, w13, w_desc, act, sorted_ids, block_expert, num_padded, num_pairs, s_ht, s_we, s_wn, s_at, x_scale, s_xs,
    w_scale, s_se, s_sn, lora_keys, lora_v, lora_b, s_lv, s_lg, s_ln, HIDDEN: tl.constexpr, INTER: tl.constexpr,
    TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr,
    SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, GROUP: tl.constexpr, LORA_RANK: tl.constexpr, USE_PDL: tl.constexpr,
    QUANT_ACT: tl.constexpr, N_MAJOR: tl.constexpr, W_DESC: tl.constexpr, PERSISTENT: tl.constexpr,
    FLATTEN: tl.constexpr, ACT_SORTED: tl.constexpr,
):  # fmt: skip
    """act[pair, n] = silu(x @ gate^T) * (x @ up^T) for one block of pairs of one expert and one
    BLOCK_N slice of the expert width; gate and up rows are the two halves of w13[e].
    FP8: hidden is x quantized per row and GROUP columns (scales x_scale, row stride s_xs), w13
    float8 with block scales w_scale [E, rows / SCALE_N, HIDDEN / SCALE_K]; each K step (one
    scale group of both, BLOCK_K <= min(GROUP, SCALE_K)) multiplies its FP8 dot by the two. FP8
    without QUANT_ACT: hidden is x as it is, each K step's weight tiles converted to its dtype for
    the dot (W8A16), the dot times the weights' scales.
    LORA_RANK > 0: the pair's low-rank delta (low_rank.PairLowRank: lora_keys, lora_v rows of stride
    s_lv, lora_b [G, 2 * INTER, LORA_RANK] of strides s_lg, s_ln: its adapters) joins gate and up
    before the activation (_block_low_rank: no expand launch, no delta buffer).
    N_MAJOR: the N slices of a row block are neighbouring programs (grid (N blocks, row blocks)):
    they read its gathered rows while those are still in L2. W_DESC (bf16 experts): the gate and up
    tiles through w_desc, a TMA descriptor of w13 as [E * 2 * INTER, HIDDEN] with [BLOCK_N, BLOCK_K]
    boxes (rows past an expert's INTER only feed columns the store masks; K tails read zeros).
    PERSISTENT: grid (programs,), each program taking tiles p, p + programs, ... of the row blocks'
    N slices in N-major order: no programs past the padded rows (the grid's bound is the most row
    blocks any routing needs); FLATTEN: the tile loop and the K loop as one pipelined loop, so that a
    tile's first loads are in flight while the tile before it ends (sm_90, Triton 3.6: 224 KB of
    shared memory and 255 registers at the 8k tiles, against 192 KB and 168 / 183 one program a tile).
    ACT_SORTED: act's rows in the sorted list's order (row r of row block r // BLOCK_M; padding rows
    unwritten) instead of by pair, so that the down GEMM reads whole row blocks through TMA."""
    pdl_wait(USE_PDL)
    if PERSISTENT:
        n_blocks = tl.cdiv(INTER, BLOCK_N)
        tiles = tl.cdiv(tl.load(num_padded), BLOCK_M) * n_blocks
        # FLATTEN: one loop with the tile's K loop, so the pipeline loads the next tile's first steps early
        last = tl.maximum(tiles - 1, 0)
        for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=FLATTEN):
            # a flattened pipeline may load a tile's indices ahead of the loop's bound (triton-lang/triton
            # #11601: loads hoisted above zero-trip loops): any such tile reads a real block's
            real = tl.minimum(tile, last)
            _up_tile(
                hidden, w13, w_desc, act, sorted_ids, block_expert, num_pairs, s_ht, s_we, s_wn, s_at, x_scale, s_xs,
                w_scale, s_se, s_sn, lora_keys, lora_v, lora_b, s_lv, s_lg, s_ln, real // n_blocks, real % n_blocks,
                HIDDEN, INTER, TOPK, BLOCK_M, BLOCK_N, BLOCK_K, FP8, SCALE_N, SCALE_K, GROUP, LORA_RANK, QUANT_ACT,
                W_DESC, ACT_SORTED,
            )  # fmt: skip
    else:
        pid_m, pid_n = _block_ids(N_MAJOR)
        if pid_m * BLOCK_M < tl.load(num_padded):
            _up_tile(
                hidden, w13, w_desc, act, sorted_ids, block_expert, num_pairs, s_ht, s_we, s_wn, s_at, x_scale, s_xs,
                w_scale, s_se, s_sn, lora_keys, lora_v, lora_b, s_lv, s_lg, s_ln, pid_m, pid_n, HIDDEN, INTER, TOPK,
                BLOCK_M, BLOCK_N, BLOCK_K, FP8, SCALE_N, SCALE_K, GROUP, LORA_RANK, QUANT_ACT, W_DESC, ACT_SORTED,
            )  # fmt: skip


@triton.jit
def _up_tile(
    hidden, w13, w_desc, act, sorted_ids, block_expert, num_pairs, s_ht, s_we, s_wn, s_at, x_scale, s_xs, w_scale,
    s_se, s_sn, lora_keys, lora_v, lora_b, s_lv, s_lg, s_ln, pid_m, pid_n, HIDDEN: tl.constexpr, INTER: tl.constexpr,
    TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr,
    SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, GROUP: tl.constexpr, LORA_RANK: tl.constexpr,
    QUANT_ACT: tl.constexpr, W_DESC: tl.constexpr, ACT_SORTED: tl.constexpr,
):  # fmt: skip
    """_up_kernel's tile (row block pid_m, N slice pid_n)."""
    rows = tl.arange(0, BLOCK_M)
    e = tl.maximum(tl.load(block_expert + pid_m), 0)  # >= 0 on every real block; guards speculated ones
    pair = tl.load(sorted_ids + pid_m * BLOCK_M + rows)
    row_ok = (pair >= 0) & (pair < num_pairs)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < INTER
    k = tl.arange(0, BLOCK_K)
    token = (pair // TOPK).to(tl.int64)
    a_ptr = hidden + token[:, None] * s_ht + k[None, :]
    g_ptr = w13 + e.to(tl.int64) * s_we + n[None, :] * s_wn + k[:, None]
    u_ptr = g_ptr + INTER * s_wn
    n_sc = tl.minimum(n, INTER - 1)
    xs_ptr = x_scale + tl.where(row_ok, token, 0) * s_xs
    gs_ptr = w_scale + e.to(tl.int64) * s_se + (n_sc // SCALE_N) * s_sn
    us_ptr = w_scale + e.to(tl.int64) * s_se + ((n_sc + INTER) // SCALE_N) * s_sn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    w_row = e * (2 * INTER) + pid_n * BLOCK_N
    for k0 in range(0, HIDDEN, BLOCK_K):
        k_ok = k0 + k < HIDDEN
        if HIDDEN % BLOCK_K == 0:
            a = tl.load(a_ptr, mask=row_ok[:, None], other=0.0)
        else:
            a = tl.load(a_ptr, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if W_DESC:
            g = w_desc.load([w_row, k0]).T
            u = w_desc.load([w_row + INTER, k0]).T
        elif HIDDEN % BLOCK_K == 0:
            g = tl.load(g_ptr, mask=n_ok[None, :], other=0.0)
            u = tl.load(u_ptr, mask=n_ok[None, :], other=0.0)
        else:
            g = tl.load(g_ptr, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            u = tl.load(u_ptr, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        if FP8 and QUANT_ACT:
            xs = tl.load(xs_ptr + k0 // GROUP)[:, None]
            acc_g += tl.dot(a, g) * xs * tl.load(gs_ptr + k0 // SCALE_K)[None, :]
            acc_u += tl.dot(a, u) * xs * tl.load(us_ptr + k0 // SCALE_K)[None, :]
        elif FP8:
            acc_g += _converted_dot(a, g) * tl.load(gs_ptr + k0 // SCALE_K)[None, :]
            acc_u += _converted_dot(a, u) * tl.load(us_ptr + k0 // SCALE_K)[None, :]
        else:
            acc_g = tl.dot(a, g, acc_g)
            acc_u = tl.dot(a, u, acc_u)
        a_ptr += BLOCK_K
        g_ptr += BLOCK_K
        u_ptr += BLOCK_K
    if LORA_RANK > 0:
        low = (lora_keys, lora_v, lora_b, s_lv, s_lg, s_ln, pair, row_ok)
        acc_g += _block_low_rank(*low, n, n_ok, 0, LORA_RANK, BLOCK_M, BLOCK_N)
        acc_u += _block_low_rank(*low, n + INTER, n_ok, LORA_RANK, LORA_RANK, BLOCK_M, BLOCK_N)
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    out_row = (pid_m * BLOCK_M + rows).to(tl.int64) if ACT_SORTED else pair.to(tl.int64)
    dst = act + out_row[:, None] * s_at + n[None, :]
    tl.store(dst, h.to(act.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


# values that change from pass to pass: one compile serves them all (kernels/__init__.py)
@triton.jit(do_not_specialize=["num_pairs"])
def _down_kernel(
    act, w2, w_desc, y, topk_weights, sorted_ids, block_expert, num_padded, num_pairs, s_at, s_we, s_wn, s_yp,
    act_scale, s_as, w_scale, s_se, s_sn, lora_keys, lora_v, lora_b, s_lv, s_lg, s_ln, HIDDEN: tl.constexpr,
    INTER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr,
    SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, GROUP: tl.constexpr, LORA_RANK: tl.constexpr, USE_PDL: tl.constexpr,
    QUANT_ACT: tl.constexpr, N_MAJOR: tl.constexpr, W_DESC: tl.constexpr, PERSISTENT: tl.constexpr,
    FLATTEN: tl.constexpr, A_DESC: tl.constexpr,
):  # fmt: skip
    """y[pair, n] = weight[pair] * (act[pair] @ w2[e, n]^T (+ the pair's low-rank delta, lora_b
    [G, HIDDEN, LORA_RANK], as _up_kernel's)) for one block of sorted pairs. FP8: act quantized per
    row and GROUP columns (act_scale), w2 float8 with block scales, as _up_kernel (the delta's
    shrink read the unquantized act); without QUANT_ACT act as it is, as _up_kernel's W8A16. N_MAJOR
    and W_DESC (w2 as [E * HIDDEN, INTER]), PERSISTENT and FLATTEN as _up_kernel's. A_DESC: act is a
    TMA descriptor of the activations in sorted order (_up_kernel's ACT_SORTED; bf16, no low-rank
    addition) with [BLOCK_M, BLOCK_K] boxes: each row block read whole, no gather."""
    pdl_wait(USE_PDL)
    if PERSISTENT:
        n_blocks = tl.cdiv(HIDDEN, BLOCK_N)
        tiles = tl.cdiv(tl.load(num_padded), BLOCK_M) * n_blocks
        # FLATTEN: one loop with the tile's K loop, so the pipeline loads the next tile's first steps early
        last = tl.maximum(tiles - 1, 0)
        for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=FLATTEN):
            # a flattened pipeline may load a tile's indices ahead of the loop's bound (triton-lang/triton
            # #11601: loads hoisted above zero-trip loops): any such tile reads a real block's
            real = tl.minimum(tile, last)
            _down_tile(
                act, w2, w_desc, y, topk_weights, sorted_ids, block_expert, num_pairs, s_at, s_we, s_wn, s_yp,
                act_scale, s_as, w_scale, s_se, s_sn, lora_keys, lora_v, lora_b, s_lv, s_lg, s_ln, real // n_blocks,
                real % n_blocks, HIDDEN, INTER, BLOCK_M, BLOCK_N, BLOCK_K, FP8, SCALE_N, SCALE_K, GROUP, LORA_RANK,
                QUANT_ACT, W_DESC, A_DESC,
            )  # fmt: skip
    else:
        pid_m, pid_n = _block_ids(N_MAJOR)
        if pid_m * BLOCK_M < tl.load(num_padded):
            _down_tile(
                act, w2, w_desc, y, topk_weights, sorted_ids, block_expert, num_pairs, s_at, s_we, s_wn, s_yp,
                act_scale, s_as, w_scale, s_se, s_sn, lora_keys, lora_v, lora_b, s_lv, s_lg, s_ln, pid_m, pid_n,
                HIDDEN, INTER, BLOCK_M, BLOCK_N, BLOCK_K, FP8, SCALE_N, SCALE_K, GROUP, LORA_RANK, QUANT_ACT, W_DESC,
                A_DESC,
            )  # fmt: skip


@triton.jit
def _down_tile(
    act, w2, w_desc, y, topk_weights, sorted_ids, block_expert, num_pairs, s_at, s_we, s_wn, s_yp, act_scale, s_as,
    w_scale, s_se, s_sn, lora_keys, lora_v, lora_b, s_lv, s_lg, s_ln, pid_m, pid_n, HIDDEN: tl.constexpr,
    INTER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr,
    SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, GROUP: tl.constexpr, LORA_RANK: tl.constexpr,
    QUANT_ACT: tl.constexpr, W_DESC: tl.constexpr, A_DESC: tl.constexpr,
):  # fmt: skip
    """_down_kernel's tile (row block pid_m, N slice pid_n)."""
    e = tl.maximum(tl.load(block_expert + pid_m), 0)  # as _up_tile's
    pair = tl.load(sorted_ids + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = (pair >= 0) & (pair < num_pairs)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < HIDDEN
    k = tl.arange(0, BLOCK_K)
    if not A_DESC:
        a_ptr = act + pair.to(tl.int64)[:, None] * s_at + k[None, :]
    b_ptr = w2 + e.to(tl.int64) * s_we + n[None, :] * s_wn + k[:, None]
    as_ptr = act_scale + tl.where(row_ok, pair, 0).to(tl.int64) * s_as
    bs_ptr = w_scale + e.to(tl.int64) * s_se + (tl.minimum(n, HIDDEN - 1) // SCALE_N) * s_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    w_row = e * HIDDEN + pid_n * BLOCK_N
    for k0 in range(0, INTER, BLOCK_K):
        k_ok = k0 + k < INTER
        if A_DESC:  # the row block whole (its padding rows feed only rows the store masks)
            a = act.load([pid_m * BLOCK_M, k0])
        elif INTER % BLOCK_K == 0:
            a = tl.load(a_ptr, mask=row_ok[:, None], other=0.0)
        else:
            a = tl.load(a_ptr, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if W_DESC:
            b = w_desc.load([w_row, k0]).T
        elif INTER % BLOCK_K == 0:
            b = tl.load(b_ptr, mask=n_ok[None, :], other=0.0)
        else:
            b = tl.load(b_ptr, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        if FP8 and QUANT_ACT:
            scale = tl.load(as_ptr + k0 // GROUP)[:, None] * tl.load(bs_ptr + k0 // SCALE_K)[None, :]
            acc += tl.dot(a, b) * scale
        elif FP8:
            acc += _converted_dot(a, b) * tl.load(bs_ptr + k0 // SCALE_K)[None, :]
        else:
            acc = tl.dot(a, b, acc)
        if not A_DESC:
            a_ptr += BLOCK_K
        b_ptr += BLOCK_K
    if LORA_RANK > 0:
        low = (lora_keys, lora_v, lora_b, s_lv, s_lg, s_ln, pair, row_ok)
        acc += _block_low_rank(*low, n, n_ok, 0, LORA_RANK, BLOCK_M, BLOCK_N)
    acc *= tl.load(topk_weights + pair, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    dst = y + pair.to(tl.int64)[:, None] * s_yp + n[None, :]
    tl.store(dst, acc.to(y.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _sum_kernel(
    y, topk_ids, out, shared, gate_logit, expert_offset, num_experts, s_yp, s_ot, s_st, s_gl, residual, norm_weight,
    normed_out, res_out, s_rt, eps, lora_keys, lora_v, lora_b, s_lv, s_lg, s_ln, y_row, topk_weights,
    HIDDEN: tl.constexpr, TOPK: tl.constexpr, BLOCK: tl.constexpr, HAS_SHARED: tl.constexpr, ADD_NORM: tl.constexpr,
    LORA_RANK: tl.constexpr, USE_PDL: tl.constexpr, BY_ROW: tl.constexpr,
):  # fmt: skip
    """out[t] = sum of its local slots' rows of y (non-local slots were never written); BY_ROW (the
    grouped GEMMs' unweighted output in expert order): slot p's row is y_row[p], times topk_weights[p]; plus
    sigmoid(gate_logit[t]) * shared[t] (the shared expert's down projection) when HAS_SHARED; one
    rounding. ADD_NORM (BLOCK covers the row): the next norm of the row instead, res_out[t] =
    out[t] + residual[t] and normed_out[t] = its zero-centred RMSNorm (rows of stride s_rt).
    Everything loads after the PDL wait (kernels/pdl.py): the kernel before it on its stream is the
    routed down GEMM when the shared expert's projection runs on a side stream (joined by an event),
    else that projection's last kernel.
    LORA_RANK > 0 (with HAS_SHARED): the shared expert's low-rank delta (SharedExpert.lora:
    lora_keys [T], lora_v rows of stride s_lv, lora_b [S, HIDDEN, LORA_RANK] of strides s_lg, s_ln)
    joins its output under the gate, one rank column at a time (the row stays BLOCK wide in
    registers for the norm)."""
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    pdl_wait(USE_PDL)
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(TOPK):
        pair = t * TOPK + j
        e = tl.load(topk_ids + pair).to(tl.int32) - expert_offset
        local = (e >= 0) & (e < num_experts)
        h_ok = h < tl.where(local, HIDDEN, 0)
        if BY_ROW:
            row = tl.load(y_row + pair, mask=local, other=0).to(tl.int64)
            weight = tl.load(topk_weights + pair).to(tl.float32)
            acc += weight * tl.load(y + row * s_yp + h, mask=h_ok, other=0.0).to(tl.float32)
        else:
            acc += tl.load(y + pair.to(tl.int64) * s_yp + h, mask=h_ok, other=0.0).to(tl.float32)
    if HAS_SHARED:
        scale = tl.sigmoid(tl.load(gate_logit + t.to(tl.int64) * s_gl).to(tl.float32))
        shared_row = tl.load(shared + t.to(tl.int64) * s_st + h, mask=h < HIDDEN, other=0.0).to(tl.float32)
        if LORA_RANK > 0:
            key = tl.load(lora_keys + t)
            b_row = lora_b + tl.maximum(key, 0).to(tl.int64) * s_lg + h.to(tl.int64) * s_ln
            b_ok = h < tl.where(key >= 0, HIDDEN, 0)  # an empty range, not a scalar mask (the interpreter)
            for j in tl.static_range(LORA_RANK):
                vj = tl.load(lora_v + t.to(tl.int64) * s_lv + j)
                vj = tl.where(key >= 0, vj, 0.0)  # a row without an adapter has no v (unset)
                shared_row += vj * tl.load(b_row + j, mask=b_ok, other=0.0).to(tl.float32)
        acc += scale * shared_row
    if ADD_NORM:
        row = t.to(tl.int64) * s_rt
        xv = acc.to(out.dtype.element_ty).to(tl.float32)
        add_rms_norm_row(xv, residual + row, res_out + row, normed_out + row, norm_weight, eps, h, h < HIDDEN, HIDDEN)
    else:
        tl.store(out + t.to(tl.int64) * s_ot + h, acc.to(out.dtype.element_ty), mask=h < HIDDEN)


@triton.jit
def _converted_dot(a, w):
    """a @ w.to(a.dtype) (W8A16: FP8 weights converted for a dot in the activations' dtype); float32
    activations take IEEE dots (tf32's rounding is not float32's)."""
    if a.dtype == tl.float32:
        return tl.dot(a, w.to(a.dtype), input_precision="ieee")
    return tl.dot(a, w.to(a.dtype))


def moe_sorted(
    hidden, w13, w2, topk_weights, topk_ids, expert_offset, out, cfg, shared, norm, pdl, scales=(None, None),
    deltas=None, quantize_acts=True, grouped=False, shared_stream=True,
) -> None:  # fmt: skip
    """The sorted path into `out` (or, with norm, into norm.out): group, up GEMM, down GEMM, sum.
    scales: (w13_scale, w2_scale) of FP8 experts: x and act are quantized per 1 x 128 group for
    the FP8 dots (one launch each; quantize_acts False, or scale blocks too narrow for an FP8 dot
    (naive.fp8_dots_fit): neither is, the kernels convert the weights for dots in the activations'
    dtype). deltas (PairDeltas): added to each pair's gate / up and down projections (adapters) in
    their low-rank form, expanded inside the two GEMMs (in full precision beside the FP8 dots; their
    two shrinks are the only launches they add). grouped: the two GEMMs are torch's grouped GEMM
    (grouped.py: bf16 experts, no deltas; cfg unused), the same sum kernel after. shared_stream: the
    shared expert on a side stream (_start_shared)."""
    started = _start_shared(shared, quantize_acts) if shared_stream else None
    if grouped:
        y, y_row = grouped_gemms(hidden=hidden, w13=w13, w2=w2, topk_ids=topk_ids, expert_offset=expert_offset, pdl=pdl)
        _sum(hidden, y, topk_ids, expert_offset, w13.shape[0], out, shared, started, norm, pdl, (y_row, topk_weights))
        return
    num_tokens, hidden_size = hidden.shape
    num_experts, inter = w13.shape[0], w2.shape[2]
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    block_m = cfg["block_m"]
    sorted_ids, block_expert, offsets = align_pairs(
        topk_ids=topk_ids, num_experts=num_experts, expert_offset=expert_offset, block_m=block_m, pdl=pdl
    )
    num_padded = offsets[num_experts:]
    max_blocks = block_expert.shape[0]
    up, down = cfg["up"], cfg["down"]
    w13_scale, w2_scale = scales
    fp8 = w13_scale is not None
    # a_tma (bf16 experts, no deltas): act in the sorted order, a row a sorted position, so that the
    # down GEMM reads whole row blocks through TMA
    a_tma = cfg.get("a_tma", False) and not fp8 and deltas is None and (inter * hidden.element_size()) % 16 == 0
    act_rows = max_blocks * block_m if a_tma else num_pairs
    act = torch.empty((act_rows, inter), dtype=hidden.dtype, device=hidden.device)
    y = torch.empty((num_pairs, hidden_size), dtype=hidden.dtype, device=hidden.device)
    up_sc = _scale_args(w13_scale, w13, hidden)
    down_sc = _scale_args(w2_scale, w2, hidden)
    quant = fp8 and quantize_acts and fp8_dots_fit(w13, w13_scale, w2, w2_scale)
    x, x_scale = quantize_act(x=hidden, group=ACT_GROUP, pdl=pdl) if quant else (hidden, hidden)
    up_k = min(up["block_k"], up_sc[3], ACT_GROUP) if fp8 else up["block_k"]
    up_lora = low_rank_args(None if deltas is None else deltas.low_rank_gate_up(topk_ids), act)
    tma = cfg.get("w_tma", False) and not fp8 and _tma_ok(w13) and _tma_ok(w2)
    persistent = cfg.get("persistent", "") if deltas is None else ""  # no low-rank loop inside the tile loop
    info = device_info(hidden.device)
    per_sm = _programs_per_sm(persistent, up, block_m, 2, x.element_size(), w13.element_size(), info)
    grid, n_major = _grid(
        max_blocks, triton.cdiv(inter, up["block_n"]), cfg.get("n_major", False), per_sm, info.num_sms
    )
    up_desc = _weight_desc(w13, up["block_n"], up["block_k"]) if tma else w13
    _up_kernel[grid](
        x, w13, up_desc, act, sorted_ids, block_expert, num_padded, num_pairs, x.stride(0), w13.stride(0),
        w13.stride(1), act.stride(0), x_scale, x_scale.stride(0), *up_sc[:3], *up_lora[:6], HIDDEN=hidden_size,
        INTER=inter, TOPK=top_k, BLOCK_M=block_m, BLOCK_N=up["block_n"], BLOCK_K=up_k, FP8=fp8, SCALE_N=up_sc[4],
        SCALE_K=up_sc[3], GROUP=ACT_GROUP, LORA_RANK=up_lora[6], QUANT_ACT=quant, N_MAJOR=n_major, W_DESC=tma,
        PERSISTENT=per_sm > 0, FLATTEN=persistent == "flat", ACT_SORTED=a_tma,
        num_warps=up["num_warps"], num_stages=up["num_stages"], **pdl_launch(hidden, pdl),
    )  # fmt: skip
    down_lora = low_rank_args(None if deltas is None else deltas.low_rank_down(act), act)
    a, a_scale = quantize_act(x=act, group=ACT_GROUP, pdl=pdl) if quant else (act, act)
    down_k = min(down["block_k"], down_sc[3], ACT_GROUP) if fp8 else down["block_k"]
    per_sm = _programs_per_sm(persistent, down, block_m, 1, a.element_size(), w2.element_size(), info)
    grid, n_major = _grid(
        max_blocks, triton.cdiv(hidden_size, down["block_n"]), cfg.get("n_major", False), per_sm, info.num_sms
    )
    down_desc = _weight_desc(w2, down["block_n"], down_k) if tma else w2
    a_in = _row_desc(a, block_m, down_k) if a_tma else a
    _down_kernel[grid](
        a_in, w2, down_desc, y, topk_weights, sorted_ids, block_expert, num_padded, num_pairs, a.stride(0),
        w2.stride(0), w2.stride(1), y.stride(0), a_scale, a_scale.stride(0), *down_sc[:3], *down_lora[:6],
        HIDDEN=hidden_size, INTER=inter, BLOCK_M=block_m, BLOCK_N=down["block_n"], BLOCK_K=down_k, FP8=fp8,
        SCALE_N=down_sc[4], SCALE_K=down_sc[3], GROUP=ACT_GROUP, LORA_RANK=down_lora[6], QUANT_ACT=quant,
        N_MAJOR=n_major, W_DESC=tma, PERSISTENT=per_sm > 0, FLATTEN=persistent == "flat", A_DESC=a_tma,
        num_warps=down["num_warps"], num_stages=down["num_stages"],
        **pdl_launch(act, pdl),
    )  # fmt: skip
    _sum(hidden, y, topk_ids, expert_offset, num_experts, out, shared, started, norm, pdl, quantize_acts=quantize_acts)


@dataclasses.dataclass(frozen=True)
class _SharedOut:
    """The shared expert's down projection [T, H] in flight on the side stream: done, the event recorded
    there after it, which the sum kernel's stream waits on."""

    out: torch.Tensor
    done: torch.cuda.Event


def _shared_down(shared: SharedExpert, pdl: bool, quantize_acts: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """The shared expert's activation and down projection (cuBLAS, into `out` when given; FP8: linear).
    quantize_acts False: the FP8 down projection leaves its activation unquantized too."""
    shared_act = silu_mul(shared.gate_up, shared.w2.shape[1], pdl)
    if shared.w2_scale is None:  # one form on either stream: the same cuBLAS call, the same bits
        return torch.mm(shared_act, shared.w2.t(), out=_shared_out(shared) if out is None else out)
    return linear_kernels.linear(
        x=shared_act, weight=shared.w2, weight_scale=shared.w2_scale, pdl=pdl, fp8_gemm=shared_fp8_gemm(quantize_acts)
    )


def _shared_out(shared: SharedExpert) -> torch.Tensor:
    """The shared expert's [T, H] output, allocated on the current stream."""
    rows, hidden = shared.gate_up.shape[0], shared.w2.shape[0]
    return torch.empty((rows, hidden), dtype=shared.gate_up.dtype, device=shared.gate_up.device)


def _start_shared(shared: SharedExpert | None, quantize_acts: bool = True) -> _SharedOut | None:
    """A shared expert's activation and down projection on CUDA, which need only its gate / up rows: on
    a side stream beside the routing and the routed GEMMs, joined by the sum kernel (the same kernels on
    the same inputs, so the same bits). bf16: into a buffer allocated on the caller's stream, which
    reads it; FP8: linear's own output, allocated on the side stream (each later use of that stream
    first waits for the caller's, so its memory is reused only after the sum has read it). Its side
    launches take no programmatic dependent launch (their predecessor is on another stream). None
    off CUDA: the sum runs the projection in turn."""
    if shared is None or shared.gate_up.device.type != "cuda":
        return None
    device = shared.gate_up.device
    out = _shared_out(shared) if shared.w2_scale is None else None
    main = torch.cuda.current_stream(device)
    side = side_stream(device, "moe_shared")
    side.wait_stream(main)  # its gate / up rows, and the sum that read the last output
    with torch.cuda.stream(side):
        out = _shared_down(shared, False, quantize_acts, out)
        done = side.record_event()
    return _SharedOut(out, done)


def _sum(
    hidden, y, topk_ids, expert_offset, num_experts, out, shared, started, norm, pdl, by_row=None, quantize_acts=True
) -> None:  # fmt: skip
    """Each token's local slots of y summed (by_row: (y_row, topk_weights), the grouped GEMMs' rows
    and the weights they leave out), the shared expert (started: its down projection from
    _start_shared, else run here) and the next norm when asked: into out / norm."""
    num_tokens, hidden_size = hidden.shape
    top_k = topk_ids.shape[1]
    shared_out = gate_logit = None
    if shared is not None:  # the gate and the sum in the sum kernel
        if started is None:
            shared_out = _shared_down(shared, pdl, quantize_acts)
        else:
            torch.cuda.current_stream(hidden.device).wait_event(started.done)
            shared_out = started.out
        gate_logit = shared.gate_logit
    # with the norm a program takes a whole row (a norm needs all of it); the shared expert's adapter
    # (a rank column at a time over the row) spills at 4 warps (ptxas, sm_90: 528 bytes)
    block_h = (
        triton.next_power_of_2(hidden_size) if norm is not None else min(1024, triton.next_power_of_2(hidden_size))
    )
    norm_args = norm_kernel_args(norm, out)
    shared_lora = low_rank_args(None if shared is None else shared.lora, out)
    _sum_kernel[(num_tokens, triton.cdiv(hidden_size, block_h))](
        y, topk_ids, out, out if shared_out is None else shared_out, out if gate_logit is None else gate_logit,
        expert_offset, num_experts, y.stride(0), out.stride(0), 0 if shared_out is None else shared_out.stride(0),
        0 if gate_logit is None else gate_logit.stride(0), *norm_args, *shared_lora[:6],
        *(by_row or (topk_ids, topk_ids)), HIDDEN=hidden_size, TOPK=top_k, BLOCK=block_h,
        HAS_SHARED=shared is not None, ADD_NORM=norm is not None, LORA_RANK=shared_lora[6],
        BY_ROW=by_row is not None, num_warps=8 if shared_lora[6] else 4, **pdl_launch(y, pdl),
    )  # fmt: skip


# persistent programs a multiprocessor: at most this many, as many as their pipelines' shared memory allows
MAX_PROGRAMS_PER_SM = 4
SM_SHARED_MEMORY = 228 * 1024  # sm_90: a multiprocessor's, of which one program may take 227 KB


def _programs_per_sm(
    persistent: str, tiles: dict, block_m: int, operands: int, a_elem: int, w_elem: int, info: DeviceInfo
) -> int:
    """0 (one program a tile) unless `persistent`; else how many programs of these tiles (`operands`
    weight tiles a K step: gate and up, or down) fit a multiprocessor's shared memory."""
    if not persistent:
        return 0
    per_stage = tiles["block_k"] * (a_elem * block_m + operands * w_elem * tiles["block_n"])
    need = tiles["num_stages"] * per_stage + SMEM_SCRATCH
    return max(1, min(MAX_PROGRAMS_PER_SM, SM_SHARED_MEMORY // need))


def _tma_ok(w: torch.Tensor) -> bool:
    """Whether experts' weights [E, R, C] can be read through a TMA descriptor: contiguous, rows and
    base on 16 bytes."""
    return w.is_contiguous() and (w.shape[-1] * w.element_size()) % 16 == 0 and w.data_ptr() % 16 == 0


def _weight_desc(w: torch.Tensor, block_n: int, block_k: int):
    """Experts' weights [E, R, C] as a TMA descriptor of [E * R, C] with [block_n, block_k] boxes."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(w.view(-1, w.shape[-1]), [block_n, block_k])


def _row_desc(a: torch.Tensor, block_m: int, block_k: int):
    """Activations [R, C] (rows in sorted order) as a TMA descriptor with [block_m, block_k] boxes."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(a, [block_m, block_k])


def _scale_args(scale: torch.Tensor | None, weight: torch.Tensor, dummy: torch.Tensor) -> tuple:
    """(scale, expert stride, row-block stride, SCALE_K, SCALE_N) of FP8 experts' [E, ., .] block
    scales; placeholders (SCALE_K large enough not to bound BLOCK_K) without."""
    if scale is None:
        return dummy, 0, 0, 1 << 30, 1
    bn, bk = scale_block(*weight.shape[-2:], tuple(scale.shape[-2:]))
    return scale, scale.stride(0), scale.stride(1), bk, bn
