"""Write-on-accept in Triton; same contracts as state.accept_states_naive / conv_accept_naive.

Recurrent state: one program per (row, value head, V-block) and layer loads its [K, BV] float32 state
tile from the slot, replays the accepted verify steps (state = exp(g) state + k delta^T, the verify
kernel's own update) and stores it back. Conv windows: one program per (row, channel block) and
layer. The accepted count is read on the device, so the step needs no host round trip.

Both take a leading layer dimension (pools [layers, S, ...], tables [layers, N, ...]): every GDN
layer of the model in one launch (the per-layer entry points are the one-layer case).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:  # state.accept_states imports this module (when CUDA)
    from .state import VerifyTable

BLOCK_V = 64
CONV_BLOCK_C = 256


@triton.jit(do_not_specialize=["slots", "last_accepted"])
def _accept_kernel(
    pool, slots, last_accepted, wy_k, wy_delta, wy_g, length, stride_pl, stride_ps, stride_ph, stride_pk, stride_pv,
    stride_kl, stride_dl, stride_gl, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    NV = tl.cdiv(V, BV)
    i_v = pid % NV
    hv = pid // NV % HV
    n = pid // NV // HV
    last = tl.load(last_accepted + n).to(tl.int32)
    if last < 0:
        return
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    slot = tl.load(slots + n).to(tl.int64)
    p_pool = pool + layer * stride_pl + slot * stride_ps + hv * stride_ph
    p_pool += o_k[:, None] * stride_pk + o_v[None, :] * stride_pv
    state = tl.load(p_pool, mask=m_kv, other=0.0).to(tl.float32)
    n64 = n.to(tl.int64)
    for t in range(0, last + 1):
        row = (n64 * length + t) * HV + hv
        b_k = tl.load(wy_k + layer * stride_kl + row * K + o_k, mask=m_k, other=0.0)
        b_d = tl.load(wy_delta + layer * stride_dl + row * V + o_v, mask=m_v, other=0.0)
        b_g = tl.load(wy_g + layer * stride_gl + row)
        state = state * tl.exp(b_g)
        state = state + b_k[:, None] * b_d[None, :]
    tl.store(p_pool, state.to(pool.dtype.element_ty), mask=m_kv)


def accept_states_layers(
    *, state_pools: torch.Tensor, state_slots: torch.Tensor, table: VerifyTable, last_accepted: torch.Tensor
) -> None:
    """state.accept_states over a layer dimension: state_pools [layers, S, Hv, K, V]; table's k
    [layers, N, L, Hv, K], delta [layers, N, L, Hv, V], g [layers, N, L, Hv] (each layer's rows
    contiguous: a row slice of larger tables is fine). One launch."""
    num_layers, num_rows, length, num_v_heads, key_dim = table.k.shape
    value_dim = table.delta.shape[-1]
    if num_rows == 0 or num_layers == 0:
        return
    for t in (table.k[0], table.delta[0], table.g[0]):
        assert t.is_contiguous(), "each layer's verify table rows contiguous"
    bv = min(BLOCK_V, max(16, triton.next_power_of_2(value_dim)))
    grid = (num_rows * num_v_heads * triton.cdiv(value_dim, bv), num_layers)
    _accept_kernel[grid](
        state_pools, state_slots, last_accepted, table.k, table.delta, table.g, length, *state_pools.stride(),
        table.k.stride(0), table.delta.stride(0), table.g.stride(0), HV=num_v_heads, K=key_dim, V=value_dim,
        BK=max(16, triton.next_power_of_2(key_dim)), BV=bv, num_warps=4,
    )  # fmt: skip


def accept_states(
    *, state_pool: torch.Tensor, state_slots: torch.Tensor, table: VerifyTable, last_accepted: torch.Tensor
) -> None:
    """See state.accept_states: the one-layer case of accept_states_layers."""
    one = type(table)(table.k[None], table.delta[None], table.g[None])  # state imports this module
    accept_states_layers(state_pools=state_pool[None], state_slots=state_slots, table=one, last_accepted=last_accepted)


@triton.jit(do_not_specialize=["slots", "last_accepted"])
def _conv_accept_kernel(
    pool, slots, last_accepted, x, channels, stride_pl, stride_ps, stride_pc, stride_pw, stride_xl, stride_xn,
    stride_xt, W1: tl.constexpr, BW: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    """Row n, channel block 1, layer 2: window j = (the slot's window before the verify, then the
    verify's inputs)[last + 1 + j], read whole before any of it is overwritten."""
    n = tl.program_id(0)
    o_c = tl.program_id(1) * BC + tl.arange(0, BC)
    layer = tl.program_id(2).to(tl.int64)
    o_w = tl.arange(0, BW)
    last = tl.load(last_accepted + n).to(tl.int32)
    if last < 0:  # nothing accepted: the slot keeps its window
        return
    slot = tl.load(slots + n).to(tl.int64)
    src = last + 1 + o_w  # into (window, inputs)
    m = (o_c < channels)[:, None] & (o_w < W1)[None, :]
    p_s = pool + layer * stride_pl + slot * stride_ps + o_c[:, None] * stride_pc
    old = tl.load(p_s + src[None, :] * stride_pw, mask=m & (src < W1)[None, :], other=0.0)
    p_x = x + layer * stride_xl + n.to(tl.int64) * stride_xn + (src - W1)[None, :].to(tl.int64) * stride_xt
    new = tl.load(p_x + o_c[:, None], mask=m & (src >= W1)[None, :], other=0.0).to(pool.dtype.element_ty)
    window = tl.where((src < W1)[None, :], old, new)
    tl.debug_barrier()  # every thread has read the old window before it is overwritten
    tl.store(p_s + o_w[None, :] * stride_pw, window, mask=m)


def conv_accept_layers(
    *, conv_state_pools: torch.Tensor, state_slots: torch.Tensor, x: torch.Tensor, last_accepted: torch.Tensor
) -> None:
    """state.conv_accept over a layer dimension: conv_state_pools [layers, S, C, W - 1]; x [layers,
    N, L, C] (channels contiguous). One launch, grid (N, C / CONV_BLOCK_C, layers)."""
    num_layers, num_rows, _, channels = x.shape
    width_1 = conv_state_pools.shape[-1]
    if num_rows == 0 or channels == 0 or width_1 == 0 or num_layers == 0:
        return
    assert x.stride(3) == 1, "x [layers, N, L, C] with contiguous channels"
    _conv_accept_kernel[(num_rows, triton.cdiv(channels, CONV_BLOCK_C), num_layers)](
        conv_state_pools, state_slots, last_accepted, x, channels, *conv_state_pools.stride(), *x.stride()[:3],
        W1=width_1, BW=triton.next_power_of_2(width_1), BC=CONV_BLOCK_C, num_warps=4,
    )  # fmt: skip


def conv_accept(
    *, conv_state_pool: torch.Tensor, state_slots: torch.Tensor, x: torch.Tensor, last_accepted: torch.Tensor
) -> None:
    """See state.conv_accept: the one-layer case of conv_accept_layers."""
    conv_accept_layers(
        conv_state_pools=conv_state_pool[None], state_slots=state_slots, x=x[None], last_accepted=last_accepted
    )
