"""The split design's walk over pairs of chunks (ChunkVariant.pairs): half the dependent steps.

With S_a the state entering chunk a and b the chunk after it, the split recurrence is
v_a = u_a - w_a S_a, S_b = exp(G_a) S_a + k_a^T (ks_a v_a), v_b = u_b - w_b S_b (G: a chunk's last
in-chunk decay log, ks: kscale, the key norm and the decay to the chunk end). Substituting S_b,

    v_b = u_b' - w_b' S_a,  u_b' = u_b - M u_a,  w_b' = exp(G_a) w_b - M w_a,  M = w_b k_a^T diag(ks_a),

so both chunks' v_new come from S_a in one 128-row matmul, and the state after the pair is
exp(G_a + G_b) S_a + [k_a; k_b]^T ([exp(G_b) ks_a; ks_b] [v_a; v_b]): two dependent matmuls a pair
instead of four. `_intra_pairs_kernel` (the matmul kernel a pair of chunks a program) stores w_a, u_a
and the second chunk's w_b', u_b'; `_recur_pairs_kernel` walks the pairs. The state entering the second
chunk (h for the output kernel, a capture after the first chunk) is S_b, a matmul beside the chain.
u_b' and w_b' are rounded to the matmul dtype as w and u are, so the bits differ from the chunk
walk's by roundings; the reference is naive.py as for every design."""

from __future__ import annotations

import triton
import triton.language as tl

from .chunk_prepare import _load_block, chunk_scales
from .chunk_state import _walk_start
from .varlen import chunks_before, locate_chunk


