"""Plain-torch FP8 (e4m3) quantization: the references, the CPU path, and the weight quantizer the
loader uses (block scales), with its inverse."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value
# an all-zero group or block gets this amax instead of 0 (no division by zero; its values stay 0)
AMAX_FLOOR = 1e-10
ACT_GROUP = 128  # columns per activation scale (1 x 128 groups)
# linear's FP8 paths by rows (linear.MAX_TUNED_TOKENS is GEMV_MAX_ROWS): up to GEMV_MAX_ROWS the GEMV /
# skinny GEMM take x as it is; above, the fp8_gemm setting's GEMM. "dequant" (the weight dequantized
# for cuBLAS's bf16 GEMM, x as it is) from DEQUANT_MIN_ROWS rows: it moves 5 bytes a weight to the W8A8
# GEMM's 1, so decode batches below it keep the W8A8 GEMM (H200, FP8 decode step, two sessions apart:
# batch 64 13.23 ms W8A8 at 3b42315 against 13.98 dequant at 4ff468f, batch 256 24.57 against 23.58,
# bf16 alike in both; the crossover interpolated at ~150 rows, unmeasured: docs/PERF.md stages it)
GEMV_MAX_ROWS = 16
DEQUANT_MIN_ROWS = 128


def gemm_quantizes_x(rows: int, fp8_gemm: str) -> bool:
    """Whether linear with an FP8 weight quantizes its `rows`-row input (per row and 1 x 128 group)
    under its fp8_gemm ("dequant", "triton", "cublas", or "w8a16": the dequantized weight's GEMM at
    every size above the GEMVs): the W8A8 GEMMs do, the GEMVs and the dequantized weight's GEMM do not."""
    if fp8_gemm == "w8a16":
        return False
    return rows > GEMV_MAX_ROWS and (fp8_gemm != "dequant" or rows < DEQUANT_MIN_ROWS)


def quantize_act(*, x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference of fp8.quantize_act: per row and group of `group` columns, s = max(amax,
    AMAX_FLOOR) / 448 and q = x / s (IEEE float32 division, round to nearest even, saturated)."""
    rows, cols = x.shape
    groups = -(-cols // group)
    padded = torch.zeros(rows, groups * group, dtype=torch.float32, device=x.device)
    padded[:, :cols] = x.float()
    blocks = padded.view(rows, groups, group)
    scale = blocks.abs().amax(dim=2).clamp_min(AMAX_FLOOR) / FP8_MAX
    q = (blocks / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(rows, -1)[:, :cols].contiguous(), scale


def expand_scale(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """A [..., ceil(rows / bn), ceil(cols / bk)] scale grid as one value per element [..., rows, cols]."""
    bn, bk = block
    return scale.repeat_interleave(bn, dim=-2)[..., :rows, :].repeat_interleave(bk, dim=-1)[..., :cols]


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [..., N, K] (float8) times its block scales [..., ceil(N / bn), ceil(K / bk)] (the block
    read off the shapes, scale_block), computed in float32, returned in `dtype`."""
    rows, cols = q.shape[-2:]
    block = scale_block(rows, cols, tuple(scale.shape[-2:]))
    return (q.float() * expand_scale(scale.float(), rows, cols, block)).to(dtype)


def quantize_weight(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """Block quantization of w [..., N, K]: per bn x bk block s = max(amax, AMAX_FLOOR) / 448 and
    q = w / s (float32, round to nearest even, saturated). Returns (q float8_e4m3fn [..., N, K],
    s float32 [..., ceil(N / bn), ceil(K / bk)]), the layout of block-FP8 checkpoints (s is their
    `weight_scale_inv`: the factor that dequantizes)."""
    rows, cols = w.shape[-2:]
    bn, bk = block
    gn, gk = -(-rows // bn), -(-cols // bk)
    lead = w.shape[:-2]
    padded = torch.zeros(*lead, gn * bn, gk * bk, dtype=torch.float32, device=w.device)
    padded[..., :rows, :cols] = w.float()
    blocks = padded.view(*lead, gn, bn, gk, bk)
    scale = blocks.abs().amax(dim=(-3, -1)).clamp_min(AMAX_FLOOR) / FP8_MAX
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(*lead, gn * bn, gk * bk)[..., :rows, :cols].contiguous(), scale


def scale_block(rows: int, cols: int, grid: tuple[int, int]) -> tuple[int, int]:
    """The (bn, bk) block of a [rows, cols] weight whose scale grid is `grid`: for each axis the
    smallest power of two b <= 128 with ceil(n / b) == grid (when the grid has one entry any b >= n
    indexes alike: the smallest such power of two). A grid no power of two gives is an error."""
    return _block(rows, grid[0], "rows"), _block(cols, grid[1], "columns")


def _block(n: int, groups: int, what: str) -> int:
    b = 1
    while b <= 128:
        if -(-n // b) == groups:
            return b
        b *= 2
    raise ValueError(f"a scale grid of {groups} for {n} {what} matches no power-of-two block up to 128")
