"""FP8 kernel cases at Qwen3.5-35B-A3B shapes (hidden 2048; 256 experts of width 512, top-8), each
against the bf16 kernel the model runs without FP8, timed in the same run:

- fp8_linear[graph] at 1 and 16 rows: the FP8 row GEMV / skinny GEMM (weights dequantized in
  registers) against our bf16 ones, CALLS calls on distinct weights in one CUDA graph (cold weights,
  no launch gaps); the floor is the FP8 weights' bytes.
- fp8_linear[graph,w8a8-vs-gemv] at 1 and 16 rows: the W8A8 tensor-core GEMM (its quantize launch
  included) against the decode GEMVs that widen the weights in registers.
- fp8_linear[graph,w8a8-vs-dequant] at 32 / 64 / 128 / 256 rows (decode batches): our W8A8 GEMM
  against the dequantized weight on cuBLAS (fp8_gemm=dequant, which takes passes from
  fp8.naive.DEQUANT_MIN_ROWS rows), CALLS calls on distinct weights in one CUDA graph.
- fp8_linear at 2,048 and 8,192 rows: activation quantization + the block-scaled FP8 GEMM against
  cuBLAS bf16, TFLOP/s; the peer: the same on cuBLAS's block-scaled FP8 GEMM (fp8_gemm=cublas).
- fp8_moe: the fused MoE with FP8 experts against bf16 experts (pairs path at 1 and 8 tokens in a
  CUDA graph; sorted path at 2,048 and 8,192 tokens eager).
- quantize_act: per-token 1 x 128 groups at prefill sizes.

    python -m deltaserve.bench.kernels --only fp8
    python -m deltaserve.bench.kernels_fp8 --row-sweep    # batch 1: the FP8 one-row GEMV's tiles
    python -m deltaserve.bench.kernels_fp8 --rows-sweep --tokens 2,4,8   # the few-row FP8 tiles

The row sweep (FP8 decode at batch 1 is bound by its ~270 kernels' latency, not its bytes: 2.18 ms
against a 0.87 ms floor at 4ff468f, bf16 2.23): every (block_n, num_warps) tile of the one-row kernel
with the weights loaded before or after the PDL wait, graph-timed on cold FP8 weights, us per call and
share of the FP8 bytes at copy bandwidth, beside the bf16 kernel's tuned tile on the same rows; it
prints TUNED_ROW_FP8 lines for kernels/linear/tuned.py where the best beats the current pick by 3%.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys

import torch
import torch.nn.functional as F
import triton
import triton.testing

from deltaserve.bench.kernel_cases import Case, graphed
from deltaserve.layers.kernels import fp8 as fp8_kernels
from deltaserve.layers.kernels import linear as linear_kernels
from deltaserve.layers.kernels.linear import naive, triton_fp8
from deltaserve.layers.kernels.moe import naive as moe_naive
from deltaserve.layers.kernels.moe import triton_moe as tm

DTYPE = torch.bfloat16
# (label, FP8 rows, unquantized tail rows, K)
SHAPES = [
    ("gdn_in_proj", 12288, 64, 2048),
    ("attn_qkv", 9216, 0, 2048),
    ("o_proj", 2048, 0, 4096),
    ("moe_in", 1024, 264, 2048),
]
COLD_BYTES = 256 << 20
H, E, TOP_K, INTER = 2048, 256, 8, 512
TOLERANCE = 2e-2  # max |out - ref| / max |ref| against the float32 reference of the same quantization


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _weights(n: int, tail: int, k: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]]:
    """(FP8 values, scales, tail, the bf16 weight of the same rows) copies, COLD_BYTES of bf16 in all."""
    g = torch.Generator(device="cuda").manual_seed(n + k)
    out = []
    for _ in range(max(2, math.ceil(COLD_BYTES / ((n + tail) * k * 2)))):
        w = torch.randn(n + tail, k, device="cuda", dtype=DTYPE, generator=g) * k**-0.5
        q, s = fp8_kernels.quantize_weight(w[:n])
        out.append((q, s, w[n:] if tail else None, w))
    return out


def _graphed_pair(
    op: str, label: str, m: int, copies: list, ours, reference, reference_label: str, target: str
) -> Case:
    """ours(x=, weight=, weight_scale=, weight_tail=) against reference(...) at m rows, each as calls on
    the distinct weight copies in one CUDA graph; ours checked against the W8A8 reference (x quantized)."""
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, copies[0][0].shape[1], device="cuda", dtype=DTYPE, generator=g)
    calls = max(20, len(copies))
    pick = [copies[i % len(copies)] for i in range(calls)]
    q, s, t, _ = copies[0]
    n, k = q.shape
    tail = 0 if t is None else t.shape[0]

    def run(fn, c):
        return fn(x=x, weight=c[0], weight_scale=c[1], weight_tail=c[2])

    return Case(
        op=op,
        shape=f"{label} M={m} N={n}+{tail} K={k} x{calls}",
        ours=graphed([functools.partial(run, ours, c) for c in pick]),
        reference=graphed([functools.partial(run, reference, c) for c in pick]),
        reference_label=reference_label,
        check=lambda: _rel_err(
            run(ours, copies[0]), naive.linear(x=x, weight=q, weight_scale=s, weight_tail=t, quantize_x=True)
        ),
        tolerance=TOLERANCE,
        bytes_moved=calls * (n * k + tail * k * 2 + m * k * 2 + m * (n + tail) * 2),
        flops=calls * 2 * m * (n + tail) * k,
        target=target,
    )


def _linear_cases(label: str, n: int, tail: int, k: int) -> list[Case]:
    copies = _weights(n, tail, k)
    cases = []
    for m in (1, 16):
        g = torch.Generator(device="cuda").manual_seed(m)
        x = torch.randn(m, k, device="cuda", dtype=DTYPE, generator=g)
        calls = max(20, len(copies))
        pick = [copies[i % len(copies)] for i in range(calls)]

        def fp8(c, x=x):
            return linear_kernels.linear(x=x, weight=c[0], weight_scale=c[1], weight_tail=c[2])

        q, s, t, _ = copies[0]
        cases.append(
            Case(
                op="fp8_linear[graph]",
                shape=f"{label} M={m} N={n}+{tail} K={k} x{calls}",
                ours=graphed([lambda c=c: fp8(c) for c in pick]),
                reference=graphed([lambda c=c, x=x: linear_kernels.linear(x=x, weight=c[3]) for c in pick]),
                reference_label="bf16 (ours)",
                check=lambda x=x, q=q, s=s, t=t: _rel_err(
                    linear_kernels.linear(x=x, weight=q, weight_scale=s, weight_tail=t),
                    naive.linear(x=x, weight=q, weight_scale=s, weight_tail=t),
                ),
                tolerance=TOLERANCE,
                bytes_moved=calls * (n * k + tail * k * 2 + m * k * 2 + m * (n + tail) * 2),
                flops=calls * 2 * m * (n + tail) * k,
                target="faster than bf16",
            )
        )
    w8a8 = functools.partial(triton_fp8.fp8_linear, backend="triton")
    for m in (1, 16):  # batch 1 and 16: the W8A8 tensor-core GEMM (with its quantize launch) against the GEMVs
        cases.append(
            _graphed_pair(
                "fp8_linear[graph,w8a8-vs-gemv]", label, m, copies, w8a8, linear_kernels.linear,
                "the decode GEMV (weights widened in registers)",
                "faster than the GEMV: then a W8A8 decode GEMV (x quantized inside) is worth building",
            )
        )  # fmt: skip
    for m in (32, 64, 128, 256):  # decode batches: where fp8.naive.DEQUANT_MIN_ROWS belongs
        cases.append(
            _graphed_pair(
                "fp8_linear[graph,w8a8-vs-dequant]", label, m, copies,
                functools.partial(linear_kernels.linear, fp8_gemm="triton"),
                functools.partial(triton_fp8.fp8_linear, backend="dequant"), "dequantized weight + cuBLAS bf16",
                "the faster one sets DEQUANT_MIN_ROWS",
            )
        )  # fmt: skip
    for m in (2048, 8192):
        g = torch.Generator(device="cuda").manual_seed(m)
        x = torch.randn(m, k, device="cuda", dtype=DTYPE, generator=g)
        q, s, t, w = copies[0]
        cases.append(
            Case(
                op="fp8_linear",
                shape=f"{label} M={m} N={n}+{tail} K={k}",
                ours=lambda x=x, q=q, s=s, t=t: linear_kernels.linear(
                    x=x, weight=q, weight_scale=s, weight_tail=t, fp8_gemm="triton"
                ),
                reference=lambda x=x, w=w: F.linear(x, w),
                reference_label="cuBLAS bf16",
                check=lambda x=x, q=q, s=s, t=t: _rel_err(
                    linear_kernels.linear(x=x, weight=q, weight_scale=s, weight_tail=t, fp8_gemm="triton"),
                    naive.linear(x=x, weight=q, weight_scale=s, weight_tail=t, quantize_x=True),
                ),
                tolerance=TOLERANCE,
                bytes_moved=n * k + tail * k * 2 + m * k * 2 + m * (n + tail) * 2,
                flops=2 * m * (n + tail) * k,
                peer=lambda x=x, q=q, s=s, t=t: linear_kernels.linear(
                    x=x, weight=q, weight_scale=s, weight_tail=t, fp8_gemm="cublas"
                ),
                peer_label="cuBLAS block FP8 (fp8_gemm=cublas)",
                target="faster than cuBLAS bf16",
            )
        )
    return cases


def _moe_cases() -> list[Case]:
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(E, 2 * INTER, H, device="cuda", dtype=DTYPE, generator=g) * H**-0.5
    w2 = torch.randn(E, H, INTER, device="cuda", dtype=DTYPE, generator=g) * INTER**-0.5
    q13, s13 = fp8_kernels.quantize_weight(w13)
    q2, s2 = fp8_kernels.quantize_weight(w2)
    cases = []
    for tokens in (1, 8, 2048, 8192):
        calls = 16 if tokens <= 8 else 1
        routes = []
        for i in range(calls):
            gi = torch.Generator(device="cuda").manual_seed(100 * tokens + i)
            hidden = torch.randn(tokens, H, device="cuda", dtype=DTYPE, generator=gi)
            logits = torch.randn(tokens, E, device="cuda", generator=gi)
            weights, ids = moe_naive.route_topk_softmax(router_logits=logits, top_k=TOP_K, renormalize=True)
            routes.append(dict(hidden=hidden, topk_weights=weights, topk_ids=ids))
        fp8 = [lambda r=r: tm.fused_moe(**r, w13=q13, w2=q2, w13_scale=s13, w2_scale=s2) for r in routes]
        bf16 = [lambda r=r: tm.fused_moe(**r, w13=w13, w2=w2) for r in routes]
        distinct = sum(torch.unique(r["topk_ids"]).numel() for r in routes)
        r0 = routes[0]
        w8a16 = None  # the sorted path's other FP8 form (fp8_activations=unquantized): prefill sizes
        if tokens * TOP_K > moe_naive.PAIRS_PATH_MAX:
            w8a16 = functools.partial(
                tm.fused_moe, **r0, w13=q13, w2=q2, w13_scale=s13, w2_scale=s2, fp8_quantize_acts=False
            )
        cases.append(
            Case(
                op="fp8_moe[graph]" if calls > 1 else "fp8_moe",
                shape=f"T={tokens} E={E} k={TOP_K} I={INTER}" + (f" x{calls}" if calls > 1 else ""),
                ours=graphed(fp8) if calls > 1 else fp8[0],
                reference=graphed(bf16) if calls > 1 else bf16[0],
                reference_label="bf16 experts",
                check=lambda r0=r0: _rel_err(
                    tm.fused_moe(**r0, w13=q13, w2=q2, w13_scale=s13, w2_scale=s2),
                    moe_naive.fused_moe(**r0, w13=q13, w2=q2, w13_scale=s13, w2_scale=s2),
                ),
                tolerance=TOLERANCE,
                bytes_moved=distinct * 3 * INTER * H + calls * 4 * tokens * H,
                flops=calls * tokens * TOP_K * 6 * INTER * H,
                peer=w8a16,
                peer_label="W8A16 (activations unquantized)" if w8a16 else "",
                target="faster than bf16",
            )
        )
    return cases


def _quant_case(m: int) -> Case:
    x = torch.randn(m, H, device="cuda", dtype=DTYPE)
    return Case(
        op="quantize_act",
        shape=f"M={m} K={H} group=128",
        ours=lambda: fp8_kernels.quantize_act(x=x),
        reference=lambda: fp8_kernels.naive.quantize_act(x=x, group=128),
        reference_label="torch",
        check=lambda: float(
            not torch.equal(fp8_kernels.quantize_act(x=x)[1], fp8_kernels.naive.quantize_act(x=x, group=128)[1])
        ),
        tolerance=0.0,
        bytes_moved=m * H * 3 + m * (H // 128) * 4,
    )


# (block_n, num_warps): the one-row kernel's FP8 tiles, up to twice its bf16 bound (MAX_ELEMS_PER_THREAD)
FP8_ROW_TILES = [(1, 4), (2, 4), (2, 8), (4, 4), (4, 8), (8, 4), (8, 8), (16, 8), (16, 16), (32, 16)]


def row_sweep() -> None:
    """Batch 1, each model shape's FP8 projection (its tail rows in bf16, as the model holds them):
    the one-row kernel at every FP8_ROW_TILES tile, preloaded or not, against the bf16 one-row
    kernel's pick on the same rows (bf16 weights), each graph-timed over cold copies."""
    from deltaserve.bench.kernels import measure_copy_bandwidth

    bandwidth = measure_copy_bandwidth()
    for label, n, tail, k in SHAPES:
        _row_sweep_shape(label, n, tail, k, bandwidth)


