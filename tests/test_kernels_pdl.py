"""Programmatic dependent launch: off for CPU tensors (the interpreter) and when not asked for, and
on the GPU a chain of decode kernels (norm -> GEMV -> router -> fused MoE -> norm) captured in a
CUDA graph gives the same bits with it as without it (pdl=False, KernelOptions.pdl)."""

import pytest
import torch

from deltaserve.layers.kernels import linear as linear_kernels
from deltaserve.layers.kernels import moe as moe_kernels
from deltaserve.layers.kernels import norm as norm_kernels
from deltaserve.layers.kernels.pdl import pdl_enabled, pdl_launch


def test_off_for_cpu_tensors_and_when_not_asked():
    x = torch.zeros(2)
    assert not pdl_enabled(x, True)
    assert pdl_launch(x, True) == {"USE_PDL": False}
    if torch.cuda.is_available():
        assert not pdl_enabled(x.cuda(), False)
        assert pdl_launch(x.cuda(), False) == {"USE_PDL": False}


def _chain(x, residual, norm_w, w_in, w13, w2, shared_w2, pdl):
    h, res = norm_kernels.fused_add_rms_norm(x=x, residual=residual, weight=norm_w, eps=1e-6, pdl=pdl)
    proj = linear_kernels.linear(x=h, weight=w_in, pdl=pdl)
    weights, ids = moe_kernels.route_topk_softmax(router_logits=proj[:, :64], top_k=4, renormalize=True, pdl=pdl)
    shared = moe_kernels.SharedExpert(gate_up=proj[:, 64:320], w2=shared_w2, gate_logit=proj[:, 320:321])
    out = moe_kernels.fused_moe(hidden=h, w13=w13, w2=w2, topk_weights=weights, topk_ids=ids, shared=shared, pdl=pdl)
    return norm_kernels.fused_add_rms_norm(x=out, residual=res, weight=norm_w, eps=1e-6, pdl=pdl)[0]


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 3, 16])
def test_gpu_graph_same_bits_with_and_without(tokens):
    g = torch.Generator(device="cuda").manual_seed(tokens)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    hidden = 512
    args = (
        torch.randn(tokens, hidden, generator=g, **bf),
        torch.randn(tokens, hidden, generator=g, **bf),
        torch.randn(hidden, generator=g, **bf) * 0.1,
        torch.randn(328, hidden, generator=g, **bf) * hidden**-0.5,
        torch.randn(64, 2 * 128, hidden, generator=g, **bf) * hidden**-0.5,
        torch.randn(64, hidden, 128, generator=g, **bf) * 128**-0.5,
        torch.randn(hidden, 128, generator=g, **bf) * 128**-0.5,
    )
    outs = {}
    for pdl in (True, False):
        _chain(*args, pdl)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = _chain(*args, pdl)
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        outs[pdl] = captured.clone()
    assert not outs[True].isnan().any()
    assert torch.equal(outs[True], outs[False])
