"""Causal depthwise conv1d with a carried window in Triton; same contract as naive.py.

Prefill (`causal_conv1d_varlen`): one program per (chunk of BT tokens of one sequence, BC
channels) computes its rows from W shifted loads of the input tile. The first W - 1 positions of
a sequence also read the slot's window (or zeros); the program holding the sequence's first chunk
computes them, and being the only reader of that window it then writes the new one (the last
W - 1 inputs) after a barrier. Decode (`causal_conv1d_update`): one program per (sequence, BC
channels) shifts the window by the new input. No host syncs: chunks are located inside the
kernel from cu_seqlens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..gdn.varlen import locate_chunk
from ..pdl import pdl_launch, pdl_wait
from .naive import is_silu

BLOCK_T = 64  # tokens per prefill program
BLOCK_C = 128  # channels per prefill program: 256-byte bf16 rows
# the prefill kernel's (tokens, channels, warps) a program. The sweep (`python -m
# deltaserve.bench.kernels_conv1d --sweep`, one H100, 2026-12-05) put (32, 128, 4) first or within 1% of
# it at 2k / 8k / 32k tokens: 37.8 / 119.9 / 439.3 us against 46.7 / 150.8 / 561.0 for (64, 128, 8),
# the earlier default (sm_90: 76 against 104 registers, 6 programs an SM against 2: more bytes in flight)
VARLEN_TILES = (32, 128, 4)
BLOCK_N = 64  # sequences scanned per step when locating chunks
UPDATE_BLOCK_C = 256  # channels per decode program


@triton.jit
def _activate(y, SILU: tl.constexpr):
    if SILU:
        y = y / (1.0 + tl.exp(-y))
    return y


@triton.jit
def _conv_rows(
    p_x, p_s, weight, bias, o_c, m_c, pos, m_t, stride_xt, stride_sw, stride_wc, win_lo, W: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """float32 conv outputs at sequence positions `pos` (rows) for channels `o_c`; taps before the
    sequence start read window positions [win_lo, 0), zeros elsewhere."""
    acc = tl.zeros([pos.shape[0], o_c.shape[0]], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias + o_c, mask=m_c, other=0.0).to(tl.float32)[None, :]
    m = m_t[:, None] & m_c[None, :]
    for j in tl.static_range(W):
        src = pos - (W - 1) + j
        tap = tl.load(weight + o_c * stride_wc + j, mask=m_c, other=0.0).to(tl.float32)
        xin = tl.load(p_x + src.to(tl.int64)[:, None] * stride_xt, mask=m & (src >= 0)[:, None], other=0.0)
        xin = xin.to(tl.float32)
        if p_s is not None:
            win_m = m & ((src < 0) & (src >= win_lo))[:, None]
            xin += tl.load(p_s + (src + W - 1)[:, None] * stride_sw, mask=win_m, other=0.0).to(tl.float32)
        acc += xin * tap[None, :]
    return acc


# values that change from pass to pass: one compile serves them all (kernels/__init__.py)
@triton.jit(do_not_specialize=["num_seqs", "cu_seqlens", "slots", "has_initial_state"])
def _conv_varlen_kernel(
    x, weight, bias, y, state, cu_seqlens, slots, has_initial_state, saved, num_seqs, channels, stride_xt, stride_yt,
    stride_ss, stride_sc, stride_sw, stride_wc, stride_st, W: tl.constexpr, BW: tl.constexpr, BT: tl.constexpr,
    BC: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, UPDATE_STATE: tl.constexpr,
    SAVE_X: tl.constexpr,
):  # fmt: skip
    n, c = locate_chunk(cu_seqlens, num_seqs, tl.program_id(0), BT, BLOCK_N)
    if n >= num_seqs:
        return
    bos = tl.load(cu_seqlens + n).to(tl.int32)
    seqlen = tl.load(cu_seqlens + n + 1).to(tl.int32) - bos
    o_c = tl.program_id(1) * BC + tl.arange(0, BC)
    m_c = o_c < channels
    p_x = x + bos.to(tl.int64) * stride_xt + o_c[None, :]
    p_y = y + bos.to(tl.int64) * stride_yt + o_c[None, :]

    # rows whose taps all lie inside the sequence (the first W - 1 positions are done below); a position
    # times the row stride in int64 (past 2^31 from ~174k tokens of one sequence at the 35B in_proj's width)
    pos = c * BT + tl.arange(0, BT)
    if SAVE_X:  # a copy of this chunk's inputs (L1 / L2 hits: the taps below read the same rows)
        m_all = (pos < seqlen)[:, None] & m_c[None, :]
        rows = tl.load(p_x + pos.to(tl.int64)[:, None] * stride_xt, mask=m_all)
        tl.store(saved + (bos + pos).to(tl.int64)[:, None] * stride_st + o_c[None, :], rows, mask=m_all)
    m_t = (pos < seqlen) & (pos >= W - 1)
    acc = _conv_rows(p_x, None, weight, bias, o_c, m_c, pos, m_t, stride_xt, 0, stride_wc, 0, W, HAS_BIAS)
    tl.store(
        p_y + pos.to(tl.int64)[:, None] * stride_yt,
        _activate(acc, SILU).to(y.dtype.element_ty),
        mask=m_t[:, None] & m_c[None, :],
    )

    if c == 0:
        # the only program reading this slot's window (for these channels): the head rows, then the new window
        slot = tl.load(slots + n).to(tl.int64)
        p_s = state + slot * stride_ss + o_c[None, :] * stride_sc
        win_lo = tl.where(tl.load(has_initial_state + n) != 0, -(W - 1), 0)  # no initial state: read no window
        o_w = tl.arange(0, BW)
        m_head = (o_w < W - 1) & (o_w < seqlen)
        head = _conv_rows(
            p_x, p_s, weight, bias, o_c, m_c, o_w, m_head, stride_xt, stride_sw, stride_wc, win_lo, W, HAS_BIAS
        )
        tl.store(
            p_y + o_w[:, None] * stride_yt,
            _activate(head, SILU).to(y.dtype.element_ty),
            mask=m_head[:, None] & m_c[None, :],
        )
        if UPDATE_STATE:
            # new window i = input at position seqlen - (W - 1) + i: from x, or from the old window for short sequences
            src = seqlen - (W - 1) + o_w
            m_w = (o_w < W - 1)[:, None] & m_c[None, :]
            new = tl.load(p_x + src.to(tl.int64)[:, None] * stride_xt, mask=m_w & (src >= 0)[:, None], other=0.0)
            new = new.to(tl.float32)
            win_m = m_w & ((src < 0) & (src >= win_lo))[:, None]
            new += tl.load(p_s + (src + W - 1)[:, None] * stride_sw, mask=win_m, other=0.0).to(tl.float32)
            tl.debug_barrier()  # every thread has read the old window before it is overwritten
            tl.store(p_s + o_w[:, None] * stride_sw, new.to(state.dtype.element_ty), mask=m_w)


# values that change from pass to pass: one compile serves them all (kernels/__init__.py)
@triton.jit(do_not_specialize=["slots"])
def _conv_update_kernel(
    x, weight, bias, y, state, slots, channels, stride_xn, stride_yn, stride_ss, stride_sc, stride_sw, stride_wc,
    W: tl.constexpr, BW: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0)
    o_c = tl.program_id(1) * BC + tl.arange(0, BC)
    m_c = o_c < channels
    o_w = tl.arange(0, BW)
    slot = tl.load(slots + n).to(tl.int64)
    p_s = state + slot * stride_ss + o_c[:, None] * stride_sc
    # the window, the taps and the bias come from earlier passes and the weights, never from the
    # kernel before this one (the input projection): they load before the PDL wait (kernels/pdl.py)
    m_win = m_c[:, None] & (o_w < W - 1)[None, :]
    window = tl.load(p_s + o_w[None, :] * stride_sw, mask=m_win, other=0.0)
    shifted = tl.load(p_s + (o_w + 1)[None, :] * stride_sw, mask=m_c[:, None] & (o_w + 1 < W - 1)[None, :], other=0.0)
    taps = tl.load(weight + o_c[:, None] * stride_wc + o_w[None, :], mask=m_c[:, None] & (o_w < W)[None, :], other=0.0)
    if HAS_BIAS:
        b_bias = tl.load(bias + o_c, mask=m_c, other=0.0).to(tl.float32)
    pdl_wait(USE_PDL)
    b_x = tl.load(x + n.to(tl.int64) * stride_xn + o_c, mask=m_c, other=0.0)

    # seq[c, j], j < W: the window then the new input
    seq = window.to(tl.float32) + tl.where((o_w == W - 1)[None, :], b_x.to(tl.float32)[:, None], 0.0)
    out = tl.sum(seq * taps.to(tl.float32), 1)
    if HAS_BIAS:
        out += b_bias
    tl.store(y + n.to(tl.int64) * stride_yn + o_c, _activate(out, SILU).to(y.dtype.element_ty), mask=m_c)

    # shift the window by one: new[c, i] = seq[c, i + 1]
    shifted += tl.where((o_w + 1 == W - 1)[None, :], b_x.to(state.dtype.element_ty)[:, None], 0.0)
    tl.debug_barrier()  # the window is read by neighbouring threads before it is overwritten
    tl.store(p_s + o_w[None, :] * stride_sw, shifted, mask=m_win)


def causal_conv1d_varlen(
    *, x, weight, bias, cu_seqlens, conv_state_pool, state_slots, has_initial_state, activation="silu",
    update_state=True, save_inputs=None, tiles=VARLEN_TILES,
):  # fmt: skip
    """conv1d.causal_conv1d_varlen: grid (T // block_t + N, C / block_c), no host sync. tiles:
    (block_t, block_c, num_warps), powers of two."""
    block_t, block_c, num_warps = tiles
    silu = is_silu(activation)
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    num_tokens, channels = x.shape
    width = weight.shape[1]
    num_seqs = cu_seqlens.shape[0] - 1
    y = torch.empty((num_tokens, channels), dtype=x.dtype, device=x.device)
    if num_seqs == 0 or channels == 0:
        return y
    grid = (num_tokens // block_t + num_seqs, triton.cdiv(channels, block_c))
    _conv_varlen_kernel[grid](
        x, weight, weight if bias is None else bias, y, conv_state_pool, cu_seqlens, state_slots, has_initial_state,
        y if save_inputs is None else save_inputs, num_seqs, channels, x.stride(0), y.stride(0),
        *conv_state_pool.stride(), weight.stride(0), 0 if save_inputs is None else save_inputs.stride(0),
        W=width, BW=triton.next_power_of_2(max(width - 1, 1)), BT=block_t, BC=block_c, BLOCK_N=BLOCK_N,
        HAS_BIAS=bias is not None, SILU=silu, UPDATE_STATE=update_state, SAVE_X=save_inputs is not None,
        num_warps=num_warps,
    )  # fmt: skip
    return y


def causal_conv1d_update(*, x, weight, bias, conv_state_pool, state_slots, activation="silu", pdl=True):
    """conv1d.causal_conv1d_update: grid (N, C / UPDATE_BLOCK_C)."""
    silu = is_silu(activation)
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    num_seqs, channels = x.shape
    width = weight.shape[1]
    y = torch.empty((num_seqs, channels), dtype=x.dtype, device=x.device)
    if num_seqs == 0 or channels == 0:
        return y
    _conv_update_kernel[(num_seqs, triton.cdiv(channels, UPDATE_BLOCK_C))](
        x, weight, weight if bias is None else bias, y, conv_state_pool, state_slots, channels,
        x.stride(0), y.stride(0), *conv_state_pool.stride(), weight.stride(0),
        W=width, BW=triton.next_power_of_2(width), BC=UPDATE_BLOCK_C, HAS_BIAS=bias is not None, SILU=silu,
        num_warps=4,
        **pdl_launch(x, pdl),
    )  # fmt: skip
    return y


# the entries are views of a graph's static buffers, and x starts num_decode rows into its projection
# (a mixed pass's prompt rows: 16-byte aligned or not by the decode rows' count): alignments are not
# compile keys, so no pass's mix of rows compiles a variant after start-up
@triton.jit(do_not_specialize=["x", "seq", "start", "end", "dst", "slots", "has_initial_state", "num_tokens"])
def _capture_windows_kernel(
    x, pool, slots, has_initial_state, seq, start, end, dst, num_tokens, channels, stride_xt, stride_ps,
    stride_pc, stride_pw, W1: tl.constexpr, BW: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    e = tl.program_id(0)
    o_c = tl.program_id(1) * BC + tl.arange(0, BC)
    m_c = o_c < channels
    s = tl.load(seq + e)
    first, stop = tl.load(start + e), tl.load(end + e)
    slot = tl.load(slots + s).to(tl.int64)
    keep = tl.load(has_initial_state + s).to(tl.int32) != 0
    j = tl.arange(0, BW)
    m_j = j < W1
    r = stop - W1 + j  # the window's rows of x; those before the stream's start come from its slot
    own = r >= first
    row = tl.minimum(tl.maximum(r, 0), num_tokens - 1).to(tl.int64)
    col = tl.minimum(tl.maximum(r - first + W1, 0), W1 - 1)
    m = m_c[:, None] & m_j[None, :]
    new = tl.load(x + row[None, :] * stride_xt + o_c[:, None], mask=m & own[None, :], other=0.0)
    old = tl.load(pool + slot * stride_ps + o_c[:, None] * stride_pc + col[None, :] * stride_pw, mask=m & ~own[None, :])
    old = tl.where(keep, old, tl.zeros_like(old))
    win = tl.where(own[None, :], new.to(pool.dtype.element_ty), old)
    d = tl.load(dst + e).to(tl.int64)
    tl.store(pool + d * stride_ps + o_c[:, None] * stride_pc + j[None, :] * stride_pw, win, mask=m)


def capture_windows(
    *,
    x: torch.Tensor,
    conv_state_pool: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    seq: torch.Tensor,
    start: torch.Tensor,
    end: torch.Tensor,
    dst: torch.Tensor,
) -> None:
    """FixedCaptures.conv_windows in one launch: for entry c, the W - 1 inputs before row end[c] of
    stream seq[c] (whose rows start at start[c]; before it, the stream slot's old window, zeros
    without initial state) into slot dst[c] of conv_state_pool [S, C, W - 1]. x: [T, C], channels
    contiguous. No used entry's destination is a stream's slot (unused ones write the scratch slot)."""
    assert x.stride(1) == 1, "x: channels contiguous"
    channels, width_1 = x.shape[1], conv_state_pool.shape[-1]
    block_c = min(256, triton.next_power_of_2(channels))
    _capture_windows_kernel[(seq.shape[0], triton.cdiv(channels, block_c))](
        x, conv_state_pool, state_slots, has_initial_state, seq, start, end, dst, x.shape[0], channels, x.stride(0),
        *conv_state_pool.stride(), W1=width_1, BW=triton.next_power_of_2(width_1), BC=block_c, num_warps=4,
    )  # fmt: skip
