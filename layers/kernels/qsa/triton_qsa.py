"""Triton QSA kernels: the indexer's key writes and block compression, block scoring, block top-k
and attention over the selected blocks. Layouts and semantics as in naive.py.

- `write_index_keys`: one program per token.
- `compress_blocks`: one program per token; those that complete a block read its r raw keys through
  the block table, average them in float32 (rounded to the cache dtype, as transformers rounds the
  mean), apply the zero-centred norm and the rotary embedding at the block's first position, and
  write the block key into their own page (the completing token's page).
- `index_scores`: grid (tokens, block tiles): q's heads x a tile of block keys in one tl.dot, relu,
  summed over heads.
- `block_topk`: one program per token. A short row (up to `pair` blocks) ranks every score against
  all others at once; a longer one finds the K-th largest score's order-preserving integer key
  4 bits per pass (8 passes, each counting the scores at or above 16 thresholds at once), then keeps
  the larger scores and the first ties in index order. Rows up to `row` blocks are read once into
  registers; longer ones are read in pieces on every pass. Selected blocks come out ascending; ties
  (-0.0 equal to 0.0) go to the lowest index.
- `sparse_attention`: grid (tokens, kv heads, splits): the q heads of one kv head in the rows of one
  tile, an online softmax over the selected blocks' tokens and the query's tail, read through the
  block table (the same tile step as the dense kernels, with a gathered position list). Where tokens
  x kv heads leave the GPU idle (decode at small batch) each query's list is cut into spans of whole
  tiles and a second kernel merges them by their log-sum-exp, as the dense decode kernel does;
  prefill chunks and large batches run one program per token and kv head, writing the output.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..attention.triton_decode import MAX_SPLITS, _merge_spans, _num_spans, _split_bounds
from ..device import num_sms

LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["slot_mapping", "num_tokens"])
def _write_keys_kernel(
    keys, key_cache, slot_mapping, num_tokens, s_kt, s_cb, s_co, D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = d < tl.where(slot >= 0, D, 0)  # slot -1: padding, nothing is written
    k = tl.load(keys + t * s_kt + d, mask=mask)
    tl.store(key_cache + (slot // PAGE) * s_cb + (slot % PAGE) * s_co + d, k.to(key_cache.dtype.element_ty), mask=mask)


def write_index_keys(*, keys: torch.Tensor, key_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    num_tokens, head_dim = keys.shape
    if num_tokens == 0:
        return
    assert keys.stride(1) == 1 and key_cache.stride(2) == 1, "contiguous head dim"
    _write_keys_kernel[(num_tokens,)](
        keys, key_cache, slot_mapping, num_tokens, keys.stride(0), key_cache.stride(0), key_cache.stride(1),
        D=head_dim, PAGE=key_cache.shape[1], BLOCK_D=triton.next_power_of_2(head_dim), num_warps=1,
    )  # fmt: skip


@triton.jit(do_not_specialize=["positions", "slot_mapping", "token_rows", "block_tables", "s_btn"])
def _compress_kernel(
    key_cache, block_cache, positions, slot_mapping, token_rows, block_tables, norm_weight, inv_freq, eps,
    s_kb, s_ko, s_bb, s_bi, s_btn,
    R: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr, PAGE: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions + t).to(tl.int64)
    slot = tl.load(slot_mapping + t).to(tl.int64)
    if ((pos + 1) % R != 0) | (slot < 0):
        return
    row = tl.load(token_rows + t).to(tl.int64)
    first = pos + 1 - R
    j = tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    half = ROT // 2
    partner = tl.where(d < half, d + half, tl.where(d < ROT, d - half, d))
    tok = first + j
    page = tl.load(block_tables + row * s_btn + tok // PAGE, mask=j < R, other=0).to(tl.int64)
    base = key_cache + (page * s_kb + (tok % PAGE) * s_ko)[:, None]
    mask = (j < R)[:, None] & (d < D)[None, :]
    # the mean in float32, rounded to the cache dtype as transformers rounds it before its norm
    dt = block_cache.dtype.element_ty
    x = (tl.sum(tl.load(base + d[None, :], mask=mask, other=0.0).to(tl.float32), 0) / R).to(dt).to(tl.float32)
    xp = (tl.sum(tl.load(base + partner[None, :], mask=mask, other=0.0).to(tl.float32), 0) / R).to(dt).to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, 0) / D + eps)
    w = tl.load(norm_weight + d, mask=d < D, other=0.0).to(tl.float32)
    wp = tl.load(norm_weight + partner, mask=d < D, other=0.0).to(tl.float32)
    y = (x * inv_rms * (1.0 + w)).to(dt).to(tl.float32)
    yp = (xp * inv_rms * (1.0 + wp)).to(dt).to(tl.float32)
    i = tl.where(d < half, d, d - half)
    angle = first.to(tl.float32) * tl.load(inv_freq + i, mask=d < ROT, other=0.0)
    c, s = tl.cos(angle), tl.sin(angle)
    out = tl.where(d < ROT, tl.where(d < half, y * c - yp * s, y * c + yp * s), y)
    dst = block_cache + (slot // PAGE) * s_bb + ((slot % PAGE) // R) * s_bi + d
    tl.store(dst, out.to(dt), mask=d < D)


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
    from ..rotary.triton_rotary import _inv_freq

    num_tokens = positions.shape[0]
    head_dim = key_cache.shape[2]
    if num_tokens == 0:
        return
    assert key_cache.stride(2) == 1 and block_cache.stride(2) == 1 and block_tables.stride(1) == 1
    _compress_kernel[(num_tokens,)](
        key_cache, block_cache, positions, slot_mapping, token_rows, block_tables, norm_weight,
        _inv_freq(rotary_dim, theta, key_cache.device), eps,
        key_cache.stride(0), key_cache.stride(1), block_cache.stride(0), block_cache.stride(1), block_tables.stride(0),
        R=compress_ratio, D=head_dim, ROT=rotary_dim, PAGE=key_cache.shape[1],
        BLOCK_R=triton.next_power_of_2(compress_ratio), BLOCK_D=triton.next_power_of_2(head_dim), num_warps=1,
    )  # fmt: skip


@triton.jit(do_not_specialize=["positions", "token_rows", "block_tables", "s_btn", "max_blocks"])
def _scores_kernel(
    q, block_cache, positions, token_rows, block_tables, out, max_blocks, scale,
    s_qt, s_qh, s_bb, s_bi, s_btn, s_ot,
    HI: tl.constexpr, D: tl.constexpr, R: tl.constexpr, PAGE: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    pos = tl.load(positions + t).to(tl.int64)
    nc = (pos + 1) // R
    valid = c < nc
    row = tl.load(token_rows + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    result = tl.full([BLOCK_C], float("-inf"), tl.float32)
    if tl.program_id(1) * BLOCK_C < nc:
        last = (c + 1).to(tl.int64) * R - 1  # the block's last token: its key lives in that token's page
        page = tl.load(block_tables + row * s_btn + last // PAGE, mask=valid, other=0).to(tl.int64)
        k_ptr = block_cache + (page * s_bb + ((last % PAGE) // R) * s_bi)[:, None] + d[None, :]
        keys = tl.load(k_ptr, mask=valid[:, None] & (d < D)[None, :], other=0.0)
        qh = tl.load(q + t * s_qt + h[:, None] * s_qh + d[None, :], mask=(h < HI)[:, None] & (d < D)[None, :],
                     other=0.0)  # fmt: skip
        dots = tl.dot(qh.to(keys.dtype), tl.trans(keys))  # [BLOCK_H, BLOCK_C]; padded heads give 0
        result = tl.where(valid, tl.sum(tl.maximum(dots, 0.0), 0) * scale, result)
    tl.store(out + t * s_ot + c, result, mask=c < max_blocks)


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
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty((num_tokens, max_blocks), dtype=torch.float32, device=q.device)
    if num_tokens == 0 or max_blocks == 0:
        return out
    assert q.stride(2) == 1 and block_cache.stride(2) == 1 and block_tables.stride(1) == 1
    block_c = 64 if q.is_cuda else 16
    grid = (num_tokens, triton.cdiv(max_blocks, block_c))
    _scores_kernel[grid](
        q, block_cache, positions, token_rows, block_tables, out, max_blocks, 1.0 / math.sqrt(head_dim),
        q.stride(0), q.stride(1), block_cache.stride(0), block_cache.stride(1), block_tables.stride(0), out.stride(0),
        HI=num_heads, D=head_dim, R=compress_ratio, PAGE=block_size,
        BLOCK_H=max(16, triton.next_power_of_2(num_heads)), BLOCK_C=block_c,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), num_warps=4,
    )  # fmt: skip
    return out


@triton.jit
def _sort_key(x):
    """float32 -> int32 with the same order (signed comparison); -0.0 gets +0.0's key (equal scores tie)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(x == 0.0, 0, bits ^ ((bits >> 31) & 0x7FFFFFFF))


