"""q/k head norm fused with partial rotary embeddings (gated attention's pre-attention step)."""

from . import naive
from .naive import KvCacheWrite  # noqa: F401  (qk_norm_rope's kv_cache argument)


def qk_norm_rope(**kwargs):
    """See naive.qk_norm_rope."""
    if kwargs["q"].is_cuda:
        from .triton_rotary import qk_norm_rope as impl
    else:
        impl = naive.qk_norm_rope
    return impl(**kwargs)
