"""Triton paged attention: KV write, causal varlen prefill over cached pages, split-K decode.

Layouts and semantics as in naive.py. The q heads that share a kv head are packed into the rows of
one tile (row r = token r // group, head r % group), so each KV tile is read once per kv head and
feeds one tl.dot for all of them. head_dim may be any size: tiles are padded to a power of two and
masked. Scores are kept in the log2 domain (scale * log2(e) folded in) so the softmax uses exp2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..device import num_sms, ticket_counters
from ..pdl import pdl_launch, pdl_wait

LOG2E = 1.4426950408889634


PREFILL_SEQ_BLOCK = 64  # sequences the prefill kernel scans per step to find its q block's owner


@triton.jit
def _write_kv_kernel(
    key,
    value,
    k_cache,
    v_cache,
    slot_mapping,
    s_kt,
    s_kh,
    s_vt,
    s_vh,
    s_kcb,
    s_kco,
    s_kch,
    s_vcb,
    s_vco,
    s_vch,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
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


def write_kv_cache(
    *,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key, value: [T, Hkv, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D]; slot_mapping: [T]
    flat slot = page * block_size + offset, -1 writes nothing. Grid (T,): one token's heads per program."""
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert key.stride(-1) == 1 and value.stride(-1) == 1, "key/value need a contiguous head dim"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "caches need a contiguous head dim"
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        PAGE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4,
        **pdl_launch(key),
    )


@triton.jit
def _attend_block(
    acc,
    m_i,
    l_i,
    q,
    q_pos,
    kv_start,
    kv_end,
    k_base,
    v_base,
    bt_row,
    s_btp,
    s_kb,
    s_ko,
    s_vb,
    s_vo,
    d,
    qk_scale,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK: tl.constexpr,
):
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
    q,
    k_cache,
    v_cache,
    cu_seqlens_q,
    seq_lens,
    block_tables,
    out,
    qk_scale,
    num_seqs,
    s_qt,
    s_qh,
    s_kb,
    s_ko,
    s_kh,
    s_vb,
    s_vo,
    s_vh,
    s_btn,
    s_btp,
    s_ot,
    s_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SEQ: tl.constexpr,
):
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


def _prefill_config(head_dim: int, group: int, on_gpu: bool) -> dict:
    """Tile rows (q tokens x group heads), KV tile, warps, stages. On sm_90, 128 rows over two
    warpgroups with 32 (head dim 256) or 64 keys per step compile without spills; small fixed tiles
    for the interpreter."""
    if not on_gpu:
        return dict(block_m=max(16, triton.next_power_of_2(group)), block_n=16, num_warps=4, num_stages=1)
    block_m = max(128, triton.next_power_of_2(group))
    if head_dim > 128:
        return dict(block_m=block_m, block_n=32, num_warps=8, num_stages=2)
    return dict(block_m=block_m, block_n=64, num_warps=8, num_stages=3)


def paged_attention(
    *,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    config: dict | None = None,
) -> torch.Tensor:
    """Causal attention of new tokens over their sequence's cached pages (themselves included).

    q: [T, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D]; cu_seqlens_q: [N + 1];
    seq_lens: [N] tokens cached after this pass (the last q_len of them are the queries);
    block_tables: [N, max_pages]. Returns o: [T, Hq, D].

    Grid (T // BLOCK_Q + N, Hkv): a program takes BLOCK_Q tokens x all q heads of one kv head; the
    bound needs no host sync and programs past their sequence's end return at once. `config`
    overrides the tile choice (block_m, block_n, num_warps, num_stages) for tuning sweeps."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    num_seqs = cu_seqlens_q.shape[0] - 1
    assert num_q_heads % num_kv_heads == 0, "q heads must be a multiple of kv heads"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "contiguous head dim"
    group = num_q_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    cfg = config or _prefill_config(head_dim, group, q.is_cuda)
    block_q = cfg["block_m"] // group
    assert block_q >= 1, "block_m must hold at least one token's heads"
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        cu_seqlens_q,
        seq_lens,
        block_tables,
        out,
        scale * LOG2E,
        num_seqs,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        block_tables.stride(1),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        PAGE=k_cache.shape[1],
        BLOCK_M=cfg["block_m"],
        BLOCK_Q=block_q,
        BLOCK_N=cfg["block_n"],
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SEQ=PREFILL_SEQ_BLOCK,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return out


@triton.jit
def _split_bounds(seq_len, split, num_splits, BLOCK_N: tl.constexpr):
    """Each sequence cuts its own context into num_splits spans of whole KV tiles (short ones too)."""
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    return start, tl.minimum(start + split_len, seq_len)


@triton.jit
def _num_spans(seq_len, num_splits, BLOCK_N: tl.constexpr):
    """How many of a sequence's num_splits spans are not empty (the first ones)."""
    return tl.cdiv(seq_len, tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N)


