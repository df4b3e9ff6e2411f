"""Paged attention cases (16 q heads, 2 kv heads, head dim 256, pages of 16, bf16): decode at
batch 1 / 64 / 256 x 4096 context, decode over e4m3 pages against bf16 ones at 16k, prefill of 8192
new tokens, 256 new tokens after 16,384 cached (a prefix-cache hit: split-K), torch's SDPA over one
chunk (8k and a one-pass 32k prompt, and 8k after 24k cached keys: flash on expanded heads as the
engine runs it, on the kv heads, cuDNN), and the KV write.

    python -m deltaserve.bench.kernels --only attention
    python -m deltaserve.bench.kernels_attention --sweep   # decode tile / split sweep at batch 64
    python -m deltaserve.bench.kernels_attention --sweep --batch 1 --ctx 512 --table-pages 4096
    python -m deltaserve.bench.kernels_attention --sweep --ctx 16384 --kv-fp8   # over e4m3 pages
    python -m deltaserve.bench.kernels_attention --sweep-prefill   # prefill tile sweep (one 2,048-token prompt)

The [graph] rows and the decode sweep time back-to-back calls (each its own KV pool, so that the KV
comes from HBM) captured in one CUDA graph, with PDL as in serving: batch-1 decode is launch- and
latency-bound, and timed from a stream it would time the host's launches. --table-pages gives the
block tables the decode graphs' width (the server's longest context), which sets the split count.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from deltaserve.bench.kernel_cases import Case, graphed
from deltaserve.layers.kernels.attention import naive
from deltaserve.layers.kernels.attention import triton_attention as ta
from deltaserve.layers.kernels.attention import triton_decode as td
from deltaserve.layers.kernels.device import device_info

HQ, HKV, D, PAGE = 16, 2, 256, 16
SCALE = D**-0.5
DTYPE = torch.bfloat16


def _pool(num_seqs: int, seq_len: int, extra_pages: int = 0, seed: int = 0, kv_dtype: torch.dtype = DTYPE):
    """KV pools holding num_seqs sequences of seq_len tokens in scrambled pages (stored as kv_dtype),
    and their tables."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages_per_seq = -(-seq_len // PAGE)
    num_blocks = num_seqs * pages_per_seq + extra_pages
    k_cache = torch.randn(num_blocks, PAGE, HKV, D, device="cuda", dtype=DTYPE, generator=g)
    v_cache = torch.randn(num_blocks, PAGE, HKV, D, device="cuda", dtype=DTYPE, generator=g)
    k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
    perm = torch.randperm(num_blocks, device="cuda", generator=g)[: num_seqs * pages_per_seq]
    block_tables = perm.view(num_seqs, pages_per_seq).to(torch.int32)
    return k_cache, v_cache, block_tables


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[N, Hkv, seq_len, D] contiguous copy of each sequence's keys or values."""
    n = block_tables.shape[0]
    return cache[block_tables.long()].reshape(n, -1, HKV, D)[:, :seq_len].transpose(1, 2).contiguous()


def _max_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out.float() - ref.float()).abs().max().item()


def _decode_args(
    batch: int, ctx: int, *, seed: int, table_pages: int = 0, gate: bool = False, kv_dtype: torch.dtype = DTYPE
) -> dict:
    """A decode batch of `ctx` cached tokens per sequence; block tables widened to `table_pages`
    (the decode graphs' width: the split count follows it); the layer's output gate if `gate`."""
    k_cache, v_cache, block_tables = _pool(batch, ctx, seed=seed, kv_dtype=kv_dtype)
    if table_pages > block_tables.shape[1]:
        wide = torch.zeros((batch, table_pages), dtype=torch.int32, device="cuda")
        wide[:, : block_tables.shape[1]] = block_tables
        block_tables = wide
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HQ, D, device="cuda", dtype=DTYPE)
    args = dict(q=q, k_cache=k_cache, v_cache=v_cache, seq_lens=seq_lens, block_tables=block_tables, scale=SCALE)
    if gate:
        args["output_gate"] = torch.randn(batch, HQ, 2 * D, device="cuda", dtype=DTYPE)[..., D:]
    return args


