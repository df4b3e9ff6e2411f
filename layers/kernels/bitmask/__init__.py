"""Structured output's token bitmask applied to the logits: tokens the grammar forbids become -inf."""

from __future__ import annotations

import torch

from . import naive


def apply_token_bitmask(*, logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """In place: logits[rows[i], t] = -inf wherever bit t of bitmask row i is 0 (xgrammar's layout:
    bit t % 32 of int32 word t // 32 is token t, 1 = allowed).

    Args:
        logits: [R, V], any float dtype, on the device; the last dim contiguous.
        bitmask: [M, W] int32 on the logits' device, W >= ceil(V / 32); bits past V are ignored.
        rows: [M] int64 on the device, the logits row each bitmask row masks; None: M == R, in order.

    CUDA: one launch; CPU: plain torch.
    """
    if logits.is_cuda:
        from .triton_bitmask import apply_token_bitmask as impl

        impl(logits=logits, bitmask=bitmask, rows=rows)
        return
    naive.apply_token_bitmask(logits=logits, bitmask=bitmask, rows=rows)