def _row_sweep_shape(label: str, n: int, tail: int, k: int, bandwidth: float) -> None:
    from deltaserve.layers.kernels.device import device_info
    from deltaserve.layers.kernels.linear import triton_row

    copies = _weights(n, tail, k)
    calls = max(20, len(copies))
    pick = [copies[i % len(copies)] for i in range(calls)]
    x = torch.randn(1, k, device="cuda", dtype=DTYPE, generator=torch.Generator(device="cuda").manual_seed(1))
    fp8_bytes = n * k + tail * k * 2 + q_scale_bytes(copies[0][1])
    ref = naive.linear(x=x.float(), weight=copies[0][3].float())

    def time_us(fn) -> float:
        replay = graphed([lambda c=c: fn(c) for c in pick])
        return triton.testing.do_bench(replay, warmup=10, rep=50, return_mode="median") * 1e3 / calls

    def fp8_row(c, cfg: dict, preload: bool) -> torch.Tensor:
        return triton_row.row_gemv(x=x, weight=c[0], weight_scale=c[1], weight_tail=c[2], config=cfg, preload=preload)[
            0
        ]

    bf16_us = time_us(lambda c: triton_row.row_gemv(x=x, weight=c[3])[0])
    current = triton_row.pick_config(n + tail, k, device_info(torch.device("cuda")), fp8=True)
    print(f"{label} N8={n} tail={tail} K={k}: bf16 row GEMV {bf16_us:6.2f} us; FP8 pick {current}", flush=True)
    rows = []
    for block_n, warps in FP8_ROW_TILES:
        # e4m3 elements are half a bf16 one's registers: up to twice the bf16 bound a thread
        if block_n * triton.next_power_of_2(k) > 2 * triton_row.MAX_ELEMS_PER_THREAD * 32 * warps:
            continue
        for preload in (True, False):
            fn = functools.partial(fp8_row, cfg=dict(block_n=block_n, num_warps=warps), preload=preload)
            try:
                err = _rel_err(fn(copies[0]), ref)
                us = time_us(fn)
            except Exception as e:  # a tile that does not compile, or that the tail's rows cannot take
                print(f"  n{block_n} w{warps}: {type(e).__name__}: {str(e)[:80]}")
                continue
            rows.append((us, block_n, warps, preload, err))
    rows.sort()
    for us, block_n, warps, preload, err in rows[:8]:
        share = fp8_bytes / bandwidth / (us * 1e-6)
        mark = "  <- pick" if (block_n, warps) == (current["block_n"], current["num_warps"]) and preload else ""
        when = "preload" if preload else "after-wait"
        print(f"  n{block_n} w{warps} {when}: {us:6.2f} us  {100 * share:5.1f}% of copy BW  err {err:.1e}{mark}")
    now = next((r[0] for r in rows if (r[1], r[2], r[3]) == (current["block_n"], current["num_warps"], True)), None)
    if rows and now is not None and rows[0][0] < 0.97 * now and rows[0][3]:
        print(f"  TUNED_ROW_FP8[H200][({n + tail}, {k})] = dict(block_n={rows[0][1]}, num_warps={rows[0][2]})")