@triton.jit
def _chunk_rows(
    k, y, beta, gcum, rnorm, t0, length, hv, stride_kt, stride_kh, stride_bt, stride_bh, HV: tl.constexpr,
    GROUP: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    L2NORM: tl.constexpr,
):  # fmt: skip
    """One chunk's WY rows for the split design (chunk_prepare.chunk_scales' chunk): Y, the raw keys [BT,
    BK] in the matmul dtype, w = Y (beta exp(gamma) k / |k|) [BT, BK] float32, beta, kscale (the key
    norm and the decay to the chunk end), the chunk's last decay log, the row mask and its first row."""
    b_y, b_gc, b_beta, scale_k, g_last, m_t, row = chunk_scales(
        y, beta, gcum, rnorm, t0, length, hv, stride_bt, stride_bh, HV, BT, BC, L2NORM
    )
    o_k = tl.arange(0, BK)
    p_k = k + t0 * stride_kt + (hv // GROUP) * stride_kh
    b_k = _load_block(p_k, tl.arange(0, BT), m_t, stride_kt, o_k, o_k < K).to(y.dtype.element_ty)
    scale_w = scale_k * b_beta * tl.exp(b_gc)
    b_w = tl.dot(b_y, (b_k.to(tl.float32) * scale_w[:, None]).to(y.dtype.element_ty))
    return b_y, b_k, b_w, b_beta, scale_k * tl.exp(g_last - b_gc), g_last, m_t, row


# values that change from pass to pass: one compile serves them all (kernels/__init__.py)
@triton.jit(do_not_specialize=["num_seqs", "cu_seqlens"])
def _intra_pairs_kernel(
    k, v, beta, cu_seqlens, gcum, rnorm, y, w, u, kscale, num_seqs, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_bt, stride_bh, HV: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
    BVP: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BLOCK_N: tl.constexpr, L2NORM: tl.constexpr,
):  # fmt: skip
    """The split design's matmul kernel (chunk_prepare._intra_kernel) a pair of chunks a program, the pair
    merged on the way out: w_a, u_a and kscale of both as the chunk kernel stores them, and for the
    second chunk w_b' = exp(G_a) w_b - M w_a and u_b' = u_b - M u_a with M = w_b k_a^T diag(ks_a) (w_b,
    u_b rounded to the matmul dtype first, as stored), so the walk's step reads both chunks' rows
    straight. A sequence's last chunk without a partner is a pair whose second half is empty."""
    n, p = locate_chunk(cu_seqlens, num_seqs, tl.program_id(0), 2 * BT, BLOCK_N)
    if n >= num_seqs:
        return
    hv = tl.program_id(1)
    t_a = tl.load(cu_seqlens + n).to(tl.int32) + p * 2 * BT
    length = tl.load(cu_seqlens + n + 1).to(tl.int32) - t_a  # tokens from the pair's start on
    t_a = t_a.to(tl.int64)
    dt = w.dtype.element_ty
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    y_a, k_a, w_a, beta_a, ks_a, g_a, m_a, row_a = _chunk_rows(
        k, y, beta, gcum, rnorm, t_a, length, hv, stride_kt, stride_kh, stride_bt, stride_bh, HV, GROUP, K, BK, BT,
        BC, L2NORM,
    )  # fmt: skip
    y_b, k_b, w_b, beta_b, ks_b, g_b, m_b, row_b = _chunk_rows(
        k, y, beta, gcum, rnorm, t_a + BT, length - BT, hv, stride_kt, stride_kh, stride_bt, stride_bh, HV, GROUP, K,
        BK, BT, BC, L2NORM,
    )  # fmt: skip
    tl.store(kscale + row_a + o_t * HV, ks_a, mask=m_a)
    tl.store(kscale + row_b + o_t * HV, ks_b, mask=m_b)
    w_a = w_a.to(dt)
    tl.store(w + row_a * K + o_t[:, None] * (HV * K) + o_k[None, :], w_a, mask=m_a[:, None] & m_k[None, :])
    w_b = w_b.to(dt)
    m = (tl.dot(w_b, tl.trans(k_a)) * ks_a[None, :]).to(dt)  # [BT, BT]: second chunk's rows, first's
    w_b = tl.exp(g_a) * w_b.to(tl.float32) - tl.dot(m, w_a)
    tl.store(w + row_b * K + o_t[:, None] * (HV * K) + o_k[None, :], w_b.to(dt), mask=m_b[:, None] & m_k[None, :])
    for vp in range(0, V, BVP):
        o_v = vp + tl.arange(0, BVP)
        m_v = o_v < V
        b_v = _load_block(v + t_a * stride_vt + hv * stride_vh, o_t, m_a, stride_vt, o_v, m_v).to(tl.float32)
        u_a = tl.dot(y_a, (b_v * beta_a[:, None]).to(dt)).to(dt)
        tl.store(u + row_a * V + o_t[:, None] * (HV * V) + o_v[None, :], u_a, mask=m_a[:, None] & m_v[None, :])
        b_v = _load_block(v + (t_a + BT) * stride_vt + hv * stride_vh, o_t, m_b, stride_vt, o_v, m_v).to(tl.float32)
        u_b = tl.dot(y_b, (b_v * beta_b[:, None]).to(dt)).to(dt).to(tl.float32) - tl.dot(m, u_a)
        tl.store(u + row_b * V + o_t[:, None] * (HV * V) + o_v[None, :], u_b.to(dt), mask=m_b[:, None] & m_v[None, :])


# values that change from pass to pass: one compile serves them all (kernels/__init__.py)
@triton.jit(do_not_specialize=["num_seqs", "cu_seqlens", "slots", "has_initial_state", "capture"])
def _recur_pairs_kernel(
    k, w, u, kscale, gcum, h, chunk_states, capture, pool, cu_seqlens, slots, has_initial_state, num_seqs, stride_kt,
    stride_kh, stride_ps, HV: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr,
    V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, BLOCK_N: tl.constexpr,
    STORE_CHUNK_STATES: tl.constexpr, STORE_CAPTURE: tl.constexpr,
):  # fmt: skip
    """_recur_kernel over pairs of chunks after _intra_pairs_kernel: per pair, h of both chunks, v_new of
    both over u ([v_a; v_b] = [u_a; u_b'] - [w_a; w_b'] S_a), the state after the pair from S_a
    directly, and S_b (the second chunk's h, the state after the first chunk) beside the chain.
    A sequence's last chunk without a partner is a pair whose second half is masked."""
    n, hv, o_k, o_v, m_k, m_v, bos, eos, num_chunks, slot, tile, state = _walk_start(
        cu_seqlens, pool, slots, has_initial_state, stride_ps, HV, K, V, BK, BV, BT
    )
    m_kv = m_k[:, None] & m_v[None, :]
    o_t = tl.arange(0, 2 * BT)
    first_half = o_t < BT
    dt = w.dtype.element_ty
    first = chunks_before(cu_seqlens, n, BT, BLOCK_N)
    p_h = h + (first * HV + hv).to(tl.int64) * (K * V) + tile
    if STORE_CHUNK_STATES:
        p_cs = chunk_states + (first * HV + hv).to(tl.int64) * (K * V) + tile
    p_k = k + (hv // GROUP) * stride_kh + o_t[:, None] * stride_kt + o_k[None, :]
    step = (
        HV * K * V
    )  # a chunk's h (and chunk state) after the one before (offsets in int64: past 2^31 at 4,096 chunks)

    for p in range((num_chunks + 1) // 2):
        c = 2 * p
        c64 = tl.cast(c, tl.int64)
        t0 = bos + c * BT
        has_b = c + 1 < num_chunks
        m_t = o_t < eos - t0
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        row = t0.to(tl.int64) * HV + hv
        # the decay logs at each chunk's last token (in-chunk sums); the second chunk's is 0 without it
        g_a = tl.load(gcum + row + (tl.minimum(eos - t0, BT) - 1) * HV)
        g_b = tl.where(has_b, tl.load(gcum + row + (tl.minimum(eos - t0, 2 * BT) - 1) * HV), 0.0)
        ks = tl.load(kscale + row + o_t * HV, mask=m_t, other=0.0)
        b_s = state.to(dt)
        tl.store(p_h + c64 * step, b_s, mask=m_kv)
        b_w = tl.load(w + row * K + o_t[:, None] * (HV * K) + o_k[None, :], mask=m_tk, other=0.0)
        p_u = u + row * V + o_t[:, None] * (HV * V) + o_v[None, :]
        v_new = tl.load(p_u, mask=m_tv, other=0.0).to(tl.float32) - tl.dot(b_w, b_s)
        tl.store(p_u, v_new.to(dt), mask=m_tv)  # this program owns these columns: u becomes v_new
        b_k = tl.load(p_k + t0.to(tl.int64) * stride_kt, mask=m_tk, other=0.0).to(dt)
        v_pair = (v_new * tl.where(first_half, tl.exp(g_b) * ks, ks)[:, None]).to(dt)
        state_next = state * tl.exp(g_a + g_b) + tl.dot(tl.trans(b_k), v_pair)
        if has_b:
            v_first = (v_new * tl.where(first_half, ks, 0.0)[:, None]).to(dt)
            s_b = state * tl.exp(g_a) + tl.dot(tl.trans(b_k), v_first)
            tl.store(p_h + (c64 + 1) * step, s_b.to(dt), mask=m_kv)
            if STORE_CHUNK_STATES:
                tl.store(p_cs + c64 * step, s_b, mask=m_kv)
                tl.store(p_cs + (c64 + 1) * step, state_next, mask=m_kv)
            if STORE_CAPTURE:  # prefix-cache snapshots after either chunk (gdn/state.py)
                dst = tl.load(capture + first + c).to(tl.int64)
                if dst >= 0:
                    tl.store(pool + dst * stride_ps + hv * (K * V) + tile, s_b.to(pool.dtype.element_ty), mask=m_kv)
                dst = tl.load(capture + first + c + 1).to(tl.int64)
                if dst >= 0:
                    dst_tile = pool + dst * stride_ps + hv * (K * V) + tile
                    tl.store(dst_tile, state_next.to(pool.dtype.element_ty), mask=m_kv)
        else:
            if STORE_CHUNK_STATES:
                tl.store(p_cs + c64 * step, state_next, mask=m_kv)
            if STORE_CAPTURE:
                dst = tl.load(capture + first + c).to(tl.int64)
                if dst >= 0:
                    dst_tile = pool + dst * stride_ps + hv * (K * V) + tile
                    tl.store(dst_tile, state_next.to(pool.dtype.element_ty), mask=m_kv)
        state = state_next
    if num_chunks > 0:
        tl.store(pool + slot * stride_ps + hv * (K * V) + tile, state.to(pool.dtype.element_ty), mask=m_kv)
