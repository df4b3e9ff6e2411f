"""FP8 weights in the model: which projections a block-FP8 scheme quantizes, the parameters an FP8
projection holds, and writing checkpoint slices into them.

An FP8 projection weight is a parameter of float8_e4m3fn rows [*, N8, K] carrying `.fp8`
(Fp8Layout): its float32 block scales [*, ceil(N8 / bn), ceil(K / bk)] and, for a fused projection
whose last rows the checkpoint keeps unquantized (the MoE router and shared-expert gate, the GDN b
and a rows), those rows as a tail [*, N - N8, K] in the model's dtype. The kernels take the three
(linear's weight_scale / weight_tail, fused_moe's w13_scale / w2_scale).

The local block (bn, bk) is the checkpoint's (128 x 128) where a rank's rows and columns of every
piece of the fused weight start on it; smaller where they do not (a power of two dividing the
pieces: tiny test models, or shards narrower than a block), each local block then lying inside one
checkpoint block. `assign` writes a checkpoint slice: an FP8 one as it is (its values, and the
scales of the blocks it lies in), a higher-precision one (a bf16 checkpoint under
quantization="fp8", or the random format) quantized in the scheme's blocks of the whole checkpoint
tensor first, so that both give the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .base import LazyTensor, copy_into
from .config import Fp8Scheme
from .kernels import fp8 as fp8_kernels


@dataclass(frozen=True)
class Fp8Projection:
    """A projection weight a layer can hold in FP8: module.attr [*, N, K]; `sources` the checkpoint
    modules of its first N - tail_rows rows (FP8 only if the scheme quantizes all of them); the
    tail rows stay in the model's dtype. row_unit / col_unit: a length every piece of a rank's rows
    / columns starts and ends on (the local block divides it)."""

    module: nn.Module
    attr: str
    sources: tuple[str, ...]
    tail_rows: int = 0
    row_unit: int = 128
    col_unit: int = 128


@dataclass
class Fp8Layout:
    """What an FP8 weight parameter carries (as `.fp8`): its block scales, its tail (or None), the
    local block and the FP8 row count N8."""

    scale: nn.Parameter
    tail: nn.Parameter | None
    block: tuple[int, int]
    rows: int


def local_block(unit: int, block: int) -> int:
    """The largest power of two dividing `unit` (0: any), at most `block`."""
    b = block
    while unit % b:
        b //= 2
    return b


def apply_scheme(
    projections: list[Fp8Projection], scheme: Fp8Scheme, device: torch.device | str, dtype: torch.dtype
) -> None:
    """Each projection whose sources the scheme quantizes becomes FP8 (rows, scales and tail
    allocated on `device`, uninitialised); the others are left as they are."""
    for p in projections:
        if not p.sources or not all(scheme.quantizes(s) for s in p.sources):
            continue
        old = getattr(p.module, p.attr)
        *lead, n, k = old.shape
        rows = n - p.tail_rows
        bn, bk = local_block(p.row_unit, scheme.block[0]), local_block(p.col_unit, scheme.block[1])
        q = nn.Parameter(torch.empty(*lead, rows, k, dtype=fp8_kernels.FP8, device=device), requires_grad=False)
        scale = torch.empty(*lead, -(-rows // bn), -(-k // bk), dtype=torch.float32, device=device)
        tail = None
        if p.tail_rows:
            tail = nn.Parameter(torch.empty(*lead, p.tail_rows, k, dtype=dtype, device=device), requires_grad=False)
            p.module.register_parameter(p.attr + "_tail", tail)
        p.module.register_parameter(p.attr + "_scale", nn.Parameter(scale, requires_grad=False))
        q.fp8 = Fp8Layout(getattr(p.module, p.attr + "_scale"), tail, (bn, bk), rows)
        setattr(p.module, p.attr, q)


def layout(param: torch.Tensor) -> Fp8Layout | None:
    """An FP8 weight's layout; None for a plain weight."""
    return getattr(param, "fp8", None)


def scale_of(param: torch.Tensor) -> torch.Tensor | None:
    """An FP8 weight's block scales (the kernels' weight_scale); None for a plain weight."""
    lay = layout(param)
    return None if lay is None else lay.scale


def tail_of(param: torch.Tensor) -> torch.Tensor | None:
    """An FP8 weight's unquantized tail rows; None when it has none (or is a plain weight)."""
    lay = layout(param)
    return None if lay is None else lay.tail


