"""The shared expert's tail at decode, one kernel: out = routed + sigmoid(gate_logit) *
(silu(gate) * up) @ w2.T. At batch 1 this replaced six launches per MoE layer (silu, mul, the down
GEMV, sigmoid, mul, add), each a few microseconds of mostly launch gap inside the decode graph.

Grid (H / BLOCK_N, T): a program streams BLOCK_N rows of w2 (16-byte loads, evict_first) and
forms the activation of its token on the fly, in float32, from the gate/up projection's output.
The activation chunk is loaded broadcast to the weight tile's shape (the same addresses in every
row: L1 hits), so it arrives in the tile's register layout without a shared-memory shuffle. The
gate and the routed sum are applied in the epilogue; one rounding to the output dtype at the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shared_combine_kernel(
    routed,
    gate_up,
    w2,
    gate_logit,
    out,
    H,
    s_routed,
    s_gate_up,
    s_w2,
    s_gate,
    s_out,
    INTER: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(1).to(tl.int64)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ld = tl.minimum(n, H - 1).to(tl.int64)  # rows past H re-read the last one; never stored
    k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in tl.static_range(0, INTER, BLOCK_K):
        cols = k0 + k[None, :] + 0 * n[:, None]  # [BLOCK_N, BLOCK_K], every row the same columns
        k_ok = cols < INTER
        g = tl.load(gate_up + t * s_gate_up + cols, mask=k_ok, other=0.0).to(tl.float32)
        u = tl.load(gate_up + t * s_gate_up + INTER + cols, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w2 + n_ld[:, None] * s_w2 + cols, mask=k_ok, other=0.0, eviction_policy="evict_first")
        acc += w.to(tl.float32) * (g * tl.sigmoid(g) * u)
    shared = tl.sum(acc, 1)
    scale = tl.sigmoid(tl.load(gate_logit + t * s_gate).to(tl.float32))
    base = tl.load(routed + t * s_routed + n_ld).to(tl.float32)
    tl.store(out + t * s_out + n, (base + scale * shared).to(out.dtype.element_ty), mask=n < H)


def shared_expert_combine(
    *,
    routed: torch.Tensor,
    gate_up: torch.Tensor,
    w2: torch.Tensor,
    gate_logit: torch.Tensor,
    config: dict | None = None,
) -> torch.Tensor:
    """See naive.shared_expert_combine. routed: [T, H]; gate_up: [T, 2 * I]; w2: [H, I];
    gate_logit: [T, 1]; rows may be strided (column slices of a fused projection), columns must be
    contiguous. `config` (block_n, block_k, num_warps) overrides the tiles."""
    num_tokens, hidden = routed.shape
    inter = w2.shape[1]
    assert w2.shape[0] == hidden and gate_up.shape == (num_tokens, 2 * inter), "shapes"
    assert gate_logit.shape == (num_tokens, 1), "gate_logit is [T, 1]"
    for name, t in (("routed", routed), ("gate_up", gate_up), ("w2", w2)):
        assert t.stride(-1) == 1, f"{name}: contiguous last dim"
    out = torch.empty_like(routed)
    if num_tokens == 0 or hidden == 0:
        return out
    if config is None:
        if routed.is_cuda:  # 2 rows x 512 columns of bf16: the linear sweep's best GEMV tile at N=2048, K=512
            config = dict(block_n=2, block_k=min(512, triton.next_power_of_2(inter)), num_warps=4)
        else:  # interpreter
            config = dict(block_n=8, block_k=min(64, triton.next_power_of_2(inter)), num_warps=4)
    _shared_combine_kernel[(triton.cdiv(hidden, config["block_n"]), num_tokens)](
        routed,
        gate_up,
        w2,
        gate_logit,
        out,
        hidden,
        routed.stride(0),
        gate_up.stride(0),
        w2.stride(0),
        gate_logit.stride(0),
        out.stride(0),
        INTER=inter,
        BLOCK_N=config["block_n"],
        BLOCK_K=config["block_k"],
        num_warps=config["num_warps"],
    )
    return out
