"""Small pieces the layers share: the zero-centred RMSNorm's weights, a projection under the pass's
kernel options, and the helpers that load a rank's rows or columns of a checkpoint tensor."""

from __future__ import annotations

import torch
from torch import nn

from .base import CheckpointTensor, LazyTensor, copy_into
from .kernels import linear as linear_kernels
from .kernels.options import KernelOptions
from .quant import assign, scale_of, tail_of


def empty_param(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    """An uninitialised, frozen parameter (weights come from the loader)."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class RMSNorm(nn.Module):
    """The weight and eps of x / rms(x) * (1 + weight), the zero-centred norm of Qwen3-Next and
    Qwen3.5; the kernels that fuse it into their neighbours apply it."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = empty_param(dim)
        self.eps = eps

    def checkpoint_tensors(self, name: str) -> list[CheckpointTensor]:
        return [whole(name, self.weight, init="zeros")]


def project(
    x: torch.Tensor, weight: torch.Tensor, kernels: KernelOptions, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ weight.T (+ bias) by linear_kernels.linear with the kernel options of the pass (an FP8
    weight with its block scales and tail rows, layers/quant.py)."""
    return linear_kernels.linear(
        x=x, weight=weight, bias=bias, weight_scale=scale_of(weight), weight_tail=tail_of(weight), pdl=kernels.pdl,
        row_gemv=kernels.row_gemv, row_tiles=kernels.row_tiles, few_rows=kernels.few_rows_gemv,
        fp8_gemm=kernels.linear_fp8_gemm(),
    )  # fmt: skip


def whole(name: str, param: torch.Tensor, init: str = "normal") -> CheckpointTensor:
    """A replicated tensor: every rank loads all of it."""
    return CheckpointTensor(name, tuple(param.shape), lambda t: copy_into(param, t.get(), name), init=init)


def row_ranges(
    name: str,
    param: torch.Tensor,
    full_shape: tuple[int, ...],
    pieces: list[tuple[int, int, int]],
    init: str = "normal",
) -> CheckpointTensor:
    """Rows of a checkpoint tensor copied into rows of `param`: each piece is
    (checkpoint row start, param row start, rows). Column-parallel weights are one piece; fused
    projections gather several."""

    def load(t: LazyTensor) -> None:
        for src, dst, rows in pieces:
            assign(param, (slice(dst, dst + rows),), t, (slice(src, src + rows),), name)

    return CheckpointTensor(name, tuple(full_shape), load, init=init)


def col_range(name: str, param: torch.Tensor, full_shape: tuple[int, ...], start: int) -> CheckpointTensor:
    """Columns [start, start + param.shape[1]) of a row-parallel weight."""
    cols = param.shape[1]
    return CheckpointTensor(
        name,
        tuple(full_shape),
        lambda t: assign(param, (slice(None), slice(None)), t, (slice(None), slice(start, start + cols)), name),
    )
