"""Triton RMSNorm variants: one kernel, [ROWS, D] tiles, float32 math, flags for the zero-centred
scale, the silu gate (GDN output norm) and the fused residual add. Rows may be strided (views of
a larger tensor, e.g. q out of a fused q/gate projection); the last dim must be contiguous."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..pdl import pdl_launch, pdl_wait


# values that change from pass to pass: one compile serves them all (kernels/__init__.py)
@triton.jit(do_not_specialize=["num_rows"])
def _rms_norm_kernel(
    x, gate, residual, weight, out, res_out, ids, num_rows, s_x, s_g, gate_heads, s_gh, s_r, s_o, s_ro, eps,
    lora_keys, lora_v, lora_b, s_lv, s_lg, s_ln, DIM: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
    ZERO_CENTERED: tl.constexpr, HAS_GATE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GATHER: tl.constexpr,
    LORA_RANK: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """LORA_RANK > 0: x's rows get their low-rank delta (low_rank.PairLowRank: lora_keys, lora_v rows
    of stride s_lv, lora_b [S, DIM, LORA_RANK] of strides s_lg, s_ln) in float32 before the residual
    add, one rank column at a time."""
    pdl_wait(USE_PDL)
    r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = (r < num_rows)[:, None] & (d < DIM)[None, :]
    if GATHER:  # x is a table and row r reads its row ids[r] (an embedding lookup), kept as res_out
        src = tl.load(ids + r, mask=r < num_rows, other=0).to(tl.int64)
        xg = tl.load(x + src[:, None] * s_x + d[None, :], mask=mask, other=0.0)
        tl.store(res_out + r[:, None] * s_ro + d[None, :], xg, mask=mask)
        xv = xg.to(tl.float32)
    else:
        xv = tl.load(x + r[:, None] * s_x + d[None, :], mask=mask, other=0.0).to(tl.float32)
    if LORA_RANK > 0:
        key = tl.load(lora_keys + r, mask=r < num_rows, other=-1)
        has = (r < num_rows) & (key >= 0)
        b_rows = lora_b + tl.maximum(key, 0).to(tl.int64)[:, None] * s_lg + d[None, :] * s_ln
        for j in tl.static_range(LORA_RANK):
            vj = tl.load(lora_v + r * s_lv + j, mask=has, other=0.0)
            xv += vj[:, None] * tl.load(b_rows + j, mask=mask & has[:, None], other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        xv += tl.load(residual + r[:, None] * s_r + d[None, :], mask=mask, other=0.0).to(tl.float32)
        # the sum is rounded to the stream's dtype before it is normed, as the unfused ops do
        summed = xv.to(res_out.dtype.element_ty)
        tl.store(res_out + r[:, None] * s_ro + d[None, :], summed, mask=mask)
        xv = summed.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xv * xv, 1) / DIM + eps)
    w = tl.load(weight + d, mask=d < DIM, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = 1.0 + w
    if HAS_GATE:
        # the gate may be a [T, H, D] view of a wider projection (GDN's z): row r is (r // H, r % H)
        g_row = (r // gate_heads) * s_g + (r % gate_heads) * s_gh
        g = tl.load(gate + g_row[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
        y = w[None, :] * (xv * inv[:, None]) * (g * tl.sigmoid(g))
    else:
        y = (xv * inv[:, None]) * w[None, :]
    tl.store(out + r[:, None] * s_o + d[None, :], y.to(out.dtype.element_ty), mask=mask)


@triton.jit
def add_rms_norm_row(xv, residual, res_out, normed_out, weight, eps, d, mask, DIM: tl.constexpr):
    """One row's residual add + zero-centred RMSNorm inside another kernel (the MoE block's last
    one): xv [BLOCK] float32 holds the block output already rounded to the stream's dtype; the
    pointers are the row's starts. The norm kernel's arithmetic and roundings (its sum of squares
    may add up in another order)."""
    xv += tl.load(residual + d, mask=mask, other=0.0).to(tl.float32)
    summed = xv.to(res_out.dtype.element_ty)
    tl.store(res_out + d, summed, mask=mask)
    xv = summed.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xv * xv, 0) / DIM + eps)
    w = 1.0 + tl.load(weight + d, mask=mask, other=0.0).to(tl.float32)
    tl.store(normed_out + d, ((xv * inv) * w).to(normed_out.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., D] as [R, D] with a row stride, without a copy when the layout allows it."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t.reshape(-1, t.shape[-1])


def _head_rows(t: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(rows, heads, head stride): a [T, H, D] view whose token rows are strided apart (a column
    slice of a projection, which reshape would copy) stays a view, addressed as token t's head h
    at t * rows.stride(0) + h * head stride; anything else as _rows gives it (one head)."""
    if t.dim() == 3 and t.stride(-1) == 1 and t.shape[1] > 1:
        return t[:, 0], t.shape[1], t.stride(1)
    return _rows(t), 1, 0


