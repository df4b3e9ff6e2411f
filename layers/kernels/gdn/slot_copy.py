"""Copies of whole state slots for the entries a graphed pass uses (fixed_captures.FixedCaptures).

A prefill graph's capture fields have a fixed number of entries; the ones a pass does not use name
the scratch slot. Copied with torch index ops, every entry moves its [Hv, K, V] float32 state
(2 MB at the 35B shape) twice, used or not: ~15 us a GDN layer of a 2k prefill. Here one launch
copies only the entries whose `used` flag is set: grid (entries, tiles of a slot), an unused
entry's programs return before any load. Same contract as naive.copy_state_slots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # elements a program (16 KB of float32)


# the index tensors are views of a graph's static buffers: their alignment is not a compile key
@triton.jit(do_not_specialize=["dst", "used", "src", "slots", "keep"])
def _copy_kernel(
    pool, dst, used, src, slots, keep, stride_s, numel, FROM_SEQ: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    c = tl.program_id(0)
    if tl.load(used + c) == 0:
        return
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    d = tl.load(dst + c).to(tl.int64)
    if FROM_SEQ:
        seq = tl.load(src + c)
        s = tl.load(slots + seq).to(tl.int64)
        x = tl.load(pool + s * stride_s + offs, mask=ok, other=0.0)
        x = tl.where(tl.load(keep + seq).to(tl.int32) != 0, x, 0.0)
    else:
        s = tl.load(src + c).to(tl.int64)
        x = tl.load(pool + s * stride_s + offs, mask=ok, other=0.0)
    tl.store(pool + d * stride_s + offs, x, mask=ok)


def copy_state_slots(
    *,
    pool: torch.Tensor,
    dst: torch.Tensor,
    used: torch.Tensor,
    src: torch.Tensor,
    slots: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
) -> None:
    """naive.copy_state_slots in one launch (pool [S, ...] with each slot contiguous)."""
    assert pool[0].is_contiguous(), "pool: each slot's state contiguous"
    numel = pool[0].numel()
    from_seq = slots is not None
    _copy_kernel[(dst.shape[0], triton.cdiv(numel, BLOCK))](
        pool, dst, used, src, slots if from_seq else src, keep if from_seq else src, pool.stride(0), numel,
        FROM_SEQ=from_seq, BLOCK=BLOCK, num_warps=4,
    )  # fmt: skip
