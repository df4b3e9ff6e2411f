"""One-row GEMV (a batch-1 decode projection) whose weight loads start before the previous kernel
has finished, with an optional residual add + zero-centred RMSNorm in front of it.

out[n] = sum_k w[n, k] * y[k], where y is x itself, or (NORM) y = rms_norm(x + residual) * (1 + g)
rounded to x's dtype exactly as the standalone norm kernel rounds it (the sum first, then the
normed value), so the fused form feeds the GEMV the same input bits as norm-then-linear.

Why: at batch 1 each kernel of a decode step costs ~2 us beyond its bytes, mostly the latency of
its first loads. Under programmatic dependent launch a program may start while the previous kernel
is still running; the weights never change during a pass, so each program issues its whole
[BLOCK_N, K] weight tile *before* `pdl_wait` and only the activations wait. With NORM, the norm
launch before the projection goes too (each program recomputes the row's sum of squares from L1).

Grid: cdiv(N, BLOCK_N) programs (or, `persistent`, at most that many per SM, each looping over
row blocks); BLOCK_K = next_power_of_2(K), the whole row in one tile. The
activations are loaded broadcast to the weight tile's shape (every row the same addresses: L1 hits)
so they arrive in its register layout without a shared-memory conversion. Program 0 writes the new
residual (x + residual) and, when asked, the normed row for later kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..device import DeviceInfo, device_info, tuned_for
from ..fp8 import scale_block
from ..options import RowTile
from ..pdl import pdl_launch, pdl_wait
from .tuned import TUNED_ROW, TUNED_ROW_FP8

# the whole row is one register tile: at most this many weight elements per thread
MAX_ELEMS_PER_THREAD = 64
MAX_K = 8192


@triton.jit
def _load(ptr, mask, EVEN_K: tl.constexpr, EVICT: tl.constexpr):
    if EVEN_K:
        return tl.load(ptr, eviction_policy=EVICT)
    return tl.load(ptr, mask=mask, other=0.0, eviction_policy=EVICT)


@triton.jit
def _add_pair(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _row_gemv_kernel(
    x, residual, norm_weight, w, scale, tail, bias, out, res_out, normed_out, N, N8, s_wn, s_sn, s_tn, eps,
    K: tl.constexpr,  # a constant mask bound: masked rows of any K keep 16-byte loads
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    WRITE_NORMED: tl.constexpr, HAS_BIAS: tl.constexpr, PRELOAD: tl.constexpr, DEFER_NORM: tl.constexpr,
    PERSISTENT: tl.constexpr, EVEN_K: tl.constexpr, X_ROW: tl.constexpr, FP8: tl.constexpr, HAS_TAIL: tl.constexpr,
    SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, TAIL_BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """FP8 (weight float8 with block scales `scale`, SCALE_N x SCALE_K): the weights are widened and
    scaled in registers after the PDL wait. HAS_TAIL: rows N8.. of the output come from `tail` (in
    x's dtype, rows of stride s_tn), one program per TAIL_BLOCK_N of them after the FP8 rows' programs
    (N8 a multiple of BLOCK_N; TAIL_BLOCK_N rows of the tail are BLOCK_N rows' bytes of e4m3, so that
    both paths of the kernel hold the same weight registers)."""
    pid = tl.program_id(0)
    if HAS_TAIL:
        tail_block = pid - N8 // BLOCK_N
        if tail_block >= 0:
            _row_gemv_body(
                x, residual, norm_weight, tail, scale, bias + N8, out + N8, res_out, normed_out, tail_block, pid == 0,
                N - N8, 0, s_tn, eps, K, TAIL_BLOCK_N, BLOCK_K, NORM, HAS_RESIDUAL, WRITE_NORMED, HAS_BIAS, PRELOAD,
                DEFER_NORM, False, EVEN_K, X_ROW, False, SCALE_N, SCALE_K, USE_PDL,
            )  # fmt: skip
            return
    _row_gemv_body(
        x, residual, norm_weight, w, scale, bias, out, res_out, normed_out, pid, pid == 0, N8 if HAS_TAIL else N, s_sn,
        s_wn, eps, K, BLOCK_N, BLOCK_K, NORM, HAS_RESIDUAL, WRITE_NORMED, HAS_BIAS, PRELOAD, DEFER_NORM, PERSISTENT,
        EVEN_K, X_ROW, FP8, SCALE_N, SCALE_K, USE_PDL,
    )  # fmt: skip


@triton.jit
def _row_gemv_body(
    x, residual, norm_weight, w, scale, bias, out, res_out, normed_out, pid, writer, N, s_sn, s_wn, eps,
    K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    WRITE_NORMED: tl.constexpr, HAS_BIAS: tl.constexpr, PRELOAD: tl.constexpr, DEFER_NORM: tl.constexpr,
    PERSISTENT: tl.constexpr, EVEN_K: tl.constexpr, X_ROW: tl.constexpr, FP8: tl.constexpr, SCALE_N: tl.constexpr,
    SCALE_K: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """Row block `pid` of an N-row weight w (out, bias: its first row's); `writer`: this program
    writes the residual and normed rows."""
    r = tl.arange(0, BLOCK_N)
    n = pid * BLOCK_N + r
    n_ld = tl.minimum(n, N - 1).to(tl.int64)  # rows past N re-read row N - 1, never stored
    k = tl.arange(0, BLOCK_K)
    cols = k[None, :] + 0 * r[:, None]  # [BLOCK_N, BLOCK_K], every row the same columns
    k_ok = cols < K  # unused when EVEN_K: unmasked loads vectorise to 16 bytes
    w_ptr = w + n_ld[:, None] * s_wn + k[None, :]
    if FP8 and not X_ROW:  # one factor per element, from its block (identical addresses within a block)
        sc = tl.load(scale + (n_ld // SCALE_N)[:, None] * s_sn + cols // SCALE_K, mask=k_ok, other=0.0)
    if FP8 and X_ROW:  # the tile's rows share one scale row (BLOCK_N <= SCALE_N): it scales x's row instead
        row_scale = tl.load(scale + ((pid * BLOCK_N) // SCALE_N) * s_sn + k // SCALE_K, mask=k < K, other=0.0)
    else:
        row_scale = 0.0
    if PRELOAD:  # weights are constant during the pass: fetch them while the previous kernel ends
        wt = _load(w_ptr, k_ok, EVEN_K, "evict_first")
    pdl_wait(USE_PDL)
    if not PRELOAD:
        wt = _load(w_ptr, k_ok, EVEN_K, "evict_first")
    if FP8 and not X_ROW:
        wt = wt.to(tl.float32) * sc
    if X_ROW:
        # tall tiles (and FP8 tiles within one scale row): the activations as one row (a tile's
        # worth of copies would not fit in registers), broadcast over the weight rows by one layout
        # conversion
        _row_gemv_x_row(
            x, residual, norm_weight, bias, out, res_out, normed_out, wt, writer, n, n_ld, k, N, eps, K,
            NORM, HAS_RESIDUAL, WRITE_NORMED, HAS_BIAS, EVEN_K, row_scale, FP8,
        )  # fmt: skip
        return
    y = _load(x + cols, k_ok, EVEN_K, "").to(tl.float32)
    if NORM:
        if HAS_RESIDUAL:
            # rounded to the stream's dtype before it is normed, as the unfused ops do
            summed = (y + _load(residual + cols, k_ok, EVEN_K, "").to(tl.float32)).to(x.dtype.element_ty)
            if writer:  # every row of the tile holds the same values: identical, vectorised writes
                tl.store(res_out + cols, summed, mask=k_ok)
            y = summed.to(tl.float32)
        scale_g = 1.0 + _load(norm_weight + cols, k_ok, EVEN_K, "").to(tl.float32)
        if DEFER_NORM:
            # the row's 1 / rms is a common factor of the dot: one two-operand reduction gives the
            # dot with the unnormed row and the sum of squares, with no serial prologue
            acc, squares = tl.reduce((wt.to(tl.float32) * (y * scale_g), y * y), 1, _add_pair)
            inv = tl.rsqrt(squares / K + eps)
            acc = acc * inv
        else:
            inv = tl.rsqrt(tl.sum(y * y, 1) / K + eps)
        normed = ((y * inv[:, None]) * scale_g).to(x.dtype.element_ty)
        if WRITE_NORMED:  # noqa: SIM102 (a constexpr test, then a run-time one)
            if writer:
                tl.store(normed_out + cols, normed, mask=k_ok)
        if not DEFER_NORM:
            acc = tl.sum(wt.to(tl.float32) * normed.to(tl.float32), 1)
    else:
        acc = tl.sum(wt.to(tl.float32) * y, 1)
    if not PERSISTENT:
        if HAS_BIAS:
            acc += tl.load(bias + n_ld).to(tl.float32)
        tl.store(out + n, acc.to(out.dtype.element_ty), mask=n < N)
    else:
        # fewer programs than row blocks: this one also takes blocks pid + P, pid + 2P, ... with the
        # activations (and the norm) it already has, each block's weights loaded one block ahead
        if NORM:
            if DEFER_NORM:
                xin, post = y * scale_g, inv
            else:
                xin, post = normed.to(tl.float32), inv * 0.0 + 1.0
        else:
            xin, post = y, tl.full([BLOCK_N], 1.0, tl.float32)
        num_blocks = tl.cdiv(N, BLOCK_N)
        step = tl.num_programs(0)
        for blk in range(pid, num_blocks, step):
            n = blk * BLOCK_N + r
            nxt = blk + step
            n_next = tl.minimum(nxt * BLOCK_N + r, N - 1).to(tl.int64)
            live = (r * 0 + nxt < num_blocks)[:, None] & k_ok  # past the last block: no traffic
            wt_next = tl.load(
                w + n_next[:, None] * s_wn + k[None, :], mask=live, other=0.0, eviction_policy="evict_first"
            )
            if blk != pid:  # the first block's dot is acc, from above
                acc = tl.sum(wt.to(tl.float32) * xin, 1) * post
            if HAS_BIAS:
                acc += tl.load(bias + tl.minimum(n, N - 1)).to(tl.float32)
            tl.store(out + n, acc.to(out.dtype.element_ty), mask=n < N)
            wt = wt_next


@triton.jit
def _row_gemv_x_row(
    x, residual, norm_weight, bias, out, res_out, normed_out, wt, writer, n, n_ld, k, N, eps, K: tl.constexpr,
    NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, WRITE_NORMED: tl.constexpr, HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr, row_scale, FP8: tl.constexpr,
):  # fmt: skip
    """The one-row kernel's work after its weight load, with x [K] read once as a row: the same
    operations and roundings as the broadcast form (the norm's sum over one row). FP8: the row is
    multiplied by the tile's block scales (row_scale [K]) before the dot: one multiply a column,
    none a weight (Triton 3.6 also loads a per-element scale tile element by element)."""
    k_ok = k < K
    y = _load(x + k, k_ok, EVEN_K, "").to(tl.float32)
    if NORM:
        if HAS_RESIDUAL:
            summed = (y + _load(residual + k, k_ok, EVEN_K, "").to(tl.float32)).to(x.dtype.element_ty)
            if writer:
                tl.store(res_out + k, summed, mask=k_ok)
            y = summed.to(tl.float32)
        scale = 1.0 + _load(norm_weight + k, k_ok, EVEN_K, "").to(tl.float32)
        inv = tl.rsqrt(tl.sum(y * y, 0) / K + eps)
        normed = ((y * inv) * scale).to(x.dtype.element_ty)
        if WRITE_NORMED:  # noqa: SIM102 (a constexpr test, then a run-time one)
            if writer:
                tl.store(normed_out + k, normed, mask=k_ok)
        y = normed.to(tl.float32)
    if FP8:
        y = y * row_scale
    acc = tl.sum(wt.to(tl.float32) * y[None, :], 1)
    if HAS_BIAS:
        acc += tl.load(bias + n_ld).to(tl.float32)
    tl.store(out + n, acc.to(out.dtype.element_ty), mask=n < N)


def supports(num_rows: int, k: int, dtype: torch.dtype) -> bool:
    """Whether a call of this shape can take the one-row kernel."""
    return num_rows == 1 and k <= MAX_K and dtype in (torch.bfloat16, torch.float16)


def fuses_norm(n: int) -> bool:
    """Whether rms_norm_linear runs the norm inside the one-row kernel for an N-row weight."""
    return n <= FUSED_NORM_MAX_N


# the exact add + norm prologue is a serial chain in every program (loads, a reduction, then the
# dot), paid once per wave of programs: it pays where there are few (MoE input: 3.1 us fused vs 4.1
# norm kernel + GEMV) and loses on the 12K-row in_proj (19.1 vs 15.0); defer_norm removes the chain
FUSED_NORM_MAX_N = 2048


# tiles of at least this many rows read x once as a row (X_ROW) instead of broadcast to the tile
X_ROW_MIN_BLOCK_N = 8


def pick_config(n: int, k: int, info: DeviceInfo, row_tiles: tuple[RowTile, ...] = (), fp8: bool = False) -> dict:
    """block_n rows per program and num_warps: a row_tiles entry for [n, k], for an FP8 weight the
    device's TUNED_ROW_FP8, the device's TUNED_ROW (measured in bf16; an FP8 weight takes twice its
    rows: the same bytes a program, unmeasured),
    else keep the [block_n, K] tile within MAX_ELEMS_PER_THREAD elements per thread with ~4+
    programs per SM at the model's shapes (registers only: right on any GPU)."""
    for tile in row_tiles:
        if (tile.n, tile.k) == (n, k):
            return dict(block_n=tile.block_n, num_warps=tile.num_warps)
    if fp8 and (tuned := (tuned_for(TUNED_ROW_FP8, info) or {}).get((n, k))) is not None:
        return dict(tuned)
    tuned = (tuned_for(TUNED_ROW, info) or {}).get((n, k))
    if tuned is not None:
        return dict(tuned, block_n=2 * tuned["block_n"]) if fp8 else dict(tuned)
    block_k = triton.next_power_of_2(k)
    block_n = 4 if n >= 8192 else 2 if n >= 2048 else 1
    num_warps = 4
    while block_n * block_k > MAX_ELEMS_PER_THREAD * 32 * num_warps and num_warps < 8:
        num_warps *= 2
    while block_n > 1 and block_n * block_k > MAX_ELEMS_PER_THREAD * 32 * num_warps:
        block_n //= 2
    return dict(block_n=block_n, num_warps=num_warps)


def row_gemv(
    *, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None, eps: float = 1e-6, write_normed: bool = False, preload: bool = True,
    defer_norm: bool = False, config: dict | None = None, row_tiles: tuple[RowTile, ...] = (), pdl: bool = True,
    weight_scale: torch.Tensor | None = None, weight_tail: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    """x: [1, K] (last dim contiguous); weight: [N, K]; bias: [N]. Without norm_weight: (x @ w.T,
    None, None). With it: y = rms_norm(x + residual) * (1 + norm_weight) (residual [1, K] or None),
    returns (y @ w.T (+ bias), y if write_normed else None, x + residual if residual is given else
    None). Output in x's dtype. `config` forces block_n / num_warps (the bench sweeps them) and
    may set `persistent`: at most that many programs per SM, each looping over row blocks with the
    next block's weights loaded one block ahead and the activations (and the norm) computed once
    per program instead of once per block (not in TUNED_ROW until measured).
    defer_norm: the dot runs on the unnormed row times (1 + norm_weight) and is scaled by 1 / rms at
    the end, from the same reduction (no serial norm before the dot in each program); its input is
    then not rounded to x's dtype first, so the result differs from norm-then-linear by that
    rounding (the normed row written for later kernels is the exact one either way). Not the
    default yet: `bench.kernels_linear --row-sweep` times it against the exact form.
    weight_scale: weight is float8 with these block scales (dequantized in registers; not with
    `persistent`); weight_tail [N_tail, K] in x's dtype: rows appended after weight's (the output
    has N + N_tail columns; block_n shrinks to a power of two dividing N)."""
    assert supports(x.shape[0], x.shape[1], x.dtype) and x.dim() == 2, "one row of a half-precision x"
    fp8 = weight_scale is not None
    assert weight.shape[1] == x.shape[1] and (fp8 or weight.dtype == x.dtype), "weight [N, K] in x's dtype or FP8"
    num_rows, k = x.shape
    n8 = weight.shape[0]
    n = n8 + (0 if weight_tail is None else weight_tail.shape[0])
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    norm = norm_weight is not None
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(x) if norm and residual is not None else None
    normed = torch.empty_like(x) if norm and write_normed else None
    if residual is not None:
        assert norm and residual.shape == x.shape and residual.dtype == x.dtype, "residual [1, K] like x"
        residual = residual if residual.stride(1) == 1 else residual.contiguous()
    info = device_info(x.device)
    cfg = dict(config or pick_config(n, k, info, row_tiles, fp8=fp8))
    if weight_tail is not None:  # the tail's programs start after whole row blocks
        cfg["block_n"] = dividing_block(cfg["block_n"], n8)
    # a tail row of x's dtype holds two e4m3 rows' bytes: half the rows a tail program
    tail_block_n = max(1, cfg["block_n"] // 2) if fp8 else cfg["block_n"]
    blocks = triton.cdiv(n8, cfg["block_n"]) + (0 if weight_tail is None else triton.cdiv(n - n8, tail_block_n))
    per_sm = cfg.get("persistent")
    programs = min(blocks, per_sm * info.num_sms) if per_sm else blocks
    assert programs == blocks or (not fp8 and weight_tail is None), "FP8 weights and tails: no persistent loop"
    assert weight_tail is None or weight_tail.dtype == x.dtype, "weight_tail in x's dtype"
    if weight_tail is not None and weight_tail.stride(1) != 1:
        weight_tail = weight_tail.contiguous()
    scale_n, scale_k = scale_block(n8, k, tuple(weight_scale.shape)) if fp8 else (1, 1)
    # the row form has neither the deferred norm nor the persistent loop: those keep the broadcast;
    # FP8 tiles within one scale row take it (the row scaled by the blocks, not each weight)
    x_row = cfg.get("x_row", cfg["block_n"] >= X_ROW_MIN_BLOCK_N or (fp8 and cfg["block_n"] <= scale_n))
    x_row = x_row and not defer_norm and programs == blocks and not (fp8 and cfg["block_n"] > scale_n)
    _row_gemv_kernel[(programs,)](
        x, residual if residual is not None else x, norm_weight if norm else x, weight,
        weight_scale if fp8 else out, weight_tail if weight_tail is not None else weight,
        bias if bias is not None else out, out, res_out if res_out is not None else out,
        normed if normed is not None else out, n, n8, weight.stride(0), weight_scale.stride(0) if fp8 else 0,
        weight_tail.stride(0) if weight_tail is not None else 0, eps, K=k, BLOCK_N=cfg["block_n"],
        BLOCK_K=triton.next_power_of_2(k), NORM=norm, HAS_RESIDUAL=residual is not None,
        WRITE_NORMED=normed is not None, HAS_BIAS=bias is not None, PRELOAD=preload, DEFER_NORM=defer_norm,
        PERSISTENT=programs < blocks, EVEN_K=triton.next_power_of_2(k) == k, X_ROW=x_row, FP8=fp8,
        HAS_TAIL=weight_tail is not None, SCALE_N=scale_n, SCALE_K=scale_k, TAIL_BLOCK_N=tail_block_n,
        num_warps=cfg["num_warps"],
        num_stages=1, **pdl_launch(x, pdl),
    )  # fmt: skip
    return out, normed, res_out


def dividing_block(block: int, n: int) -> int:
    """The largest power of two <= block that divides n (block a power of two)."""
    while n % block:
        block //= 2
    return block
