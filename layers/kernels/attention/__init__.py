"""Paged attention: KV write, prefill over cached pages, decode."""

import os

from . import naive
from .naive import DecodeRope  # noqa: F401  (paged_decode_attention's rope argument)


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


def rope_in_decode() -> bool:
    """Whether a decode-only pass folds the q/k norm + rotary embedding and the KV write into the
    decode kernel (DecodeRope) instead of the rope kernel's launch: on unless
    DELTASERVE_ROPE_IN_DECODE=0 (read at each call, so that a process can compare both)."""
    return os.environ.get("DELTASERVE_ROPE_IN_DECODE", "1") != "0"
