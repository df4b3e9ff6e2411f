"""The fused MoE's tiles as data, keyed by device name (device.tuned_for), and what other GPUs use."""

from __future__ import annotations

import triton

from ..device import H200, SMEM_SCRATCH, DeviceInfo, stages_that_fit, tuned_for

# The pairs path (GEMV, registers only: the same tiles are right on any GPU). Thin row blocks so that
# batch 1 (8 pairs) already runs 1024 up and 1024 down programs, several per SM. From the sm_90
# compile (moe/NOTES.md): up 4 x 512 / 4 warps issues 14 of its 16 16-byte weight loads per thread
# before the first FMA; down 2 x 512 / 2 warps 11 of 16. Routing in the up GEMV: one warp a program
# keeps the top-k's reductions in the warp, one row a program (H200, batch 1: 12.2 us a layer;
# 2 x 512 12.5, 4 x 512 / 4 warps 13.1). block_k / block_i: at most these, the row's power of two.
PAIRS_TILES = {
    H200: dict(
        up=dict(block_n=4, block_k=512, num_warps=4),
        up_route=dict(block_n=1, block_k=1024, num_warps=1),
        down=dict(block_h=2, block_i=512, num_warps=2),
    )
}

# The pairs path over FP8 experts: per kernel ("up", "up_route", "down"), tiles measured on FP8 weights
# (bench kernels_moe --sweep --path pairs --fp8, and --kernel route); a kernel missing here takes the
# bf16 entry with the up GEMVs' K chunk doubled (pairs_config)
# H200, 2026-12-05: the sweep's best routing tile (4 rows a program over 512-column chunks, 14.9 us a layer
# with the down GEMV against 16.4, eca8251) ran 9.34 us a layer in the engine against 9.17 at 1 row, and
# the down GEMV's (one row, one warp: 13.7 against 14.9 in the sweep) 13.44 against 9.91 (the engine's
# fused norm): neither kept
PAIRS_TILES_FP8: dict[str, dict[str, dict]] = {H200: {}}

# The sorted path (tensor cores), by the mean routed rows per expert (rows at most, tiles): block_m at
# about twice the mean, so that most experts' rows sit in one block and their weights are read once (up
# to 64 rows a prefill is bound by the weights' bytes). Swept jointly at 512 / 1k / 2k / 4k / 8k tokens
# (bench kernels_moe --kernel both, H200, 769e931): 404 / 442 / 516 / 703 / 1,201 us a layer against
# 447 / 488 / 729 / 860 / 1,397 with the tiles before (bm 16 / 32 / 32 / 64 / 128, narrower N tiles).
# n_major (sorted._grid): a row block's N slices as neighbouring programs, so that the down GEMM's
# activations (67 MB at 8k, re-read by each of its 8 N blocks) stay in L2 between them: at 8k the
# same 1,106 us a layer as row blocks major (1,100; bench kernels_moe --kernel order, 04d376d), and
# what the end-to-end figures at 04d376d ran with. w_tma (the bf16 weights' tiles through TMA
# descriptors): at 8k 1,049.7 us a layer against 1,110.0 by pointers (bench kernels_moe --kernel tma, c0eef08).
# a_tma (unmeasured, off): the up GEMM writes the activations in sorted order and the down GEMM reads
# whole row blocks through TMA instead of gathering them by pair (sm_90 build at 8k: no cp.async left,
# 183 -> 173 registers; Triton's TMA pipeline still syncs the CTA twice a K step); --kernel tma times it.
SORTED_TILES = {
    H200: (
        (12, dict(block_m=16, up=(64, 128, 4, 4), down=(64, 128, 4, 4))),
        (24, dict(block_m=32, up=(64, 128, 4, 3), down=(64, 128, 4, 3))),
        (45, dict(block_m=64, up=(256, 64, 8, 3), down=(128, 64, 8, 3))),
        (None, dict(block_m=128, up=(128, 64, 8, 4), down=(256, 64, 8, 4), n_major=True, w_tma=True)),
    )
}

# FP8 experts (W8A8) on the sorted path, one 128-column scale group a K step (block_k 128), by the
# mean rows per expert as SORTED_TILES. Joint sweep (bench kernels_moe --kernel both --fp8, H200,
# bd782e6): 2k 382.9 us a layer (bm64; the experts' bytes at copy bandwidth) and 8k 1,093.3 (bm128)
# against 1,120.3 / 2,718.3 with the bf16 table's tiles at twice the K step (their 128 x 128
# accumulators pairs spill). Fewer rows: the bf16 entries so converted (unswept).
SORTED_TILES_FP8 = {
    H200: (
        (96, dict(block_m=64, up=(64, 128, 4, 3), down=(128, 128, 8, 4))),
        (None, dict(block_m=128, up=(128, 128, 8, 3), down=(128, 128, 8, 4))),
    )
}


