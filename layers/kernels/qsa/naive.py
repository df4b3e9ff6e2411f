"""Plain-torch QSA (Qwen4-Exp sparse attention): the reference and the CPU path.

Layouts (one attention layer; bs = block_size, the KV page size; r = compress_ratio):
  key_cache   [num_blocks, bs, D]: the indexer's raw key of every token, paged like the KV cache;
  block_cache [num_blocks, (bs - 1) // r + 1, D]: the compressed key of block c (tokens c*r .. c*r+r-1)
              sits in the page of the block's LAST token e = c*r + r - 1, at index (e % bs) // r. A
              page then holds only keys of tokens up to its own last one: a full page never changes
              again, and pages shared by prefix caching stay valid.
The compressed key of a block: mean of its raw keys (float32, rounded to the cache dtype), the
zero-centred RMSNorm k_norm, and rotary embedding at the block's first position.

A query at position p sees nc = (p + 1) // r complete blocks; with nc > top_blocks it attends to
the top_blocks blocks of highest score sum_h relu(q_h . K_c) / sqrt(D), else to all of them, and
always to its tail, the tokens nc*r .. p of the incomplete block (transformers' Qwen4ExpTextQSAIndexer).

Token-major arguments cover one group of a pass (its decode rows or its prefill chunk): positions [T],
token_rows [T] (each token's row of block_tables [N, max_pages]).
"""

from __future__ import annotations

import math

import torch

from ..precision import acc_dtype
from ..rotary.naive import apply_rotary, rotary_cos_sin


