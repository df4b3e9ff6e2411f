"""What the kernels' tile pickers ask of the device."""

from __future__ import annotations

import functools

import torch


def num_sms(device: torch.device, cpu: int = 4) -> int:
    """Multiprocessor count of a CUDA device (cached per device); `cpu` for interpreter runs, where
    a caller may want the tiles the GPU would pick (the H200's 132) or small grids."""
    if device.type != "cuda":
        return cpu
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def ticket_counters(device: torch.device, count: int, owner: str) -> torch.Tensor:
    """At least `count` zeroed int32 counters on the device for one kernel family's "last program
    to finish" tickets (each launch leaves them at zero). One buffer per owner: kernels that may
    run at the same time (neighbours under programmatic dependent launch) must not share one.
    Grown, never freed: a captured CUDA graph keeps the address it was captured with. Allocate
    outside capture: a zero fill inside one would only run at replay."""
    key = (owner, device.type, device.index)
    have = _TICKETS.get(key)
    if have is None or have[-1].numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{owner}: run a launch of {count} tickets eagerly before capturing it")
        _TICKETS.setdefault(key, []).append(torch.zeros(max(count, MIN_TICKETS), dtype=torch.int32, device=device))
    return _TICKETS[key][-1]


def ticket_buffers(owner: str, device: torch.device) -> list[torch.Tensor]:
    """Every counter buffer handed out to `owner` on the device (tests check they are back at zero)."""
    return _TICKETS.get((owner, device.type, device.index), [])


# owner -> the buffers handed out (the older ones stay alive for graphs captured with them)
_TICKETS: dict[tuple, list[torch.Tensor]] = {}
MIN_TICKETS = 1 << 16  # 256 KB: 4096 sequences at 16 key heads
