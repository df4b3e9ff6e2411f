"""Causal conv1d kernel cases at Qwen3.5-35B-A3B shapes: the GDN layer's conv over q, k, v
(C = 2 * 16 * 128 + 32 * 128 = 8192 channels, width 4, bf16 inputs and window, silu)."""

from __future__ import annotations

import torch

from deltaserve.bench.kernel_cases import Case
from deltaserve.layers.kernels.conv1d import naive
from deltaserve.layers.kernels.conv1d.triton_conv1d import causal_conv1d_update, causal_conv1d_varlen

CHANNELS, WIDTH = 2 * 16 * 128 + 32 * 128, 4
TOLERANCE = 1e-2  # bf16 outputs, relative to the reference's magnitude


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| over max(1, max |ref|); NaN counts as infinite."""
    if torch.isnan(out).any():
        return float("inf")
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1)).item()


def _varlen_case(num_tokens: int) -> Case:
    x = torch.randn(num_tokens, CHANNELS, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(CHANNELS, WIDTH, device="cuda", dtype=torch.bfloat16) * 0.5
    pool = torch.randn(4, CHANNELS, WIDTH - 1, device="cuda", dtype=torch.bfloat16)
    kwargs = dict(
        x=x,
        weight=weight,
        bias=None,
        cu_seqlens=torch.tensor([0, num_tokens], dtype=torch.int32, device="cuda"),
        state_slots=torch.tensor([1], dtype=torch.int32, device="cuda"),
        has_initial_state=torch.tensor([True], device="cuda"),
    )
    work_pool = pool.clone()

    def check() -> float:
        ours_pool, ref_pool = pool.clone(), pool.clone()
        out = causal_conv1d_varlen(conv_state_pool=ours_pool, **kwargs)
        ref = naive.causal_conv1d_varlen(conv_state_pool=ref_pool, **kwargs)
        return max(_rel_err(out, ref), _rel_err(ours_pool, ref_pool))

    return Case(
        op="conv1d_varlen",
        shape=f"T={num_tokens} C={CHANNELS} W={WIDTH}",
        ours=lambda: causal_conv1d_varlen(conv_state_pool=work_pool, **kwargs),
        reference=lambda: naive.causal_conv1d_varlen(conv_state_pool=work_pool, **kwargs),
        reference_label="naive torch",
        check=check,
        tolerance=TOLERANCE,
        bytes_moved=2 * num_tokens * CHANNELS * 2 + CHANNELS * WIDTH * 2 + 2 * CHANNELS * (WIDTH - 1) * 2,
        flops=2 * num_tokens * CHANNELS * WIDTH,
        target="near the copy-bandwidth floor",
    )


def _update_case(num_seqs: int) -> Case:
    x = torch.randn(num_seqs, CHANNELS, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(CHANNELS, WIDTH, device="cuda", dtype=torch.bfloat16) * 0.5
    pool = torch.randn(num_seqs + 8, CHANNELS, WIDTH - 1, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(num_seqs + 8, device="cuda")[:num_seqs].to(torch.int32)
    kwargs = dict(x=x, weight=weight, bias=None, state_slots=slots)
    work_pool = pool.clone()

    def check() -> float:
        ours_pool, ref_pool = pool.clone(), pool.clone()
        out = causal_conv1d_update(conv_state_pool=ours_pool, **kwargs)
        ref = naive.causal_conv1d_update(conv_state_pool=ref_pool, **kwargs)
        return max(_rel_err(out, ref), _rel_err(ours_pool, ref_pool))

    return Case(
        op="conv1d_update",
        shape=f"N={num_seqs} C={CHANNELS} W={WIDTH}",
        ours=lambda: causal_conv1d_update(conv_state_pool=work_pool, **kwargs),
        reference=lambda: naive.causal_conv1d_update(conv_state_pool=work_pool, **kwargs),
        reference_label="naive torch",
        check=check,
        tolerance=TOLERANCE,
        bytes_moved=2 * num_seqs * CHANNELS * 2 + CHANNELS * WIDTH * 2 + 2 * num_seqs * CHANNELS * (WIDTH - 1) * 2,
        target="launch-bound at these sizes: a few microseconds",
    )


def cases() -> list[Case]:
    torch.manual_seed(0)
    return [_varlen_case(8192), _update_case(64), _update_case(256)]
