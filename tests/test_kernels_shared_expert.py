"""The shared expert inside the fused MoE (the pairs path's down GEMV; the sorted path's activation
kernel, down GEMM and routed sum) against the plain-torch reference: odd shapes, strided
column-slice inputs as the MoE block slices them from its fused projection, expert parallelism,
outputs pre-filled with NaN. Interpreted on CPU tensors without CUDA, compiled with it; and (marked
gpu) bf16 at the model's shape inside a CUDA graph."""

import pytest
import torch
import torch.nn.functional as F

from deltaserve.layers.kernels import moe as moe_kernels
from deltaserve.layers.kernels.moe import naive
from deltaserve.layers.kernels.moe import triton_moe as tm
from deltaserve.layers.kernels.moe.naive import SharedExpert

pytestmark = pytest.mark.usefixtures("nan_fill")


def make(*, tokens, hidden, inter, shared_inter, local, total, top_k, offset, device, dtype=torch.float32, seed=0):
    """Routed inputs (some tokens routed to other ranks' experts) and the shared expert's inputs as
    column slices of a [T, E + 2 I_s + 1 + pad] projection, like the MoE block's in_proj output."""
    g = torch.Generator().manual_seed(seed)
    to = dict(device=device, dtype=dtype)
    proj = torch.randn(tokens, total + 2 * shared_inter + 1 + 3, generator=g).to(**to)
    weights, ids = naive.route_topk_softmax(router_logits=proj[:, :total].float().cpu(), top_k=top_k, renormalize=True)
    gate_row = total + 2 * shared_inter
    return dict(
        hidden=torch.randn(tokens, hidden, generator=g).to(**to),
        w13=(torch.randn(local, 2 * inter, hidden, generator=g) * hidden**-0.5).to(**to),
        w2=(torch.randn(local, hidden, inter, generator=g) * inter**-0.5).to(**to),
        topk_weights=weights.to(**to),
        topk_ids=ids.to(device),
        expert_offset=offset,
        shared=SharedExpert(
            gate_up=proj[:, total:gate_row],
            w2=(torch.randn(hidden, shared_inter, generator=g) * shared_inter**-0.5).to(**to),
            gate_logit=proj[:, gate_row : gate_row + 1],
        ),
    )


def test_reference_is_the_model_composition():
    """naive == routed + sigmoid(gate) * down(silu(gate) * up), as transformers composes the block."""
    args = make(
        tokens=3,
        hidden=12,
        inter=5,
        shared_inter=7,
        local=4,
        total=4,
        top_k=2,
        offset=0,
        device="cpu",
        dtype=torch.float64,
    )
    shared = args.pop("shared")
    act = F.silu(shared.gate_up[:, :7]) * shared.gate_up[:, 7:]
    composed = naive.fused_moe(**args) + torch.sigmoid(shared.gate_logit) * (act @ shared.w2.t())
    assert torch.allclose(naive.fused_moe(**args, shared=shared), composed, atol=1e-12)


CASES = [
    # path, tokens, hidden, inter, shared inter, local experts, total experts, top_k, offset
    ("pairs", 1, 16, 8, 8, 4, 4, 2, 0),
    ("pairs", 3, 37, 24, 40, 6, 6, 2, 0),  # shared wider than the routed experts, odd hidden
    ("pairs", 4, 33, 16, 100, 4, 12, 3, 4),  # expert parallel: a middle rank; shared width not a power of 2
    ("sorted", 9, 40, 16, 24, 5, 15, 2, 10),  # expert parallel, the last rank
    ("pairs", 8, 40, 16, 24, 5, 15, 2, 10),
]


@pytest.mark.parametrize("path,tokens,hidden,inter,shared_inter,local,total,top_k,offset", CASES)
def test_matches_reference(device, path, tokens, hidden, inter, shared_inter, local, total, top_k, offset):
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
    ref = naive.fused_moe(**args)
    out = tm.fused_moe(**args, path=path)
    assert not out.isnan().any(), "an output element was never written"
    tol = 1e-5 if device.type == "cpu" else 5e-3  # tf32-free float32 on the interpreter
    assert ((out - ref).norm() / ref.norm()).item() < tol


