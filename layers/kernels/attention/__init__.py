"""Paged attention over a KV pool: the KV write, prefill over cached pages, decode.

The KV pool of one layer is [num_blocks, block_size, Hkv, D] for K and for V, in the model's dtype
or float8 e4m3 (kv_cache_dtype fp8: scale 1, stores saturate at +-448 and round to nearest even,
readers upcast to q's dtype in registers). A sequence's block
table row maps its positions to pages: position p lives in page block_tables[n, p // block_size] at
offset p % block_size. Queries are token-major and varlen. q head h reads kv head h // (Hq // Hkv).
"""

from __future__ import annotations

import torch

from . import naive
from .naive import is_fp8_cache, sequence_kv

__all__ = ["is_fp8_cache", "paged_attention", "paged_decode_attention", "sequence_kv", "write_kv_cache"]


def write_kv_cache(
    *,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    pdl: bool = True,
) -> None:
    """Write each token's key and value into its cache slot.

    Args:
        key, value: [T, Hkv, D] (D contiguous). k_cache, v_cache: [num_blocks, block_size, Hkv, D].
        slot_mapping: [T] int, flat slot = page * block_size + offset; -1 (padding) writes nothing.
        pdl: CUDA: launch under programmatic dependent launch (sm_90+).
    """
    if key.is_cuda:
        from .triton_attention import write_kv_cache as impl

        return impl(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping, pdl=pdl)
    return naive.write_kv_cache(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)


def paged_attention(
    *,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    own_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    output_gate: torch.Tensor | None = None,
    sdpa_backend: str = "flash",
) -> torch.Tensor:
    """Causal attention of a prefill chunk's tokens over their sequences' cached pages (themselves included).

    Args:
        q: [T, Hq, D] (D contiguous). k_cache, v_cache: [num_blocks, block_size, Hkv, D].
        cu_seqlens_q: [N + 1] int, where each sequence's queries start in q.
        seq_lens: [N] int32, tokens cached after this pass (the last q_len of them are the queries).
        block_tables: [N, max_pages] int32. scale: the softmax scale.
        own_kv: (k, v) [L, Hkv, D], when the chunk is one sequence's (N = 1): all L of its keys and
            values in order (the chunk's own when nothing is cached before it, else sequence_kv's
            copy out of the pages; its queries are the last T): causal attention over them with
            torch's SDPA (flash on CUDA) instead of reading the pages; the caller vouches for them.
        output_gate: [T, Hq, D] (D contiguous): the result times sigmoid(output_gate), one rounding
            (the SDPA path: its output's, then the gated one's).
        sdpa_backend: the SDPA path's backend on CUDA (naive.causal_sdpa: flash, or cudnn).

    Returns:
        o: [T, Hq, D] in q's dtype (float32 softmax). CUDA: one launch (two when few queries meet a
        long context: split-K and its merge), no host sync.
    """
    if own_kv is not None:
        out = naive.causal_sdpa(q=q, k=own_kv[0], v=own_kv[1], scale=scale, backend=sdpa_backend)
        if output_gate is None:
            return out
        if out.is_cuda:
            from .triton_gate import apply_output_gate

            return apply_output_gate(o=out, gate=output_gate)
        return naive.output_gated(out, output_gate)
    impl = naive.paged_attention
    if q.is_cuda:
        from .triton_attention import paged_attention as impl
    return impl(
        q=q, k_cache=k_cache, v_cache=v_cache, cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens,
        block_tables=block_tables, scale=scale, output_gate=output_gate,
    )  # fmt: skip


def paged_decode_attention(
    *,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    output_gate: torch.Tensor | None = None,
    pdl: bool = True,
    tokens_per_row: int = 1,
) -> torch.Tensor:
    """One query per sequence over all its cached positions (flash-decoding on CUDA); or, with
    tokens_per_row L > 1, L causal queries a sequence (a speculative verify's rows): query j of
    sequence n (q row n L + j) sees positions [0, seq_lens[n] - L + j].

    Args:
        q: [N L, Hq, D] (D contiguous). k_cache, v_cache: [num_blocks, block_size, Hkv, D].
        seq_lens: [N] int32, cached positions (the newest L hold this pass's keys and values).
        block_tables: [N, max_pages] int32. scale: the softmax scale.
        output_gate: [N L, Hq, D] (D contiguous): the result times sigmoid(output_gate), one rounding.
        pdl: CUDA: launch under programmatic dependent launch (sm_90+).

    Returns:
        o: [N L, Hq, D] in q's dtype. CUDA: no host sync (shapes alone choose the launch).
    """
    if tokens_per_row < 1 or q.shape[0] != seq_lens.shape[0] * tokens_per_row:
        raise ValueError(f"tokens_per_row: {tokens_per_row} does not split q's {q.shape[0]} rows over the sequences")
    if q.is_cuda:
        from .triton_decode import paged_decode_attention as impl

        return impl(
            q=q, k_cache=k_cache, v_cache=v_cache, seq_lens=seq_lens, block_tables=block_tables, scale=scale,
            output_gate=output_gate, pdl=pdl, tokens_per_row=tokens_per_row,
        )  # fmt: skip
    return naive.paged_decode_attention(
        q=q, k_cache=k_cache, v_cache=v_cache, seq_lens=seq_lens, block_tables=block_tables, scale=scale,
        output_gate=output_gate, tokens_per_row=tokens_per_row,
    )  # fmt: skip
