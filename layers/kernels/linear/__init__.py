"""Dense projections: a one-row GEMV or skinny GEMM for the few-token (decode) case, cuBLAS
otherwise; and the input norm fused into the projection that follows it (`rms_norm_linear`)."""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F

from .. import norm as norm_kernels
from ..device import DeviceInfo, device_info, tuned_for
from ..fp8.naive import DEQUANT_MIN_ROWS, gemm_quantizes_x
from ..low_rank import PairLowRank
from ..options import RowTile
from . import naive
from .tuned import TUNED, tuned_key

# At or under this many rows (tokens) a CUDA input takes the Triton GEMV form: the weights are read
# once and the work is bandwidth-bound. Above it, up to 16 rows, only the half-precision shapes whose
# tensor-core tiles beat cuBLAS in the device's sweep (TUNED) do; cuBLAS takes the rest.
MAX_TOKENS = 4
MAX_TUNED_TOKENS = 16
# 2..this many rows of a plain half-precision weight take the few-row GEMV (triton_rows: the weight
# read once, every row reusing its register tile); KernelOptions.few_rows_gemv sets it per engine
FEW_ROWS_MAX = 8
# FP8 weights: at most this many rows (2 and 4 rows ran slower than bf16 on the skinny GEMM, H200
# d82cab0; at 8 the skinny GEMM already beat bf16: it keeps 5..8 rows until the few-row form is timed)
FP8_FEW_ROWS_MAX = 4

Path = Literal["row", "rows", "skinny", "torch"]


def linear(
    *,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
    weight_tail: torch.Tensor | None = None,
    pdl: bool = True,
    row_gemv: bool = True,
    row_tiles: tuple[RowTile, ...] = (),
    few_rows: int = FEW_ROWS_MAX,
    fp8_gemm: str = "dequant",
) -> torch.Tensor:
    """x @ weight.T (+ bias), float32 accumulation.

    Args:
        x: [M, K] (rows may be strided). weight: [N, K] in x's dtype, or float8_e4m3fn with
            weight_scale. bias: [N (+ N_tail)] or None.
        weight_scale: an FP8 weight's block scales [ceil(N / bn), ceil(K / bk)] float32 (w = q * s
            per block; checkpoints' 128 x 128 `weight_scale_inv`, see kernels.fp8).
        weight_tail: with an FP8 weight, [N_tail, K] rows in x's dtype after weight's (a fused
            projection whose last rows a checkpoint keeps unquantized); the output has N + N_tail
            columns.
        pdl: CUDA: the Triton kernels launch under programmatic dependent launch (sm_90+).
        row_gemv: a half-precision CUDA row (M = 1) takes the one-row GEMV (else the skinny GEMM).
        row_tiles: one-row GEMV tiles overriding the tuned ones for the shapes they name.
        few_rows: a half-precision CUDA call of 2..few_rows rows takes the few-row GEMV (0: none; an
            FP8 weight at most FP8_FEW_ROWS_MAX rows).
        fp8_gemm: an FP8 weight's GEMM above MAX_TUNED_TOKENS rows: "dequant" (from
            fp8.naive.DEQUANT_MIN_ROWS rows the weight dequantized to x's dtype, cuBLAS's GEMM on x as
            it is: W8A16, as the GEMV and skinny paths; fewer rows take ours), "w8a16" (the dequantized
            weight's GEMM at every size: x never quantized), "triton" (our block-scaled W8A8 GEMM) or
            "cublas" (cuBLAS's block-scaled W8A8 GEMM where it takes the weight:
            triton_fp8.cublas_fp8_ok; else ours).

    Returns:
        [M, N (+ N_tail)] in x's dtype. The path: gemm_path (one row, 2..few_rows rows, <=
        MAX_TOKENS rows or a tuned shape on CUDA: Triton; otherwise F.linear). An FP8 weight: up
        to MAX_TUNED_TOKENS rows the Triton GEMV / skinny GEMM with the weight dequantized in
        registers, x as it is; above, fp8_gemm's GEMM: the W8A8 ones quantize x per row and 1 x 128
        group (fp8.quantize_act), "dequant" takes it as it is (fp8.naive.gemm_quantizes_x), and the
        CPU reference likewise.
    """
    if weight_scale is not None:
        return _linear_fp8(x, weight, bias, weight_scale, weight_tail, pdl, row_gemv, row_tiles, fp8_gemm, few_rows)
    _check_plain(weight, weight_tail)
    path = _path(x, weight.shape[0], row_gemv, few_rows)
    if path == "row":
        from .triton_row import row_gemv as impl

        return impl(x=x, weight=weight, bias=bias, row_tiles=row_tiles, pdl=pdl)[0]
    if path == "rows":
        from .triton_rows import rows_gemv

        return rows_gemv(x=x, weight=weight, bias=bias, pdl=pdl)[0]
    if path == "skinny":
        from .triton_linear import linear as impl

        return impl(x=x, weight=weight, bias=bias, pdl=pdl)
    return F.linear(x, weight, bias)


