"""Plain-torch linear: the reference and the CPU path."""

from __future__ import annotations

import torch

from ..fp8.naive import ACT_GROUP, dequantize_weight, expand_scale, quantize_act
from ..precision import acc_dtype


def linear(
    *, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None, weight_tail: torch.Tensor | None = None, quantize_x: bool = False,
) -> torch.Tensor:  # fmt: skip
    """The reference of linear.linear: float32 (float64 for float64 x) accumulation, x's dtype out.
    An FP8 weight is dequantized with weight_scale first; its weight_tail rows follow its own;
    quantize_x: x quantized per row and group of 128 columns (fp8.quantize_act) and dequantized,
    for the rows of the FP8 weight (the tail takes x as it is), as the tensor-core path does."""
    acc = acc_dtype(x)
    xw = x.to(acc)
    if weight_scale is None:
        out = xw @ weight.to(acc).t()
    else:
        if quantize_x and x.shape[0]:
            q, s = quantize_act(x=x, group=ACT_GROUP)
            xw = (q.float() * expand_scale(s, *x.shape, (1, ACT_GROUP))).to(acc)
        out = xw @ dequantize_weight(weight, weight_scale, acc).t()
    if weight_tail is not None:
        out = torch.cat((out, x.to(acc) @ weight_tail.to(acc).t()), dim=1)
    if bias is not None:
        out = out + bias.to(acc)
    return out.to(x.dtype)
