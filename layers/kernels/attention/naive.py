"""Plain-torch paged attention: the reference and the CPU path.

The KV pool of one layer is [num_blocks, block_size, kv_heads, head_dim] for K and for V. A
sequence's block table row maps its positions to pages: position p lives in page
block_tables[n, p // block_size] at offset p % block_size. Queries are token-major and varlen.
"""

from __future__ import annotations

import torch

from ..precision import acc_dtype


def write_kv_cache(
    *,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key, value: [T, Hkv, D]; slot_mapping: [T] flat slot = page * block_size + offset; a slot
    of -1 (padding) writes nothing."""
    block_size = k_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    k_cache[slots // block_size, slots % block_size] = key[valid].to(k_cache.dtype)
    v_cache[slots // block_size, slots % block_size] = value[valid].to(v_cache.dtype)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` positions of one sequence: [length, Hkv, D]."""
    block_size = cache.shape[1]
    num_pages = (length + block_size - 1) // block_size
    pages = cache[block_table[:num_pages].long()]  # [P, block_size, Hkv, D]
    return pages.reshape(-1, *cache.shape[2:])[:length]


def paged_attention(
    *,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of new tokens over their sequence's cached pages (themselves included).

    q: [T, Hq, D]; cu_seqlens_q: [N + 1]; seq_lens: [N] tokens cached after this pass (the last
    q_len of them are the queries); block_tables: [N, max_pages]. Returns o: [T, Hq, D]."""
    return _attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, q.dtype)


def _attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, out_dtype) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    bounds = cu_seqlens_q.tolist()
    num_q_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    for n in range(len(bounds) - 1):
        start, end = bounds[n], bounds[n + 1]
        if end == start:
            continue
        seq_len = int(seq_lens[n])
        q_len = end - start
        acc = acc_dtype(q, k_cache)
        keys = gather_kv(k_cache, block_tables[n], seq_len).to(acc).repeat_interleave(group, dim=1)
        values = gather_kv(v_cache, block_tables[n], seq_len).to(acc).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].to(acc), keys) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        scores = scores.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        probs = scores.softmax(dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, values).to(out_dtype)
    return out


def paged_decode_attention(
    *,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    output_gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per sequence over all its cached positions. q: [N, Hq, D] -> [N, Hq, D].
    output_gate [N, Hq, D] (any strides): the result times sigmoid(output_gate), one rounding (the
    gated attention's output gate)."""
    cu = torch.arange(q.shape[0] + 1, device=q.device)
    if output_gate is None:
        return _attention(q, k_cache, v_cache, cu, seq_lens, block_tables, scale, q.dtype)
    acc = acc_dtype(q, k_cache)
    out = _attention(q, k_cache, v_cache, cu, seq_lens, block_tables, scale, acc)
    return (out * torch.sigmoid(output_gate.to(acc))).to(q.dtype)
