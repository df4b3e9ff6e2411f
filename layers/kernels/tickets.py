""" "Last program to arrive" tickets with a fan-in: which of a launch's programs finishes a job that
needs every program's stores (a row norm, a merge).

With one counter, every program's returning atomic lands on the same L2 address, and those
serialise: on the H200 a barrier over 1,056 programs cost 2.98 us against 1.29 over 264
(`bench.kernels_sync`). With a fan-in F, program p arrives on its group's counter (p // F); only
the last of each group goes on to the shared counter, so no address takes more than max(F, groups)
arrivals and the last program pays two round trips instead of one.

Ordering (as CUTLASS's serial split-K semaphore): the caller's CTA barrier orders its threads'
stores before the arrival's release; the last of a group acquires its group's releases and
releases them on (cumulativity) with its own on the shared counter; the last overall acquires that.
Every counter it drew is back at zero when the launch ends: each is reset by the program that saw
it complete, and the next launch on the device runs after this one.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl


@triton.jit
def last_to_arrive(tickets, pid, total, FAN_IN: tl.constexpr):
    """True in exactly one of the `total` programs (pid in [0, total)) that call it, the last to
    arrive. tickets: the launch's counters, 1 + cdiv(total, FAN_IN) of them when FAN_IN > 0, one
    when FAN_IN == 0 (a single counter). Call after a CTA barrier that follows the stores the
    last program must see."""
    if FAN_IN == 0:
        last = tl.atomic_add(tickets, 1, sem="acq_rel", scope="gpu") == total - 1
        if last:
            tl.store(tickets, 0)
    else:
        group = pid // FAN_IN
        groups = (total + FAN_IN - 1) // FAN_IN
        members = tl.minimum(total - group * FAN_IN, FAN_IN)
        p_group = tickets + 1 + group
        last = tl.atomic_add(p_group, 1, sem="acq_rel", scope="gpu") == members - 1
        if last:
            tl.store(p_group, 0)
            last = tl.atomic_add(tickets, 1, sem="acq_rel", scope="gpu") == groups - 1
            if last:
                tl.store(tickets, 0)
    return last


def counters_needed(total: int, fan_in: int) -> int:
    """Counters one last_to_arrive over `total` programs draws."""
    return 1 if fan_in == 0 else 1 + triton.cdiv(total, fan_in)


# measured on the H200 (docs/PERF.md, session 15): see fan_in()
DEFAULT_FAN_IN = 32


def fan_in() -> int:
    """The fan-in launches use: DELTASERVE_TICKET_FAN_IN (0 = one counter), read at each launch
    so that a process can compare both, else DEFAULT_FAN_IN."""
    return int(os.environ.get("DELTASERVE_TICKET_FAN_IN", DEFAULT_FAN_IN))