def _launch(x, weight, eps, *, gate=None, residual=None, zero_centered=False, ids=None, pdl=True, low_rank=None):
    """ids: x is a [V, D] table and the rows are x[ids] (res_out holds them). low_rank: x [T, D]'s
    rows' adapters (PairLowRank, one slice)."""
    dim = x.shape[-1]
    x2 = _rows(x)
    shape = x.shape if ids is None else (ids.shape[0], dim)
    num_rows = shape[0] if ids is not None else x2.shape[0]
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    keep = residual is not None or ids is not None
    res_out = torch.empty(shape, dtype=x.dtype, device=x.device) if keep else None
    if num_rows == 0:
        return out, res_out
    block_d = triton.next_power_of_2(dim)
    assert block_d <= 65536, "rows above 64K elements are not supported"
    # ~2-4K elements per program: many short rows share a program, long rows get more warps
    rows = max(1, 2048 // block_d) if x.is_cuda else max(1, min(4, 64 // block_d))
    g2, gate_heads, s_gh = _head_rows(gate) if gate is not None else (x2, 1, 0)
    r2 = _rows(residual) if residual is not None else x2
    o2 = out.view(-1, dim)
    ro2 = res_out.view(-1, dim) if res_out is not None else o2
    lora = (x2, x2, x2, 0, 0, 0, 0)
    if low_rank is not None:
        keys, v, b = low_rank
        assert ids is None and keys.shape == (num_rows,) and b.shape[1] == dim, "low_rank: a key per row of x"
        assert v.shape[1] == b.shape[2] and v.stride(1) == 1 and b.stride(2) == 1, "low_rank: one slice"
        lora = (keys, v, b, v.stride(0), b.stride(0), b.stride(1), b.shape[2])
    _rms_norm_kernel[(triton.cdiv(num_rows, rows),)](
        x2, g2, r2, weight, o2, ro2, ids if ids is not None else x2, num_rows, x2.stride(0), g2.stride(0), gate_heads,
        s_gh, r2.stride(0), o2.stride(0), ro2.stride(0), eps, *lora[:6], DIM=dim, ROWS=rows, BLOCK_D=block_d,
        ZERO_CENTERED=zero_centered, HAS_GATE=gate is not None, HAS_RESIDUAL=residual is not None,
        GATHER=ids is not None, LORA_RANK=lora[6], num_warps=8 if rows * block_d >= 4096 else 4,
        **pdl_launch(x2, pdl),
    )  # fmt: skip
    return out, res_out


# the ops of norm/__init__.py; grid: cdiv(rows, ROWS) programs of ROWS rows
def rms_norm(*, x, weight, eps, zero_centered=True, pdl=True):
    return _launch(x, weight, eps, zero_centered=zero_centered, pdl=pdl)[0]


def fused_add_rms_norm(*, x, residual, weight, eps, pdl=True, low_rank=None):
    return _launch(x, weight, eps, residual=residual, zero_centered=True, pdl=pdl, low_rank=low_rank)


def gated_rms_norm(*, x, gate, weight, eps, pdl=True):
    assert gate.shape == x.shape, "gate must match x"
    return _launch(x, weight, eps, gate=gate, pdl=pdl)[0]


def embed_rms_norm(*, ids, table, weight, eps, pdl=True):
    return _launch(table, weight, eps, zero_centered=True, ids=ids, pdl=pdl)
