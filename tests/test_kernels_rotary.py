"""The fused q/k head norm + partial rotary kernel against its plain-torch reference (interpreted
on CPU, compiled on CUDA), including strided q (a view into the fused q/gate projection)."""

import functools

import pytest
import torch

from deltaserve.layers.kernels.rotary import naive
from deltaserve.layers.kernels.rotary import triton_rotary as tr


@pytest.mark.parametrize("block_t", [None, 4])  # the default (one token a program here), a tile with a tail
@pytest.mark.parametrize(
    "tokens, q_heads, k_heads, head_dim, rotary_dim",
    [(1, 6, 2, 16, 4), (7, 3, 1, 24, 8), (33, 4, 4, 64, 64), (5, 2, 1, 256, 64), (70, 2, 1, 32, 16), (9, 2, 1, 40, 12)],
)
def test_matches_reference(device, nan_fill, tokens, q_heads, k_heads, head_dim, rotary_dim, block_t):
    g = torch.Generator().manual_seed(tokens)
    q_gate = torch.randn(tokens, q_heads, 2 * head_dim, generator=g).to(device)
    q = q_gate[..., :head_dim]  # strided, as the layer passes it
    k = torch.randn(tokens, k_heads, head_dim, generator=g).to(device)
    qw, kw = (
        (0.3 * torch.randn(head_dim, generator=g)).to(device),
        (0.3 * torch.randn(head_dim, generator=g)).to(device),
    )
    positions = torch.randint(0, 5000, (tokens,), generator=g).to(device)
    kwargs = dict(q=q, k=k, q_weight=qw, k_weight=kw, positions=positions, eps=1e-6, rotary_dim=rotary_dim, theta=1e7)
    ref_q, ref_k = naive.qk_norm_rope(**kwargs)
    out_q, out_k = tr.qk_norm_rope(**kwargs, block_t=block_t)
    tol = 2e-4 if device.type == "cpu" else 1e-3  # angles up to 5000 rad: float32 phase rounding
    assert torch.allclose(out_q, ref_q, atol=tol, rtol=tol), (out_q - ref_q).abs().max()
    assert torch.allclose(out_k, ref_k, atol=tol, rtol=tol), (out_k - ref_k).abs().max()


@pytest.mark.gpu
def test_bf16_at_real_shape(device):
    tokens, d = 64, 256
    q_gate = torch.randn(tokens, 16, 2 * d, device=device, dtype=torch.bfloat16)
    k = torch.randn(tokens, 2, d, device=device, dtype=torch.bfloat16)
    w = 0.1 * torch.randn(d, device=device, dtype=torch.bfloat16)
    positions = torch.arange(30000, 30000 + tokens, device=device)
    kwargs = dict(
        q=q_gate[..., :d], k=k, q_weight=w, k_weight=w, positions=positions, eps=1e-6, rotary_dim=64, theta=1e7
    )
    ref_q, ref_k = naive.qk_norm_rope(**kwargs)
    out_q, out_k = tr.qk_norm_rope(**kwargs)
    assert (out_q.float() - ref_q.float()).abs().max() < 0.05
    assert (out_k.float() - ref_k.float()).abs().max() < 0.05


@pytest.mark.parametrize("block_t", [None, 2])
@pytest.mark.parametrize(
    "tokens, q_heads, k_heads, head_dim, rotary_dim", [(5, 4, 2, 24, 8), (3, 2, 1, 16, 16), (4, 2, 1, 40, 12)]
)
def test_writes_kv_cache(device, nan_fill, tokens, q_heads, k_heads, head_dim, rotary_dim, block_t):
    """With kv_cache the same launch writes the finished k and the value to their slots: every
    written slot equals the reference's, a slot of -1 writes nothing, untouched slots keep their
    bits; q and k are returned as without it."""
    g = torch.Generator().manual_seed(tokens + head_dim)
    q = torch.randn(tokens, q_heads, 2 * head_dim, generator=g).to(device)[..., :head_dim]
    kv = torch.randn(tokens, 2 * k_heads, head_dim, generator=g).to(device)
    k, v = kv[:, :k_heads], kv[:, k_heads:]  # strided views, as the fused projection gives them
    qw, kw = ((0.3 * torch.randn(head_dim, generator=g)).to(device) for _ in range(2))
    positions = torch.arange(100, 100 + tokens, device=device)
    pages, block = 4, 4
    slots = torch.tensor([13, 2, -1, 7, 0][:tokens], device=device)
    kwargs = dict(q=q, k=k, q_weight=qw, k_weight=kw, positions=positions, eps=1e-6, rotary_dim=rotary_dim, theta=1e6)
    caches = {}
    for name, impl in (("ref", naive.qk_norm_rope), ("ours", functools.partial(tr.qk_norm_rope, block_t=block_t))):
        k_cache = torch.full((pages, block, k_heads, head_dim), 7.0, device=device)
        v_cache = torch.full((pages, block, k_heads, head_dim), 7.0, device=device)
        out = impl(**kwargs, kv_cache=naive.KvCacheWrite(v, k_cache, v_cache, slots))
        caches[name] = (out, k_cache, v_cache)
    (ref_q, ref_k), ref_kc, ref_vc = caches["ref"]
    (out_q, out_k), out_kc, out_vc = caches["ours"]
    tol = 2e-4 if device.type == "cpu" else 1e-3
    assert torch.allclose(out_q, ref_q, atol=tol, rtol=tol) and torch.allclose(out_k, ref_k, atol=tol, rtol=tol)
    assert torch.allclose(out_kc, ref_kc, atol=tol, rtol=tol)
    assert torch.equal(out_vc, ref_vc)
    written = torch.zeros(pages * block, dtype=torch.bool)
    written[[s for s in slots.tolist() if s >= 0]] = True
    assert (out_kc.view(pages * block, -1)[~written.to(device)] == 7.0).all()  # untouched slots, -1 included


