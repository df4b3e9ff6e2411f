"""Greedy sampling's argmax over the vocabulary."""

from __future__ import annotations

import torch

from . import naive


def row_argmax(*, logits: torch.Tensor, pdl: bool = True) -> torch.Tensor:
    """The first index of each row's largest logit; NaN counts as larger than any number (torch.argmax's rule).

    Args:
        logits: [R, V], any float dtype, rows at any stride (CUDA: the last dim contiguous or copied).
        pdl: CUDA: launch under programmatic dependent launch (sm_90+).

    Returns:
        [R] int64. CUDA: one launch in the logits' own dtype; CPU: torch.argmax.
    """
    if logits.is_cuda:
        from .triton_argmax import row_argmax as impl

        return impl(logits=logits, pdl=pdl)
    return naive.row_argmax(logits=logits)
