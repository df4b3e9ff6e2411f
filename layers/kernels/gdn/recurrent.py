"""Fused recurrent gated delta rule (decode, k-token verify) in Triton; same contract as
naive.fused_recurrent_gated_delta_rule.

One program per (sequence, value head, V-block): it reads its [K, BV] float32 state tile from the
pool slot once, runs the L tokens with l2norm, gating and the delta update in registers, writes
each token's output (and state, when asked), then writes the tile back. Memory-bound: the state
moves once each way.

ONE_PASS reads both products off the decayed state before the update, o = S'^T q + delta (k.q)
with S' = exp(g) S and delta = beta (v - S'^T k): the two reductions over K run side by side as
one multi-operand reduction, instead of the second waiting for the update.

RAW_GATE (the decode path's form: a, b, A_log, dt_bias given instead of g, beta) reads the raw
gate projections where in_proj wrote them and computes g = -exp(A_log) softplus(a + dt_bias) and
beta = sigmoid(b) in the kernel (gating.gate_values), saving the standalone gating launch.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ..pdl import pdl_launch, pdl_wait
from .gating import gate_values
from .naive import raw_gate_form
from .varlen import value_block

BLOCK_V = 32  # 32 float32 columns: each state row segment is one 128-byte line


@dataclasses.dataclass(frozen=True)
class RecurrentVariant:
    """block_v: state columns per program (the program count is N * Hv * V / block_v); num_warps;
    one_pass: see the module docstring; row_strides: when the [K, V] tiles of the pool (and of the
    intermediate states) are contiguous, address them with constant offsets, which frees the
    registers a [K, BV] tensor of 64-bit addresses holds; maxnreg: a register cap, so that more
    programs (and more state bytes in flight) fit on an SM. bench/kernels_gdn.py times variants
    side by side."""

    block_v: int = BLOCK_V
    num_warps: int = 4
    one_pass: bool = True
    row_strides: bool = True
    maxnreg: int | None = None


# fastest on the H200 at N = 1, 64 and 256 of the variants bench/kernels_gdn.py times (gdn/NOTES.md);
# registers only, so right on any GPU
DEFAULT_VARIANT = RecurrentVariant(block_v=64, num_warps=4)


@triton.jit
def _add_pair(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


# values that change from pass to pass: one compile serves them all (kernels/__init__.py)
@triton.jit(do_not_specialize=["slots", "lengths"])
def _recurrent_kernel(
    q, k, v, g, beta, A_log, dt_bias, o, pool, slots, inter, wy_k, wy_delta, wy_g, lengths, scale, length, stride_qn,
    stride_ql, stride_qh, stride_kn,
    stride_kl, stride_kh, stride_vn, stride_vl, stride_vh, stride_gn, stride_gl, stride_gh, stride_bn, stride_bl,
    stride_bh, stride_ps, stride_ph, stride_pk, stride_pv, stride_in, stride_il, stride_ih, stride_ik, stride_iv,
    HV: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    L2NORM: tl.constexpr, STORE_INTERMEDIATE: tl.constexpr, UPDATE_STATE: tl.constexpr, ONE_PASS: tl.constexpr,
    ROW_STRIDES: tl.constexpr, RAW_GATE: tl.constexpr, STORE_WY: tl.constexpr, HAS_LENGTHS: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    n, hv, o_k, o_v, m_k, m_v = value_block(tl.program_id(0), HV, K, V, BK, BV)
    hk = hv // GROUP
    m_kv = m_k[:, None] & m_v[None, :]
    steps = length
    if HAS_LENGTHS:  # a row of no steps leaves its state as it is: nothing to read or write
        steps = tl.load(lengths + n).to(tl.int32)
        if steps == 0:
            pdl_wait(USE_PDL)
            return

    slot = tl.load(slots + n).to(tl.int64)
    if ROW_STRIDES:  # the usual contiguous [K, V] tiles: constant offsets, one base address register
        p_pool = pool + slot * stride_ps + hv * stride_ph + o_k[:, None] * V + o_v[None, :]
    else:
        p_pool = pool + slot * stride_ps + hv * stride_ph + o_k[:, None] * stride_pk + o_v[None, :] * stride_pv
    # the state (and the gate constants below) come from earlier passes, never from the kernel
    # before this one (a conv): they load before the PDL wait (kernels/pdl.py), q / k / v after it
    state = tl.load(p_pool, mask=m_kv, other=0.0).to(tl.float32)

    n64 = n.to(tl.int64)
    p_q = q + n64 * stride_qn + hk * stride_qh + o_k
    p_k = k + n64 * stride_kn + hk * stride_kh + o_k
    p_v = v + n64 * stride_vn + hv * stride_vh + o_v
    p_g = g + n64 * stride_gn + hv * stride_gh
    p_b = beta + n64 * stride_bn + hv * stride_bh
    if RAW_GATE:  # g, beta point at the raw a, b
        neg_a_exp = -tl.exp(tl.load(A_log + hv).to(tl.float32))
        bias = tl.load(dt_bias + hv).to(tl.float32)
    pdl_wait(USE_PDL)
    p_o = o + (n64 * length * HV + hv) * V + o_v
    if ROW_STRIDES:
        p_i = inter + n64 * stride_in + hv * stride_ih + o_k[:, None] * V + o_v[None, :]
    else:
        p_i = inter + n64 * stride_in + hv * stride_ih + o_k[:, None] * stride_ik + o_v[None, :] * stride_iv
    for t in range(steps):
        b_q = tl.load(p_q + t * stride_ql, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(p_k + t * stride_kl, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(p_v + t * stride_vl, mask=m_v, other=0.0).to(tl.float32)
        b_g = tl.load(p_g + t * stride_gl).to(tl.float32)
        b_beta = tl.load(p_b + t * stride_bl).to(tl.float32)
        if RAW_GATE:
            b_g, b_beta = gate_values(b_g, b_beta, neg_a_exp, bias)
        if L2NORM:
            b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, 0) + 1e-6)
            b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, 0) + 1e-6)
        state = state * tl.exp(b_g)
        if ONE_PASS:
            b_q = b_q * scale
            pred, b_o = tl.reduce((state * b_k[:, None], state * b_q[:, None]), 0, _add_pair)
            delta = b_beta * (b_v - pred)
            b_o += delta * tl.sum(b_k * b_q, 0)
            state = state + b_k[:, None] * delta[None, :]
        else:
            delta = b_beta * (b_v - tl.sum(state * b_k[:, None], 0))
            state = state + b_k[:, None] * delta[None, :]
            b_o = tl.sum(state * (b_q * scale)[:, None], 0)
        tl.store(p_o + t * HV * V, b_o.to(o.dtype.element_ty), mask=m_v)
        if STORE_WY:  # the step write-on-accept replays (gdn/state.py): contiguous [N, L, Hv, *] tables
            wy_row = (n64 * length + t) * HV + hv
            tl.store(wy_delta + wy_row * V + o_v, delta, mask=m_v)
            if tl.program_id(0) % tl.cdiv(V, BV) == 0:
                tl.store(wy_k + wy_row * K + o_k, b_k, mask=m_k)
                tl.store(wy_g + wy_row, b_g)
        if STORE_INTERMEDIATE:
            tl.store(p_i + t * stride_il, state.to(inter.dtype.element_ty), mask=m_kv)
    if UPDATE_STATE:
        tl.store(p_pool, state.to(pool.dtype.element_ty), mask=m_kv)


def fused_recurrent_gated_delta_rule(
    *, q, k, v, state_pool, state_slots, g=None, beta=None, a=None, b=None, A_log=None, dt_bias=None, scale=None,
    use_qk_l2norm=True, intermediate_states_out=None, update_state=True, verify_table=None, variant=None, pdl=True,
    lengths=None,
):  # fmt: skip
    """gdn.fused_recurrent_gated_delta_rule; variant: a RecurrentVariant (None: DEFAULT_VARIANT).
    Raw gates: the kernel computes g and beta as gating.gdn_gating would."""
    raw_gate = raw_gate_form(g, beta, a, b, A_log, dt_bias)
    if raw_gate:
        g, beta = a, b  # the kernel reads them through the g / beta pointers and strides
    else:
        A_log = dt_bias = g  # never read
    cfg = variant or DEFAULT_VARIANT
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    num_seqs, length, num_k_heads, key_dim = q.shape
    num_v_heads, value_dim = v.shape[2], v.shape[3]
    scale = key_dim**-0.5 if scale is None else scale
    out = torch.empty((num_seqs, length, num_v_heads, value_dim), dtype=v.dtype, device=v.device)
    if num_seqs == 0 or length == 0:
        return out
    # without intermediate states the pool stands in as a (never written) pointer argument
    inter = intermediate_states_out if intermediate_states_out is not None else state_pool
    wy = verify_table
    if wy is not None and tuple(wy.k.shape[:2]) != (num_seqs, length):
        raise ValueError(f"verify_table: rows {tuple(wy.k.shape[:2])} differ from the call's ({num_seqs}, {length})")
    row_strides = cfg.row_strides and all(t.stride(-1) == 1 and t.stride(-2) == value_dim for t in (state_pool, inter))
    bv = min(cfg.block_v, max(16, triton.next_power_of_2(value_dim)))
    grid = (num_seqs * num_v_heads * triton.cdiv(value_dim, bv),)
    _recurrent_kernel[grid](
        q, k, v, g, beta, A_log, dt_bias, out, state_pool, state_slots, inter,
        *((wy.k, wy.delta, wy.g) if wy is not None else (out, out, out)),
        lengths if lengths is not None else state_slots, scale, length,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *g.stride(), *beta.stride(), *state_pool.stride(),
        inter.stride(0), inter.stride(1) if intermediate_states_out is not None else 0, *inter.stride()[-3:],
        HV=num_v_heads, GROUP=num_v_heads // num_k_heads, K=key_dim, V=value_dim,
        BK=max(16, triton.next_power_of_2(key_dim)), BV=bv, L2NORM=use_qk_l2norm,
        STORE_INTERMEDIATE=intermediate_states_out is not None, UPDATE_STATE=update_state, ONE_PASS=cfg.one_pass,
        ROW_STRIDES=row_strides, RAW_GATE=raw_gate, STORE_WY=wy is not None, HAS_LENGTHS=lengths is not None,
        num_warps=cfg.num_warps,
        **({} if cfg.maxnreg is None else {"maxnreg": cfg.maxnreg}),
        **pdl_launch(q, pdl),
    )  # fmt: skip
    return out