@triton.jit
def _merge_spans(
    part_o,
    part_lse,
    out,
    gate,
    n,
    head,
    h_ok,
    row0,
    cnt,
    s_on,
    s_oh,
    s_gn,
    s_gh,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    CHUNK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_GATE: tl.constexpr,
    GATE_LOADED: tl.constexpr = False,
):
    """Merge the cnt span partials of the q heads `head` ([BLOCK_H], h_ok: real heads; partial rows
    row0 + span) by their log2-sum-exp, apply the output gate, store. The reduce kernel calls it
    with one head, the single-launch decode with a kv head's GROUP heads: the same operations per
    head, so both give the same bits under the interpreter. .cg: other SMs wrote the partials.
    GATE_LOADED: `gate` is the [BLOCK_H, BLOCK_D] gate tile itself, loaded earlier by the caller."""
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    spans = tl.arange(0, BLOCK_S)
    lse_ok = h_ok[:, None] & (spans < cnt)[None, :]
    lse = tl.load(part_lse + row0[:, None] + spans[None, :], mask=lse_ok, other=float("-inf"), cache_modifier=".cg")
    m = tl.where(h_ok, tl.max(lse, 1), 0.0)  # padding heads: no -inf - -inf
    acc = tl.zeros([head.shape[0], BLOCK_D], tl.float32)
    denom = tl.zeros([head.shape[0], CHUNK_S], tl.float32)
    # the partial outputs are read CHUNK_S spans at a time to bound registers
    for s0 in range(0, cnt, CHUNK_S):
        sc = s0 + tl.arange(0, CHUNK_S)
        ok = h_ok[:, None] & (sc < cnt)[None, :]
        rows = row0[:, None] + sc[None, :]
        lse_c = tl.load(part_lse + rows, mask=ok, other=float("-inf"), cache_modifier=".cg")
        w = tl.where(ok, tl.exp2(lse_c - m[:, None]), 0.0)
        o_ptr = part_o + (rows * HEAD_DIM)[:, :, None] + d[None, None, :]
        o = tl.load(o_ptr, mask=ok[:, :, None] & d_ok[None, None, :], other=0.0, cache_modifier=".cg")
        acc += tl.sum(w[:, :, None] * o, 1)
        denom += w
    o = acc / tl.where(h_ok, tl.sum(denom, 1), 1.0)[:, None]
    mask = h_ok[:, None] & d_ok[None, :]
    if HAS_GATE:  # the gated attention's output gate, before the one rounding
        if GATE_LOADED:
            g = gate
        else:
            g = tl.load(gate + n * s_gn + head[:, None] * s_gh + d[None, :], mask=mask)
        o *= tl.sigmoid(g.to(tl.float32))
    tl.store(out + n * s_on + head[:, None] * s_oh + d[None, :], o.to(out.dtype.element_ty), mask=mask)


