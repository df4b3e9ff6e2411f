"""Dynamic per-token group FP8 quantization of activations in Triton: one program per row and
GROUPS groups of columns (a whole row of the model's widths), float32 math, IEEE division so that
the result is the reference's bit for bit."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..pdl import pdl_launch, pdl_wait
from .naive import AMAX_FLOOR, FP8, FP8_MAX


@triton.jit
def round_to_e4m3(v):
    """float32 v (|v| <= 448) rounded to the nearest e4m3 value, ties to even, still in float32: the
    cast that follows is then exact. Done by hand because Triton's interpreter rounds the cast
    itself wrongly (a mantissa carry wraps instead of raising the exponent)."""
    bits = v.to(tl.int32, bitcast=True)
    # normal range: keep 3 of float32's 23 mantissa bits, round half to even (a carry raises the
    # exponent, as it should)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)  # -1048576: ~0xFFFFF
    # below 2^-6 e4m3 is subnormal: multiples of 2^-9, rounded by the 1.5 * 2^23 trick on |v|, the
    # sign put back after (a negative value that rounds to zero is -0, as the reference's cast gives)
    t = tl.abs(v) * 512.0
    sub = ((t + 12582912.0) - 12582912.0) * 0.001953125
    sub = tl.where(v < 0, -sub, sub)
    return tl.where(tl.abs(v) < 0.015625, sub, normal)


@triton.jit
def quantize_group_block(x, FP8_LIMIT: tl.constexpr, FLOOR: tl.constexpr):
    """x [R, G, GROUP] float32 -> (q float8e4nv [R, G, GROUP], s [R, G]): each group's scale
    max(amax, FLOOR) / 448 and its values divided by it (kernels that quantize in their epilogue
    use it too)."""
    amax = tl.maximum(tl.max(tl.abs(x), 2), FLOOR)
    # IEEE division (a plain `/` compiles to the approximate one on the GPU: the scale 1 ulp off)
    s = tl.div_rn(amax, tl.zeros_like(amax) + FP8_LIMIT)
    q = tl.div_rn(x, s[:, :, None])
    q = round_to_e4m3(tl.minimum(tl.maximum(q, -FP8_LIMIT), FP8_LIMIT))
    return q.to(tl.float8e4nv), s


# the row count changes from pass to pass: one compile serves them all (kernels/__init__.py)
@triton.jit(do_not_specialize=["M"])
def _quant_kernel(
    x, q, s, M, K, s_xm, s_qm, s_sm, s_sg, GROUP: tl.constexpr, GROUPS: tl.constexpr, FP8_LIMIT: tl.constexpr,
    FLOOR: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    col = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    ok = col < K
    v = tl.load(x + row * s_xm + col, mask=ok, other=0.0).to(tl.float32)
    qv, sv = quantize_group_block(v[None, :, :], FP8_LIMIT, FLOOR)
    tl.store(q + row * s_qm + col, tl.reshape(qv, [GROUPS, GROUP]), mask=ok)
    tl.store(s + row * s_sm + g * s_sg, tl.reshape(sv, [GROUPS]), mask=g * GROUP < K)


def quantize_act(
    *, x: torch.Tensor, group: int, pdl: bool = True, m_major: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8.quantize_act on CUDA (and under the interpreter for CPU tensors in tests)."""
    assert x.dim() == 2 and x.stride(-1) == 1, "x [M, K] with contiguous rows"
    assert group & (group - 1) == 0, "group must be a power of two"
    rows, cols = x.shape
    groups = triton.cdiv(cols, group)
    q = torch.empty((rows, cols), dtype=FP8, device=x.device)
    s = torch.empty((groups, rows) if m_major else (rows, groups), dtype=torch.float32, device=x.device)
    s = s.t() if m_major else s
    if rows == 0 or cols == 0:
        return q, s
    per_program = min(triton.next_power_of_2(groups), max(1, 4096 // group))  # up to 4096 columns a program
    _quant_kernel[(rows, triton.cdiv(groups, per_program))](
        x, q, s, rows, cols, x.stride(0), q.stride(0), s.stride(0), s.stride(1), GROUP=group, GROUPS=per_program,
        FP8_LIMIT=FP8_MAX, FLOOR=AMAX_FLOOR, num_warps=4, **pdl_launch(x, pdl),
    )  # fmt: skip
    return q, s
