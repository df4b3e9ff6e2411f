"""Causal depthwise conv1d with a carried window: varlen prefill and single-token update."""

from . import naive


def causal_conv1d_varlen(**kwargs):
    """See naive.causal_conv1d_varlen."""
    if kwargs["x"].is_cuda:
        from .triton_conv1d import causal_conv1d_varlen as impl
    else:
        impl = naive.causal_conv1d_varlen
    return impl(**kwargs)


def causal_conv1d_update(**kwargs):
    """See naive.causal_conv1d_update."""
    if kwargs["x"].is_cuda:
        from .triton_conv1d import causal_conv1d_update as impl
    else:
        impl = naive.causal_conv1d_update
    return impl(**kwargs)
