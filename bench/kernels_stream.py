"""How fast the routed experts' weights stream in the sorted MoE GEMMs' tile pattern, without the GEMMs.

A 2k prefill's MoE is bound by its weights' bytes (every expert's rows fit one 128-row block, so each
expert's weights are read once): the up GEMM reads 1 GB a layer, the down GEMM 512 MB, and they run at
~75% of the copy bandwidth. This bench reads the same bytes in the same grid and boxes as the GEMMs
(N-major: one expert's N slices side by side; up: a gate and an up box a K step; down: one box), and
either only sums them (`sum`) or feeds them to a dot against a register-held 128-row tile (`dot`: the
tensor cores' share without the activations' gather). Each weight layout:
- `rows`: the checkpoint's [E, R, K] rows (a box is BLOCK_N rows of BLOCK_K columns, rows 2 * K bytes
  apart),
- `tiles`: the same weights re-laid so that each box is contiguous (what a load-time shuffle would do),
read through TMA descriptors (`tma`) or pointer loads (`ptr`, cp.async). Against the copy bandwidth
measured in the same process: if `rows / tma / dot` is near the GEMM's in-place time, the pattern sets
the pace; if `tiles` is faster, a load-time layout would recover the difference.

    python -m deltaserve.bench.kernels_stream                 # up and down at a 2k pass, then the MoE's own
    python -m deltaserve.bench.kernels_stream --tokens 8192   # two 128-row blocks an expert: compute-bound
    python -m deltaserve.bench.kernels_stream --real          # the MoE's own up / down under skewed routings
"""

from __future__ import annotations

import argparse
import functools

import torch
import triton
import triton.language as tl

from deltaserve.bench.kernel_cases import graphed

E, H, INTER = 256, 2048, 512


