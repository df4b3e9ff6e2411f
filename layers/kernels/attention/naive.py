"""Plain-torch paged attention: the reference and the CPU path (layouts: attention/__init__.py)."""

from __future__ import annotations

import logging

import torch

from ..fp8.naive import FP8, FP8_MAX
from ..precision import acc_dtype

log = logging.getLogger(__name__)


def is_fp8_cache(cache: torch.Tensor) -> bool:
    """Whether a KV cache holds float8 e4m3 (kv_cache_dtype fp8)."""
    return cache.dtype == FP8


def to_cache(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """x in the cache's dtype: an FP8 (e4m3, scale 1) cache saturates at +-448 (the largest finite
    value) before the round to nearest even."""
    if is_fp8_cache(cache):
        x = x.float().clamp(-FP8_MAX, FP8_MAX)
    return x.to(cache.dtype)


def write_kv_cache(*, key, value, k_cache, v_cache, slot_mapping) -> None:
    """The reference of attention.write_kv_cache."""
    block_size = k_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    k_cache[slots // block_size, slots % block_size] = to_cache(key[valid], k_cache)
    v_cache[slots // block_size, slots % block_size] = to_cache(value[valid], v_cache)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` positions of one sequence: [length, Hkv, D]."""
    block_size = cache.shape[1]
    num_pages = (length + block_size - 1) // block_size
    pages = cache[block_table[:num_pages].long()]  # [P, block_size, Hkv, D]
    return pages.reshape(-1, *cache.shape[2:])[:length]


def paged_attention(
    *, q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, output_gate=None
) -> torch.Tensor:  # fmt: skip
    """The reference of attention.paged_attention."""
    if output_gate is None:
        return _attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, q.dtype)
    return _gated(_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, acc_dtype(q, k_cache)),
                  output_gate, q.dtype)  # fmt: skip


def output_gated(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The reference of triton_gate.apply_output_gate: o * sigmoid(gate) in float32, one rounding to o's dtype."""
    return _gated(o.float(), gate, o.dtype)


def _gated(out: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """out * sigmoid(gate) in out's (accumulation) dtype, then the one rounding to `dtype`."""
    return (out * torch.sigmoid(gate.to(out.dtype))).to(dtype)


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
    *, q, k_cache, v_cache, seq_lens, block_tables, scale, output_gate=None, tokens_per_row=1
) -> torch.Tensor:
    """The reference of attention.paged_decode_attention: each q row its own one-query sequence."""
    if tokens_per_row > 1:  # row j of each sequence sees its context and the pass's first j + 1 tokens
        rows = tokens_per_row
        later = (rows - 1 - torch.arange(rows, device=seq_lens.device)).repeat(seq_lens.shape[0])
        seq_lens = seq_lens.repeat_interleave(rows) - later.to(seq_lens.dtype)
        block_tables = block_tables.repeat_interleave(rows, dim=0)
    cu = torch.arange(q.shape[0] + 1, device=q.device)
    if output_gate is None:
        return _attention(q, k_cache, v_cache, cu, seq_lens, block_tables, scale, q.dtype)
    out = _attention(q, k_cache, v_cache, cu, seq_lens, block_tables, scale, acc_dtype(q, k_cache))
    return _gated(out, output_gate, q.dtype)


def causal_sdpa(
    *, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, backend: str = "flash"
) -> torch.Tensor:  # fmt: skip
    """Causal attention of one sequence's last T queries q [T, Hq, D] over its keys and values k, v
    [L, Hkv, D] (L >= T: query i sees keys up to L - T + i) by torch's scaled_dot_product_attention
    with enable_gqa (the kv heads shared by their q groups in the kernel, not copied: H200, 8k
    tokens, 16 / 2 heads of 256: 0.90 ms against 1.03 expanded; bf16 or fp16, D up to 256; the
    lower-right causal bias when L > T). backend "cudnn": cuDNN's attention on CUDA when L == T
    (flash where it declines the shapes). Returns [T, Hq, D] in q's dtype."""
    from torch.nn.attention.bias import causal_lower_right

    num_q, num_kv = q.shape[0], k.shape[0]
    qh = q.transpose(0, 1).unsqueeze(0)
    kh = k.transpose(0, 1).unsqueeze(0)
    vh = v.transpose(0, 1).unsqueeze(0)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    out = None
    if num_kv == num_q and backend == "cudnn" and q.is_cuda:
        out = _cudnn_causal(qh, kh, vh, scale)
    if out is None and num_kv == num_q:
        out = sdpa(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    elif out is None:
        out = sdpa(qh, kh, vh, attn_mask=causal_lower_right(num_q, num_kv), scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1).contiguous()


_CUDNN_DECLINED: set[tuple] = set()


def _cudnn_causal(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, scale: float) -> torch.Tensor | None:
    """Causal SDPA on cuDNN's backend alone; None (logged once a shape) where it declines these inputs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    key = (tuple(qh.shape), qh.dtype)
    if key in _CUDNN_DECLINED:
        return None
    try:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(
                qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True
            )
    except RuntimeError as e:
        _CUDNN_DECLINED.add(key)
        log.warning("cuDNN attention declined %s (%s): flash serves these chunks", key, str(e)[:120])
        return None


def sequence_kv(
    *, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's first `length` keys and values out of the pages [num_blocks, block_size, Hkv,
    D] its block_table row [pages] names: (k, v) [length, Hkv, D], contiguous copies."""
    block_size = k_cache.shape[1]
    pages = block_table[: -(-length // block_size)].long()

    def gather(cache: torch.Tensor) -> torch.Tensor:
        return cache.index_select(0, pages).flatten(0, 1)[:length]

    return gather(k_cache), gather(v_cache)
