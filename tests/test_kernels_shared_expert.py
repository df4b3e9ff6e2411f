"""The fused shared-expert tail (down projection + sigmoid gate + routed sum) against its plain-torch
reference at odd shapes, strided column-slice inputs, outputs pre-filled with NaN: interpreted on CPU
tensors without CUDA, compiled with it; and (marked gpu) bf16 at the model's shape."""

import pytest
import torch
import torch.nn.functional as F

from deltaserve.layers.kernels import moe as moe_kernels
from deltaserve.layers.kernels.moe import naive, triton_shared

pytestmark = pytest.mark.usefixtures("nan_fill")


def make(tokens: int, hidden: int, inter: int, device, dtype=torch.float32, seed=0):
    """Inputs as the MoE block slices them out of its fused projection [T, E + 2I + 1 + pad]."""
    g = torch.Generator().manual_seed(seed)
    experts, pad = 5, 3
    proj = torch.randn(tokens, experts + 2 * inter + 1 + pad, generator=g)
    w2 = torch.randn(hidden, inter, generator=g) * inter**-0.5
    routed = torch.randn(tokens, hidden, generator=g)
    to = dict(device=device, dtype=dtype)
    proj, w2, routed = proj.to(**to), w2.to(**to), routed.to(**to)
    gate_row = experts + 2 * inter
    return dict(routed=routed, gate_up=proj[:, experts:gate_row], w2=w2, gate_logit=proj[:, gate_row : gate_row + 1])


def test_reference_is_the_model_composition():
    """naive == routed + sigmoid(gate) * down(silu(gate) * up), as the MoE block composes it."""
    args = make(3, 12, 7, "cpu", dtype=torch.float64)
    inter = 7
    act = F.silu(args["gate_up"][:, :inter]) * args["gate_up"][:, inter:]
    composed = args["routed"] + torch.sigmoid(args["gate_logit"]) * (act @ args["w2"].t())
    assert torch.allclose(naive.shared_expert_combine(**args), composed, atol=1e-12)


@pytest.mark.parametrize(("tokens", "hidden", "inter"), [(1, 16, 8), (3, 37, 24), (4, 130, 100), (2, 9, 64)])
@pytest.mark.parametrize("config", [None, dict(block_n=4, block_k=16, num_warps=2)])
def test_matches_reference(device, tokens, hidden, inter, config):
    args = make(tokens, hidden, inter, device)
    out = triton_shared.shared_expert_combine(**args, config=config)
    ref = naive.shared_expert_combine(**args)
    assert not out.isnan().any(), "an output element was never written"
    assert (out - ref).abs().max().item() <= 1e-4


def test_empty(device):
    args = make(0, 16, 8, device)
    assert triton_shared.shared_expert_combine(**args).shape == (0, 16)


def test_dispatch(device):
    """The op: the kernel on CUDA, the reference on CPU; the model fuses only up to the row cap."""
    args = make(2, 16, 8, device)
    out = moe_kernels.shared_expert_combine(**args)
    if device.type == "cpu":
        assert torch.equal(out, naive.shared_expert_combine(**args))
        assert not moe_kernels.fuses_shared_combine(args["routed"])
    else:
        assert torch.equal(out, triton_shared.shared_expert_combine(**args))
        cap = moe_kernels.SHARED_COMBINE_MAX_TOKENS
        assert moe_kernels.fuses_shared_combine(make(cap, 16, 8, device)["routed"])
        assert not moe_kernels.fuses_shared_combine(make(cap + 1, 16, 8, device)["routed"])


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 2, 4])
def test_gpu_bf16_model_shape(tokens):
    """Qwen3.5-35B-A3B's shared expert (H 2,048, I 512) in bf16, inside a CUDA graph too."""
    args = make(tokens, 2048, 512, "cuda", dtype=torch.bfloat16)
    ref = naive.shared_expert_combine(**args)
    out = triton_shared.shared_expert_combine(**args)
    scale = ref.float().abs().max().item()
    assert (out.float() - ref.float()).abs().max().item() <= 2 * scale * torch.finfo(torch.bfloat16).eps
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = triton_shared.shared_expert_combine(**args)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, out)
