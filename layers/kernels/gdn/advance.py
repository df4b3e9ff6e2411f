"""Capture replays on the chunked op's own intermediates (state.py: a prefix-cache capture inside a
chunk is the state at the chunk's start, on the capture's slot, advanced by the chunk's first
`count` tokens): every replay of a call in one launch, after the sequential kernel.

The rows of a chunk's WY transform before a cut are those of the chunk cut there ((I + A)^-1 is
lower triangular), so a replay solves nothing again: with S the state entering the chunk,
v_new = u - w S (the split design's recurrence leaves v_new in u; the fused one leaves u) and
c = count - 1,
    S_c = exp(gamma_c) S + sum_{i <= c} rnorm_i exp(gamma_c - gamma_i) k_i v_new_i^T,
one or two matmuls a (replay, value head, V-block) program. Same contract as the reference's
token-by-token replay (naive.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 32  # V columns a program: more programs for the few replays of a pass


# the entries are views of a plan's device arrays (a graph's static buffers): not compile keys
@triton.jit(do_not_specialize=["first", "count", "slots"])
def _advance_kernel(
    k, w, u, gcum, rnorm, pool, first, count, slots, stride_kt, stride_kh, stride_ps, stride_ph, stride_pk, stride_pv,
    HV: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BT: tl.constexpr, L2NORM: tl.constexpr, V_NEW: tl.constexpr,
):  # fmt: skip
    """Program (replay e, value head and V-block): the slot's [K, BV] state tile advanced by the
    first count[e] tokens of the chunk starting at row first[e]; count 0: nothing (unused entry).
    V_NEW: u holds v_new already (split design)."""
    e = tl.program_id(0)
    num = tl.load(count + e).to(tl.int32)
    if num <= 0:
        return
    NV: tl.constexpr = (V + BV - 1) // BV
    hv = tl.program_id(1) // NV
    o_v = (tl.program_id(1) % NV) * BV + tl.arange(0, BV)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_t, m_k, m_v = o_t < num, o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    t0 = tl.load(first + e).to(tl.int64)
    slot = tl.load(slots + e).to(tl.int64)
    p_pool = pool + slot * stride_ps + hv * stride_ph + o_k[:, None] * stride_pk + o_v[None, :] * stride_pv
    state = tl.load(p_pool, mask=m_kv, other=0.0).to(tl.float32)
    row = t0 * HV + hv
    dt = w.dtype.element_ty
    v_new = tl.load(u + row * V + o_t[:, None] * (HV * V) + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
    v_new = v_new.to(tl.float32)
    if not V_NEW:
        b_w = tl.load(w + row * K + o_t[:, None] * (HV * K) + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        v_new = v_new - tl.dot(b_w, state.to(dt))
    p_k = k + t0 * stride_kt + (hv // GROUP) * stride_kh + o_t[:, None] * stride_kt + o_k[None, :]
    b_k = tl.load(p_k, mask=m_t[:, None] & m_k[None, :], other=0.0).to(dt)
    b_gc = tl.load(gcum + row + o_t * HV, mask=m_t, other=0.0)
    g_cut = tl.load(gcum + row + (num - 1) * HV)
    scale = tl.exp(g_cut - b_gc)
    if L2NORM:
        scale = scale * tl.load(rnorm + row + o_t * HV, mask=m_t, other=0.0)
    v_scaled = (v_new * tl.where(m_t, scale, 0.0)[:, None]).to(dt)
    state = state * tl.exp(g_cut) + tl.dot(tl.trans(b_k), v_scaled)
    tl.store(p_pool, state.to(pool.dtype.element_ty), mask=m_kv)


def advance_within_chunks(
    *,
    k: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    gcum: torch.Tensor,
    rnorm: torch.Tensor,
    state_pool: torch.Tensor,
    first: torch.Tensor,
    count: torch.Tensor,
    slots: torch.Tensor,
    v_new: bool,
    l2norm: bool,
    chunk: int,
) -> None:
    """Advance each entry's slot state (pool [S, Hv, K, V] float32) by the first count[e] tokens
    (0 < count < chunk; 0: unused) of the chunk starting at token row first[e], from the chunked op's
    intermediates: k [T, Hk, K] (raw keys), w [T, Hv, K], u [T, Hv, V] (v_new when `v_new`), gcum and
    rnorm [T, Hv] float32 (rnorm read only with `l2norm`). first, count, slots: [E] integer tensors."""
    num_tokens, num_k_heads, key_dim = k.shape
    num_v_heads, value_dim = u.shape[1], u.shape[2]
    entries = first.shape[0]
    if entries == 0 or num_tokens == 0:
        return
    assert k.stride(-1) == 1 and w.is_contiguous() and u.is_contiguous(), "k rows, w and u contiguous"
    bv = min(BLOCK_V, max(16, triton.next_power_of_2(value_dim)))
    grid = (entries, num_v_heads * triton.cdiv(value_dim, bv))
    _advance_kernel[grid](
        k, w, u, gcum, rnorm, state_pool, first, count, slots, k.stride(0), k.stride(1), *state_pool.stride(),
        HV=num_v_heads, GROUP=num_v_heads // num_k_heads, K=key_dim, V=value_dim,
        BK=max(16, triton.next_power_of_2(key_dim)), BV=bv, BT=chunk, L2NORM=l2norm, V_NEW=v_new, num_warps=4,
    )  # fmt: skip
