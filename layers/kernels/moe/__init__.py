"""MoE routing and the fused expert computation."""

from . import naive
from .naive import AddNorm, NormedOut, SharedExpert, apply_add_norm

__all__ = ["AddNorm", "NormedOut", "SharedExpert", "apply_add_norm", "fused_moe", "route_topk_softmax", "routed_moe"]


def route_topk_softmax(**kwargs):
    """See naive.route_topk_softmax."""
    if kwargs["router_logits"].is_cuda:
        from .triton_moe import route_topk_softmax as impl
    else:
        impl = naive.route_topk_softmax
    return impl(**kwargs)


def fused_moe(**kwargs):
    """See naive.fused_moe (the shared expert too, when `shared` is given)."""
    if kwargs["hidden"].is_cuda:
        from .triton_moe import fused_moe as impl
    else:
        impl = naive.fused_moe
    return impl(**kwargs)


def routed_moe(**kwargs):
    """See naive.routed_moe (route, then the experts; on CUDA's pairs path the up GEMV routes)."""
    if kwargs["hidden"].is_cuda:
        from .triton_moe import routed_moe as impl
    else:
        impl = naive.routed_moe
    return impl(**kwargs)