# the K-th largest key is found RADIX_BITS bits at a time: each pass counts the scores at or above
# 2 ** RADIX_BITS thresholds at once (8 passes over the row instead of a binary search's 32)
RADIX_BITS = 4


@triton.jit
def _thresholds(lo, P: tl.constexpr, BITS: tl.constexpr):
    """Pass P's thresholds lo + j * step (j < 2 ** BITS, step = 2 ** (32 - BITS * (P + 1))) as int32
    keys (they all fit: the pass searches [lo, lo + 2 ** BITS * step), inside the int32 range)."""
    j = tl.arange(0, 1 << BITS).to(tl.int64)
    return (lo + j * (1 << (32 - BITS * (P + 1)))).to(tl.int32)


@triton.jit
def _count_at_least(key, ok, thresholds):
    """[len(thresholds)] counts of the keys (where ok) at or above each threshold."""
    return tl.sum(((key[None, :] >= thresholds[:, None]) & ok[None, :]).to(tl.int32), 1)


@triton.jit
def _narrow(lo, counts, P: tl.constexpr, BITS: tl.constexpr, K: tl.constexpr):
    """The largest threshold still reached by K scores (counts fall as thresholds rise; the first
    one always is): the next pass searches [it, it + step)."""
    return lo + (tl.sum((counts >= K).to(tl.int32), 0) - 1).to(tl.int64) * (1 << (32 - BITS * (P + 1)))


