"""Block-scaled FP8 GEMM (prefill-sized projections with an FP8 weight) in Triton:
out[M, :N8] = sum over K blocks of (xq @ wq^T) * x_scale[m, kb] * w_scale[n / bn, kb], float32
accumulation, the output dtype on store.

xq / x_scale: the activations quantized per row and group of 128 columns (fp8.quantize_act, one
launch before this one); wq / w_scale: the weight's float8 values and its block scales. Each K step
is one scale group of both operands (BLOCK_K = min(128, bk)), so the two scales multiply the step's
partial product: tl.dot on float8e4nv operands, which Triton lowers to wgmma (QGMMA) on sm_90 for
64-row tiles and to mma.sync on fp16-widened operands below that. Programs run in grouped order
(GROUP_M row blocks share their weight column blocks in L2). Rows past M and N re-read the last one
(no masks in the loop), K tails are masked; nothing past M / N8 is stored.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..device import DeviceInfo, device_info
from ..fp8 import ACT_GROUP, quantize_act, scale_block
from ..pdl import pdl_launch
from .triton_linear import _reduce_kernel


# the row count changes from pass to pass: one compile serves them all (kernels/__init__.py)
@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(
    a, a_scale, b, b_scale, bias, c, part, M, N, K, s_am, s_asm, s_bn, s_bsn, s_cm, SCALE_N: tl.constexpr,
    SCALE_K: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr, K_SPLIT: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * grid_n
    first_m = (pid // per_group) * GROUP_M
    rows_in_group = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_in_group
    pid_n = (pid % per_group) // rows_in_group

    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ld = tl.minimum(m, M - 1).to(tl.int64)
    n_ld = tl.minimum(n, N - 1).to(tl.int64)
    k_start = pid_k * K_SPLIT
    k = k_start + tl.arange(0, BLOCK_K)
    a_ptr = a + m_ld[:, None] * s_am + k[None, :]
    b_ptr = b + n_ld[None, :] * s_bn + k[:, None]
    as_ptr = a_scale + m_ld * s_asm
    bs_ptr = b_scale + (n_ld // SCALE_N) * s_bsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_start, tl.minimum(k_start + K_SPLIT, K), BLOCK_K):
        if EVEN_K:
            at = tl.load(a_ptr)
            bt = tl.load(b_ptr)
        else:
            at = tl.load(a_ptr, mask=(k0 - k_start + k)[None, :] < K, other=0.0)
            bt = tl.load(b_ptr, mask=(k0 - k_start + k)[:, None] < K, other=0.0)
        sa = tl.load(as_ptr + k0 // GROUP)
        sb = tl.load(bs_ptr + k0 // SCALE_K)
        acc += tl.dot(at, bt) * sa[:, None] * sb[None, :]
        a_ptr += BLOCK_K
        b_ptr += BLOCK_K
    mask = (m < M)[:, None] & (n < N)[None, :]
    if SPLIT_K > 1:  # this split's float32 partial in part [SPLIT_K, M, N]
        offset = pid_k.to(tl.int64) * M * N + m.to(tl.int64)[:, None] * N + n[None, :]
        tl.store(part + offset, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias + n_ld).to(tl.float32)[None, :]
        tl.store(c + m.to(tl.int64)[:, None] * s_cm + n[None, :], acc.to(c.dtype.element_ty), mask=mask)


# at or under this many rows the weight's bytes bound the time (decode batches): narrower tiles, split K
WEIGHT_BOUND_ROWS = 256


def pick_config(num_rows: int, n: int, k: int, info: DeviceInfo) -> dict:
    """Tiles by the row count: 64-row tiles up to 64 rows (one wgmma row block), 128 above; 128
    weight columns (one scale block), 64 up to WEIGHT_BOUND_ROWS rows with K split (powers of two,
    each split at least one 128-column step) until ~2 programs per SM; unmeasured. Interpreter:
    small tiles."""
    if info.is_interpreter:
        return dict(block_m=16, block_n=32, block_k=128, group_m=4, num_warps=4, num_stages=1, split_k=1)
    if num_rows <= 64:
        cfg = dict(block_m=64, block_n=64, block_k=128, group_m=8, num_warps=4, num_stages=4)
    elif num_rows <= WEIGHT_BOUND_ROWS:
        cfg = dict(block_m=128, block_n=64, block_k=128, group_m=8, num_warps=8, num_stages=3)
    else:
        return dict(block_m=128, block_n=128, block_k=128, group_m=8, num_warps=8, num_stages=3, split_k=1)
    tiles = triton.cdiv(num_rows, cfg["block_m"]) * triton.cdiv(n, cfg["block_n"])
    split = 1
    while tiles * split < 2 * info.num_sms and split < 16 and k >= 2 * split * cfg["block_k"]:
        split *= 2
    return dict(cfg, split_k=split)


def cublas_fp8_ok(weight: torch.Tensor, weight_scale: torch.Tensor) -> bool:
    """Whether cuBLAS's block-scaled FP8 GEMM (torch's scaled_mm, 1 x 128 activation and 128 x 128
    weight scales) takes this weight: 128 x 128 scale blocks, rows a multiple of 128, K of 512 (its
    weight scales then need no padding to four K groups), contiguous scales."""
    n8, k = weight.shape
    return (
        hasattr(F, "scaled_mm")
        and n8 % 128 == 0
        and k % 512 == 0
        and weight_scale.is_contiguous()
        and scale_block(n8, k, tuple(weight_scale.shape)) == (128, 128)
    )


def _cublas_fp8(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, pdl: bool) -> torch.Tensor:
    """x @ (q * s)^T by cuBLAS's block-scaled FP8 GEMM: x quantized per 1 x 128 group with its
    scales rows-fastest (cuBLAS's layout), the weight's [N / 128, K / 128] scales as [K / 128, N / 128]
    K-fastest (its transpose, no copy). cuBLAS refuses x scales whose columns are not 16-byte aligned
    (CUBLAS_STATUS_NOT_SUPPORTED at 17, 33, 2,049 rows on the H200): rows padded to a multiple of 4."""
    rows = x.shape[0]
    if rows % 4:
        x = F.pad(x, (0, 0, 0, 4 - rows % 4))
    xq, xs = quantize_act(x=x, group=ACT_GROUP, pdl=pdl, m_major=True)
    kind = F.ScalingType
    out = F.scaled_mm(
        xq, weight.t(), xs, kind.BlockWise1x128, weight_scale.t(), kind.BlockWise128x128, output_dtype=x.dtype
    )
    return out[:rows]


def fp8_linear(
    *, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
    weight_tail: torch.Tensor | None = None, config: dict | None = None, pdl: bool = True, backend: str = "triton",
) -> torch.Tensor:  # fmt: skip
    """linear.linear's tensor-core path for an FP8 weight: x quantized per 1 x 128 group, the
    block-scaled GEMM into the FP8 rows' columns, the tail rows (x as it is) on cuBLAS into the rest.
    `config` forces tiles (block_m, block_n, block_k, group_m, num_warps, num_stages, split_k).
    backend "cublas": the GEMM on cuBLAS's block-scaled FP8 kernel where it takes the weight
    (cublas_fp8_ok; else this Triton kernel); "dequant": the weight (and its tail) dequantized into
    one bf16 scratch, then cuBLAS's bf16 GEMM (x as it is)."""
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1], "x [M, K], weight [N, K]"
    num_rows, k = x.shape
    n8 = weight.shape[0]
    n = n8 + (0 if weight_tail is None else weight_tail.shape[0])
    out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    if backend == "dequant":
        from ..fp8.triton_dequant import dequantize_weight

        full = torch.empty((n, k), dtype=x.dtype, device=x.device)
        tail = (
            None if weight_tail is None else (weight_tail if weight_tail.stride(1) == 1 else weight_tail.contiguous())
        )
        block = scale_block(n8, k, tuple(weight_scale.shape))
        dequantize_weight(q=weight, scale=weight_scale, block=block, out=full, tail=tail)  # the tail rows too
        return F.linear(x, full, bias)
    if backend == "cublas" and cublas_fp8_ok(weight, weight_scale):
        main = _cublas_fp8(x, weight, weight_scale, pdl)
        if bias is not None:
            main += bias[:n8]
        if weight_tail is None:
            return main
        out[:, :n8] = main
        out[:, n8:] = F.linear(x, weight_tail, None if bias is None else bias[n8:])
        return out
    xq, xs = quantize_act(x=x, group=ACT_GROUP, pdl=pdl)
    scale_n, scale_k = scale_block(n8, k, tuple(weight_scale.shape))
    cfg = dict(config or pick_config(num_rows, n8, k, device_info(x.device)))
    block_k = min(cfg["block_k"], scale_k, ACT_GROUP)
    # K split into ranges of whole steps, none empty
    k_split = triton.cdiv(triton.cdiv(k, max(1, cfg.get("split_k", 1))), block_k) * block_k
    split = triton.cdiv(k, k_split)
    part = torch.empty((split, num_rows, n8), dtype=torch.float32, device=x.device) if split > 1 else out
    grid = (triton.cdiv(num_rows, cfg["block_m"]) * triton.cdiv(n8, cfg["block_n"]), split)
    _fp8_gemm_kernel[grid](
        xq, xs, weight, weight_scale, bias if bias is not None else out, out, part, num_rows, n8, k, xq.stride(0),
        xs.stride(0), weight.stride(0), weight_scale.stride(0), out.stride(0), SCALE_N=scale_n, SCALE_K=scale_k,
        GROUP=ACT_GROUP, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], BLOCK_K=block_k, GROUP_M=cfg["group_m"],
        EVEN_K=k % k_split == 0, HAS_BIAS=bias is not None, SPLIT_K=split, K_SPLIT=k_split,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    if split > 1:
        block = 1024
        _reduce_kernel[(triton.cdiv(num_rows * n8, block),)](
            part, bias if bias is not None else out, out, num_rows, n8, out.stride(0), SPLIT_K=split, BLOCK=block,
            HAS_BIAS=bias is not None, num_warps=4, **pdl_launch(part, pdl),
        )  # fmt: skip
    if weight_tail is not None:
        tail_bias = None if bias is None else bias[n8:]
        out[:, n8:] = F.linear(x, weight_tail, tail_bias)
    return out
