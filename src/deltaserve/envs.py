"""Every environment variable deltaserve reads, in one registry, each read in one place.

Kernel choices (`DELTASERVE_PDL`, ...) are read once into `deltaserve.layers.kernels.options.KernelOptions`
when an engine starts; nothing reads them at launch time. The README's table of variables is
checked against this registry by a test.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str
    help: str


ENV_VARS: dict[str, EnvVar] = {
    v.name: v
    for v in (
        EnvVar("DELTASERVE_CACHE", "~/.cache/deltaserve", "where the built-in demo model is built and kept"),
        EnvVar(
            "DELTASERVE_API_KEY",
            "",
            "the API key `serve` requires (HTTP bearer, gRPC metadata) and `generate` sends, unless --api-key",
        ),
        EnvVar("DELTASERVE_PDL", "1", "0: decode kernels launch without programmatic dependent launch (sm_90+)"),
        EnvVar("DELTASERVE_ROW_GEMV", "1", "0: one-token projections take the skinny GEMM instead of the row GEMV"),
        EnvVar(
            "DELTASERVE_FEW_ROWS_GEMV",
            "8",
            "most rows (2..) of a projection that take the few-row GEMV (the weight read once); 0: none",
        ),
        EnvVar(
            "DELTASERVE_FEW_ROWS_NORM",
            "1",
            "0: the few-row GEMV takes the input norm from the norm kernel instead of running it in front",
        ),
        EnvVar(
            "DELTASERVE_ROW_TILES",
            "",
            'row-GEMV tiles for given weight shapes, "NxK:BLOCK_NxWARPS" joined by "+" (e.g. "2048x4096:16x8")',
        ),
        EnvVar(
            "DELTASERVE_ROUTE_IN_UP_MAX_TOKENS",
            "4",
            "the largest decode batch whose MoE router runs inside the experts' up GEMV",
        ),
        EnvVar(
            "DELTASERVE_FUSED_GDN_MAX_SEQS",
            "12",
            "the largest decode batch whose GDN step (conv, delta rule, gated norm) is one launch",
        ),
        EnvVar(
            "DELTASERVE_PREFILL_ATTENTION",
            "auto",
            "sdpa: a one-sequence prefill chunk takes torch's SDPA (flash) over its keys (copied out of the "
            "pages after cached ones); auto: that for chunks of 4,096 tokens or more over at most 32,768 keys; "
            "paged: the paged kernel always",
        ),
        EnvVar(
            "DELTASERVE_SDPA_BACKEND",
            "flash",
            "the SDPA prefill path's backend on CUDA: flash (FA2), or cudnn (cuDNN's attention) for chunks "
            "without cached keys (flash after cached ones and where cuDNN declines the shapes)",
        ),
        EnvVar(
            "DELTASERVE_FP8_GEMM",
            "dequant",
            "the GEMM of prefill-sized projections with FP8 weights: dequant (from 128 rows the weight dequantized to "
            "a bf16 scratch, then cuBLAS's bf16 GEMM on the activations as they are: W8A16; fewer rows take ours), "
            "triton (our block-scaled W8A8 GEMM), or cublas (cuBLAS's block-scaled W8A8 GEMM, through torch's "
            "scaled_mm, where it takes the weight's shape)",
        ),
        EnvVar(
            "DELTASERVE_MOE_SORTED_BLOCK_M",
            "0",
            "rows of the MoE sorted path's tiles (16, 32, 64, 128); 0: by the rows per expert",
        ),
        EnvVar(
            "DELTASERVE_MOE_SORTED_PERSISTENT",
            "",
            "the MoE sorted path's GEMMs as persistent programs, each looping over tiles: loop (each tile's K loo"
            "p pipelined as now), flat (the tile and K loops as one pipelined loop: a tile's first loads during t"
            "he last steps of the one before); unset: one program a tile",
        ),
        EnvVar(
            "DELTASERVE_MOE_SHARED_STREAM",
            "1",
            "0: the MoE's sorted path (prefill, decode batches over 8) runs the shared expert's activation and down "
            "projection after the routed GEMMs on their stream, not on a side stream beside them (same bits)",
        ),
        EnvVar(
            "DELTASERVE_MOE_PREFILL_GEMM",
            "triton",
            "the routed experts' GEMMs on the MoE's sorted path (prefill, bf16): triton (ours, x gathered inside), "
            "or torch (torch's grouped GEMM, CUTLASS on sm_90, on x gathered into expert order first)",
        ),
        EnvVar(
            "DELTASERVE_FP8_ACTIVATIONS",
            "quantized",
            "the activations of FP8 projections: quantized: per row and 1 x 128 group where an FP8 tensor-core GEMM"
            " takes them (the MoE's sorted path; dense projections of 17 to 127 rows), as they are in the decode "
            "GEMVs, so a token's numerics depend on its pass's size; unquantized: never (W8A16 at every size): "
            "the FP8 weights' exact function whatever shares a request's passes, so speculative decoding and "
            "batching change no token (slower prefill); auto: as quantized, the MoE only above 24 routed rows an "
            "expert",
        ),
        EnvVar(
            "DELTASERVE_GDN_CHUNK_VARIANT",
            "",
            "the chunked GDN prefill's design (fused, fused_pf, split32: one walk, split32_win: split32 over "
            "chunk windows of ~128 chunks on two streams); unset: by shape",
        ),
        EnvVar("DELTASERVE_GDN_VARIANTS", "", "bench only: comma-separated chunk-kernel variants to time"),
    )
}


def read(name: str, environ: Mapping[str, str] | None = None) -> str:
    """The variable's value, or its registered default; unregistered names are a programming error."""
    var = ENV_VARS[name]
    env = os.environ if environ is None else environ
    return env.get(name, var.default)


def markdown_table() -> str:
    """The README's table of variables (a test checks the README holds exactly this)."""
    rows = ["| variable | default | what |", "|---|---|---|"]
    for var in ENV_VARS.values():
        default = f"`{var.default}`" if var.default else "(unset)"
        rows.append(f"| `{var.name}` | {default} | {var.help} |")
    return "\n".join(rows)
