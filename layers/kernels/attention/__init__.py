"""Paged attention: KV write, prefill over cached pages, decode."""

from . import naive


def write_kv_cache(**kwargs):
    """See naive.write_kv_cache."""
    if kwargs["key"].is_cuda:
        from .triton_attention import write_kv_cache as impl
    else:
        impl = naive.write_kv_cache
    return impl(**kwargs)


def paged_attention(**kwargs):
    """See naive.paged_attention."""
    if kwargs["q"].is_cuda:
        from .triton_attention import paged_attention as impl
    else:
        impl = naive.paged_attention
    return impl(**kwargs)


def paged_decode_attention(**kwargs):
    """See naive.paged_decode_attention."""
    if kwargs["q"].is_cuda:
        from .triton_attention import paged_decode_attention as impl
    else:
        impl = naive.paged_decode_attention
    return impl(**kwargs)
