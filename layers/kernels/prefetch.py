"""L2 prefetch of the next kernels' weights, issued by a latency-bound kernel of the decode chain.

At batch 1 a decode step alternates kernels that stream weights (the projections, the experts) with
kernels that wait on latency (the GDN recurrence, attention over a short context, the router, a
"last program" tail); during the latter DRAM idles. Those kernels know which weights come next (a
mixer's out_proj, the MoE block's input projection, the down projections of the experts the router
picked, the next layer's input projection), so they ask L2 to fetch them: the next kernel then reads
from L2 instead of waiting on DRAM. Nothing comes back to the SM (no registers, no wait); the ranges
are weights, which no kernel writes, so the requests may go out before or after the PDL wait.

Each program of a grid takes a contiguous share of the range, split over its threads:
- "bulk": one `cp.async.bulk.prefetch.L2` per thread (the TMA unit walks its chunk);
- "lines": one `prefetch.global.L2` per 128-byte line, looping over the thread's chunk.
`DELTASERVE_L2_PREFETCH` = bulk (default) | lines | 0 picks the form at each launch (so that
`bench offline --variants` compares them in one process); sm_90+ CUDA tensors only (the
interpreter has no inline PTX).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .pdl import pdl_enabled

MODES = {"0": 0, "bulk": 1, "lines": 2}
GRANULE = 256  # bytes: the unit of shares and chunks (bulk prefetches need 16-byte alignment and sizes)


def prefetch_mode(t: torch.Tensor) -> int:
    """The PREFETCH constexpr for kernels launched on t's device: 0 off, 1 bulk, 2 lines. Read at
    each launch; the forms need sm_90 (as PDL), so PDL off turns it off too."""
    name = os.environ.get("DELTASERVE_L2_PREFETCH", "bulk")
    if name not in MODES:
        raise ValueError(f"DELTASERVE_L2_PREFETCH: one of {sorted(MODES)}, not {name!r}")
    return MODES[name] if pdl_enabled(t) else 0


def prefetch_args(weights: Sequence[torch.Tensor | None], device_tensor: torch.Tensor, num_warps: int) -> dict:
    """Keyword arguments of a kernel that calls `prefetch_ranges`: up to two weight tensors
    (contiguous, whole 256-byte granules are fetched; a trailing part is left out) as
    pf_a / pf_b pointers with their granule counts, the PREFETCH form and PF_THREADS (the
    kernel's 32 * num_warps threads). No weights, or a device without the form: PREFETCH=0 (the
    pointers are placeholders)."""
    weights = [w for w in weights if w is not None and w.numel() > 0]
    assert len(weights) <= 2, f"at most two prefetch ranges, got {len(weights)}"
    mode = prefetch_mode(device_tensor) if weights else 0
    ranges = []
    for w in weights:
        assert w.is_contiguous() and w.data_ptr() % 16 == 0, "prefetch ranges: contiguous, 16-byte aligned"
        ranges.append((w, w.numel() * w.element_size() // GRANULE))
    while len(ranges) < 2:
        ranges.append((device_tensor, 0))
    (pf_a, granules_a), (pf_b, granules_b) = ranges
    return dict(
        pf_a=pf_a,
        pf_a_granules=granules_a,
        pf_b=pf_b,
        pf_b_granules=granules_b,
        PREFETCH=mode,
        PF_THREADS=32 * num_warps,
    )


def prefix_bytes(weight: torch.Tensor, max_bytes: int) -> torch.Tensor:
    """The leading rows of weight up to max_bytes (what a kernel reads first when its programs go
    in row order), as a view."""
    row_bytes = weight[0].numel() * weight.element_size()
    return weight[: max(0, min(weight.shape[0], max_bytes // row_bytes))]


@triton.jit
def _bulk_prefetch(addr, size):
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r",
        [addr, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _line_prefetch(addr):
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [addr], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def thread_chunks(granules, part, parts, THREADS: tl.constexpr):
    """Program `part` of `parts` takes the contiguous share [start, end) of `granules` granules,
    thread t of it the chunk [first[t], first[t] + count[t]) (count <= 0: none). Returns (first,
    count, per_thread, end); per_thread is the longest chunk."""
    start = granules.to(tl.int64) * part // parts
    end = granules.to(tl.int64) * (part + 1) // parts
    per_thread = tl.cdiv(end - start, THREADS)
    first = start + tl.arange(0, THREADS) * per_thread
    return first, tl.minimum(per_thread, end - first), per_thread, end


@triton.jit
def prefetch_share(base, granules, part, parts, MODE: tl.constexpr, THREADS: tl.constexpr):
    """Program `part` of `parts` fetches its share of the `granules` 256-byte granules at base
    (thread_chunks), MODE 1 in bulk, 2 line by line."""
    if granules > 0:
        first, count, per_thread, end = thread_chunks(granules, part, parts, THREADS)
        base_bytes = base.to(tl.pointer_type(tl.int8))
        if MODE == 1:
            _bulk_prefetch((base_bytes + first * 256).to(tl.int64), (count * 256).to(tl.int32))
        else:
            last_line = end * 2 - 1  # 128-byte lines: never past the range
            for line in range(0, per_thread * 2):
                _line_prefetch((base_bytes + tl.minimum(first * 2 + line, last_line) * 128).to(tl.int64))


@triton.jit
def prefetch_ranges(
    pf_a, pf_a_granules, pf_b, pf_b_granules, part, parts, PREFETCH: tl.constexpr, PF_THREADS: tl.constexpr
):
    """This program's share of both ranges (prefetch_args) towards L2; nothing when PREFETCH is 0.
    PF_THREADS: the program's thread count, so that each thread issues its own chunk."""
    if PREFETCH != 0:
        prefetch_share(pf_a, pf_a_granules, part, parts, PREFETCH, PF_THREADS)
        prefetch_share(pf_b, pf_b_granules, part, parts, PREFETCH, PF_THREADS)
