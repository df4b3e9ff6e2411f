"""QSA sparse attention (Qwen4-Exp): the indexer's paged key caches, block scoring + top-k, and
attention over the selected blocks. Layouts and semantics: naive.py.

Shapes: B = pages in the pool, P = page size (block_size), r = compress ratio, D = indexer head dim,
Hi = indexer query heads, N = rows of block_tables, T = tokens of one group of a pass (its decode
rows or its prefill chunk), C = max_blocks, K = top_blocks, Hq / Hkv / Dh = attention heads and head
dim. Each op picks the Triton kernel for CUDA tensors and the plain-torch reference otherwise; the
Triton kernels launch without programmatic dependent launch (they take no options).
"""

from __future__ import annotations

import torch

from . import naive


def write_index_keys(*, keys: torch.Tensor, key_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write each token's raw indexer key into its slot of the key cache.

    Args:
        keys: [T, D] (D contiguous). key_cache: [B, P, D].
        slot_mapping: [T] int64, flat slot = page * P + offset; -1 (padding) writes nothing.
    """
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
    """The compressed key of every block a token of the group completes (position % r == r - 1).

    Args:
        key_cache: [B, P, D], this pass's raw keys already written. block_cache: [B, (P - 1) // r + 1, D];
            block c's key goes to the page of its last token, index (last % P) // r.
        positions, slot_mapping, token_rows: [T] int (token_rows: each token's row of block_tables).
        block_tables: [N, max_pages] int32. norm_weight: [D], the zero-centred k_layernorm.
        eps, rotary_dim, theta: the norm's epsilon and the rotary embedding (at the block's first position).
    """
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
    """Each query's score of every complete block of its sequence.

    Args:
        q: [T, Hi, D], the normed, rotated indexer queries (D contiguous). block_cache: [B, _, D].
        positions, token_rows: [T] int. block_tables: [N, max_pages] int32.
        max_blocks: C, at least the largest (p + 1) // r of the group.

    Returns:
        scores: [T, C] float32 (float64 for float64 inputs on CPU): sum_h relu(q_h . K_c) / sqrt(D) for
        c < (p + 1) // r, -inf past it.
    """
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
    """The blocks each query attends to.

    Args:
        scores: [T, C] (index_scores). positions: [T] int. top_blocks: K.

    Returns:
        [T, K] int32, ascending, -1 past the last: every complete block while (p + 1) // r <= K, else
        the K of highest score. Equal scores at the cut: the CPU reference breaks them as torch.topk
        on the row's first (p + 1) // r scores (as transformers does), the Triton kernel by lowest index
        (-0.0 equal to 0.0).
    """
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
    """Each query's attention over its selected blocks' tokens and its incomplete block's tokens up
    to itself.

    Args:
        q: [T, Hq, Dh] (Dh contiguous). k_cache, v_cache: [B, P, Hkv, Dh]; q head h reads kv head
            h // (Hq // Hkv). positions, token_rows: [T] int. block_tables: [N, max_pages] int32.
        selected: [T, K] int32 (block_topk). scale: the softmax scale.

    Returns:
        o: [T, Hq, Dh] in q's dtype (float32 softmax).
    """
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
