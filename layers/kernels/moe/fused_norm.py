"""The residual add + zero-centred RMSNorm that follows an MoE block, done by the block's last kernel
(the pairs path's down GEMV, the sorted path's sum) instead of a norm launch: its buffers, and the
arguments those kernels take for it."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .naive import AddNorm, NormedOut

# the fused norm holds a whole row in one program's registers
MAX_NORM_HIDDEN = 8192


class FusedNorm(NamedTuple):
    """add_norm with its output buffers, for the kernels (rows of one stride in all four tensors)."""

    add: AddNorm
    out: NormedOut
    row_stride: int


def fused_norm(add_norm: AddNorm | None, hidden: torch.Tensor) -> FusedNorm | None:
    """The buffers of a fused add + norm, or None where the norm kernel runs after the block (no
    add_norm, or rows wider than MAX_NORM_HIDDEN); errors name the add_norm field."""
    if add_norm is None or hidden.shape[1] > MAX_NORM_HIDDEN:
        return None
    residual = add_norm.residual.contiguous()
    if residual.shape != hidden.shape or residual.dtype != hidden.dtype:
        raise ValueError(
            f"add_norm.residual: expected {list(hidden.shape)} {hidden.dtype}, got "
            f"{list(residual.shape)} {residual.dtype}"
        )
    if add_norm.weight.shape != (hidden.shape[1],):
        raise ValueError(f"add_norm.weight: expected [{hidden.shape[1]}], got {list(add_norm.weight.shape)}")
    out = NormedOut(torch.empty_like(hidden), torch.empty_like(hidden))
    return FusedNorm(AddNorm(residual, add_norm.weight, add_norm.eps), out, residual.stride(0))


def norm_kernel_args(norm: FusedNorm | None, placeholder: torch.Tensor) -> tuple:
    """(residual, norm weight, normed out, residual out, row stride, eps) for a kernel's ADD_NORM
    arguments; placeholders (never read under ADD_NORM = False) without the norm."""
    if norm is None:
        return placeholder, placeholder, placeholder, placeholder, 0, 0.0
    return norm.add.residual, norm.add.weight, norm.out.normed, norm.out.residual, norm.row_stride, norm.add.eps
