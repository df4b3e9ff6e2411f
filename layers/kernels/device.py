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