@pytest.mark.parametrize("block_t", [None, 2])
def test_writes_fp8_kv_cache(device, nan_fill, block_t):
    """An e4m3 cache (kv_cache_dtype fp8): the launch stores its own finished k, and the value,
    rounded to e4m3 as torch rounds them (values beyond +-448 saturate), bit for bit; -1 writes
    nothing."""
    g = torch.Generator().manual_seed(11)
    tokens, q_heads, k_heads, head_dim = 4, 2, 2, 24
    q = torch.randn(tokens, q_heads, head_dim, generator=g).to(device)
    k = torch.randn(tokens, k_heads, head_dim, generator=g).to(device)
    v = (torch.randn(tokens, k_heads, head_dim, generator=g) * 200).to(device)  # some beyond 448
    qw, kw = ((0.3 * torch.randn(head_dim, generator=g)).to(device) for _ in range(2))
    slots = torch.tensor([5, -1, 0, 14], device=device)
    kwargs = dict(q=q, k=k, q_weight=qw, k_weight=kw, positions=torch.arange(tokens, device=device), eps=1e-6,
                  rotary_dim=8, theta=1e6)  # fmt: skip
    fp8 = torch.float8_e4m3fn
    k_cache = torch.full((4, 4, k_heads, head_dim), 7.0, device=device).to(fp8)
    v_cache = k_cache.clone()
    _, out_k = tr.qk_norm_rope(**kwargs, kv_cache=naive.KvCacheWrite(v, k_cache, v_cache, slots), block_t=block_t)
    flat_k, flat_v = k_cache.view(16, k_heads, head_dim), v_cache.view(16, k_heads, head_dim)
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        assert torch.equal(flat_k[s].view(torch.uint8), out_k[t].to(fp8).view(torch.uint8))
        assert torch.equal(flat_v[s].view(torch.uint8), v[t].clamp(-448, 448).to(fp8).view(torch.uint8))
    assert flat_v.float().abs().max() == 448.0
    written = torch.zeros(16, dtype=torch.bool, device=device)
    written[[0, 5, 14]] = True
    assert (flat_k[~written].float() == 7.0).all() and (flat_v[~written].float() == 7.0).all()


@pytest.mark.gpu
def test_rows_past_2_31_elements_of_the_projection(device):
    """240,000 tokens of q / k read as views of the fused qkv output (rows of 9,216, the 35B attention's):
    a token times the row stride passes 2^31 from token 233,017. The rows past it equal the same rows
    normed and rotated alone (small offsets)."""
    tokens, d = 240_000, 256
    qkv = torch.randn(tokens, 9216, device=device, dtype=torch.bfloat16)
    q = qkv[:, :8192].view(tokens, 16, 2 * d)[..., :d]
    k = qkv[:, 8192:8704].view(tokens, 2, d)
    w = 0.1 * torch.randn(d, device=device, dtype=torch.bfloat16)
    positions = torch.arange(tokens, device=device)
    kwargs = dict(q_weight=w, k_weight=w, eps=1e-6, rotary_dim=64, theta=1e7)
    out_q, out_k = tr.qk_norm_rope(q=q, k=k, positions=positions, **kwargs)
    for start in (1000, 233_000, 239_872):
        rows = slice(start, start + 128)
        alone_q, alone_k = tr.qk_norm_rope(q=q[rows], k=k[rows], positions=positions[rows], **kwargs)
        assert torch.equal(out_q[rows], alone_q), start
        assert torch.equal(out_k[rows], alone_k), start
