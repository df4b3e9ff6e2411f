"""routed_moe: on the pairs path the experts' up GEMV does the router's top-k itself (no router
launch). It must give what routing first and then running the experts gives: the same tokens'
experts, weights and outputs, under expert parallelism, with the shared expert and the fused norm."""

import pytest
import torch
from test_kernels_shared_expert import make

from deltaserve.layers.kernels.moe import AddNorm, naive
from deltaserve.layers.kernels.moe import triton_moe as tm

pytestmark = pytest.mark.usefixtures("nan_fill")

CASES = [
    # tokens, hidden, inter, shared inter, local experts, total experts, top_k, offset, renormalize,
    # with_norm (the fused add + norm in the down GEMV: its own kernel arguments, not the routing's;
    # it runs with and without EP, with and without renormalizing, with the shared expert preloaded
    # and in chunks)
    (1, 16, 8, 8, 4, 4, 2, 0, True, False),
    (3, 37, 24, 40, 6, 6, 2, 0, False, True),
    (4, 33, 16, 100, 4, 12, 3, 4, True, True),  # expert parallel: a middle rank; the shared expert in 2 chunks
    (5, 40, 16, 24, 5, 15, 2, 10, True, False),  # the last rank
    (2, 24, 8, 16, 40, 40, 8, 0, True, True),  # top-8 of 40
]


@pytest.mark.parametrize("tokens,hidden,inter,shared_inter,local,total,top_k,offset,renormalize,with_norm", CASES)
def test_routing_in_the_up_gemv_is_route_then_experts(
    device, tokens, hidden, inter, shared_inter, local, total, top_k, offset, renormalize, with_norm
):
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
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(tokens, total, generator=g).to(device)
    logits[0, : min(3, total)] = logits[0, 0]  # ties go to the lower expert, as the router kernel's
    del args["topk_weights"], args["topk_ids"]
    add_norm = None
    if with_norm:
        residual = torch.randn(tokens, hidden, generator=g).to(device)
        add_norm = AddNorm(residual, torch.zeros(hidden, device=device), 1e-6)
    weights, ids = tm.route_topk_softmax(router_logits=logits, top_k=top_k, renormalize=renormalize)
    first = tm.fused_moe(**args, topk_weights=weights, topk_ids=ids, path="pairs", add_norm=add_norm)
    routed = tm.routed_moe(
        **args,
        router_logits=logits,
        top_k=top_k,
        renormalize=renormalize,
        path="pairs",
        add_norm=add_norm,
        route_in_up_max_tokens=tokens,
    )
    # the reference experts on the router kernel's choice (torch.topk may order the tie differently)
    ref = naive.fused_moe(**args, topk_weights=weights, topk_ids=ids, add_norm=add_norm)
    pairs = zip(routed, first, ref, strict=True) if with_norm else [(routed, first, ref)]
    for got, want, reference in pairs:
        assert not got.isnan().any(), "an output element was never written"
        if device.type == "cpu":  # the interpreter: the same arithmetic, so the same bits
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert ((got - reference).norm() / reference.norm()).item() < (1e-5 if device.type == "cpu" else 5e-3)


def test_other_paths_route_first(device):
    """The sorted path (and large expert counts) keep the router launch: same result as the reference."""
    args = make(tokens=37, hidden=24, inter=8, shared_inter=16, local=4, total=6, top_k=2, offset=1, device=device)
    del args["topk_weights"], args["topk_ids"]
    logits = torch.randn(37, 6, generator=torch.Generator().manual_seed(5)).to(device)
    got = tm.routed_moe(**args, router_logits=logits, top_k=2, renormalize=True)
    ref = naive.routed_moe(**args, router_logits=logits, top_k=2, renormalize=True)
    assert ((got - ref).norm() / ref.norm()).item() < (1e-5 if device.type == "cpu" else 5e-3)


def test_only_small_batches_route_in_the_up_gemv(device, monkeypatch):
    """By default up to ROUTE_IN_UP_MAX_TOKENS tokens route inside the up GEMV (no router launch) and
    more tokens launch the router first (measured slower at batch 8); route_in_up_max_tokens
    (KernelOptions, DELTASERVE_ROUTE_IN_UP_MAX_TOKENS) moves the cut, and 0 always launches it."""
    launched = []
    route = tm.route_topk_softmax

    def counting_route(**kwargs):
        launched.append(kwargs["router_logits"].shape[0])
        return route(**kwargs)

    monkeypatch.setattr(tm, "route_topk_softmax", counting_route)
    cut = tm.ROUTE_IN_UP_MAX_TOKENS
    for tokens in (1, cut, cut + 1):
        shape = dict(hidden=24, inter=8, shared_inter=16, local=6, total=6, top_k=2, offset=0)
        args = make(tokens=tokens, **shape, device=device)
        del args["topk_weights"], args["topk_ids"]
        logits = torch.randn(tokens, 6, generator=torch.Generator().manual_seed(tokens)).to(device)
        got = tm.routed_moe(**args, router_logits=logits, top_k=2, renormalize=True)
        ref = naive.routed_moe(**args, router_logits=logits, top_k=2, renormalize=True)
        assert ((got - ref).norm() / ref.norm()).item() < (1e-5 if device.type == "cpu" else 5e-3)
    assert launched == [cut + 1]
    tm.routed_moe(**args, router_logits=logits, top_k=2, renormalize=True, route_in_up_max_tokens=cut + 1)
    assert launched == [cut + 1]
    one = make(tokens=1, **shape, device=device)
    del one["topk_weights"], one["topk_ids"]
    tm.routed_moe(**one, router_logits=logits[:1], top_k=2, renormalize=True, route_in_up_max_tokens=0)
    assert launched == [cut + 1, 1]


def test_routing_up_gemv_tiles_from_config(device):
    """routed_moe's `config` (the pairs sweep's `--kernel route`) sets the routing up GEMV's tiles:
    other tiles (another K chunk: another summation order), the reference's result."""
    from deltaserve.layers.kernels.device import device_info
    from deltaserve.layers.kernels.moe import tiles

    args = make(tokens=2, hidden=40, inter=16, shared_inter=16, local=6, total=6, top_k=2, offset=0, device=device)
    del args["topk_weights"], args["topk_ids"]
    logits = torch.randn(2, 6, generator=torch.Generator().manual_seed(9)).to(device)
    kw = dict(router_logits=logits, top_k=2, renormalize=True, path="pairs", route_in_up_max_tokens=2)
    default = tm.routed_moe(**args, **kw)
    cfg = tiles.pairs_config(40, 16, device_info(logits.device))
    other = tm.routed_moe(**args, **kw, config={**cfg, "up_route": dict(block_n=2, block_k=16, num_warps=2)})
    ref = naive.routed_moe(**args, router_logits=logits, top_k=2, renormalize=True)
    assert ((other - ref).norm() / ref.norm()).item() < (1e-5 if device.type == "cpu" else 5e-3)
    assert ((other - default).norm() / default.norm()).item() < (1e-5 if device.type == "cpu" else 5e-3)
