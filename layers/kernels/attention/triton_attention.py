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
from ..fp8.triton_quant import round_to_e4m3
from ..pdl import pdl_launch, pdl_wait
from .naive import is_fp8_cache

LOG2E = 1.4426950408889634


PREFILL_SEQ_BLOCK = 64  # sequences the prefill kernel scans per step to find its q block's owner


@triton.jit
def to_cache(x, KV_FP8: tl.constexpr):
    """x ready for the cache's store: for an FP8 (e4m3, scale 1) cache saturated at +-448 and rounded
    to nearest even in float32 (the store's cast is then exact), as naive.to_cache."""
    if KV_FP8:
        x = round_to_e4m3(tl.clamp(x.to(tl.float32), -448.0, 448.0))
    return x


@triton.jit
def _write_kv_kernel(
    key, value, k_cache, v_cache, slot_mapping, s_kt, s_kh, s_vt, s_vh, s_kcb, s_kco, s_kch, s_vcb, s_vco, s_vch,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    KV_FP8: tl.constexpr, USE_PDL: tl.constexpr,
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
    tl.store(k_dst, to_cache(k, KV_FP8).to(k_cache.dtype.element_ty), mask=mask)
    tl.store(v_dst, to_cache(v, KV_FP8).to(v_cache.dtype.element_ty), mask=mask)


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
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        KV_FP8=is_fp8_cache(k_cache), num_warps=4, **pdl_launch(key, pdl),
    )  # fmt: skip


