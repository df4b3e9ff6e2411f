"""tickets.last_to_arrive: exactly one program of a launch is told it is the last, it sees every
other program's stores, and the counter is back at zero for the next launch."""

import pytest
import torch
import triton
import triton.language as tl

from deltaserve.layers.kernels.tickets import last_to_arrive


@triton.jit
def _count_kernel(marks, seen, ticket):
    pid = tl.program_id(0)
    total = tl.num_programs(0)
    tl.store(marks + pid, pid + 1)
    tl.debug_barrier()
    if last_to_arrive(ticket, total):
        # the last program sums every program's mark: all must be visible to it
        offs = tl.arange(0, 1024)
        got = tl.load(marks + offs, mask=offs < total, other=0, cache_modifier=".cg")
        tl.store(seen + pid, tl.sum(got, 0))


@pytest.mark.parametrize("programs", [1, 7, 300, 1024])
def test_exactly_one_program_is_last_and_sees_every_store(device, programs):
    ticket = torch.zeros(1, dtype=torch.int32, device=device)
    for _ in range(3):  # later launches find the counter back at zero
        marks = torch.zeros(programs, dtype=torch.int32, device=device)
        seen = torch.full((programs,), -1, dtype=torch.int32, device=device)
        _count_kernel[(programs,)](marks, seen, ticket)
        told = (seen >= 0).nonzero().flatten().tolist()
        assert len(told) == 1, f"{len(told)} programs were told they were last"
        assert seen[told[0]].item() == programs * (programs + 1) // 2
        assert ticket.item() == 0, "the counter was left set"