def _check_plain(weight: torch.Tensor, weight_tail: torch.Tensor | None) -> None:
    if weight.dtype == torch.float8_e4m3fn:
        raise ValueError("weight: float8 values need their weight_scale")
    if weight_tail is not None:
        raise ValueError("weight_tail: only with an FP8 weight (weight_scale)")


def _linear_fp8(
    x, weight, bias, weight_scale, weight_tail, pdl, row_gemv, row_tiles, fp8_gemm, few_rows
) -> torch.Tensor:  # fmt: skip
    """linear with an FP8 weight: the path by rows (see linear)."""
    rows = x.shape[0]
    if not x.is_cuda or x.dim() != 2:
        quantize_x = gemm_quantizes_x(rows, fp8_gemm)
        return naive.linear(
            x=x, weight=weight, bias=bias, weight_scale=weight_scale, weight_tail=weight_tail, quantize_x=quantize_x
        )
    if rows > MAX_TUNED_TOKENS:
        from .triton_fp8 import fp8_linear

        if fp8_gemm == "w8a16":
            backend = "dequant"
        else:
            backend = "triton" if fp8_gemm == "dequant" and rows < DEQUANT_MIN_ROWS else fp8_gemm
        return fp8_linear(
            x=x, weight=weight, weight_scale=weight_scale, bias=bias, weight_tail=weight_tail, pdl=pdl, backend=backend
        )
    args = dict(x=x, weight=weight, bias=bias, weight_scale=weight_scale, weight_tail=weight_tail, pdl=pdl)
    path = _path(x, weight.shape[0], row_gemv, _few_rows(few_rows, fp8=True))
    if path == "row":
        from .triton_row import row_gemv as impl

        return impl(**args, row_tiles=row_tiles)[0]
    if path == "rows":
        from .triton_rows import rows_gemv

        return rows_gemv(**args)[0]
    from .triton_linear import linear as impl

    return impl(**args)


def gemm_path(
    num_rows: int, n: int, k: int, dtype: torch.dtype, info: DeviceInfo, row_gemv: bool, few_rows: int = 0
) -> Path:
    """Which kernel a CUDA call of this shape takes: "row" (the one-row GEMV), "rows" (the few-row
    GEMV, 2..few_rows rows), "skinny" (the skinny GEMM) or "torch" (cuBLAS)."""
    from .triton_row import supports
    from .triton_rows import supports as rows_support

    if row_gemv and supports(num_rows, k, dtype):
        return "row"
    if 2 <= num_rows <= few_rows and rows_support(num_rows, k, dtype):
        return "rows"
    if num_rows <= MAX_TOKENS:
        return "skinny"
    half = dtype in (torch.bfloat16, torch.float16)
    tuned = tuned_for(TUNED, info) or {}
    return "skinny" if half and num_rows <= MAX_TUNED_TOKENS and tuned_key(num_rows, n, k) in tuned else "torch"


def _few_rows(few_rows: int, fp8: bool) -> int:
    """The most rows that take the few-row GEMV: the option's, for an FP8 weight at most FP8_FEW_ROWS_MAX."""
    return min(few_rows, FP8_FEW_ROWS_MAX) if fp8 else few_rows


