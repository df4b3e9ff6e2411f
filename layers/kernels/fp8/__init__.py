"""FP8 (e4m3) quantization: the block format of FP8 checkpoints' weights, and the dynamic per-token
group quantization of activations that the tensor-core FP8 paths (linear's prefill GEMM, the MoE's
sorted path) feed their dots with.

Weights: w ~ q * s with q float8_e4m3fn [..., N, K] and s float32 [..., ceil(N / bn), ceil(K / bk)],
one factor per bn x bk block (checkpoints: 128 x 128, stored as `weight_scale_inv`; a shard of a
fused or split weight may need a smaller power-of-two block, read off the shapes by scale_block).
Activations: per row and group of ACT_GROUP columns, s = amax / 448 and q = x / s, at run time.
"""

from __future__ import annotations

import torch

from . import naive
from .naive import ACT_GROUP, FP8, FP8_MAX, dequantize_weight, expand_scale, quantize_weight, scale_block

__all__ = [
    "ACT_GROUP", "FP8", "FP8_MAX", "dequantize_weight", "expand_scale", "is_fp8", "quantize_act", "quantize_weight",
    "scale_block",
]  # fmt: skip


def is_fp8(t: torch.Tensor | None) -> bool:
    """Whether t holds float8_e4m3fn values (an FP8 weight)."""
    return t is not None and t.dtype == FP8


def quantize_act(
    *, x: torch.Tensor, group: int = ACT_GROUP, pdl: bool = True, m_major: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic FP8 quantization per row and group of columns: s = max(amax, 1e-10) / 448 over the
    group, q = x / s (IEEE division, round to nearest even, saturated at +-448).

    Args:
        x: [M, K], any float dtype (rows may be strided, the last dim contiguous). group: a power of
            two, the columns per scale. pdl: CUDA: launch under programmatic dependent launch.
        m_major: s laid out rows-fastest (strides (1, M)), as cuBLAS's 1 x 128 block scales are.

    Returns:
        (q float8_e4m3fn [M, K] contiguous, s float32 [M, ceil(K / group)]). CUDA: one launch.
    """
    if x.is_cuda:
        from .triton_quant import quantize_act as impl

        return impl(x=x, group=group, pdl=pdl, m_major=m_major)
    q, s = naive.quantize_act(x=x, group=group)
    return q, (s.t().contiguous().t() if m_major else s)