def pairs_config(hidden_size: int, inter: int, info: DeviceInfo, fp8: bool = False) -> dict:
    """The pairs path's tiles for this device (other GPUs: the H200's). fp8: PAIRS_TILES_FP8's
    kernels, the others as bf16's with the up GEMVs' K chunk doubled (the same bytes a chunk as
    bf16, unmeasured); the down GEMV keeps its tile (4 rows spilled in Triton 3.6's sm_90 build at
    2 warps)."""
    if info.is_interpreter:
        block_k = min(64, triton.next_power_of_2(hidden_size))
        block_i = min(64, triton.next_power_of_2(inter))
        up = dict(block_n=8, block_k=block_k, num_warps=4)
        return dict(up=up, up_route=up, down=dict(block_h=8, block_i=block_i, num_warps=4))
    tiles = tuned_for(PAIRS_TILES, info) or PAIRS_TILES[H200]
    k, i = triton.next_power_of_2(hidden_size), triton.next_power_of_2(inter)
    wide = 2 if fp8 else 1
    cfg = dict(
        up={**tiles["up"], "block_k": min(wide * tiles["up"]["block_k"], k)},
        up_route={**tiles["up_route"], "block_k": min(wide * tiles["up_route"]["block_k"], k)},
        down={**tiles["down"], "block_i": min(tiles["down"]["block_i"], i)},
    )
    measured = (tuned_for(PAIRS_TILES_FP8, info) or {}) if fp8 else {}
    for name, tile in measured.items():
        limit = i if name == "down" else k
        chunk = "block_i" if name == "down" else "block_k"
        cfg[name] = {**tile, chunk: min(tile[chunk], limit)}
    return cfg


# shared memory the flattened persistent loop takes beyond its pipeline (sm_90 builds, Triton 3.6: 2 to 32 KB
# over one program a tile; the 1k tile's 216 KB became 232 and failed to launch at 227 KB a program)
FLAT_SMEM = 32 * 1024


def sorted_config(
    num_pairs: int, num_experts: int, elem: int, info: DeviceInfo, fp8: bool = False, block_m: int = 0,
    quantized_acts: bool = True, persistent: str = "",
) -> dict:  # fmt: skip
    """The sorted path's tiles for this device: block_m, n_major (the grid's program order:
    sorted._grid), w_tma (bf16 experts' weights through TMA descriptors), a_tma (the activations in
    sorted order, through TMA for the down GEMM), and up / down block_n,
    block_k, num_warps, num_stages. Other GPUs: the H200's,
    each pipeline as deep as their shared memory holds. fp8 (one-byte weights): W8A8 from
    SORTED_TILES_FP8 where it has entries; otherwise the bf16 tiles with twice the K step, at most
    one 128-column scale group; each pipeline as deep as fits (quantized_acts False: the activations keep `elem`
    bytes, and the weights converted for the dot take one more unpipelined buffer). block_m: the
    entry with these tile rows (0: the entry for the mean rows per expert). persistent: "loop" or
    "flat", the GEMMs as persistent programs looping over tiles (sorted._grid); "": the entry's."""
    if info.is_interpreter:
        tiles = dict(block_n=16, block_k=16, num_warps=4, num_stages=1)
        return dict(block_m=16, up=tiles, down=dict(tiles), persistent=persistent)
    tuned = tuned_for(SORTED_TILES, info)
    rows = num_pairs / max(1, num_experts)
    table = tuned or SORTED_TILES[H200]
    if fp8 and quantized_acts:  # the FP8 sweep's entries, below their rows the bf16 ones converted
        fp8_table = tuned_for(SORTED_TILES_FP8, info) or SORTED_TILES_FP8[H200]
        table = tuple(e for e in table if e[1]["block_m"] < fp8_table[0][1]["block_m"]) + fp8_table
    if block_m:
        entry = next((cfg for _, cfg in table if cfg["block_m"] == block_m), None)
        if entry is None:
            raise ValueError(f"sorted_block_m: no tile entry with block_m {block_m}")
    else:
        entry = next(cfg for most, cfg in table if most is None or rows <= most)
    block_m = entry["block_m"]
    cfg = dict(
        block_m=block_m, n_major=entry.get("n_major", False), w_tma=entry.get("w_tma", False),
        a_tma=entry.get("a_tma", False), persistent=persistent or entry.get("persistent", ""),
    )  # fmt: skip
    for name, operands in (("up", 2), ("down", 1)):  # up reads the gate and the up tile
        block_n, block_k, warps, stages = entry[name]
        fixed = SMEM_SCRATCH + (FLAT_SMEM if cfg["persistent"] == "flat" else 0)
        if fp8:
            block_k = min(128, 2 * block_k)
            a_elem = 1 if quantized_acts else elem
            per_stage = block_k * (a_elem * block_m + operands * block_n)
            fixed += 0 if quantized_acts else elem * block_k * operands * block_n
            stages = stages_that_fit(stages, per_stage, fixed, info)
        elif tuned is None or cfg["persistent"] == "flat":
            per_stage = elem * block_k * (block_m + operands * block_n)
            stages = stages_that_fit(stages, per_stage, fixed, info)
        cfg[name] = dict(block_n=block_n, block_k=block_k, num_warps=warps, num_stages=stages)
    return cfg
