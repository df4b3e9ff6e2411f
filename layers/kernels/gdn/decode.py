"""The whole GDN decode step between in_proj and out_proj in one Triton kernel (one token per
sequence); same contract as naive.fused_gdn_decode, which composes the three ops it replaces:

    conv1d update (SiLU) -> fused recurrent gated delta rule (raw gates, q/k l2norm) -> gated RMSNorm

Grid: one program per (sequence, value head, block of block_v value columns), as the recurrent
kernel's: the recurrent state (2 MB a layer at batch 1) is what takes the time, and it moves
fastest spread over many SMs (a program per key head, or per whole value head, is slower:
gdn/NOTES.md). Each program computes the conv of its key head's q and k
(K channels each: the l2norm and the products need all of them) and of its own v columns, runs the
delta rule on its [K, block_v] state tile and writes its output columns, rounded as the recurrent
kernel stores them, into the output.

Two things span programs: the q / k conv window of a key head is read by its GROUP * NV programs
(NV = V / block_v) and must be shifted once, after all of them have read it; and the norm of a value
head needs all its V outputs. Both go to the last of the key head's programs to finish, found with
a ticket: after a CTA barrier, one atomic add (acq_rel, gpu scope) on a counter per (sequence, key
head); the program that draws GROUP * NV - 1 shifts the q / k windows from its registers (every
program computed the same), reads the GROUP heads' outputs back and norms them in place, and
zeroes the counter for the next launch. (The pattern of CUTLASS's serial split-K semaphore: the
barrier orders every thread's stores and window reads before the release, the acquire orders the
last program's loads and stores after them.) The counters are one zeroed int32 buffer per device
(`device.ticket_counters`), shared by every launch: launches on a device must not overlap. The v
windows are each program's own (a barrier, then the shift).

Rounding follows the unfused path, so that results agree within bf16 rounding (and bit for bit
under the interpreter): the conv output is rounded to the activations' dtype (the conv kernel
stores it), the recurrent output too before the norm, the normed output is in that dtype. The
math is the three kernels' own: the conv's [C, W] tap sum and SiLU, the recurrent kernel's
ONE_PASS update with rsqrt(sum x^2 + 1e-6) l2norm, scale K**-0.5 and gating.gate_values, the
norm's w * (x * rstd) * silu(z) (plain weight, as gated_rms_norm). Only the pool slots of the batch
are written (float32 state and conv windows, in place); no host syncs, so a CUDA graph can capture
it (only shapes decide the launch; the ticket buffer must exist before the capture).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..device import ticket_counters
from ..pdl import pdl_launch, pdl_wait
from .gating import gate_values
from .recurrent import _add_pair

DECODE_WARPS = 4
# value columns per program: on the H200, in CUDA graphs, 32 beat 64 at every N measured (1 to 256),
# and 128 (a whole value head, no ticket needed for the norm) lost by 1.7x at N = 1
BLOCK_V = 32


@triton.jit
def _window_load(weight, p_win, c, m_c, stride_cc, stride_cw, stride_wc, W: tl.constexpr, BW: tl.constexpr):
    """The loads of the conv of channels c that the previous kernel does not write: the window
    [len(c), BW] (positions >= W - 1 zero), the taps [len(c), BW] and the window shifted by one
    (position i holds window position i + 1, the last valid position zero). Nothing computed, so
    that the caller can issue every load before the first layout conversion's barrier."""
    o_w = tl.arange(0, BW)
    p_c = p_win + c[:, None] * stride_cc
    window = tl.load(p_c + o_w[None, :] * stride_cw, mask=m_c[:, None] & (o_w < W - 1)[None, :], other=0.0)
    taps = tl.load(weight + c[:, None] * stride_wc + o_w[None, :], mask=m_c[:, None] & (o_w < W)[None, :], other=0.0)
    shifted = tl.load(p_c + (o_w + 1)[None, :] * stride_cw, mask=m_c[:, None] & (o_w + 1 < W - 1)[None, :], other=0.0)
    return window, taps, shifted


@triton.jit
def _conv_silu(b_x, window, taps, shifted, W: tl.constexpr, BW: tl.constexpr):
    """SiLU(conv) of the loaded channels rounded to the input's dtype (as the conv kernel stores
    it) and returned as float32, and the new window (the shifted one with the new input at W - 2).
    The conv update kernel's operations (its bits under the interpreter)."""
    o_w = tl.arange(0, BW)
    seq = window.to(tl.float32) + tl.where((o_w == W - 1)[None, :], b_x.to(tl.float32)[:, None], 0.0)
    y = tl.sum(seq * taps.to(tl.float32), 1)
    y = y / (1.0 + tl.exp(-y))
    new_window = shifted + tl.where((o_w + 1 == W - 1)[None, :], b_x.to(shifted.dtype)[:, None], 0.0)
    return y.to(b_x.dtype).to(tl.float32), new_window


