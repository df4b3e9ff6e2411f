"""The chunked gated delta rule's sequential part (chunk.py): one program per (sequence, value
head, V-block) walks the sequence's chunks with the float32 state in registers, in one of two
designs (fused: _state_kernel; split: _recur_kernel, then _output_kernel in parallel over chunks)."""

from __future__ import annotations

import triton
import triton.language as tl

from .chunk_prepare import _load_block
from .varlen import chunks_before, locate_chunk, value_block


@triton.jit
def _first_chunk_decay_log(gcum, hv, bos, eos, HV: tl.constexpr, BT: tl.constexpr):
    """gamma_last of a sequence's first chunk (0 for an empty sequence), read as a masked vector so
    that an empty sequence at the end of the batch reads nothing."""
    o_t = tl.arange(0, BT)
    last = tl.minimum(eos - bos, BT) - 1
    vals = tl.load(gcum + (bos + o_t).to(tl.int64) * HV + hv, mask=o_t == last, other=0.0)
    return tl.sum(vals, 0)


@triton.jit
def _walk_start(
    cu_seqlens, slots, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BT: tl.constexpr,
):  # fmt: skip
    """Where this program's walk starts: its sequence n, value head and state tile (varlen.value_block),
    the sequence's tokens [bos, eos) and chunk count, its pool slot, and the tile's offsets inside a
    [K, V] state (o_k V + o_v: the pool's slots hold contiguous [HV, K, V] states, as the h and
    chunk-state buffers, so that every store of the tile shares one offset tensor, not a [BK, BV]
    tensor of 64-bit addresses each)."""
    n, hv, o_k, o_v, m_k, m_v = value_block(tl.program_id(0), HV, K, V, BK, BV)
    bos = tl.load(cu_seqlens + n).to(tl.int32)
    eos = tl.load(cu_seqlens + n + 1).to(tl.int32)
    num_chunks = (eos - bos + BT - 1) // BT
    slot = tl.load(slots + n).to(tl.int64)
    tile = o_k[:, None] * V + o_v[None, :]
    return n, hv, o_k, o_v, m_k, m_v, bos, eos, num_chunks, slot, tile


@triton.jit
def _load_state(pool, slot, stride_ps, hv, tile, o_k, m_v, use_slot, K: tl.constexpr, V: tl.constexpr):
    """The walk's float32 state tile: the slot's where use_slot, else zeros (an empty row range, so that
    the slot's old contents are never read)."""
    k_init = tl.where(use_slot, K, 0)
    p_state = pool + slot * stride_ps + hv * (K * V)
    return tl.load(p_state + tile, mask=(o_k < k_init)[:, None] & m_v[None, :], other=0.0).to(tl.float32)


# values that change from pass to pass: one compile serves them all (kernels/__init__.py)
@triton.jit(do_not_specialize=["num_seqs", "cu_seqlens", "slots", "has_initial_state", "capture"])
def _state_kernel(
    q, w, u, kd, scores, qscale, gcum, o, chunk_states, capture, pool, cu_seqlens, slots, has_initial_state, num_seqs,
    stride_qt, stride_qh, stride_ps, HV: tl.constexpr, GROUP: tl.constexpr,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, BLOCK_N: tl.constexpr,
    STORE_CHUNK_STATES: tl.constexpr, PREFETCH: tl.constexpr, STORE_CAPTURE: tl.constexpr,
):  # fmt: skip
    """The fused sequential kernel (output inside the chunk loop). PREFETCH: the chunk's qscale and
    decay are loaded one chunk ahead (at the end of the previous iteration) instead of in the middle
    of the dot chain, where each costs a full memory latency per chunk."""
    n, hv, o_k, o_v, m_k, m_v, bos, eos, num_chunks, slot, tile = _walk_start(cu_seqlens, slots, HV, K, V, BK, BV, BT)
    state = _load_state(pool, slot, stride_ps, hv, tile, o_k, m_v, tl.load(has_initial_state + n) != 0, K, V)
    m_kv = m_k[:, None] & m_v[None, :]
    o_t = tl.arange(0, BT)
    dt = w.dtype.element_ty
    if STORE_CHUNK_STATES or STORE_CAPTURE:
        first = chunks_before(cu_seqlens, n, BT, BLOCK_N)
    if STORE_CHUNK_STATES:
        p_cs = chunk_states + (first * HV + hv).to(tl.int64) * (K * V) + tile
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
            tl.store(p_cs + tl.cast(c, tl.int64) * (HV * K * V), state, mask=m_kv)
        if STORE_CAPTURE:  # a prefix-cache snapshot of the state after this chunk (gdn/state.py)
            dst = tl.load(capture + first + c).to(tl.int64)
            if dst >= 0:
                tl.store(pool + dst * stride_ps + hv * (K * V) + tile, state.to(pool.dtype.element_ty), mask=m_kv)
        if PREFETCH:
            # the next chunk's (the last chunk's again on the last iteration: always in bounds)
            t1 = bos + tl.minimum(c + 1, num_chunks - 1) * BT
            row1 = t1.to(tl.int64) * HV + hv
            b_qs_next = tl.load(qscale + row1 + o_t * HV, mask=o_t < eos - t1, other=0.0)
            g_last_next = tl.load(gcum + row1 + (tl.minimum(eos - t1, BT) - 1) * HV)
    if num_chunks > 0:
        tl.store(pool + slot * stride_ps + hv * (K * V) + tile, state.to(pool.dtype.element_ty), mask=m_kv)


