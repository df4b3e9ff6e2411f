"""Dense projection cases at Qwen3.5-35B-A3B decode shapes (hidden 2048, bf16): the Triton skinny
GEMM (layers/kernels/linear) against cuBLAS (F.linear), both timed inside CUDA graphs.

Shapes (N, K): GDN in_proj (12352, 2048); fused attention q_gate|k|v (8192 + 512 + 512, 2048);
o_proj / GDN out_proj (2048, 4096); the MoE block's fused router | shared gate_up | shared gate
(256 + 1024 + 1, 2048); the shared expert's down_proj (2048, 512). Tokens M = 1 and 8.

Every row is CALLS back-to-back calls captured in one torch.cuda.CUDAGraph and replayed (eager launch
overhead, ~5 us, would swamp a 5 us kernel), each call on another copy of the weight so that the
copies together exceed L2 several times over (a decode step reads every layer's weights cold).
Time and floor are for all the calls of a row; "% of copy BW" is the floor over the time.

    python -m deltaserve.bench.kernels --only linear            # default configs vs cuBLAS
    python -m deltaserve.bench.kernels_linear --sweep           # every config, best per shape
    python -m deltaserve.bench.kernels_linear --sweep --tokens 1 --shapes 1288:2048,2048:4096 --json out.json
    python -m deltaserve.bench.kernels_linear --rows-sweep --tokens 2,4,8,16  # the few-row GEMV's tiles

The sweep prints, per (M, N, K), cuBLAS, the default pick and the fastest configs (us per call,
GB/s, % of copy BW, error, bit-reproducibility), then a summary and `TUNED[<device>][...] = {...}` lines to
paste into layers/kernels/linear/tuned.py where the best beats the default.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton

from deltaserve.bench.kernel_cases import Case, graphed
from deltaserve.layers.kernels import linear as linear_kernels
from deltaserve.layers.kernels.device import device_info
from deltaserve.layers.kernels.linear import naive
from deltaserve.layers.kernels.linear import triton_linear as tl_
from deltaserve.layers.kernels.linear.tuned import tuned_key

DTYPE = torch.bfloat16
SHAPES = [
    ("gdn_in_proj", 12352, 2048),
    ("attn_qkv", 8192 + 512 + 512, 2048),
    ("o_proj", 2048, 4096),
    ("moe_in", 1288, 2048),  # router 256 + shared gate_up 1,024 + shared gate 1, padded to 8
    ("shared_down", 2048, 512),
]
TOKENS = (1, 8)
COLD_BYTES = 256 << 20  # weight copies per row: at least this many bytes (H200 L2: 50 MB)
MIN_CALLS = 20
TOLERANCE = 1e-2  # max |out - ref| / max |ref| against float32 (bf16 output rounding is 2^-8)
_WEIGHTS: dict[tuple[int, int], list[torch.Tensor]] = {}


def _weights(n: int, k: int) -> list[torch.Tensor]:
    """Distinct weight copies of one shape, COLD_BYTES in all (shared by every row of the shape)."""
    if (n, k) not in _WEIGHTS:
        copies = max(2, math.ceil(COLD_BYTES / (n * k * 2)))
        g = torch.Generator(device="cuda").manual_seed(n * 7 + k)
        _WEIGHTS[(n, k)] = [torch.randn(n, k, device="cuda", dtype=DTYPE, generator=g) * k**-0.5 for _ in range(copies)]
    return _WEIGHTS[(n, k)]


def _x(m: int, k: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(m * 13 + k)
    return torch.randn(m, k, device="cuda", dtype=DTYPE, generator=g)


def _num_calls(n: int, k: int) -> int:
    return max(MIN_CALLS, len(_weights(n, k)))


def _bytes(m: int, n: int, k: int) -> int:
    return 2 * (n * k + m * k + m * n)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _calls(fn: Callable[[torch.Tensor, torch.Tensor], object], m: int, n: int, k: int) -> list[Callable[[], object]]:
    x, ws = _x(m, k), _weights(n, k)
    return [lambda w=w: fn(x, w) for w in (ws[i % len(ws)] for i in range(_num_calls(n, k)))]


def _ours(x: torch.Tensor, w: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    return tl_.linear(x=x, weight=w, config=config)


def _case(label: str, m: int, n: int, k: int) -> Case:
    calls = _num_calls(n, k)
    x, w = _x(m, k), _weights(n, k)[0]
    target = ">=70% of copy BW, faster than cuBLAS" if m == 1 else "faster than cuBLAS"
    return Case(
        op="linear[graph]",
        shape=f"{label} M={m} N={n} K={k} x{calls}",
        ours=graphed(_calls(lambda x, w: linear_kernels.linear(x=x, weight=w), m, n, k)),
        reference=graphed(_calls(lambda x, w: F.linear(x, w), m, n, k)),
        reference_label="cuBLAS",
        check=lambda: _rel_err(linear_kernels.linear(x=x, weight=w), naive.linear(x=x.float(), weight=w.float())),
        tolerance=TOLERANCE,
        bytes_moved=calls * _bytes(m, n, k),
        flops=calls * 2 * m * n * k,
        target=target,
    )


def cases() -> list[Case]:
    return [_case(label, m, n, k) for m in TOKENS for label, n, k in SHAPES]


# --- config sweep -----------------------------------------------------------------------------------

# GEMV form (block_n, block_k, num_warps): one or two 16-byte bf16 loads per row chunk per thread
GEMV_TILES = [(1, 1024, 4), (2, 512, 4), (2, 1024, 4), (4, 512, 4), (4, 512, 8), (4, 1024, 8), (8, 256, 4)]
GEMV_TILES += [(8, 512, 8), (16, 256, 8)]
# MMA form (block_n, block_k, num_warps, num_stages)
MMA_TILES = [(16, 128, 4, 4), (16, 256, 4, 3), (32, 128, 4, 4), (32, 256, 4, 3), (64, 128, 4, 4), (32, 64, 4, 6)]
MMA_TILES += [(64, 64, 4, 5)]
SPLITS = (1, 2, 4, 8, 16)


def sweep_configs(m: int, n: int, k: int, num_sms: int) -> list[dict]:
    """Configs worth timing at this shape: GEMV tiles (<= 4 rows per program; more rows take several
    row blocks) and MMA tiles, each at the splits that give between 1 and 16 programs per SM and
    keep >= 1 K chunk per split."""
    out = []
    bm = min(4, tl_.m_bucket(m))
    gemv_tiles = GEMV_TILES if m <= 4 else [(2, 512, 4), (4, 512, 8), (2, 1024, 8)]
    tiles = [dict(block_m=bm, block_n=bn, block_k=bk, num_warps=w, dot=False) for bn, bk, w in gemv_tiles]
    mma_tiles = MMA_TILES if m > 4 else MMA_TILES[:4]
    tiles += [dict(block_n=bn, block_k=bk, num_warps=w, num_stages=s, dot=True) for bn, bk, w, s in mma_tiles]
    seen = set()
    for tile in tiles:
        for split in SPLITS:
            cfg = tl_.resolve({**tile, "split_k": split}, m, n, k, DTYPE)
            programs = math.ceil(n / cfg["block_n"]) * math.ceil(m / cfg["block_m"]) * cfg["split_k"]
            key = tuple(sorted((a, b) for a, b in cfg.items() if a != "k_split"))
            if cfg["split_k"] != split or key in seen or not num_sms <= programs <= 16 * num_sms:
                continue
            seen.add(key)
            out.append({**tile, "split_k": split})
    return out


def _time_graph(replay: Callable[[], None], calls: int) -> float:
    """Microseconds per call, median over replays."""
    import triton.testing

    return triton.testing.do_bench(replay, warmup=5, rep=40, return_mode="median") * 1e3 / calls


def _public(cfg: dict) -> dict:
    return {a: b for a, b in cfg.items() if a != "k_split"}


def _sweep_case(m: int, n: int, k: int, num_sms: int) -> dict:
    """Every sweep config at one shape (and the default pick, and cuBLAS), timed in graphs."""
    calls = _num_calls(n, k)
    x, w = _x(m, k), _weights(n, k)[0]
    ref = naive.linear(x=x.float(), weight=w.float())
    default = _public(tl_.resolve(tl_.pick_config(m, n, k, DTYPE, device_info(x.device)), m, n, k, DTYPE))
    cublas_us = _time_graph(graphed(_calls(lambda x, w: F.linear(x, w), m, n, k)), calls)
    configs = sweep_configs(m, n, k, num_sms)
    if default not in [_public(tl_.resolve(c, m, n, k, DTYPE)) for c in configs]:
        configs.append(default)
    rows = []
    for cfg in configs:
        try:
            out = _ours(x, w, cfg)
            err = _rel_err(out, ref)
            same = torch.equal(out, _ours(x, w, cfg))
            us = _time_graph(graphed(_calls(lambda x, w, cfg=cfg: _ours(x, w, cfg), m, n, k)), calls)
        except Exception as e:  # a config that does not compile or fit is reported, not fatal
            print(f"  {cfg} failed: {type(e).__name__}: {str(e)[:100]}", flush=True)
            continue
        rows.append(dict(us=us, cfg=_public(tl_.resolve(cfg, m, n, k, DTYPE)), err=err, reproducible=same))
    rows.sort(key=lambda r: r["us"])
    best = next((r for r in rows if r["err"] <= TOLERANCE and r["reproducible"]), None)
    passed = None
    if best is not None and best["cfg"]["split_k"] > 1:  # the best split-K config, two-kernel reduction
        cfg = {**best["cfg"], "reduce": "pass"}
        us = _time_graph(graphed(_calls(lambda x, w: _ours(x, w, cfg), m, n, k)), calls)
        passed = dict(us=us, cfg=cfg, err=_rel_err(_ours(x, w, cfg), ref), reproducible=True)
    return dict(
        m=m,
        n=n,
        k=k,
        configs=len(configs),
        cublas_us=cublas_us,
        default=default,
        default_row=next((r for r in rows if r["cfg"] == default), None),
        best=best,
        passed=passed,
        rows=rows,
    )


def sweep(tokens: list[int], shapes: list[tuple[str, int, int]], json_path: str | None) -> None:
    from deltaserve.bench.kernels import measure_copy_bandwidth

    bandwidth = measure_copy_bandwidth()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    name = torch.cuda.get_device_name()
    print(f"device: {name}  SMs {num_sms}  copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    results, summary, tuned = [], [], []
    for m in tokens:
        for label, n, k in shapes:
            started = time.perf_counter()
            res = _sweep_case(m, n, k, num_sms)
            nbytes = _bytes(m, n, k)

            def line(tag: str, r: dict | None, us: float | None = None, nbytes: int = nbytes) -> str:
                us = r["us"] if r is not None else us
                gbs = nbytes / (us * 1e-6) / 1e9
                text = f"  {tag:<8} {us:7.2f} us {gbs:6.0f} GB/s {100 * gbs * 1e9 / bandwidth:4.0f}%"
                if r is not None:
                    text += f"  err {r['err']:.1e}{'' if r['reproducible'] else ' NONDET'}  {_short(r['cfg'])}"
                return text

            took = time.perf_counter() - started
            print(f"M={m} N={n} K={k} ({label}): {res['configs']} configs in {took:.0f}s", flush=True)
            print(line("cuBLAS", None, res["cublas_us"]))
            if res["default_row"] is not None:
                print(line("default", res["default_row"]))
            for r in res["rows"][:5]:
                print(line("", r))
            if res["passed"] is not None:
                print(line("pass", res["passed"]))
            best, default_row = res["best"], res["default_row"]
            if best is not None:
                bw = 100 * nbytes / (best["us"] * 1e-6) / bandwidth
                text = f"M={m:<2} {label:<12} N={n:<5} K={k:<4} best {best['us']:6.2f} us ({bw:3.0f}% of copy BW)"
                text += f" cuBLAS {res['cublas_us']:6.2f} us ({res['cublas_us'] / best['us']:.2f}x)"
                if default_row is not None:
                    text += f" default {default_row['us']:6.2f} us"
                summary.append(text)
                if default_row is None or best["us"] < 0.97 * default_row["us"]:
                    tuned.append(f"TUNED[{name!r}][{tuned_key(m, n, k)}] = {best['cfg']!r}")
            results.append(dict(res, label=label))
            if json_path:
                with open(json_path, "w") as f:
                    json.dump({"device": name, "copy_bw": bandwidth, "cases": results}, f, indent=1)
    print("summary:")
    for text in summary:
        print("  " + text)
    print("paste into layers/kernels/linear/tuned.py (where the best beats the default by >3%):")
    for text in tuned:
        print(text)


# --- one-row kernel (triton_row.py) ------------------------------------------------------------------

ROW_TILES = [(1, 4), (2, 4), (2, 8), (4, 4), (4, 8), (8, 8)]  # (block_n, num_warps)
ROW_PERSISTENT = (None, 2, 4, 8)  # programs per SM (None: one program per row block)


def row_sweep(shapes: list[tuple[str, int, int]]) -> None:
    """Batch 1: the one-row kernel's tiles (one program per row block, or persistent programs
    looping over blocks), weights loaded before or after the PDL wait, against the GEMV form of
    triton_linear (its tuned or heuristic tiles); then the input norm fused into it (exact, and
    with 1 / rms deferred to after the dot) at the best tiles of each form, against the norm kernel
    followed by the one-row GEMV. Graph-timed, us per call."""
    from deltaserve.layers.kernels import norm as norm_kernels
    from deltaserve.layers.kernels.linear import triton_row

    for label, n, k in shapes:
        if not triton_row.supports(1, k, DTYPE):
            continue
        calls = _num_calls(n, k)
        gemv_us = _time_graph(graphed(_calls(lambda x, w: tl_.linear(x=x, weight=w), 1, n, k)), calls)
        print(
            f"{label} N={n} K={k}: triton_linear GEMV {gemv_us:6.2f} us  (default row config "
            f"{triton_row.pick_config(n, k, device_info(torch.device('cuda')))})",
            flush=True,
        )
        rows = []
        for block_n, warps in ROW_TILES:
            if block_n * triton.next_power_of_2(k) > triton_row.MAX_ELEMS_PER_THREAD * 32 * warps:
                continue
            for per_sm in ROW_PERSISTENT:
                for preload in (True, False):
                    cfg = dict(block_n=block_n, num_warps=warps, persistent=per_sm)

                    def fn(x, w, cfg=cfg, preload=preload):
                        return triton_row.row_gemv(x=x, weight=w, config=cfg, preload=preload)

                    us = _time_graph(graphed(_calls(fn, 1, n, k)), calls)
                    rows.append((us, block_n, warps, per_sm, preload))
        rows.sort(key=lambda r: r[0])
        for us, block_n, warps, per_sm, preload in rows[:8]:
            form = f"persistent {per_sm}/SM" if per_sm else "a program per block"
            print(f"  row n{block_n} w{warps} {form} {'preload' if preload else 'after-wait'}: {us:6.2f} us")
        residual = _x(1, k) * 3
        norm_w = torch.zeros(k, device="cuda", dtype=DTYPE)
        best = {}
        for _us, block_n, warps, per_sm, _ in rows:  # the fastest tiles of each form
            best.setdefault(per_sm is not None, dict(block_n=block_n, num_warps=warps, persistent=per_sm))
        for cfg in best.values():

            def fused(x, w, residual=residual, norm_w=norm_w, cfg=cfg, defer=False):
                return triton_row.row_gemv(
                    x=x, weight=w, residual=residual, norm_weight=norm_w, config=cfg, defer_norm=defer
                )

            def unfused(x, w, residual=residual, norm_w=norm_w, cfg=cfg):
                y, _ = norm_kernels.fused_add_rms_norm(x=x, residual=residual, weight=norm_w, eps=1e-6)
                return triton_row.row_gemv(x=y, weight=w, config=cfg)

            fused_us = _time_graph(graphed(_calls(fused, 1, n, k)), calls)
            deferred_us = _time_graph(graphed(_calls(lambda x, w, f=fused: f(x, w, defer=True), 1, n, k)), calls)
            unfused_us = _time_graph(graphed(_calls(unfused, 1, n, k)), calls)
            print(
                f"  {cfg}: add+norm fused {fused_us:6.2f} us, deferred 1/rms {deferred_us:6.2f} us"
                f"  vs norm kernel + row GEMV {unfused_us:6.2f} us",
                flush=True,
            )


# --- few-row kernel (triton_rows.py) ----------------------------------------------------------------

FEW_ROW_TILES = [(1, 4), (1, 8), (2, 4), (2, 8), (4, 8), (8, 8)]  # (block_n, num_warps)
FEW_ROW_GROUPS = (1, 2, 4, 8)


def rows_sweep(tokens: list[int], shapes: list[tuple[str, int, int]]) -> None:
    """2..16 rows: the few-row kernel's tiles (rows per program, warps, rows per reduction group,
    weights before or after the PDL wait) against the skinny GEMM's pick, cuBLAS and the one-row
    GEMV on one row (the time the few-row kernel aims at). Graph-timed, us per call."""
    from deltaserve.layers.kernels.linear import triton_row, triton_rows

    info = device_info(torch.device("cuda"))
    for label, n, k in shapes:
        calls = _num_calls(n, k)
        one_row = _time_graph(graphed(_calls(lambda x, w: triton_row.row_gemv(x=x, weight=w)[0], 1, n, k)), calls)
        for m in tokens:
            if m < 2 or not triton_rows.supports(m, k, DTYPE):
                continue
            skinny = _time_graph(graphed(_calls(lambda x, w: tl_.linear(x=x, weight=w), m, n, k)), calls)
            cublas = _time_graph(graphed(_calls(lambda x, w: F.linear(x, w), m, n, k)), calls)
            default = triton_rows.pick_config(m, n, k, info)
            rows = []
            for block_n, warps in FEW_ROW_TILES:
                for group in FEW_ROW_GROUPS:
                    per_thread = group * block_n * triton.next_power_of_2(k) / (32 * warps)
                    if group > triton.next_power_of_2(m) or per_thread > 4 * triton_rows.MAX_PRODUCT_PER_THREAD:
                        continue
                    for preload in (True, False):
                        cfg = dict(block_n=block_n, num_warps=warps, group=group)

                        def fn(x, w, cfg=cfg, preload=preload):
                            return triton_rows.rows_gemv(x=x, weight=w, config=cfg, preload=preload)

                        rows.append((_time_graph(graphed(_calls(fn, m, n, k)), calls), cfg, preload))
            rows.sort(key=lambda r: r[0])
            default_us = _time_graph(
                graphed(_calls(lambda x, w, c=default: triton_rows.rows_gemv(x=x, weight=w, config=c), m, n, k)), calls
            )
            x, w = _x(m, k), _weights(n, k)[0]
            err = _rel_err(triton_rows.rows_gemv(x=x, weight=w)[0], naive.linear(x=x.float(), weight=w.float()))
            print(
                f"{label} M={m} N={n} K={k}: few-row default {default} {default_us:6.2f} us (err {err:.1e}); "
                f"skinny {skinny:6.2f}, cuBLAS {cublas:6.2f}, one-row GEMV at M=1 {one_row:6.2f}",
                flush=True,
            )
            for us, cfg, preload in rows[:5]:
                when = "preload" if preload else "after-wait"
                print(f"  n{cfg['block_n']} w{cfg['num_warps']} g{cfg['group']} {when}: {us:6.2f} us")


def _short(cfg: dict) -> str:
    c = _public(cfg)
    form = "mma" if c["dot"] else f"gemv{c['block_m']}"
    s = f"{form} n{c['block_n']} k{c['block_k']} s{c['split_k']} w{c['num_warps']}"
    if c["dot"]:
        s += f" st{c['num_stages']}"
    return s + (" pass" if c["split_k"] > 1 and c["reduce"] == "pass" else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="time every config per shape (else: the cases)")
    parser.add_argument("--row-sweep", action="store_true", help="batch 1: the one-row kernel's tiles")
    parser.add_argument("--rows-sweep", action="store_true", help="2..16 rows (--tokens): the few-row kernel's tiles")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated M values")
    parser.add_argument("--shapes", default=None, help="comma-separated N:K (default: the five model shapes)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.kernels_linear needs a CUDA device", file=sys.stderr)
        return 2
    shapes = SHAPES
    if args.shapes:
        shapes = [(f"{nk}", *map(int, nk.split(":"))) for nk in args.shapes.split(",")]
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.sweep:
        sweep(tokens, shapes, args.json)
        return 0
    if args.row_sweep:
        row_sweep(shapes)
        return 0
    if args.rows_sweep:
        rows_sweep(tokens, shapes)
        return 0
    import importlib

    from deltaserve.bench import kernels

    # the runner imports this module by name (under -m it is a second copy of __main__)
    module = importlib.import_module("deltaserve.bench.kernels_linear")
    module.SHAPES, module.TOKENS = shapes, tuple(tokens)
    return kernels.main(["--only", "linear"] + (["--json", args.json] if args.json else []))


if __name__ == "__main__":
    sys.exit(main())
