"""Dense projections: a skinny GEMM / GEMV for the few-token (decode) case, cuBLAS otherwise; and
the input norm fused into the projection that follows it (`rms_norm_linear`)."""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .. import norm as norm_kernels
from . import naive  # noqa: F401  (the reference, for tests and benches)
from .tuned import TUNED, tuned_key

# At or under this many rows (tokens) a CUDA input takes the Triton GEMV form: the weights are read
# once and the work is bandwidth-bound. Above it, up to 16 rows, only the half-precision shapes whose
# tensor-core tiles beat cuBLAS in the sweep (TUNED) do; cuBLAS takes the rest.
MAX_TOKENS = 4
MAX_TUNED_TOKENS = 16


def linear(*, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias), x: [M, K], weight: [N, K] -> [M, N] in x's dtype (float32 accumulate).
    Triton skinny GEMM for CUDA inputs of at most MAX_TOKENS rows, or of at most MAX_TUNED_TOKENS
    rows at a TUNED half-precision shape; F.linear otherwise (and on CPU)."""
    if x.is_cuda and x.dim() == 2 and _one_row(x):
        from .triton_row import row_gemv

        return row_gemv(x=x, weight=weight, bias=bias)[0]
    if x.is_cuda and x.dim() == 2 and uses_triton(x.shape[0], weight.shape[0], x.shape[1], x.dtype):
        from .triton_linear import linear as impl

        return impl(x=x, weight=weight, bias=bias)
    return F.linear(x, weight, bias)


def uses_triton(num_rows: int, n: int, k: int, dtype: torch.dtype) -> bool:
    """Whether a CUDA call of this shape takes the Triton kernel (else cuBLAS)."""
    if num_rows <= MAX_TOKENS:
        return True
    half = dtype in (torch.bfloat16, torch.float16)
    return half and num_rows <= MAX_TUNED_TOKENS and tuned_key(num_rows, n, k) in TUNED


class NormLinearOut(NamedTuple):
    """rms_norm_linear's results: the projection, the normed input (when asked for), and the
    residual stream after the add."""

    out: torch.Tensor
    normed: torch.Tensor | None
    residual: torch.Tensor


def rms_norm_linear(
    *,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    write_normed: bool = False,
) -> NormLinearOut:
    """residual' = x + residual (x itself when residual is None), y = rms_norm(residual') * (1 +
    norm_weight), out = y @ weight.T (+ bias). x, residual: [M, K]; norm_weight: [K]; weight: [N, K].
    One kernel for a CUDA row (batch-1 decode) and a weight of at most FUSED_NORM_MAX_N rows (where
    the measured fusion pays): the norm runs inside the GEMV; otherwise the norm kernel, then
    `linear`. normed is y when write_normed (else None)."""
    if x.is_cuda and _one_row(x) and _fuses_norm(weight.shape[0]):
        from .triton_row import row_gemv

        out, normed, summed = row_gemv(
            x=x,
            weight=weight,
            bias=bias,
            residual=residual,
            norm_weight=norm_weight,
            eps=eps,
            write_normed=write_normed,
        )
        return NormLinearOut(out, normed, x if summed is None else summed)
    if residual is None:
        summed, normed = x, norm_kernels.rms_norm(x=x, weight=norm_weight, eps=eps)
    else:
        normed, summed = norm_kernels.fused_add_rms_norm(x=x, residual=residual, weight=norm_weight, eps=eps)
    out = linear(x=normed, weight=weight, bias=bias)
    return NormLinearOut(out, normed if write_normed else None, summed)


def _one_row(x: torch.Tensor) -> bool:
    """Whether a CUDA input takes the one-row kernel (triton_row.py). DELTASERVE_ROW_GEMV=0 turns it
    off (read per call, so the benchmark can compare both)."""
    from .triton_row import supports

    return supports(x.shape[0], x.shape[1], x.dtype) and os.environ.get("DELTASERVE_ROW_GEMV", "1") != "0"


def _fuses_norm(n: int) -> bool:
    from .triton_row import fuses_norm

    return fuses_norm(n)
