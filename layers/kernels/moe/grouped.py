"""The fused MoE's sorted path on torch's grouped GEMM (`torch._grouped_mm`: CUTLASS's grouped
kernel on sm_90 for bf16) instead of our Triton GEMMs: the pairs grouped per local expert with no
padding (align.py at block_m 1), their x rows gathered into that order (one launch, which also
records each pair's row), the gate / up grouped GEMM, silu(gate) * up, the down grouped GEMM, and the
sum kernel reading each token's slots from their sorted rows with the routing weights (and the shared
expert and the next norm, as the Triton path's). The gather and the unfused activation move ~0.7 GB
more at 8k tokens than the Triton path, which gathers inside its GEMMs: worth it only where CUTLASS's
GEMMs win more than that (bench kernels_moe --kernel grouped)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..pdl import pdl_launch, pdl_wait
from .activation import silu_mul
from .align import align_pairs


def supported(hidden: torch.Tensor, w13: torch.Tensor) -> bool:
    """Whether this call can take the grouped-GEMM path: bf16 experts (torch's fast kernel; other
    dtypes fall back to a host-synchronising loop on CUDA), rows 16-byte aligned, torch has the op."""
    return (
        hasattr(torch, "_grouped_mm")
        and hidden.dtype == w13.dtype == torch.bfloat16
        and (hidden.shape[1] * 2) % 16 == 0
        and (w13.shape[1] * 2) % 32 == 0
    )


@triton.jit(do_not_specialize=["num_pairs"])
def _gather_kernel(
    hidden, sorted_ids, num_rows, xs, inv, num_pairs, s_ht, s_xr, HIDDEN: tl.constexpr, TOPK: tl.constexpr,
    BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """xs[r] = hidden[sorted_ids[r] // TOPK] for the rows r < num_rows[0] (the local pairs), and
    inv[pair] = r (the first column block's program)."""
    pdl_wait(USE_PDL)
    r = tl.program_id(0)
    if r >= tl.load(num_rows):
        return
    pair = tl.load(sorted_ids + r)
    h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = h < HIDDEN
    row = tl.load(hidden + (pair // TOPK).to(tl.int64) * s_ht + h, mask=ok)
    tl.store(xs + r.to(tl.int64) * s_xr + h, row, mask=ok)
    if tl.program_id(1) == 0:
        tl.store(inv + pair, r)


def grouped_gemms(
    *, hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, expert_offset: int,
    pdl: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """down_e(silu(gate_e(x)) * up_e(x)) for each local (token, slot) pair, unweighted, in expert order.

    Args:
        hidden: [T, H] bf16 (H contiguous). w13: [E, 2 * I, H]. w2: [E, H, I] (contiguous last dims).
        topk_ids: [T, top_k] int (global expert ids; experts outside [expert_offset, + E) skipped).

    Returns:
        (y [T * top_k, H]: row r is pair p's output where inv[p] == r, rows past the local pairs unset;
        inv [T * top_k] int32: the row of each local pair, unset for the others).
    """
    num_tokens, hidden_size = hidden.shape
    num_experts, inter = w13.shape[0], w2.shape[2]
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    sorted_ids, _, offsets = align_pairs(
        topk_ids=topk_ids, num_experts=num_experts, expert_offset=expert_offset, block_m=1, pdl=pdl
    )
    xs = torch.empty((num_pairs, hidden_size), dtype=hidden.dtype, device=hidden.device)
    inv = torch.empty(num_pairs, dtype=torch.int32, device=hidden.device)
    block = min(1024, triton.next_power_of_2(hidden_size))
    _gather_kernel[(num_pairs, triton.cdiv(hidden_size, block))](
        hidden, sorted_ids, offsets[num_experts:], xs, inv, num_pairs, hidden.stride(0), xs.stride(0),
        HIDDEN=hidden_size, TOPK=top_k, BLOCK=block, num_warps=4, **pdl_launch(hidden, pdl),
    )  # fmt: skip
    ends = offsets[1:]  # each local expert's last row + 1 (int32): the grouped GEMMs' groups
    gate_up = torch._grouped_mm(xs, w13.transpose(1, 2), offs=ends)
    act = silu_mul(gate_up, inter, pdl)
    return torch._grouped_mm(act, w2.transpose(1, 2), offs=ends), inv