# values that change from pass to pass: one compile serves them all (kernels/__init__.py)
@triton.jit(
    do_not_specialize=["num_seqs", "cu_seqlens", "slots", "has_initial_state", "capture", "chunk_lo", "chunk_hi"]
)
def _recur_kernel(
    k, w, u, kscale, gcum, h, chunk_states, capture, pool, cu_seqlens, slots, has_initial_state, num_seqs, chunk_lo,
    chunk_hi, stride_kt, stride_kh, stride_ps, HV: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr,
    V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, BLOCK_N: tl.constexpr,
    STORE_CHUNK_STATES: tl.constexpr, STORE_CAPTURE: tl.constexpr,
):  # fmt: skip
    """The split design's sequential kernel: only the recurrence. Per chunk it stores the state
    entering the chunk (h, input dtype) for _output_kernel, turns u into v_new = u - w S in place, and
    updates S = exp(gamma_last) S + k^T (kscale * v_new) with the raw keys (kscale folds the key norm
    and the decay to the chunk end into v_new's rows). Two dependent matmuls per chunk.

    Only the chunks of global index in [chunk_lo, chunk_hi) (varlen.py's numbering): a sequence's walk
    may be cut into windows, one launch each; a window that starts inside a sequence resumes from the
    float32 state the window before left in its slot (the same bits as one walk)."""
    n, hv, o_k, o_v, m_k, m_v, bos, eos, num_chunks, slot, tile = _walk_start(cu_seqlens, slots, HV, K, V, BK, BV, BT)
    first = chunks_before(cu_seqlens, n, BT, BLOCK_N)
    c_begin = tl.minimum(tl.maximum(chunk_lo - first, 0), num_chunks)
    c_end = tl.minimum(tl.maximum(chunk_hi - first, 0), num_chunks)
    if c_begin >= c_end:
        return
    use_slot = (c_begin > 0) | (tl.load(has_initial_state + n) != 0)
    state = _load_state(pool, slot, stride_ps, hv, tile, o_k, m_v, use_slot, K, V)
    m_kv = m_k[:, None] & m_v[None, :]
    o_t = tl.arange(0, BT)
    dt = w.dtype.element_ty
    p_h = h + (first * HV + hv).to(tl.int64) * (K * V) + tile
    if STORE_CHUNK_STATES:
        p_cs = chunk_states + (first * HV + hv).to(tl.int64) * (K * V) + tile
    p_k = k + (hv // GROUP) * stride_kh + o_t[:, None] * stride_kt + o_k[None, :]
    t_begin = bos + c_begin * BT
    b_ks_next = tl.load(kscale + t_begin.to(tl.int64) * HV + hv + o_t * HV, mask=o_t < eos - t_begin, other=0.0)
    g_last_next = _first_chunk_decay_log(gcum, hv, t_begin, eos, HV, BT)

    for c in range(c_begin, c_end):
        t0 = bos + c * BT
        m_t = o_t < eos - t0
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        row = t0.to(tl.int64) * HV + hv
        b_s = state.to(dt)
        tl.store(p_h + tl.cast(c, tl.int64) * (HV * K * V), b_s, mask=m_kv)
        b_w = tl.load(w + row * K + o_t[:, None] * (HV * K) + o_k[None, :], mask=m_tk, other=0.0)
        p_u = u + row * V + o_t[:, None] * (HV * V) + o_v[None, :]
        v_new = tl.load(p_u, mask=m_tv, other=0.0).to(tl.float32) - tl.dot(b_w, b_s)
        tl.store(p_u, v_new.to(dt), mask=m_tv)  # this program owns these columns: u becomes v_new
        b_k = tl.load(p_k + t0.to(tl.int64) * stride_kt, mask=m_tk, other=0.0).to(dt)
        v_scaled = (v_new * b_ks_next[:, None]).to(dt)
        state = state * tl.exp(g_last_next) + tl.dot(tl.trans(b_k), v_scaled)
        if STORE_CHUNK_STATES:
            tl.store(p_cs + tl.cast(c, tl.int64) * (HV * K * V), state, mask=m_kv)
        if STORE_CAPTURE:  # a prefix-cache snapshot of the state after this chunk (gdn/state.py)
            dst = tl.load(capture + first + c).to(tl.int64)
            if dst >= 0:
                tl.store(pool + dst * stride_ps + hv * (K * V) + tile, state.to(pool.dtype.element_ty), mask=m_kv)
        # the next chunk's small vectors, fetched a chunk ahead (the window's last chunk's again at its
        # end: a later window's may not be computed yet)
        t1 = bos + tl.minimum(c + 1, c_end - 1) * BT
        row1 = t1.to(tl.int64) * HV + hv
        b_ks_next = tl.load(kscale + row1 + o_t * HV, mask=o_t < eos - t1, other=0.0)
        g_last_next = tl.load(gcum + row1 + (tl.minimum(eos - t1, BT) - 1) * HV)
    tl.store(pool + slot * stride_ps + hv * (K * V) + tile, state.to(pool.dtype.element_ty), mask=m_kv)


# values that change from pass to pass: one compile serves them all (kernels/__init__.py)
@triton.jit(do_not_specialize=["num_seqs", "cu_seqlens", "chunk_lo"])
def _output_kernel(
    q, k, gcum, rnorm, h, v_new, o, gate, norm_weight, cu_seqlens, num_seqs, chunk_lo, scale, eps, stride_qt, stride_qh,
    stride_kt, stride_kh, stride_zt, stride_zh, HV: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr,
    V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, BLOCK_N: tl.constexpr,
    L2NORM: tl.constexpr, GATED: tl.constexpr,
):  # fmt: skip
    """The split design's output, parallel over (chunk, value head):
    o = qscale (q h) + (q k^T * causal decay, norms and scale folded in) v_new, over V in BV blocks.
    GATED: then the GDN output norm of each (token, head) row in place, weight * rms_norm(o) *
    silu(gate) (gate [T, HV, V] of strides stride_zt, stride_zh), o rounded to its dtype first as the
    norm kernel reads it: the rows' squares are summed over the V blocks, which are read back (this
    program's own stores, from L1 / L2) and scaled, so o never makes a trip to memory and back.
    Program i takes global chunk chunk_lo + i."""
    i_c = tl.program_id(0) + chunk_lo
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
    p_o = o + row * V + o_t[:, None] * (HV * V)
    squares = tl.zeros([BT], dtype=tl.float32)
    for vp in range(0, V, BV):
        o_v = vp + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        b_h = tl.load(p_h + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0)
        b_v = tl.load(v_new + row * V + o_t[:, None] * (HV * V) + o_v[None, :], mask=m_tv, other=0.0)
        out = tl.dot(b_q, b_h) * b_qs[:, None]
        out = tl.dot(b_sc, b_v, out).to(o.dtype.element_ty)
        tl.store(p_o + o_v[None, :], out, mask=m_tv)
        if GATED:
            out32 = out.to(tl.float32)
            squares += tl.sum(out32 * out32, 1)
    if GATED:
        inv = tl.rsqrt(squares / V + eps)
        tl.debug_barrier()  # the blocks stored above are read back by other threads
        p_z = gate + (t0 + o_t).to(tl.int64)[:, None] * stride_zt + hv * stride_zh
        for vp in range(0, V, BV):
            o_v = vp + tl.arange(0, BV)
            m_v = o_v < V
            m_tv = m_t[:, None] & m_v[None, :]
            x = tl.load(p_o + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
            z = tl.load(p_z + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
            wn = tl.load(norm_weight + o_v, mask=m_v, other=0.0).to(tl.float32)
            y = wn[None, :] * (x * inv[:, None]) * (z * tl.sigmoid(z))
            tl.store(p_o + o_v[None, :], y.to(o.dtype.element_ty), mask=m_tv)