def block_key_slots(c: torch.Tensor, rows: torch.Tensor, block_tables: torch.Tensor, ratio: int, block_size: int):
    """(page, index) in block_cache of block c of each row (c, rows broadcast together)."""
    last = (c + 1) * ratio - 1
    page = block_tables[rows, last // block_size].long()
    return page, (last % block_size) // ratio


def write_index_keys(*, keys: torch.Tensor, key_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """keys [T, D] -> key_cache at each token's flat slot (page * bs + offset); slot -1 writes nothing."""
    block_size = key_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    key_cache[slots // block_size, slots % block_size] = keys[valid].to(key_cache.dtype)


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
    """For every token that completes a block (position % r == r - 1, slot >= 0), the block's
    compressed key from the raw keys in key_cache (this pass's included: write them first)."""
    r, block_size = compress_ratio, key_cache.shape[1]
    done = ((positions + 1) % r == 0) & (slot_mapping >= 0)
    if not bool(done.any()):
        return
    pos, rows = positions[done].long(), token_rows[done].long()
    c = pos // r
    token = c[:, None] * r + torch.arange(r, device=pos.device)  # [M, r]
    pages = block_tables[rows[:, None], token // block_size].long()
    raw = key_cache[pages, token % block_size]  # [M, r, D]
    acc = acc_dtype(raw)
    pooled = raw.to(acc).mean(dim=1).to(key_cache.dtype)
    normed = pooled.to(acc) * torch.rsqrt(pooled.to(acc).pow(2).mean(-1, keepdim=True) + eps)
    normed = (normed * (1.0 + norm_weight.to(acc))).to(key_cache.dtype)
    cos, sin = rotary_cos_sin(c * r, rotary_dim, theta)
    roped = apply_rotary(normed[:, None, :], cos, sin)[:, 0]
    page, index = block_key_slots(c, rows, block_tables, r, block_size)
    block_cache[page, index] = roped.to(block_cache.dtype)


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
    """q [T, Hi, D] (normed, rotated indexer queries) -> scores [T, max_blocks] float32 (float64 for
    float64 inputs): sum_h relu(q_h . K_c) / sqrt(D) for c < (p + 1) // r, -inf past it.
    max_blocks: at least the largest (p + 1) // r of the group."""
    num_tokens, _, head_dim = q.shape
    acc = acc_dtype(q, block_cache)
    out = torch.full((num_tokens, max_blocks), float("-inf"), dtype=acc, device=q.device)
    if num_tokens == 0 or max_blocks == 0:
        return out
    c = torch.arange(max_blocks, device=q.device)
    nc = (positions.long() + 1) // compress_ratio
    valid = c[None, :] < nc[:, None]
    rows = token_rows.long()[:, None].expand(-1, max_blocks)
    cc = torch.where(valid, c[None, :], 0)
    page, index = block_key_slots(cc, rows, block_tables, compress_ratio, block_size)
    keys = block_cache[page, index].to(acc)  # [T, C, D]
    dots = torch.einsum("thd,tcd->tch", q.to(acc), keys)
    scores = torch.relu(dots).sum(-1) / math.sqrt(head_dim)
    return torch.where(valid, scores, out)


def block_topk(*, scores: torch.Tensor, positions: torch.Tensor, compress_ratio: int, top_blocks: int) -> torch.Tensor:
    """The blocks each query attends to: [T, top_blocks] int32, ascending, -1 past the last. All
    nc = (p + 1) // r complete blocks when nc <= top_blocks, else the top_blocks of highest score.
    Ties are broken as torch.topk on the row's first nc scores breaks them (what transformers calls);
    the Triton kernel takes the lowest index."""
    num_tokens = scores.shape[0]
    out = torch.full((num_tokens, top_blocks), -1, dtype=torch.int32, device=scores.device)
    for t, nc in enumerate(((positions.long() + 1) // compress_ratio).tolist()):
        if nc <= top_blocks:
            out[t, :nc] = torch.arange(nc, dtype=torch.int32, device=scores.device)
        else:
            out[t] = scores[t, :nc].topk(top_blocks, dim=0).indices.sort().values.to(torch.int32)
    return out


def selected_positions(
    selected: torch.Tensor, positions: torch.Tensor, compress_ratio: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Key positions each query attends to: the selected blocks' tokens, then its tail. Returns
    (positions [T, top_blocks * r + r - 1] int64, valid mask of the same shape)."""
    r = compress_ratio
    sel = selected.long()
    within = torch.arange(r, device=sel.device)
    block_pos = (sel[:, :, None] * r + within).flatten(1)
    block_ok = (sel[:, :, None] >= 0).expand(-1, -1, r).flatten(1)
    pos = positions.long()
    tail_start = ((pos + 1) // r) * r
    tail_pos = tail_start[:, None] + torch.arange(r - 1, device=sel.device)
    tail_ok = tail_pos <= pos[:, None]
    return torch.cat((block_pos, tail_pos), 1), torch.cat((block_ok, tail_ok), 1)


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
    """Each query over its selected blocks and tail: q [T, Hq, Dh]; k_cache, v_cache [num_blocks, bs,
    Hkv, Dh] (q's dtype, or float8 e4m3 pages: widened as read); selected [T, top_blocks] (block_topk).
    Returns [T, Hq, Dh] in q's dtype."""
    num_tokens, num_q_heads, _ = q.shape
    if num_tokens == 0:
        return torch.empty_like(q)
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    kv_pos, ok = selected_positions(selected, positions, compress_ratio)
    kv_pos = torch.where(ok, kv_pos, 0)
    pages = block_tables[token_rows.long()[:, None], kv_pos // block_size].long()
    acc = acc_dtype(q, k_cache)
    group = num_q_heads // num_kv_heads
    keys = k_cache[pages, kv_pos % block_size].to(acc)  # [T, L, Hkv, D]
    values = v_cache[pages, kv_pos % block_size].to(acc)
    qg = q.to(acc).unflatten(1, (num_kv_heads, group))  # q head h reads kv head h // group
    s = torch.einsum("tkgd,tlkd->tkgl", qg, keys) * scale
    s = s.masked_fill(~ok[:, None, None, :], float("-inf"))
    return torch.einsum("tkgl,tlkd->tkgd", s.softmax(-1), values).flatten(1, 2).to(q.dtype)
