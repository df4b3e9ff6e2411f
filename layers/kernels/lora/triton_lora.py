"""Segmented LoRA in Triton (punica / S-LoRA style): a pass's tokens grouped by adapter slot, then
a shrink and a grouped expand.

The grouping is the MoE's own (moe/align.py: BLOCK_M-row blocks, one key per block, no host sync), so
a decode pass's grouping runs inside a CUDA graph and reads each token's slot from a device tensor.

  shrink: v[m, :] = a[key] @ x[m]                v [M, RA] float32, RA = slices x rank
  expand: y[m, n] += b[key, n] . v[m, slice(n)]  one slice per contiguous range of output rows

The expand's row n reads the rank columns of its slice (the fused q | k | v projection has one A
per slice); the slices are at most MAX_SLICES contiguous row ranges. At decode sizes the shrink is
a GEMV per row (no grouping needed). The routed experts' adapters have no grouping of their own:
per-pair GEMV shrinks here (the pair's key, slot * local experts + expert, computed in the first),
expanded inside the MoE's GEMVs and grouped GEMMs (moe/pairs.py, moe/sorted.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..moe.align import align_pairs
from ..pdl import pdl_launch, pdl_wait
from .naive import pair_keys as naive_pair_keys

MAX_SLICES = 4
# at or under this many rows (decode) a shrink is one GEMV program per (row, 8 of its A rows): the
# grouped dot kernel runs one program per slot's row block, a serial walk over K at a handful of
# programs; the GEMV reads a slot's A once per row instead (from L2 after the first)
SHRINK_GEMV_MAX_ROWS = 64
# rows per block: small batches (decode) have a handful of rows per adapter; prefill chunks many
SMALL_BLOCK_M, LARGE_BLOCK_M, LARGE_ROWS = 16, 64, 512


class RowGroups(NamedTuple):
    """Rows grouped by key (align_pairs' layout): sorted_ids [blocks * block_m] (row per position,
    num_rows = padding), block_key [blocks] (-1: unused block), num_padded [1] (rows in use)."""

    sorted_ids: torch.Tensor
    block_key: torch.Tensor
    num_padded: torch.Tensor
    block_m: int
    num_rows: int


def group_rows(keys: torch.Tensor, num_keys: int, pdl: bool = True) -> RowGroups:
    """Group the rows of keys [M, W] (flat row = m * W + w) by key in [0, num_keys); other keys skip."""
    num_rows = keys.numel()
    block_m = SMALL_BLOCK_M if num_rows <= LARGE_ROWS else LARGE_BLOCK_M
    sorted_ids, block_key, offsets = align_pairs(
        topk_ids=keys, num_experts=num_keys, expert_offset=0, block_m=block_m, pdl=pdl
    )
    return RowGroups(sorted_ids, block_key, offsets[num_keys:], block_m, num_rows)


@triton.jit
def _block_rows(sorted_ids, block_key, num_padded, num_rows, BLOCK_M: tl.constexpr):
    """This program's block of grouped rows: (whether it is in use, its key, its rows, which of them
    are real rows rather than padding). An unused block reads unset (allocated) entries, then exits."""
    pid_m = tl.program_id(0)
    used = pid_m * BLOCK_M < tl.load(num_padded)
    key = tl.load(block_key + pid_m)
    m = tl.load(sorted_ids + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    return used, key, m, m < num_rows


# values that change from pass to pass: one compile serves them all (kernels/__init__.py)
@triton.jit(do_not_specialize=["num_rows"])
def _shrink_kernel(
    x, a, v, sorted_ids, block_key, num_padded, num_rows, s_xm, s_ag, s_ar, s_vm, K: tl.constexpr,
    RA: tl.constexpr, ROW_DIV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    GLU: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """v[m, r] = x[m // ROW_DIV] . a[key, r] for one block of rows of one key and BLOCK_R of its RA rows.
    GLU: x's rows are [gate | up] (2 K wide) and the input is silu(gate) * up (float32, rounded to
    x's dtype once, as a separate activation kernel would store it)."""
    pdl_wait(USE_PDL)
    used, key, m, m_ok = _block_rows(sorted_ids, block_key, num_padded, num_rows, BLOCK_M)
    if not used:
        return
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < RA
    k = tl.arange(0, BLOCK_K)
    x_ptr = x + (m // ROW_DIV).to(tl.int64)[:, None] * s_xm + k[None, :]
    a_ptr = a + key.to(tl.int64) * s_ag + r[None, :] * s_ar + k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + k < K
        xt = tl.load(x_ptr, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        at = tl.load(a_ptr, mask=r_ok[None, :] & k_ok[:, None], other=0.0)
        if GLU:
            gt = xt.to(tl.float32)
            ut = tl.load(x_ptr + K, mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            acc = tl.dot((gt * tl.sigmoid(gt) * ut).to(xt.dtype), at.to(xt.dtype), acc)
        else:
            acc = tl.dot(xt, at.to(xt.dtype), acc)
        x_ptr += BLOCK_K
        a_ptr += BLOCK_K
    tl.store(v + m.to(tl.int64)[:, None] * s_vm + r[None, :], acc, mask=m_ok[:, None] & r_ok[None, :])


# values that change from pass to pass: one compile serves them all (kernels/__init__.py)
@triton.jit(do_not_specialize=["num_rows"])
def _expand_kernel(
    v, b, y, sorted_ids, block_key, num_padded, num_rows, s_vm, s_bg, s_bn, s_ym, bound1, bound2, bound3,
    row_gate, s_gm, N: tl.constexpr, R: tl.constexpr, NUM_SLICES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GATED: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """y[m, n] += b[key, n] . v[m, slice(n) * R : slice(n) * R + R] for one block of rows of one key
    and BLOCK_N output rows; slice(n) counts the bounds at or below n. GATED: the delta of row m is
    scaled by sigmoid(row_gate[m]) (rows of stride s_gm) first."""
    pdl_wait(USE_PDL)
    used, key, m, m_ok = _block_rows(sorted_ids, block_key, num_padded, num_rows, BLOCK_M)
    if not used:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    r = tl.arange(0, R)
    bt = tl.load(b + key.to(tl.int64) * s_bg + n[None, :] * s_bn + r[:, None], mask=n_ok[None, :], other=0.0)
    which = (n >= bound1).to(tl.int32) + (n >= bound2).to(tl.int32) + (n >= bound3).to(tl.int32)
    v_rows = v + m.to(tl.int64)[:, None] * s_vm + r[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for j in tl.static_range(NUM_SLICES):
        vj = tl.load(v_rows + j * R, mask=m_ok[:, None], other=0.0).to(bt.dtype)
        part = tl.dot(vj, bt)
        if NUM_SLICES > 1:
            part = tl.where((which == j)[None, :], part, 0.0)
        acc += part
    if GATED:
        acc *= tl.sigmoid(tl.load(row_gate + m.to(tl.int64) * s_gm, mask=m_ok, other=0.0).to(tl.float32))[:, None]
    dst = y + m.to(tl.int64)[:, None] * s_ym + n[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    acc += tl.load(dst, mask=ok, other=0.0).to(tl.float32)
    tl.store(dst, acc.to(y.dtype.element_ty), mask=ok)


def shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    groups: RowGroups,
    row_div: int = 1,
    pdl: bool = True,
    glu: bool = False,
    keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """v [num_rows, RA] float32: each grouped row's x row (row // row_div) times its key's a [G, RA, K];
    glu: x [T, 2 K] is [gate | up] and the row read is silu(gate) * up. keys: the rows' keys (row_div
    1): up to SHRINK_GEMV_MAX_ROWS rows the GEMV kernel runs instead (rows without a key: unset)."""
    if keys is not None and row_div == 1 and keys.numel() <= SHRINK_GEMV_MAX_ROWS:
        assert keys.numel() == x.shape[0], "shrink: a key per row of x"
        return _pair_shrink(x, a, keys.reshape(-1), keys.numel(), 1, pdl, glu=glu)
    ra, k = a.shape[1], a.shape[2]
    assert x.shape[1] == k * (2 if glu else 1), "shrink: x's width"
    assert x.stride(-1) == 1 and a.stride(-1) == 1, "shrink: contiguous last dims"
    v = torch.empty((groups.num_rows, ra), dtype=torch.float32, device=x.device)
    block_r = max(16, min(64, triton.next_power_of_2(ra)))
    block_k = max(16, min(128, triton.next_power_of_2(k)))
    grid = (groups.block_key.shape[0], triton.cdiv(ra, block_r))
    _shrink_kernel[grid](
        x, a, v, groups.sorted_ids, groups.block_key, groups.num_padded, groups.num_rows, x.stride(0), a.stride(0),
        a.stride(1), v.stride(0), K=k, RA=ra, ROW_DIV=row_div, BLOCK_M=groups.block_m, BLOCK_R=block_r,
        BLOCK_K=block_k, GLU=glu, num_warps=4, **pdl_launch(x, pdl),
    )  # fmt: skip
    return v


def expand(
    v: torch.Tensor,
    b: torch.Tensor,
    y: torch.Tensor,
    groups: RowGroups,
    bounds: tuple[int, ...],
    pdl: bool = True,
    row_gate: torch.Tensor | None = None,
) -> None:
    """y[row, :bounds[-1]] += each grouped row's delta from v (shrink's output) and b [G, N, R],
    scaled by sigmoid(row_gate[row]) ([T, 1]) when given."""
    n, rank = bounds[-1], b.shape[2]
    slices = len(bounds) - 1
    assert 1 <= slices <= MAX_SLICES and b.shape[1] == n and v.shape[1] == slices * rank, "expand: shapes"
    assert rank >= 16 and rank & (rank - 1) == 0, "expand: the slot rank is a power of two >= 16"
    assert y.stride(-1) == 1 and b.stride(-1) == 1, "expand: contiguous last dims"
    inner = list(bounds[1:-1]) + [n] * (MAX_SLICES - slices)
    block_n = max(16, min(64, triton.next_power_of_2(n)))
    grid = (groups.block_key.shape[0], triton.cdiv(n, block_n))
    _expand_kernel[grid](
        v, b, y, groups.sorted_ids, groups.block_key, groups.num_padded, groups.num_rows, v.stride(0), b.stride(0),
        b.stride(1), y.stride(0), *inner[:3], v if row_gate is None else row_gate,
        0 if row_gate is None else row_gate.stride(0), N=n, R=rank, NUM_SLICES=slices,
        BLOCK_M=groups.block_m, BLOCK_N=block_n, GATED=row_gate is not None, num_warps=4, **pdl_launch(v, pdl),
    )  # fmt: skip


def add_lora(
    *, y, x, a, b, bounds, groups: RowGroups, pdl: bool = True, glu: bool = False, row_gate=None, keys=None
):  # fmt: skip
    """lora.add_lora on CUDA (and under the interpreter): shrink (keys: as shrink's), then expand into
    y in place."""
    v = shrink(x, a, groups, pdl=pdl, glu=glu, keys=keys)
    expand(v, b, y, groups, bounds, pdl=pdl, row_gate=row_gate)
    return y


@triton.jit
def _shrink_row(
    x, a, v, key, row, x_row, s_xm, s_ag, s_ar, s_vm, K: tl.constexpr, RA: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr, GLU: tl.constexpr,
):  # fmt: skip
    """v[row, r] = x[x_row] . a[key, r] for this program's BLOCK_R of the RA rows (key >= 0). GLU: x's
    rows are [gate | up] (2 K wide), read as silu(gate) * up rounded to x's dtype once (as
    _shrink_kernel's)."""
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < RA
    k = tl.arange(0, BLOCK_K)
    x_ptr = x + x_row.to(tl.int64) * s_xm + k
    a_ptr = a + key.to(tl.int64) * s_ag + r[:, None] * s_ar + k[None, :]
    acc = tl.zeros([BLOCK_R, BLOCK_K], tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        k_ok = k0 + k < K
        xt = tl.load(x_ptr + k0, mask=k_ok, other=0.0)
        if GLU:
            ut = tl.load(x_ptr + K + k0, mask=k_ok, other=0.0).to(tl.float32)
            gt = xt.to(tl.float32)
            xt = (gt * tl.sigmoid(gt) * ut).to(xt.dtype)
        at = tl.load(a_ptr + k0, mask=r_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += at * xt.to(tl.float32)[None, :]
    tl.store(v + row.to(tl.int64) * s_vm + r, tl.sum(acc, 1), mask=r_ok)


@triton.jit
def _pair_shrink_kernel(
    x, a, v, keys, token_slots, topk_ids, num_pairs, num_local, expert_offset, s_xm, s_ag, s_ar, s_vm, x2, a2, v2,
    keys2, s_xm2, s_ag2, s_ar2, s_vm2, K: tl.constexpr, RA: tl.constexpr, ROW_DIV: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, KEYS_FROM_IDS: tl.constexpr, GLU: tl.constexpr,
    K2: tl.constexpr, RA2: tl.constexpr, BLOCK_K2: tl.constexpr, GLU2: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """v[p, r] = x[p // ROW_DIV] . a[keys[p], r] for BLOCK_R of the RA rows of one pair, a GEMV (each
    pair one row: no grouping); pairs without a key skip (their v rows stay unset: the readers check
    the key). KEYS_FROM_IDS: the key is slot * num_local + local expert of pair p (token p // ROW_DIV,
    naive.pair_keys), -1 without an adapter or for another rank's expert, and the pair's first
    program writes it to keys (no launch of its own). GLU: as _shrink_row's.
    Programs past num_pairs (K2 > 0) run a second shrink in the same launch: row q = p - num_pairs,
    v2[q] = x2[q] . a2[keys2[q]] (GLU2), RA2 rows of it."""
    pdl_wait(USE_PDL)
    p = tl.program_id(0)
    first_r = tl.program_id(1) * BLOCK_R
    if p < num_pairs:
        if KEYS_FROM_IDS:
            local = tl.load(topk_ids + p).to(tl.int32) - expert_offset
            slot = tl.load(token_slots + p // ROW_DIV).to(tl.int32)
            key = tl.where((slot >= 0) & (local >= 0) & (local < num_local), slot * num_local + local, -1)
            if tl.program_id(1) == 0:
                tl.store(keys + p, key)
        else:
            key = tl.load(keys + p)
        if (key >= 0) & (first_r < RA):
            _shrink_row(x, a, v, key, p, p // ROW_DIV, s_xm, s_ag, s_ar, s_vm, K, RA, BLOCK_R, BLOCK_K, GLU)
    elif K2 > 0:
        q = p - num_pairs
        key2 = tl.load(keys2 + q)
        if (key2 >= 0) & (first_r < RA2):
            _shrink_row(x2, a2, v2, key2, q, q, s_xm2, s_ag2, s_ar2, s_vm2, K2, RA2, BLOCK_R, BLOCK_K2, GLU2)


class ShrinkJob(NamedTuple):
    """A second shrink to run in a pair shrink's launch: v [M, RA] float32 (filled) = each row's x
    (glu: as shrink's) times a[keys[row]] ([G, RA, K]); rows without a key (-1) are left unset."""

    x: torch.Tensor
    a: torch.Tensor
    keys: torch.Tensor
    v: torch.Tensor
    glu: bool = False


def _block_k(k: int) -> int:
    return max(16, min(256, triton.next_power_of_2(k)))


def _pair_shrink(x, a, keys, num_pairs, row_div, pdl, ids=None, glu=False, extra: ShrinkJob | None = None, v=None):
    ra, k = a.shape[1], a.shape[2]
    assert x.shape[1] == k * (2 if glu else 1), "pair_shrink: x's width"
    assert x.stride(-1) == 1 and a.stride(-1) == 1, "pair_shrink: contiguous last dims"
    if v is None:
        v = torch.empty((num_pairs, ra), dtype=torch.float32, device=x.device)
    assert v.shape == (num_pairs, ra) and v.stride(1) == 1, "pair_shrink: v"
    token_slots, topk_ids, num_local, expert_offset = ids if ids is not None else (keys, keys, 0, 0)
    ra2, rows2, job2 = 0, 0, (x, a, v, keys, 0, 0, 0, 0)
    k2, glu2 = 0, False
    if extra is not None:
        ra2, k2, rows2, glu2 = extra.a.shape[1], extra.a.shape[2], extra.keys.numel(), extra.glu
        assert extra.x.shape == (rows2, k2 * (2 if glu2 else 1)) and extra.v.shape == (rows2, ra2), "extra: shapes"
        assert extra.x.stride(-1) == 1 and extra.a.stride(-1) == 1 and extra.v.stride(-1) == 1, "extra: last dims"
        job2 = (extra.x, extra.a, extra.v, extra.keys, extra.x.stride(0), extra.a.stride(0), extra.a.stride(1))
        job2 += (extra.v.stride(0),)
    block_r = min(8, triton.next_power_of_2(ra))
    grid = (num_pairs + rows2, triton.cdiv(max(ra, ra2), block_r))
    _pair_shrink_kernel[grid](
        x, a, v, keys, token_slots, topk_ids, num_pairs, num_local, expert_offset, x.stride(0), a.stride(0),
        a.stride(1), v.stride(0), *job2, K=k, RA=ra, ROW_DIV=row_div, BLOCK_R=block_r, BLOCK_K=_block_k(k),
        KEYS_FROM_IDS=ids is not None, GLU=glu, K2=k2, RA2=ra2, BLOCK_K2=_block_k(max(k2, 1)), GLU2=glu2,
        num_warps=4, **pdl_launch(x, pdl),
    )  # fmt: skip
    return v


def pair_shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    keys: torch.Tensor,
    row_div: int,
    pdl: bool = True,
    extra: ShrinkJob | None = None,
) -> torch.Tensor:
    """v [P, RA] float32 for the P = keys.numel() routed pairs: pair p's row of x (p // row_div)
    times its key's a [G, RA, K]; rows of pairs without a key (-1) are left unset. extra: a second
    shrink (ShrinkJob) in the same launch, into its own v."""
    return _pair_shrink(x, a, keys, keys.numel(), row_div, pdl, extra=extra)


def pair_shrink_keys(
    x: torch.Tensor,
    a: torch.Tensor,
    token_slots: torch.Tensor,
    topk_ids: torch.Tensor,
    num_local: int,
    expert_offset: int,
    pdl: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys [P] int32, v [P, RA] float32) of the routed pairs of topk_ids [T, top_k] in one launch:
    keys as naive.pair_keys (flattened), v as pair_shrink (row_div = top_k) with those keys."""
    ids = topk_ids.contiguous()
    keys = torch.empty(ids.numel(), dtype=torch.int32, device=ids.device)
    v = _pair_shrink(x, a, keys, ids.numel(), ids.shape[1], pdl, ids=(token_slots, ids, num_local, expert_offset))
    return keys, v


# above this many routed pairs (prefill) the experts' shrinks group the pairs by key first (the
# pair keys' torch ops and a grouping launch), each key's A read once a block; at or under it
# (decode: 64 tokens at top-8 is 512) one GEMV program per pair, no grouping
PAIR_GEMV_MAX_PAIRS = 2048


def expert_shrink_gate_up(
    x: torch.Tensor,
    a: torch.Tensor,
    token_slots: torch.Tensor,
    topk_ids: torch.Tensor,
    num_local: int,
    expert_offset: int,
    pdl: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, RowGroups | None]:
    """(keys [P], v [P, RA], the grouping or None) of the routed pairs' gate / up shrink: pair_shrink_keys
    up to PAIR_GEMV_MAX_PAIRS pairs, else the pairs grouped by key and the grouped shrink."""
    if topk_ids.numel() <= PAIR_GEMV_MAX_PAIRS:
        return (*pair_shrink_keys(x, a, token_slots, topk_ids, num_local, expert_offset, pdl), None)
    keys = naive_pair_keys(token_slots, topk_ids, num_local, expert_offset).reshape(-1)
    groups = group_rows(keys[:, None], a.shape[0], pdl)
    return keys, shrink(x, a, groups, row_div=topk_ids.shape[1], pdl=pdl), groups


def expert_shrink_down(
    act: torch.Tensor,
    a: torch.Tensor,
    keys: torch.Tensor,
    groups: RowGroups | None,
    pdl: bool = True,
    extra: ShrinkJob | None = None,
) -> torch.Tensor:
    """The routed pairs' down shrink v [P, RA] with expert_shrink_gate_up's keys and grouping; extra
    (ShrinkJob) runs in the same launch on the GEMV form, in its own before it otherwise."""
    if groups is None:
        return pair_shrink(act, a, keys, 1, pdl, extra=extra)
    if extra is not None:
        _pair_shrink(extra.x, extra.a, extra.keys, extra.keys.numel(), 1, pdl, glu=extra.glu, v=extra.v)
    return shrink(act, a, groups, row_div=1, pdl=pdl)
