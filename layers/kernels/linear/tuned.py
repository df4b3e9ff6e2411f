"""Measured linear tiles, keyed by device name (device.tuned_for): where a sweep beat the shape
heuristic or cuBLAS on that device. Other devices take the heuristics (triton_linear.pick_config,
triton_row.pick_config) and cuBLAS for 5..16 rows. No triton import here: the op's dispatch reads
it on every call."""

from __future__ import annotations

from ..device import H200

# the skinny GEMM (triton_linear.py), from `python -m deltaserve.bench.kernels_linear --sweep
# --tokens 1,16` in bf16: (row bucket, N, K) -> config; bucket 1, 2 or 4: the GEMV form, beating the
# heuristic; bucket 16 (5..16 rows on tensor cores): beating cuBLAS, and only these shapes leave it
TUNED: dict[str, dict[tuple[int, int, int], dict]] = {
    H200: {
        # o_proj / GDN out_proj at one token: 6.7 us vs 8.1 (heuristic) and 9.7 (cuBLAS)
        (1, 2048, 4096): dict(block_m=1, block_n=2, block_k=1024, split_k=1, num_warps=4, dot=False),
        # fused router | shared gate_up | shared gate, 1,281 rows padded to 1,288: 3.5 us vs 4.7
        (1, 1288, 2048): dict(block_m=1, block_n=1, block_k=1024, split_k=1, num_warps=4, dot=False),
        # 16 rows: GDN in_proj 15.1 us vs cuBLAS 16.4; o_proj 8.3 vs 9.8; MoE fused input 5.9 vs 12.2
        (16, 12352, 2048): dict(block_n=32, block_k=128, split_k=1, num_warps=4, num_stages=4, dot=True),
        (16, 2048, 4096): dict(block_n=32, block_k=128, split_k=4, num_warps=4, num_stages=4, dot=True),
        (16, 1288, 2048): dict(block_n=32, block_k=64, split_k=4, num_warps=4, num_stages=6, dot=True),
    }
}

# the one-row GEMV (triton_row.py), from `python -m deltaserve.bench.kernels_linear --row-sweep`
# (graph-timed, us per call against the GEMV form of triton_linear): (N, K) -> block_n, num_warps
TUNED_ROW: dict[str, dict[tuple[int, int], dict]] = {
    H200: {
        (12352, 2048): dict(block_n=2, num_warps=8),  # GDN in_proj: 13.4 vs 13.8
        (9216, 2048): dict(block_n=2, num_warps=8),  # attention q_gate | k | v: 10.4 vs 10.7
        (2048, 4096): dict(block_n=1, num_warps=4),  # o_proj / out_proj: 5.7 vs 5.8
        (1288, 2048): dict(block_n=4, num_warps=8),  # MoE router | shared gate_up | gate: 2.8 vs 3.0
    }
}


# the one-row GEMV on FP8 weights (tails included in N), from `python -m deltaserve.bench.kernels_fp8
# --row-sweep`; shapes missing here take twice the bf16 entry's rows (the same bytes a program)
# H200, bench.kernels_fp8 --row-sweep (eca8251), graph-timed on cold weights, the best tile whose
# weights load before the PDL wait: GDN in_proj 8.60 us (4 rows, 8 warps before: 9.5+), attention
# q/k/v 7.38 (7.4+), o_proj 3.88 (4.11)
TUNED_ROW_FP8: dict[str, dict[tuple[int, int], dict]] = {
    H200: {
        (12352, 2048): dict(block_n=4, num_warps=4),
        (9216, 2048): dict(block_n=4, num_warps=4),
        (2048, 4096): dict(block_n=4, num_warps=8),
    }
}


def tuned_key(num_rows: int, n: int, k: int) -> tuple[int, int, int]:
    """The TUNED key of an M-row call: GEMV buckets 1, 2, 4; 16 for 5..16 rows."""
    bucket = 1 if num_rows <= 1 else 2 if num_rows <= 2 else 4 if num_rows <= 4 else 16
    return bucket, n, k
