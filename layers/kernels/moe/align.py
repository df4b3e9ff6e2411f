"""The sorted path's pair grouping (moe_align style, on the device): the (token, slot) pairs of a
top-k routing grouped per local expert into BLOCK_M-row blocks padded with a sentinel, so that the
grouped GEMMs (sorted.py) take one expert per block. Up to ALIGN_ONE_LAUNCH_MAX pairs one
single-program kernel (histogram + scan + one in-register sort, deterministic); above it two
launches: count (atomic ranks per expert; its last program to arrive scans the padded offsets) and
place (the scatter, the padding, the blocks' experts; each expert's counter reset by the program
that reads it, so the counters, a device buffer of tickets, are zero between calls). No host sync."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..device import ticket_counters
from ..pdl import pdl_launch, pdl_wait
from ..tickets import last_to_arrive

# at or under this many routed pairs (batch 128 at top-8) align_pairs is the single-program launch
# holding every pair's sort key in registers; its sort does not spread over programs, so beyond
# 2,048 keys it would near the two-launch form's cost (moe/NOTES.md)
ALIGN_ONE_LAUNCH_MAX = 1024


@triton.jit
def _scan(counts, offsets, num_experts, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, STRIDE: tl.constexpr):
    """offsets[e] = start of expert e's padded rows; offsets[E] = all padded rows (expert e's count at
    counts[e * STRIDE]). .cg: other programs' atomics wrote the counts."""
    e = tl.arange(0, BLOCK_E)
    c = tl.load(counts + e * STRIDE, mask=e < num_experts, other=0, cache_modifier=".cg")
    padded = tl.cdiv(c, BLOCK_M) * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(offsets + e, ends - padded, mask=e < num_experts)
    tl.store(offsets + num_experts, tl.sum(padded, 0))