def _path(x: torch.Tensor, n: int, row_gemv: bool, few_rows: int = 0) -> Path:
    if not x.is_cuda or x.dim() != 2:
        return "torch"
    return gemm_path(x.shape[0], n, x.shape[1], x.dtype, device_info(x.device), row_gemv, few_rows)


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
    weight_scale: torch.Tensor | None = None,
    weight_tail: torch.Tensor | None = None,
    pdl: bool = True,
    row_gemv: bool = True,
    row_tiles: tuple[RowTile, ...] = (),
    low_rank: PairLowRank | None = None,
    few_rows: int = FEW_ROWS_MAX,
    few_rows_norm: bool = True,
    fp8_gemm: str = "dequant",
) -> NormLinearOut:
    """The residual add, the zero-centred input norm and the projection after it:
    s = x + residual (x itself when residual is None), y = rms_norm(s) * (1 + norm_weight),
    out = y @ weight.T (+ bias).

    Args:
        x, residual: [M, K], one dtype. norm_weight: [K]. weight: [N, K]. bias: [N] or None.
        write_normed: also return y. weight_scale, weight_tail, pdl, row_gemv, row_tiles, few_rows,
            fp8_gemm: as `linear`. few_rows_norm: the few-row GEMV may run the norm inside (below).
        low_rank: x's adapters (norm.fused_add_rms_norm's low_rank: s = x + delta + residual; needs
            the residual); the norm kernel then runs, not a row GEMV's norm.

    Returns:
        NormLinearOut(out [M, N], y [M, K] or None, s [M, K]), in x's dtype. A CUDA row whose
        weight has at most triton_row.FUSED_NORM_MAX_N rows (where the fusion measured faster) runs
        the norm inside the one-row GEMV, and 2..few_rows rows (FP8: _few_rows) of such a weight inside the
        few-row GEMV; otherwise the norm kernel, then `linear`.
    """
    if weight_scale is None:
        _check_plain(weight, weight_tail)
    assert low_rank is None or residual is not None, "rms_norm_linear: low_rank needs the residual"
    path = _path(x, weight.shape[0], row_gemv, _few_rows(few_rows, fp8=weight_scale is not None))
    n = weight.shape[0] + (0 if weight_tail is None else weight_tail.shape[0])
    if low_rank is None and path == "rows" and few_rows_norm and _fuses_norm(n):
        from .triton_rows import rows_gemv

        out, normed, summed = rows_gemv(
            x=x, weight=weight, bias=bias, residual=residual, norm_weight=norm_weight, eps=eps,
            write_normed=write_normed, pdl=pdl, weight_scale=weight_scale, weight_tail=weight_tail,
        )  # fmt: skip
        return NormLinearOut(out, normed, x if summed is None else summed)
    if low_rank is None and path == "row" and _fuses_norm(weight.shape[0]):
        from .triton_row import row_gemv as impl

        out, normed, summed = impl(
            x=x, weight=weight, bias=bias, residual=residual, norm_weight=norm_weight, eps=eps,
            write_normed=write_normed, row_tiles=row_tiles, pdl=pdl, weight_scale=weight_scale, weight_tail=weight_tail,
        )  # fmt: skip
        return NormLinearOut(out, normed, x if summed is None else summed)
    if residual is None:
        summed, normed = x, norm_kernels.rms_norm(x=x, weight=norm_weight, eps=eps, pdl=pdl)
    else:
        normed, summed = norm_kernels.fused_add_rms_norm(
            x=x, residual=residual, weight=norm_weight, eps=eps, pdl=pdl, low_rank=low_rank
        )
    out = linear(
        x=normed, weight=weight, bias=bias, weight_scale=weight_scale, weight_tail=weight_tail, pdl=pdl,
        row_gemv=row_gemv, row_tiles=row_tiles, few_rows=few_rows, fp8_gemm=fp8_gemm,
    )  # fmt: skip
    return NormLinearOut(out, normed if write_normed else None, summed)


def _fuses_norm(n: int) -> bool:
    from .triton_row import fuses_norm

    return fuses_norm(n)
