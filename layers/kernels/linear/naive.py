"""Plain-torch linear: the reference and the CPU path."""

from __future__ import annotations

import torch


def linear(*, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference of linear.linear: float32 accumulation, x's dtype out."""
    out = x.float() @ weight.float().t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