@triton.jit
def _store_window(p_win, window, c, m_c, stride_cc, stride_cw, W: tl.constexpr, BW: tl.constexpr):
    """Write the shifted window ([len(c), BW], positions >= W - 1 unused) of channels c."""
    o_w = tl.arange(0, BW)
    p = p_win + c[:, None] * stride_cc + o_w[None, :] * stride_cw
    tl.store(p, window, mask=m_c[:, None] & (o_w < W - 1)[None, :])


# values that change from pass to pass: one compile serves them all (kernels/__init__.py)
@triton.jit(do_not_specialize=["slots"])
def _fused_gdn_decode_kernel(
    x, z, a, b, conv_weight, conv_pool, A_log, dt_bias, norm_weight, pool, slots, out, tickets, scale, eps, stride_xn,
    stride_zn, stride_zh, stride_an, stride_ah, stride_bn, stride_bh, stride_cs, stride_cc, stride_cw, stride_wc,
    stride_ps, stride_ph, stride_pk, stride_pv, HK: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    W: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BG: tl.constexpr, BVH: tl.constexpr, BW: tl.constexpr,
    ROW_STRIDES: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    NV: tl.constexpr = (V + BV - 1) // BV
    HV: tl.constexpr = HK * GROUP
    i_v = pid % NV
    hv = pid // NV % HV
    n = (pid // NV // HV).to(tl.int64)
    hk = hv // GROUP
    slot = tl.load(slots + n).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    x_row = x + n * stride_xn
    p_win = conv_pool + slot * stride_cs
    if ROW_STRIDES:  # contiguous [K, V] tiles: constant offsets from one base address
        p_state = pool + slot * stride_ps + hv * (K * V) + o_k[:, None] * V + o_v[None, :]
    else:
        p_state = pool + slot * stride_ps + hv * stride_ph + o_k[:, None] * stride_pk + o_v[None, :] * stride_pv

    # every load up front, before any math, so that the compute waits for one round trip (on
    # sm_90 ptxas keeps them there: SASS of Triton 3.6 and 3.9). The state, the conv windows and
    # the weights are not written by the previous kernel (in_proj), and every kernel before that
    # has completed once this one runs (each passes its own wait before letting the next launch):
    # they load before the PDL wait, while in_proj still streams its weights
    state = tl.load(p_state, mask=m_kv, other=0.0).to(tl.float32)
    c_q = hk * K + o_k
    c_k = HK * K + c_q
    c_v = 2 * HK * K + hv * V + o_v
    win_q = _window_load(conv_weight, p_win, c_q, m_k, stride_cc, stride_cw, stride_wc, W, BW)
    win_k = _window_load(conv_weight, p_win, c_k, m_k, stride_cc, stride_cw, stride_wc, W, BW)
    win_v = _window_load(conv_weight, p_win, c_v, m_v, stride_cc, stride_cw, stride_wc, W, BW)
    a_log = tl.load(A_log + hv)
    bias = tl.load(dt_bias + hv)
    pdl_wait(USE_PDL)
    x_q = tl.load(x_row + c_q, mask=m_k, other=0.0)
    x_k = tl.load(x_row + c_k, mask=m_k, other=0.0)
    x_v = tl.load(x_row + c_v, mask=m_v, other=0.0)
    raw_a = tl.load(a + n * stride_an + hv * stride_ah)
    raw_b = tl.load(b + n * stride_bn + hv * stride_bh)

    # the conv outputs rounded as the conv kernel stores them; q, k: the recurrent kernel's l2norm and scale
    b_q, win_q = _conv_silu(x_q, *win_q, W, BW)
    b_k, win_k = _conv_silu(x_k, *win_k, W, BW)
    b_v, win_v = _conv_silu(x_v, *win_v, W, BW)
    b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, 0) + 1e-6)
    b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, 0) + 1e-6)
    b_q = b_q * scale

    # the recurrent kernel's RAW_GATE gates and ONE_PASS update
    neg_a_exp = -tl.exp(a_log.to(tl.float32))
    b_g, b_beta = gate_values(raw_a.to(tl.float32), raw_b.to(tl.float32), neg_a_exp, bias.to(tl.float32))
    state = state * tl.exp(b_g)
    pred, b_o = tl.reduce((state * b_k[:, None], state * b_q[:, None]), 0, _add_pair)
    delta = b_beta * (b_v - pred)
    b_o += delta * tl.sum(b_k * b_q, 0)
    state = state + b_k[:, None] * delta[None, :]
    # the output, rounded as the recurrent kernel stores it, not normed yet (the norm needs all of V)
    p_out = out + (n * HV + hv) * V
    tl.store(p_out + o_v, b_o.to(out.dtype.element_ty), mask=m_v)

    # The last of the key head's GROUP * NV programs to get here (a ticket) shifts the q / k
    # windows, which all of them read, and norms the outputs of its GROUP value heads, which all
    # of them wrote. The barrier orders every thread's output stores and window reads before the
    # ticket's release; the ticket's acquire orders the last program's reads and writes after
    # every release (CUTLASS's serial split-K semaphore, one thread per CTA).
    tl.debug_barrier()
    p_ticket = tickets + n * HK + hk
    last = tl.atomic_add(p_ticket, 1, sem="acq_rel", scope="gpu") == GROUP * NV - 1
    # after the release, so that it does not wait for them: the state tile and the v windows are
    # this program's alone (the barrier above: every thread has read its window)
    tl.store(p_state, state.to(pool.dtype.element_ty), mask=m_kv)
    _store_window(p_win, win_v, c_v, m_v, stride_cc, stride_cw, W, BW)
    if last:
        tl.store(p_ticket, 0)  # for the next launch, which runs after this grid has completed
        _store_window(p_win, win_q, c_q, m_k, stride_cc, stride_cw, W, BW)
        _store_window(p_win, win_k, c_k, m_k, stride_cc, stride_cw, W, BW)
        o_g = tl.arange(0, BG)
        o_f = tl.arange(0, BVH)
        m_gf = (o_g < GROUP)[:, None] & (o_f < V)[None, :]
        hv_g = hk * GROUP + o_g
        p_core = out + (n * HV + hv_g)[:, None] * V + o_f[None, :]
        core = tl.load(p_core, mask=m_gf, other=0.0, cache_modifier=".cg").to(tl.float32)
        gate = tl.load(z + n * stride_zn + hv_g[:, None] * stride_zh + o_f[None, :], mask=m_gf, other=0.0)
        gate = gate.to(tl.float32)
        w = tl.load(norm_weight + o_f, mask=o_f < V, other=0.0).to(tl.float32)
        inv = tl.rsqrt(tl.sum(core * core, 1) / V + eps)
        y = w[None, :] * (core * inv[:, None]) * (gate * tl.sigmoid(gate))
        tl.store(p_core, y.to(out.dtype.element_ty), mask=m_gf)


