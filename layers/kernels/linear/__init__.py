"""Dense projections: a skinny GEMM / GEMV for the few-token (decode) case, cuBLAS otherwise."""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