def rows_of(param: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of a weight's logical [*, N, K] (an FP8 weight: they must lie in its
    tail, as a view there; a plain weight: a view)."""
    lay = layout(param)
    if lay is None:
        return param[..., start:stop, :]
    assert start >= lay.rows and lay.tail is not None, "rows of an FP8 weight's FP8 part are not a plain tensor"
    return lay.tail[..., start - lay.rows : stop - lay.rows, :]


def assign(param: torch.Tensor, dst: tuple, t: LazyTensor, src: tuple, name: str) -> None:
    """param[dst] = the checkpoint tensor's slice t[src]: dst (leading indices, then a row slice
    and a column slice of param's logical [*, N, K]) and src (slices of t) name blocks of one
    shape. A plain param: the values (an FP8 source dequantized, by LazyTensor.get). An FP8 param:
    its tail rows as for a plain one, its FP8 rows as described in the module docstring."""
    lay = layout(param)
    if lay is None:
        copy_into(param[dst], t.get(*src), name)
        return
    *lead, rows, cols = _full(dst, (0,) * param.dim())
    r0, r1 = _bounds(rows, param.shape[-2] + (0 if lay.tail is None else lay.tail.shape[-2]))
    if r0 >= lay.rows:  # the tail
        copy_into(lay.tail[(*lead, slice(r0 - lay.rows, r1 - lay.rows), cols)], t.get(*src), name)
        return
    if r1 > lay.rows:
        raise ValueError(f"checkpoint tensor '{name}': rows {r0}..{r1} straddle the FP8 rows' end {lay.rows}")
    c0, c1 = _bounds(cols, param.shape[-1])
    *src_lead, src_rows, src_cols = _full(src, t.shape)
    s0, s1 = _bounds(src_rows, t.shape[-2])
    k0, k1 = _bounds(src_cols, t.shape[-1])
    if (s1 - s0, k1 - k0) != (r1 - r0, c1 - c0):
        got, want = (s1 - s0, k1 - k0), (r1 - r0, c1 - c0)
        raise ValueError(f"checkpoint tensor '{name}' slice has shape {got}, expected {want}")
    bn, bk = lay.block
    if r0 % bn or c0 % bk or s0 % bn or k0 % bk:
        raise ValueError(f"checkpoint tensor '{name}': an FP8 piece starts inside a {bn} x {bk} scale block")
    q, blocks, cb = _fp8_slice(t, tuple(src_lead), (s0, s1), (k0, k1), param.device)
    copy_into(param[(*lead, slice(r0, r1), slice(c0, c1))], q, name)
    # each local block's factor: that of the checkpoint block its first element lies in
    rb = (s0 + torch.arange(0, r1 - r0, bn)) // cb[0] - s0 // cb[0]
    kb = (k0 + torch.arange(0, c1 - c0, bk)) // cb[1] - k0 // cb[1]
    local = blocks[..., rb, :][..., :, kb]
    dst_blocks = (*lead, slice(r0 // bn, r0 // bn + local.shape[-2]), slice(c0 // bk, c0 // bk + local.shape[-1]))
    copy_into(lay.scale[dst_blocks], local, name + " (block scales)")


def _bounds(index, size: int) -> tuple[int, int]:
    start, stop, step = index.indices(size) if isinstance(index, slice) else (index, index + 1, 1)
    assert step == 1, "contiguous slices"
    return start, stop


def _full(src: tuple, shape: tuple[int, ...]) -> tuple:
    """src padded with whole-dimension slices to t's rank."""
    return tuple(src) + (slice(None),) * (len(shape) - len(src))


def _fp8_slice(
    t: LazyTensor, lead: tuple, rows: tuple[int, int], cols: tuple[int, int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
    """(values float8 [*, R, C], the scales of the checkpoint blocks the slice touches [*, RB, CB],
    the checkpoint block) of t[lead, rows, cols]: an FP8 tensor's own, or a higher-precision one
    quantized (on `device`) in the scheme's blocks of the whole tensor (the block-aligned slice
    around it)."""
    (s0, s1), (k0, k1) = rows, cols
    if t.scale is not None:
        bn, bk = t.block
        q = t.get_raw(*lead, slice(s0, s1), slice(k0, k1))
        sc = t.scale.get(*lead, slice(s0 // bn, -(-s1 // bn)), slice(k0 // bk, -(-k1 // bk))).float()
        return q, sc, (bn, bk)
    bn, bk = t.block
    a0, a1 = s0 // bn * bn, min(-(-s1 // bn) * bn, t.shape[-2])
    b0, b1 = k0 // bk * bk, min(-(-k1 // bk) * bk, t.shape[-1])
    q, sc = fp8_kernels.quantize_weight(t.get(*lead, slice(a0, a1), slice(b0, b1)).to(device), (bn, bk))
    return q[..., s0 - a0 : s1 - a0, k0 - b0 : k1 - b0], sc, (bn, bk)
