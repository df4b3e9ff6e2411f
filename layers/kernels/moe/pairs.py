"""The fused MoE's pairs path (a handful of routed pairs, i.e. decode): GEMV kernels on CUDA cores,
no sorting. Up: one program per (pair, BLOCK_N rows of the expert width) streams those gate and up
rows with 16-byte loads; down: one program per (token, BLOCK_H rows of the hidden size) streams its
top-k experts' rows and sums them in registers, the shared expert as one more slot. Thin row blocks
put several programs on every SM even at batch 1, and the pair index is the fastest grid axis, so
two tokens routed to one expert read its rows at about the same time (the second read mostly hits
L2). The up GEMV can also route (ROUTE: router.py's top-k in each program, no router launch)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..device import ticket_counters
from ..fp8 import scale_block
from ..norm.triton_norm import add_rms_norm_row
from ..pdl import pdl_launch, pdl_wait
from ..tickets import last_to_arrive
from .fused_norm import norm_kernel_args
from .naive import PairLowRank, SharedExpert
from .router import _pair_expert, _topk_softmax


@triton.jit
def _low_rank(keys, v, b, s_v, s_bg, s_bn, pair, n, n_ok, V_OFFSET: tl.constexpr, R: tl.constexpr):
    """[len(n)] float32: b[key, n] . v[pair, V_OFFSET : V_OFFSET + R] of the pair's key, zero
    without one (an empty rank range rather than a scalar mask, which the interpreter mistypes)."""
    key = tl.load(keys + pair)
    r = tl.arange(0, R)
    r_ok = r < tl.where(key >= 0, R, 0)
    vr = tl.load(v + pair.to(tl.int64) * s_v + V_OFFSET + r, mask=r_ok, other=0.0)
    b_ptr = b + tl.maximum(key, 0).to(tl.int64) * s_bg + n[:, None].to(tl.int64) * s_bn + r[None, :]
    br = tl.load(b_ptr, mask=n_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)
    return tl.sum(br * vr[None, :], 1)


@triton.jit
def _chunk_loads(x_ptr, g_ptr, u_ptr, k_ok, rows_ok, w_ok, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr):
    """A K chunk of x and of the gate and up rows, as float32: rows_ok / w_ok the rows' and the
    tile's masks. EVEN_K (the chunk inside the row): x unmasked, and the weights masked only without
    EVEN_N (rows past the weight's): unmasked loads need no zeroed destination registers."""
    if EVEN_K:
        x = tl.load(x_ptr)
        if EVEN_N:
            g = tl.load(g_ptr, eviction_policy="evict_first")
            u = tl.load(u_ptr, eviction_policy="evict_first")
        else:
            g = tl.load(g_ptr, mask=rows_ok, other=0.0, eviction_policy="evict_first")
            u = tl.load(u_ptr, mask=rows_ok, other=0.0, eviction_policy="evict_first")
    else:
        x = tl.load(x_ptr, mask=k_ok, other=0.0)
        g = tl.load(g_ptr, mask=w_ok, other=0.0, eviction_policy="evict_first")
        u = tl.load(u_ptr, mask=w_ok, other=0.0, eviction_policy="evict_first")
    return x.to(tl.float32), g.to(tl.float32), u.to(tl.float32)


@triton.jit
def _gate_up(
    x_row, w_rows, n, n_ok, s_wn, HIDDEN: tl.constexpr, INTER: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_N: tl.constexpr,
):  # fmt: skip
    """([len(n)], [len(n)]) float32: x . gate[n] and x . up[n] (gate row n of w_rows, up row n + INTER).
    The K loop is unrolled and accumulates [len(n), BLOCK_K] partial products, reduced once at the
    end, so no barrier separates one chunk's loads from the next."""
    k = tl.arange(0, BLOCK_K)
    g_ptr = w_rows + n[:, None] * s_wn + k[None, :]
    u_ptr = g_ptr + INTER * s_wn
    acc_g = tl.zeros([n.shape[0], BLOCK_K], tl.float32)
    acc_u = tl.zeros([n.shape[0], BLOCK_K], tl.float32)
    for k0 in tl.static_range(0, HIDDEN, BLOCK_K):
        k_ok = k0 + k < HIDDEN
        w_ok = n_ok[:, None] & k_ok[None, :]
        x, g, u = _chunk_loads(
            x_row + k0 + k, g_ptr + k0, u_ptr + k0, k_ok, n_ok[:, None], w_ok, HIDDEN % BLOCK_K == 0,
            EVEN_N,
        )  # fmt: skip
        acc_g += g * x[None, :]
        acc_u += u * x[None, :]
    return tl.sum(acc_g, 1), tl.sum(acc_u, 1)


@triton.jit
def _fp8_gate_up(
    x_row, w_rows, w_scales, n, n_ok, s_wn, s_sn, HIDDEN: tl.constexpr, INTER: tl.constexpr, BLOCK_K: tl.constexpr,
    SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, EVEN_N: tl.constexpr,
):  # fmt: skip
    """_gate_up over float8 rows with block scales w_scales [rows / SCALE_N, HIDDEN / SCALE_K] (row
    stride s_sn; SCALE_K a power of two). Each K chunk is G groups of GK columns, each inside one
    scale block: the products are summed within a group, then the group's sum is scaled (G
    multiplies a row and chunk, not one a weight, and no scale broadcast across lanes)."""
    GK: tl.constexpr = BLOCK_K if BLOCK_K < SCALE_K else SCALE_K
    G: tl.constexpr = BLOCK_K // GK
    grp = tl.arange(0, G)
    kk = grp[:, None] * GK + tl.arange(0, GK)[None, :]
    g_ptr = w_rows + n[:, None, None] * s_wn + kk[None, :, :]
    u_ptr = g_ptr + INTER * s_wn
    n_sc = tl.minimum(n, INTER - 1)  # rows past INTER (never stored) take the last row's scales
    gs_ptr = w_scales + (n_sc // SCALE_N)[:, None, None] * s_sn
    us_ptr = w_scales + ((n_sc + INTER) // SCALE_N)[:, None, None] * s_sn
    acc_g = tl.zeros([n.shape[0], G], tl.float32)
    acc_u = tl.zeros([n.shape[0], G], tl.float32)
    for k0 in tl.static_range(0, HIDDEN, BLOCK_K):
        k_ok = k0 + kk < HIDDEN
        w_ok = n_ok[:, None, None] & k_ok[None, :, :]
        x, g, u = _chunk_loads(
            x_row + k0 + kk, g_ptr + k0, u_ptr + k0, k_ok, n_ok[:, None, None], w_ok, HIDDEN % BLOCK_K == 0,
            EVEN_N,
        )  # fmt: skip
        # [rows, G, 1] scales, summed over the unit axis into the layout of the group sums
        block = ((k0 + grp * GK) // SCALE_K)[None, :, None]
        s_ok = (k0 + grp * GK < HIDDEN)[None, :, None]
        acc_g += tl.sum(g * x[None, :, :], 2) * tl.sum(tl.load(gs_ptr + block, mask=s_ok, other=0.0), 2)
        acc_u += tl.sum(u * x[None, :, :], 2) * tl.sum(tl.load(us_ptr + block, mask=s_ok, other=0.0), 2)
    return tl.sum(acc_g, 1), tl.sum(acc_u, 1)


@triton.jit
def _up_gemv_kernel(
    hidden, w13, act, topk_ids, expert_offset, num_experts, s_ht, s_we, s_wn, s_at, router_logits, topk_weights,
    num_routed, s_lt, w13_scale, s_se, s_sn, lora_keys, lora_v, lora_b, s_lv, s_lg, s_ln, HIDDEN: tl.constexpr,
    INTER: tl.constexpr, TOPK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROUTE: tl.constexpr,
    TOPK_P: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, FP8: tl.constexpr,
    SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, LORA_RANK: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """act[pair, n] = silu(x . gate[n]) * (x . up[n]) for BLOCK_N rows n of one pair's expert.
    ROUTE: the router's work too, so its launch goes. Each program finds its pair's expert from its
    token's logits over the num_routed experts (argmax rounds up to the pair's slot: the router
    kernel's selection); the programs of row block 0 also run the router kernel's whole top-k
    softmax (_topk_softmax) and write topk_ids / topk_weights for the down GEMV. Meant for 1-warp
    programs: a round's reduction then stays in the warp (shuffles, no barrier).
    Pairs routed to another rank's expert exit (their act rows stay unset; the down kernel masks
    them). The K loop is unrolled and accumulates [BLOCK_N, BLOCK_K] partial products, reduced once
    at the end, so no barrier separates one chunk's loads from the next.
    FP8: w13 is float8 with block scales w13_scale [E, rows / SCALE_N, HIDDEN / SCALE_K] (strides
    s_se, s_sn), widened and scaled in registers.
    LORA_RANK > 0: the pair's low-rank delta (low_rank.PairLowRank: lora_keys, lora_v rows of stride
    s_lv, lora_b [G, 2 * INTER, LORA_RANK] of strides s_lg, s_ln) joins gate and up before the
    activation."""
    pdl_wait(USE_PDL)
    pair = tl.program_id(0)
    if ROUTE:
        routed = _pair_expert(router_logits, pair // TOPK, pair % TOPK, num_routed, s_lt, BLOCK_E)
        if tl.program_id(1) == 0:
            t = pair // TOPK + tl.zeros([1], tl.int32)
            top_w, top_i = _topk_softmax(
                router_logits, t, t >= 0, num_routed, s_lt, TOPK, TOPK_P, RENORMALIZE, 1, BLOCK_E
            )
            mine = tl.arange(0, TOPK_P)[None, :] == pair % TOPK
            tl.store(topk_ids + pair, tl.sum(tl.sum(tl.where(mine, top_i, 0), 1), 0).to(tl.int64))
            tl.store(topk_weights + pair, tl.sum(tl.sum(tl.where(mine, top_w, 0.0), 1), 0))
        e = routed - expert_offset
    else:
        e = tl.load(topk_ids + pair).to(tl.int32) - expert_offset
    if (e < 0) | (e >= num_experts):
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < INTER
    x_row = hidden + (pair // TOPK).to(tl.int64) * s_ht
    w_rows = w13 + e.to(tl.int64) * s_we
    if FP8:
        gate, up = _fp8_gate_up(
            x_row, w_rows, w13_scale + e.to(tl.int64) * s_se, n, n_ok, s_wn, s_sn, HIDDEN, INTER, BLOCK_K, SCALE_N,
            SCALE_K, INTER % BLOCK_N == 0,
        )  # fmt: skip
    else:
        gate, up = _gate_up(x_row, w_rows, n, n_ok, s_wn, HIDDEN, INTER, BLOCK_K, INTER % BLOCK_N == 0)
    if LORA_RANK > 0:
        gate += _low_rank(lora_keys, lora_v, lora_b, s_lv, s_lg, s_ln, pair, n, n_ok, 0, LORA_RANK)
        up += _low_rank(lora_keys, lora_v, lora_b, s_lv, s_lg, s_ln, pair, n + INTER, n_ok, LORA_RANK, LORA_RANK)
    h = gate * tl.sigmoid(gate) * up
    tl.store(act + pair.to(tl.int64) * s_at + n, h.to(act.dtype.element_ty), mask=n_ok)


@triton.jit
def _down_gemv_kernel(
    act, w2, out, topk_weights, topk_ids, expert_offset, num_experts, s_at, s_we, s_wn, s_ot, shared_gate_up, shared_w2,
    shared_gate_logit, s_sgu, s_sw2, s_sgl, residual, norm_weight, normed_out, res_out, tickets, s_rt, eps,
    w2_scale, s_se, s_sn, shared_scale, s_ssn, lora_keys, lora_v, lora_b, s_lv, s_lg, s_ln, slora_keys, slora_v,
    slora_b, s_shv, s_shg, s_shn, HIDDEN: tl.constexpr, INTER: tl.constexpr, TOPK: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_I: tl.constexpr, SHARED_INTER: tl.constexpr, ADD_NORM: tl.constexpr,
    BLOCK_HID: tl.constexpr, FP8: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
    SHARED_FP8: tl.constexpr, SHARED_SCALE_N: tl.constexpr, SHARED_SCALE_K: tl.constexpr, LORA_RANK: tl.constexpr,
    SHARED_LORA_RANK: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """out[t, h] = sum_j weight[t, j] * act[t, j] . w2[e_j, h] for BLOCK_H rows h, all top-k slots
    unrolled into one straight run of independent loads. A slot routed to another rank gets an
    empty column range: its loads are fully masked (an empty range instead of a scalar mask, which
    the interpreter mistypes). SHARED_INTER > 0: the shared expert is one more slot, its activation
    silu(gate) * up formed on the fly from its gate/up projection and weighted by sigmoid(gate
    logit), so the block's whole output leaves in one rounding. The shared expert's weights do not
    depend on the routing: when they fit one chunk they are loaded before the PDL wait, while the
    previous kernel finishes.
    ADD_NORM: the next norm of the block's output too (the norm kernel's work, without its launch).
    The last of a token's programs to finish (tickets.last_to_arrive, after a CTA barrier) reads the
    whole row back from L2 and writes res_out = out + residual and normed_out = its zero-centred
    RMSNorm.
    FP8 / SHARED_FP8: w2 / shared_w2 are float8 with block scales (w2_scale [E, H / SCALE_N,
    INTER / SCALE_K], strides s_se, s_sn; shared_scale [H / .., SHARED_INTER / ..], row stride
    s_ssn), widened and scaled in registers.
    LORA_RANK > 0: each pair's low-rank delta (as _up_gemv_kernel's, lora_b [G, HIDDEN, LORA_RANK])
    joins its down projection before the routing weight. SHARED_LORA_RANK > 0: the token's
    low-rank delta (SharedExpert.lora: slora_keys, slora_v rows of stride s_shv, slora_b
    [S, HIDDEN, SHARED_LORA_RANK]) joins the shared expert's output under its gate."""
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < HIDDEN
    h_sc = tl.minimum(h, HIDDEN - 1)
    i = tl.arange(0, BLOCK_I)
    shared_ptr = shared_w2 + h[:, None].to(tl.int64) * s_sw2 + i[None, :]
    # FP8 tiles whose rows lie in one scale row scale the activation row, not each weight
    ROW_SCALE: tl.constexpr = FP8 and BLOCK_H <= SCALE_N
    SHARED_ROW_SCALE: tl.constexpr = SHARED_FP8 and BLOCK_H <= SHARED_SCALE_N
    first = tl.program_id(1) * BLOCK_H
    if SHARED_ROW_SCALE:
        shared_sc_ptr = shared_scale + (first // SHARED_SCALE_N) * s_ssn
    else:
        shared_sc_ptr = shared_scale + (h_sc // SHARED_SCALE_N)[:, None] * s_ssn
    PRELOAD_SHARED: tl.constexpr = SHARED_INTER > 0 and SHARED_INTER <= BLOCK_I
    if PRELOAD_SHARED:
        shared_mask = h_ok[:, None] & (i < SHARED_INTER)[None, :]
        shared_b = tl.load(shared_ptr, mask=shared_mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        if SHARED_FP8 and not SHARED_ROW_SCALE:
            i_in = (i < SHARED_INTER)[None, :]
            shared_b *= tl.load(shared_sc_ptr + (i // SHARED_SCALE_K)[None, :], mask=i_in, other=0.0)
    pdl_wait(USE_PDL)
    acc = tl.zeros([BLOCK_H, BLOCK_I], tl.float32)
    low_rank = tl.zeros([BLOCK_H], tl.float32)  # the routed pairs' and the shared expert's adapters
    for j in tl.static_range(TOPK):
        pair = t * TOPK + j
        e = tl.load(topk_ids + pair).to(tl.int32) - expert_offset
        w = tl.load(topk_weights + pair).to(tl.float32)
        if LORA_RANK > 0:  # pairs routed elsewhere have no key
            low_rank += w * _low_rank(lora_keys, lora_v, lora_b, s_lv, s_lg, s_ln, pair, h, h_ok, 0, LORA_RANK)
        local = (e >= 0) & (e < num_experts)
        limit = tl.where(local, INTER, 0)
        a_ptr = act + pair.to(tl.int64) * s_at + i
        b_ptr = w2 + tl.where(local, e, 0).to(tl.int64) * s_we + h[:, None] * s_wn + i[None, :]
        e_scale = w2_scale + tl.where(local, e, 0).to(tl.int64) * s_se
        if ROW_SCALE:
            bs_ptr = e_scale + (first // SCALE_N) * s_sn
        else:
            bs_ptr = e_scale + (h_sc // SCALE_N)[:, None] * s_sn
        for i0 in tl.static_range(0, INTER, BLOCK_I):
            i_ok = i0 + i < limit
            a = tl.load(a_ptr + i0, mask=i_ok, other=0.0).to(tl.float32) * w
            b_ok = h_ok[:, None] & i_ok[None, :]
            b = tl.load(b_ptr + i0, mask=b_ok, other=0.0, eviction_policy="evict_first").to(tl.float32)
            # FP8 scales masked by the static bound only (identical addresses within a block)
            if ROW_SCALE:
                a *= tl.load(bs_ptr + (i0 + i) // SCALE_K, mask=i0 + i < INTER, other=0.0)
            elif FP8:
                b *= tl.load(bs_ptr + ((i0 + i) // SCALE_K)[None, :], mask=(i0 + i < INTER)[None, :], other=0.0)
            acc += b * a[None, :]
    if SHARED_INTER > 0:
        scale = tl.sigmoid(tl.load(shared_gate_logit + t.to(tl.int64) * s_sgl).to(tl.float32))
        if SHARED_LORA_RANK > 0:
            shared_low = _low_rank(slora_keys, slora_v, slora_b, s_shv, s_shg, s_shn, t, h, h_ok, 0, SHARED_LORA_RANK)
            low_rank += scale * shared_low
        g_ptr = shared_gate_up + t.to(tl.int64) * s_sgu + i
        for i0 in tl.static_range(0, SHARED_INTER, BLOCK_I):
            i_ok = i0 + i < SHARED_INTER
            g = tl.load(g_ptr + i0, mask=i_ok, other=0.0).to(tl.float32)
            u = tl.load(g_ptr + SHARED_INTER + i0, mask=i_ok, other=0.0).to(tl.float32)
            shared_act = g * tl.sigmoid(g) * u * scale
            if SHARED_ROW_SCALE:
                shared_act *= tl.load(shared_sc_ptr + (i0 + i) // SHARED_SCALE_K, mask=i_ok, other=0.0)
            if PRELOAD_SHARED:
                b = shared_b
            else:
                b_mask = h_ok[:, None] & i_ok[None, :]
                b = tl.load(shared_ptr + i0, mask=b_mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
                if SHARED_FP8 and not SHARED_ROW_SCALE:
                    sc = tl.load(shared_sc_ptr + ((i0 + i) // SHARED_SCALE_K)[None, :], mask=i_ok[None, :], other=0.0)
                    b *= sc
            acc += b * shared_act[None, :]
    total = tl.sum(acc, 1)
    if LORA_RANK > 0 or SHARED_LORA_RANK > 0:
        total += low_rank
    tl.store(out + t.to(tl.int64) * s_ot + h, total.to(out.dtype.element_ty), mask=h_ok)
    if ADD_NORM:
        tl.debug_barrier()
        if last_to_arrive(tickets + t, tl.num_programs(1)):
            d = tl.arange(0, BLOCK_HID)
            d_ok = d < HIDDEN
            xv = tl.load(out + t.to(tl.int64) * s_ot + d, mask=d_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
            row = t.to(tl.int64) * s_rt
            add_rms_norm_row(xv, residual + row, res_out + row, normed_out + row, norm_weight, eps, d, d_ok, HIDDEN)


def moe_pairs(
    hidden, w13, w2, topk_weights, topk_ids, expert_offset, out, cfg, shared, norm, pdl, route=None,
    scales=(None, None), deltas=None,
) -> None:  # fmt: skip
    """The pairs path into `out` (or, with norm, into norm.out). route: (router_logits,
    renormalize) when the up GEMV routes, filling topk_ids / topk_weights. scales: (w13_scale,
    w2_scale) of FP8 experts, else (None, None). deltas (PairDeltas, not with route): their
    low-rank form, expanded inside the GEMVs (two small shrink launches beside them)."""
    assert deltas is None or route is None, "moe_pairs: the deltas need the routing first"
    num_tokens, hidden_size = hidden.shape
    num_experts, inter = w13.shape[0], w2.shape[2]
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    act = torch.empty((num_pairs, inter), dtype=hidden.dtype, device=hidden.device)
    up, down = cfg["up"] if route is None else cfg["up_route"], cfg["down"]
    logits, renormalize = route if route is not None else (hidden, False)
    w13_scale, w2_scale = scales
    up_scale = _scale_args(w13_scale, w13, out)
    up_lora = low_rank_args(None if deltas is None else deltas.low_rank_gate_up(topk_ids), out)
    _up_gemv_kernel[(num_pairs, triton.cdiv(inter, up["block_n"]))](
        hidden, w13, act, topk_ids, expert_offset, num_experts, hidden.stride(0), w13.stride(0), w13.stride(1),
        act.stride(0), logits, topk_weights, logits.shape[1], logits.stride(0), *up_scale[:3], *up_lora[:6],
        HIDDEN=hidden_size, INTER=inter, TOPK=top_k, BLOCK_N=up["block_n"], BLOCK_K=up["block_k"],
        ROUTE=route is not None, TOPK_P=triton.next_power_of_2(top_k), RENORMALIZE=renormalize,
        BLOCK_E=triton.next_power_of_2(logits.shape[1]), FP8=w13_scale is not None, SCALE_N=up_scale[3],
        SCALE_K=up_scale[4], LORA_RANK=up_lora[6], num_warps=up["num_warps"], num_stages=1, **pdl_launch(hidden, pdl),
    )  # fmt: skip
    down_lora = low_rank_args(None if deltas is None else deltas.low_rank_down(act), out)
    shared_lora = low_rank_args(None if shared is None else shared.lora, out)
    shared_inter = 0 if shared is None else shared.w2.shape[1]
    args = (act, w2, out, topk_weights, topk_ids, expert_offset, num_experts)
    args += (act.stride(0), w2.stride(0), w2.stride(1), out.stride(0), *_shared_args(shared, out))
    tickets = out if norm is None else ticket_counters(out.device, num_tokens, "moe_down_norm")
    norm_args = norm_kernel_args(norm, out)
    args += (*norm_args[:4], tickets, *norm_args[4:])
    down_scale = _scale_args(w2_scale, w2, out)
    shared_scale = None if shared is None else shared.w2_scale
    sh = _scale_args(None if shared_scale is None else shared_scale[None], None if shared is None else shared.w2, out)
    _down_gemv_kernel[(num_tokens, triton.cdiv(hidden_size, down["block_h"]))](
        *args, *down_scale[:3], sh[0], sh[2], *down_lora[:6], *shared_lora[:6], HIDDEN=hidden_size, INTER=inter,
        TOPK=top_k, BLOCK_H=down["block_h"], BLOCK_I=down["block_i"], SHARED_INTER=shared_inter,
        ADD_NORM=norm is not None, BLOCK_HID=triton.next_power_of_2(hidden_size), FP8=w2_scale is not None,
        SCALE_N=down_scale[3], SCALE_K=down_scale[4], SHARED_FP8=shared_scale is not None, SHARED_SCALE_N=sh[3],
        SHARED_SCALE_K=sh[4], LORA_RANK=down_lora[6], SHARED_LORA_RANK=shared_lora[6], num_warps=down["num_warps"],
        num_stages=1, **pdl_launch(act, pdl),
    )  # fmt: skip


def low_rank_args(low: PairLowRank | None, dummy: torch.Tensor) -> tuple:
    """(keys, v, b, v's row stride, b's key and row strides, the rank; 0 without) for a kernel's
    LORA_RANK arguments (placeholders without)."""
    if low is None:
        return dummy, dummy, dummy, 0, 0, 0, 0
    keys, v, b = low
    rank = b.shape[2]
    assert rank & (rank - 1) == 0 and b.stride(2) == 1 and v.stride(1) == 1, "low rank: a power of two, contiguous"
    return keys, v, b, v.stride(0), b.stride(0), b.stride(1), rank


def _scale_args(scale: torch.Tensor | None, weight: torch.Tensor | None, dummy: torch.Tensor) -> tuple:
    """(scale, expert stride, row-block stride, SCALE_N, SCALE_K) of [E, ., .] block scales of an
    FP8 weight [E, rows, cols] (a [rows, cols] weight's scales as [1, ., .]); placeholders for none."""
    if scale is None:
        return dummy, 0, 0, 1, 1
    rows, cols = weight.shape[-2:]
    block = scale_block(rows, cols, tuple(scale.shape[-2:]))
    return (scale, scale.stride(0), scale.stride(1), *block)


def _shared_args(shared: SharedExpert | None, out: torch.Tensor) -> tuple:
    """The down GEMV's shared-expert pointers and row strides (placeholders when there is none)."""
    if shared is None:
        return out, out, out, 0, 0, 0
    return (
        shared.gate_up,
        shared.w2,
        shared.gate_logit,
        shared.gate_up.stride(0),
        shared.w2.stride(0),
        shared.gate_logit.stride(0),
    )
