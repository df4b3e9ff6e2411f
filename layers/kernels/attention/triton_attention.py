"""Triton paged attention: the KV write and the causal varlen prefill over cached pages (the decode
kernels: triton_decode.py, which shares _attend_block).

Layouts and semantics as in naive.py. The q heads that share a kv head are packed into the rows of
one tile (row r = token r // group, head r % group), so each KV tile is read once per kv head and
feeds one tl.dot for all of them. head_dim may be any size: tiles are padded to a power of two and
masked. Scores are kept in the log2 domain (scale * log2(e) folded in) so the softmax uses exp2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..device import H200, SMEM_SCRATCH, DeviceInfo, device_info, tuned_for
from ..pdl import pdl_launch, pdl_wait

LOG2E = 1.4426950408889634


PREFILL_SEQ_BLOCK = 64  # sequences the prefill kernel scans per step to find its q block's owner


@triton.jit
def _write_kv_kernel(
    key, value, k_cache, v_cache, slot_mapping, s_kt, s_kh, s_vt, s_vh, s_kcb, s_kco, s_kch, s_vcb, s_vco, s_vch,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    # a slot of -1 is padding: an empty head range masks every lane, nothing is read or written
    mask = (h < tl.where(slot >= 0, NUM_HEADS, 0))[:, None] & (d < HEAD_DIM)[None, :]
    page = slot // PAGE
    off = slot % PAGE
    k = tl.load(key + t * s_kt + h[:, None] * s_kh + d[None, :], mask=mask)
    v = tl.load(value + t * s_vt + h[:, None] * s_vh + d[None, :], mask=mask)
    k_dst = k_cache + page * s_kcb + off * s_kco + h[:, None] * s_kch + d[None, :]
    v_dst = v_cache + page * s_vcb + off * s_vco + h[:, None] * s_vch + d[None, :]
    tl.store(k_dst, k.to(k_cache.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache.dtype.element_ty), mask=mask)


def write_kv_cache(*, key, value, k_cache, v_cache, slot_mapping, pdl=True) -> None:
    """attention.write_kv_cache. Grid (T,): one token's heads per program."""
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert key.stride(-1) == 1 and value.stride(-1) == 1, "key/value need a contiguous head dim"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "caches need a contiguous head dim"
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), NUM_HEADS=num_heads, HEAD_DIM=head_dim, PAGE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim), num_warps=4,
        **pdl_launch(key, pdl),
    )  # fmt: skip


