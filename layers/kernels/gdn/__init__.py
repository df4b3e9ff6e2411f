"""Gated delta rule: chunked (prefill) and fused recurrent (decode, k-token verify).

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