@triton.jit
def _attend_block(
    acc, m_i, l_i, q, q_pos, kv_start, kv_end, k_base, v_base, bt_row, s_btp, s_kb, s_ko, s_vb, s_vo, d, qk_scale,
    PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over KV positions [kv_start, kv_start + BLOCK_N) read through the
    block table, K and V in q's dtype (an FP8 cache's tiles upcast in registers). MASK: apply the
    kv_end bound and the causal limit q_pos (else the tile is known full)."""
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
    k = tl.load(k_base + (page * s_kb + off * s_ko)[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
    s = tl.dot(q, tl.trans(k)) * qk_scale
    if MASK:
        s = tl.where(ok[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_base + (page * s_vb + off * s_vo)[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, m_new, l_i


@triton.jit
def _merge_spans(
    part_o, part_lse, out, gate, n, head, h_ok, row0, cnt, s_on, s_oh, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
    CHUNK_S: tl.constexpr, BLOCK_D: tl.constexpr, HAS_GATE: tl.constexpr,
):  # fmt: skip
    """Merge the cnt span partials of the q heads `head` ([BLOCK_H], h_ok: real heads; partial rows
    row0 + span) by their log2-sum-exp, apply the output gate (HAS_GATE: `gate` is the [BLOCK_H,
    BLOCK_D] gate tile, loaded by the caller), store. .cg: other SMs wrote the partials."""
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
        o *= tl.sigmoid(gate.to(tl.float32))
    tl.store(out + n * s_on + head[:, None] * s_oh + d[None, :], o.to(out.dtype.element_ty), mask=mask)


# values that change from pass to pass: one compile serves them all (kernels/__init__.py)
@triton.jit(do_not_specialize=["cu_seqlens_q", "seq_lens", "block_tables", "num_seqs", "s_btn", "num_splits"])
def _prefill_kernel(
    q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, out, part_o, part_lse, qk_scale, num_seqs, num_splits,
    s_qt, s_qh, s_kb, s_ko, s_kh, s_vb, s_vo, s_vh, s_btn, s_btp, s_ot, s_oh, gate, s_gt, s_gh, GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_SEQ: tl.constexpr, HAS_GATE: tl.constexpr, KV_FP8: tl.constexpr,
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
    qt = tl.load(q + q_rows[:, None] + d[None, :], mask=q_mask, other=0.0)
    if not KV_FP8:  # the dots in the cache's dtype (an FP8 cache: in q's, its tiles upcast)
        qt = qt.to(k_cache.dtype.element_ty)
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
    # split-K: span `split` of num_splits takes a share of the unmasked tiles; the span holding the
    # last of them also runs the masked ones, so every span that runs has a key each row may see
    split = tl.program_id(2)
    num_full = full_end // BLOCK_N
    per_span = tl.maximum(tl.cdiv(num_full, num_splits), 1)
    last_span = tl.maximum(num_full - 1, 0) // per_span
    span_lo = split * per_span * BLOCK_N
    span_hi = tl.minimum((split + 1) * per_span, num_full) * BLOCK_N
    masked_lo = tl.where(split == last_span, full_end, kv_end)
    # the partials: [T, Hq, num_splits, HEAD_DIM] outputs and [T, Hq, num_splits] log2-sum-exp
    part_row = ((q_start + tok) * tl.num_programs(1) * GROUP + head).to(tl.int64) * num_splits + split
    if split > last_span:  # an empty span (a context shorter than the split): weight 0 in the merge
        tl.store(part_o + part_row[:, None] * HEAD_DIM + d[None, :], tl.zeros([BLOCK_M, BLOCK_D], tl.float32),
                 mask=q_mask)  # fmt: skip
        tl.store(part_lse + part_row, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=row_ok)
        return
    for kv_start in range(span_lo, span_hi, BLOCK_N):
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, qt, q_pos, kv_start, kv_end, k_base, v_base, bt_row, s_btp, s_kb, s_ko, s_vb, s_vo, d,
            qk_scale, PAGE, HEAD_DIM, BLOCK_N, False,
        )  # fmt: skip
    for kv_start in range(masked_lo, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, qt, q_pos, kv_start, kv_end, k_base, v_base, bt_row, s_btp, s_kb, s_ko, s_vb, s_vo, d,
            qk_scale, PAGE, HEAD_DIM, BLOCK_N, True,
        )  # fmt: skip
    o = acc / l_i[:, None]
    if num_splits == 1:
        rows = (q_start + tok).to(tl.int64)
        if HAS_GATE:  # the gated attention's output gate, before the one rounding
            g_rows = rows * s_gt + head * s_gh
            o *= tl.sigmoid(tl.load(gate + g_rows[:, None] + d[None, :], mask=q_mask).to(tl.float32))
        o_rows = rows * s_ot + head * s_oh
        tl.store(out + o_rows[:, None] + d[None, :], o.to(out.dtype.element_ty), mask=q_mask)
    else:
        tl.store(part_o + part_row[:, None] * HEAD_DIM + d[None, :], o, mask=q_mask)
        tl.store(part_lse + part_row, m_i + tl.log2(l_i), mask=row_ok)


# values that change from pass to pass: one compile serves them all
@triton.jit(do_not_specialize=["num_splits"])
def _prefill_reduce_kernel(
    part_o, part_lse, out, s_ot, s_oh, num_splits, gate, s_gt, s_gh, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
    CHUNK_S: tl.constexpr, BLOCK_D: tl.constexpr, HAS_GATE: tl.constexpr,
):  # fmt: skip
    """Grid (T, Hq): one token's head, its num_splits span partials merged (empty spans weigh 0),
    times sigmoid(gate) with HAS_GATE."""
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) + tl.zeros([1], tl.int32)
    row0 = (t * tl.num_programs(1) + head) * num_splits
    gate_tile = gate
    if HAS_GATE:
        d = tl.arange(0, BLOCK_D)
        gate_tile = tl.load(gate + t * s_gt + head[:, None] * s_gh + d[None, :], mask=(d < HEAD_DIM)[None, :])
    _merge_spans(
        part_o, part_lse, out, gate_tile, t, head, head >= 0, row0, num_splits, s_ot, s_oh, HEAD_DIM, BLOCK_S, CHUNK_S,
        BLOCK_D, HAS_GATE,
    )  # fmt: skip


# sm_90 tiles (q rows = tokens x group heads), head dim -> tiles: 128 rows over two warpgroups. Head dim
# 256: 64 keys a step over 3 stages, though it spills a little under Triton 3.6: one 2k / 1k prompt
# 113 / 61 us against 135 / 73 at 32 keys and 2 stages, the spill-free tile (bench kernels_attention
# --sweep-prefill, H100, 49ee0b1)
PREFILL_TILES = {
    H200: {128: dict(block_n=64, num_warps=8, num_stages=3), 256: dict(block_n=64, num_warps=8, num_stages=3)}
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


# split-K for few q tiles over long contexts: at most this many spans (a run-time argument: one
# compiled variant serves every count), each at least SPLIT_MIN_KEYS keys of the longest context
PREFILL_MAX_SPLITS = 16
SPLIT_MIN_KEYS = 1024
# the cost of one more span (its partial's write and the merge's read), as a share of the unsplit time
SPLIT_OVERHEAD = 0.02
# span partials the merge reads at a time ([CHUNK_S, BLOCK_D] float32 in one program's registers)
PREFILL_MERGE_CHUNK = 8


# the unused partials' placeholder, one per device (a dict, not a function cache: a fake-tensor run
# such as bench.launches saves and restores it)
_NO_PARTIALS: dict[torch.device, torch.Tensor] = {}


def _no_partials(device: torch.device) -> torch.Tensor:
    if device not in _NO_PARTIALS:
        _NO_PARTIALS[device] = torch.empty(1, dtype=torch.float32, device=device)
    return _NO_PARTIALS[device]


def _prefill_splits(programs: int, max_context: int, info: DeviceInfo) -> int:
    """Key spans per q tile: 1 while the (q tile, kv head) programs fill the GPU or the context is
    short; else the count whose waves of programs (about one per SM: the tiles take most of its
    shared memory) give the least time, each span's overhead counted."""
    cap = min(PREFILL_MAX_SPLITS, max_context // SPLIT_MIN_KEYS)
    if programs >= info.num_sms or cap < 2:
        return 1
    best, best_cost = 1, 1.0
    for splits in range(2, cap + 1):
        cost = -(-programs * splits // info.num_sms) / splits * (1 + SPLIT_OVERHEAD * splits)
        if cost < best_cost:
            best, best_cost = splits, cost
    return best


def paged_attention(
    *, q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, output_gate=None, config=None
):  # fmt: skip
    """attention.paged_attention. Grid (T // BLOCK_Q + N, Hkv, S): a program takes BLOCK_Q tokens x
    all q heads of one kv head over one of S spans of their keys; the bound needs no host sync and
    programs past their sequence's end return at once. S > 1 (few programs, a long context: the
    block-table width bounds it) writes float32 partials that a second kernel (T, Hq) merges.
    output_gate: the result times sigmoid(output_gate) before its one rounding. `config` overrides
    the tiles (block_m, block_n, num_warps, num_stages) and num_splits."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    num_seqs = cu_seqlens_q.shape[0] - 1
    assert num_q_heads % num_kv_heads == 0, "q heads must be a multiple of kv heads"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "contiguous head dim"
    group = num_q_heads // num_kv_heads
    if output_gate is not None:
        assert output_gate.shape == q.shape and output_gate.stride(-1) == 1, "output_gate: [T, Hq, D], contiguous D"
    gate_args = (q, 0, 0) if output_gate is None else (output_gate, output_gate.stride(0), output_gate.stride(1))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    info = device_info(q.device)
    cfg = config or _prefill_config(head_dim, group, max(q.element_size(), k_cache.element_size()), info)
    block_q = cfg["block_m"] // group
    assert block_q >= 1, "block_m must hold at least one token's heads"
    programs = num_tokens // block_q + num_seqs
    num_splits = cfg.get("num_splits") or _prefill_splits(
        programs * num_kv_heads, block_tables.shape[1] * k_cache.shape[1], info
    )
    assert 1 <= num_splits <= PREFILL_MAX_SPLITS, f"num_splits {num_splits} outside [1, {PREFILL_MAX_SPLITS}]"
    if num_splits > 1:
        part_o = torch.empty((num_tokens, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_tokens, num_q_heads, num_splits), dtype=torch.float32, device=q.device)
    else:  # never written; float32 as the split's partials, so that both run one compiled variant
        part_o = part_lse = _no_partials(q.device)
    block_d = max(16, triton.next_power_of_2(head_dim))
    _prefill_kernel[(programs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, out, part_o, part_lse, scale * LOG2E, num_seqs,
        num_splits, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), block_tables.stride(1),
        out.stride(0), out.stride(1), *gate_args, GROUP=group, HEAD_DIM=head_dim, PAGE=k_cache.shape[1],
        BLOCK_M=cfg["block_m"], BLOCK_Q=block_q, BLOCK_N=cfg["block_n"], BLOCK_D=block_d, BLOCK_SEQ=PREFILL_SEQ_BLOCK,
        HAS_GATE=output_gate is not None, KV_FP8=is_fp8_cache(k_cache), num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )  # fmt: skip
    if num_splits > 1:
        _prefill_reduce_kernel[(num_tokens, num_q_heads)](
            part_o, part_lse, out, out.stride(0), out.stride(1), num_splits, *gate_args, HEAD_DIM=head_dim,
            BLOCK_S=PREFILL_MAX_SPLITS, CHUNK_S=PREFILL_MERGE_CHUNK, BLOCK_D=block_d,
            HAS_GATE=output_gate is not None, num_warps=4,
        )  # fmt: skip
    return out
