"""MoE routing and the fused expert computation."""

from . import naive


def route_topk_softmax(**kwargs):
    """See naive.route_topk_softmax."""
    return naive.route_topk_softmax(**kwargs)


def fused_moe(**kwargs):
    """See naive.fused_moe."""
    if kwargs["hidden"].is_cuda:
        from .triton_moe import fused_moe as impl
    else:
        impl = naive.fused_moe
    return impl(**kwargs)
