"""QSA sparse attention (Qwen4-Exp): the indexer's paged key caches, block scoring + top-k, and
attention over the selected blocks. Layouts and semantics: naive.py.

Typed op signatures (fla style): B = blocks in the pool, P = page size (block_size), r = compress
ratio, D = indexer head dim, Hi = indexer query heads, N = rows of block_tables, T = tokens of one
group of a pass (its decode rows or its prefill chunk), C = max_blocks, K = top_blocks, Hq / Hkv /
Dh = attention heads and head dim. The wrappers pick the Triton kernel for CUDA tensors and the
plain-torch reference otherwise.
"""

from __future__ import annotations

import torch

from . import naive


def write_index_keys(*, keys: torch.Tensor, key_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """keys [T, D] (unit stride over D) -> key_cache [B, P, D] at flat slots slot_mapping [T] int64
    (page * P + offset; -1 writes nothing)."""
    if keys.is_cuda:
        from .triton_qsa import write_index_keys as impl
    else:
        impl = naive.write_index_keys
    impl(keys=keys, key_cache=key_cache, slot_mapping=slot_mapping)


def compress_blocks(
    *,
    key_cache: torch.Tensor,
    block_cache: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    token_rows: torch.Tensor,
    block_tables: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    rotary_dim: int,
    theta: float,
    compress_ratio: int,
) -> None:
    """Compressed keys of the blocks the group's tokens complete: key_cache [B, P, D] (this pass's raw
    keys already written) -> block_cache [B, (P - 1) // r + 1, D]. positions, slot_mapping, token_rows:
    [T]; block_tables [N, max_pages] int32; norm_weight [D] (zero-centred k_layernorm)."""
    kwargs = dict(
        key_cache=key_cache,
        block_cache=block_cache,
        positions=positions,
        slot_mapping=slot_mapping,
        token_rows=token_rows,
        block_tables=block_tables,
        norm_weight=norm_weight,
        eps=eps,
        rotary_dim=rotary_dim,
        theta=theta,
        compress_ratio=compress_ratio,
    )
    if key_cache.is_cuda:
        from .triton_qsa import compress_blocks as impl
    else:
        impl = naive.compress_blocks
    impl(**kwargs)


def index_scores(
    *,
    q: torch.Tensor,
    block_cache: torch.Tensor,
    positions: torch.Tensor,
    token_rows: torch.Tensor,
    block_tables: torch.Tensor,
    compress_ratio: int,
    block_size: int,
    max_blocks: int,
) -> torch.Tensor:
    """q [T, Hi, D] -> scores [T, C] float32: sum_h relu(q_h . K_c) / sqrt(D) for the complete blocks
    c < (p + 1) // r of each token's sequence, -inf past them."""
    kwargs = dict(
        q=q,
        block_cache=block_cache,
        positions=positions,
        token_rows=token_rows,
        block_tables=block_tables,
        compress_ratio=compress_ratio,
        block_size=block_size,
        max_blocks=max_blocks,
    )
    if q.is_cuda:
        from .triton_qsa import index_scores as impl
    else:
        impl = naive.index_scores
    return impl(**kwargs)


def block_topk(*, scores: torch.Tensor, positions: torch.Tensor, compress_ratio: int, top_blocks: int) -> torch.Tensor:
    """scores [T, C] -> selected blocks [T, K] int32, ascending, -1 padded: every complete block while
    (p + 1) // r <= K, else the K of highest score (ties: naive.block_topk)."""
    if scores.is_cuda:
        from .triton_qsa import block_topk as impl
    else:
        impl = naive.block_topk
    return impl(scores=scores, positions=positions, compress_ratio=compress_ratio, top_blocks=top_blocks)


def sparse_attention(
    *,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    token_rows: torch.Tensor,
    block_tables: torch.Tensor,
    selected: torch.Tensor,
    compress_ratio: int,
    scale: float,
) -> torch.Tensor:
    """q [T, Hq, Dh]; k_cache, v_cache [B, P, Hkv, Dh]; selected [T, K] -> o [T, Hq, Dh] in q's dtype:
    each query's softmax attention over the selected blocks' tokens and its own incomplete block's
    tokens up to itself."""
    kwargs = dict(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        positions=positions,
        token_rows=token_rows,
        block_tables=block_tables,
        selected=selected,
        compress_ratio=compress_ratio,
        scale=scale,
    )
    if q.is_cuda:
        from .triton_qsa import sparse_attention as impl
    else:
        impl = naive.sparse_attention
    return impl(**kwargs)
