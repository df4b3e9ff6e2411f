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

Every op that launches such kernels takes `pdl: bool`; the layers pass KernelOptions.pdl
(DELTASERVE_PDL=0 turns it off; the benchmark compares both). With it on, torch.profiler's kernel
times include the wait: attribute time per kernel with it off. What it saved, and the L2 prefetches
tried beside it: docs/PERF.md ("Programmatic dependent launch").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import device_info


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Wait for the previous kernel's completion, then release the next kernel's launch."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def pdl_enabled(t: torch.Tensor, pdl: bool) -> bool:
    """Whether a kernel on t's device launches with programmatic dependent launch: asked for, and
    a CUDA device of sm_90 or later."""
    return pdl and t.is_cuda and device_info(t.device).capability >= (9, 0)


def pdl_launch(t: torch.Tensor, pdl: bool) -> dict:
    """Launch keywords for a kernel that takes USE_PDL and calls pdl_wait first: both on when
    pdl_enabled, neither key for the interpreter."""
    if pdl_enabled(t, pdl):
        return dict(USE_PDL=True, launch_pdl=True)
    return dict(USE_PDL=False)
