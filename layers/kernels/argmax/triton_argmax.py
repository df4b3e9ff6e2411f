"""Each row's argmax over the vocabulary in one launch, read in the logits' own dtype.

Why: greedy decoding took torch's float32 copy of the bf16 logits and its argmax reduction, two
kernels (H200, batch 1, 248,320 logits: 4.2 + 7.9 us in place a step); at batch 256 the copy alone
moves 380 MB. Here the lm_head's bf16 output is read once.

Grid (rows, blocks of BLOCK logits): each program finds its block's maximum and the first index
holding it, stores the pair, and the last of the row's programs to arrive (tickets.last_to_arrive)
merges the row's pairs, first index among equal maxima, as torch.argmax. NaN is taken as +inf:
where a row holds both, this returns the first of either, torch the first NaN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..device import ticket_counters
from ..pdl import pdl_launch, pdl_wait
from ..tickets import last_to_arrive

BLOCK = 2048  # batch 1 over a 248K vocabulary: 122 programs, about one per SM
NUM_WARPS = 4


@triton.jit
def _row_argmax_kernel(
    logits, block_max, block_arg, out, tickets, s_row, vocab, BLOCK: tl.constexpr, BLOCKS_P: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    blocks = tl.num_programs(1)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(logits + row * s_row + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)
    best = tl.max(x, 0)
    # the first index holding the maximum (an all -inf block: its first index, as torch)
    first = tl.min(tl.where((x == best) & (offs < vocab), offs, vocab), 0)
    tl.store(block_max + row * blocks + blk, best)
    tl.store(block_arg + row * blocks + blk, first)
    tl.debug_barrier()
    if last_to_arrive(tickets + row, blocks):
        j = tl.arange(0, BLOCKS_P)
        mine = j < blocks
        maxima = tl.load(block_max + row * blocks + j, mask=mine, other=float("-inf"), cache_modifier=".cg")
        args = tl.load(block_arg + row * blocks + j, mask=mine, other=vocab, cache_modifier=".cg")
        top = tl.max(maxima, 0)
        tl.store(out + row, tl.min(tl.where((maxima == top) & mine, args, vocab), 0).to(tl.int64))


def row_argmax(*, logits: torch.Tensor, block: int = BLOCK, pdl: bool = True) -> torch.Tensor:
    """argmax.row_argmax on CUDA (or the interpreter). Launches on a device must not overlap: they
    share the ticket counters."""
    assert logits.dim() == 2 and logits.is_floating_point(), "logits [R, V] of a float dtype"
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    assert vocab > 0, "an empty vocabulary has no argmax"
    blocks = triton.cdiv(vocab, block)
    block_max = torch.empty((rows, blocks), dtype=torch.float32, device=logits.device)
    block_arg = torch.empty((rows, blocks), dtype=torch.int32, device=logits.device)
    tickets = ticket_counters(logits.device, rows, "row_argmax")
    _row_argmax_kernel[(rows, blocks)](
        logits, block_max, block_arg, out, tickets, logits.stride(0), vocab, BLOCK=block,
        BLOCKS_P=triton.next_power_of_2(blocks), num_warps=NUM_WARPS, **pdl_launch(logits, pdl),
    )  # fmt: skip
    return out
