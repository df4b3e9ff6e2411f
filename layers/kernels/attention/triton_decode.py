"""Triton paged decode attention (flash-decoding): one query per sequence over its cached pages.

Grid (N, Hkv, S): each program runs all q heads of one kv head (packed into the rows of one tile)
over one of S spans of its sequence (each sequence splits its own length, so short ones finish
early); a second kernel (N, Hq) merges the spans by their log-sum-exp and applies the output gate.
S == 1 writes the output directly. S comes from shapes only (the block-table width bounds the
context), so nothing syncs with the host. Layouts as in naive.py; scores in the log2 domain.

Under PDL the decode kernel reads the block tables, seq_lens and every cached position but the last
(seq_len - 1) before waiting for the previous kernel: that one may write only q and that position
(the rope kernel writing this token's K/V); the reduce kernel reads seq_lens and the output gate
before its wait (the projection that wrote the gate completed two kernels earlier).

Rows of several queries (ROWS = tokens_per_row > 1: a speculative verify's k + 1 tokens a
sequence): q row r is query r % ROWS of sequence r // ROWS and sees the keys up to its own position,
the sequence's context plus the pass's first r % ROWS + 1 tokens. Every one of the pass's tokens is
read after the wait (a key-at-a-time step after the context's tiles), so the rows split over the
GPU as decode rows do, where the prefill kernel would give a sequence one program a kv head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..device import H200, SMEM_SCRATCH, DeviceInfo, device_info, stages_that_fit, tuned_for
from ..pdl import pdl_launch, pdl_wait
from .triton_attention import LOG2E, _attend_block, _merge_spans, is_fp8_cache


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
def _attend_key(acc, m_i, l_i, qt, k_row, v_row, present, qk_scale):
    """One online-softmax step over a single key (present: else acc and l_i stay as they are)."""
    s_new = tl.sum(qt.to(tl.float32) * k_row.to(tl.float32)[None, :], 1) * qk_scale
    s_new = tl.where(present, s_new, float("-inf"))
    m_new = tl.maximum(m_i, s_new)
    p_new = tl.exp2(s_new - m_new)
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + p_new
    acc = acc * alpha[:, None] + p_new[:, None] * v_row.to(tl.float32)[None, :]
    return acc, m_new, l_i


@triton.jit
def _row_len(seq_lens, n, ROWS: tl.constexpr):
    """Keys visible to q row n: its sequence's (n // ROWS) cached length less the pass's later tokens."""
    if ROWS == 1:
        return tl.load(seq_lens + n)
    return tl.load(seq_lens + n // ROWS) - (ROWS - 1 - n % ROWS)


# values that change from pass to pass: one compile serves them all (kernels/__init__.py)
@triton.jit(do_not_specialize=["num_splits", "seq_lens", "block_tables", "s_btn"])
def _decode_kernel(
    q, k_cache, v_cache, seq_lens, block_tables, out, part_o, part_lse, qk_scale, s_qn, s_qh, s_kb, s_ko, s_kh, s_vb,
    s_vo, s_vh, s_btn, s_btp, s_on, s_oh, num_splits, gate, s_gn, s_gh, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_GATE: tl.constexpr,
    ROWS: tl.constexpr, KV_FP8: tl.constexpr, FP16_DOTS: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    # read before pdl_wait: only the previous kernel (rope) can still run (PDL chain), writing q and the
    # pass's K/V (seq_len - 1 for one-token rows; the last ROWS positions of a sequence otherwise)
    seq_len = _row_len(seq_lens, n, ROWS)
    start, end = _split_bounds(seq_len, split, num_splits, BLOCK_N)
    if start >= end:
        pdl_wait(USE_PDL)
        return
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    head = h * GROUP + g
    d_ok = d < HEAD_DIM
    mask = (g < GROUP)[:, None] & d_ok[None, :]
    bt_row = block_tables + (n // ROWS).to(tl.int64) * s_btn
    k_base = k_cache + h * s_kh
    v_base = v_cache + h * s_vh
    # the cached positions of this span, the pass's tokens excluded (they come last, after the wait)
    first_new = seq_len - 1 - n % ROWS
    ctx_end = tl.minimum(end, first_new)
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
    if ROWS == 1:
        new_pos = seq_len - 1
        has_new = end == seq_len  # the last span: it holds the new token
        new_page = tl.load(bt_row + (new_pos // PAGE) * s_btp, mask=has_new, other=0).to(tl.int64)
        new_off = new_page * s_kb + (new_pos % PAGE) * s_ko
        new_v_off = new_page * s_vb + (new_pos % PAGE) * s_vo

    pdl_wait(USE_PDL)
    qt = tl.load(q + n * s_qn + head[:, None] * s_qh + d[None, :], mask=mask, other=0.0)
    if not KV_FP8:  # the dots in the cache's dtype (an FP8 cache: in q's, its tiles upcast)
        qt = qt.to(k_cache.dtype.element_ty)
    elif FP16_DOTS:  # bf16 q over e4m3 tiles: e4m3 -> fp16 is one conversion, e4m3 -> bf16 two (sm_90)
        qt = qt.to(tl.float16)
    k0, v0 = k0.to(qt.dtype), v0.to(qt.dtype)
    if ROWS == 1:
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
    if ROWS == 1:
        # the new token (last span only; elsewhere p = 0 and alpha = 1 leave acc and l_i as they are)
        acc, m_i, l_i = _attend_key(acc, m_i, l_i, qt, k_new, v_new, has_new, qk_scale)
    else:
        # the pass's tokens this row sees that lie in this span, a key at a time
        for pos in range(tl.maximum(start, first_new), end):
            page = tl.load(bt_row + (pos // PAGE) * s_btp).to(tl.int64)
            k_p = tl.load(k_base + page * s_kb + (pos % PAGE) * s_ko + d, mask=d_ok, other=0.0)
            v_p = tl.load(v_base + page * s_vb + (pos % PAGE) * s_vo + d, mask=d_ok, other=0.0)
            acc, m_i, l_i = _attend_key(acc, m_i, l_i, qt, k_p, v_p, True, qk_scale)

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


# values that change from pass to pass: one compile serves them all (kernels/__init__.py)
@triton.jit(do_not_specialize=["num_splits", "seq_lens"])
def _decode_reduce_kernel(
    part_o, part_lse, seq_lens, out, s_on, s_oh, num_splits, gate, s_gn, s_gh, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK_S: tl.constexpr, BLOCK_D: tl.constexpr, HAS_GATE: tl.constexpr,
    ROWS: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0)
    head = tl.program_id(1) + tl.zeros([1], tl.int32)
    # before the wait, one round trip each off the chain: seq_lens is no kernel's output in the
    # pass, and the gate is the input projection's (completed before the decode kernel started)
    seq_len = _row_len(seq_lens, n, ROWS)
    row0 = (n * tl.num_programs(1) + head) * num_splits
    cnt = _num_spans(seq_len, num_splits, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    gate_tile = gate
    if HAS_GATE:
        gate_tile = tl.load(gate + n * s_gn + head[:, None] * s_gh + d[None, :], mask=(d < HEAD_DIM)[None, :])
    pdl_wait(USE_PDL)
    _merge_spans(
        part_o, part_lse, out, gate_tile, n, head, head >= 0, row0, cnt, s_on, s_oh, HEAD_DIM, BLOCK_S, CHUNK_S,
        BLOCK_D, HAS_GATE,
    )  # fmt: skip


# the most splits _decode_config picks; the split count is a run-time argument of both kernels (it
# follows the batch's decode rows, and a compile-time constant would compile one variant per value
# in the middle of serving)
MAX_SPLITS = 64
# partial elements per merge chunk, [BLOCK_H, chunk, BLOCK_D] float32 with BLOCK_H the kv head's
# q-head group: 8 spans a chunk at GROUP 8, D 256
MERGE_ELEMS = 16384

# measured on the H200: a 5-stage K+V pipeline of 4 warps, and about two programs per SM (the sweep
# at 64 x 4096, D = 256, peaked there: 89% of copy bandwidth at 2 splits x 32-token tiles)
DECODE_TILES = {H200: dict(programs_per_sm=2, num_warps=4, num_stages=5)}
# other GPUs: the same, the pipeline as deep as their shared memory holds (_decode_smem)
GENERIC_DECODE_TILES = dict(programs_per_sm=2, num_warps=4, num_stages=5)


def _decode_smem(block_n: int, block_d: int, block_g: int, elem: int) -> tuple[int, int]:
    """(bytes per pipeline stage, bytes outside the pipeline) of the decode kernel, an upper bound:
    a KV tile's worth per stage (sm_90 builds take about that: 17 / 34 / 67 KB at 1 / 3 / 5 stages
    of 32 x 256 bf16 tiles); q, the first K+V tile and the scores besides."""
    per_stage = block_n * block_d * elem
    return per_stage, elem * (block_g * block_d + 2 * block_n * block_d + block_g * block_n) + SMEM_SCRATCH


def _decode_config(
    *, num_seqs: int, num_kv_heads: int, max_context: int, head_dim: int, group: int, elem: int, info: DeviceInfo
) -> dict:
    """KV tile, splits, warps, stages. On a GPU: 32-token K+V tiles at head dim 256, and enough splits
    for about programs_per_sm programs per SM; tiles halved when the sequences alone fill the GPU."""
    if info.is_interpreter:
        return dict(block_n=16, num_splits=max(1, min(4, max_context // 16)), num_warps=4, num_stages=1)
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_n = max(16, min(64, 8192 // block_d))
    max_splits = max(1, min(MAX_SPLITS, max_context // (4 * block_n)))
    tuned = tuned_for(DECODE_TILES, info)
    tiles = tuned or GENERIC_DECODE_TILES
    want = tiles["programs_per_sm"] * info.num_sms
    num_splits = max(1, min(max_splits, round(want / (num_seqs * num_kv_heads))))
    if num_splits == 1:  # enough sequences to fill the GPU: smaller tiles (256 x 4096: ~100% at 16, 84% at 32)
        block_n = max(16, block_n // 2)
    stages = tiles["num_stages"]
    if tuned is None:
        per_stage, fixed = _decode_smem(block_n, block_d, max(16, triton.next_power_of_2(group)), elem)
        stages = stages_that_fit(stages, per_stage, fixed, info)
    return dict(block_n=block_n, num_splits=num_splits, num_warps=tiles["num_warps"], num_stages=stages)


def paged_decode_attention(
    *, q, k_cache, v_cache, seq_lens, block_tables, scale, output_gate=None, config=None, pdl=True, tokens_per_row=1
) -> torch.Tensor:
    """attention.paged_decode_attention: the decode kernel, then (more than one split) the reduce
    kernel, over q's rows (tokens_per_row a sequence). `config` overrides (block_n, num_splits,
    num_warps, num_stages, merge_chunk; fp16_dots, default True: bf16 q over an FP8 cache takes fp16
    dots, False: bf16 dots) for tuning sweeps."""
    num_seqs, num_q_heads, head_dim = q.shape  # q rows
    assert num_seqs == seq_lens.shape[0] * tokens_per_row, "q: tokens_per_row rows a sequence"
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
    cfg = config or _decode_config(
        num_seqs=num_seqs,
        num_kv_heads=num_kv_heads,
        max_context=block_tables.shape[1] * k_cache.shape[1],
        head_dim=head_dim,
        group=group,
        elem=k_cache.element_size(),
        info=device_info(q.device),
    )
    num_splits = cfg["num_splits"]
    kv_fp8 = is_fp8_cache(k_cache)
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
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, seq_lens, block_tables, out, part_o, part_lse, scale * LOG2E, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), block_tables.stride(0), block_tables.stride(1), out.stride(0), out.stride(1), num_splits,
        *gate_args, GROUP=group, HEAD_DIM=head_dim, PAGE=k_cache.shape[1],
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=cfg["block_n"], BLOCK_D=block_d,
        HAS_GATE=output_gate is not None, ROWS=tokens_per_row, KV_FP8=kv_fp8,
        FP16_DOTS=kv_fp8 and q.dtype == torch.bfloat16 and bool(cfg.get("fp16_dots", True)),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_launch(q, pdl),
    )  # fmt: skip
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, num_q_heads)](
            part_o, part_lse, seq_lens, out, out.stride(0), out.stride(1), num_splits, *gate_args, HEAD_DIM=head_dim,
            BLOCK_N=cfg["block_n"], BLOCK_S=block_s, CHUNK_S=chunk, BLOCK_D=block_d, HAS_GATE=output_gate is not None,
            ROWS=tokens_per_row, num_warps=4, **pdl_launch(part_o, pdl),
        )  # fmt: skip
    return out
