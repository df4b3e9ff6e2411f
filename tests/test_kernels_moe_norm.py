"""The residual add + RMSNorm that follows an MoE block, done by the block's last kernel (the pairs
path's down GEMV through a last-program ticket, the sorted path's sum kernel): the block followed
by the norm kernel (the same residual bits; the norm within float32 rounding of its sum of
squares), for every row, with the tickets left at zero."""

import pytest
import torch
from test_kernels_shared_expert import make

from deltaserve.layers.kernels import norm as norm_kernels
from deltaserve.layers.kernels.device import ticket_buffers
from deltaserve.layers.kernels.moe import AddNorm, NormedOut, naive
from deltaserve.layers.kernels.moe import fused_norm as fused_norm_module
from deltaserve.layers.kernels.moe import triton_moe as tm

pytestmark = pytest.mark.usefixtures("nan_fill")

CASES = [
    # path, tokens, hidden, inter, shared inter, local experts, total experts, top_k, offset
    ("pairs", 1, 16, 8, 8, 4, 4, 2, 0),
    ("pairs", 3, 37, 24, 40, 6, 6, 2, 0),  # odd hidden: the row's tail is masked
    ("pairs", 4, 33, 16, 100, 4, 12, 3, 4),  # expert parallel
    ("sorted", 9, 40, 16, 24, 5, 15, 2, 10),
    ("sorted", 37, 24, 8, 16, 4, 6, 2, 1),
]


def _add_norm(tokens: int, hidden: int, device, dtype=torch.float32) -> AddNorm:
    g = torch.Generator().manual_seed(7)
    residual = torch.randn(tokens, hidden, generator=g).to(device=device, dtype=dtype)
    weight = (0.1 * torch.randn(hidden, generator=g)).to(device=device, dtype=dtype)
    return AddNorm(residual, weight, 1e-6)


@pytest.mark.parametrize("path,tokens,hidden,inter,shared_inter,local,total,top_k,offset", CASES)
def test_fused_norm_is_block_then_norm(device, path, tokens, hidden, inter, shared_inter, local, total, top_k, offset):
    args = make(
        tokens=tokens,
        hidden=hidden,
        inter=inter,
        shared_inter=shared_inter,
        local=local,
        total=total,
        top_k=top_k,
        offset=offset,
        device=device,
    )
    add_norm = _add_norm(tokens, hidden, device)
    block = tm.fused_moe(**args, path=path)
    ref_normed, ref_residual = norm_kernels.fused_add_rms_norm(
        x=block, residual=add_norm.residual, weight=add_norm.weight, eps=add_norm.eps
    )
    for _ in range(2):  # a second launch finds the tickets back at zero
        out = tm.fused_moe(**args, path=path, add_norm=add_norm)
        assert isinstance(out, NormedOut)
        assert not out.normed.isnan().any() and not out.residual.isnan().any(), "an element was never written"
        # the sum is the same op; the sum of squares may add up in another order (another block width)
        assert torch.equal(out.residual, ref_residual)
        torch.testing.assert_close(out.normed, ref_normed, rtol=2e-6, atol=2e-6)
    for tickets in ticket_buffers("moe_down_norm", device):
        assert not tickets.any()


def test_naive_and_unfused_paths_apply_the_norm(device, monkeypatch):
    """The reference and rows too wide for the fused norm give NormedOut too: block, then the norm."""
    args = make(tokens=5, hidden=24, inter=8, shared_inter=16, local=4, total=6, top_k=2, offset=0, device=device)
    add_norm = _add_norm(5, 24, device)
    ref = naive.fused_moe(**args)
    # the op the reference applies: the norm kernel on CUDA (its own sum order), plain torch on CPU
    normed, summed = norm_kernels.fused_add_rms_norm(
        x=ref, residual=add_norm.residual, weight=add_norm.weight, eps=add_norm.eps
    )
    got = naive.fused_moe(**args, add_norm=add_norm)
    assert torch.equal(got.normed, normed) and torch.equal(got.residual, summed)
    monkeypatch.setattr(fused_norm_module, "MAX_NORM_HIDDEN", 16)  # 24 wide: the norm kernel after the block
    for path in ("pairs", "sorted"):
        unfused = tm.fused_moe(**args, path=path, add_norm=add_norm)
        # float32 tl.dot runs in tf32 on the GPU (the rule of test_kernels_moe's `tol`)
        tol = 1e-5 if device.type == "cpu" else 5e-3
        torch.testing.assert_close(unfused.residual, summed, rtol=tol, atol=tol)
        torch.testing.assert_close(unfused.normed, normed, rtol=10 * tol, atol=10 * tol)


def test_bad_residual_names_the_field(device):
    args = make(tokens=2, hidden=16, inter=8, shared_inter=8, local=4, total=4, top_k=2, offset=0, device=device)
    bad = AddNorm(torch.zeros(3, 16, device=device), torch.zeros(16, device=device), 1e-6)
    with pytest.raises(ValueError, match="add_norm.residual"):
        tm.fused_moe(**args, add_norm=bad)
    bad = AddNorm(torch.zeros(2, 16, device=device), torch.zeros(15, device=device), 1e-6)
    with pytest.raises(ValueError, match="add_norm.weight"):
        tm.fused_moe(**args, add_norm=bad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the model's shape in bf16")
@pytest.mark.parametrize("tokens", [1, 3, 16])
def test_gpu_bf16_model_shape(tokens):
    args = make(
        tokens=tokens,
        hidden=2048,
        inter=512,
        shared_inter=512,
        local=256,
        total=256,
        top_k=8,
        offset=0,
        device="cuda",
        dtype=torch.bfloat16,
    )
    add_norm = _add_norm(tokens, 2048, "cuda", torch.bfloat16)
    block = tm.fused_moe(**args)
    normed, summed = norm_kernels.fused_add_rms_norm(
        x=block, residual=add_norm.residual, weight=add_norm.weight, eps=add_norm.eps
    )
    out = tm.fused_moe(**args, add_norm=add_norm)
    assert torch.equal(out.residual, summed)
    torch.testing.assert_close(out.normed, normed, rtol=1.6e-2, atol=1e-2)  # one bf16 rounding apart at most
    for tickets in ticket_buffers("moe_down_norm", torch.device("cuda")):
        assert not tickets.any()