# (block_n, num_warps, group): the few-row kernel's FP8 tiles, 32 to 256 weights a thread
FP8_FEW_ROW_TILES = [(bn, w, g) for bn, w in ((2, 1), (4, 2), (4, 4), (8, 4), (8, 8), (16, 8)) for g in (1, 2, 4)]


def rows_sweep(tokens: list[int]) -> None:
    """2..8 rows, each model shape's FP8 projection (tail rows in bf16): the few-row kernel's FP8 tiles
    (rows a program, warps, rows a reduction group) with the weights loaded before the PDL wait, against
    its default tile, the skinny GEMM (the FP8 path above FP8_FEW_ROWS_MAX rows) and the bf16 few-row
    kernel on the same rows; graph-timed over cold copies, us per call."""
    from deltaserve.bench.kernels import measure_copy_bandwidth
    from deltaserve.layers.kernels.device import device_info
    from deltaserve.layers.kernels.linear import triton_linear, triton_rows

    bandwidth = measure_copy_bandwidth()
    info = device_info(torch.device("cuda"))
    for label, n, tail, k in SHAPES:
        copies = _weights(n, tail, k)
        calls = max(20, len(copies))
        pick = [copies[i % len(copies)] for i in range(calls)]
        fp8_bytes = n * k + tail * k * 2 + q_scale_bytes(copies[0][1])

        def time_us(fn, pick=pick, calls=calls) -> float:
            replay = graphed([lambda c=c: fn(c) for c in pick])
            return triton.testing.do_bench(replay, warmup=10, rep=50, return_mode="median") * 1e3 / calls

        for m in tokens:
            x = torch.randn(m, k, device="cuda", dtype=DTYPE, generator=torch.Generator(device="cuda").manual_seed(m))
            ref = naive.linear(x=x.float(), weight=copies[0][3].float())

            def rows(c, cfg=None, x=x):
                return triton_rows.rows_gemv(x=x, weight=c[0], weight_scale=c[1], weight_tail=c[2], config=cfg)[0]

            skinny = time_us(lambda c, x=x: triton_linear.linear(x=x, weight=c[0], weight_scale=c[1], weight_tail=c[2]))
            bf16 = time_us(lambda c, x=x: triton_rows.rows_gemv(x=x, weight=c[3])[0])
            default = triton_rows.pick_config(m, n + tail, k, info, fp8=True)
            default_us = time_us(rows)
            print(
                f"{label} M={m} N8={n} tail={tail} K={k}: FP8 few-row default {default} {default_us:6.2f} us "
                f"(err {_rel_err(rows(copies[0]), ref):.1e}); skinny {skinny:6.2f}; bf16 few-row {bf16:6.2f}",
                flush=True,
            )
            found = []
            for block_n, warps, group in FP8_FEW_ROW_TILES:
                if group > triton.next_power_of_2(m):
                    continue
                cfg = dict(block_n=block_n, num_warps=warps, group=group)
                try:
                    found.append((time_us(functools.partial(rows, cfg=cfg)), cfg))
                except Exception as e:  # a tile that does not compile or fit
                    print(f"  {cfg}: {type(e).__name__}: {str(e)[:80]}")
            for us, cfg in sorted(found, key=lambda r: r[0])[:5]:
                share = fp8_bytes / bandwidth / (us * 1e-6)
                tile = f"n{cfg['block_n']} w{cfg['num_warps']} g{cfg['group']}"
                print(f"  {tile}: {us:6.2f} us  {100 * share:5.1f}% of copy BW")


def q_scale_bytes(scale: torch.Tensor) -> int:
    return scale.numel() * scale.element_size()


def cases() -> list[Case]:
    out = [c for label, n, tail, k in SHAPES for c in _linear_cases(label, n, tail, k)]
    return out + _moe_cases() + [_quant_case(m) for m in (2048, 8192)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--row-sweep", action="store_true", help="batch 1: the FP8 one-row GEMV's tiles")
    parser.add_argument("--rows-sweep", action="store_true", help="2..8 rows (--tokens): the few-row FP8 tiles")
    parser.add_argument("--tokens", default="2,4,8", help="comma-separated rows for --rows-sweep")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.kernels_fp8 needs a CUDA device", file=sys.stderr)
        return 2
    if args.row_sweep:
        row_sweep()
        return 0
    if args.rows_sweep:
        rows_sweep([int(t) for t in args.tokens.split(",")])
        return 0
    from deltaserve.bench import kernels

    return kernels.main(["--only", "fp8"])


if __name__ == "__main__":
    sys.exit(main())
