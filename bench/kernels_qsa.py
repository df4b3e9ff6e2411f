"""QSA (Qwen4-Exp sparse attention) cases at the qwen4_exp_24l preset's shapes (16 q heads, 2 kv heads
of 256, pages of 16, bf16; 16 indexer heads of 128, budget 2048 tokens in blocks of 16): one layer's
selection + attention (index scores, block top-k, sparse attention) against dense paged attention
over the same context, at 32k tokens of context: decode at batch 1 / 16 / 64, and a 2048-token
prefill chunk ending at 32k. Timed as CUDA graphs of the calls.

    python -m deltaserve.bench.kernels --only qsa
"""

from __future__ import annotations

import torch

from deltaserve.bench.kernel_cases import Case, graphed
from deltaserve.layers.kernels import attention as attention_ops
from deltaserve.layers.kernels.qsa import naive
from deltaserve.layers.kernels.qsa import triton_qsa as tq

HQ, HKV, D, PAGE = 16, 2, 256, 16
HI, DI, BUDGET, RATIO = 16, 128, 2048, 16
DTYPE = torch.bfloat16


def _inputs(batch: int, ctx: int, new: int, seed: int = 0) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages = -(-ctx // PAGE)
    num_blocks = batch * pages
    perm = torch.randperm(num_blocks, device="cuda", generator=g)
    tables = perm.view(batch, pages).to(torch.int32)
    positions = torch.arange(ctx - new, ctx, device="cuda").repeat(batch)
    rows = torch.arange(batch, device="cuda").repeat_interleave(new)
    nbi = (PAGE - 1) // RATIO + 1

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", dtype=DTYPE, generator=g)

    return dict(
        k_cache=rnd(num_blocks, PAGE, HKV, D),
        v_cache=rnd(num_blocks, PAGE, HKV, D),
        blocks=rnd(num_blocks, nbi, DI),
        tables=tables,
        positions=positions,
        rows=rows,
        q=rnd(batch * new, HQ, D),
        iq=rnd(batch * new, HI, DI),
        seq_lens=torch.full((batch,), ctx, dtype=torch.int32, device="cuda"),
        cu=torch.arange(0, batch * new + 1, new, dtype=torch.int32, device="cuda"),
        max_blocks=pages * PAGE // RATIO,
    )


def _qsa(x: dict):
    scores = tq.index_scores(q=x["iq"], block_cache=x["blocks"], positions=x["positions"], token_rows=x["rows"],
                             block_tables=x["tables"], compress_ratio=RATIO, block_size=PAGE,
                             max_blocks=x["max_blocks"])  # fmt: skip
    selected = tq.block_topk(scores=scores, positions=x["positions"], compress_ratio=RATIO, top_blocks=BUDGET // RATIO)
    return _attend(x, selected, tq.sparse_attention)


def _attend(x: dict, selected: torch.Tensor, impl):
    return impl(q=x["q"], k_cache=x["k_cache"], v_cache=x["v_cache"], positions=x["positions"], token_rows=x["rows"],
                block_tables=x["tables"], selected=selected, compress_ratio=RATIO, scale=D**-0.5)  # fmt: skip


def _dense(x: dict, new: int):
    kv = dict(q=x["q"], k_cache=x["k_cache"], v_cache=x["v_cache"], seq_lens=x["seq_lens"], block_tables=x["tables"])
    if new == 1:
        return attention_ops.paged_decode_attention(**kv, scale=D**-0.5)
    return attention_ops.paged_attention(**kv, cu_seqlens_q=x["cu"], scale=D**-0.5)


def _check(x: dict, rows: int = 256) -> float:
    """The sparse attention against the plain-torch one on the same (Triton) selection, over the first
    `rows` queries (the reference gathers [queries, budget, Hkv, D] floats)."""
    x = {**x, **{k: x[k][:rows] for k in ("positions", "rows", "q", "iq")}}
    scores = tq.index_scores(q=x["iq"], block_cache=x["blocks"], positions=x["positions"], token_rows=x["rows"],
                             block_tables=x["tables"], compress_ratio=RATIO, block_size=PAGE,
                             max_blocks=x["max_blocks"])  # fmt: skip
    selected = tq.block_topk(scores=scores, positions=x["positions"], compress_ratio=RATIO, top_blocks=BUDGET // RATIO)
    out = _attend(x, selected, tq.sparse_attention).float()
    ref = _attend(x, selected, naive.sparse_attention).float()
    return ((out - ref).abs().max() / ref.abs().max()).item()


def cases() -> list[Case]:
    out = []
    ctx = 32768
    for batch, new in ((1, 1), (16, 1), (64, 1), (1, 2048)):
        x = _inputs(batch, ctx, new)
        tokens = batch * new
        # bytes: each query's selected KV rows, every block key it scores, its scores written and read
        per_query = (BUDGET + RATIO) * 2 * HKV * D * 2 + (ctx // RATIO) * (DI * 2 + 8)
        phase = "decode" if new == 1 else "prefill"
        out.append(
            Case(
                op=f"qsa_{phase}[graph]",
                shape=f"N={batch} new={new} ctx={ctx} budget={BUDGET}/r={RATIO}",
                ours=graphed([lambda x=x: _qsa(x)]),
                reference=graphed([lambda x=x, new=new: _dense(x, new)]),
                reference_label="dense",
                check=lambda x=x: _check(x),
                tolerance=2e-2,
                bytes_moved=tokens * per_query,
                target="sparse attention's cost against dense at 32k context",
            )
        )
    return out
