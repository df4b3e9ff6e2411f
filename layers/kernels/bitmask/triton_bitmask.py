"""The token bitmask applied in one launch: grid (bitmask rows, blocks of BLOCK tokens); each program
reads BLOCK / 32 words of its row's mask, expands them to bits and stores -inf where a bit is 0.
The logits are only written, and only where a token is forbidden.

Why not xgrammar's own Triton kernel: it takes the bitmask with one row per logits row (a batch of
64 rows of which one is constrained would upload 64 masks) and copies a Python list of row indices
from pageable memory (a host sync under async scheduling); here the mask holds the constrained rows
only and the row ids come in a device tensor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # 61 programs per row of a 248K vocabulary
NUM_WARPS = 4


@triton.jit
def _apply_bitmask_kernel(
    logits, bitmask, rows, s_row, s_mask, vocab, words, HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    i = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    if HAS_ROWS:
        row = tl.load(rows + i).to(tl.int64)
    else:
        row = i
    w = blk * (BLOCK // 32) + tl.arange(0, BLOCK // 32)
    packed = tl.load(bitmask + i * s_mask + w, mask=w < words, other=-1)
    banned = ((packed[:, None] >> tl.arange(0, 32)[None, :]) & 1) == 0
    banned = tl.reshape(banned, (BLOCK,))
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    tl.store(logits + row * s_row + offs, float("-inf"), mask=banned & (offs < vocab))


def apply_token_bitmask(
    *, logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None, block: int = BLOCK
) -> None:
    """bitmask.apply_token_bitmask on CUDA (or the interpreter)."""
    assert logits.dim() == 2 and logits.stride(1) == 1, "logits [R, V] with contiguous rows"
    assert bitmask.dtype == torch.int32 and bitmask.dim() == 2 and bitmask.stride(1) == 1, "bitmask [M, W] int32"
    vocab = logits.shape[1]
    words = bitmask.shape[1]
    assert words * 32 >= vocab, f"bitmask of {words} words covers fewer than {vocab} tokens"
    count = bitmask.shape[0]
    if rows is None:
        assert count == logits.shape[0], "without rows the bitmask has one row per logits row"
    else:
        assert rows.shape == (count,), "rows: one logits row per bitmask row"
    if count == 0:
        return
    _apply_bitmask_kernel[(count, triton.cdiv(vocab, block))](
        logits, bitmask, rows if rows is not None else bitmask, logits.stride(0), bitmask.stride(0), vocab, words,
        HAS_ROWS=rows is not None, BLOCK=block, num_warps=NUM_WARPS,
    )  # fmt: skip
