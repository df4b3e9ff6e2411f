"""silu(gate) * up over a gate / up projection's output: the shared expert's activation, and the
routed experts' between the grouped GEMMs of grouped.py."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..pdl import pdl_launch, pdl_wait


@triton.jit
def _silu_mul_kernel(gate_up, act, s_gt, s_at, INTER: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """act[t, i] = silu(gate[t, i]) * up[t, i] from gate_up [T, 2 * INTER] (strided rows), in float32,
    one rounding."""
    pdl_wait(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = i < INTER
    g = tl.load(gate_up + t * s_gt + i, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gate_up + t * s_gt + INTER + i, mask=ok, other=0.0).to(tl.float32)
    tl.store(act + t * s_at + i, (g * tl.sigmoid(g) * u).to(act.dtype.element_ty), mask=ok)


def silu_mul(gate_up: torch.Tensor, inter: int, pdl: bool) -> torch.Tensor:
    """silu(gate) * up of gate_up [T, 2 * inter] (gate columns first) -> [T, inter], one launch."""
    num_tokens = gate_up.shape[0]
    act = torch.empty((num_tokens, inter), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(inter))
    _silu_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
        gate_up, act, gate_up.stride(0), act.stride(0), INTER=inter, BLOCK=block, num_warps=4, **pdl_launch(act, pdl)
    )
    return act
