"""Hyper-connections (Qwen4-Exp): the residual stream is `count` streams of hidden_size side by side,
[T, count * hidden]. Before a block, a gated mixer reads all of them and gives the block one input:

    n      = rms_norm per stream (weight [count * hidden], zero-centred)
    w      = sigmoid(up(silu(down(n) / count)))            [T, count, hidden]
    input  = mean over streams of w * n                     [T, hidden]
    inject = 2 sigmoid(inject(n) / count)                   [T, count]

and after it each stream gets the block's output scaled by its inject weight (`add_block_output`).
The model's last mixer has no inject weights: its mixed input is the final hidden state.

Every rank holds the whole mixer (its weights are small) and the whole stream: the blocks' outputs
are complete after their all-reduce.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import CheckpointTensor
from .common import empty_param, project, whole
from .kernels.options import KernelOptions
from .kernels.precision import acc_dtype


def grouped_rms_norm(x: torch.Tensor, weight: torch.Tensor, group: int, eps: float) -> torch.Tensor:
    """x / rms(x) * (1 + weight) over each `group` features of the last dim (float32 math, x's dtype
    out): transformers' grouped Qwen4ExpTextRMSNorm. x: [T, G * group]; weight: [G * group]."""
    acc = acc_dtype(x)
    xf = x.to(acc).unflatten(-1, (-1, group))
    y = (xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)).flatten(-2)
    return (y * (1.0 + weight.to(acc))).to(x.dtype)


class HyperConnection(nn.Module):
    """One gated mixer of the hyper-connection streams (transformers' Qwen4ExpTextGatedResidual)."""

    def __init__(self, hidden_size: int, count: int, lowrank: int, eps: float, inject: bool = True):
        super().__init__()
        self.hidden_size, self.count, self.eps = hidden_size, count, eps
        width = count * hidden_size
        self.norm_weight = empty_param(width)
        self.down = empty_param(lowrank, width)
        self.up = empty_param(width, lowrank)
        self.inject = empty_param(count, width) if inject else None

    def checkpoint_tensors(self, prefix: str) -> list[CheckpointTensor]:
        out = [
            whole(f"{prefix}hc_norm.weight", self.norm_weight, init="zeros"),
            whole(f"{prefix}input_mix_weight_down.weight", self.down),
            whole(f"{prefix}input_mix_weight_up.weight", self.up),
        ]
        if self.inject is not None:
            out.append(whole(f"{prefix}block_inject_weight.weight", self.inject))
        return out

    def forward(self, streams: torch.Tensor, kernels: KernelOptions) -> tuple[torch.Tensor, torch.Tensor | None]:
        """streams [T, count * hidden] -> (the block input [T, hidden], inject weights [T, count] or None)."""
        normed = grouped_rms_norm(streams, self.norm_weight, self.hidden_size, self.eps)
        mix = F.silu(project(normed, self.down, kernels) / self.count)
        mix = torch.sigmoid(project(mix, self.up, kernels))
        mixed = (mix.unflatten(-1, (self.count, self.hidden_size)) * normed.unflatten(-1, (self.count, -1))).mean(-2)
        if self.inject is None:
            return mixed, None
        return mixed, 2 * torch.sigmoid(project(normed, self.inject, kernels) / self.count)


def add_block_output(streams: torch.Tensor, out: torch.Tensor, inject: torch.Tensor) -> torch.Tensor:
    """streams + each stream's inject weight times the block output: [T, count * hidden]."""
    return streams + (out.unsqueeze(-2) * inject.unsqueeze(-1)).flatten(-2)
