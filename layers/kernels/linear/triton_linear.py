"""Triton skinny GEMM for few tokens: out[M, N] = x[M, K] @ weight[N, K].T (+ bias), float32
accumulate, x's dtype out. Bandwidth-bound at decode batches: every weight byte is read once.

One kernel, grid (N / BLOCK_N, SPLIT_K, M / BLOCK_M). A program streams BLOCK_N weight rows over its
K range (K / SPLIT_K, a multiple of BLOCK_K) and multiplies them with BLOCK_M rows of x:
- GEMV form (`dot=False`, the default for <= 4 rows; BLOCK_M is 1, 2 or 4): each x row has its own
  [BLOCK_N, BLOCK_K] float32 accumulator of partial products (K unrolled when it is short, so most
  weight loads issue before the first FMA), reduced over K once at the end. x chunks are loaded
  broadcast to the weight tile's shape (L1 hits) so they arrive in its register layout: no
  shared-memory round trip or barrier per chunk. Weight loads are 16 bytes, evict_first.
- MMA form (`dot=True`, the default for 5..16 rows): tl.dot on [16, BLOCK_K] x [BLOCK_K, BLOCK_N]
  tiles (x rows padded to 16), pipelined over K in num_stages stages.
Weight rows past N and x rows past M are clamped to the last one (loads without masks), their
results never stored; K tails are masked.

Split-K (a small N has too few row blocks to occupy every SM): each program writes its float32
partial to a workspace [SPLIT_K, M, N], and the partials are summed in split order 0, 1, ... so the
result is bit-reproducible run to run (no float atomics). Two ways to do the sum:
- "sem" (default): one launch. After storing its partial a program bumps an int32 counter of its
  output tile (acq_rel atomic after a CTA barrier); the program that sees SPLIT_K - 1 sums the tile's
  partials from L2, stores the output and resets the counter to 0, so the persistent counter buffer
  is zero again for the next launch (CUDA graph replays included). The buffer is allocated outside
  any capture (the first eager call; decode graphs warm up eagerly first); a call captured before
  it exists uses "pass".
- "pass": a second tiny kernel sums the partials.
Both give the same bits. No host syncs and no data-dependent host logic: everything the host decides
comes from shapes, so calls can be captured in CUDA graphs.

Configs: `pick_config` (shape heuristic, overridden by TUNED entries) or an explicit `config=` dict
(bench/kernels_linear.py --sweep forces them): block_m (GEMV only; MMA uses 16), block_n, block_k,
split_k, num_warps, num_stages, dot, reduce.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..device import SMEM_SCRATCH, DeviceInfo, device_info, stages_that_fit, tuned_for
from ..fp8 import scale_block
from ..pdl import pdl_launch, pdl_wait
from .triton_row import dividing_block
from .tuned import TUNED, tuned_key

# Split-K "sem" counters: one int32 per output tile of a launch; a launch with more tiles uses "pass".
COUNTER_SLOTS = 16384
_COUNTERS: dict[int, torch.Tensor] = {}


@triton.jit
def _load_w(w_ptr, k0, k_rel, k_left, EVEN_K: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] weight chunk at k0 of this program's K range (k_left: elements of K
    from the range's start to K's end), streamed once: evict_first."""
    if EVEN_K:
        return tl.load(w_ptr + k0, eviction_policy="evict_first")
    return tl.load(w_ptr + k0, mask=(k0 + k_rel < k_left)[None, :], other=0.0, eviction_policy="evict_first")


@triton.jit
def _load_x(x_ptr, k0, k_rel, k_left, EVEN_K: tl.constexpr):
    """x chunk at k0 (any shape whose last dim is BLOCK_K)."""
    if EVEN_K:
        return tl.load(x_ptr + k0)
    return tl.load(x_ptr + k0, mask=k0 + k_rel < k_left, other=0.0)