# values that change from pass to pass: one compile serves them all (kernels/__init__.py)
@triton.jit(do_not_specialize=["num_splits", "seq_lens", "block_tables", "s_btn"])
def _decode_kernel(
    q,
    k_cache,
    v_cache,
    seq_lens,
    block_tables,
    out,
    part_o,
    part_lse,
    tickets,
    qk_scale,
    s_qn,
    s_qh,
    s_kb,
    s_ko,
    s_kh,
    s_vb,
    s_vo,
    s_vh,
    s_btn,
    s_btp,
    s_on,
    s_oh,
    num_splits,
    gate,
    s_gn,
    s_gh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_GATE: tl.constexpr,
    FUSED: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_S: tl.constexpr,
    CHUNK_S: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    n = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    # read before pdl_wait: only the previous kernel (rope) can still run (PDL chain), writing q, K/V[seq_len - 1]
    seq_len = tl.load(seq_lens + n)
    start, end = _split_bounds(seq_len, split, num_splits, BLOCK_N)
    if start >= end:
        pdl_wait(USE_PDL)
        return
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    head = h * GROUP + g
    d_ok = d < HEAD_DIM
    mask = (g < GROUP)[:, None] & d_ok[None, :]
    bt_row = block_tables + n.to(tl.int64) * s_btn
    k_base = k_cache + h * s_kh
    v_base = v_cache + h * s_vh
    # the cached positions of this span, the new token's excluded (it comes last, after the wait)
    ctx_end = tl.minimum(end, seq_len - 1)
    # the first tile's K and V as one [2 x BLOCK_N, D] load (rows: K, then V): separate loads had
    # the V loads issue only after the K tile had arrived (its move to shared memory comes first)
    r = tl.arange(0, 2 * BLOCK_N)
    pos_r = start + r % BLOCK_N
    ok_r = pos_r < ctx_end
    page_r = tl.load(bt_row + (pos_r // PAGE) * s_btp, mask=ok_r, other=0).to(tl.int64)
    off_r = pos_r % PAGE
    row_k = k_base + page_r * s_kb + off_r * s_ko
    row_v = v_base + page_r * s_vb + off_r * s_vo
    rows = tl.where(r < BLOCK_N, row_k, row_v)
    kv0 = tl.load(rows[:, None] + d[None, :], mask=ok_r[:, None] & d_ok[None, :], other=0.0)
    k0, v0 = tl.split(tl.permute(tl.reshape(kv0, [2, BLOCK_N, BLOCK_D]), [1, 2, 0]))
    pos0 = start + tl.arange(0, BLOCK_N)
    ok0 = pos0 < ctx_end
    new_pos = seq_len - 1
    has_new = end == seq_len  # the last span: it holds the new token
    new_page = tl.load(bt_row + (new_pos // PAGE) * s_btp, mask=has_new, other=0).to(tl.int64)
    new_off = new_page * s_kb + (new_pos % PAGE) * s_ko
    new_v_off = new_page * s_vb + (new_pos % PAGE) * s_vo

    pdl_wait(USE_PDL)
    qt = tl.load(q + n * s_qn + head[:, None] * s_qh + d[None, :], mask=mask, other=0.0)
    qt = qt.to(k_cache.dtype.element_ty)
    new_ok = d < tl.where(has_new, HEAD_DIM, 0)  # other spans: an empty range masks every lane
    k_new = tl.load(k_base + new_off + d, mask=new_ok, other=0.0)
    v_new = tl.load(v_base + new_v_off + d, mask=new_ok, other=0.0)
    # every key of the sequence is visible to its one query
    q_pos = tl.full([BLOCK_G], 0, tl.int32) + seq_len

    # a finite start: the first tile may be all masked (a span of only the new token), and
    # exp2(-inf - -inf) would be NaN; with any key present the result is the same as from -inf
    m_i = tl.full([BLOCK_G], -1e30, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    # the first tile, loaded before the wait
    s = tl.dot(qt, tl.trans(k0)) * qk_scale
    s = tl.where(ok0[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v0.dtype), v0, acc * alpha[:, None])
    m_i = m_new
    # the span's other tiles
    full_end = start + (ctx_end - start) // BLOCK_N * BLOCK_N
    for kv_start in range(start + BLOCK_N, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, qt, q_pos, kv_start, ctx_end, k_base, v_base, bt_row, s_btp, s_kb, s_ko, s_vb, s_vo, d,
            qk_scale, PAGE, HEAD_DIM, BLOCK_N, False,
        )  # fmt: skip
    for kv_start in range(tl.maximum(full_end, start + BLOCK_N), ctx_end, BLOCK_N):
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, qt, q_pos, kv_start, ctx_end, k_base, v_base, bt_row, s_btp, s_kb, s_ko, s_vb, s_vo, d,
            qk_scale, PAGE, HEAD_DIM, BLOCK_N, True,
        )  # fmt: skip
    # the new token (last span only; elsewhere p = 0 and alpha = 1 leave acc and l_i as they are)
    s_new = tl.sum(qt.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * qk_scale
    s_new = tl.where(has_new, s_new, float("-inf"))
    m_new = tl.maximum(m_i, s_new)
    p_new = tl.exp2(s_new - m_new)
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + p_new
    acc = acc * alpha[:, None] + p_new[:, None] * v_new.to(tl.float32)[None, :]
    m_i = m_new

    o = acc / l_i[:, None]
    if num_splits == 1:
        if HAS_GATE:  # the gated attention's output gate, before the one rounding
            o *= tl.sigmoid(tl.load(gate + n * s_gn + head[:, None] * s_gh + d[None, :], mask=mask).to(tl.float32))
        tl.store(out + n * s_on + head[:, None] * s_oh + d[None, :], o.to(out.dtype.element_ty), mask=mask)
    else:
        # partials: [N, Hq, num_splits, HEAD_DIM] outputs and [N, Hq, num_splits] log2-sum-exp
        row = (n * tl.num_programs(1) * GROUP + head) * num_splits + split
        tl.store(part_o + row[:, None] * HEAD_DIM + d[None, :], o, mask=mask)
        tl.store(part_lse + row, m_i + tl.log2(l_i), mask=g < GROUP)
        if FUSED:
            # The last of the (sequence, kv head)'s spans to get here (a ticket) merges them all, as
            # the reduce kernel would. The barrier orders every thread's partial stores before the
            # ticket's release; the ticket's acquire orders the last program's reads after every
            # release (CUTLASS's serial split-K semaphore; layers/kernels/gdn/decode.py).
            tl.debug_barrier()
            cnt = _num_spans(seq_len, num_splits, BLOCK_N)
            p_ticket = tickets + n * tl.num_programs(1) + h
            if tl.atomic_add(p_ticket, 1, sem="acq_rel", scope="gpu") == cnt - 1:
                tl.store(p_ticket, 0)  # for the next launch, which runs after this grid has completed
                hh = tl.arange(0, BLOCK_H)
                heads = h * GROUP + hh
                row0 = (n * tl.num_programs(1) * GROUP + heads) * num_splits
                _merge_spans(
                    part_o, part_lse, out, gate, n, heads, hh < GROUP, row0, cnt, s_on, s_oh, s_gn, s_gh,
                    HEAD_DIM, BLOCK_S, CHUNK_S, BLOCK_D, HAS_GATE,
                )  # fmt: skip


# values that change from pass to pass: one compile serves them all (kernels/__init__.py)
@triton.jit(do_not_specialize=["num_splits", "seq_lens"])
def _decode_reduce_kernel(
    part_o,
    part_lse,
    seq_lens,
    out,
    s_on,
    s_oh,
    num_splits,
    gate,
    s_gn,
    s_gh,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    CHUNK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_GATE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    n = tl.program_id(0)
    head = tl.program_id(1) + tl.zeros([1], tl.int32)
    # before the wait, one round trip each off the chain: seq_lens is no kernel's output in the
    # pass, and the gate is the input projection's (completed before the decode kernel started)
    seq_len = tl.load(seq_lens + n)
    row0 = (n * tl.num_programs(1) + head) * num_splits
    cnt = _num_spans(seq_len, num_splits, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    gate_tile = gate
    if HAS_GATE:
        gate_tile = tl.load(gate + n * s_gn + head[:, None] * s_gh + d[None, :], mask=(d < HEAD_DIM)[None, :])
    pdl_wait(USE_PDL)
    _merge_spans(
        part_o, part_lse, out, gate_tile, n, head, head >= 0, row0, cnt, s_on, s_oh, s_gn, s_gh,
        HEAD_DIM, BLOCK_S, CHUNK_S, BLOCK_D, HAS_GATE, GATE_LOADED=HAS_GATE,
    )  # fmt: skip


# the most splits _decode_config picks; the split count is a run-time argument of both decode
# kernels (it follows the batch's decode rows, and a compile-time constant would compile one
# variant per value in the middle of serving)
MAX_SPLITS = 64
# Decode batches of at most this many sequences merge their spans in the decode kernel (the last
# span of each (sequence, kv head) to finish, by a ticket) instead of a second, reduce kernel. None
# do by default: measured on the H200 (CUDA graphs, PDL, 512 tokens of context, in place in the
# batch-1 step at 4a4eb2d) the single launch took 16.8 us a layer against 5.3 + 6.5 for decode +
# reduce, and 22.9 against 13.9 + 3.6 at batch 16; back to back (`bench.kernels_attention
# --sweep-path`) 10.8 against 9.1 us at B = 1, even at 16, 0.92-0.99x from 24 up: the merge is a
# serial chain in one program per (sequence, kv head) over 128 KB of partials, after an atomic
# round trip, which costs more than the reduce launch under PDL. Kept selectable (`path="fused"`).
FUSED_MAX_SEQS = 0
# and the single launch caps the spans at 16 (128 KB merged by one program at head dim 256, ~1 us
# of one SM's L2 bandwidth); at 512 tokens of context 16 spans of 32 tokens are what 64 give too
FUSED_MAX_SPLITS = 16
# partial elements per merge chunk, [BLOCK_H, chunk, BLOCK_D] float32 (both paths merge the same
# chunks: the same bits): 8 spans a chunk at GROUP 8, D 256, 128 registers a thread at 4 warps;
# sm_90 (Triton 3.6): 206 registers, no spills (twice as many spills)
MERGE_ELEMS = 16384


def _decode_config(
    *, num_seqs: int, num_kv_heads: int, max_context: int, head_dim: int, device: torch.device, fused: bool = False
) -> dict:
    """KV tile, splits, warps, stages. On the GPU: 32-token K+V tiles at head dim 256 in a 5-stage
    pipeline, and enough splits for about two programs per SM (at most FUSED_MAX_SPLITS when the
    spans merge in the decode kernel)."""
    if device.type != "cuda":
        return dict(block_n=16, num_splits=max(1, min(4, max_context // 16)), num_warps=4, num_stages=1)
    block_n = max(16, min(64, 8192 // max(16, triton.next_power_of_2(head_dim))))
    max_splits = max(1, min(FUSED_MAX_SPLITS if fused else MAX_SPLITS, max_context // (4 * block_n)))
    # about two programs per SM: the H200 sweep at 64 x 4096 (D=256) peaked there (89% of copy
    # bandwidth at 2 splits x 32-token tiles; 62% at the earlier 5 programs per SM x 16-token tiles)
    num_splits = max(1, min(max_splits, round(2 * num_sms(device) / (num_seqs * num_kv_heads))))
    if num_splits == 1:  # enough sequences to fill the GPU: smaller tiles (256 x 4096: ~100% at 16, 84% at 32)
        block_n = max(16, block_n // 2)
    return dict(block_n=block_n, num_splits=num_splits, num_warps=4, num_stages=5)


# the single-launch decode's counters, one per (sequence, kv head) (kernels/device.py)
TICKETS = "paged_decode_attention"


def paged_decode_attention(
    *,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    output_gate: torch.Tensor | None = None,
    config: dict | None = None,
    path: str | None = None,
) -> torch.Tensor:
    """One query per sequence over all its cached positions. q: [N, Hq, D] -> [N, Hq, D];
    seq_lens: [N]; block_tables: [N, max_pages]; output_gate [N, Hq, D] (contiguous head dim): the
    result times sigmoid(output_gate), applied where the output is stored.

    Flash-decoding: grid (N, Hkv, S) where each program runs all q heads of one kv head over one of S
    spans of its sequence (each sequence splits its own length, so short ones finish early); the
    spans merge by their log-sum-exp. path "fused": the last span of each (sequence, kv head) to
    finish merges them in the same launch (a ticket); "reduce": a second kernel (N, Hq) does; None:
    fused for at most FUSED_MAX_SEQS sequences. S comes from shapes only (the block-table width
    bounds the context), so nothing syncs with the host. S == 1 writes o directly.
    `config` overrides (block_n, num_splits, num_warps, num_stages) for tuning sweeps.

    Under PDL the kernel reads the block tables, seq_lens and every cached position but the last
    (seq_len - 1) before waiting for the previous kernel: that one may write only q and that
    position (the rope kernel writing this token's K/V); output_gate is read after the wait by the
    decode kernel, before it by the reduce kernel (two kernels on: the projection has completed)."""
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    assert num_q_heads % num_kv_heads == 0, "q heads must be a multiple of kv heads"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "contiguous head dim"
    group = num_q_heads // num_kv_heads
    if output_gate is not None:
        assert output_gate.shape == q.shape and output_gate.stride(-1) == 1, "output_gate: [N, Hq, D], contiguous D"
    gate_args = (q, 0, 0) if output_gate is None else (output_gate, output_gate.stride(0), output_gate.stride(1))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    if path is None:
        path = "fused" if num_seqs <= FUSED_MAX_SEQS else "reduce"
    assert path in ("fused", "reduce"), f"path: 'fused' or 'reduce', not {path!r}"
    fused = path == "fused"
    cfg = config or _decode_config(
        num_seqs=num_seqs,
        num_kv_heads=num_kv_heads,
        max_context=block_tables.shape[1] * k_cache.shape[1],
        head_dim=head_dim,
        device=q.device,
        fused=fused,
    )
    num_splits = cfg["num_splits"]
    assert 1 <= num_splits <= MAX_SPLITS, f"num_splits {num_splits} outside [1, {MAX_SPLITS}]"
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_h = triton.next_power_of_2(group)
    # one variant for every split count (a new constant would compile mid-serving)
    block_s = MAX_SPLITS
    chunk = cfg.get("merge_chunk") or max(1, min(block_s, MERGE_ELEMS // (block_h * block_d)))
    if num_splits > 1:
        part_o = torch.empty((num_seqs, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_seqs, num_q_heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out
    tickets = ticket_counters(q.device, num_seqs * num_kv_heads, TICKETS) if fused else part_lse
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        seq_lens,
        block_tables,
        out,
        part_o,
        part_lse,
        tickets,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        block_tables.stride(1),
        out.stride(0),
        out.stride(1),
        num_splits,
        *gate_args,
        GROUP=group,
        HEAD_DIM=head_dim,
        PAGE=k_cache.shape[1],
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=cfg["block_n"],
        BLOCK_D=block_d,
        HAS_GATE=output_gate is not None,
        FUSED=fused,
        BLOCK_H=block_h,
        BLOCK_S=block_s,
        CHUNK_S=chunk,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        **pdl_launch(q),
    )
    if num_splits > 1 and not fused:
        _decode_reduce_kernel[(num_seqs, num_q_heads)](
            part_o,
            part_lse,
            seq_lens,
            out,
            out.stride(0),
            out.stride(1),
            num_splits,
            *gate_args,
            HEAD_DIM=head_dim,
            BLOCK_N=cfg["block_n"],
            BLOCK_S=block_s,
            CHUNK_S=chunk,
            BLOCK_D=block_d,
            HAS_GATE=output_gate is not None,
            num_warps=4,
            **pdl_launch(part_o),
        )
    return out