def _decode_graph_calls(
    batch: int, ctx: int, table_pages: int, cfg: dict | None = None, pdl: bool = True, kv_dtype: torch.dtype = DTYPE
):
    """Back-to-back decode calls, each over its own KV pool (>= 64 MB in all, at most 64 calls, so
    the KV is not in L2), the layer's gate; returns (calls, args of the first, KV bytes per call)."""
    kv_bytes = 2 * batch * ctx * HKV * D * kv_dtype.itemsize
    num = max(4, min(64, -(-(64 << 20) // kv_bytes)))
    all_args = [
        _decode_args(batch, ctx, seed=i, table_pages=table_pages, gate=True, kv_dtype=kv_dtype) for i in range(num)
    ]
    calls = [lambda a=a: td.paged_decode_attention(**a, config=cfg, pdl=pdl) for a in all_args]
    return calls, all_args[0], kv_bytes


def _decode_graph_case(batch: int, ctx: int, table_pages: int = 4096) -> Case:
    """Decode (+ reduce) timed in a CUDA graph with PDL, per call; the reference is the same without."""
    calls, args, kv_bytes = _decode_graph_calls(batch, ctx, table_pages)
    plain_calls = _decode_graph_calls(batch, ctx, table_pages, pdl=False)[0]
    num = len(calls)

    def check():
        return _max_err(td.paged_decode_attention(**args), naive.paged_decode_attention(**args))

    return Case(
        op="attn_decode[graph]",
        shape=f"B={batch} ctx={ctx} x{num}",
        ours=graphed(calls),
        reference=graphed(plain_calls),
        reference_label=f"without PDL (x{num})",
        check=check,
        tolerance=2e-2,
        bytes_moved=num * kv_bytes,
    )


def _decode_case(batch: int, ctx: int) -> Case:
    args = _decode_args(batch, ctx, seed=batch)
    q, k_cache, block_tables = args["q"], args["k_cache"], args["block_tables"]
    k_seq, v_seq = _gather(k_cache, block_tables, ctx), _gather(args["v_cache"], block_tables, ctx)
    # the q heads of one kv head act as that head's query rows: plain multi-query SDPA, no repeat
    q_rows = q.view(batch, HKV, HQ // HKV, D)

    def reference():
        return F.scaled_dot_product_attention(q_rows, k_seq, v_seq, scale=SCALE)

    def check():
        return _max_err(td.paged_decode_attention(**args), naive.paged_decode_attention(**args))

    kv_bytes = 2 * batch * ctx * HKV * D * 2
    return Case(
        op="attn_decode",
        shape=f"B={batch} ctx={ctx} Hq={HQ} Hkv={HKV} D={D}",
        ours=lambda: td.paged_decode_attention(**args),
        reference=reference,
        reference_label="sdpa(contiguous KV)",
        check=check,
        tolerance=2e-2,
        bytes_moved=kv_bytes + 2 * q.numel() * 2 + block_tables.numel() * 4,
        flops=4 * batch * HQ * ctx * D,
        target=">=70% of copy BW at B=64" if batch == 64 else "",
    )


def _decode_fp8_case(batch: int, ctx: int) -> Case:
    """Decode over e4m3 pages against the same shape over bf16 pages (the peer): half the KV bytes."""
    args = _decode_args(batch, ctx, seed=batch, kv_dtype=torch.float8_e4m3fn)
    bf16 = dict(args, k_cache=args["k_cache"].to(DTYPE), v_cache=args["v_cache"].to(DTYPE))
    default = td._decode_config(
        num_seqs=batch, num_kv_heads=HKV, max_context=args["block_tables"].shape[1] * PAGE, head_dim=D,
        group=HQ // HKV, elem=1, info=device_info(args["q"].device),
    )  # fmt: skip
    bf16_dots = dict(default, fp16_dots=False)

    def check():
        return _max_err(td.paged_decode_attention(**args), td.paged_decode_attention(**bf16))

    return Case(
        op="attn_decode_fp8kv",
        shape=f"B={batch} ctx={ctx} Hq={HQ} Hkv={HKV} D={D}",
        ours=lambda: td.paged_decode_attention(**args),
        reference=lambda: td.paged_decode_attention(**bf16),
        reference_label="the same over bf16 pages",
        peer=lambda: td.paged_decode_attention(**args, config=bf16_dots),
        peer_label="bf16 dots",
        check=check,
        tolerance=2e-2,
        bytes_moved=2 * batch * ctx * HKV * D + 2 * args["q"].numel() * 2 + args["block_tables"].numel() * 4,
        flops=4 * batch * HQ * ctx * D,
    )


def _prefill_cost(num_tokens: int, cached: int) -> dict:
    """A chunk's fewest bytes (q read, o written, the keys and values read once) and causal FLOPs."""
    seq_len = cached + num_tokens
    return dict(
        bytes_moved=2 * num_tokens * HQ * D * 2 + 2 * seq_len * HKV * D * 2,
        flops=2 * HQ * num_tokens * (2 * cached + num_tokens + 1) * D,
    )


def _prefill_case(num_tokens: int, cached: int = 0) -> Case:
    """num_tokens new tokens after `cached` ones (a prefix-cache hit: few queries, a long context; the
    split-K path, timed against its own unsplit path as the peer)."""
    seq_len = cached + num_tokens
    k_cache, v_cache, block_tables = _pool(1, seq_len, seed=7)
    q = torch.randn(num_tokens, HQ, D, device="cuda", dtype=DTYPE)
    args = dict(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        cu_seqlens_q=torch.tensor([0, num_tokens], dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32, device="cuda"),
        block_tables=block_tables,
        scale=SCALE,
    )
    k_seq, v_seq = _gather(k_cache, block_tables, seq_len), _gather(v_cache, block_tables, seq_len)
    q_seq = q.transpose(0, 1).unsqueeze(0).contiguous()
    # causal, aligned to the end: query i sees keys [0, cached + i]
    mask = None
    if cached:
        q_pos = cached + torch.arange(num_tokens, device="cuda")
        mask = torch.arange(seq_len, device="cuda")[None, :] <= q_pos[:, None]

    def reference():
        return F.scaled_dot_product_attention(
            q_seq, k_seq, v_seq, attn_mask=mask, is_causal=not cached, scale=SCALE, enable_gqa=True
        )

    def check():
        return _max_err(ta.paged_attention(**args), naive.paged_attention(**args))

    info = device_info(q.device)
    cfg = ta._prefill_config(D, HQ // HKV, 2, info)
    programs = (num_tokens // (cfg["block_m"] // (HQ // HKV)) + 1) * HKV
    splits = ta._prefill_splits(programs, block_tables.shape[1] * PAGE, info)
    unsplit = dict(cfg, num_splits=1)
    return Case(
        op="attn_prefill",
        shape=f"T={num_tokens} cached={cached} Hq={HQ} Hkv={HKV} D={D}" + (f" splits={splits}" if splits > 1 else ""),
        ours=lambda: ta.paged_attention(**args),
        reference=reference,
        reference_label="sdpa causal(contiguous)",
        check=check,
        tolerance=2e-2,
        **_prefill_cost(num_tokens, cached),
        peer=(lambda: ta.paged_attention(**args, config=unsplit)) if splits > 1 else None,
        peer_label="unsplit (1 span)",
    )


def _sdpa_case(num_tokens: int, cached: int = 0) -> Case:
    """One sequence's chunk through torch's SDPA as the engine runs it (prefill_attention=auto from
    SDPA_MIN_QUERIES queries: naive.causal_sdpa, k and v expanded to the q heads), against SDPA on the
    unexpanded heads (enable_gqa) and, as the peer, cuDNN's attention where this torch runs it for
    these shapes (head dim 256; after cached keys, through the lower-right causal bias): at 32k the
    attention is the largest part of a prefill, and FA2 is what SDPA's flash backend runs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    seq_len = cached + num_tokens
    g = torch.Generator(device="cuda").manual_seed(11)
    q = torch.randn(num_tokens, HQ, D, device="cuda", dtype=DTYPE, generator=g)
    k = torch.randn(seq_len, HKV, D, device="cuda", dtype=DTYPE, generator=g)
    v = torch.randn(seq_len, HKV, D, device="cuda", dtype=DTYPE, generator=g)
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    bias = causal_lower_right(num_tokens, seq_len) if cached else None

    def gqa():
        if bias is None:
            return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=SCALE, enable_gqa=True)
        return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=bias, scale=SCALE, enable_gqa=True)

    def cudnn():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return gqa()

    peer, peer_label = cudnn, "cuDNN (enable_gqa)"
    try:  # a backend this torch does not run for these shapes is reported, not timed
        cudnn()
        torch.cuda.synchronize()
    except Exception as e:
        peer, peer_label = None, f"cuDNN: {type(e).__name__}"

    def check():
        return _max_err(naive.causal_sdpa(q=q, k=k, v=v, scale=SCALE), gqa()[0].transpose(0, 1))

    return Case(
        op="attn_prefill_sdpa",
        shape=f"T={num_tokens} cached={cached} Hq={HQ} Hkv={HKV} D={D}",
        ours=lambda: naive.causal_sdpa(q=q, k=k, v=v, scale=SCALE),
        reference=gqa,
        reference_label="sdpa enable_gqa",
        check=check,
        tolerance=2e-2,
        **_prefill_cost(num_tokens, cached),
        peer=peer,
        peer_label=peer_label,
    )


def _write_case(num_tokens: int) -> Case:
    k_cache, v_cache, _ = _pool(1, num_tokens * 2, seed=3)
    key = torch.randn(num_tokens, HKV, D, device="cuda", dtype=DTYPE)
    value = torch.randn_like(key)
    slots = torch.randperm(k_cache.shape[0] * PAGE, device="cuda")[:num_tokens]
    args = dict(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots)

    def check():
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        naive.write_kv_cache(key=key, value=value, k_cache=k_ref, v_cache=v_ref, slot_mapping=slots)
        ta.write_kv_cache(**args)
        return max(_max_err(k_cache, k_ref), _max_err(v_cache, v_ref))

    return Case(
        op="attn_write_kv",
        shape=f"T={num_tokens} Hkv={HKV} D={D}",
        ours=lambda: ta.write_kv_cache(**args),
        reference=lambda: naive.write_kv_cache(**args),
        reference_label="torch index_put",
        check=check,
        tolerance=0.0,
        bytes_moved=2 * 2 * key.numel() * 2,
    )


def cases() -> list[Case]:
    return [
        _decode_case(1, 4096),
        _decode_case(64, 4096),
        _decode_case(256, 4096),
        _decode_graph_case(1, 512),
        _decode_fp8_case(64, 16384),
        _decode_fp8_case(1, 16384),
        _prefill_case(8192),
        _prefill_case(256, cached=16384),
        _sdpa_case(8192),
        _sdpa_case(32768),
        _sdpa_case(8192, cached=24576),
        _write_case(8192),
    ]


def _time_graph(replay: Callable[[], None], calls: int) -> float:
    """Microseconds per call, median over replays."""
    import triton.testing

    return triton.testing.do_bench(replay, warmup=5, rep=40, return_mode="median") * 1e3 / calls


GRID_KEYS = ("block_n", "num_splits", "num_warps", "num_stages")


def sweep(
    batch: int = 64,
    ctx: int = 4096,
    table_pages: int = 0,
    kv_dtype: torch.dtype = DTYPE,
    grid: dict | None = None,
    fp16_dots: bool = True,
) -> None:
    """Decode configs at one shape, timed in CUDA graphs: time, share of copy bandwidth, error; the
    default marked. grid: lists of block_n, num_splits, num_warps, num_stages to try; fp16_dots (the
    default): over an FP8 cache, fp16 dots, False: bf16 dots."""
    grid = {
        "block_n": [16, 32], "num_splits": [1, 2, 3, 4, 5, 8, 16, 32, 64], "num_warps": [4, 8], "num_stages": [3, 5],
        **(grid or {}),
    }  # fmt: skip
    from deltaserve.bench.kernels import measure_copy_bandwidth

    bandwidth = measure_copy_bandwidth()
    args = _decode_args(batch, ctx, seed=batch, table_pages=table_pages, gate=True, kv_dtype=kv_dtype)
    ref = naive.paged_decode_attention(**args)
    default = td._decode_config(
        num_seqs=batch, num_kv_heads=HKV, max_context=args["block_tables"].shape[1] * PAGE, head_dim=D,
        group=HQ // HKV, elem=kv_dtype.itemsize, info=device_info(args["q"].device),
    )  # fmt: skip
    print(f"B={batch} ctx={ctx}  default {default}")
    for block_n, splits, warps, stages in itertools.product(*(grid[k] for k in GRID_KEYS)):
        cfg = dict(block_n=block_n, num_splits=splits, num_warps=warps, num_stages=stages, fp16_dots=fp16_dots)
        try:
            err = _max_err(td.paged_decode_attention(**args, config=cfg), ref)
            calls, _, kv_bytes = _decode_graph_calls(batch, ctx, table_pages, cfg, kv_dtype=kv_dtype)
            us = _time_graph(graphed(calls), len(calls))
        except Exception as e:  # a config that does not compile or fit is reported, not fatal
            print(f"{cfg} failed: {type(e).__name__}: {str(e)[:80]}")
            continue
        frac = kv_bytes / bandwidth / (us * 1e-6)
        mark = "  <- default" if cfg == default else ""
        print(f"{cfg}  {us:8.1f} us  {100 * frac:5.1f}% of copy BW  err {err:.1e}{mark}", flush=True)


def sweep_prefill(num_tokens: int = 2048, context: int = 0) -> None:
    """Prefill tile configs at one sequence of num_tokens new tokens after `context` cached ones (a
    prefix-cache hit's pass): time, TFLOP/s, error."""
    import triton.testing

    k_cache, v_cache, block_tables = _pool(1, context + num_tokens, seed=7)
    q = torch.randn(num_tokens, HQ, D, device="cuda", dtype=DTYPE)
    args = dict(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        cu_seqlens_q=torch.tensor([0, num_tokens], dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor([context + num_tokens], dtype=torch.int32, device="cuda"),
        block_tables=block_tables,
        scale=SCALE,
    )
    ref = naive.paged_attention(**args)
    flops = 4 * HQ * num_tokens * (context + num_tokens / 2) * D  # causal: QK^T and PV over the keys seen
    default = ta._prefill_config(D, HQ // HKV, 2, device_info(q.device))
    print(f"T={num_tokens} after {context} cached  default {default}")
    if q.is_cuda:  # the reference in the same run: torch's SDPA over the sequence's keys copied out of the pages
        k, v = naive.sequence_kv(
            k_cache=k_cache, v_cache=v_cache, block_table=block_tables[0], length=context + num_tokens
        )
        for backend in ("flash", "cudnn"):
            sdpa = lambda b=backend: naive.causal_sdpa(q=q, k=k, v=v, scale=SCALE, backend=b)  # noqa: E731
            ms = triton.testing.do_bench(sdpa, warmup=5, rep=30, return_mode="median")
            print(
                f"sdpa {backend} (keys contiguous)  {ms:8.3f} ms  {flops / ms / 1e9:6.0f} TFLOP/s  "
                f"err {_max_err(sdpa(), ref):.1e}"
            )
    for block_m, block_n, warps, stages in itertools.product([64, 128], [32, 64], [4, 8], [2, 3]):
        cfg = dict(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages)
        try:
            err = _max_err(ta.paged_attention(**args, config=cfg), ref)
            ms = triton.testing.do_bench(
                lambda cfg=cfg: ta.paged_attention(**args, config=cfg), warmup=5, rep=30, return_mode="median"
            )
        except Exception as e:  # a config that does not compile or fit is reported, not fatal
            print(f"{cfg} failed: {type(e).__name__}: {str(e)[:80]}")
            continue
        print(f"{cfg}  {ms:8.3f} ms  {flops / ms / 1e9:6.0f} TFLOP/s  err {err:.1e}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--sweep-prefill", action="store_true")
    parser.add_argument(
        "--prefill-tokens", type=int, default=2048, help="the prefill sweep's prompt (the paged kernel serves < 4,096)"
    )
    parser.add_argument("--prefill-context", type=int, default=0, help="cached tokens before the sweep's prompt")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--table-pages", type=int, default=0)
    parser.add_argument("--kv-fp8", action="store_true", help="the decode sweep over e4m3 pages")
    parser.add_argument("--bf16-dots", action="store_true", help="with --kv-fp8: bf16 dots (config fp16_dots=False)")
    for key in GRID_KEYS:
        parser.add_argument(f"--{key.replace('_', '-')}", default="", help=f"decode sweep {key}s, e.g. 32,64")
    a = parser.parse_args()
    if a.sweep:
        grid = {k: [int(v) for v in getattr(a, k).split(",")] for k in GRID_KEYS if getattr(a, k)}
        sweep(a.batch, a.ctx, a.table_pages, torch.float8_e4m3fn if a.kv_fp8 else DTYPE, grid, not a.bf16_dots)
    if a.sweep_prefill:
        sweep_prefill(a.prefill_tokens, a.prefill_context)