def test_sorted_path(device):
    """The sorted path (its activation kernel, the down GEMM, the gate inside the routed sum) at a
    prefill-like shape: the reference's result."""
    args = make(tokens=37, hidden=24, inter=8, shared_inter=16, local=4, total=6, top_k=2, offset=1, device=device)
    ref = naive.fused_moe(**args)
    out = tm.fused_moe(**args, path="sorted")
    assert not out.isnan().any()
    assert ((out - ref).norm() / ref.norm()).item() < (1e-5 if device.type == "cpu" else 5e-3)


def test_bad_shared_shapes_name_the_tensor(device):
    args = make(tokens=2, hidden=16, inter=8, shared_inter=8, local=4, total=4, top_k=2, offset=0, device=device)
    shared = args.pop("shared")
    bad = shared._replace(gate_logit=shared.gate_logit[:1])
    for impl in (naive.fused_moe, moe_kernels.fused_moe):
        with pytest.raises(ValueError, match="shared.gate_logit"):
            impl(**args, shared=bad)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 4, 8, 16, 64])
def test_gpu_bf16_model_shape(tokens):
    """Qwen3.5-35B-A3B's block (H 2,048, 256 experts, top 8, I 512, shared I 512) in bf16, through the
    default path for the batch size, eager and inside a CUDA graph (same bits)."""
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
    ref = naive.fused_moe(**args).float()
    out = tm.fused_moe(**args)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = tm.fused_moe(**args)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, out)


@pytest.mark.gpu
@pytest.mark.parametrize("weights", ["bf16", "fp8"])
@pytest.mark.parametrize("tokens", [16, 64, 2048])
def test_gpu_shared_expert_side_stream_same_bits(tokens, weights):
    """The sorted path runs the shared expert's activation and down projection on a side stream beside
    the routed work, joined by the sum kernel: the block and its next norm have the bits of the
    one-stream order (the projection run by the sum in turn), eagerly over ten calls on dirty memory and
    from a CUDA graph replayed on new inputs (a missing join reads a partial projection). fp8: block-FP8
    experts and shared expert (its down projection through linear, the output allocated on the side
    stream)."""
    from deltaserve.layers.kernels.fp8 import naive as fp8_naive

    args = make(
        tokens=tokens, hidden=2048, inter=512, shared_inter=512, local=256, total=256, top_k=8, offset=0,
        device="cuda", dtype=torch.bfloat16,
    )  # fmt: skip
    scales = {}
    if weights == "fp8":
        (w13, scales["w13_scale"]), (w2, scales["w2_scale"]) = map(fp8_naive.quantize_weight, (args["w13"], args["w2"]))
        shared_w2, shared_scale = fp8_naive.quantize_weight(args["shared"].w2)
        args.update(w13=w13, w2=w2)
        args["shared"] = SharedExpert(
            gate_up=args["shared"].gate_up, w2=shared_w2, gate_logit=args["shared"].gate_logit, w2_scale=shared_scale
        )
    g = torch.Generator(device="cuda").manual_seed(3)
    residual = torch.randn(tokens, 2048, device="cuda", dtype=torch.bfloat16, generator=g)
    weight = 0.1 * torch.randn(2048, device="cuda", dtype=torch.bfloat16, generator=g)
    add_norm = moe_kernels.AddNorm(residual, weight, 1e-6)

    def block(side: bool = True):
        return tm.fused_moe(**args, **scales, path="sorted", add_norm=add_norm, shared_stream=side)

    ref = block(side=False)
    for _ in range(10):
        out = block()
        torch.cuda.synchronize()
        assert torch.equal(out.residual, ref.residual) and torch.equal(out.normed, ref.normed)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = block()
    gate_up = args["shared"].gate_up
    for seed in range(3):  # new shared-expert inputs and hidden rows, in place
        gate_up.copy_(torch.randn(gate_up.shape, device="cuda", generator=g).to(gate_up.dtype))
        args["hidden"].copy_(torch.randn(args["hidden"].shape, device="cuda", generator=g).to(torch.bfloat16))
        ref = block(side=False)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured.residual, ref.residual), seed
        assert torch.equal(captured.normed, ref.normed), seed
