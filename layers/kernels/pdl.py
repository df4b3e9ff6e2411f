"""Programmatic dependent launch (sm_90+): a kernel launched with it may start while the kernel
before it in the stream is still finishing, and waits in `pdl_wait` (griddepcontrol.wait) until
that kernel has completed and its writes are visible. What it saves is the launch and ramp-up of
each small decode kernel, which at batch 1 is most of their time. CUDA graphs keep the
programmatic edges.

Every kernel launched with `pdl_launch` calls `pdl_wait(USE_PDL)` first, before any load or store
(at most an L2 prefetch of weights, `prefetch_l2`, comes before it):
so it never reads a buffer the previous kernel is writing, and never writes one it is still
reading (graph buffers are reused). It then lets the next kernel launch early, whose own wait still
covers this kernel's completion: the chain stays ordered even through kernels that exit early.

DELTASERVE_PDL=0 turns it off, DELTASERVE_PDL=noprefetch keeps it without the weight prefetch
(the benchmark compares them).
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


@triton.jit
def prefetch_l2(ptrs):
    """Bring the 128-byte lines at ptrs (one address per line) into L2, holding no registers: a
    kernel calls it before pdl_wait on what no kernel writes (weights), so the stream of its first
    wave starts under the previous kernel's tail. GPU only (inline PTX)."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; // dummy $0", "=r,l", [ptrs.to(tl.int64)], dtype=tl.int32, is_pure=False, pack=1
    )


@functools.cache
def _supported(device_index: int) -> bool:
    if os.environ.get("DELTASERVE_PDL", "1") == "0":
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_enabled(t: torch.Tensor) -> bool:
    """Whether kernels on t's device launch with programmatic dependent launch."""
    return t.is_cuda and _supported(t.device.index if t.device.index is not None else torch.cuda.current_device())


def pdl_prefetch(t: torch.Tensor) -> bool:
    """Whether PDL kernels prefetch their weights before waiting (the PREFETCH constexpr)."""
    return pdl_enabled(t) and os.environ.get("DELTASERVE_PDL", "1") != "noprefetch"


def pdl_launch(t: torch.Tensor) -> dict:
    """Launch keywords for a kernel that takes USE_PDL and calls pdl_wait first: both on for CUDA
    tensors on sm_90+, neither key for the interpreter."""
    if pdl_enabled(t):
        return dict(USE_PDL=True, launch_pdl=True)
    return dict(USE_PDL=False)