def fused_gdn_decode(
    *, mixed_qkv, z, a, b, conv_weight, conv_state_pool, A_log, dt_bias, state_pool, state_slots, norm_weight, eps,
    scale=None, block_v=None, num_warps=DECODE_WARPS, pdl=True,
):  # fmt: skip
    """gdn.fused_gdn_decode in one launch. Grid: N * Hv * cdiv(V, block_v) programs of num_warps
    warps (block_v None: BLOCK_V). The last dims of mixed_qkv and z must be contiguous, or they are
    copied."""
    mixed_qkv = mixed_qkv if mixed_qkv.stride(-1) == 1 else mixed_qkv.contiguous()
    z = z if z.stride(-1) == 1 else z.contiguous()
    conv_weight = conv_weight if conv_weight.stride(-1) == 1 else conv_weight.contiguous()
    num_seqs, channels = mixed_qkv.shape
    num_v_heads, key_dim, value_dim = state_pool.shape[1:]
    num_k_heads = (channels - num_v_heads * value_dim) // (2 * key_dim)
    width = conv_weight.shape[1]
    assert num_k_heads > 0 and num_v_heads % num_k_heads == 0, (mixed_qkv.shape, state_pool.shape)
    assert channels == 2 * num_k_heads * key_dim + num_v_heads * value_dim, (mixed_qkv.shape, state_pool.shape)
    assert z.shape == (num_seqs, num_v_heads, value_dim) and a.shape == b.shape == (num_seqs, num_v_heads)
    assert conv_weight.shape[0] == channels and conv_state_pool.shape[1:] == (channels, width - 1)
    group = num_v_heads // num_k_heads
    scale = key_dim**-0.5 if scale is None else scale
    out = torch.empty((num_seqs, num_v_heads, value_dim), dtype=mixed_qkv.dtype, device=mixed_qkv.device)
    if num_seqs == 0:
        return out
    block_v = block_v or min(BLOCK_V, max(16, triton.next_power_of_2(value_dim)))
    tickets = ticket_counters(mixed_qkv.device, num_seqs * num_k_heads, "fused_gdn_decode")
    row_strides = state_pool.stride()[-2:] == (value_dim, 1)
    grid = (num_seqs * num_v_heads * triton.cdiv(value_dim, block_v),)
    _fused_gdn_decode_kernel[grid](
        mixed_qkv, z, a, b, conv_weight, conv_state_pool, A_log, dt_bias, norm_weight, state_pool, state_slots, out,
        tickets, scale, eps, mixed_qkv.stride(0), z.stride(0), z.stride(1), *a.stride(), *b.stride(),
        *conv_state_pool.stride(), conv_weight.stride(0), *state_pool.stride(),
        HK=num_k_heads, GROUP=group, K=key_dim, V=value_dim, W=width, BK=max(16, triton.next_power_of_2(key_dim)),
        BV=block_v, BG=triton.next_power_of_2(group), BVH=max(16, triton.next_power_of_2(value_dim)),
        BW=triton.next_power_of_2(width), ROW_STRIDES=row_strides,
        num_warps=num_warps,
        **pdl_launch(mixed_qkv, pdl),
    )  # fmt: skip
    return out
