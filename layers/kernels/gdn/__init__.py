"""Gated delta rule: chunked (prefill) and fused recurrent (decode, k-token verify), and the gating
that feeds them (g, beta from the raw projections; the recurrent kernel can also take raw gates);
and the whole one-token decode step (conv1d update, recurrent, gated norm) as one op.

The wrappers pick the Triton kernel for CUDA tensors and the plain-torch reference otherwise.
"""

import os

from . import naive

# Decode batches up to this many sequences (one token each) take fused_gdn_decode; larger ones the
# three separate kernels. On the H200, in CUDA graphs, per layer: fused 4.7 / 13.5 / 18.5 / 24.1 /
# 98 us against 6.7 / 15.6 / 19.7 / 24.0 / 84 us at N = 1 / 8 / 12 / 16 / 64 (the fused programs
# each redo their key head's q / k conv, which costs more than the launches it saves at large N).
FUSED_DECODE_MAX_SEQS = 12


def fused_decode_max_seqs() -> int:
    """FUSED_DECODE_MAX_SEQS, or DELTASERVE_FUSED_GDN_MAX_SEQS when set (read per call, so that the
    benchmark's variants can move the cut; captured graphs keep the choice of their capture)."""
    return int(os.environ.get("DELTASERVE_FUSED_GDN_MAX_SEQS", FUSED_DECODE_MAX_SEQS))


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


def fused_gdn_decode(**kwargs):
    """See naive.fused_gdn_decode: conv1d update -> recurrent (raw gates) -> gated norm for one token
    per sequence, in one launch on CUDA."""
    if kwargs["mixed_qkv"].is_cuda:
        from .decode import fused_gdn_decode as impl
    else:
        impl = naive.fused_gdn_decode
    return impl(**kwargs)
