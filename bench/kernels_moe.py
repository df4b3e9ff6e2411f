"""MoE cases at Qwen3.5-35B-A3B shapes (hidden 2048, 256 experts, top-8, expert width 512, bf16).

- router: route_topk_softmax for 1 / 64 / 256 / 8192 tokens against torch's softmax + topk
  (naive.route_topk_softmax), and 40 batch-1 calls (one decode step's layers) in a CUDA graph.
- fused_moe: 1 / 16 / 64 / 256 tokens on the default path against the per-expert torch loop
  (naive.fused_moe on GPU), called eagerly: at small batches that time includes the launches.
- fused_moe+shared[graph]: GRAPH_CALLS blocks' experts with the shared expert folded into the last
  kernel, against the routed kernels plus the torch composition of the shared expert's tail (silu,
  mul, down GEMM, sigmoid, mul, add: six launches per block), at batch 1 and 8 (pairs path) and 16 and 64 (sorted path).
- fused_moe[graph]: GRAPH_CALLS calls with distinct routings captured in one CUDA graph, each path
  at decode batches: the kernels' own time with no launch gaps, and cold weights in every call
  (each call routes to other experts than the one before). Time and floor are for all the calls.

    python -m deltaserve.bench.kernels --only moe
    python -m deltaserve.bench.kernels_moe --sweep --tokens 1   # tile sweep of the chosen path (graph-timed)
    python -m deltaserve.bench.kernels_moe --sweep --tokens 8 --path sorted
    python -m deltaserve.bench.kernels_moe --sweep --tokens 2048 --kernel down   # prefill: one GEMM's tiles
    python -m deltaserve.bench.kernels_moe --sweep --tokens 4096 --kernel both   # block_m x both GEMMs' best
    python -m deltaserve.bench.kernels_moe --sweep --tokens 8192 --kernel order  # the grid's program order
    python -m deltaserve.bench.kernels_moe --sweep --tokens 8192 --kernel tma    # weights through TMA descriptors
    python -m deltaserve.bench.kernels_moe --sweep --tokens 2048 --kernel both --fp8  # FP8 experts (W8A8)
    python -m deltaserve.bench.kernels_moe --sweep --tokens 8192 --kernel grouped  # ours vs torch's grouped GEMM
    python -m deltaserve.bench.kernels_moe --sweep --tokens 8192 --kernel routing  # router + grouping launch shapes
    scripts/gpu-session moe-sweep   # the prefill sweeps, each compiled in 16 processes first
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from deltaserve.bench.kernel_cases import Case, graphed
from deltaserve.layers.kernels import linear as linear_kernels
from deltaserve.layers.kernels.device import device_info
from deltaserve.layers.kernels.moe import naive, tiles
from deltaserve.layers.kernels.moe import triton_moe as tm
from deltaserve.layers.kernels.moe.naive import SharedExpert

H, E, TOP_K, INTER = 2048, 256, 8, 512
DTYPE = torch.bfloat16
EXPERT_BYTES = 3 * INTER * H * 2
GRAPH_CALLS = 16
_WEIGHTS: dict[str, torch.Tensor] = {}


def _weights() -> tuple[torch.Tensor, torch.Tensor]:
    """One set of expert weights (1.5 GB) shared by every case."""
    if not _WEIGHTS:
        g = torch.Generator(device="cuda").manual_seed(0)
        _WEIGHTS["w13"] = torch.randn(E, 2 * INTER, H, device="cuda", dtype=DTYPE, generator=g) * H**-0.5
        _WEIGHTS["w2"] = torch.randn(E, H, INTER, device="cuda", dtype=DTYPE, generator=g) * INTER**-0.5
    return _WEIGHTS["w13"], _WEIGHTS["w2"]


def _fp8_weights() -> dict:
    """The same experts block-quantized (128 x 128 scales, as FP8 checkpoints), made once."""
    if "q13" not in _WEIGHTS:
        from deltaserve.layers.kernels import fp8 as fp8_kernels

        w13, w2 = _weights()
        _WEIGHTS["q13"], _WEIGHTS["s13"] = fp8_kernels.quantize_weight(w13)
        _WEIGHTS["q2"], _WEIGHTS["s2"] = fp8_kernels.quantize_weight(w2)
    return dict(w13=_WEIGHTS["q13"], w2=_WEIGHTS["q2"], w13_scale=_WEIGHTS["s13"], w2_scale=_WEIGHTS["s2"])


def _inputs(num_tokens: int, seed: int, fp8: bool = False, w8a16: bool = False) -> dict:
    w13, w2 = _weights()
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(num_tokens, H, device="cuda", dtype=DTYPE, generator=g)
    logits = torch.randn(num_tokens, E, device="cuda", generator=g)
    weights, ids = naive.route_topk_softmax(router_logits=logits, top_k=TOP_K, renormalize=True)
    experts = _fp8_weights() if fp8 else dict(w13=w13, w2=w2)
    if fp8 and w8a16:  # the sorted path's FP8 experts on unquantized activations (fp8_activations)
        experts["fp8_quantize_acts"] = False
    return dict(hidden=hidden, **experts, topk_weights=weights.to(DTYPE), topk_ids=ids, expert_offset=0)


def _routed(args: dict, seed: int) -> dict:
    """_inputs' case as routed_moe takes it: router logits (the same generator's) instead of the routing."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(args["hidden"].shape[0], E, device="cuda", generator=g).to(DTYPE)
    out = {k: v for k, v in args.items() if k not in ("topk_weights", "topk_ids")}
    return dict(out, router_logits=logits, top_k=TOP_K, renormalize=True)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| over max |ref|: the outputs' scale depends on the routing."""
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _moe_bytes(args: dict) -> int:
    if "router_logits" in args:  # a routed case (_routed): its routing, as the router picks it
        _, ids = naive.route_topk_softmax(router_logits=args["router_logits"].float(), top_k=TOP_K, renormalize=True)
        args = dict(args, topk_ids=ids)
    num_tokens = args["hidden"].shape[0]
    routed = torch.unique(args["topk_ids"]).numel()
    expert_bytes = EXPERT_BYTES // args["w13"].element_size() if "w13_scale" in args else EXPERT_BYTES
    return routed * expert_bytes + 2 * num_tokens * H * 2 + num_tokens * TOP_K * (8 + 2)


