"""The token rows a graphed pass's capture replays run on (fixed_captures.FixedCaptures.finish_chunked).

Each replay entry takes CHUNK - 1 rows of q, k, v, g and beta from its first token on (clamped to the
pass), and the rows past its count are made no-ops (g = beta = 0). With torch that is five index
selects and two selects on a mask a GDN layer, each a launch of a few microseconds (~1 ms of a 2k
prefill graph over 30 layers); here one launch writes all five: a program a gathered row. Same
contract as naive.replay_rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # elements a step of a row's copy


# the entries are views of a graph's static buffers: their alignment is not a compile key
@triton.jit(do_not_specialize=["first", "count", "num_tokens"])
def _rows_kernel(
    q, k, v, g, beta, out_q, out_k, out_v, out_g, out_beta, first, count, num_tokens, s_q, s_k, s_v, s_g, s_b,
    WQK: tl.constexpr, WV: tl.constexpr, WG: tl.constexpr, STEPS: tl.constexpr, BLOCK: tl.constexpr,
    BLOCK_G: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    e = r // STEPS
    i = r % STEPS
    src = tl.minimum(tl.load(first + e) + i, num_tokens - 1).to(tl.int64)
    live = i < tl.load(count + e)
    row = r.to(tl.int64)
    for start in tl.static_range(0, WQK, BLOCK):
        o = start + tl.arange(0, BLOCK)
        m = o < WQK
        tl.store(out_q + row * WQK + o, tl.load(q + src * s_q + o, mask=m), mask=m)
        tl.store(out_k + row * WQK + o, tl.load(k + src * s_k + o, mask=m), mask=m)
    for start in tl.static_range(0, WV, BLOCK):
        o = start + tl.arange(0, BLOCK)
        m = o < WV
        tl.store(out_v + row * WV + o, tl.load(v + src * s_v + o, mask=m), mask=m)
    o = tl.arange(0, BLOCK_G)
    m = o < WG
    gv = tl.load(g + src * s_g + o, mask=m, other=0.0)
    tl.store(out_g + row * WG + o, tl.where(live, gv, tl.zeros_like(gv)), mask=m)
    bv = tl.load(beta + src * s_b + o, mask=m, other=0.0)
    tl.store(out_beta + row * WG + o, tl.where(live, bv, tl.zeros_like(bv)), mask=m)


def replay_rows(
    *,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    first: torch.Tensor,
    count: torch.Tensor,
    steps: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """naive.replay_rows in one launch (each token row of q, k, v, g and beta contiguous)."""
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        assert x[0].is_contiguous(), f"{name}: each token row contiguous"
    num_tokens, rows = q.shape[0], first.shape[0] * steps
    outs = tuple(torch.empty((rows, *x.shape[1:]), dtype=x.dtype, device=x.device) for x in (q, k, v, g, beta))
    if rows == 0:
        return outs
    wqk, wv, wg = q[0].numel(), v[0].numel(), g[0].numel()
    assert k[0].numel() == wqk and beta[0].numel() == wg, "k as q, beta as g"
    _rows_kernel[(rows,)](
        q, k, v, g, beta, *outs, first, count, num_tokens, q.stride(0), k.stride(0), v.stride(0), g.stride(0),
        beta.stride(0), WQK=wqk, WV=wv, WG=wg, STEPS=steps, BLOCK=min(BLOCK, triton.next_power_of_2(max(wqk, wv))),
        BLOCK_G=triton.next_power_of_2(wg), num_warps=4,
    )  # fmt: skip
    return outs
