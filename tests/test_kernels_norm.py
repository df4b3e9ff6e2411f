"""Triton RMSNorm variants vs the plain-torch references at small shapes: interpreted on CPU
tensors without CUDA, compiled on the GPU with it; and (marked gpu) bf16 at the real shapes."""

import pytest
import torch

from deltaserve.layers.kernels.norm import naive
from deltaserve.layers.kernels.norm import triton_norm as tn

# conftest: TRITON_INTERPRET without CUDA, the `device` fixture, gpu-marked tests skipped on CPU
pytestmark = pytest.mark.usefixtures("nan_fill")


def max_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not out.isnan().any(), "NaN in the output (an element was never written)"
    return (out.float() - ref.float()).abs().max().item()


@pytest.mark.parametrize("shape", [(7, 64), (3, 5, 20), (1, 48)])
@pytest.mark.parametrize("zero_centered", [True, False])
def test_rms_norm(device, shape, zero_centered):
    x = torch.randn(shape, device=device)
    w = torch.randn(shape[-1], device=device) * 0.5
    ref = naive.rms_norm(x=x, weight=w, eps=1e-6, zero_centered=zero_centered)
    assert max_err(tn.rms_norm(x=x, weight=w, eps=1e-6, zero_centered=zero_centered), ref) < 1e-5


@pytest.mark.parametrize(("tokens", "vocab", "dim"), [(1, 50, 64), (7, 13, 40), (5, 9, 2048)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embed_rms_norm(device, tokens, vocab, dim, dtype):
    """The embedding lookup + the first input norm: the rows exactly the table's, the normed rows
    as the plain norm of them (repeated ids included)."""
    g = torch.Generator().manual_seed(tokens + dim)
    table = torch.randn(vocab, dim, generator=g).to(device=device, dtype=dtype)
    w = (0.1 * torch.randn(dim, generator=g)).to(device=device, dtype=dtype)
    ids = torch.randint(0, vocab, (tokens,), generator=g).to(device)
    ids[0] = vocab - 1
    normed, rows = tn.embed_rms_norm(ids=ids, table=table, weight=w, eps=1e-6)
    ref_normed, ref_rows = naive.embed_rms_norm(ids=ids, table=table, weight=w, eps=1e-6)
    assert torch.equal(rows, ref_rows)
    tol = 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps * ref_normed.float().abs().max().item()
    assert max_err(normed, ref_normed) <= tol


def test_rms_norm_strided_rows(device):
    """q out of a fused q/gate projection: [T, H, 2D] sliced to [..., :D] (row stride 2D)."""
    qg = torch.randn(5, 3, 2 * 24, device=device)
    q = qg[..., :24]
    w = torch.randn(24, device=device)
    assert max_err(tn.rms_norm(x=q, weight=w, eps=1e-6), naive.rms_norm(x=q, weight=w, eps=1e-6)) < 1e-5


@pytest.mark.parametrize("shape", [(9, 4, 16), (6, 3, 40)])
def test_gated_rms_norm(device, shape):
    x, gate = torch.randn(shape, device=device), torch.randn(shape, device=device)
    w = 1 + 0.2 * torch.randn(shape[-1], device=device)
    ref = naive.gated_rms_norm(x=x, gate=gate, weight=w, eps=1e-6)
    assert max_err(tn.gated_rms_norm(x=x, gate=gate, weight=w, eps=1e-6), ref) < 1e-5


@pytest.mark.parametrize("tokens", [1, 5])
def test_gated_rms_norm_gate_from_a_projection(device, tokens):
    """GDN's gate z: [T, H, D] columns of the in_proj output (token rows 300 apart, heads D apart),
    read in place (reshaping it to rows would copy it every pass)."""
    heads, dim = 4, 16
    proj = torch.randn(tokens, 300, device=device)
    gate = proj[:, 37 : 37 + heads * dim].reshape(tokens, heads, dim)
    assert gate.data_ptr() == proj[:, 37:].data_ptr(), "the test's gate must be a view"
    x = torch.randn(tokens, heads, dim, device=device)
    w = 1 + 0.2 * torch.randn(dim, device=device)
    ref = naive.gated_rms_norm(x=x, gate=gate.contiguous(), weight=w, eps=1e-6)
    assert max_err(tn.gated_rms_norm(x=x, gate=gate, weight=w, eps=1e-6), ref) < 1e-5


def test_fused_add_rms_norm(device):
    x, residual = torch.randn(11, 56, device=device), torch.randn(11, 56, device=device)
    w = torch.randn(56, device=device) * 0.3
    out, summed = tn.fused_add_rms_norm(x=x, residual=residual, weight=w, eps=1e-5)
    ref, ref_summed = naive.fused_add_rms_norm(x=x, residual=residual, weight=w, eps=1e-5)
    assert torch.equal(summed, ref_summed)
    assert max_err(out, ref) < 1e-5


# --- GPU, bf16, the real shapes ------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_rms_norm_bf16():
    x = torch.randn(8192, 2048, device="cuda", dtype=torch.bfloat16)
    w = (0.1 * torch.randn(2048, device="cuda")).to(torch.bfloat16)
    assert max_err(tn.rms_norm(x=x, weight=w, eps=1e-6), naive.rms_norm(x=x, weight=w, eps=1e-6)) < 5e-2
    q = torch.randn(64, 16, 512, device="cuda", dtype=torch.bfloat16)[..., :256]
    wq = (0.1 * torch.randn(256, device="cuda")).to(torch.bfloat16)
    assert max_err(tn.rms_norm(x=q, weight=wq, eps=1e-6), naive.rms_norm(x=q, weight=wq, eps=1e-6)) < 5e-2


@pytest.mark.gpu
def test_gpu_gated_rms_norm_bf16():
    x = torch.randn(8192, 32, 128, device="cuda", dtype=torch.bfloat16)
    gate = torch.randn_like(x)
    w = 1 + 0.1 * torch.randn(128, device="cuda")
    ref = naive.gated_rms_norm(x=x, gate=gate, weight=w, eps=1e-6)
    assert max_err(tn.gated_rms_norm(x=x, gate=gate, weight=w, eps=1e-6), ref) < 5e-2


@pytest.mark.gpu
def test_gpu_fused_add_rms_norm_bf16():
    x = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    w = (0.1 * torch.randn(2048, device="cuda")).to(torch.bfloat16)
    out, summed = tn.fused_add_rms_norm(x=x, residual=residual, weight=w, eps=1e-6)
    ref, ref_summed = naive.fused_add_rms_norm(x=x, residual=residual, weight=w, eps=1e-6)
    assert torch.equal(summed, ref_summed)
    assert max_err(out, ref) < 5e-2