# --- router ---------------------------------------------------------------------------------------


def _router_err(logits: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> float:
    """Largest weight difference against torch, and inf if an id points at an expert whose renormalised
    probability is not the weight it came with (bf16 logits tie now and then, and torch orders ties
    its own way, so ids are checked through the probabilities rather than compared)."""
    ref_w, _ = naive.route_topk_softmax(router_logits=logits, top_k=TOP_K, renormalize=True)
    picked = torch.softmax(logits.float(), dim=-1).gather(1, ids)
    picked = picked / picked.sum(dim=-1, keepdim=True)
    distinct = bool((ids.sort(dim=-1).values.diff(dim=-1) > 0).all())
    if not distinct or (picked - weights).abs().max().item() > 1e-5:
        return float("inf")
    return (weights - ref_w).abs().max().item()


def _router_case(num_tokens: int) -> Case:
    logits = torch.randn(num_tokens, E, device="cuda", dtype=DTYPE)  # the router GEMV's output dtype
    kw = dict(router_logits=logits, top_k=TOP_K, renormalize=True)
    return Case(
        op="route_topk_softmax",
        shape=f"T={num_tokens} E={E} k={TOP_K}",
        ours=lambda: tm.route_topk_softmax(**kw),
        reference=lambda: naive.route_topk_softmax(**kw),
        reference_label="torch softmax+topk",
        check=lambda: _router_err(logits, *tm.route_topk_softmax(**kw)),
        tolerance=1e-5,
        bytes_moved=num_tokens * E * 2 + num_tokens * TOP_K * (4 + 8),
        target="one launch; T=8192 >=3x torch" if num_tokens in (1, 8192) else "",
    )


def _router_step_case(layers: int = 40) -> Case:
    """One decode step's routers (batch 1, one per MoE layer) in a CUDA graph: launch-bound, the
    number that moves the decode step."""
    logits = [torch.randn(1, E, device="cuda", dtype=DTYPE) for _ in range(layers)]
    kws = [dict(router_logits=x, top_k=TOP_K, renormalize=True) for x in logits]
    return Case(
        op="route_topk_softmax[graph]",
        shape=f"T=1 E={E} k={TOP_K} x{layers} calls",
        ours=graphed([lambda kw=kw: tm.route_topk_softmax(**kw) for kw in kws]),
        reference=graphed([lambda kw=kw: naive.route_topk_softmax(**kw) for kw in kws]),
        reference_label="torch softmax+topk",
        check=lambda: _router_err(logits[0], *tm.route_topk_softmax(**kws[0])),
        tolerance=1e-5,
        bytes_moved=layers * (E * 2 + TOP_K * 12),
        target="<=0.1 ms per 40 calls",
    )


# --- fused MoE ------------------------------------------------------------------------------------


def _case(num_tokens: int) -> Case:
    args = _inputs(num_tokens, seed=num_tokens)
    target = ""
    if num_tokens == 1:
        target = ">=60% of copy BW (routed experts' weights)"
    elif num_tokens == 256:
        target = ">=3x faster than the per-expert torch.mm loop"
    return Case(
        op="fused_moe",
        shape=f"T={num_tokens} H={H} E={E} k={TOP_K} I={INTER}",
        ours=lambda: tm.fused_moe(**args),
        reference=lambda: naive.fused_moe(**args),
        reference_label="per-expert torch.mm",
        check=lambda: _rel_err(tm.fused_moe(**args), naive.fused_moe(**args)),
        tolerance=2e-2,
        bytes_moved=_moe_bytes(args),
        flops=2 * num_tokens * TOP_K * 3 * H * INTER,
        target=target,
    )


def _graph_case(num_tokens: int, path: str, config: dict | None = None) -> Case:
    """GRAPH_CALLS fused_moe calls on `path`, distinct routings, one graph."""
    calls = GRAPH_CALLS if num_tokens <= 256 else 4
    sets = [_inputs(num_tokens, seed=1000 * num_tokens + i) for i in range(calls)]
    replay = graphed([lambda a=a: tm.fused_moe(**a, path=path, config=config) for a in sets])
    target = ">=60% of copy BW" if num_tokens <= 16 and path == "pairs" else ""
    return Case(
        op=f"fused_moe[graph,{path}]",
        shape=f"T={num_tokens} x{GRAPH_CALLS} calls",
        ours=replay,
        reference=None,
        reference_label="",
        check=lambda: _rel_err(tm.fused_moe(**sets[0], path=path, config=config), naive.fused_moe(**sets[0])),
        tolerance=2e-2,
        bytes_moved=sum(_moe_bytes(a) for a in sets),
        flops=GRAPH_CALLS * 2 * num_tokens * TOP_K * 3 * H * INTER,
        target=target,
    )


def _shared_graph_case(num_tokens: int) -> Case:
    """GRAPH_CALLS MoE blocks' expert part with the shared expert (distinct routings and shared
    weights), one graph: folded into fused_moe's last kernel against the routed kernels followed by
    the torch composition the model ran before (silu, mul, down GEMM, sigmoid, mul, add)."""
    g = torch.Generator(device="cuda").manual_seed(7)
    sets = []
    for i in range(GRAPH_CALLS):
        args = _inputs(num_tokens, seed=5000 + 100 * num_tokens + i)
        proj = torch.randn(num_tokens, E + 2 * INTER + 8, device="cuda", dtype=DTYPE, generator=g)
        gate_row = E + 2 * INTER
        w2 = torch.randn(H, INTER, device="cuda", dtype=DTYPE, generator=g) * INTER**-0.5
        args["shared"] = SharedExpert(gate_up=proj[:, E:gate_row], w2=w2, gate_logit=proj[:, gate_row : gate_row + 1])
        sets.append(args)

    def composed(a: dict) -> torch.Tensor:
        routed = tm.fused_moe(**{k: v for k, v in a.items() if k != "shared"})
        s = a["shared"]
        act = F.silu(s.gate_up[:, :INTER]) * s.gate_up[:, INTER:]
        return routed + torch.sigmoid(s.gate_logit) * linear_kernels.linear(x=act, weight=s.w2)

    shared_bytes = GRAPH_CALLS * H * INTER * 2
    return Case(
        op="fused_moe+shared[graph]",
        shape=f"T={num_tokens} x{GRAPH_CALLS} calls",
        ours=graphed([lambda a=a: tm.fused_moe(**a) for a in sets]),
        reference=graphed([lambda a=a: composed(a) for a in sets]),
        reference_label="routed + torch composition (6 launches)",
        check=lambda: _rel_err(tm.fused_moe(**sets[0]), naive.fused_moe(**sets[0])),
        tolerance=2e-2,
        bytes_moved=sum(_moe_bytes(a) for a in sets) + shared_bytes,
        target="faster than the composition",
    )


GRAPH_CASES = [(1, "pairs"), (4, "pairs"), (8, "pairs"), (8, "sorted")]
GRAPH_CASES += [(16, "pairs"), (16, "sorted"), (32, "pairs"), (32, "sorted")]


def cases() -> list[Case]:
    out = [_router_case(t) for t in (1, 64, 256, 8192)]
    out.append(_router_step_case())
    out += [_shared_graph_case(t) for t in (1, 8, 16, 64)]
    out += [_case(t) for t in (1, 16, 64, 256)]
    out += [_graph_case(t, path) for t, path in GRAPH_CASES]
    return out


# --- tile sweeps ----------------------------------------------------------------------------------


def _tiles(block_n: int, block_k: int, num_warps: int, num_stages: int) -> dict:
    return dict(block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages)


# prefill sizes (this many routed rows per expert or more): the sorted GEMMs' tiles swept one kernel at
# a time, block_m shared by both (one alignment of the pairs)
PREFILL_SWEEP_ROWS = 48


# kernel "both": block_m against the best tiles of each GEMM's own sweeps at 2k and 8k (H200, ecb59bc)
JOINT_UP = [(64, 128, 4, 3), (256, 64, 8, 3), (128, 64, 8, 4), (64, 64, 8, 3)]
JOINT_DOWN = [(256, 64, 8, 4), (256, 64, 8, 3), (128, 64, 8, 3), (64, 128, 4, 3)]
# FP8 experts (W8A8): one 128-column scale group a K step; the up GEMM holds two accumulators and
# two scaled partial products, so that wide tiles want 8 warps
FP8_JOINT_UP = [(64, 128, 4, 3), (64, 128, 8, 4), (128, 128, 8, 3), (128, 128, 4, 4)]
FP8_JOINT_DOWN = [(128, 128, 4, 3), (128, 128, 8, 4), (256, 128, 8, 3), (64, 128, 4, 4)]


def _default(num_tokens: int, fp8: bool, w8a16: bool = False) -> dict:
    info = device_info(torch.device("cuda"))
    return tiles.sorted_config(num_tokens * TOP_K, E, 2, info, fp8=fp8, quantized_acts=not w8a16)


def _sweep_configs(
    path: str, num_tokens: int = 1, kernel: str = "up", fp8: bool = False, w8a16: bool = False
) -> list[dict]:
    if path == "sorted" and kernel == "both" and fp8:
        # 16-row tiles: decode batches (9..64 tokens: 0.3-2 rows an expert)
        grid = itertools.product([16, 32, 64, 128], FP8_JOINT_UP, FP8_JOINT_DOWN)
        configs = [dict(block_m=bm, up=_tiles(*up), down=_tiles(*down)) for bm, up, down in grid]
        default = _default(num_tokens, fp8, w8a16)
        return configs + ([] if default in configs else [default])
    if path == "sorted" and kernel == "persistent":
        return _persistent_configs(_default(num_tokens, fp8, w8a16))
    if fp8 and path != "pairs":
        raise SystemExit("--fp8: on the pairs path, or with --kernel both or persistent on the sorted path")
    if path == "sorted" and kernel == "order":  # the default tiles, row-block-major against N-major grids
        default = tiles.sorted_config(num_tokens * TOP_K, E, 2, device_info(torch.device("cuda")))
        return [{**default, "n_major": False}, {**default, "n_major": True}]
    if path == "sorted" and kernel == "tma":  # the default tiles: weights by pointers or TMA, act gathered or TMA
        default = tiles.sorted_config(num_tokens * TOP_K, E, 2, device_info(torch.device("cuda")))
        return [
            {**default, "w_tma": False},
            {**default, "w_tma": True},
            {**default, "w_tma": True, "a_tma": True},
            {**default, "w_tma": True, "a_tma": True, "persistent": "flat"},
        ]
    if path == "sorted" and kernel == "both":
        grid = itertools.product([16, 32, 64, 128], JOINT_UP, JOINT_DOWN)
        configs = [dict(block_m=bm, up=_tiles(*up), down=_tiles(*down)) for bm, up, down in grid]
        default = tiles.sorted_config(num_tokens * TOP_K, E, 2, device_info(torch.device("cuda")))
        return configs + ([] if default in configs else [default])
    if path == "sorted" and num_tokens * TOP_K / E >= PREFILL_SWEEP_ROWS:
        default = tiles.sorted_config(num_tokens * TOP_K, E, 2, device_info(torch.device("cuda")))
        grid = itertools.product([32, 64, 128], [64, 128, 256], [64, 128], [4, 8], [3, 4])
        other = "down" if kernel == "up" else "up"
        return [{"block_m": bm, kernel: _tiles(bn, bk, w, st), other: default[other]} for bm, bn, bk, w, st in grid]
    if path == "pairs" and kernel == "route":  # the routing up GEMV (batches up to route_in_up_max_tokens)
        default = tiles.pairs_config(H, INTER, device_info(torch.device("cuda")), fp8=fp8)
        chunks = [512, 1024, 2048] if fp8 else [512, 1024]
        # FP8: a program's routing is the same work as bf16's over half the bytes, so more rows a program
        grid = itertools.product([1, 2, 4] if fp8 else [1, 2], chunks, [1, 2])
        return [{**default, "up_route": dict(block_n=n, block_k=k, num_warps=w)} for n, k, w in grid]
    if path == "pairs":
        chunks = [512, 1024, 2048] if fp8 else [512, 1024]  # FP8: the same bytes in twice the columns
        ups = [dict(block_n=n, block_k=k, num_warps=w) for n, k, w in itertools.product([2, 4, 8], chunks, [2, 4])]
        downs = [dict(block_h=h, block_i=512, num_warps=w) for h, w in itertools.product([1, 2, 4, 8], [1, 2, 4])]
        # the up and down kernels are independent: sweep each against the other's default
        default = tiles.pairs_config(H, INTER, device_info(torch.device("cuda")), fp8=fp8)
        return [{**default, "up": u} for u in ups] + [{**default, "down": d} for d in downs]
    return [
        dict(block_m=bm, up=_tiles(bn, bk, w, s), down=_tiles(bn, bk, w, s))
        for bm, bn, bk, w, s in itertools.product([16, 32], [64, 128], [64, 128], [4, 8], [3, 4])
    ]


def _persistent_configs(default: dict) -> list[dict]:
    """The default tiles as one program a tile, then as persistent programs (sorted._grid: as many a
    multiprocessor as their shared memory allows): "loop" (each tile's K loop pipelined alone), "flat"
    (one pipelined loop over tiles and K steps), and "flat" with a stage less (the flattened loop
    holds the next tile's operands too: 224 KB of shared memory at the 8k tiles, sm_90)."""
    fewer = {name: {**default[name], "num_stages": max(2, default[name]["num_stages"] - 1)} for name in ("up", "down")}
    return [
        {**default, "persistent": ""},
        {**default, "persistent": "loop"},
        {**default, "persistent": "flat"},
        {**default, **fewer, "persistent": "flat"},
    ]


def sweep(
    num_tokens: int, path: str | None, kernel: str = "up", compile_only: bool = False, shard: str = "0/1",
    fp8: bool = False, w8a16: bool = False,
) -> None:  # fmt: skip
    """Tile configs of one path at this batch, each timed as graph-captured calls with distinct
    routings (GRAPH_CALLS; 4 at prefill sizes): time per call, share of copy BW, TFLOP/s, error.
    kernel: at prefill sizes, the sorted GEMM whose tiles are swept (the other keeps its default).
    compile_only: each config of shard "i/n" (every n-th from the i-th) run once, untimed: several
    such processes fill Triton's on-disk cache side by side, so that the timed sweep only loads.
    fp8: the experts block-quantized (W8A8 on the sorted path; w8a16: the activations left unquantized),
    against their float32 reference."""
    import triton.testing

    from deltaserve.bench.kernels import measure_copy_bandwidth

    path = path or ("pairs" if num_tokens * TOP_K <= tm.PAIRS_PATH_MAX else "sorted")
    if compile_only:
        index, count = (int(v) for v in shard.split("/"))
        args = _inputs(num_tokens, seed=0, fp8=fp8, w8a16=w8a16)
        for cfg in _sweep_configs(path, num_tokens, kernel, fp8, w8a16)[index::count]:
            try:
                tm.fused_moe(**args, path=path, config=cfg)
            except Exception as e:
                print(f"{cfg} failed: {type(e).__name__}: {str(e)[:80]}")
        torch.cuda.synchronize()
        return
    bandwidth = measure_copy_bandwidth()
    calls = GRAPH_CALLS if num_tokens <= 256 else 4
    sets = [_inputs(num_tokens, seed=1000 * num_tokens + i, fp8=fp8, w8a16=w8a16) for i in range(calls)]
    if kernel == "route":  # routed by the up GEMV from the router's logits (as decode at batch 1 runs it)
        sets = [_routed(a, seed=1000 * num_tokens + i) for i, a in enumerate(sets)]
    floor_bytes = sum(_moe_bytes(a) for a in sets)
    ref = naive.routed_moe(**sets[0]) if kernel == "route" else naive.fused_moe(**sets[0])
    info = device_info(torch.device("cuda"))
    if path == "pairs":
        default = tiles.pairs_config(H, INTER, info, fp8=fp8)
    else:
        default = tiles.sorted_config(num_tokens * TOP_K, E, 2, info, fp8=fp8, quantized_acts=not w8a16)
    form = " fp8 w8a16" if fp8 and w8a16 else " fp8" if fp8 else ""
    print(f"T={num_tokens} path={path}{form} default {default}")
    rows = []
    run = tm.routed_moe if kernel == "route" else tm.fused_moe
    for cfg in _sweep_configs(path, num_tokens, kernel, fp8, w8a16):
        try:
            err = _rel_err(run(**sets[0], path=path, config=cfg), ref)
            replay = graphed([lambda a=a, cfg=cfg: run(**a, path=path, config=cfg) for a in sets])
            ms = triton.testing.do_bench(replay, warmup=10, rep=50, return_mode="median") / calls
        except Exception as e:  # a config that does not compile or fit is reported, not fatal
            print(f"{cfg} failed: {type(e).__name__}: {str(e)[:80]}")
            continue
        rows.append((ms, cfg, err))
    flops = 2 * num_tokens * TOP_K * 3 * INTER * H  # gate, up and down
    ranked = sorted(rows, key=lambda r: r[0])
    mine = [r for r in ranked if r[1] == default]
    for ms, cfg, err in ranked[:20] + [("default:", None, None)] + mine:
        if cfg is None:
            print(ms if mine else "default: not in the grid")
            continue
        mark = "  <- default" if cfg == default else ""
        frac = floor_bytes / calls / bandwidth / (ms * 1e-3)
        tflops = flops / (ms * 1e-3) / 1e12
        print(f"{ms * 1e3:8.1f} us  {100 * frac:5.1f}% of copy BW  {tflops:6.1f} TFLOP/s  err {err:.1e}  {cfg}{mark}")


def grouped_ab(num_tokens: int) -> None:
    """The sorted path on our Triton GEMMs against torch's grouped GEMM (prefill_gemm="torch"), each
    as graph-captured calls with distinct routings (4 a graph), plus the grouped GEMMs alone (x already
    in expert order, uniform groups): us a call, TFLOP/s, error against the float32 reference."""
    import triton.testing

    from deltaserve.layers.kernels.moe import grouped

    calls = 4
    sets = [_inputs(num_tokens, seed=1000 * num_tokens + i) for i in range(calls)]
    ref = naive.fused_moe(**sets[0])
    flops = 2 * num_tokens * TOP_K * 3 * INTER * H
    print(f"T={num_tokens}: the sorted path's GEMMs, triton (ours) against torch's grouped GEMM")
    for name, kw in (("triton", dict(path="sorted")), ("torch", dict(path="grouped"))):
        err = _rel_err(tm.fused_moe(**sets[0], **kw), ref)
        replay = graphed([lambda a=a, kw=kw: tm.fused_moe(**a, **kw) for a in sets])
        ms = triton.testing.do_bench(replay, warmup=10, rep=50, return_mode="median") / calls
        print(f"{name:>8}: {ms * 1e3:8.1f} us  {flops / (ms * 1e-3) / 1e12:6.1f} TFLOP/s  err {err:.1e}")
    w13, w2 = _weights()
    rows = num_tokens * TOP_K
    ends = torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * (rows // E)
    xs = torch.randn(rows, H, device="cuda", dtype=DTYPE)
    act = torch.randn(rows, INTER, device="cuda", dtype=DTYPE)
    assert grouped.supported(xs, w13)
    for name, fn, f in (
        ("up", lambda: torch._grouped_mm(xs, w13.transpose(1, 2), offs=ends), 2 * rows * H * 2 * INTER),
        ("down", lambda: torch._grouped_mm(act, w2.transpose(1, 2), offs=ends), 2 * rows * INTER * H),
    ):
        ms = triton.testing.do_bench(graphed([fn]), warmup=10, rep=50, return_mode="median")
        print(f"{'grouped ' + name:>14}: {ms * 1e3:8.1f} us  {f / (ms * 1e-3) / 1e12:6.1f} TFLOP/s (GEMM alone)")


def routing_sweep(num_tokens: int) -> None:
    """The sorted path's routing at a prefill size: the router (route_topk_softmax: tokens a program x
    warps) on logits strided as the model's (the first 256 columns of the router + shared expert
    projection's 1,281), then the pair grouping's two launches (align_pairs: pairs a program, the
    count and place kernels' warps, the counters' spacing) on its ids; each config as 20 graph-captured
    calls, us a call, checked against the default config's output: the router's weights and ids bit
    for bit (or how many ids and how far the weights differ: the softmax's sums run in another order
    on another layout), the grouping's offsets and block experts equal and each expert's pairs the
    same set."""
    import triton.testing

    from deltaserve.layers.kernels.moe import align, router

    torch.manual_seed(0)
    wide = torch.randn(num_tokens, E + 1 + 2 * INTER, device="cuda", dtype=DTYPE)
    logits = wide[:, :E]
    want_w, want_i = router.route_topk_softmax(router_logits=logits, top_k=TOP_K, renormalize=True)
    block_m = tiles.sorted_config(num_tokens * TOP_K, E, 2, device_info(logits.device))["block_m"]

    def timed(fn) -> float:
        return triton.testing.do_bench(graphed([fn] * 20), warmup=5, rep=40, return_mode="median") * 1e3 / 20

    default = router.router_config(num_tokens, device_info(logits.device))
    for block_t, warps in itertools.product((1, 2, 4, 8, 16), (1, 2, 4, 8)):
        cfg = dict(block_t=block_t, num_warps=warps)
        w, i = router.route_topk_softmax(router_logits=logits, top_k=TOP_K, renormalize=True, config=cfg)
        ok = torch.equal(w, want_w) and torch.equal(i, want_i)
        diff = f"ids {int((i != want_i).sum())} differ, weights by {float((w - want_w).abs().max()):.1e}"
        us = timed(lambda cfg=cfg: router.route_topk_softmax(router_logits=logits, top_k=TOP_K, renormalize=True,
                                                             config=cfg))  # fmt: skip
        mark = " (default)" if cfg == default else ""
        print(f"router T={num_tokens} block_t {block_t:2d} warps {warps}: {us:7.2f} us {'same' if ok else diff}{mark}")

    def group(cfg):
        return align.align_pairs(topk_ids=want_i, num_experts=E, expert_offset=0, block_m=block_m, config=cfg)

    want_rows, want_blocks, want_offsets = group(None)

    def same(rows, blocks, offsets) -> bool:
        if not (torch.equal(offsets, want_offsets) and torch.equal(blocks, want_blocks)):
            return False
        total, pairs = int(offsets[-1]), want_i.numel() + 1
        expert = blocks.repeat_interleave(block_m)[:total].long() * pairs  # each expert's rows as one set
        return torch.equal((expert + rows[:total]).sort().values, (expert + want_rows[:total]).sort().values)

    default = align.align_config(logits.device)
    shapes = itertools.product((256, 1024, 4096), (1, 4, 8), (4, 8), (1, 32))
    for block_p, count_warps, place_warps, stride in shapes:
        cfg = dict(block_p=block_p, count_warps=count_warps, place_warps=place_warps, count_stride=stride)
        ok = same(*group(cfg))
        us = timed(lambda cfg=cfg: group(cfg))
        mark = " (default)" if cfg == default else ""
        print(f"align T={num_tokens} {cfg}: {us:7.2f} us {'ok' if ok else 'DIFFERS'}{mark}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--path", choices=["pairs", "sorted"], default=None)
    parser.add_argument(
        "--kernel", choices=["up", "down", "both", "order", "tma", "persistent", "route", "grouped", "routing"],
        default="up",
        help="sorted path: the GEMM swept at prefill sizes, both (block_m against each one's best tiles), or "
        "order (the default tiles on row-block-major and N-major grids), tma (their weights by pointers or TMA, "
        "the down GEMM's activations gathered or in sorted order through TMA), "
        "persistent (the default tiles as one program a tile against persistent programs), grouped (ours "
        "against torch's grouped GEMM), routing (the router's and the pair grouping's launch shapes); pairs path: "
        "route (the routing up GEMV's tiles, from router logits)",
    )  # fmt: skip
    parser.add_argument("--compile-only", action="store_true", help="run the shard's configs once, untimed")
    parser.add_argument("--shard", default="0/1", help="with --compile-only: i/n, every n-th config from the i-th")
    parser.add_argument(
        "--fp8", action="store_true", help="FP8 experts (block-quantized; with --kernel both or persistent)"
    )
    parser.add_argument("--w8a16", action="store_true", help="with --fp8: the activations left unquantized (W8A16)")
    a = parser.parse_args()
    if a.sweep and a.kernel == "grouped":
        grouped_ab(a.tokens)
    elif a.sweep and a.kernel == "routing":
        routing_sweep(a.tokens)
    elif a.sweep:
        sweep(a.tokens, a.path, a.kernel, a.compile_only, a.shard, a.fp8, a.w8a16)
