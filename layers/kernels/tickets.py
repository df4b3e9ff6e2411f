""" "Last program to arrive" tickets: which of a launch's programs finishes a job that needs every
program's stores (a row norm, a merge).

Ordering (as CUTLASS's serial split-K semaphore): the caller's CTA barrier orders its threads'
stores before the arrival's release (an acq_rel atomic add, gpu scope); the last program's acquire
orders its loads after every release. The counter is back at zero when the launch ends (the last
program resets it; the next launch on the device runs after this one).

One counter per job, not a tree of them: the arrivals of one launch are spread out enough that
one address keeps up (a two-level form measured slower for the MoE down GEMV: moe/NOTES.md).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def last_to_arrive(ticket, total):
    """True in exactly one of the `total` programs that call it with the same counter, the last to
    arrive, which also resets the counter. Call after a CTA barrier that follows the stores the
    last program must see."""
    last = tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu") == total - 1
    if last:
        tl.store(ticket, 0)
    return last
