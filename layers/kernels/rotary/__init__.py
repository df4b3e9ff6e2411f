"""q/k head norm fused with partial rotary embeddings (gated attention's pre-attention step)."""

from __future__ import annotations

import torch

from . import naive
from .naive import KvCacheWrite

__all__ = ["KvCacheWrite", "qk_norm_rope"]


def qk_norm_rope(
    *,
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    positions: torch.Tensor,
    eps: float,
    rotary_dim: int,
    theta: float,
    kv_cache: KvCacheWrite | None = None,
    pdl: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-centred RMSNorm of each q and k head (float32, weight 1 + w), then the rotate-half
    rotary embedding of its first `rotary_dim` features (theta ** (-2i / rotary_dim), transformers'
    convention).

    Args:
        q: [T, Hq, D], k: [T, Hkv, D], activations' dtype, may be strided views (D contiguous).
        q_weight, k_weight: [D].
        positions: [T] int.
        kv_cache: also write the finished k and `kv_cache.value` ([T, Hkv, D]) into the paged cache
            ([num_blocks, block_size, Hkv, D]) at `kv_cache.slot_mapping` ([T]; -1 writes nothing).
        pdl: CUDA: launch under programmatic dependent launch (sm_90+).

    Returns:
        (q, k): new contiguous tensors of the inputs' shapes and dtype. CUDA: one launch.
    """
    if q.is_cuda:
        from .triton_rotary import qk_norm_rope as impl

        return impl(
            q=q, k=k, q_weight=q_weight, k_weight=k_weight, positions=positions, eps=eps, rotary_dim=rotary_dim,
            theta=theta, kv_cache=kv_cache, pdl=pdl,
        )  # fmt: skip
    return naive.qk_norm_rope(
        q=q, k=k, q_weight=q_weight, k_weight=k_weight, positions=positions, eps=eps, rotary_dim=rotary_dim,
        theta=theta, kv_cache=kv_cache,
    )  # fmt: skip
