"""The chunked gated delta rule's parallel part (chunk.py), per (chunk, value head): the solve of
Y = (I + A)^-1 in 16 x 16 blocks, and the whole-chunk matmuls w = Y (beta exp(gamma) k), u = Y (beta v)
with what the chosen sequential design needs besides (chunk_state.py)."""

from __future__ import annotations

import triton
import triton.language as tl

from .varlen import locate_chunk


@triton.jit
def _load_block(ptr, rows, row_mask, stride_t, cols, col_mask):
    return tl.load(
        ptr + rows[:, None] * stride_t + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0
    )


@triton.jit
def _key_blocks(p_k, o_c, m0, m1, m2, m3, stride_kt, kp, K: tl.constexpr, BKP: tl.constexpr, BC: tl.constexpr):
    """Columns [kp, kp + BKP) of the chunk's four BC-row blocks of keys."""
    o_k = kp + tl.arange(0, BKP)
    m_k = o_k < K
    k0 = _load_block(p_k, o_c, m0, stride_kt, o_k, m_k)
    k1 = _load_block(p_k, o_c + BC, m1, stride_kt, o_k, m_k)
    k2 = _load_block(p_k, o_c + 2 * BC, m2, stride_kt, o_k, m_k)
    k3 = _load_block(p_k, o_c + 3 * BC, m3, stride_kt, o_k, m_k)
    return k0, k1, k2, k3


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
@triton.jit(do_not_specialize=["num_seqs", "cu_seqlens", "chunk_lo"])
def _solve_kernel(
    k, g, beta, cu_seqlens, gcum, rnorm, a_scratch, y, num_seqs, chunk_lo, stride_kt, stride_kh, stride_gt,
    stride_gh, stride_bt, stride_bh, HV: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, BKP: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BLOCK_N: tl.constexpr, L2NORM: tl.constexpr, PRECISION: tl.constexpr,
    SUB_STAGES: tl.constexpr,
):  # fmt: skip
    i_c = tl.program_id(0) + chunk_lo  # global chunk (varlen.py)
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

    # the ten 16 x 16 blocks of raw k k^T on and below the diagonal, over K in pieces, one pass over the
    # keys (sm_90, Triton 3.6: 205 registers against 210 for a second pass after the substitution, and
    # four dependent loads fewer); the l2 norms scale them afterwards. SUB_STAGES > 1: this loop's key
    # blocks and the substitution's rows loaded ahead (cp.async), off the chains of dependent steps
    a00 = tl.zeros([BC, BC], dtype=tl.float32)
    a11, a22, a33 = a00, a00, a00
    a10, a20, a21, a30, a31, a32 = a00, a00, a00, a00, a00, a00
    ss0 = tl.zeros([BC], dtype=tl.float32)
    ss1, ss2, ss3 = ss0, ss0, ss0
    for kp in tl.range(0, K, BKP, num_stages=SUB_STAGES):
        k0, k1, k2, k3 = _key_blocks(p_k, o_c, m0, m1, m2, m3, stride_kt, kp, K, BKP, BC)
        a00 = tl.dot(k0, tl.trans(k0), a00)
        a11 = tl.dot(k1, tl.trans(k1), a11)
        a22 = tl.dot(k2, tl.trans(k2), a22)
        a33 = tl.dot(k3, tl.trans(k3), a33)
        a10 = tl.dot(k1, tl.trans(k0), a10)
        a20 = tl.dot(k2, tl.trans(k0), a20)
        a21 = tl.dot(k2, tl.trans(k1), a21)
        a30 = tl.dot(k3, tl.trans(k0), a30)
        a31 = tl.dot(k3, tl.trans(k1), a31)
        a32 = tl.dot(k3, tl.trans(k2), a32)
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
    for i in tl.range(2, BC, num_stages=SUB_STAGES):
        sel = (o_c == i)[:, None]
        r_i = o_c * 0 + i  # row i of each block, as a vector (the interpreter rejects scalar masks)
        x0 = _substitute_row(x0, sel, tl.load(p_a + i * (HV * BC), mask=r_i < length, other=0.0))
        x1 = _substitute_row(x1, sel, tl.load(p_a + (BC + i) * (HV * BC), mask=r_i + BC < length, other=0.0))
        x2 = _substitute_row(x2, sel, tl.load(p_a + (2 * BC + i) * (HV * BC), mask=r_i + 2 * BC < length, other=0.0))
        x3 = _substitute_row(x3, sel, tl.load(p_a + (3 * BC + i) * (HV * BC), mask=r_i + 3 * BC < length, other=0.0))
    eye = (o_c[:, None] == o_c[None, :]).to(tl.float32)
    y00, y11, y22, y33 = x0 + eye, x1 + eye, x2 + eye, x3 + eye

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


