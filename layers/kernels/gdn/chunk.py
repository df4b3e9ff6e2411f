"""Chunked gated delta rule (varlen prefill) in Triton; same contract as naive.chunk_gated_delta_rule.

Per sequence, tokens are cut into chunks of BT = 64. With gamma the in-chunk cumulative sum of g,
A = strictly-lower(beta_i * k_i.k_j * exp(gamma_i - gamma_j)) (l2-normalised keys) and
Y = (I + A)^-1 (the WY / UT transform of the chunk):

1. `_solve_kernel`, one 1-warp program per (chunk, value head): cumsum of g and the key norms
   (both stored), A in 16 x 16 blocks from raw k k^T, the four diagonal blocks of Y by forward
   substitution, the six below them by block merges; Y stored in the input dtype.
2. `_intra_kernel`, per (chunk, value head), whole-chunk matmuls: w = Y (beta exp(gamma) k),
   u = Y (beta v), and what the sequential kernel of the chosen design needs besides.
3. The sequential part, one program per (sequence, value head, V-block) walking the sequence's
   chunks with the float32 state S in registers; it reads the initial state from the pool slot and
   writes the final one back. Two designs (ChunkVariant.split):
   - fused, `_state_kernel`: per chunk v_new = u - w S, o = qscale (q S) + scores v_new,
     S = exp(gamma_last) S + kd^T v_new, with kd = k exp(gamma_last - gamma) and the masked, decayed
     q k^T (scores) and the q factor (qscale) from the intra kernel. Four dependent matmuls a chunk.
   - split, `_recur_kernel` then `_output_kernel`: the sequential kernel keeps only the recurrence
     (v_new = u - w S stored over u, S = exp(gamma_last) S + k^T (kscale v_new), two matmuls a
     chunk) and stores the state entering each chunk (h, input dtype); the output kernel, parallel
     over (chunk, value head), computes o = qscale (q h) + scores v_new.
   Each chunk's tiles are software-pipelined (num_stages); the small per-chunk vectors are fetched
   a chunk ahead by hand, since the pipeliner leaves them as plain loads in the middle of the chain.

Matmuls take the inputs' dtype (bf16) with float32 accumulation; the 16 x 16 solve merges run in
tf32. Varlen chunks are located inside the kernels (varlen.py), so there is no host sync unless
chunk_states_out is asked for. VARIANTS names the configurations that bench/kernels_gdn.py times;
pick_variant chooses one when the caller names none. NOTES.md has the resources and predictions.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from ..device import num_sms
from .state import StateCaptures, plan_captures
from .varlen import chunks_before, locate_chunk

H200_SMS = 132  # interpreter runs pick the blocks the H200 would

CHUNK = 64  # tokens per chunk (BT)
SUB = 16  # rows per block of the triangular solve (BC); CHUNK == 4 * SUB
BLOCK_N = 64  # sequences scanned per step when locating chunks


@triton.jit
def _load_block(ptr, rows, row_mask, stride_t, cols, col_mask):
    return tl.load(
        ptr + rows[:, None] * stride_t + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0
    )


@triton.jit
def _gate_block(a, row_scale, col_scale, gc_row, gc_col, DIAGONAL: tl.constexpr):
    """row_scale_i * col_scale_j * exp(gamma_i - gamma_j) * a_ij, strictly lower on diagonal blocks."""
    diff = gc_row[:, None] - gc_col[None, :]
    if DIAGONAL:
        o = tl.arange(0, a.shape[0])
        diff = tl.where(o[:, None] > o[None, :], diff, float("-inf"))
    return a * tl.exp(diff) * row_scale[:, None] * col_scale[None, :]


@triton.jit
def _substitute_row(x, sel, a):
    """One forward-substitution step: row `sel` of X = (I + L)^-1 - I from a = -L[i, :] (zero from
    column i on) and the rows above it, already final."""
    return tl.where(sel, (a + tl.sum(a[:, None] * x, 0))[None, :], x)


# values that change from pass to pass: one compile serves them all (kernels/__init__.py)
@triton.jit(do_not_specialize=["num_seqs", "cu_seqlens"])
def _solve_kernel(
    k,
    g,
    beta,
    cu_seqlens,
    gcum,
    rnorm,
    a_scratch,
    y,
    num_seqs,
    stride_kt,
    stride_kh,
    stride_gt,
    stride_gh,
    stride_bt,
    stride_bh,
    HV: tl.constexpr,
    GROUP: tl.constexpr,
    K: tl.constexpr,
    BKP: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    BLOCK_N: tl.constexpr,
    L2NORM: tl.constexpr,
    PRECISION: tl.constexpr,
):
    i_c = tl.program_id(0)
    hv = tl.program_id(1)
    n, c = locate_chunk(cu_seqlens, num_seqs, i_c, BT, BLOCK_N)
    if n >= num_seqs:
        return
    t0 = tl.load(cu_seqlens + n).to(tl.int32) + c * BT
    length = tl.load(cu_seqlens + n + 1).to(tl.int32) - t0  # tokens from the chunk start on (may exceed BT)
    t0 = t0.to(tl.int64)
    row = t0 * HV + hv  # (token, value head) index of the chunk's first row in the [T, HV, ...] buffers
    dt = y.dtype.element_ty
    p_k = k + t0 * stride_kt + (hv // GROUP) * stride_kh

    # in 16-row blocks: in-chunk cumsum of g, and A = beta k k^T decay (normalised keys)
    o_c = tl.arange(0, BC)
    m0 = o_c < length
    m1 = o_c + BC < length
    m2 = o_c + 2 * BC < length
    m3 = o_c + 3 * BC < length
    p_g = g + t0 * stride_gt + hv * stride_gh + o_c * stride_gt
    g0 = tl.load(p_g, mask=m0, other=0.0).to(tl.float32)
    g1 = tl.load(p_g + BC * stride_gt, mask=m1, other=0.0).to(tl.float32)
    g2 = tl.load(p_g + 2 * BC * stride_gt, mask=m2, other=0.0).to(tl.float32)
    g3 = tl.load(p_g + 3 * BC * stride_gt, mask=m3, other=0.0).to(tl.float32)
    gc0 = tl.cumsum(g0, 0)
    total = tl.sum(g0, 0)
    gc1 = tl.cumsum(g1, 0) + total
    total += tl.sum(g1, 0)
    gc2 = tl.cumsum(g2, 0) + total
    total += tl.sum(g2, 0)
    gc3 = tl.cumsum(g3, 0) + total
    p_gc = gcum + row + o_c * HV
    tl.store(p_gc, gc0, mask=m0)
    tl.store(p_gc + BC * HV, gc1, mask=m1)
    tl.store(p_gc + 2 * BC * HV, gc2, mask=m2)
    tl.store(p_gc + 3 * BC * HV, gc3, mask=m3)
    p_b = beta + t0 * stride_bt + hv * stride_bh + o_c * stride_bt
    b0 = tl.load(p_b, mask=m0, other=0.0).to(tl.float32)
    b1 = tl.load(p_b + BC * stride_bt, mask=m1, other=0.0).to(tl.float32)
    b2 = tl.load(p_b + 2 * BC * stride_bt, mask=m2, other=0.0).to(tl.float32)
    b3 = tl.load(p_b + 3 * BC * stride_bt, mask=m3, other=0.0).to(tl.float32)

    # diagonal blocks of raw k k^T, over K in pieces; the l2 norms scale them afterwards. The blocks
    # below the diagonal come in a second pass, after the substitution: fewer live registers.
    a00 = tl.zeros([BC, BC], dtype=tl.float32)
    a11, a22, a33 = a00, a00, a00
    ss0 = tl.zeros([BC], dtype=tl.float32)
    ss1, ss2, ss3 = ss0, ss0, ss0
    for kp in range(0, K, BKP):
        o_k = kp + tl.arange(0, BKP)
        m_k = o_k < K
        k0 = _load_block(p_k, o_c, m0, stride_kt, o_k, m_k)
        k1 = _load_block(p_k, o_c + BC, m1, stride_kt, o_k, m_k)
        k2 = _load_block(p_k, o_c + 2 * BC, m2, stride_kt, o_k, m_k)
        k3 = _load_block(p_k, o_c + 3 * BC, m3, stride_kt, o_k, m_k)
        a00 = tl.dot(k0, tl.trans(k0), a00)
        a11 = tl.dot(k1, tl.trans(k1), a11)
        a22 = tl.dot(k2, tl.trans(k2), a22)
        a33 = tl.dot(k3, tl.trans(k3), a33)
        if L2NORM:
            ss0 += tl.sum(k0.to(tl.float32) * k0.to(tl.float32), 1)
            ss1 += tl.sum(k1.to(tl.float32) * k1.to(tl.float32), 1)
            ss2 += tl.sum(k2.to(tl.float32) * k2.to(tl.float32), 1)
            ss3 += tl.sum(k3.to(tl.float32) * k3.to(tl.float32), 1)
    if L2NORM:
        r0, r1, r2, r3 = tl.rsqrt(ss0 + 1e-6), tl.rsqrt(ss1 + 1e-6), tl.rsqrt(ss2 + 1e-6), tl.rsqrt(ss3 + 1e-6)
        p_rn = rnorm + row + o_c * HV
        tl.store(p_rn, r0, mask=m0)
        tl.store(p_rn + BC * HV, r1, mask=m1)
        tl.store(p_rn + 2 * BC * HV, r2, mask=m2)
        tl.store(p_rn + 3 * BC * HV, r3, mask=m3)
    else:
        r0 = tl.full([BC], 1.0, dtype=tl.float32)
        r1, r2, r3 = r0, r0, r0

    # Y = (I + A)^-1. Diagonal blocks by forward substitution, the four interleaved; the rows of
    # -A they consume are re-read from a scratch copy, cheaper than extracting them from registers
    x0 = -_gate_block(a00, b0 * r0, r0, gc0, gc0, True)
    x1 = -_gate_block(a11, b1 * r1, r1, gc1, gc1, True)
    x2 = -_gate_block(a22, b2 * r2, r2, gc2, gc2, True)
    x3 = -_gate_block(a33, b3 * r3, r3, gc3, gc3, True)
    p_a = a_scratch + row * BC + o_c
    tl.store(p_a[None, :] + o_c[:, None] * (HV * BC), x0, mask=m0[:, None])
    tl.store(p_a[None, :] + (o_c + BC)[:, None] * (HV * BC), x1, mask=m1[:, None])
    tl.store(p_a[None, :] + (o_c + 2 * BC)[:, None] * (HV * BC), x2, mask=m2[:, None])
    tl.store(p_a[None, :] + (o_c + 3 * BC)[:, None] * (HV * BC), x3, mask=m3[:, None])
    tl.debug_barrier()  # the rows are read back by other threads
    for i in range(2, BC):
        sel = (o_c == i)[:, None]
        r_i = o_c * 0 + i  # row i of each block, as a vector (the interpreter rejects scalar masks)
        x0 = _substitute_row(x0, sel, tl.load(p_a + i * (HV * BC), mask=r_i < length, other=0.0))
        x1 = _substitute_row(x1, sel, tl.load(p_a + (BC + i) * (HV * BC), mask=r_i + BC < length, other=0.0))
        x2 = _substitute_row(x2, sel, tl.load(p_a + (2 * BC + i) * (HV * BC), mask=r_i + 2 * BC < length, other=0.0))
        x3 = _substitute_row(x3, sel, tl.load(p_a + (3 * BC + i) * (HV * BC), mask=r_i + 3 * BC < length, other=0.0))
    eye = (o_c[:, None] == o_c[None, :]).to(tl.float32)
    y00, y11, y22, y33 = x0 + eye, x1 + eye, x2 + eye, x3 + eye

    a10 = tl.zeros([BC, BC], dtype=tl.float32)
    a20, a21, a30, a31, a32 = a10, a10, a10, a10, a10
    for kp in range(0, K, BKP):
        o_k = kp + tl.arange(0, BKP)
        m_k = o_k < K
        k0 = _load_block(p_k, o_c, m0, stride_kt, o_k, m_k)
        k1 = _load_block(p_k, o_c + BC, m1, stride_kt, o_k, m_k)
        k2 = _load_block(p_k, o_c + 2 * BC, m2, stride_kt, o_k, m_k)
        k3 = _load_block(p_k, o_c + 3 * BC, m3, stride_kt, o_k, m_k)
        a10 = tl.dot(k1, tl.trans(k0), a10)
        a20 = tl.dot(k2, tl.trans(k0), a20)
        a21 = tl.dot(k2, tl.trans(k1), a21)
        a30 = tl.dot(k3, tl.trans(k0), a30)
        a31 = tl.dot(k3, tl.trans(k1), a31)
        a32 = tl.dot(k3, tl.trans(k2), a32)
    a10 = _gate_block(a10, b1 * r1, r0, gc1, gc0, False)
    a20 = _gate_block(a20, b2 * r2, r0, gc2, gc0, False)
    a21 = _gate_block(a21, b2 * r2, r1, gc2, gc1, False)
    a30 = _gate_block(a30, b3 * r3, r0, gc3, gc0, False)
    a31 = _gate_block(a31, b3 * r3, r1, gc3, gc1, False)
    a32 = _gate_block(a32, b3 * r3, r2, gc3, gc2, False)
    # below the diagonal: Y_ij = -Y_ii sum_{j <= m < i} A_im Y_mj
    y10 = -tl.dot(y11, tl.dot(a10, y00, input_precision=PRECISION), input_precision=PRECISION)
    y21 = -tl.dot(y22, tl.dot(a21, y11, input_precision=PRECISION), input_precision=PRECISION)
    y32 = -tl.dot(y33, tl.dot(a32, y22, input_precision=PRECISION), input_precision=PRECISION)
    y20 = tl.dot(a21, y10, tl.dot(a20, y00, input_precision=PRECISION), input_precision=PRECISION)
    y20 = -tl.dot(y22, y20, input_precision=PRECISION)
    y31 = tl.dot(a32, y21, tl.dot(a31, y11, input_precision=PRECISION), input_precision=PRECISION)
    y31 = -tl.dot(y33, y31, input_precision=PRECISION)
    y30 = tl.dot(a31, y10, tl.dot(a30, y00, input_precision=PRECISION), input_precision=PRECISION)
    y30 = -tl.dot(y33, tl.dot(a32, y20, y30, input_precision=PRECISION), input_precision=PRECISION)

    # blocks above the diagonal are never written (nor read)
    p_y = y + row * BT + o_c[:, None] * (HV * BT) + o_c[None, :]
    tl.store(p_y, y00.to(dt), mask=m0[:, None])
    tl.store(p_y + BC * HV * BT, y10.to(dt), mask=m1[:, None])
    tl.store(p_y + BC * HV * BT + BC, y11.to(dt), mask=m1[:, None])
    tl.store(p_y + 2 * BC * HV * BT, y20.to(dt), mask=m2[:, None])
    tl.store(p_y + 2 * BC * HV * BT + BC, y21.to(dt), mask=m2[:, None])
    tl.store(p_y + 2 * BC * HV * BT + 2 * BC, y22.to(dt), mask=m2[:, None])
    tl.store(p_y + 3 * BC * HV * BT, y30.to(dt), mask=m3[:, None])
    tl.store(p_y + 3 * BC * HV * BT + BC, y31.to(dt), mask=m3[:, None])
    tl.store(p_y + 3 * BC * HV * BT + 2 * BC, y32.to(dt), mask=m3[:, None])
    tl.store(p_y + 3 * BC * HV * BT + 3 * BC, y33.to(dt), mask=m3[:, None])


# values that change from pass to pass: one compile serves them all (kernels/__init__.py)
@triton.jit(do_not_specialize=["num_seqs", "cu_seqlens"])
def _intra_kernel(
    q,
    k,
    v,
    beta,
    cu_seqlens,
    gcum,
    rnorm,
    y,
    w,
    u,
    kd,
    scores,
    qscale,
    num_seqs,
    scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_bh,
    HV: tl.constexpr,
    GROUP: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BKP: tl.constexpr,
    BVP: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    BLOCK_N: tl.constexpr,
    L2NORM: tl.constexpr,
    FUSED: tl.constexpr,
):
    """FUSED: w, u, kd, scores and qscale for _state_kernel. Otherwise (split): w, u and, in the
    `qscale` buffer, kscale = rnorm exp(gamma_last - gamma), the per-token factor _recur_kernel folds
    into v_new so that it can take the raw keys."""
    n, c = locate_chunk(cu_seqlens, num_seqs, tl.program_id(0), BT, BLOCK_N)
    if n >= num_seqs:
        return
    hv = tl.program_id(1)
    t0 = tl.load(cu_seqlens + n).to(tl.int32) + c * BT
    length = tl.load(cu_seqlens + n + 1).to(tl.int32) - t0
    t0 = t0.to(tl.int64)
    row = t0 * HV + hv
    dt = w.dtype.element_ty
    p_q = q + t0 * stride_qt + (hv // GROUP) * stride_qh
    p_k = k + t0 * stride_kt + (hv // GROUP) * stride_kh

    o_t = tl.arange(0, BT)
    m_t = o_t < length
    lower = (o_t[None, :] // BC) <= (o_t[:, None] // BC)
    b_y = tl.load(y + row * BT + o_t[:, None] * (HV * BT) + o_t[None, :], mask=m_t[:, None] & lower, other=0.0)
    b_gc = tl.load(gcum + row + o_t * HV, mask=m_t, other=0.0)
    b_beta = tl.load(beta + t0 * stride_bt + hv * stride_bh + o_t * stride_bt, mask=m_t, other=0.0).to(tl.float32)
    scale_k = tl.full([BT], 1.0, dtype=tl.float32)
    if L2NORM:
        scale_k = tl.load(rnorm + row + o_t * HV, mask=m_t, other=0.0)
    scale_w = scale_k * b_beta * tl.exp(b_gc)
    g_last = tl.load(gcum + row + (tl.minimum(length, BT) - 1) * HV)
    scale_kd = scale_k * tl.exp(g_last - b_gc)

    # w = Y (beta exp(gamma) k) and kd = k exp(gamma_last - gamma) piece by piece over K, with raw q k^T
    qk = tl.zeros([BT, BT], dtype=tl.float32)
    ss_q = tl.zeros([BT], dtype=tl.float32)
    for kp in range(0, K, BKP):
        o_k = kp + tl.arange(0, BKP)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        b_k = _load_block(p_k, o_t, m_t, stride_kt, o_k, m_k).to(dt)
        if FUSED:
            b_q = _load_block(p_q, o_t, m_t, stride_qt, o_k, m_k).to(dt)
            qk = tl.dot(b_q, tl.trans(b_k), qk)
            if L2NORM:
                ss_q += tl.sum(b_q.to(tl.float32) * b_q.to(tl.float32), 1)
        b_k = b_k.to(tl.float32)
        offs = row * K + o_t[:, None] * (HV * K) + o_k[None, :]
        tl.store(w + offs, tl.dot(b_y, (b_k * scale_w[:, None]).to(dt)).to(dt), mask=m_tk)
        if FUSED:
            tl.store(kd + offs, (b_k * scale_kd[:, None]).to(dt), mask=m_tk)
    # u = Y (beta v)
    p_v = v + t0 * stride_vt + hv * stride_vh
    for vp in range(0, V, BVP):
        o_v = vp + tl.arange(0, BVP)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        b_v = _load_block(p_v, o_t, m_t, stride_vt, o_v, o_v < V).to(tl.float32)
        offs = row * V + o_t[:, None] * (HV * V) + o_v[None, :]
        tl.store(u + offs, tl.dot(b_y, (b_v * b_beta[:, None]).to(dt)).to(dt), mask=m_tv)

    if FUSED:
        # the state kernel's output terms: scores = (q k^T * causal decay) with the norms and scale
        # folded in, and qscale, the factor of the q S term
        scale_q = tl.full([BT], scale, dtype=tl.float32)
        if L2NORM:
            scale_q = scale_q * tl.rsqrt(ss_q + 1e-6)
        causal = (o_t[:, None] >= o_t[None, :]) & m_t[:, None]
        decay = tl.exp(tl.where(causal, b_gc[:, None] - b_gc[None, :], float("-inf")))
        qk = qk * decay * scale_q[:, None] * scale_k[None, :]
        tl.store(scores + row * BT + o_t[:, None] * (HV * BT) + o_t[None, :], qk.to(dt), mask=m_t[:, None])
        tl.store(qscale + row + o_t * HV, scale_q * tl.exp(b_gc), mask=m_t)
    else:
        tl.store(qscale + row + o_t * HV, scale_kd, mask=m_t)


@triton.jit
def _first_chunk_decay_log(gcum, hv, bos, eos, HV: tl.constexpr, BT: tl.constexpr):
    """gamma_last of a sequence's first chunk (0 for an empty sequence), read as a masked vector so
    that an empty sequence at the end of the batch reads nothing."""
    o_t = tl.arange(0, BT)
    last = tl.minimum(eos - bos, BT) - 1
    vals = tl.load(gcum + (bos + o_t).to(tl.int64) * HV + hv, mask=o_t == last, other=0.0)
    return tl.sum(vals, 0)


# values that change from pass to pass: one compile serves them all (kernels/__init__.py)
@triton.jit(do_not_specialize=["num_seqs", "cu_seqlens", "slots", "has_initial_state"])
def _state_kernel(
    q,
    w,
    u,
    kd,
    scores,
    qscale,
    gcum,
    o,
    chunk_states,
    capture,
    pool,
    cu_seqlens,
    slots,
    has_initial_state,
    num_seqs,
    stride_qt,
    stride_qh,
    stride_ps,
    stride_ph,
    stride_pk,
    stride_pv,
    HV: tl.constexpr,
    GROUP: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    BT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STORE_CHUNK_STATES: tl.constexpr,
    PREFETCH: tl.constexpr,
    STORE_CAPTURE: tl.constexpr,
):
    """The fused sequential kernel (output inside the chunk loop). PREFETCH: the chunk's qscale and
    decay are loaded one chunk ahead (at the end of the previous iteration) instead of in the middle
    of the dot chain, where each costs a full memory latency per chunk."""
    pid = tl.program_id(0)
    NV = tl.cdiv(V, BV)
    i_v = pid % NV
    n = pid // NV // HV
    hv = pid // NV % HV
    bos = tl.load(cu_seqlens + n).to(tl.int32)
    eos = tl.load(cu_seqlens + n + 1).to(tl.int32)
    num_chunks = (eos - bos + BT - 1) // BT
    dt = w.dtype.element_ty

    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]

    slot = tl.load(slots + n).to(tl.int64)
    # no initial state: an empty row range, so the slot's old contents are never read
    k_init = tl.where(tl.load(has_initial_state + n) != 0, K, 0)
    p_pool = pool + slot * stride_ps + hv * stride_ph + o_k[:, None] * stride_pk + o_v[None, :] * stride_pv
    state = tl.load(p_pool, mask=(o_k < k_init)[:, None] & m_v[None, :], other=0.0).to(tl.float32)
    if STORE_CHUNK_STATES or STORE_CAPTURE:
        first = chunks_before(cu_seqlens, n, BT, BLOCK_N)
    if STORE_CHUNK_STATES:
        p_cs = chunk_states + (first * HV + hv).to(tl.int64) * (K * V)
        p_cs += o_k[:, None] * V + o_v[None, :]
    if PREFETCH:
        b_qs_next = tl.load(qscale + bos.to(tl.int64) * HV + hv + o_t * HV, mask=o_t < eos - bos, other=0.0)
        g_last_next = _first_chunk_decay_log(gcum, hv, bos, eos, HV, BT)

    for c in range(num_chunks):
        t0 = bos + c * BT
        m_t = o_t < eos - t0
        m_tv = m_t[:, None] & m_v[None, :]
        row = t0.to(tl.int64) * HV + hv
        b_w = tl.load(w + row * K + o_t[:, None] * (HV * K) + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        p_q = q + t0.to(tl.int64) * stride_qt + (hv // GROUP) * stride_qh + o_t[:, None] * stride_qt + o_k[None, :]
        b_q = tl.load(p_q, mask=m_t[:, None] & m_k[None, :], other=0.0).to(dt)
        p_u = u + row * V + o_t[:, None] * (HV * V) + o_v[None, :]
        b_s = state.to(dt)
        v_new = tl.load(p_u, mask=m_tv, other=0.0).to(tl.float32) - tl.dot(b_w, b_s)
        v_new = v_new.to(dt)
        # o = qscale * (q S) + scores v_new
        if PREFETCH:
            b_qs = b_qs_next
        else:
            b_qs = tl.load(qscale + row + o_t * HV, mask=m_t, other=0.0)
        out = tl.dot(b_q, b_s) * b_qs[:, None]
        b_sc = tl.load(scores + row * BT + o_t[:, None] * (HV * BT) + o_t[None, :], mask=m_t[:, None], other=0.0)
        out = tl.dot(b_sc, v_new, out)
        tl.store(o + row * V + o_t[:, None] * (HV * V) + o_v[None, :], out.to(o.dtype.element_ty), mask=m_tv)
        # S = exp(gamma_last) S + kd^T v_new, kd^T as a [BK, BT] tile
        if PREFETCH:
            decay = tl.exp(g_last_next)
        else:
            decay = tl.exp(tl.load(gcum + row + (tl.minimum(eos - t0, BT) - 1) * HV))
        b_kd = tl.load(
            kd + row * K + o_k[:, None] + o_t[None, :] * (HV * K), mask=m_k[:, None] & m_t[None, :], other=0.0
        )
        state = state * decay + tl.dot(b_kd, v_new)
        if STORE_CHUNK_STATES:
            tl.store(p_cs + c * (HV * K * V), state, mask=m_kv)
        if STORE_CAPTURE:  # a prefix-cache snapshot of the state after this chunk
            dst = tl.load(capture + first + c).to(tl.int64)
            if dst >= 0:
                p_dst = pool + dst * stride_ps + hv * stride_ph + o_k[:, None] * stride_pk + o_v[None, :] * stride_pv
                tl.store(p_dst, state.to(pool.dtype.element_ty), mask=m_kv)
        if PREFETCH:
            # the next chunk's (the last chunk's again on the last iteration: always in bounds)
            t1 = bos + tl.minimum(c + 1, num_chunks - 1) * BT
            row1 = t1.to(tl.int64) * HV + hv
            b_qs_next = tl.load(qscale + row1 + o_t * HV, mask=o_t < eos - t1, other=0.0)
            g_last_next = tl.load(gcum + row1 + (tl.minimum(eos - t1, BT) - 1) * HV)
    if num_chunks > 0:
        tl.store(p_pool, state.to(pool.dtype.element_ty), mask=m_kv)


# values that change from pass to pass: one compile serves them all (kernels/__init__.py)
@triton.jit(do_not_specialize=["num_seqs", "cu_seqlens", "slots", "has_initial_state"])
def _recur_kernel(
    k,
    w,
    u,
    kscale,
    gcum,
    h,
    chunk_states,
    capture,
    pool,
    cu_seqlens,
    slots,
    has_initial_state,
    num_seqs,
    stride_kt,
    stride_kh,
    stride_ps,
    stride_ph,
    stride_pk,
    stride_pv,
    HV: tl.constexpr,
    GROUP: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    BT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STORE_CHUNK_STATES: tl.constexpr,
    STORE_CAPTURE: tl.constexpr,
):
    """The split design's sequential kernel: only the recurrence. Per chunk it stores the state
    entering the chunk (h, input dtype) for _output_kernel, turns u into v_new = u - w S in place, and
    updates S = exp(gamma_last) S + k^T (kscale * v_new) with the raw keys (kscale folds the key norm
    and the decay to the chunk end into v_new's rows). Two dependent matmuls per chunk."""
    pid = tl.program_id(0)
    NV = tl.cdiv(V, BV)
    i_v = pid % NV
    n = pid // NV // HV
    hv = pid // NV % HV
    bos = tl.load(cu_seqlens + n).to(tl.int32)
    eos = tl.load(cu_seqlens + n + 1).to(tl.int32)
    num_chunks = (eos - bos + BT - 1) // BT
    dt = w.dtype.element_ty

    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]

    slot = tl.load(slots + n).to(tl.int64)
    # no initial state: an empty row range, so the slot's old contents are never read
    k_init = tl.where(tl.load(has_initial_state + n) != 0, K, 0)
    p_pool = pool + slot * stride_ps + hv * stride_ph + o_k[:, None] * stride_pk + o_v[None, :] * stride_pv
    state = tl.load(p_pool, mask=(o_k < k_init)[:, None] & m_v[None, :], other=0.0).to(tl.float32)
    first = chunks_before(cu_seqlens, n, BT, BLOCK_N)
    p_h = h + (first * HV + hv).to(tl.int64) * (K * V) + o_k[:, None] * V + o_v[None, :]
    if STORE_CHUNK_STATES:
        p_cs = chunk_states + (first * HV + hv).to(tl.int64) * (K * V) + o_k[:, None] * V + o_v[None, :]
    p_k = k + (hv // GROUP) * stride_kh + o_t[:, None] * stride_kt + o_k[None, :]
    b_ks_next = tl.load(kscale + bos.to(tl.int64) * HV + hv + o_t * HV, mask=o_t < eos - bos, other=0.0)
    g_last_next = _first_chunk_decay_log(gcum, hv, bos, eos, HV, BT)

    for c in range(num_chunks):
        t0 = bos + c * BT
        m_t = o_t < eos - t0
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        row = t0.to(tl.int64) * HV + hv
        b_s = state.to(dt)
        tl.store(p_h + c * (HV * K * V), b_s, mask=m_kv)
        b_w = tl.load(w + row * K + o_t[:, None] * (HV * K) + o_k[None, :], mask=m_tk, other=0.0)
        p_u = u + row * V + o_t[:, None] * (HV * V) + o_v[None, :]
        v_new = tl.load(p_u, mask=m_tv, other=0.0).to(tl.float32) - tl.dot(b_w, b_s)
        tl.store(p_u, v_new.to(dt), mask=m_tv)  # this program owns these columns: u becomes v_new
        b_k = tl.load(p_k + t0.to(tl.int64) * stride_kt, mask=m_tk, other=0.0).to(dt)
        v_scaled = (v_new * b_ks_next[:, None]).to(dt)
        state = state * tl.exp(g_last_next) + tl.dot(tl.trans(b_k), v_scaled)
        if STORE_CHUNK_STATES:
            tl.store(p_cs + c * (HV * K * V), state, mask=m_kv)
        if STORE_CAPTURE:  # a prefix-cache snapshot of the state after this chunk
            dst = tl.load(capture + first + c).to(tl.int64)
            if dst >= 0:
                p_dst = pool + dst * stride_ps + hv * stride_ph + o_k[:, None] * stride_pk + o_v[None, :] * stride_pv
                tl.store(p_dst, state.to(pool.dtype.element_ty), mask=m_kv)
        # the next chunk's small vectors, fetched a chunk ahead (the last chunk's again at the end)
        t1 = bos + tl.minimum(c + 1, num_chunks - 1) * BT
        row1 = t1.to(tl.int64) * HV + hv
        b_ks_next = tl.load(kscale + row1 + o_t * HV, mask=o_t < eos - t1, other=0.0)
        g_last_next = tl.load(gcum + row1 + (tl.minimum(eos - t1, BT) - 1) * HV)
    if num_chunks > 0:
        tl.store(p_pool, state.to(pool.dtype.element_ty), mask=m_kv)


# values that change from pass to pass: one compile serves them all (kernels/__init__.py)
@triton.jit(do_not_specialize=["num_seqs", "cu_seqlens"])
def _output_kernel(
    q,
    k,
    gcum,
    rnorm,
    h,
    v_new,
    o,
    cu_seqlens,
    num_seqs,
    scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    HV: tl.constexpr,
    GROUP: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    BT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    L2NORM: tl.constexpr,
):
    """The split design's output, parallel over (chunk, value head):
    o = qscale (q h) + (q k^T * causal decay, norms and scale folded in) v_new, over V in BV blocks."""
    i_c = tl.program_id(0)
    hv = tl.program_id(1)
    n, c = locate_chunk(cu_seqlens, num_seqs, i_c, BT, BLOCK_N)
    if n >= num_seqs:
        return
    t0 = tl.load(cu_seqlens + n).to(tl.int32) + c * BT
    length = tl.load(cu_seqlens + n + 1).to(tl.int32) - t0
    t0 = t0.to(tl.int64)
    row = t0 * HV + hv
    dt = v_new.dtype.element_ty

    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_t = o_t < length
    m_k = o_k < K
    hk = hv // GROUP
    # raw q and k feed the matmuls; their l2 norms scale the products (k's come from the solve kernel)
    b_q = _load_block(q + t0 * stride_qt + hk * stride_qh, o_t, m_t, stride_qt, o_k, m_k).to(dt)
    b_k = _load_block(k + t0 * stride_kt + hk * stride_kh, o_t, m_t, stride_kt, o_k, m_k).to(dt)
    scale_q = tl.full([BT], scale, dtype=tl.float32)
    scale_k = tl.full([BT], 1.0, dtype=tl.float32)
    if L2NORM:
        q32 = b_q.to(tl.float32)
        scale_q = scale_q * tl.rsqrt(tl.sum(q32 * q32, 1) + 1e-6)
        scale_k = tl.load(rnorm + row + o_t * HV, mask=m_t, other=0.0)
    b_gc = tl.load(gcum + row + o_t * HV, mask=m_t, other=0.0)
    causal = (o_t[:, None] >= o_t[None, :]) & m_t[:, None]
    decay = tl.exp(tl.where(causal, b_gc[:, None] - b_gc[None, :], float("-inf")))
    b_sc = (tl.dot(b_q, tl.trans(b_k)) * decay * scale_q[:, None] * scale_k[None, :]).to(dt)
    b_qs = scale_q * tl.exp(b_gc)
    p_h = h + (i_c * HV + hv).to(tl.int64) * (K * V) + o_k[:, None] * V
    for vp in range(0, V, BV):
        o_v = vp + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        b_h = tl.load(p_h + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0)
        b_v = tl.load(v_new + row * V + o_t[:, None] * (HV * V) + o_v[None, :], mask=m_tv, other=0.0)
        out = tl.dot(b_q, b_h) * b_qs[:, None]
        out = tl.dot(b_sc, b_v, out)
        tl.store(o + row * V + o_t[:, None] * (HV * V) + o_v[None, :], out.to(o.dtype.element_ty), mask=m_tv)


@functools.lru_cache(maxsize=8)
def _smem_limit(device: torch.device) -> int:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return getattr(props, "shared_memory_per_block_optin", 232448)
    return 232448  # the H200's (227 KB)


def _stages_that_fit(wanted: int, per_stage: int, fixed: int, device: torch.device) -> int:
    """The deepest software pipeline, up to `wanted`, whose tile buffers (per_stage bytes each, plus
    `fixed` for the matmul operands the loop stages itself) fit in a program's shared memory."""
    return max(1, min(wanted, (_smem_limit(device) - fixed) // per_stage))


def _contiguous_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


@dataclasses.dataclass(frozen=True)
class ChunkVariant:
    """How the sequential part runs; `chunk_gated_delta_rule(variant=...)` takes one of these or a name
    from VARIANTS, and bench/kernels_gdn.py times them side by side.

    split: True for _recur_kernel + _output_kernel, False for the fused _state_kernel.
    block_v: V columns per sequential program; 0 picks 64, halved to 32 while the grid has fewer
        programs than the GPU has SMs (the first design's rule).
    num_warps: of the sequential kernel; 0 picks 4 at block_v 32 and 8 above (the fused kernel's
        [K, 64] tiles spill at 4 warps once its loads are pipelined).
    num_stages: depth of the software pipeline of the sequential kernel's per-chunk tile loads; the
        wrapper lowers it until the tiles fit in shared memory.
    prefetch: fused only; fetch the chunk's qscale and decay one chunk ahead.
    out_block_v, out_warps: split only; the output kernel's V block and warps.
    """

    split: bool = True
    block_v: int = 0
    num_warps: int = 0
    num_stages: int = 3
    prefetch: bool = True
    out_block_v: int = 64
    out_warps: int = 4


VARIANTS = {
    # the first design, as measured on the H200 (0.193 / 0.734 / 3.022 ms at T = 2048 / 8192 / 32768)
    "fused": ChunkVariant(split=False, num_warps=4, num_stages=2, prefetch=False),
    "fused_pf": ChunkVariant(split=False, num_stages=3, prefetch=True),
    "fused64w8": ChunkVariant(split=False, block_v=64, num_warps=8, num_stages=3, prefetch=True),
    "split32": ChunkVariant(split=True, block_v=32, num_warps=4),
    "split64": ChunkVariant(split=True, block_v=64, num_warps=4),
    "split64w8": ChunkVariant(split=True, block_v=64, num_warps=8),
    "split32_o128": ChunkVariant(split=True, block_v=32, num_warps=4, out_block_v=128, out_warps=8),
}


# Up to this many tokens per sequence the original fused design won on the H200 (0.197 vs 0.234 ms
# for split32 at T=2048, one sequence; docs/PERF.md), above it split32 (0.51 vs 0.64 ms at 8192).
FUSED_MAX_TOKENS_PER_SEQ = 2048


def pick_variant(
    num_seqs: int, num_v_heads: int, value_dim: int, device: torch.device, num_tokens: int | None = None
) -> str:
    """The variant used when none is named. The split design shortens the per-chunk dependency chain
    (two matmuls instead of four) at the cost of an h round trip; it pays when the sequential grid is
    latency-bound (about one wave of programs: few, long sequences). With many sequences the
    sequential kernel is throughput-bound and the fused design moves fewer bytes; short sequences
    keep the original fused kernel."""
    if num_tokens is not None and num_tokens <= FUSED_MAX_TOKENS_PER_SEQ * num_seqs:
        return "fused"
    if num_seqs * num_v_heads * triton.cdiv(value_dim, 64) <= num_sms(device, cpu=H200_SMS):
        return "split32"
    return "fused_pf"


def _resolve_variant(
    variant, num_seqs: int, num_v_heads: int, value_dim: int, device, num_tokens: int | None = None
) -> ChunkVariant:
    if variant is None:
        variant = pick_variant(num_seqs, num_v_heads, value_dim, device, num_tokens)
    if isinstance(variant, str):
        variant = VARIANTS[variant]
    return variant


def chunk_gated_delta_rule(
    *,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_pool: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
    chunk_states_out: list | None = None,
    variant: str | ChunkVariant | None = None,
    captures: StateCaptures | None = None,
) -> torch.Tensor:
    """Chunked gated delta rule over varlen sequences; updates their pool slots in place.

    q, k: [T, Hk, K]; v: [T, Hv, V]; g (log decay, <= 0), beta: [T, Hv]; cu_seqlens: [N + 1];
    state_pool: [S, Hv, K, V] float32; state_slots: [N]; has_initial_state: [N] bool. Returns
    o: [T, Hv, V] in v's dtype. chunk_states_out, when a list, receives for each sequence a
    [num_chunks, Hv, K, V] float32 tensor of the state after each chunk (this reads cu_seqlens on
    the host). Only chunk_size 64 is supported. q, k, v may be strided views (last dim contiguous).
    variant: a VARIANTS name or a ChunkVariant; None picks by pick_variant.
    captures: also write the states they name into their pool slots (state.py); no host sync.
    """
    if chunk_size != CHUNK:
        raise ValueError(f"chunk_size must be {CHUNK}, got {chunk_size}")
    q, k, v = _contiguous_last(q), _contiguous_last(k), _contiguous_last(v)
    num_tokens, num_k_heads, key_dim = q.shape
    num_v_heads, value_dim = v.shape[1], v.shape[2]
    num_seqs = cu_seqlens.shape[0] - 1
    scale = key_dim**-0.5 if scale is None else scale
    device, dt = v.device, k.dtype
    cfg = _resolve_variant(variant, num_seqs, num_v_heads, value_dim, device, num_tokens)
    out = torch.empty((num_tokens, num_v_heads, value_dim), dtype=v.dtype, device=device)
    max_chunks = num_tokens // CHUNK + num_seqs
    # scratch, in few allocations: per (token, value head) float32 vectors, then matmul-dtype tiles.
    # qscale holds kscale in the split design
    gcum, rnorm, qscale = torch.empty((3, num_tokens, num_v_heads), dtype=torch.float32, device=device).unbind(0)
    a_scratch = torch.empty((num_tokens, num_v_heads, SUB), dtype=torch.float32, device=device)
    if cfg.split:
        y = torch.empty((num_tokens, num_v_heads, CHUNK), dtype=dt, device=device)
        w = torch.empty((num_tokens, num_v_heads, key_dim), dtype=dt, device=device)
        kd, scores = w, y  # unused
        # the state entering each chunk, for the output kernel
        h = torch.empty((max_chunks, num_v_heads, key_dim, value_dim), dtype=dt, device=device)
    else:
        y, scores = torch.empty((2, num_tokens, num_v_heads, CHUNK), dtype=dt, device=device).unbind(0)
        w, kd = torch.empty((2, num_tokens, num_v_heads, key_dim), dtype=dt, device=device).unbind(0)
    u = torch.empty((num_tokens, num_v_heads, value_dim), dtype=dt, device=device)
    chunk_states = None
    if chunk_states_out is not None:
        chunk_states = torch.empty((max_chunks, num_v_heads, key_dim, value_dim), dtype=torch.float32, device=device)
    if num_seqs == 0:
        return out
    plan = capture_arg = None
    if captures is not None and captures.items:
        plan = plan_captures(captures, CHUNK)
        _store_initial_states(plan.initial_stores, state_pool, state_slots, has_initial_state)
        capture_arg = torch.full((max_chunks,), -1, dtype=torch.int32)
        for index, slot in plan.chunk_stores.items():
            capture_arg[index] = slot
        capture_arg = capture_arg.to(device, non_blocking=True)

    group = num_v_heads // num_k_heads
    bk = max(16, triton.next_power_of_2(key_dim))
    bv_all = max(16, triton.next_power_of_2(value_dim))
    _solve_kernel[(max_chunks, num_v_heads)](
        k, g, beta, cu_seqlens, gcum, rnorm, a_scratch, y, num_seqs,
        k.stride(0), k.stride(1), g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
        HV=num_v_heads, GROUP=group, K=key_dim, BKP=min(32, bk), BT=CHUNK, BC=SUB, BLOCK_N=BLOCK_N,
        L2NORM=use_qk_l2norm, PRECISION="ieee" if dt == torch.float32 else "tf32",
        num_warps=1, num_stages=1,
    )  # fmt: skip
    _intra_kernel[(max_chunks, num_v_heads)](
        q, k, v, beta, cu_seqlens, gcum, rnorm, y, w, u, kd, scores, qscale, num_seqs, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), beta.stride(0), beta.stride(1),
        HV=num_v_heads, GROUP=group, K=key_dim, V=value_dim, BKP=min(64, bk), BVP=min(64, bv_all), BT=CHUNK, BC=SUB,
        BLOCK_N=BLOCK_N, L2NORM=use_qk_l2norm, FUSED=not cfg.split,
        num_warps=8, num_stages=2,
    )  # fmt: skip
    bv = min(cfg.block_v or 64, bv_all)
    if not cfg.block_v:  # narrower V-blocks when there are too few (sequence, head) pairs to fill the GPU
        while bv > 32 and num_seqs * num_v_heads * triton.cdiv(value_dim, bv) < num_sms(device, cpu=H200_SMS):
            bv //= 2
    seq_warps = cfg.num_warps or (4 if bv <= 32 else 8)
    seq_grid = (triton.cdiv(value_dim, bv) * num_seqs * num_v_heads,)
    cs_arg = w if chunk_states is None else chunk_states
    cap_arg = cu_seqlens if capture_arg is None else capture_arg  # never read without captures
    # shared memory of the sequential loop (estimates above what sm_90 builds allocate): per stage its
    # tiles (split: w, k, u; fused: w, q, kd, scores, u), besides the state and v_new matmul operands
    esize = w.element_size()
    fixed = esize * (bk + CHUNK) * bv + 8192
    per_stage = esize * CHUNK * ((2 if cfg.split else 3) * bk + bv + (0 if cfg.split else CHUNK))
    stages = _stages_that_fit(cfg.num_stages, per_stage, fixed, device)
    if cfg.split:
        _recur_kernel[seq_grid](
            k, w, u, qscale, gcum, h, cs_arg, cap_arg, state_pool, cu_seqlens, state_slots, has_initial_state,
            num_seqs,
            k.stride(0), k.stride(1), *state_pool.stride(),
            HV=num_v_heads, GROUP=group, K=key_dim, V=value_dim, BK=bk, BV=bv, BT=CHUNK, BLOCK_N=BLOCK_N,
            STORE_CHUNK_STATES=chunk_states is not None, STORE_CAPTURE=capture_arg is not None,
            num_warps=seq_warps, num_stages=stages,
        )  # fmt: skip
        _output_kernel[(max_chunks, num_v_heads)](
            q, k, gcum, rnorm, h, u, out, cu_seqlens, num_seqs, scale, q.stride(0), q.stride(1), k.stride(0),
            k.stride(1),
            HV=num_v_heads, GROUP=group, K=key_dim, V=value_dim, BK=bk, BV=min(cfg.out_block_v, bv_all), BT=CHUNK,
            BLOCK_N=BLOCK_N, L2NORM=use_qk_l2norm,
            num_warps=cfg.out_warps, num_stages=2,
        )  # fmt: skip
    else:
        _state_kernel[seq_grid](
            q, w, u, kd, scores, qscale, gcum, out, cs_arg, cap_arg, state_pool,
            cu_seqlens, state_slots, has_initial_state, num_seqs, q.stride(0), q.stride(1), *state_pool.stride(),
            HV=num_v_heads, GROUP=group, K=key_dim, V=value_dim, BK=bk, BV=bv, BT=CHUNK, BLOCK_N=BLOCK_N,
            STORE_CHUNK_STATES=chunk_states is not None, PREFETCH=cfg.prefetch, STORE_CAPTURE=capture_arg is not None,
            num_warps=seq_warps, num_stages=stages,
        )  # fmt: skip

    if plan is not None:
        _finish_captures(plan, captures, q, k, v, g, beta, state_pool, scale, use_qk_l2norm)
    if chunk_states_out is not None:
        counts = ((cu_seqlens[1:] - cu_seqlens[:-1] + CHUNK - 1) // CHUNK).tolist()
        start = 0
        for count in counts:
            chunk_states_out.append(chunk_states[start : start + count])
            start += count
    return out


def _store_initial_states(stores, state_pool, state_slots, has_initial_state) -> None:
    """Captures at a sequence's first token: its initial state (the slot's, or zeros), copied before
    the kernels overwrite the slot. Device ops only."""
    for seq, dst in stores:
        src = state_pool[state_slots[seq].long()]
        state_pool[dst] = torch.where(has_initial_state[seq].bool(), src, torch.zeros_like(src))


def _finish_captures(plan, captures, q, k, v, g, beta, state_pool, scale, use_qk_l2norm) -> None:
    """After the kernels: copies for captures that share a stored state, then the tokens between each
    capture's chunk boundary and its offset, replayed on its slot by the recurrent kernel."""
    from .recurrent import fused_recurrent_gated_delta_rule

    for src, dst in plan.copies:
        state_pool[dst] = state_pool[src]
    starts = captures.starts()
    for seq, first, count, dst in plan.replays:
        rows = slice(starts[seq] + first, starts[seq] + first + count)
        fused_recurrent_gated_delta_rule(
            q=q[rows].unsqueeze(0),
            k=k[rows].unsqueeze(0),
            v=v[rows].unsqueeze(0),
            g=g[rows].unsqueeze(0),
            beta=beta[rows].unsqueeze(0),
            state_pool=state_pool,
            state_slots=torch.full((1,), dst, dtype=torch.int32, device=state_pool.device),
            scale=scale,
            use_qk_l2norm=use_qk_l2norm,
        )
