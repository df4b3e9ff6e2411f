"""Tensor and expert parallelism as a separate concern: the layout, shard arithmetic and collectives.

Layers ask `ParallelLayout` which slice of a weight they own and call `all_reduce` after a
row-parallel output; nothing else in the model knows about ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


class ParallelConfigError(ValueError):
    """A model size that the requested parallel layout cannot split; raised before any weight loads."""


@dataclass(frozen=True)
class ParallelLayout:
    tp_rank: int = 0
    tp_size: int = 1
    # Experts partitioned over the TP group's ranks (each expert whole on one rank) instead of
    # every expert split along its intermediate dim.
    expert_parallel: bool = False
    group: Any = None  # torch.distributed process group; None: the default group

    @property
    def is_parallel(self) -> bool:
        return self.tp_size > 1

    def split(self, total: int, what: str) -> tuple[int, int]:
        """(start, size) of this rank's equal share of `total` items; an error names `what`."""
        if total % self.tp_size:
            raise ParallelConfigError(f"{what} ({total}) is not divisible by tensor_parallel_size ({self.tp_size})")
        size = total // self.tp_size
        return self.tp_rank * size, size

    def kv_heads(self, num_kv_heads: int, num_q_heads: int) -> tuple[int, int]:
        """(first kv head, local kv heads): split when TP divides them, else replicated so that
        each rank holds the one kv head its q heads read."""
        self.split(num_q_heads, "num_attention_heads")
        if num_kv_heads >= self.tp_size:
            return self.split(num_kv_heads, "num_key_value_heads")
        if self.tp_size % num_kv_heads:
            raise ParallelConfigError(
                f"num_key_value_heads ({num_kv_heads}) must divide tensor_parallel_size ({self.tp_size}) "
                "when it is smaller"
            )
        q_start, _ = self.split(num_q_heads, "num_attention_heads")
        return q_start // (num_q_heads // num_kv_heads), 1


def all_reduce(x: torch.Tensor, layout: ParallelLayout) -> torch.Tensor:
    """Sum a row-parallel partial output over the TP group (in place); identity at TP = 1."""
    if layout.tp_size > 1:
        dist.all_reduce(x, group=layout.group)
    return x


def all_gather_last_dim(x: torch.Tensor, layout: ParallelLayout) -> torch.Tensor:
    """Concatenate each rank's slice along the last dim (vocab-parallel logits)."""
    if layout.tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(layout.tp_size)]
    dist.all_gather(parts, x.contiguous(), group=layout.group)
    return torch.cat(parts, dim=-1)


def validate_layout(config, layout: ParallelLayout) -> None:
    """Every split the model needs, checked before any weight is read."""
    if layout.tp_size == 1:
        return
    layout.kv_heads(config.num_kv_heads, config.num_attention_heads)
    if config.gdn_layer_ids:
        layout.split(config.linear_num_key_heads, "linear_num_key_heads")
    if getattr(config, "ple", None) is not None:  # each rank holds a column slice of every n-gram table
        layout.split(config.ple.head_dim, "ple_embed_dim / n-gram heads")
    if "dense" in config.mlp_types:
        layout.split(config.intermediate_size, "intermediate_size")
    if config.is_moe:
        if layout.expert_parallel:
            layout.split(config.num_experts, "num_experts")
        else:
            layout.split(config.moe_intermediate_size, "moe_intermediate_size")
        if config.shared_expert_intermediate_size:
            layout.split(config.shared_expert_intermediate_size, "shared_expert_intermediate_size")
