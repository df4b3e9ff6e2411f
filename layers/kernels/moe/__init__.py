"""MoE routing and the fused expert computation."""

from . import naive


def route_topk_softmax(**kwargs):
    """See naive.route_topk_softmax."""
    if kwargs["router_logits"].is_cuda:
        from .triton_moe import route_topk_softmax as impl
    else:
        impl = naive.route_topk_softmax
    return impl(**kwargs)


def fused_moe(**kwargs):
    """See naive.fused_moe."""
    if kwargs["hidden"].is_cuda:
        from .triton_moe import fused_moe as impl
    else:
        impl = naive.fused_moe
    return impl(**kwargs)


# Decode batches up to this many rows take the fused shared-expert kernel on CUDA (one launch for
# the shared expert's down projection, gate and routed sum); larger batches keep cuBLAS.
SHARED_COMBINE_MAX_TOKENS = 4


def fuses_shared_combine(routed) -> bool:
    """Whether shared_expert_combine runs the fused kernel for these rows (else the model composes it)."""
    return routed.is_cuda and routed.shape[0] <= SHARED_COMBINE_MAX_TOKENS


def shared_expert_combine(**kwargs):
    """See naive.shared_expert_combine."""
    if kwargs["routed"].is_cuda:
        from .triton_shared import shared_expert_combine as impl
    else:
        impl = naive.shared_expert_combine
    return impl(**kwargs)
