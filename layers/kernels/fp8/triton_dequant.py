"""Block-FP8 weights dequantized in Triton: w[n, k] = q[n, k] * s[n / bn, k / bk] in float32, stored
in the output dtype (one rounding, as naive.dequantize_weight's). Prefill-sized GEMMs with an FP8
weight can then run on cuBLAS's bf16 kernel (linear's fp8_gemm="dequant"): at 2k rows Hopper's bf16
GEMM beats both block-scaled FP8 GEMMs here, and the weight's bytes (1 read, 2 written) cost a few
microseconds against its ~100."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N, BLOCK_K = 32, 128


@triton.jit
def _dequant_kernel(
    q, s, tail, out, N, T, K, s_qn, s_sn, s_tn, s_on, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Rows [0, N) of out from q and its scales; rows [N, N + T) copied from tail (out's dtype)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = (k < K)[None, :]
    ok = (n < N)[:, None] & k_ok
    v = tl.load(q + n.to(tl.int64)[:, None] * s_qn + k[None, :], mask=ok, other=0.0).to(tl.float32)
    scale = tl.load(s + (n // SCALE_N)[:, None] * s_sn + (k // SCALE_K)[None, :], mask=ok, other=0.0)
    w = (v * scale).to(out.dtype.element_ty)
    in_tail = ((n >= N) & (n < N + T))[:, None] & k_ok
    t = tl.load(tail + (n - N).to(tl.int64)[:, None] * s_tn + k[None, :], mask=in_tail, other=0.0)
    w = tl.where(in_tail, t.to(out.dtype.element_ty), w)
    tl.store(out + n.to(tl.int64)[:, None] * s_on + k[None, :], w, mask=ok | in_tail)


def dequantize_weight(
    *, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], out: torch.Tensor,
    tail: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """q [N, K] float8 (rows may be strided, K contiguous) times its [ceil(N / bn), ceil(K / bk)]
    block scales into out [>= N (+ T), K] (its first N rows; K contiguous); tail [T, K] in out's dtype
    (K contiguous): copied into the T rows after them, in the same launch. One launch."""
    rows, cols = q.shape
    extra = 0 if tail is None else tail.shape[0]
    assert q.stride(1) == 1 and out.stride(1) == 1 and out.shape[0] >= rows + extra and out.shape[1] == cols, "shapes"
    assert tail is None or (tail.shape[1] == cols and tail.stride(1) == 1 and tail.dtype == out.dtype), "tail"
    if (rows + extra) and cols:
        grid = (triton.cdiv(rows + extra, BLOCK_N), triton.cdiv(cols, BLOCK_K))
        _dequant_kernel[grid](
            q, scale, tail if tail is not None else out, out, rows, extra, cols, q.stride(0), scale.stride(0),
            tail.stride(0) if tail is not None else 0, out.stride(0), SCALE_N=block[0], SCALE_K=block[1],
            BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4,
        )  # fmt: skip
    return out
