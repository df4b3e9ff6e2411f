"""Greedy token choice: the index of each row's largest logit."""

from __future__ import annotations

import torch


def row_argmax(*, logits: torch.Tensor) -> torch.Tensor:
    """The reference of argmax.row_argmax."""
    return logits.argmax(dim=-1)
