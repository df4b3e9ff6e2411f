"""Plain-torch RMSNorm variants: the reference and the CPU path."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..precision import acc_dtype


def rms_norm(*, x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = True) -> torch.Tensor:
    """x / rms(x) * (1 + weight) when zero_centered (the Qwen3-Next / Qwen3.5 norms), else * weight.
    Computed in float32, returned in x's dtype. x: [..., D]; weight: [D]."""
    acc = acc_dtype(x)
    xf = x.to(acc)
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    scale = 1.0 + weight.to(acc) if zero_centered else weight.to(acc)
    return (y * scale).to(x.dtype)


def fused_add_rms_norm(
    *, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual' = x + residual; returns (rms_norm(residual'), residual')."""
    summed = x + residual
    return rms_norm(x=summed, weight=weight, eps=eps), summed


def gated_rms_norm(*, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The GDN output norm: rms_norm(x) * weight * silu(gate), per head. x, gate: [..., D]."""
    acc = acc_dtype(x)
    xf = x.to(acc)
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (weight.to(acc) * y * F.silu(gate.to(acc))).to(x.dtype)


def embed_rms_norm(
    *, ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The embedding lookup and the first layer's input norm: (rms_norm(table[ids]), table[ids]).
    ids: [T]; table: [V, D]; weight: [D] (zero-centred)."""
    rows = torch.nn.functional.embedding(ids, table)
    return rms_norm(x=rows, weight=weight, eps=eps), rows