@triton.jit
def _gemv_step(
    acc0, acc1, acc2, acc3, x0, x1, x2, x3, w_ptr, k0, k_rel, k_left, BLOCK_M: tl.constexpr, EVEN_K, sc_ptr,
    k_start, FP8: tl.constexpr, SCALE_K: tl.constexpr,
):  # fmt: skip
    """One K chunk of the GEMV form: weight [BLOCK_N, BLOCK_K] times up to 4 x rows (x0..x3 point
    at them), each row its own [BLOCK_N, BLOCK_K] float32 accumulator. FP8: the chunk widened and
    multiplied by its blocks' scales (sc_ptr: the rows' scale rows; identical addresses, few loads)."""
    wt = _load_w(w_ptr, k0, k_rel, k_left, EVEN_K).to(tl.float32)
    if FP8:
        group = ((k_start + k0 + k_rel) // SCALE_K)[None, :]
        if EVEN_K:  # no mask: an identical-address load per block, not per element
            wt *= tl.load(sc_ptr + group)
        else:
            wt *= tl.load(sc_ptr + group, mask=(k0 + k_rel < k_left)[None, :], other=0.0)
    acc0 += wt * _load_x(x0, k0, k_rel[None, :], k_left, EVEN_K).to(tl.float32)
    if BLOCK_M > 1:
        acc1 += wt * _load_x(x1, k0, k_rel[None, :], k_left, EVEN_K).to(tl.float32)
    if BLOCK_M > 2:
        acc2 += wt * _load_x(x2, k0, k_rel[None, :], k_left, EVEN_K).to(tl.float32)
        acc3 += wt * _load_x(x3, k0, k_rel[None, :], k_left, EVEN_K).to(tl.float32)
    return acc0, acc1, acc2, acc3


@triton.jit
def _emit(acc, m, n, n_ld, M, N, s_om, out, bias, part, pid_k, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr):
    """acc [ROWS, BLOCK_N] for rows m: the output (+ bias) without split-K, else this split's
    float32 partial in part [SPLIT_K, M, N]."""
    mask = (m < M)[:, None] & (n < N)[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias + n_ld).to(tl.float32)[None, :]
        tl.store(out + m.to(tl.int64)[:, None] * s_om + n[None, :], acc.to(out.dtype.element_ty), mask=mask)
    else:
        # M and N may be specialised constants (value 1): no .to on them
        offset = pid_k.to(tl.int64) * M * N + m.to(tl.int64)[:, None] * N + n[None, :]
        tl.store(part + offset, acc, mask=mask)


@triton.jit
def _linear_kernel(
    x, w, scale, tail, bias, out, part, counters, M, N, N8, K, s_xm, s_wn, s_sn, s_tn, s_om, K_SPLIT: tl.constexpr,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_IEEE: tl.constexpr, UNROLL: tl.constexpr, HAS_BIAS: tl.constexpr,
    SEMAPHORE: tl.constexpr, FP8: tl.constexpr, HAS_TAIL: tl.constexpr, SCALE_N: tl.constexpr,
    SCALE_K: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """FP8: w is float8 with block scales `scale` (SCALE_N x SCALE_K), widened in registers (the MMA
    form multiplies each K step's dot by its scale column, so BLOCK_K <= SCALE_K). HAS_TAIL: output
    columns N8.. come from `tail` (x's dtype, rows of stride s_tn), in the column blocks after the
    FP8 rows' (N8 a multiple of BLOCK_N)."""
    pid_n = tl.program_id(0)
    if HAS_TAIL:  # noqa: SIM102 (a constexpr test, then a run-time one)
        if pid_n >= N8 // BLOCK_N:
            _linear_body(
                x, tail, scale, bias, out, part, counters, M, N, K, s_xm, s_tn, 0, s_om, pid_n, N8, N - N8, K_SPLIT,
                SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, USE_DOT, DOT_IEEE, UNROLL, HAS_BIAS, SEMAPHORE, False,
                SCALE_N, SCALE_K, USE_PDL,
            )  # fmt: skip
            return
    _linear_body(
        x, w, scale, bias, out, part, counters, M, N, K, s_xm, s_wn, s_sn, s_om, pid_n, 0, N8 if HAS_TAIL else N,
        K_SPLIT, SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, USE_DOT, DOT_IEEE, UNROLL, HAS_BIAS, SEMAPHORE, FP8,
        SCALE_N, SCALE_K, USE_PDL,
    )  # fmt: skip


@triton.jit
def _linear_body(
    x, w, scale, bias, out, part, counters, M, N, K, s_xm, s_wn, s_sn, s_om, pid_n, n_base, N_W, K_SPLIT: tl.constexpr,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_IEEE: tl.constexpr, UNROLL: tl.constexpr, HAS_BIAS: tl.constexpr,
    SEMAPHORE: tl.constexpr, FP8: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """Output column block pid_n of the N columns; its weight w holds columns n_base .. n_base + N_W."""
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_w = tl.minimum(n - n_base, N_W - 1).to(tl.int64)  # the weight's rows; past its end the last one
    n_ld = n_base + n_w  # bias columns
    k_rel = tl.arange(0, BLOCK_K)
    k_start = pid_k * K_SPLIT
    k_left = K - k_start
    w_ptr = w + n_w[:, None] * s_wn + (k_start + k_rel)[None, :]
    sc_ptr = scale + (n_w // SCALE_N)[:, None] * s_sn
    pdl_wait(USE_PDL)

    if USE_DOT:
        m_ld = tl.minimum(m, M - 1).to(tl.int64)
        x_ptr = x + m_ld[:, None] * s_xm + (k_start + k_rel)[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K_SPLIT, BLOCK_K):
            xt = _load_x(x_ptr, k0, k_rel[None, :], k_left, EVEN_K)
            wt = _load_w(w_ptr, k0, k_rel, k_left, EVEN_K)
            if FP8:  # float8 widens exactly to x's dtype; the K step lies in one scale block
                if DOT_IEEE:
                    part_dot = tl.dot(xt, tl.trans(wt.to(xt.dtype)), input_precision="ieee")
                else:
                    part_dot = tl.dot(xt, tl.trans(wt.to(xt.dtype)))
                acc += part_dot * tl.reshape(tl.load(sc_ptr + (k_start + k0) // SCALE_K), [BLOCK_N])[None, :]
            elif DOT_IEEE:
                acc = tl.dot(xt, tl.trans(wt), acc, input_precision="ieee")
            else:
                acc = tl.dot(xt, tl.trans(wt), acc)
        _emit(acc, m, n, n_ld, M, N, s_om, out, bias, part, pid_k, SPLIT_K, HAS_BIAS)
    else:
        # up to 4 rows, each its own accumulator; rows past M (a partial last row block) re-read
        # row M - 1 so the loads need no masks, and their results are never stored
        m0 = pid_m * BLOCK_M
        # x chunks are loaded as [BLOCK_N, BLOCK_K] (every row the same addresses, L1 hits) so they
        # come in the weight tile's register layout: no shared-memory layout conversion per chunk
        x_cols = (k_start + k_rel)[None, :] + 0 * n[:, None]
        x0 = x + tl.minimum(m0, M - 1).to(tl.int64) * s_xm + x_cols
        x1 = x + tl.minimum(m0 + 1, M - 1).to(tl.int64) * s_xm + x_cols
        x2 = x + tl.minimum(m0 + 2, M - 1).to(tl.int64) * s_xm + x_cols
        x3 = x + tl.minimum(m0 + 3, M - 1).to(tl.int64) * s_xm + x_cols
        acc0 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        acc1 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        acc3 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        if UNROLL:
            for k0 in tl.static_range(0, K_SPLIT, BLOCK_K):
                acc0, acc1, acc2, acc3 = _gemv_step(
                    acc0, acc1, acc2, acc3, x0, x1, x2, x3, w_ptr, k0, k_rel, k_left, BLOCK_M, EVEN_K, sc_ptr,
                    k_start, FP8, SCALE_K,
                )  # fmt: skip
        else:
            for k0 in range(0, K_SPLIT, BLOCK_K):
                acc0, acc1, acc2, acc3 = _gemv_step(
                    acc0, acc1, acc2, acc3, x0, x1, x2, x3, w_ptr, k0, k_rel, k_left, BLOCK_M, EVEN_K, sc_ptr,
                    k_start, FP8, SCALE_K,
                )  # fmt: skip
        # each row's accumulator reduced over K, then stored (or its split's partial)
        _emit(tl.sum(acc0, 1)[None, :], m0 + tl.arange(0, 1),
              n, n_ld, M, N, s_om, out, bias, part, pid_k, SPLIT_K, HAS_BIAS)  # fmt: skip
        if BLOCK_M > 1:
            _emit(tl.sum(acc1, 1)[None, :], m0 + 1 + tl.arange(0, 1),
                  n, n_ld, M, N, s_om, out, bias, part, pid_k, SPLIT_K, HAS_BIAS)  # fmt: skip
        if BLOCK_M > 2:
            _emit(tl.sum(acc2, 1)[None, :], m0 + 2 + tl.arange(0, 1),
                  n, n_ld, M, N, s_om, out, bias, part, pid_k, SPLIT_K, HAS_BIAS)  # fmt: skip
            _emit(tl.sum(acc3, 1)[None, :], m0 + 3 + tl.arange(0, 1),
                  n, n_ld, M, N, s_om, out, bias, part, pid_k, SPLIT_K, HAS_BIAS)  # fmt: skip

    if SEMAPHORE:
        # split-K, one launch: the last of a tile's SPLIT_K programs sums the partials in split order
        tile = counters + pid_m * tl.num_programs(0) + pid_n
        tl.debug_barrier()  # every thread's partial stored before the release below
        arrived = tl.atomic_add(tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            tl.debug_barrier()
            p_off = m.to(tl.int64)[:, None] * N + n[None, :]
            p_mask = (m < M)[:, None] & (n < N)[None, :]
            total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(
                    part + tl.cast(s, tl.int64) * M * N + p_off, mask=p_mask, other=0.0, cache_modifier=".cg"
                )
            _emit(total, m, n, n_ld, M, N, s_om, out, bias, part, pid_k, 1, HAS_BIAS)
            tl.atomic_xchg(tile, 0, sem="relaxed", scope="gpu")


@triton.jit
def _reduce_kernel(
    part, bias, out, M, N, s_om, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """out[m, n] = sum over s in order of part[s, m, n] (+ bias[n]): the "pass" split-K reduction."""
    pdl_wait(USE_PDL)
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    size = tl.cast(M, tl.int64) * N  # M and N may be specialised constants: no .to on them
    ok = i < size
    total = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT_K):
        total += tl.load(part + s * size + i, mask=ok, other=0.0)
    m, n = i // N, i % N
    if HAS_BIAS:
        total += tl.load(bias + n, mask=ok, other=0.0).to(tl.float32)
    tl.store(out + m * s_om + n, total.to(out.dtype.element_ty), mask=ok)


def _counters(device: torch.device) -> torch.Tensor | None:
    """The zeroed counter buffer of this device; None while a capture is running and it does not
    exist yet (a buffer made inside a capture would be zeroed only when the graph replays)."""
    key = device.index if device.type == "cuda" and device.index is not None else -1
    if device.type == "cuda" and key == -1:
        key = torch.cuda.current_device()
    buf = _COUNTERS.get(key)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = _COUNTERS[key] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
    return buf


def m_bucket(num_rows: int) -> int:
    """The block_m of the GEMV form for M rows: the next power of two, at most 16."""
    return min(16, triton.next_power_of_2(max(1, num_rows)))


def pick_config(num_rows: int, n: int, k: int, dtype: torch.dtype, info: DeviceInfo) -> dict:
    """Tiles from the shape (dtype: the weight's): the device's TUNED entry (measured in bf16), else <= 4 rows take the
    GEMV form with thin row blocks (4 rows x 512 columns of bf16 per chunk, 16-byte loads, 4 warps),
    5..16 rows take tensor cores on 16-row tiles (stages as the device's shared memory holds); then
    K is split (powers of two, up to 16, each split keeping >= 2 chunks of K) until there are ~4
    programs per SM. Interpreter (CPU tensors): small tiles."""
    bm = m_bucket(num_rows)
    if info.is_interpreter:
        return dict(block_m=min(bm, 4), block_n=8, block_k=min(64, triton.next_power_of_2(k)), split_k=1)
    elem = torch.empty((), dtype=dtype).element_size()
    tuned = (tuned_for(TUNED, info) or {}).get(tuned_key(num_rows, n, k)) if elem == 2 else None
    if tuned is not None:
        return dict(tuned)
    if bm <= 4:
        cfg = dict(block_m=bm, block_n=4 if bm == 1 else 2, block_k=1024 // elem, num_warps=4, dot=False)
    else:
        cfg = dict(block_m=16, block_n=32, block_k=128, num_warps=4, num_stages=4, dot=True)
    cfg["block_k"] = min(cfg["block_k"], max(16, triton.next_power_of_2(k)))
    if cfg["dot"]:  # an x tile and a weight tile per stage (an FP8 weight's x is 16-bit)
        per_stage = cfg["block_k"] * (16 * max(elem, 2) + cfg["block_n"] * elem)
        cfg["num_stages"] = stages_that_fit(cfg["num_stages"], per_stage, SMEM_SCRATCH, info)
    tiles = triton.cdiv(n, cfg["block_n"]) * triton.cdiv(num_rows, cfg["block_m"])
    want = 4 * info.num_sms
    split = 1
    while tiles * split < want and split < 16 and k >= 4 * split * cfg["block_k"]:
        split *= 2
    cfg["split_k"] = split
    return cfg


def resolve(config: dict, num_rows: int, n: int, k: int, dtype: torch.dtype, scale_k: int = 0) -> dict:
    """A config with every field set, block_k clamped to K, the split count made exact (no empty
    splits) and the per-split K range (a multiple of block_k). scale_k (FP8 weights: the columns of
    a scale block): the MMA form's K steps stay inside one block (block_k <= scale_k), the GEMV
    form's splits start at one (block_k >= scale_k)."""
    dot = bool(config.get("dot", False))
    block_k = min(int(config["block_k"]), max(16 if dot else 1, triton.next_power_of_2(k)))
    if scale_k:
        block_k = min(block_k, scale_k) if dot else max(block_k, scale_k)
    split = max(1, int(config.get("split_k", 1)))
    k_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_split)
    block_m = 16 if dot else min(4, int(config.get("block_m", m_bucket(num_rows))))
    assert dot or block_m in (1, 2, 4), "the GEMV form takes 1, 2 or 4 rows per program"
    return dict(
        block_m=block_m,
        block_n=int(config["block_n"]),
        block_k=block_k,
        split_k=split,
        k_split=k_split,
        num_warps=int(config.get("num_warps", 4)),
        num_stages=int(config.get("num_stages", 3 if dot else 1)),
        dot=dot,
        reduce=config.get("reduce", "sem"),
    )


def linear(
    *, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config: dict | None = None, pdl=True,
    weight_scale: torch.Tensor | None = None, weight_tail: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """linear.linear's skinny GEMM. Any M works (row blocks); it is built for M <= 16. `config`
    forces tiles (see the module docstring). weight_scale: weight is float8 with these block scales
    (dequantized in registers); weight_tail [N_tail, K] in x's dtype: rows after weight's (the
    output has N + N_tail columns; block_n shrinks to a power of two dividing N)."""
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1], "x [M, K], weight [N, K]"
    fp8 = weight_scale is not None
    assert fp8 or x.dtype == weight.dtype, "x and weight must share a dtype (or weight is FP8 with scales)"
    num_rows, k = x.shape
    n8 = weight.shape[0]
    n = n8 + (0 if weight_tail is None else weight_tail.shape[0])
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    if weight_tail is not None and weight_tail.stride(1) != 1:
        weight_tail = weight_tail.contiguous()
    out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    if num_rows == 0 or n == 0:
        return out
    if k == 0:
        out.zero_()
        return out + bias.to(out.dtype) if bias is not None else out
    scale_n, scale_k = scale_block(n8, k, tuple(weight_scale.shape)) if fp8 else (1, 1)
    picked = config or pick_config(num_rows, n, k, weight.dtype if fp8 else x.dtype, device_info(x.device))
    cfg = resolve(picked, num_rows, n, k, x.dtype, scale_k if fp8 else 0)
    if weight_tail is not None:  # the tail's programs start after whole column blocks
        cfg["block_n"] = dividing_block(cfg["block_n"], n8)
    grid_n, grid_m, split = triton.cdiv(n, cfg["block_n"]), triton.cdiv(num_rows, cfg["block_m"]), cfg["split_k"]
    counters = part = None
    semaphore = False
    if split > 1:
        part = torch.empty((split, num_rows, n), dtype=torch.float32, device=x.device)
        if cfg["reduce"] == "sem" and grid_n * grid_m <= COUNTER_SLOTS:
            counters = _counters(x.device)
            semaphore = counters is not None
    dummy = out
    _linear_kernel[(grid_n, split, grid_m)](
        x, weight, weight_scale if fp8 else dummy, weight_tail if weight_tail is not None else weight,
        bias if bias is not None else dummy, out, part if part is not None else dummy,
        counters if counters is not None else dummy, num_rows, n, n8, k, x.stride(0), weight.stride(0),
        weight_scale.stride(0) if fp8 else 0, weight_tail.stride(0) if weight_tail is not None else 0, out.stride(0),
        K_SPLIT=cfg["k_split"], SPLIT_K=split, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"],
        EVEN_K=k % cfg["k_split"] == 0, USE_DOT=cfg["dot"], DOT_IEEE=x.dtype == torch.float32,
        UNROLL=cfg["k_split"] // cfg["block_k"] <= 16, HAS_BIAS=bias is not None, SEMAPHORE=semaphore, FP8=fp8,
        HAS_TAIL=weight_tail is not None, SCALE_N=scale_n, SCALE_K=scale_k, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], **pdl_launch(x, pdl),
    )  # fmt: skip
    if split > 1 and not semaphore:
        block = 1024
        _reduce_kernel[(triton.cdiv(num_rows * n, block),)](
            part, bias if bias is not None else dummy, out, num_rows, n, out.stride(0), SPLIT_K=split, BLOCK=block,
            HAS_BIAS=bias is not None, num_warps=4, **pdl_launch(part, pdl),
        )  # fmt: skip
    return out
