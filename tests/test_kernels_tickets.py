"""tickets.last_to_arrive: exactly one program of a launch is told it is the last, it sees every
other program's stores, and every counter is back at zero for the next launch, for one counter
and for group counters whose last group is partial."""

import pytest
import torch
import triton
import triton.language as tl

from deltaserve.layers.kernels.tickets import counters_needed, last_to_arrive


@triton.jit
def _count_kernel(marks, seen, tickets, FAN_IN: tl.constexpr):
    pid = tl.program_id(0)
    total = tl.num_programs(0)
    tl.store(marks + pid, pid + 1)
    tl.debug_barrier()
    if last_to_arrive(tickets, pid, total, FAN_IN):
        # the last program sums every program's mark: all must be visible to it
        offs = tl.arange(0, 1024)
        got = tl.load(marks + offs, mask=offs < total, other=0, cache_modifier=".cg")
        tl.store(seen + pid, tl.sum(got, 0))


@pytest.mark.parametrize("programs,fan_in", [(1, 0), (7, 0), (1, 4), (7, 2), (8, 4), (9, 4), (300, 32), (5, 32)])
def test_exactly_one_program_is_last_and_sees_every_store(device, programs, fan_in):
    tickets = torch.zeros(counters_needed(programs, fan_in), dtype=torch.int32, device=device)
    for _ in range(3):  # later launches find the counters back at zero
        marks = torch.zeros(programs, dtype=torch.int32, device=device)
        seen = torch.full((programs,), -1, dtype=torch.int32, device=device)
        _count_kernel[(programs,)](marks, seen, tickets, FAN_IN=fan_in)
        told = (seen >= 0).nonzero().flatten().tolist()
        assert len(told) == 1, f"{len(told)} programs were told they were last"
        assert seen[told[0]].item() == programs * (programs + 1) // 2
        assert not tickets.any(), "a counter was left set"


def test_counters_needed():
    assert counters_needed(1024, 0) == 1
    assert counters_needed(1024, 32) == 33
    assert counters_needed(1025, 32) == 34
