"""Dense projections: a skinny GEMM / GEMV for the few-token (decode) case, cuBLAS otherwise."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import naive  # noqa: F401  (the reference, for tests and benches)

# At or under this many rows (tokens) a CUDA input takes the Triton GEMV form: the weights are read
# once and the work is bandwidth-bound. On the H200 (docs/PERF.md) its tensor-core form at 8 rows
# lost to cuBLAS on 4 of 5 model shapes, so cuBLAS takes everything above 4 rows.
MAX_TOKENS = 4


def linear(*, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias), x: [M, K], weight: [N, K] -> [M, N] in x's dtype (float32 accumulate).
    Triton skinny GEMM for CUDA inputs of at most MAX_TOKENS rows; F.linear otherwise (and on CPU)."""
    if x.is_cuda and x.dim() == 2 and x.shape[0] <= MAX_TOKENS:
        from .triton_linear import linear as impl

        return impl(x=x, weight=weight, bias=bias)
    return F.linear(x, weight, bias)
