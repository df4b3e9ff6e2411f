"""RMSNorm variants (zero-centred, gated, fused with the residual add or the embedding lookup).

Each op runs one Triton launch on CUDA (float32 math, the input's dtype out; rows may be strided,
the last dim contiguous) and the plain-torch reference (naive.py) on CPU.
"""

from __future__ import annotations

import torch

from ..low_rank import PairLowRank
from . import naive


def rms_norm(
    *, x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = True, pdl: bool = True
) -> torch.Tensor:
    """x / rms(x) * (1 + weight) when zero_centered (the Qwen3-Next / Qwen3.5 norms), else * weight.

    Args:
        x: [..., D], any float dtype. weight: [D].
        pdl: CUDA: launch under programmatic dependent launch (sm_90+).

    Returns:
        [..., D] in x's dtype.
    """
    if x.is_cuda:
        from .triton_norm import rms_norm as impl

        return impl(x=x, weight=weight, eps=eps, zero_centered=zero_centered, pdl=pdl)
    return naive.rms_norm(x=x, weight=weight, eps=eps, zero_centered=zero_centered)


def fused_add_rms_norm(
    *,
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    pdl: bool = True,
    low_rank: PairLowRank | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the zero-centred norm after it: s = x + residual (rounded to x's dtype).

    Args:
        x, residual: [..., D], one dtype. weight: [D].
        pdl: CUDA: launch under programmatic dependent launch (sm_90+).
        low_rank: x [T, D]'s adapters (one slice, b [S, D, R]): s = x + delta + residual, float32,
            one rounding (the projection before the norm without its expand launch).

    Returns:
        (rms_norm(s), s), both [..., D] in x's dtype.
    """
    if x.is_cuda:
        from .triton_norm import fused_add_rms_norm as impl

        return impl(x=x, residual=residual, weight=weight, eps=eps, pdl=pdl, low_rank=low_rank)
    return naive.fused_add_rms_norm(x=x, residual=residual, weight=weight, eps=eps, low_rank=low_rank)


def gated_rms_norm(
    *, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool = True
) -> torch.Tensor:
    """The GDN output norm: rms_norm(x) * weight * silu(gate) per head (plain weight, not zero-centred).

    Args:
        x, gate: [..., D] of one shape (gate may be a [T, H, D] view with strided token rows). weight: [D].
        pdl: CUDA: launch under programmatic dependent launch (sm_90+).

    Returns:
        [..., D] in x's dtype.
    """
    if x.is_cuda:
        from .triton_norm import gated_rms_norm as impl

        return impl(x=x, gate=gate, weight=weight, eps=eps, pdl=pdl)
    return naive.gated_rms_norm(x=x, gate=gate, weight=weight, eps=eps)


def embed_rms_norm(
    *, ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """The embedding lookup and the first layer's (zero-centred) input norm.

    Args:
        ids: [T] int, valid rows of table. table: [V, D]. weight: [D].
        pdl: CUDA: launch under programmatic dependent launch (sm_90+).

    Returns:
        (rms_norm(table[ids]), table[ids]), both [T, D] in table's dtype.
    """
    if table.is_cuda:
        from .triton_norm import embed_rms_norm as impl

        return impl(ids=ids, table=table, weight=weight, eps=eps, pdl=pdl)
    return naive.embed_rms_norm(ids=ids, table=table, weight=weight, eps=eps)
