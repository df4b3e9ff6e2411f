"""Plain-torch q/k head norm + partial rotary embedding: the reference and the CPU path.

Each head vector is RMS-normalised over the head dim with a zero-centred weight (1 + w), then its
first `rotary_dim` features are rotated by position (rotate-half convention, theta ** (-2i / rotary_dim)
as transformers computes it, in float32).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..attention import naive as attention_naive
from ..norm import naive as norm_naive


class KvCacheWrite(NamedTuple):
    """Where qk_norm_rope also writes each token's finished k and its v: value [T, Hkv, D];
    k_cache, v_cache [num_blocks, block_size, Hkv, D]; slot_mapping [T] (flat slot, -1 = none)."""

    value: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor


def rotary_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, rotary_dim] in float32."""
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=positions.device) / rotary_dim
    inv_freq = 1.0 / (theta**exponent)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first rotary_dim features of each head; x: [T, H, D], cos/sin: [T, rotary_dim]."""
    rotary_dim = cos.shape[-1]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated_half = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    cos, sin = cos.to(x.dtype)[:, None, :], sin.to(x.dtype)[:, None, :]
    return torch.cat((rot * cos + rotated_half * sin, rest), dim=-1)


def qk_norm_rope(*, q, k, q_weight, k_weight, positions, eps, rotary_dim, theta, kv_cache=None):
    """The reference of rotary.qk_norm_rope."""
    cos, sin = rotary_cos_sin(positions, rotary_dim, theta)
    q = norm_naive.rms_norm(x=q, weight=q_weight, eps=eps)
    k = norm_naive.rms_norm(x=k, weight=k_weight, eps=eps)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    if kv_cache is not None:
        attention_naive.write_kv_cache(
            key=k,
            value=kv_cache.value,
            k_cache=kv_cache.k_cache,
            v_cache=kv_cache.v_cache,
            slot_mapping=kv_cache.slot_mapping,
        )
    return q, k
