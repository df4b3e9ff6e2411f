"""What the kernels' tile pickers ask of the device, read from the device itself; and the zeroed
"last program to finish" ticket counters (one buffer per kernel family)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

import torch

T = TypeVar("T")


@dataclass(frozen=True)
class DeviceInfo:
    """name: as torch reports it (the key of the measured tile tables); num_sms: multiprocessors;
    smem_per_block: the shared memory one program may use (the opt-in maximum), in bytes;
    capability: (major, minor), (0, 0) for the interpreter."""

    name: str
    num_sms: int
    smem_per_block: int
    capability: tuple[int, int]

    @property
    def is_interpreter(self) -> bool:
        return self.name == INTERPRETER.name


# CPU tensors run under Triton's interpreter: small grids (4 "SMs"), and a Hopper-sized shared
# memory budget so that stage counts (which the interpreter ignores) come out as on the GPU.
INTERPRETER = DeviceInfo(name="interpreter", num_sms=4, smem_per_block=227 * 1024, capability=(0, 0))

# the name the H200's measured tile tables are keyed by (as torch.cuda.get_device_properties says)
H200 = "NVIDIA H200"


def device_info(device: torch.device) -> DeviceInfo:
    """The device's facts (cached per CUDA device); INTERPRETER for anything but CUDA."""
    if device.type != "cuda":
        return INTERPRETER
    return _cuda_info(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_info(index: int) -> DeviceInfo:
    props = torch.cuda.get_device_properties(index)
    # the opt-in maximum where torch reports it, else the default per-block limit (always allowed)
    smem = getattr(props, "shared_memory_per_block_optin", 0) or props.shared_memory_per_block
    return DeviceInfo(props.name, props.multi_processor_count, int(smem), (props.major, props.minor))


def num_sms(device: torch.device) -> int:
    """Multiprocessor count of the device (INTERPRETER's for CPU tensors)."""
    return device_info(device).num_sms


def tuned_for(table: Mapping[str, T], info: DeviceInfo) -> T | None:
    """The entry of a table keyed by device name for this device: its exact name, else the longest
    key its name contains ("NVIDIA H200" also covers "NVIDIA H200 NVL"); None: use the heuristic."""
    if info.name in table:
        return table[info.name]
    keys = [key for key in table if key in info.name]
    return table[max(keys, key=len)] if keys else None


# shared memory a kernel may use beyond its tiles' buffers (layout conversions), in the estimates
SMEM_SCRATCH = 8192


def stages_that_fit(wanted: int, per_stage: int, fixed: int, info: DeviceInfo) -> int:
    """The deepest software pipeline, up to `wanted`, whose buffers (per_stage bytes each, plus
    `fixed` for what is not pipelined) fit in one program's shared memory; at least 1."""
    return max(1, min(wanted, (info.smem_per_block - fixed) // max(1, per_stage)))


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


def side_stream(device: torch.device, owner: str) -> torch.cuda.Stream:
    """A CUDA stream at the highest priority for one kernel family's work beside the caller's stream,
    one per owner and device: when such work is ready, its programs take the SMs that free up before
    the caller's waiting programs do. A CUDA graph captures it as a fork of the capturing stream."""
    key = (owner, device.index)
    if key not in _STREAMS:
        _STREAMS[key] = torch.cuda.Stream(device, priority=-1)  # lower is sooner; 0 the default
    return _STREAMS[key]


_STREAMS: dict[tuple, torch.cuda.Stream] = {}
MIN_TICKETS = 1 << 16  # 256 KB: 4096 sequences at 16 key heads
