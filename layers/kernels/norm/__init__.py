"""RMSNorm variants (zero-centred, gated)."""

from . import naive


def rms_norm(**kwargs):
    """See naive.rms_norm."""
    if kwargs["x"].is_cuda:
        from .triton_norm import rms_norm as impl
    else:
        impl = naive.rms_norm
    return impl(**kwargs)


def gated_rms_norm(**kwargs):
    """See naive.gated_rms_norm."""
    if kwargs["x"].is_cuda:
        from .triton_norm import gated_rms_norm as impl
    else:
        impl = naive.gated_rms_norm
    return impl(**kwargs)


def fused_add_rms_norm(**kwargs):
    """See naive.fused_add_rms_norm."""
    if kwargs["x"].is_cuda:
        from .triton_norm import fused_add_rms_norm as impl
    else:
        impl = naive.fused_add_rms_norm
    return impl(**kwargs)


def embed_rms_norm(**kwargs):
    """See naive.embed_rms_norm."""
    if kwargs["table"].is_cuda:
        from .triton_norm import embed_rms_norm as impl
    else:
        impl = naive.embed_rms_norm
    return impl(**kwargs)