@triton.jit
def chunk_scales(
    y, beta, gcum, rnorm, t0, length, hv, stride_bt, stride_bh, HV: tl.constexpr, BT: tl.constexpr,
    BC: tl.constexpr, L2NORM: tl.constexpr,
):  # fmt: skip
    """What the matmul kernels read of one chunk (rows from token t0, `length` tokens from it on, at most
    BT used): (Y [BT, BT] (its lower blocks), gamma [BT], beta [BT], the key norms' factors [BT] (ones
    without L2NORM), gamma at the chunk's last token (0 for an empty chunk), the row mask, the (token,
    value head) row of t0)."""
    o_t = tl.arange(0, BT)
    m_t = o_t < length
    row = t0 * HV + hv
    lower = (o_t[None, :] // BC) <= (o_t[:, None] // BC)
    b_y = tl.load(y + row * BT + o_t[:, None] * (HV * BT) + o_t[None, :], mask=m_t[:, None] & lower, other=0.0)
    b_gc = tl.load(gcum + row + o_t * HV, mask=m_t, other=0.0)
    b_beta = tl.load(beta + t0 * stride_bt + hv * stride_bh + o_t * stride_bt, mask=m_t, other=0.0).to(tl.float32)
    scale_k = tl.full([BT], 1.0, dtype=tl.float32)
    if L2NORM:
        scale_k = tl.load(rnorm + row + o_t * HV, mask=m_t, other=0.0)
    g_last = tl.sum(tl.where(o_t == tl.minimum(length, BT) - 1, b_gc, 0.0), 0)
    return b_y, b_gc, b_beta, scale_k, g_last, m_t, row


# values that change from pass to pass: one compile serves them all (kernels/__init__.py)
@triton.jit(do_not_specialize=["num_seqs", "cu_seqlens", "chunk_lo"])
def _intra_kernel(
    q, k, v, beta, cu_seqlens, gcum, rnorm, y, w, u, kd, scores, qscale, num_seqs, chunk_lo, scale, stride_qt,
    stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_bt, stride_bh, HV: tl.constexpr, GROUP: tl.constexpr,
    K: tl.constexpr, V: tl.constexpr, BKP: tl.constexpr, BVP: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BLOCK_N: tl.constexpr, L2NORM: tl.constexpr, FUSED: tl.constexpr,
):  # fmt: skip
    """FUSED: w, u, kd, scores and qscale for _state_kernel. Otherwise (split): w, u and, in the
    `qscale` buffer, kscale = rnorm exp(gamma_last - gamma), the per-token factor _recur_kernel folds
    into v_new so that it can take the raw keys."""
    n, c = locate_chunk(cu_seqlens, num_seqs, tl.program_id(0) + chunk_lo, BT, BLOCK_N)
    if n >= num_seqs:
        return
    hv = tl.program_id(1)
    t0 = tl.load(cu_seqlens + n).to(tl.int32) + c * BT
    length = tl.load(cu_seqlens + n + 1).to(tl.int32) - t0
    t0 = t0.to(tl.int64)
    dt = w.dtype.element_ty
    p_q = q + t0 * stride_qt + (hv // GROUP) * stride_qh
    p_k = k + t0 * stride_kt + (hv // GROUP) * stride_kh

    o_t = tl.arange(0, BT)
    b_y, b_gc, b_beta, scale_k, g_last, m_t, row = chunk_scales(
        y, beta, gcum, rnorm, t0, length, hv, stride_bt, stride_bh, HV, BT, BC, L2NORM
    )
    scale_w = scale_k * b_beta * tl.exp(b_gc)
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