# values that change from pass to pass: one compile serves them all (kernels/__init__.py)
@triton.jit(do_not_specialize=["num_pairs"])
def _count_kernel(
    topk_ids, counts, ticket, ranks, offsets, expert_offset, num_experts, num_pairs, BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, STRIDE: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """Per pair: its rank within its expert (atomic increment on counters at zero, STRIDE apart; order
    within an expert is free); the last program to arrive scans the counts into offsets."""
    pdl_wait(USE_PDL)
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(topk_ids + p, mask=p < num_pairs, other=-1).to(tl.int32) - expert_offset
    local = (p < num_pairs) & (e >= 0) & (e < num_experts)
    rank = tl.atomic_add(counts + e * STRIDE, 1, mask=local, sem="relaxed")
    tl.store(ranks + p, rank, mask=local)
    tl.debug_barrier()  # this program's increments before its arrival
    if last_to_arrive(ticket, tl.num_programs(0)):
        _scan(counts, offsets, num_experts, BLOCK_M, BLOCK_E, STRIDE)


# values that change from pass to pass: one compile serves them all (kernels/__init__.py)
@triton.jit(do_not_specialize=["num_pairs", "max_blocks"])
def _place_kernel(
    topk_ids, counts, ranks, offsets, sorted_ids, block_expert, expert_offset, num_experts, num_pairs, max_blocks,
    BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, CHUNK_E: tl.constexpr, CHUNK_B: tl.constexpr, BLOCK_E: tl.constexpr,
    STRIDE: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """Program i: scatters pairs chunk i to their rows, fills expert chunk i's padding rows with the
    sentinel num_pairs (and sets those experts' counters back to zero: no other program reads them),
    and maps block chunk i to its expert (-1 past the last padded row)."""
    pdl_wait(USE_PDL)
    pid = tl.program_id(0)
    p = pid * BLOCK_P + tl.arange(0, BLOCK_P)
    e = tl.load(topk_ids + p, mask=p < num_pairs, other=-1).to(tl.int32) - expert_offset
    local = (p < num_pairs) & (e >= 0) & (e < num_experts)
    row = tl.load(offsets + e, mask=local, other=0) + tl.load(ranks + p, mask=local, other=0)
    tl.store(sorted_ids + row, p, mask=local)

    ec = pid * CHUNK_E + tl.arange(0, CHUNK_E)
    ec_ok = ec < num_experts
    fill_from = tl.load(offsets + ec, mask=ec_ok, other=0) + tl.load(counts + ec * STRIDE, mask=ec_ok, other=0)
    fill_to = tl.load(offsets + ec + 1, mask=ec_ok, other=0)
    # the [CHUNK_E] counts are replicated across the program's threads: without the barrier the thread
    # that stores an expert's zero may run before another loads its count (that thread's padding then
    # starts at the expert's first row and overwrites placed pairs; seen on the GPU from ~200k pairs)
    tl.debug_barrier()
    tl.store(counts + ec * STRIDE, tl.zeros_like(ec), mask=ec_ok)
    pad = fill_from[:, None] + tl.arange(0, BLOCK_M)[None, :]
    tl.store(sorted_ids + pad, tl.zeros_like(pad) + num_pairs, mask=ec_ok[:, None] & (pad < fill_to[:, None]))

    b = pid * CHUNK_B + tl.arange(0, CHUNK_B)
    ea = tl.arange(0, BLOCK_E)
    ends = tl.load(offsets + 1 + ea, mask=ea < num_experts, other=0)
    first_row = b * BLOCK_M
    owner = tl.sum(tl.where((ea < num_experts)[None, :] & (ends[None, :] <= first_row[:, None]), 1, 0), 1)
    owner = tl.where(first_row < tl.load(offsets + num_experts), owner, -1)
    tl.store(block_expert + b, owner, mask=b < max_blocks)


@triton.jit
def _add_pair(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


# values that change from pass to pass: one compile serves them all (kernels/__init__.py)
@triton.jit(do_not_specialize=["num_pairs", "max_blocks"])
def _align_kernel(
    topk_ids, sorted_ids, block_expert, offsets, expert_offset, num_experts, num_pairs, max_blocks,
    BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK_B: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """align_pairs in one program, no atomics and no scratch (BLOCK_P >= num_pairs): per-expert
    counts by tl.histogram, the padded scan, then one sort of the keys expert * BLOCK_P + pair
    (non-local pairs last) puts the local pairs in expert-then-pair order; sorted position i of
    expert e goes to row i + (padded start - unpadded start of e). Every block starts with a real
    pair (padding only ends an expert's last block), so the pair at a block's first row names its
    expert."""
    pdl_wait(USE_PDL)
    p = tl.arange(0, BLOCK_P)
    e = tl.load(topk_ids + p, mask=p < num_pairs, other=-1).to(tl.int32) - expert_offset
    local = (p < num_pairs) & (e >= 0) & (e < num_experts)
    counts = tl.histogram(e, BLOCK_E, mask=local)
    padded = tl.cdiv(counts, BLOCK_M) * BLOCK_M
    # one scan for both: padded row ends, and the padding rows up to each expert (inclusive)
    ends, spare_ends = tl.associative_scan((padded, padded - counts), 0, _add_pair)
    starts = ends - padded
    total = tl.sum(padded, 0)
    ea = tl.arange(0, BLOCK_E)
    tl.store(offsets + ea, starts, mask=ea < num_experts)
    tl.store(offsets + num_experts, total)
    pad = (starts + counts)[:, None] + tl.arange(0, BLOCK_M)[None, :]
    tl.store(sorted_ids + pad, tl.zeros_like(pad) + num_pairs, mask=pad < ends[:, None])
    shift = spare_ends - (padded - counts)  # padded minus unpadded start of each expert
    key = tl.sort(tl.where(local, e, BLOCK_E) * BLOCK_P + p)
    se = key // BLOCK_P
    ok = se < BLOCK_E
    row = p + tl.gather(shift, tl.minimum(se, BLOCK_E - 1), 0)
    tl.store(sorted_ids + row, key % BLOCK_P, mask=ok)
    tl.store(block_expert + row // BLOCK_M, se, mask=ok & (row % BLOCK_M == 0))
    for b0 in range(0, max_blocks, CHUNK_B):
        b = b0 + tl.arange(0, CHUNK_B)
        tl.store(block_expert + b, tl.full([CHUNK_B], -1, tl.int32), mask=(b < max_blocks) & (b * BLOCK_M >= total))


def align_pairs(
    *,
    topk_ids: torch.Tensor,
    num_experts: int,
    expert_offset: int,
    block_m: int,
    one_launch: bool | None = None,
    pdl: bool = True,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the (token, slot) pairs of topk_ids [T, top_k] (flat pair = t * top_k + slot) by local expert.

    Returns sorted_ids [max_blocks * block_m] (pair per row, num_pairs = padding; rows past the
    total are unset), block_expert [max_blocks] (local expert per block, -1 = unused) and
    offsets [E + 1] (padded row start per expert; offsets[E] = total padded rows). max_blocks bounds
    sum_e cdiv(count_e, block_m) from shapes alone, so nothing syncs with the host.
    Up to ALIGN_ONE_LAUNCH_MAX pairs: one single-program launch, pairs in ascending order within an
    expert; above it count (+ scan) and place, two launches (order within an expert free).
    `one_launch` overrides the choice (tests); `config` the two-launch form's pairs a program
    (block_p), warps (count_warps, place_warps) and the experts' counters' spacing in int32s
    (count_stride), align_config's by default."""
    num_pairs = topk_ids.numel()
    device = topk_ids.device
    max_blocks = triton.cdiv(num_pairs, block_m) + min(num_pairs, num_experts)
    offsets = torch.empty(num_experts + 1, dtype=torch.int32, device=device)
    sorted_ids = torch.empty(max_blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=device)
    block_e = triton.next_power_of_2(num_experts)
    if one_launch is None:
        one_launch = num_pairs <= ALIGN_ONE_LAUNCH_MAX
    if one_launch:
        block_p = max(16, triton.next_power_of_2(num_pairs))
        _align_kernel[(1,)](
            topk_ids, sorted_ids, block_expert, offsets, expert_offset, num_experts, num_pairs, max_blocks,
            BLOCK_M=block_m, BLOCK_P=block_p, BLOCK_E=block_e, CHUNK_B=512, num_warps=8, **pdl_launch(topk_ids, pdl),
        )  # fmt: skip
        return sorted_ids, block_expert, offsets
    cfg = config or align_config(device)
    block_p, stride = cfg["block_p"], cfg["count_stride"]
    # the experts' counters, then the count launch's ticket: zero before and after a call
    tickets = ticket_counters(device, num_experts * stride + 1, "moe_align")
    counts, ticket = tickets[: num_experts * stride], tickets[num_experts * stride :]
    ranks = torch.empty(num_pairs, dtype=torch.int32, device=device)
    chunk_e = max(1, 2048 // block_m)
    chunk_b = max(1, 4096 // block_e)
    _count_kernel[(triton.cdiv(num_pairs, block_p),)](
        topk_ids, counts, ticket, ranks, offsets, expert_offset, num_experts, num_pairs, BLOCK=block_p,
        BLOCK_M=block_m, BLOCK_E=block_e, STRIDE=stride, num_warps=cfg["count_warps"], **pdl_launch(topk_ids, pdl),
    )  # fmt: skip
    grid = max(triton.cdiv(num_pairs, block_p), triton.cdiv(num_experts, chunk_e), triton.cdiv(max_blocks, chunk_b))
    _place_kernel[(grid,)](
        topk_ids, counts, ranks, offsets, sorted_ids, block_expert, expert_offset, num_experts, num_pairs, max_blocks,
        BLOCK_M=block_m, BLOCK_P=block_p, CHUNK_E=chunk_e, CHUNK_B=chunk_b, BLOCK_E=block_e, STRIDE=stride,
        num_warps=cfg["place_warps"], **pdl_launch(topk_ids, pdl),
    )  # fmt: skip
    return sorted_ids, block_expert, offsets


def align_config(device: torch.device) -> dict:
    """The two-launch form's pairs a program, warps and counter spacing (the interpreter: small blocks).
    The experts' counters 32 int32s (128 bytes) apart spread the count kernel's atomics over the L2's
    slices: on an H100 8k tokens 7.6 us against 23.3 packed (moe/NOTES.md)."""
    if device.type != "cuda":
        return dict(block_p=64, count_warps=4, place_warps=4, count_stride=1)
    return dict(block_p=256, count_warps=4, place_warps=4, count_stride=32)
