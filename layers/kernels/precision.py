"""The dtype the plain-torch references accumulate in: float32, or float64 when any input is float64
(the CPU reference runs that compare a prefix-cache hit with a fresh run at 1e-5 need every op finer
than float32, whose rounding moves with a matmul's row count)."""

from __future__ import annotations

import torch


def acc_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
