"""RMSNorm cases (bf16): the zero-centred norm and the fused residual add + norm at T=8192 x 2048,
and the GDN gated norm at T=8192 x 32 heads x 128, against the plain-torch references on GPU.

    python -m deltaserve.bench.kernels --only norm
"""

from __future__ import annotations

import torch

from deltaserve.bench.kernel_cases import Case
from deltaserve.layers.kernels.norm import naive
from deltaserve.layers.kernels.norm import triton_norm as tn

DTYPE = torch.bfloat16
EPS = 1e-6


def _max_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out.float() - ref.float()).abs().max().item()


def _rms_case(num_tokens: int, dim: int) -> Case:
    x = torch.randn(num_tokens, dim, device="cuda", dtype=DTYPE)
    args = dict(x=x, weight=torch.randn(dim, device="cuda", dtype=DTYPE) * 0.1, eps=EPS)
    return Case(
        op="rms_norm",
        shape=f"T={num_tokens} D={dim}",
        ours=lambda: tn.rms_norm(**args),
        reference=lambda: naive.rms_norm(**args),
        reference_label="torch",
        check=lambda: _max_err(tn.rms_norm(**args), naive.rms_norm(**args)),
        tolerance=5e-2,
        bytes_moved=2 * x.numel() * 2,
    )


def _add_rms_case(num_tokens: int, dim: int) -> Case:
    x = torch.randn(num_tokens, dim, device="cuda", dtype=DTYPE)
    args = dict(x=x, residual=torch.randn_like(x), weight=torch.randn(dim, device="cuda", dtype=DTYPE) * 0.1, eps=EPS)

    def check():
        (out, res), (ref, ref_res) = tn.fused_add_rms_norm(**args), naive.fused_add_rms_norm(**args)
        return max(_max_err(out, ref), _max_err(res, ref_res))

    return Case(
        op="fused_add_rms_norm",
        shape=f"T={num_tokens} D={dim}",
        ours=lambda: tn.fused_add_rms_norm(**args),
        reference=lambda: naive.fused_add_rms_norm(**args),
        reference_label="torch",
        check=check,
        tolerance=5e-2,
        bytes_moved=4 * x.numel() * 2,
    )


def _gated_case(num_tokens: int, heads: int, dim: int) -> Case:
    x = torch.randn(num_tokens, heads, dim, device="cuda", dtype=DTYPE)
    args = dict(x=x, gate=torch.randn_like(x), weight=1 + 0.1 * torch.randn(dim, device="cuda"), eps=EPS)
    return Case(
        op="gated_rms_norm",
        shape=f"T={num_tokens} H={heads} D={dim}",
        ours=lambda: tn.gated_rms_norm(**args),
        reference=lambda: naive.gated_rms_norm(**args),
        reference_label="torch",
        check=lambda: _max_err(tn.gated_rms_norm(**args), naive.gated_rms_norm(**args)),
        tolerance=5e-2,
        bytes_moved=3 * x.numel() * 2,
    )


def cases() -> list[Case]:
    return [_rms_case(8192, 2048), _add_rms_case(8192, 2048), _gated_case(8192, 32, 128)]
