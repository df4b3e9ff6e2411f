"""Few-row GEMV (a speculative verify's k + 1 rows, a small decode batch): the one-row kernel's
weight tile, loaded once before the PDL wait, reused for every row of x.

out[m, n] = sum_k w[n, k] * x[m, k] for M rows (2..16 in the engine), float32 accumulation.

Why: the skinny GEMM's GEMV form streams K in chunks with one float32 accumulator per row and x
tiles broadcast per chunk; at 4 rows it measured ~2x the one-row GEMV's time for the same weight.
Here each program holds its whole [BLOCK_N, K] weight tile in registers (as triton_row), then takes
the rows GROUP at a time: a [GROUP, BLOCK_N, K] product reduced over K in one reduction (one
cross-warp exchange per group, not per row). x rows are re-read per program from L1 / L2 (M / BLOCK_N
times the weight's bytes; x is a few KB a row), the weight from DRAM exactly once.

Grid: cdiv(N, BLOCK_N) programs; BLOCK_K = next_power_of_2(K). Weight rows past N re-read row N - 1
and x rows past M re-read row M - 1 (no masks on the loads), their results never stored.

NORM: the residual add and the zero-centred RMSNorm in front, as triton_row's fused form: every
program computes its group's rows' sum (rounded to x's dtype), norm and normed row (rounded) as
the norm kernel does, and dots the normed row; program 0 writes the new residual and the normed
rows for later kernels (the MoE block's experts).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..device import DeviceInfo, device_info
from ..fp8 import scale_block
from ..pdl import pdl_launch, pdl_wait
from .triton_row import dividing_block

MAX_K = 8192
# registers a thread spends: the weight tile's elements, and a group's float32 products
MAX_W_PER_THREAD = 16
MAX_PRODUCT_PER_THREAD = 64
NORM_GROUP = 2


@triton.jit
def _rows_gemv_kernel(
    x, residual, norm_weight, w, scale, tail, bias, out, res_out, normed_out, M, N, N8, s_xm, s_rm, s_wn, s_sn,
    s_tn, s_om, eps, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
    EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    WRITE_NORMED: tl.constexpr, PRELOAD: tl.constexpr, FP8: tl.constexpr, HAS_TAIL: tl.constexpr,
    SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """FP8 (w float8 with block scales `scale`, SCALE_N x SCALE_K, row stride s_sn): each program
    widens and scales its weight tile once, then every row reuses it. HAS_TAIL: output columns N8..
    come from `tail` (x's dtype, row stride s_tn), BLOCK_N rows a program, in the programs after
    the FP8 rows' (N8 a multiple of BLOCK_N)."""
    pid = tl.program_id(0)
    if HAS_TAIL:
        tail_block = pid - N8 // BLOCK_N
        if tail_block >= 0:
            _rows_body(
                x, residual, norm_weight, tail, scale, bias + N8, out + N8, res_out, normed_out, tail_block, pid == 0,
                M, N - N8, s_xm, s_rm, s_tn, 0, s_om, eps, K, BLOCK_N, BLOCK_K, GROUP, EVEN_K, HAS_BIAS, NORM,
                HAS_RESIDUAL, WRITE_NORMED, PRELOAD, False, SCALE_N, SCALE_K, USE_PDL,
            )  # fmt: skip
            return
    _rows_body(
        x, residual, norm_weight, w, scale, bias, out, res_out, normed_out, pid, pid == 0, M, N8 if HAS_TAIL else N,
        s_xm, s_rm, s_wn, s_sn, s_om, eps, K, BLOCK_N, BLOCK_K, GROUP, EVEN_K, HAS_BIAS, NORM, HAS_RESIDUAL,
        WRITE_NORMED, PRELOAD, FP8, SCALE_N, SCALE_K, USE_PDL,
    )  # fmt: skip


@triton.jit
def _rows_body(
    x, residual, norm_weight, w, scale, bias, out, res_out, normed_out, pid, writer, M, N, s_xm, s_rm, s_wn, s_sn,
    s_om, eps, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
    EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    WRITE_NORMED: tl.constexpr, PRELOAD: tl.constexpr, FP8: tl.constexpr, SCALE_N: tl.constexpr,
    SCALE_K: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """Row block `pid` of an N-row weight w (out, bias: its first column's); `writer`: this program
    writes the residual and normed rows."""
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ld = tl.minimum(n, N - 1).to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    g = tl.arange(0, GROUP)
    # 3-D from the start ([1, BLOCK_N, BLOCK_K] weights, [GROUP, 1, BLOCK_K] rows of x): the product's
    # layout reaches the loads, so neither operand needs a layout conversion
    w_ptr = w + n_ld[None, :, None] * s_wn + k[None, None, :]
    k_ok = k[None, None, :] < K
    # FP8: the tile lies in one scale row (BLOCK_N divides SCALE_N): its factors as one row [1, 1, BLOCK_K]
    # (identical addresses within a block), read once a program and broadcast over the tile's rows
    s_ptr = scale + ((pid * BLOCK_N) // SCALE_N) * s_sn + (k // SCALE_K)[None, None, :]
    if PRELOAD:  # weights are constant during the pass: fetch them while the previous kernel ends
        wt = _load_tile(w_ptr, k_ok, EVEN_K)
        if FP8:
            sc = tl.load(s_ptr, mask=k_ok, other=0.0)
    pdl_wait(USE_PDL)
    if not PRELOAD:
        wt = _load_tile(w_ptr, k_ok, EVEN_K)
        if FP8:
            sc = tl.load(s_ptr, mask=k_ok, other=0.0)
    wf = wt.to(tl.float32)
    if FP8:
        wf = wf * sc
    if HAS_BIAS:
        b = tl.load(bias + n_ld).to(tl.float32)
    if NORM:
        norm_scale = 1.0 + tl.load(norm_weight + k[None, None, :], mask=k_ok, other=0.0).to(tl.float32)
    for m0 in range(0, M, GROUP):
        m = m0 + g
        m_ld = tl.minimum(m, M - 1).to(tl.int64)[:, None, None]
        x_ptr = x + m_ld * s_xm + k[None, None, :]
        if EVEN_K:
            xt = tl.load(x_ptr)
        else:
            xt = tl.load(x_ptr, mask=k_ok, other=0.0)
        if NORM:
            xt = _add_norm(xt, residual + m_ld * s_rm + k[None, None, :], norm_scale, res_out, normed_out,
                           m, M, k, k_ok, writer, eps, K, HAS_RESIDUAL, WRITE_NORMED)  # fmt: skip
        acc = tl.sum(wf * xt.to(tl.float32), 2)  # [GROUP, BLOCK_N]
        if HAS_BIAS:
            acc += b[None, :]
        mask = (m < M)[:, None] & (n < N)[None, :]
        tl.store(out + m.to(tl.int64)[:, None] * s_om + n[None, :], acc.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _load_tile(ptr, k_ok, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(ptr, eviction_policy="evict_first")
    return tl.load(ptr, mask=k_ok, other=0.0, eviction_policy="evict_first")


@triton.jit
def _add_norm(
    xt, res_ptr, scale, res_out, normed_out, m, M, k, k_ok, writer, eps, K: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    WRITE_NORMED: tl.constexpr,
):  # fmt: skip
    """The group's rows [GROUP, 1, BLOCK_K] after the residual add (rounded to the stream's dtype) and
    the norm (rounded), the norm kernel's arithmetic; the writer stores the sums and normed rows."""
    y = xt.to(tl.float32)
    out_at = m.to(tl.int64)[:, None, None] * K + k[None, None, :]  # res_out / normed_out: [M, K] contiguous
    row_ok = (m < M)[:, None, None] & k_ok
    if HAS_RESIDUAL:
        summed = (y + tl.load(res_ptr, mask=k_ok, other=0.0).to(tl.float32)).to(xt.dtype)
        if writer:
            tl.store(res_out + out_at, summed, mask=row_ok)
        y = summed.to(tl.float32)
    inv = tl.rsqrt(tl.sum(y * y, 2) / K + eps)  # [GROUP, 1]
    normed = ((y * inv[:, :, None]) * scale).to(xt.dtype)
    if WRITE_NORMED:  # noqa: SIM102 (a constexpr test, then a run-time one)
        if writer:
            tl.store(normed_out + out_at, normed, mask=row_ok)
    return normed


def supports(num_rows: int, k: int, dtype: torch.dtype) -> bool:
    """Whether a call of this shape can take the few-row kernel (x in half precision; the weight in
    x's dtype or FP8 with block scales)."""
    return num_rows >= 1 and 0 < k <= MAX_K and dtype in (torch.bfloat16, torch.float16)


def pick_config(num_rows: int, n: int, k: int, info: DeviceInfo, norm: bool = False, fp8: bool = False) -> dict:
    """block_n, num_warps and group (rows per reduction) from the shape: 8 warps; the weight tile
    within MAX_W_PER_THREAD elements a thread (two rows of a 2048-wide weight, one of a 4096-wide),
    fewer rows where N would leave under ~2 programs per SM; the group as large as the product's
    registers allow, at most the rows (a power of two), and at most NORM_GROUP with the fused norm
    (its rows' sums and normed values take registers too: sm_90, K 2048, 2 rows, 8 warps: 74
    registers at group 2, 102 at 4). Interpreter: small tiles."""
    block_k = triton.next_power_of_2(k)
    rows = triton.next_power_of_2(max(1, num_rows))
    if info.is_interpreter:
        return dict(block_n=4, num_warps=1, group=min(rows, 4))
    if fp8:
        return _fp8_config(rows, n, block_k, info)
    num_warps = 4 if block_k <= 1024 else 8
    threads = 32 * num_warps
    block_n = 1
    while block_n < 8 and 2 * block_n * block_k <= MAX_W_PER_THREAD * threads and n >= 2 * block_n * 2 * info.num_sms:
        block_n *= 2
    group = 1
    while group < min(rows, 16) and 2 * group * block_n * block_k <= MAX_PRODUCT_PER_THREAD * threads:
        group *= 2
    if norm:
        group = min(group, NORM_GROUP)
    return dict(block_n=block_n, num_warps=num_warps, group=group)


# FP8 weights: a thread's share of the weight tile. The sm_90 build (Triton 3.6) puts the kernel's cost in
# issued instructions (widening, the scale row, the reductions: a fixed part a program), so a program
# takes more of the weight than bf16's tiles: 8 rows of K 2048 over 4 warps, ~7 us for GDN in_proj at
# 2 rows by the build's instruction count, against 15.8 measured on the skinny GEMM (H200, 879cbbc)
FP8_W_PER_THREAD = 128
FP8_MAX_GROUP = 4


def _fp8_config(rows: int, n: int, block_k: int, info: DeviceInfo) -> dict:
    """FP8 tiles: FP8_W_PER_THREAD weights a thread, 8 rows a program where N leaves a program per SM,
    the group as many rows as FP8_MAX_GROUP."""
    num_warps = 4 if block_k <= 2048 else 8
    block_n = max(1, min(8, FP8_W_PER_THREAD * 32 * num_warps // block_k))
    while block_n > 1 and n < block_n * info.num_sms:
        block_n //= 2
    return dict(block_n=block_n, num_warps=num_warps, group=min(rows, FP8_MAX_GROUP))


def rows_gemv(
    *, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config: dict | None = None,
    preload: bool = True, pdl: bool = True, residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None, eps: float = 1e-6, write_normed: bool = False,
    weight_scale: torch.Tensor | None = None, weight_tail: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    """x [M, K] (last dim contiguous; rows may be strided) @ weight [N, K].T (+ bias [N]) -> [M, N]
    in x's dtype. `config` forces block_n / num_warps / group (powers of two; the bench sweeps them).
    With norm_weight: y = rms_norm(x + residual) * (1 + norm_weight) (residual [M, K] or None) in
    front, as triton_row.row_gemv. Returns (out, y if write_normed else None, x + residual if
    residual is given else None).
    weight_scale: weight is float8 with these block scales (fp8.scale_block), dequantized in
    registers once a program; weight_tail [N_tail, K] in x's dtype: rows appended after weight's (the
    output has N + N_tail columns; block_n shrinks to a power of two dividing N)."""
    fp8 = weight_scale is not None
    assert x.dim() == 2 and weight.dim() == 2 and weight.shape[1] == x.shape[1], "x [M, K], weight [N, K]"
    assert fp8 or x.dtype == weight.dtype, "x and weight share a dtype (or weight is FP8 with its scales)"
    assert weight_tail is None or (fp8 and weight_tail.dtype == x.dtype), "weight_tail: FP8 weights', in x's dtype"
    num_rows, k = x.shape
    n8 = weight.shape[0]
    n = n8 + (0 if weight_tail is None else weight_tail.shape[0])
    assert k <= MAX_K, f"K = {k} is over the few-row kernel's {MAX_K}"
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    if weight_tail is not None and weight_tail.stride(1) != 1:
        weight_tail = weight_tail.contiguous()
    norm = norm_weight is not None
    if residual is not None:
        assert norm and residual.shape == x.shape and residual.dtype == x.dtype, "residual [M, K] like x"
        residual = residual if residual.stride(1) == 1 else residual.contiguous()
    out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    res_out = torch.empty((num_rows, k), dtype=x.dtype, device=x.device) if residual is not None else None
    normed = torch.empty((num_rows, k), dtype=x.dtype, device=x.device) if norm and write_normed else None
    if num_rows == 0 or n == 0 or k == 0:
        assert not norm or (num_rows == 0 and n > 0 and k > 0), "the fused norm needs rows, columns and K"
        if num_rows and n:
            out.zero_()
            out = out + bias.to(out.dtype) if bias is not None else out
        return out, normed, res_out
    cfg = dict(config or pick_config(num_rows, n, k, device_info(x.device), norm=norm, fp8=fp8))
    if weight_tail is not None:  # the tail's programs start after whole row blocks
        cfg["block_n"] = dividing_block(cfg["block_n"], n8)
    scale_n, scale_k = scale_block(n8, k, tuple(weight_scale.shape)) if fp8 else (1, 1)
    if fp8:  # a tile within one scale row
        cfg["block_n"] = min(cfg["block_n"], scale_n)
    blocks = triton.cdiv(n8, cfg["block_n"]) + (0 if weight_tail is None else triton.cdiv(n - n8, cfg["block_n"]))
    block_k = triton.next_power_of_2(k)
    _rows_gemv_kernel[(blocks,)](
        x, residual if residual is not None else x, norm_weight if norm else x, weight,
        weight_scale if fp8 else out, weight_tail if weight_tail is not None else weight,
        bias if bias is not None else out, out, res_out if res_out is not None else out,
        normed if normed is not None else out, num_rows, n, n8, x.stride(0),
        residual.stride(0) if residual is not None else 0, weight.stride(0), weight_scale.stride(0) if fp8 else 0,
        weight_tail.stride(0) if weight_tail is not None else 0, out.stride(0), eps,
        K=k, BLOCK_N=cfg["block_n"], BLOCK_K=block_k, GROUP=cfg["group"], EVEN_K=block_k == k,
        HAS_BIAS=bias is not None, NORM=norm, HAS_RESIDUAL=residual is not None, WRITE_NORMED=normed is not None,
        PRELOAD=preload, FP8=fp8, HAS_TAIL=weight_tail is not None, SCALE_N=scale_n, SCALE_K=scale_k,
        num_warps=cfg["num_warps"], num_stages=1, **pdl_launch(x, pdl),
    )  # fmt: skip
    return out, normed, res_out
