"""Fused GDN gating in Triton; same contract as naive.gdn_gating.

    g = -exp(A_log) * softplus(a + dt_bias),   beta = sigmoid(b)      (float32)

One launch instead of the eight elementwise torch ops it replaces (casts, exp, neg, add, softplus,
mul, sigmoid). a and b are read where the fused input projection wrote them (columns of its
output, a row stride of the projection's width); g and beta come out contiguous. One program per
BLOCK_ELEMENTS // Hv tokens x all heads (A_log and dt_bias loaded once per program).

`softplus` and `gate_values` are shared with the recurrent kernel, which can read raw a / b and
compute the same gates itself (recurrent.fused_recurrent_gated_delta_rule(a=..., b=...)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SOFTPLUS_THRESHOLD = tl.constexpr(20.0)  # F.softplus's default (beta 1): above it softplus(x) is x
BLOCK_ELEMENTS = 1024  # tokens x heads per program: 32 tokens at Hv = 32


@triton.jit
def softplus(x):
    """F.softplus(x) (beta 1, threshold 20) in float32: x above the threshold, else log(1 + exp(x))
    (exp's argument clamped, so that the branch not taken never overflows). log(1 + exp(x)) rounds
    to 0 below about -17, where the true value is < 6e-8 (vLLM and fla write it the same way; the
    error is absolute, tiny against the log decay it feeds)."""
    return tl.where(x > SOFTPLUS_THRESHOLD, x, tl.log(1.0 + tl.exp(tl.minimum(x, SOFTPLUS_THRESHOLD))))


@triton.jit
def gate_values(a, b, neg_a_exp, dt_bias):
    """(g, beta) from raw float32 a, b and the head's -exp(A_log), dt_bias (broadcastable)."""
    return neg_a_exp * softplus(a + dt_bias), tl.sigmoid(b)


# values that change from pass to pass: one compile serves them all (kernels/__init__.py)
@triton.jit(do_not_specialize=["num_tokens"])
def _gating_kernel(
    a, b, A_log, dt_bias, g, beta, num_tokens, stride_at, stride_ah, stride_bt, stride_bh, HV: tl.constexpr,
    BT: tl.constexpr, BH: tl.constexpr,
):  # fmt: skip
    o_t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    o_h = tl.arange(0, BH)
    m_h = o_h < HV
    mask = (o_t < num_tokens)[:, None] & m_h[None, :]
    neg_a_exp = -tl.exp(tl.load(A_log + o_h, mask=m_h, other=0.0).to(tl.float32))
    bias = tl.load(dt_bias + o_h, mask=m_h, other=0.0).to(tl.float32)
    x_a = tl.load(a + o_t[:, None] * stride_at + o_h[None, :] * stride_ah, mask=mask, other=0.0).to(tl.float32)
    x_b = tl.load(b + o_t[:, None] * stride_bt + o_h[None, :] * stride_bh, mask=mask, other=0.0).to(tl.float32)
    b_g, b_beta = gate_values(x_a, x_b, neg_a_exp[None, :], bias[None, :])
    p_out = o_t[:, None] * HV + o_h[None, :]
    tl.store(g + p_out, b_g, mask=mask)
    tl.store(beta + p_out, b_beta, mask=mask)


def gdn_gating(
    *,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDN decay and write strength from the raw projections, in one launch.

    a, b: [..., Hv] (the layer's [T, Hv]), any float dtype, any row stride (e.g. column slices of
    the fused in_proj output; leading dims that do not merge into one row stride are copied);
    A_log, dt_bias: [Hv], any float dtype. Returns (g, beta): a's shape, float32, contiguous, with
    g = -exp(A_log) * softplus(a + dt_bias) (F.softplus: beta 1, threshold 20), beta = sigmoid(b).
    No host syncs (CUDA-graph safe).
    """
    num_heads = a.shape[-1]
    assert b.shape == a.shape and A_log.shape == dt_bias.shape == (num_heads,), (a.shape, b.shape, A_log.shape)
    g = torch.empty(a.shape, dtype=torch.float32, device=a.device)
    beta = torch.empty_like(g)
    num_tokens = g.numel() // max(num_heads, 1)
    if num_tokens == 0 or num_heads == 0:
        return g, beta
    a2, b2 = a.reshape(num_tokens, num_heads), b.reshape(num_tokens, num_heads)  # views where possible
    block_h = triton.next_power_of_2(num_heads)
    block_t = max(1, BLOCK_ELEMENTS // block_h)
    _gating_kernel[(triton.cdiv(num_tokens, block_t),)](
        a2, b2, A_log, dt_bias, g, beta, num_tokens, *a2.stride(), *b2.stride(),
        HV=num_heads, BT=block_t, BH=block_h, num_warps=4,
    )  # fmt: skip
    return g, beta
