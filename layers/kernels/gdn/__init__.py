"""Gated delta rule: chunked (prefill) and fused recurrent (decode, k-token verify), and the gating
that feeds them (g, beta from the raw projections; the recurrent kernel can also take raw gates).

The wrappers pick the Triton kernel for CUDA tensors and the plain-torch reference otherwise.
"""

from . import naive


def chunk_gated_delta_rule(**kwargs):
    """See naive.chunk_gated_delta_rule for arguments and shapes."""
    if kwargs["q"].is_cuda:
        from .chunk import chunk_gated_delta_rule as impl
    else:
        impl = naive.chunk_gated_delta_rule
    return impl(**kwargs)


def fused_recurrent_gated_delta_rule(**kwargs):
    """See naive.fused_recurrent_gated_delta_rule for arguments and shapes."""
    if kwargs["q"].is_cuda:
        from .recurrent import fused_recurrent_gated_delta_rule as impl
    else:
        impl = naive.fused_recurrent_gated_delta_rule
    return impl(**kwargs)


def gdn_gating(**kwargs):
    """See naive.gdn_gating: (g, beta) float32 from the raw a, b projections, in one launch on CUDA."""
    if kwargs["a"].is_cuda:
        from .gating import gdn_gating as impl
    else:
        impl = naive.gdn_gating
    return impl(**kwargs)
