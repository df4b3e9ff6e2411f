"""Varlen chunk bookkeeping done inside the kernels, so that wrappers never read cu_seqlens on the host;
and the (sequence, value head, V-block) layout of the state-walking grids.

A pass of N sequences (cu_seqlens [N + 1]) is cut into chunks of BT tokens per sequence; chunk
`idx` counts over all sequences in order. Grids over chunks launch `T // BT + N` programs, an upper
bound on the number of chunks; programs past the last chunk find `n == N` and exit.
"""

import triton
import triton.language as tl


@triton.jit
def locate_chunk(cu_seqlens, num_seqs, idx, BT: tl.constexpr, BLOCK_N: tl.constexpr):
    """(sequence n, chunk index inside it) of global chunk `idx`; n == num_seqs when idx is past the end."""
    n = 0
    before = 0  # chunks of the sequences that end before idx
    total = 0  # chunks of all sequences scanned so far
    for start in range(0, num_seqs, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        mask = offs < num_seqs
        lo = tl.load(cu_seqlens + offs, mask=mask, other=0).to(tl.int32)
        hi = tl.load(cu_seqlens + offs + 1, mask=mask, other=0).to(tl.int32)
        count = (hi - lo + BT - 1) // BT
        ends = tl.cumsum(count, 0) + total
        done = mask & (ends <= idx)
        n += tl.sum(done.to(tl.int32), 0)
        before += tl.sum(tl.where(done, count, 0), 0)
        total += tl.sum(count, 0)
    return n, idx - before


@triton.jit
def chunks_before(cu_seqlens, n, BT: tl.constexpr, BLOCK_N: tl.constexpr):
    """Number of BT-token chunks in sequences 0 .. n - 1 (the first global chunk index of sequence n)."""
    before = 0
    for start in range(0, n, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        mask = offs < n
        lo = tl.load(cu_seqlens + offs, mask=mask, other=0).to(tl.int32)
        hi = tl.load(cu_seqlens + offs + 1, mask=mask, other=0).to(tl.int32)
        before += tl.sum((hi - lo + BT - 1) // BT, 0)
    return before


@triton.jit
def value_block(pid, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """Program pid of a grid over (sequence, value head, BV columns of V), V-blocks fastest:
    (n, hv, o_k, o_v, m_k, m_v), its sequence and value head and the rows and columns of its
    [BK, BV] state tile with their masks."""
    NV = tl.cdiv(V, BV)
    i_v = pid % NV
    hv = pid // NV % HV
    n = pid // NV // HV
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    return n, hv, o_k, o_v, o_k < K, o_v < V