@triton.jit
def _take_top(key, ok, tau, greater, ties_before, K: tl.constexpr):
    """Which keys of a piece are kept: all above tau, and ties at tau in index order while fewer
    than K - greater ties were taken (ties_before: ties in earlier pieces)."""
    tie = (key == tau) & ok
    tie_rank = ties_before + tl.cumsum(tie.to(tl.int32), 0)  # 1-based among ties so far
    return ((key > tau) & ok) | (tie & (tie_rank <= K - greater)), tl.sum(tie.to(tl.int32), 0)


@triton.jit(do_not_specialize=["positions", "max_blocks"])
def _topk_kernel(
    scores, positions, out, max_blocks, s_st, s_ot, R: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr, PAIR: tl.constexpr, ROW: tl.constexpr, BITS: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions + t).to(tl.int64)
    n = tl.minimum((pos + 1) // R, max_blocks).to(tl.int32)
    row = scores + t * s_st
    orow = out + t * s_ot
    k = tl.arange(0, BLOCK_K)
    if n <= K:  # every complete block
        tl.store(orow + k, tl.where(k < n, k, -1).to(tl.int32), mask=k < K)
        return
    tl.store(orow + k, tl.full([BLOCK_K], -1, tl.int32), mask=k < K)
    # the scatters below store the same slots from other threads (other tensor shapes): the fill first
    tl.debug_barrier()
    if n <= PAIR:  # a short row: each score's rank from all pairs at once
        i = tl.arange(0, PAIR)
        key = _sort_key(tl.load(row + i, mask=i < n, other=float("-inf")))
        ki, kj = key[:, None], key[None, :]
        beats = ((kj > ki) | ((kj == ki) & (i[None, :] < i[:, None]))) & (i[None, :] < n)
        take = (tl.sum(beats.to(tl.int32), 1) < K) & (i < n)
        slot = tl.cumsum(take.to(tl.int32), 0) - 1
        tl.store(orow + slot, i.to(tl.int32), mask=take)
        return
    # tau: the largest key with at least K scores >= tau, i.e. the K-th largest score's key
    lo = tl.zeros([], tl.int64) - 2147483648
    if n <= ROW:  # the row fits in registers: read it once
        i = tl.arange(0, ROW)
        ok = i < n
        key = _sort_key(tl.load(row + i, mask=ok, other=0.0))
        for p in tl.static_range(32 // BITS):
            lo = _narrow(lo, _count_at_least(key, ok, _thresholds(lo, p, BITS)), p, BITS, K)
        tau = lo.to(tl.int32)
        greater = tl.sum(((key > tau) & ok).to(tl.int32), 0)
        take, _ = _take_top(key, ok, tau, greater, 0, K)
        slot = tl.cumsum(take.to(tl.int32), 0) - 1
        tl.store(orow + slot, i.to(tl.int32), mask=take)
        return
    offs = tl.arange(0, BLOCK)
    for p in tl.static_range(32 // BITS):
        thresholds = _thresholds(lo, p, BITS)
        counts = tl.zeros([1 << BITS], tl.int32)
        for i in range(0, n, BLOCK):
            c = i + offs
            counts += _count_at_least(_sort_key(tl.load(row + c, mask=c < n, other=0.0)), c < n, thresholds)
        lo = _narrow(lo, counts, p, BITS, K)
    tau = lo.to(tl.int32)
    greater = tl.zeros([], tl.int32)
    for i in range(0, n, BLOCK):
        c = i + offs
        key = _sort_key(tl.load(row + c, mask=c < n, other=0.0))
        greater += tl.sum(((key > tau) & (c < n)).to(tl.int32), 0)
    taken = tl.zeros([], tl.int32)
    ties = tl.zeros([], tl.int32)
    for i in range(0, n, BLOCK):
        c = i + offs
        key = _sort_key(tl.load(row + c, mask=c < n, other=0.0))
        take, piece_ties = _take_top(key, c < n, tau, greater, ties, K)
        slot = taken + tl.cumsum(take.to(tl.int32), 0) - 1
        tl.store(orow + slot, c.to(tl.int32), mask=take)
        taken += tl.sum(take.to(tl.int32), 0)
        ties += piece_ties


# launch shapes of block_topk (tests pass others to reach every path under the interpreter): rows
# up to `pair` blocks rank all pairs; up to `row` they are read once into registers (8 warps hold
# 4096 scores at 16 a thread); longer ones are read `block` at a time on every pass
TOPK_GPU = dict(pair=128, row=4096, block=1024, num_warps=8)
TOPK_INTERPRETER = dict(pair=32, row=64, block=16, num_warps=4)


def block_topk(
    *, scores: torch.Tensor, positions: torch.Tensor, compress_ratio: int, top_blocks: int, config: dict | None = None
) -> torch.Tensor:
    """qsa.block_topk; `config` overrides TOPK_GPU / TOPK_INTERPRETER (pair, row, block, num_warps)."""
    num_tokens, max_blocks = scores.shape
    out = torch.empty((num_tokens, top_blocks), dtype=torch.int32, device=scores.device)
    if num_tokens == 0:
        return out
    assert scores.stride(1) == 1
    cfg = {**(TOPK_GPU if scores.is_cuda else TOPK_INTERPRETER), **(config or {})}
    _topk_kernel[(num_tokens,)](
        scores, positions, out, max_blocks, scores.stride(0), out.stride(0), R=compress_ratio, K=top_blocks,
        BLOCK=cfg["block"], BLOCK_K=triton.next_power_of_2(top_blocks), PAIR=cfg["pair"], ROW=cfg["row"],
        BITS=RADIX_BITS, num_warps=cfg["num_warps"],
    )  # fmt: skip
    return out


@triton.jit
def _list_len(pos, R: tl.constexpr, K: tl.constexpr):
    """(entries of a query's position list from its selected blocks, the list's length): the blocks'
    tokens, then its tail nc * R .. pos."""
    nc = (pos + 1) // R
    from_blocks = tl.minimum(nc, K) * R
    return from_blocks, from_blocks + pos + 1 - nc * R


@triton.jit(do_not_specialize=["positions", "token_rows", "block_tables", "selected", "s_btn", "num_splits"])
def _sparse_kernel(
    q, k_cache, v_cache, positions, token_rows, block_tables, selected, out, part_o, part_lse, qk_scale, num_splits,
    s_qt, s_qh, s_kb, s_ko, s_kh, s_vb, s_vo, s_vh, s_btn, s_st, s_ot, s_oh,
    GROUP: tl.constexpr, R: tl.constexpr, K: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, KV_FP8: tl.constexpr,
):  # fmt: skip
    """KV_FP8: e4m3 pages (kv_cache_dtype fp8), each tile widened to q's dtype in registers for the dots."""
    t = tl.program_id(0).to(tl.int64)
    hk = tl.program_id(1)
    split = tl.program_id(2)
    pos = tl.load(positions + t).to(tl.int64)
    from_blocks, total = _list_len(pos, R, K)
    start, end = _split_bounds(total, split, num_splits, BLOCK_N)
    if start >= end:  # a short list: fewer spans than splits (the merge reads only the first ones)
        return
    row = tl.load(token_rows + t).to(tl.int64)
    nc = (pos + 1) // R
    m = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    head = hk * GROUP + m
    q_mask = (m < GROUP)[:, None] & d_ok[None, :]
    qt = tl.load(q + t * s_qt + head[:, None] * s_qh + d[None, :], mask=q_mask, other=0.0)
    if not KV_FP8:
        qt = qt.to(k_cache.dtype.element_ty)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = block_tables + row * s_btn
    k_base = k_cache + hk * s_kh
    v_base = v_cache + hk * s_vh
    n = tl.arange(0, BLOCK_N)
    for tile in range(start, end, BLOCK_N):  # every tile holds a valid entry: no all -inf row
        j = tile + n
        ok = j < end
        in_blocks = j < from_blocks
        blk = tl.load(selected + t * s_st + j // R, mask=ok & in_blocks, other=0).to(tl.int64)
        kv_pos = tl.where(in_blocks, blk * R + j % R, nc * R + (j - from_blocks))
        page = tl.load(bt_row + kv_pos // PAGE, mask=ok, other=0).to(tl.int64)
        off = kv_pos % PAGE
        kv_mask = ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + (page * s_kb + off * s_ko)[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if KV_FP8:
            k = k.to(qt.dtype)
        s = tl.dot(qt, tl.trans(k)) * qk_scale
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + (page * s_vb + off * s_vo)[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if KV_FP8:
            v = v.to(qt.dtype)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    o = acc / l_i[:, None]
    if num_splits == 1:
        tl.store(out + t * s_ot + head[:, None] * s_oh + d[None, :], o.to(out.dtype.element_ty), mask=q_mask)
    else:
        # partials: [T, Hq, num_splits, HEAD_DIM] outputs and [T, Hq, num_splits] log2-sum-exp
        prow = (t * tl.num_programs(1) * GROUP + head) * num_splits + split
        tl.store(part_o + prow[:, None] * HEAD_DIM + d[None, :], o, mask=q_mask)
        tl.store(part_lse + prow, m_i + tl.log2(l_i), mask=m < GROUP)


@triton.jit(do_not_specialize=["positions", "num_splits"])
def _sparse_merge_kernel(
    part_o, part_lse, positions, out, s_ot, s_oh, num_splits, R: tl.constexpr, K: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) + tl.zeros([1], tl.int32)
    _, total = _list_len(tl.load(positions + t).to(tl.int64), R, K)
    row0 = (t * tl.num_programs(1) + head) * num_splits
    cnt = _num_spans(total, num_splits, BLOCK_N)
    _merge_spans(
        part_o, part_lse, out, out, t, head, head >= 0, row0, cnt, s_ot, s_oh, HEAD_DIM, BLOCK_S, CHUNK_S, BLOCK_D,
        False,
    )  # fmt: skip


# split-K over each query's position list when the (tokens, kv heads) grid is small: splits for
# about SPARSE_PROGRAMS_PER_SM programs per SM, each span at least SPARSE_MIN_SPAN_TILES KV tiles
# (prefill chunks and large batches fill the GPU with one program per token and kv head)
SPARSE_PROGRAMS_PER_SM = 2
SPARSE_MIN_SPAN_TILES = 2
# partial elements per merge chunk ([1 head, chunk, BLOCK_D] float32): 16 spans at D 256
SPARSE_MERGE_ELEMS = 4096


def sparse_splits(*, num_tokens: int, num_kv_heads: int, max_list: int, block_n: int, num_sms: int) -> int:
    """Spans each query's position list (at most max_list entries) is cut into: enough programs for
    the GPU, whole tiles of at least SPARSE_MIN_SPAN_TILES each; 1 where the grid is full already."""
    tiles = triton.cdiv(max_list, block_n)
    want = round(SPARSE_PROGRAMS_PER_SM * num_sms / (num_tokens * num_kv_heads))
    if want <= 1:
        return 1
    per_span = max(SPARSE_MIN_SPAN_TILES, triton.cdiv(tiles, want))
    return max(1, min(MAX_SPLITS, triton.cdiv(tiles, per_span)))


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
    num_splits: int | None = None,
) -> torch.Tensor:
    """qsa.sparse_attention; `num_splits` overrides sparse_splits (tests, tuning sweeps)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1 and block_tables.stride(1) == 1
    assert selected.stride(1) == 1
    group = num_q_heads // num_kv_heads
    on_gpu = q.is_cuda
    top = selected.shape[1]
    block_n = (32 if head_dim > 128 else 64) if on_gpu else 16
    block_d = max(16, triton.next_power_of_2(head_dim))
    if num_splits is None:
        num_splits = sparse_splits(
            num_tokens=num_tokens, num_kv_heads=num_kv_heads, max_list=(top + 1) * compress_ratio - 1,
            block_n=block_n, num_sms=num_sms(q.device),
        )  # fmt: skip
    assert 1 <= num_splits <= MAX_SPLITS, f"num_splits {num_splits} outside [1, {MAX_SPLITS}]"
    if num_splits > 1:
        part_o = torch.empty((num_tokens, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_tokens, num_q_heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out
    _sparse_kernel[(num_tokens, num_kv_heads, num_splits)](
        q, k_cache, v_cache, positions, token_rows, block_tables, selected, out, part_o, part_lse, scale * LOG2E,
        num_splits, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), selected.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, R=compress_ratio, K=top, HEAD_DIM=head_dim, PAGE=k_cache.shape[1],
        BLOCK_M=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, BLOCK_D=block_d,
        KV_FP8=k_cache.dtype == torch.float8_e4m3fn, num_warps=4, num_stages=2 if on_gpu else 1,
    )  # fmt: skip
    if num_splits > 1:
        # one variant for every split count (a new constant would compile mid-serving)
        _sparse_merge_kernel[(num_tokens, num_q_heads)](
            part_o, part_lse, positions, out, out.stride(0), out.stride(1), num_splits, R=compress_ratio, K=top,
            HEAD_DIM=head_dim, BLOCK_N=block_n, BLOCK_S=MAX_SPLITS,
            CHUNK_S=max(1, min(MAX_SPLITS, SPARSE_MERGE_ELEMS // block_d)), BLOCK_D=block_d, num_warps=4,
        )  # fmt: skip
    return out
