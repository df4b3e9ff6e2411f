"""The split design's walk over pairs of chunks (ChunkVariant.pairs): half the dependent steps.

With S_a the state entering chunk a and b the chunk after it, the split recurrence is
v_a = u_a - w_a S_a, S_b = exp(G_a) S_a + k_a^T (ks_a v_a), v_b = u_b - w_b S_b (G: a chunk's last
in-chunk decay log, ks: kscale, the key norm and the decay to the chunk end). Substituting S_b,

    v_b = u_b' - w_b' S_a,  u_b' = u_b - M u_a,  w_b' = exp(G_a) w_b - M w_a,  M = w_b k_a^T diag(ks_a),

so both chunks' v_new come from S_a in one 128-row matmul, and the state after the pair is
exp(G_a + G_b) S_a + [k_a; k_b]^T ([exp(G_b) ks_a; ks_b] [v_a; v_b]): two dependent matmuls a pair
instead of four. `_pair_merge_kernel` (parallel over chunks) turns each pair's second chunk's w and u
into w_b' and u_b' in place; `_recur_pairs_kernel` walks the pairs. The state entering the second
chunk (h for the output kernel, a capture after the first chunk) is S_b, a matmul beside the chain.
u_b' and w_b' are rounded to the matmul dtype as w and u are, so the bits differ from the chunk
walk's by roundings; the reference is naive.py as for every design."""

from __future__ import annotations

import triton
import triton.language as tl

from .chunk_state import _walk_start
from .varlen import chunks_before, locate_chunk


# values that change from pass to pass: one compile serves them all (kernels/__init__.py)
@triton.jit(do_not_specialize=["num_seqs", "cu_seqlens"])
def _pair_merge_kernel(
    k, w, u, kscale, gcum, cu_seqlens, num_seqs, stride_kt, stride_kh, HV: tl.constexpr, GROUP: tl.constexpr,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Per (chunk, value head): a sequence's odd chunk b (the second of a pair; its first chunk a is full)
    becomes w_b' = exp(G_a) w_b - M w_a and u_b' = u_b - M u_a, M = w_b k_a^T diag(ks_a), in place. Even
    chunks return at once; a program reads its pair's first chunk and writes only its own rows."""
    n, c = locate_chunk(cu_seqlens, num_seqs, tl.program_id(0), BT, BLOCK_N)
    if n >= num_seqs or c % 2 == 0:
        return
    hv = tl.program_id(1)
    t_b = tl.load(cu_seqlens + n).to(tl.int32) + c * BT
    length = tl.load(cu_seqlens + n + 1).to(tl.int32) - t_b
    t_b = t_b.to(tl.int64)
    t_a = t_b - BT
    row_a = t_a * HV + hv
    row_b = t_b * HV + hv
    dt = w.dtype.element_ty
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_t = o_t < length
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    p_w_b = w + row_b * K + o_t[:, None] * (HV * K) + o_k[None, :]
    b_w_b = tl.load(p_w_b, mask=m_tk, other=0.0)
    b_w_a = tl.load(w + row_a * K + o_t[:, None] * (HV * K) + o_k[None, :], mask=m_k[None, :], other=0.0)
    p_k_a = k + t_a * stride_kt + (hv // GROUP) * stride_kh + o_t[:, None] * stride_kt + o_k[None, :]
    b_k_a = tl.load(p_k_a, mask=m_k[None, :], other=0.0).to(dt)
    ks_a = tl.load(kscale + row_a + o_t * HV)
    g_a = tl.load(gcum + row_a + (BT - 1) * HV)
    m = (tl.dot(b_w_b, tl.trans(b_k_a)) * ks_a[None, :]).to(dt)  # [BT, BT]
    w_new = tl.exp(g_a) * b_w_b.to(tl.float32) - tl.dot(m, b_w_a)
    for vp in range(0, V, BV):
        o_v = vp + tl.arange(0, BV)
        m_v = o_v < V
        b_u_a = tl.load(u + row_a * V + o_t[:, None] * (HV * V) + o_v[None, :], mask=m_v[None, :], other=0.0)
        p_u_b = u + row_b * V + o_t[:, None] * (HV * V) + o_v[None, :]
        b_u_b = tl.load(p_u_b, mask=m_t[:, None] & m_v[None, :], other=0.0).to(tl.float32)
        tl.store(p_u_b, (b_u_b - tl.dot(m, b_u_a)).to(dt), mask=m_t[:, None] & m_v[None, :])
    tl.store(p_w_b, w_new.to(dt), mask=m_tk)  # each element after its own load (it depends on it)


# values that change from pass to pass: one compile serves them all (kernels/__init__.py)
@triton.jit(do_not_specialize=["num_seqs", "cu_seqlens", "slots", "has_initial_state", "capture"])
def _recur_pairs_kernel(
    k, w, u, kscale, gcum, h, chunk_states, capture, pool, cu_seqlens, slots, has_initial_state, num_seqs, stride_kt,
    stride_kh, stride_ps, HV: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr,
    V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, BLOCK_N: tl.constexpr,
    STORE_CHUNK_STATES: tl.constexpr, STORE_CAPTURE: tl.constexpr,
):  # fmt: skip
    """_recur_kernel over pairs of chunks after _pair_merge_kernel: per pair, h of both chunks, v_new of
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
