"""Greedy token choice: the index of each row's largest logit."""

from __future__ import annotations

import torch


def row_argmax(*, logits: torch.Tensor) -> torch.Tensor:
    """logits [R, V] (any float dtype, any row stride) -> [R] int64: the first index of each row's
    maximum, NaN counting as larger than any number (torch.argmax's rule)."""
    return logits.argmax(dim=-1)
