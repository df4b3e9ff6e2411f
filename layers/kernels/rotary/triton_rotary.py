"""Triton q/k head norm + partial rotary embedding in one launch for q and k.

One program per (token, head) over q's heads then k's: it loads the head vector once (plus the
rotation partners, from L1), normalises in float32, rotates the first rotary_dim features with
cos/sin computed from the position in registers, and writes the result. This replaces two norm
launches and about twenty elementwise launches per attention layer in a decode step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..pdl import pdl_launch, pdl_wait


@triton.jit
def _qk_norm_rope_kernel(
    Q,
    K,
    Q_OUT,
    K_OUT,
    QW,
    KW,
    POS,
    INV_FREQ,
    q_stride_t,
    q_stride_h,
    k_stride_t,
    k_stride_h,
    num_q_heads,
    num_k_heads,
    eps,
    D: tl.constexpr,
    ROT: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    is_q = h < num_q_heads
    offs = tl.arange(0, BLOCK_D)
    in_dim = offs < D
    half = ROT // 2
    # the rotation partner of feature i: i + half in the first half, i - half in the second
    partner = tl.where(offs < half, offs + half, tl.where(offs < ROT, offs - half, offs))
    if is_q:
        src = Q + t * q_stride_t + h * q_stride_h
        dst = Q_OUT + (t * num_q_heads + h) * D
        w_ptr = QW
    else:
        kh = h - num_q_heads
        src = K + t * k_stride_t + kh * k_stride_h
        dst = K_OUT + (t * num_k_heads + kh) * D
        w_ptr = KW
    x = tl.load(src + offs, mask=in_dim, other=0.0).to(tl.float32)
    xp = tl.load(src + partner, mask=in_dim, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=in_dim, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + partner, mask=in_dim, other=0.0).to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    y = x * inv_rms * (1.0 + w)
    yp = xp * inv_rms * (1.0 + wp)
    pos = tl.load(POS + t).to(tl.float32)
    i = tl.where(offs < half, offs, offs - half)
    # the host's float32 inverse frequencies: the same angles (pos * inv_freq) transformers computes
    inv_freq = tl.load(INV_FREQ + i, mask=offs < ROT, other=0.0)
    angle = pos * inv_freq
    c, s = tl.cos(angle), tl.sin(angle)
    rotated = tl.where(offs < half, y * c - yp * s, y * c + yp * s)
    out = tl.where(offs < ROT, rotated, y)
    tl.store(dst + offs, out.to(dst.dtype.element_ty), mask=in_dim)


_INV_FREQ: dict[tuple, torch.Tensor] = {}


def _inv_freq(rotary_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """1 / theta ** (2i / rotary_dim) in float32, computed once per (dim, theta, device)."""
    key = (rotary_dim, theta, str(device))
    if key not in _INV_FREQ:
        exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim
        _INV_FREQ[key] = 1.0 / (theta**exponent)
    return _INV_FREQ[key]


def qk_norm_rope(
    *,
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    positions: torch.Tensor,
    eps: float,
    rotary_dim: int,
    theta: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See naive.qk_norm_rope. q: [T, Hq, D], k: [T, Hkv, D] with unit stride over D."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    assert q.stride(2) == 1 and k.stride(2) == 1, "head dim must be contiguous"
    assert rotary_dim % 2 == 0 and rotary_dim <= head_dim
    q_out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((num_tokens, num_k_heads, head_dim), dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    _qk_norm_rope_kernel[(num_tokens, num_q_heads + num_k_heads)](
        q,
        k,
        q_out,
        k_out,
        q_weight,
        k_weight,
        positions,
        _inv_freq(rotary_dim, theta, q.device),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        num_q_heads,
        num_k_heads,
        eps,
        D=head_dim,
        ROT=rotary_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=1 if head_dim <= 128 else 2,
        **pdl_launch(q),
    )
    return q_out, k_out
