"""KernelOptions: the kernel choices an engine runs with, read once (from the environment or given),
and handed down explicitly: runner -> ForwardContext -> layers -> kernel ops. A captured CUDA graph
belongs to one KernelOptions value; changing it means capturing again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace

from deltaserve import envs


@dataclass(frozen=True)
class RowTile:
    """A row-GEMV tile for one weight shape [n, k]: rows per program and warps."""

    n: int
    k: int
    block_n: int
    num_warps: int


def parse_row_tiles(spec: str) -> tuple[RowTile, ...]:
    """ "NxK:BLOCK_NxWARPS+..." -> tiles; a bad entry is an error naming DELTASERVE_ROW_TILES."""
    tiles = []
    for item in filter(None, (s.strip() for s in spec.split("+"))):
        try:
            shape, tile = item.split(":")
            n, k = (int(v) for v in shape.split("x"))
            block_n, warps = (int(v) for v in tile.split("x"))
        except ValueError:
            raise ValueError(f"DELTASERVE_ROW_TILES: {item[:40]!r} is not NxK:BLOCK_NxWARPS") from None
        if block_n < 1 or block_n & (block_n - 1) or warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"DELTASERVE_ROW_TILES: {item[:40]!r}: BLOCK_N a power of two, WARPS one of 1-16")
        tiles.append(RowTile(n, k, block_n, warps))
    return tuple(tiles)


@dataclass(frozen=True)
class KernelOptions:
    pdl: bool = field(
        default=True,
        metadata={"env": "DELTASERVE_PDL", "help": "decode kernels use programmatic dependent launch (sm_90+)"},
    )
    row_gemv: bool = field(
        default=True,
        metadata={"env": "DELTASERVE_ROW_GEMV", "help": "one-token projections take the one-row GEMV kernel"},
    )
    few_rows_gemv: int = field(
        default=8,
        metadata={
            "env": "DELTASERVE_FEW_ROWS_GEMV",
            "help": "most rows (2..) of a projection that take the few-row GEMV (weights read once); 0: none",
        },
    )
    few_rows_norm: bool = field(
        default=True,
        metadata={
            "env": "DELTASERVE_FEW_ROWS_NORM",
            "help": "the few-row GEMV runs the input norm in front of projections of <= 2048 rows (MoE input)",
        },
    )
    row_tiles: tuple[RowTile, ...] = field(
        default=(),
        metadata={"env": "DELTASERVE_ROW_TILES", "help": "row-GEMV tiles overriding the tuned table per shape"},
    )
    route_in_up_max_tokens: int = field(
        default=4,
        metadata={
            "env": "DELTASERVE_ROUTE_IN_UP_MAX_TOKENS",
            "help": "largest batch whose MoE router runs inside the experts' up GEMV",
        },
    )
    fused_gdn_max_seqs: int = field(
        default=12,
        metadata={
            "env": "DELTASERVE_FUSED_GDN_MAX_SEQS",
            "help": "largest decode batch whose GDN step is one launch",
        },
    )
    prefill_attention: str = field(
        default="auto",
        metadata={
            "env": "DELTASERVE_PREFILL_ATTENTION",
            "help": "paged: prefill attention over the KV pages; sdpa: a one-sequence chunk takes torch's SDPA "
            "(flash) over its keys and values (its own, or copied out of the pages when some are cached); "
            "auto: sdpa for one-sequence chunks of 4,096 tokens or more over at most 32,768 keys "
            "(layers/attention.py), else paged",
            "choices": ("auto", "paged", "sdpa"),
        },
    )
    sdpa_backend: str = field(
        default="flash",
        metadata={
            "env": "DELTASERVE_SDPA_BACKEND",
            "help": "the backend of the SDPA prefill path on CUDA: flash (FA2), or cudnn (cuDNN's attention) for "
            "chunks without cached keys (flash after cached ones and where cuDNN declines the shapes)",
            "choices": ("flash", "cudnn"),
        },
    )
    moe_sorted_block_m: int = field(
        default=0,
        metadata={
            "env": "DELTASERVE_MOE_SORTED_BLOCK_M",
            "help": "rows of the MoE sorted path's tiles (16, 32, 64 or 128); 0: by the rows per expert",
            "choices": (0, 16, 32, 64, 128),
        },
    )
    moe_sorted_persistent: str = field(
        default="",
        metadata={
            "env": "DELTASERVE_MOE_SORTED_PERSISTENT",
            "help": "the MoE sorted path's GEMMs as persistent programs, each looping over tiles: loop (each tile's "
            "K loop pipelined as now), flat (the tile and K loops as one pipelined loop: a tile's first loads "
            "during the last steps of the one before); empty: one program a tile",
            "choices": ("", "loop", "flat"),
        },
    )
    moe_shared_stream: bool = field(
        default=True,
        metadata={
            "env": "DELTASERVE_MOE_SHARED_STREAM",
            "help": "the MoE's sorted path (prefill, decode batches over 8) runs the shared expert's activation and "
            "down projection on a side stream beside the routing and the routed GEMMs (the same bits)",
        },
    )
    moe_prefill_gemm: str = field(
        default="triton",
        metadata={
            "env": "DELTASERVE_MOE_PREFILL_GEMM",
            "help": "the routed experts' GEMMs on the MoE's sorted path (prefill, bf16): triton (ours, x gathered "
            "inside), or torch (torch's grouped GEMM, CUTLASS on sm_90, on x gathered into expert order first)",
            "choices": ("triton", "torch"),
        },
    )
    fp8_activations: str = field(
        default="quantized",
        metadata={
            "env": "DELTASERVE_FP8_ACTIVATIONS",
            "help": "the activations of FP8 projections: quantized: per row and 1 x 128 group where an FP8 "
            "tensor-core GEMM takes them (the MoE's sorted path: prefill and decode batches over 8; dense "
            "projections of 17 to 127 rows), as they are in the decode GEMVs (W8A16), so a token's numerics "
            "depend on its pass's size; unquantized: never (W8A16 at every size: the sorted MoE converts the "
            "weights in registers, dense projections over 16 rows take the dequantized weight): the FP8 weights' "
            "exact function, whatever shares a request's passes or chunks its prompt, so speculative decoding "
            "and batching change no token (slower prefill); auto: as quantized, the MoE only above 24 routed "
            "rows an expert (64-row tiles and up: FP8 tensor cores)",
            "choices": ("quantized", "unquantized", "auto"),
        },
    )
    fp8_gemm: str = field(
        default="dequant",
        metadata={
            "env": "DELTASERVE_FP8_GEMM",
            "help": "the GEMM of prefill-sized projections with FP8 weights: dequant (from 128 rows the weight "
            "dequantized to a bf16 scratch, then cuBLAS's bf16 GEMM on the activations as they are: W8A16; fewer "
            "rows take ours), triton (our block-scaled "
            "W8A8 GEMM), or cublas (cuBLAS's block-scaled W8A8 GEMM, through torch's scaled_mm, where it takes the "
            "weight's shape)",
            "choices": ("dequant", "triton", "cublas"),
        },
    )
    gdn_chunk_variant: str = field(
        default="",
        metadata={
            "env": "DELTASERVE_GDN_CHUNK_VARIANT",
            "help": "the chunked GDN prefill's design (fused, fused_pf, split32: one walk, split32_win: split32 "
            "over chunk windows of about 128 chunks (two from 8k tokens, at most eight), each walk beside the next "
            "windows' solve and the last ones' outputs on a second stream); empty: by the shapes",
            "choices": ("", "fused", "fused_pf", "split32", "split32_win"),
        },
    )

    def __post_init__(self) -> None:
        for name in ("route_in_up_max_tokens", "fused_gdn_max_seqs", "few_rows_gemv"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        for f in fields(self):
            choices = f.metadata.get("choices")
            if choices is not None and getattr(self, f.name) not in choices:
                raise ValueError(f"{f.name}: must be one of {choices}, got {getattr(self, f.name)!r}")

    def linear_fp8_gemm(self) -> str:
        """linear's fp8_gemm for the dense projections: "w8a16" (no path quantizes x) when the FP8
        activations stay unquantized, else the fp8_gemm option."""
        return "w8a16" if self.fp8_activations == "unquantized" else self.fp8_gemm

    def row_tile(self, n: int, k: int) -> RowTile | None:
        for tile in self.row_tiles:
            if (tile.n, tile.k) == (n, k):
                return tile
        return None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KernelOptions:
        """The options the environment asks for (unset variables keep the defaults)."""
        values = {f.name: _parse(f, envs.read(f.metadata["env"], environ), f.metadata["env"]) for f in fields(cls)}
        return cls(**values)

    def with_settings(self, settings: Mapping[str, str]) -> KernelOptions:
        """These options with some fields set from text, by field name ({"pdl": "0", "row_tiles":
        "2048x4096:16x8"}, as the environment spells them); an unknown name or a bad value is an
        error naming the field."""
        known = {f.name: f for f in fields(self)}
        values = {}
        for name, raw in settings.items():
            if name not in known:
                raise ValueError(f"{name[:40]!r} is not a kernel option (one of {', '.join(known)})")
            values[name] = _parse(known[name], raw, name)
        return replace(self, **values)


def _parse(f, raw: str, what: str):
    """The value of field f from its text; errors name `what` (the variable or the field)."""
    try:
        if f.type in ("bool", bool):
            return raw.strip() not in ("0", "false", "False", "")
        if f.name == "row_tiles":
            return parse_row_tiles(raw)
        if f.type in ("str", str):
            return raw.strip()
        return int(raw)
    except ValueError as e:
        if str(e).startswith("DELTASERVE_ROW_TILES"):
            raise ValueError(str(e).replace("DELTASERVE_ROW_TILES", what, 1)) from None
        raise ValueError(f"{what}: {raw[:40]!r} is not a valid {f.type}") from None
