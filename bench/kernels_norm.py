"""RMSNorm cases (bf16): the zero-centred norm and the fused residual add + norm at T=8192 x 2048,
the GDN gated norm at T=8192 x 32 heads x 128, against the plain-torch references on GPU; and the
attention layer's q/k norm + rope with its KV cache write (16 q heads, 2 kv heads, head dim 256,
rotary 64) at prefill sizes, a token a program (the decode tiling) as the peer.

    python -m deltaserve.bench.kernels --only norm
"""

from __future__ import annotations

import torch

from deltaserve.bench.kernel_cases import Case
from deltaserve.layers.kernels.norm import naive
from deltaserve.layers.kernels.norm import triton_norm as tn
from deltaserve.layers.kernels.rotary import naive as rotary_naive
from deltaserve.layers.kernels.rotary import triton_rotary as tr

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


def _qk_rope_case(num_tokens: int, hq: int = 16, hkv: int = 2, d: int = 256, page: int = 16) -> Case:
    q_gate = torch.randn(num_tokens, hq, 2 * d, device="cuda", dtype=DTYPE)
    kv = torch.randn(num_tokens, 2 * hkv, d, device="cuda", dtype=DTYPE)
    pages = -(-num_tokens // page)
    cache = [torch.zeros(pages, page, hkv, d, device="cuda", dtype=DTYPE) for _ in range(2)]
    slots = torch.arange(num_tokens, device="cuda")
    w = 0.1 * torch.randn(d, device="cuda", dtype=DTYPE)
    args = dict(
        q=q_gate[..., :d], k=kv[:, :hkv], q_weight=w, k_weight=w, positions=slots, eps=EPS, rotary_dim=64,
        theta=1e7, kv_cache=rotary_naive.KvCacheWrite(kv[:, hkv:], cache[0], cache[1], slots),
    )  # fmt: skip

    def check():
        ours, ref = tr.qk_norm_rope(**args), rotary_naive.qk_norm_rope(**args)
        return max(_max_err(a, b) for a, b in zip(ours, ref, strict=True))

    return Case(
        op="qk_norm_rope+kv",
        shape=f"T={num_tokens} Hq={hq} Hkv={hkv} D={d}",
        ours=lambda: tr.qk_norm_rope(**args),
        reference=lambda: rotary_naive.qk_norm_rope(**args),
        reference_label="torch",
        check=check,
        tolerance=5e-2,
        bytes_moved=2 * num_tokens * (hq + 2 * hkv) * d * 2,
        peer=lambda: tr.qk_norm_rope(**args, block_t=1),
        peer_label="a token a program",
    )


def cases() -> list[Case]:
    return [
        _rms_case(8192, 2048), _add_rms_case(8192, 2048), _gated_case(8192, 32, 128), _qk_rope_case(2048),
        _qk_rope_case(8192),
    ]  # fmt: skip