@triton.jit
def _stream_kernel(
    w_desc, w, out, x, ids, y, y_desc, s_x, s_y, N_BLOCKS: tl.constexpr, BLOCKS: tl.constexpr, ROWS: tl.constexpr,
    K: tl.constexpr, HALVES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TILED: tl.constexpr,
    DESC: tl.constexpr, DOT: tl.constexpr, GATHER: tl.constexpr, STORE: tl.constexpr, NUM_STAGES: tl.constexpr,
):  # fmt: skip
    """Program (row block, N slice) of a sorted GEMM's grid (N-major; BLOCKS 128-row blocks an expert)
    reads its expert's weight boxes over K. DOT: each box into a 128-row dot (an accumulator a half, as
    the up GEMM's gate and up); GATHER: the dot's rows loaded every K step from x's rows ids[block * 128
    + r] (< 0: padding, masked), else one register tile; STORE: the accumulators (their sum) stored as
    bf16 rows of y at the same ids (STORE 1), at the block's own rows (2: y in the sorted order, the top-8
    sum then gathering them), the same through y_desc (3: a TMA store), else summed to out."""
    pid = tl.program_id(0)
    block = pid // N_BLOCKS
    e = block // BLOCKS
    nb = pid % N_BLOCKS
    KB: tl.constexpr = K // BLOCK_K
    WIDTH: tl.constexpr = BLOCK_K if TILED else K  # the flat view's row length
    n = tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    r = tl.arange(0, 128)
    row_id = tl.load(ids + block * 128 + r)
    row_ok = row_id >= 0
    a_ptr = x + tl.maximum(row_id, 0).to(tl.int64)[:, None] * s_x + k[None, :]
    if DOT:
        a = tl.load(a_ptr)
        acc0 = tl.zeros([128, BLOCK_N], tl.float32)
        acc1 = tl.zeros([128, BLOCK_N], tl.float32)
    else:
        acc0 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        acc1 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for kb in tl.range(0, KB, num_stages=NUM_STAGES):
        if GATHER:
            a = tl.load(a_ptr + kb * BLOCK_K, mask=row_ok[:, None], other=0.0)
        for half in tl.static_range(HALVES):
            if TILED:
                row = (((e * HALVES + half) * N_BLOCKS + nb) * KB + kb) * BLOCK_N
                col = 0
            else:
                row = e * ROWS + half * (ROWS // HALVES) + nb * BLOCK_N
                col = kb * BLOCK_K
            if DESC:
                b = w_desc.load([row, col])
            else:
                b = tl.load(w + (row + n).to(tl.int64)[:, None] * WIDTH + (col + k)[None, :])
            if DOT and half == 0:
                acc0 = tl.dot(a, b.T, acc0)
            elif DOT:
                acc1 = tl.dot(a, b.T, acc1)
            elif half == 0:
                acc0 += b.to(tl.float32)
            else:
                acc1 += b.to(tl.float32)
    if STORE == 3:
        y_desc.store([block * 128, nb * BLOCK_N], (acc0 + acc1).to(tl.bfloat16))
    elif STORE == 2:
        dst = y + (block * 128 + r).to(tl.int64)[:, None] * s_y + (nb * BLOCK_N + n)[None, :]
        tl.store(dst, (acc0 + acc1).to(tl.bfloat16))
    elif STORE:
        dst = y + tl.maximum(row_id, 0).to(tl.int64)[:, None] * s_y + (nb * BLOCK_N + n)[None, :]
        tl.store(dst, (acc0 + acc1).to(tl.bfloat16), mask=row_ok[:, None])
    else:
        tl.store(out + pid, tl.sum(tl.sum(acc0 + acc1, 1), 0))


def _tiled(w: torch.Tensor, halves: int, block_n: int, block_k: int) -> torch.Tensor:
    """[E, R, K] weights as contiguous [block_n, block_k] boxes in (expert, half, N slice, K step) order,
    viewed [boxes * block_n, block_k]."""
    e, r, k = w.shape
    nb, kb = r // halves // block_n, k // block_k
    t = w.view(e, halves, nb, block_n, kb, block_k).permute(0, 1, 2, 4, 3, 5).contiguous()
    return t.view(-1, block_k)


def _row_ids(tokens: int, per_row: int) -> torch.Tensor:
    """[E * blocks, 128] int32: a uniform routing of `tokens` x 8 pairs in the sorted layout (each expert's
    rows in its 128-row blocks, the last one padded with -1); per_row pairs share a row of x (up: a
    token's 8 pairs read one hidden row)."""
    pairs = tokens * 8
    rows = pairs // E
    blocks = -(-rows // 128)
    ids = torch.full((E, blocks * 128), -1, device="cuda", dtype=torch.int32)
    ids[:, :rows] = torch.randperm(pairs, device="cuda", dtype=torch.int32).view(E, rows) // per_row
    return ids.view(E * blocks, 128)


def stream_sweep(tokens: int = 2048, reps: int = 5) -> list[dict]:
    """Each GEMM's pattern x layout x load x consumer at a `tokens` pass under uniform routing, graphed
    (`reps` calls), against the copy bandwidth (and the dots' rate over the rows they compute)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from deltaserve.bench.kernels import measure_copy_bandwidth

    bandwidth = measure_copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}  copy bandwidth: {bandwidth / 1e12:.2f} TB/s")
    gemms = {
        # name: (rows an expert, K, halves, block_n, block_k, warps, stages): the 2k table's tiles
        "up": (2 * INTER, H, 2, 128, 64, 8, 4),
        "down": (H, INTER, 1, 256, 64, 8, 4),
    }
    results = []
    for name, (rows, k, halves, block_n, block_k, warps, stages) in gemms.items():
        w = torch.randn(E, rows, k, device="cuda", dtype=torch.bfloat16)
        layouts = {"rows": w.view(-1, k), "tiles": _tiled(w, halves, block_n, block_k)}
        n_blocks = rows // halves // block_n
        # at 2k: 64 pairs an expert, each expert's 128-row block half padding; up gathers the tokens'
        # hidden rows (a token's 8 pairs one row), down the pairs' activation rows
        pairs = tokens * 8
        per_row = 8 if name == "up" else 1
        x = torch.randn(pairs // per_row, k, device="cuda", dtype=torch.bfloat16)
        ids = _row_ids(tokens, per_row)
        blocks = ids.shape[0] // E
        # by pair (the sum kernel's order today), or in the sorted order: a row per computed row
        y = torch.empty(max(pairs, ids.numel()), n_blocks * block_n, device="cuda", dtype=torch.bfloat16)
        y_desc = TensorDescriptor.from_tensor(y, [128, block_n])
        out = torch.empty(ids.shape[0] * n_blocks, device="cuda", dtype=torch.float32)
        nbytes = w.numel() * w.element_size()
        flops = 2 * ids.shape[0] * 128 * rows * k  # the dots over every computed row, padding included
        forms = [(lay, ld, "sum", False, False) for lay in layouts for ld in ("tma", "ptr")]
        forms += [(lay, "tma", "dot", g, st) for lay in layouts for g in (False, True) for st in (0, 1)]
        forms += [("rows", "tma", "dot", True, st) for st in (2, 3)]  # y in the sorted order: pointers, TMA
        for layout, load, consumer, gather, store in forms:
            flat = layouts[layout]
            desc = TensorDescriptor.from_tensor(flat, [block_n, block_k]) if load == "tma" else flat
            call = functools.partial(
                _stream_kernel[(ids.shape[0] * n_blocks,)], desc, flat, out, x, ids, y, y_desc, x.stride(0),
                y.stride(0), n_blocks, blocks, rows, k, halves, block_n, block_k, layout == "tiles", load == "tma",
                consumer == "dot", gather, store, stages, num_warps=warps,
            )  # fmt: skip
            label = f"{name:5s} {layout:5s} {load:3s} {consumer:3s} {'gather' if gather else '-':6s} "
            label += ("-", "store", "sorted", "tma-st")[store].ljust(6)
            try:
                replay = graphed([call] * reps)
                ms = triton.testing.do_bench(replay, warmup=3, rep=50, return_mode="median") / reps
            except Exception as e:  # a variant that does not compile is a row, not the end of the sweep
                print(f"{label}  failed: {str(e)[:100]}")
                continue
            frac = nbytes / (ms * 1e-3) / bandwidth
            results.append(dict(gemm=name, form=label.split(), us=ms * 1e3, of_copy=frac))
            rate = f"  {flops / (ms * 1e-3) / 1e12:5.0f} TFLOP/s" if consumer == "dot" else ""
            print(f"{label}  {ms * 1e3:8.1f} us  {100 * frac:5.1f}% of copy{rate}")
        del w, layouts
    return results


def real_gemms(num_tokens: int = 2048, skews: tuple[float, ...] = (0.0, 0.5, 1.0), calls: int = 8) -> None:
    """The sorted MoE's own up and down kernels (default tiles) under routings of growing imbalance (router
    logits randn + skew * a per-expert bias), from the torch profiler: each kernel's mean time against its
    weights' bytes streamed at copy bandwidth, with the routing's 128-row blocks (an expert past 128 rows
    reads its weights again)."""
    from torch.profiler import ProfilerActivity, profile

    from deltaserve.bench.kernels import measure_copy_bandwidth
    from deltaserve.layers.kernels.moe import naive
    from deltaserve.layers.kernels.moe import triton_moe as tm

    bandwidth = measure_copy_bandwidth()
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(E, 2 * INTER, H, device="cuda", dtype=torch.bfloat16, generator=g) * H**-0.5
    w2 = torch.randn(E, H, INTER, device="cuda", dtype=torch.bfloat16, generator=g) * INTER**-0.5
    bias = torch.randn(E, device="cuda", generator=g)
    for skew in skews:
        sets = []
        for _ in range(calls):
            logits = torch.randn(num_tokens, E, device="cuda", generator=g) + skew * bias
            weights, ids = naive.route_topk_softmax(router_logits=logits, top_k=8, renormalize=True)
            hidden = torch.randn(num_tokens, H, device="cuda", dtype=torch.bfloat16, generator=g)
            sets.append(dict(hidden=hidden, topk_weights=weights.to(torch.bfloat16), topk_ids=ids))
        counts = torch.stack([torch.bincount(a["topk_ids"].flatten(), minlength=E) for a in sets]).float()
        blocks = (counts / 128).ceil().sum(1).mean().item()
        for a in sets:  # compiled and warm before the profile
            tm.fused_moe(**a, w13=w13, w2=w2)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for a in sets:
                tm.fused_moe(**a, w13=w13, w2=w2)
            torch.cuda.synchronize()
        times = {
            e.key: e.device_time_total / e.count for e in prof.key_averages() if e.key in ("_up_kernel", "_down_kernel")
        }
        up_floor = E * 2 * INTER * H * 2 / bandwidth * 1e6
        print(
            f"T={num_tokens} skew {skew}: rows an expert max {counts.max(1).values.mean():.0f}, 128-row blocks "
            f"{blocks:.1f} (experts {E}); up {times.get('_up_kernel', 0):.1f} us, "
            f"down {times.get('_down_kernel', 0):.1f} us "
            f"(each expert's weights once at copy bandwidth: {up_floor:.1f} / {up_floor / 2:.1f})"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5, help="calls a graph replay")
    parser.add_argument("--real", action="store_true", help="only the sorted MoE's own kernels, under skewed routings")
    parser.add_argument("--tokens", type=int, default=2048, help="the pass's tokens (uniform routing)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.kernels_stream needs a CUDA device")
    if args.real:
        real_gemms(args.tokens)
    else:  # then the MoE's own kernels at the same pass, same process
        stream_sweep(args.tokens, args.reps)
        real_gemms(args.tokens, skews=(0.0,))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
