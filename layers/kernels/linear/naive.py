"""Plain-torch linear: the reference and the CPU path."""

from __future__ import annotations

import torch

from ..precision import acc_dtype


def linear(*, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference of linear.linear: float32 (float64 for float64 x) accumulation, x's dtype out."""
    acc = acc_dtype(x)
    out = x.to(acc) @ weight.to(acc).t()
    if bias is not None:
        out = out + bias.to(acc)
    return out.to(x.dtype)
