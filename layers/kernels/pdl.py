"""Programmatic dependent launch (sm_90+): a kernel launched with it may start while the kernel
before it in the stream is still finishing, and waits in `pdl_wait` (griddepcontrol.wait) until
that kernel has completed and its writes are visible. What it saves is the launch and ramp-up of
each small decode kernel, which at batch 1 is most of their time. CUDA graphs keep the
programmatic edges.

Every kernel launched with `pdl_launch` calls `pdl_wait(USE_PDL)` before any store and before any
load of what the previous kernel writes: so it never reads a buffer the previous kernel is
writing, and never writes one it is still reading (graph buffers are reused). It then lets the
next kernel launch early, whose own wait still covers this kernel's completion: the chain stays
ordered even through kernels that exit early. Loads of anything else may come before the wait
(weights, recurrent state, cached KV): a kernel starts only once every program of the one before
it has passed its own wait, i.e. once every earlier kernel has completed, so only the immediately
preceding kernel can still be running.

DELTASERVE_PDL=0 turns it off (the benchmark compares both). With it on, torch.profiler's kernel
times include the wait: attribute time per kernel with it off.
Measured (H200, batch 1 decode): 2.94 -> 2.66 ms per step. An L2 prefetch of each GEMV's weights
before the wait was slower (2.73 against 2.60 ms in one run) and was taken out, and so was an L2
prefetch of the *next* kernels' weights from the latency-bound kernels (GDN decode, attention,
the MoE GEMVs: batch 1 2.32 -> 2.50-2.65 ms; docs/PERF.md, session 14): the readers are
latency-bound, so L2 hits shorten them little, and the issuers pay for the traffic.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Wait for the previous kernel's completion, then release the next kernel's launch."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@functools.cache
def _capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_enabled(t: torch.Tensor) -> bool:
    """Whether kernels on t's device launch with programmatic dependent launch (sm_90+, unless
    DELTASERVE_PDL=0; read at each launch, so a process can compare both)."""
    if not t.is_cuda or os.environ.get("DELTASERVE_PDL", "1") == "0":
        return False
    return _capable(t.device.index if t.device.index is not None else torch.cuda.current_device())


def pdl_launch(t: torch.Tensor) -> dict:
    """Launch keywords for a kernel that takes USE_PDL and calls pdl_wait first: both on for CUDA
    tensors on sm_90+, neither key for the interpreter."""
    if pdl_enabled(t):
        return dict(USE_PDL=True, launch_pdl=True)
    return dict(USE_PDL=False)