@triton.jit
def _attend_block(
    acc, m_i, l_i, q, q_pos, kv_start, kv_end, k_base, v_base, bt_row, s_btp, s_kb, s_ko, s_vb, s_vo, d, qk_scale,
    PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over KV positions [kv_start, kv_start + BLOCK_N) read through the
    block table. MASK: apply the kv_end bound and the causal limit q_pos (else the tile is known full)."""
    pos = kv_start + tl.arange(0, BLOCK_N)
    d_ok = d < HEAD_DIM
    if MASK:
        ok = pos < kv_end
        page = tl.load(bt_row + (pos // PAGE) * s_btp, mask=ok, other=0).to(tl.int64)
        kv_mask = ok[:, None] & d_ok[None, :]
    else:
        page = tl.load(bt_row + (pos // PAGE) * s_btp).to(tl.int64)
        kv_mask = d_ok[None, :]
    off = pos % PAGE
    k = tl.load(k_base + (page * s_kb + off * s_ko)[:, None] + d[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k)) * qk_scale
    if MASK:
        s = tl.where(ok[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_base + (page * s_vb + off * s_vo)[:, None] + d[None, :], mask=kv_mask, other=0.0)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, m_new, l_i


# values that change from pass to pass: one compile serves them all (kernels/__init__.py)
@triton.jit(do_not_specialize=["cu_seqlens_q", "seq_lens", "block_tables", "num_seqs", "s_btn"])
def _prefill_kernel(
    q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, out, qk_scale, num_seqs, s_qt, s_qh, s_kb, s_ko, s_kh,
    s_vb, s_vo, s_vh, s_btn, s_btp, s_ot, s_oh, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SEQ: tl.constexpr,
):  # fmt: skip
    # the last q blocks attend to the most keys: launch them first to shorten the tail
    b = tl.num_programs(0) - 1 - tl.program_id(0)
    h = tl.program_id(1)
    # sequence n owns q blocks [cu[n] // BLOCK_Q + n, cu[n + 1] // BLOCK_Q + n + 1): found without a
    # host sync, BLOCK_SEQ sequences at a time (a fixed block: the sequence count compiles no variant)
    owners = 0
    for seq0 in range(0, num_seqs, BLOCK_SEQ):
        seqs = seq0 + tl.arange(0, BLOCK_SEQ)
        seq_ok = seqs < num_seqs
        first_block = tl.load(cu_seqlens_q + seqs, mask=seq_ok, other=0) // BLOCK_Q + seqs
        owners += tl.sum(tl.where(seq_ok & (first_block <= b), 1, 0), 0)
    n = owners - 1
    q_start = tl.load(cu_seqlens_q + n)
    q_len = tl.load(cu_seqlens_q + n + 1) - q_start
    tok0 = (b - (q_start // BLOCK_Q + n)) * BLOCK_Q
    if tok0 >= q_len:
        return
    seq_len = tl.load(seq_lens + n)
    ctx_len = seq_len - q_len

    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    tok = tok0 + r // GROUP
    head = h * GROUP + r % GROUP
    row_ok = (r < BLOCK_Q * GROUP) & (tok < q_len)
    q_mask = row_ok[:, None] & (d < HEAD_DIM)[None, :]
    q_rows = (q_start + tok).to(tl.int64) * s_qt + head * s_qh
    qt = tl.load(q + q_rows[:, None] + d[None, :], mask=q_mask, other=0.0).to(k_cache.dtype.element_ty)
    q_pos = ctx_len + tok

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = block_tables + n.to(tl.int64) * s_btn
    k_base = k_cache + h * s_kh
    v_base = v_cache + h * s_vh
    # keys up to the tile's first query position need no mask; the rest run the masked step
    full_end = (ctx_len + tok0 + 1) // BLOCK_N * BLOCK_N
    kv_end = ctx_len + tl.minimum(tok0 + BLOCK_Q, q_len)
    for kv_start in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, qt, q_pos, kv_start, kv_end, k_base, v_base, bt_row, s_btp, s_kb, s_ko, s_vb, s_vo, d,
            qk_scale, PAGE, HEAD_DIM, BLOCK_N, False,
        )  # fmt: skip
    for kv_start in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, qt, q_pos, kv_start, kv_end, k_base, v_base, bt_row, s_btp, s_kb, s_ko, s_vb, s_vo, d,
            qk_scale, PAGE, HEAD_DIM, BLOCK_N, True,
        )  # fmt: skip
    o = acc / l_i[:, None]
    o_rows = (q_start + tok).to(tl.int64) * s_ot + head * s_oh
    tl.store(out + o_rows[:, None] + d[None, :], o.to(out.dtype.element_ty), mask=q_mask)


# sm_90 tiles (q rows = tokens x group heads): 128 rows over two warpgroups, 32 keys a step at head
# dim 256 or 64 at 128, compile without spills; measured on the H200 (head dim -> tiles)
PREFILL_TILES = {
    H200: {128: dict(block_n=64, num_warps=8, num_stages=3), 256: dict(block_n=32, num_warps=8, num_stages=2)}
}


def _prefill_smem(block_m: int, block_n: int, block_d: int, stages: int, elem: int) -> int:
    """Shared memory of the prefill kernel: q, a K and a V tile per stage, the scores."""
    return elem * (block_m * block_d + stages * 2 * block_n * block_d + block_m * block_n) + SMEM_SCRATCH


def _prefill_config(head_dim: int, group: int, elem: int, info: DeviceInfo) -> dict:
    """Tile rows (q tokens x group heads), KV tile, warps, stages: the measured table, else its
    tiles shrunk (stages, then keys, then rows) until they fit the device's shared memory; small
    fixed tiles for the interpreter."""
    if info.is_interpreter:
        return dict(block_m=max(16, triton.next_power_of_2(group)), block_n=16, num_warps=4, num_stages=1)
    block_m = max(128, triton.next_power_of_2(group))
    tuned = tuned_for(PREFILL_TILES, info)
    if tuned is not None:
        return dict(block_m=block_m, **tuned[128 if head_dim <= 128 else 256])
    cfg = dict(block_m=block_m, **PREFILL_TILES[H200][128 if head_dim <= 128 else 256])
    block_d, min_m = max(16, triton.next_power_of_2(head_dim)), max(16, triton.next_power_of_2(group))
    while _prefill_smem(cfg["block_m"], cfg["block_n"], block_d, cfg["num_stages"], elem) > info.smem_per_block:
        if cfg["num_stages"] > 1:
            cfg["num_stages"] -= 1
        elif cfg["block_n"] > 16:
            cfg["block_n"] //= 2
        elif cfg["block_m"] > min_m:
            cfg["block_m"] //= 2
            cfg["num_warps"] = 4
        else:
            break
    return cfg


def paged_attention(*, q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, config=None):
    """attention.paged_attention. Grid (T // BLOCK_Q + N, Hkv): a program takes BLOCK_Q tokens x all
    q heads of one kv head; the bound needs no host sync and programs past their sequence's end
    return at once. `config` overrides the tiles (block_m, block_n, num_warps, num_stages)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    num_seqs = cu_seqlens_q.shape[0] - 1
    assert num_q_heads % num_kv_heads == 0, "q heads must be a multiple of kv heads"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "contiguous head dim"
    group = num_q_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    cfg = config or _prefill_config(head_dim, group, k_cache.element_size(), device_info(q.device))
    block_q = cfg["block_m"] // group
    assert block_q >= 1, "block_m must hold at least one token's heads"
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, out, scale * LOG2E, num_seqs, q.stride(0),
        q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), block_tables.stride(0), block_tables.stride(1), out.stride(0), out.stride(1), GROUP=group,
        HEAD_DIM=head_dim, PAGE=k_cache.shape[1], BLOCK_M=cfg["block_m"], BLOCK_Q=block_q, BLOCK_N=cfg["block_n"],
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_SEQ=PREFILL_SEQ_BLOCK, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )  # fmt: skip
    return out
