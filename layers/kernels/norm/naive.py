"""Plain-torch RMSNorm variants: the reference and the CPU path."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..low_rank import low_rank_rows
from ..precision import acc_dtype


def rms_norm(*, x, weight, eps, zero_centered=True):
    """The reference of norm.rms_norm (float32 math)."""
    acc = acc_dtype(x)
    xf = x.to(acc)
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    scale = 1.0 + weight.to(acc) if zero_centered else weight.to(acc)
    return (y * scale).to(x.dtype)


def fused_add_rms_norm(*, x, residual, weight, eps, low_rank=None):
    """The reference of norm.fused_add_rms_norm."""
    if low_rank is None:
        summed = x + residual
    else:
        acc = acc_dtype(x, low_rank.v)
        summed = (x.to(acc) + low_rank_rows(low_rank, acc) + residual.to(acc)).to(x.dtype)
    return rms_norm(x=summed, weight=weight, eps=eps), summed


def gated_rms_norm(*, x, gate, weight, eps):
    """The reference of norm.gated_rms_norm."""
    acc = acc_dtype(x)
    xf = x.to(acc)
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (weight.to(acc) * y * F.silu(gate.to(acc))).to(x.dtype)


def embed_rms_norm(*, ids, table, weight, eps):
    """The reference of norm.embed_rms_norm."""
    rows = torch.nn.functional.embedding(ids, table)
    return rms_norm(x=rows, weight=weight, eps=eps), rows
