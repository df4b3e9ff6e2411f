"""Fused MoE cases at Qwen3.5-35B-A3B shapes (hidden 2048, 256 experts, top-8, expert width 512,
bf16) for 1 / 16 / 64 / 256 tokens, against the per-expert torch loop (naive.fused_moe on GPU).

    python -m deltaserve.bench.kernels --only moe
    python -m deltaserve.bench.kernels_moe --sweep --tokens 1   # tile sweep of the chosen path
"""

from __future__ import annotations

import argparse
import itertools

import torch

from deltaserve.bench.kernel_cases import Case
from deltaserve.layers.kernels.moe import naive
from deltaserve.layers.kernels.moe import triton_moe as tm

H, E, TOP_K, INTER = 2048, 256, 8, 512
DTYPE = torch.bfloat16
_WEIGHTS: dict[str, torch.Tensor] = {}


def _weights() -> tuple[torch.Tensor, torch.Tensor]:
    """One set of expert weights (1.5 GB) shared by every case."""
    if not _WEIGHTS:
        g = torch.Generator(device="cuda").manual_seed(0)
        _WEIGHTS["w13"] = torch.randn(E, 2 * INTER, H, device="cuda", dtype=DTYPE, generator=g) * H**-0.5
        _WEIGHTS["w2"] = torch.randn(E, H, INTER, device="cuda", dtype=DTYPE, generator=g) * INTER**-0.5
    return _WEIGHTS["w13"], _WEIGHTS["w2"]


def _inputs(num_tokens: int, seed: int) -> dict:
    w13, w2 = _weights()
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(num_tokens, H, device="cuda", dtype=DTYPE, generator=g)
    logits = torch.randn(num_tokens, E, device="cuda", generator=g)
    weights, ids = naive.route_topk_softmax(router_logits=logits, top_k=TOP_K, renormalize=True)
    return dict(hidden=hidden, w13=w13, w2=w2, topk_weights=weights.to(DTYPE), topk_ids=ids, expert_offset=0)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| over max |ref|: the outputs' scale depends on the routing."""
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _case(num_tokens: int) -> Case:
    args = _inputs(num_tokens, seed=num_tokens)
    routed = torch.unique(args["topk_ids"]).numel()
    expert_bytes = 3 * INTER * H * 2
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
        bytes_moved=routed * expert_bytes + 2 * num_tokens * H * 2 + num_tokens * TOP_K * (8 + 2),
        flops=2 * num_tokens * TOP_K * 3 * H * INTER,
        target=target,
    )


def cases() -> list[Case]:
    return [_case(t) for t in (1, 16, 64, 256)]


def _tiles(block_n: int, block_k: int, num_warps: int, num_stages: int) -> dict:
    return dict(block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages)


def sweep(num_tokens: int) -> None:
    """Tile configs of the path fused_moe picks at this batch: time, share of copy BW, error."""
    import triton.testing

    from deltaserve.bench.kernels import measure_copy_bandwidth

    bandwidth = measure_copy_bandwidth()
    args = _inputs(num_tokens, seed=num_tokens)
    floor_bytes = torch.unique(args["topk_ids"]).numel() * 3 * INTER * H * 2
    ref = naive.fused_moe(**args)
    pairs = num_tokens * TOP_K <= tm.PAIRS_PATH_MAX
    if pairs:
        configs = [
            dict(up=_tiles(bn, 256, 4, s), down=_tiles(16, dk, 4, ds))
            for bn, dk, s, ds in itertools.product([16, 32], [256, 512], [3, 4, 5], [3, 5])
        ]
    else:
        configs = [
            dict(block_m=bm, up=_tiles(bn, bk, w, s), down=_tiles(bn, bk, w, s))
            for bm, bn, bk, w, s in itertools.product([16, 32], [64, 128], [64, 128], [4, 8], [3, 4])
        ]
    default = tm._pairs_config(True) if pairs else tm._sorted_config(num_tokens * TOP_K, E, True)
    print(f"T={num_tokens} path={'pairs' if pairs else 'sorted'} default {default}")
    rows = []
    for cfg in configs:
        try:
            err = _rel_err(tm.fused_moe(**args, config=cfg), ref)
            ms = triton.testing.do_bench(
                lambda cfg=cfg: tm.fused_moe(**args, config=cfg), warmup=10, rep=50, return_mode="median"
            )
        except Exception as e:  # a config that does not compile or fit is reported, not fatal
            print(f"{cfg} failed: {type(e).__name__}: {str(e)[:80]}")
            continue
        rows.append((ms, cfg, err))
    for ms, cfg, err in sorted(rows, key=lambda r: r[0])[:15]:
        mark = "  <- default" if cfg == default else ""
        print(f"{ms * 1e3:8.1f} us  {100 * floor_bytes / bandwidth / (ms * 1e-3):5.1f}%  err {err:.1e}  {cfg}{mark}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--tokens", type=int, default=1)
    a = parser.parse_args()
    if a.sweep:
        sweep(a.tokens)
