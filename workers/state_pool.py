"""The worker's pooled state: KV pages for every attention layer and GDN state slots for every GDN
layer, sized from a memory budget. Layers see views of it (`LayerState`); only the driver's
allocators decide which pages and slots a request owns."""

from __future__ import annotations

import logging

import torch

from deltaserve.layers.base import AttnLayerState, LayerState, SsmLayerState
from deltaserve.layers.model import HybridModel
from deltaserve.workers.plan import PoolSizes

log = logging.getLogger(__name__)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty((), dtype=dtype).element_size()


def bytes_per_block(model: HybridModel, block_size: int, dtype: torch.dtype) -> int:
    total = 0
    for layer in model.layers:
        if layer.state_kind == "attention":
            total += sum(_nbytes(shape, dt or dtype) for shape, dt in layer.state_shapes(block_size).values())
    return total


def bytes_per_slot(model: HybridModel, dtype: torch.dtype) -> int:
    total = 0
    for layer in model.layers:
        if layer.state_kind == "ssm":
            total += sum(_nbytes(shape, dt or dtype) for shape, dt in layer.state_shapes().values())
    return total


def size_pools(
    model: HybridModel,
    *,
    budget_bytes: int,
    block_size: int,
    max_num_seqs: int,
    dtype: torch.dtype,
    num_blocks_override: int | None = None,
) -> PoolSizes:
    """Slots for max_num_seqs sequences (fewer if the budget cannot hold them with some pages),
    pages with the rest (or exactly num_blocks_override). One extra slot and page stay reserved as
    scratch for padded rows."""
    per_block = max(1, bytes_per_block(model, block_size, dtype))
    per_slot = bytes_per_slot(model, dtype)
    num_slots = max_num_seqs + 1
    if num_blocks_override is not None:
        return PoolSizes(num_blocks=num_blocks_override + 1, block_size=block_size, num_slots=num_slots)
    if per_slot and num_slots * per_slot > budget_bytes // 2:
        num_slots = max(2, (budget_bytes // 2) // per_slot)
    num_blocks = (budget_bytes - num_slots * per_slot) // per_block
    if num_blocks < 2:
        raise ValueError(
            f"the KV/state budget ({budget_bytes / 2**20:.1f} MiB) is too small: one page needs "
            f"{per_block} bytes and one GDN state slot {per_slot} bytes"
        )
    return PoolSizes(num_blocks=int(num_blocks), block_size=block_size, num_slots=int(num_slots))


class StatePool:
    """Zero-initialised pools; `layer_states[i]` is layer i's view."""

    def __init__(self, model: HybridModel, sizes: PoolSizes, *, dtype: torch.dtype, device: torch.device | str):
        self.sizes = sizes
        self.layer_states: list[LayerState] = []
        for layer in model.layers:
            if layer.state_kind == "attention":
                shapes = layer.state_shapes(sizes.block_size)
                k_shape, _ = shapes["k_cache"]
                v_shape, _ = shapes["v_cache"]
                self.layer_states.append(
                    AttnLayerState(
                        k_cache=torch.zeros((sizes.num_blocks, *k_shape), dtype=dtype, device=device),
                        v_cache=torch.zeros((sizes.num_blocks, *v_shape), dtype=dtype, device=device),
                    )
                )
            else:
                shapes = layer.state_shapes()
                rec_shape, rec_dtype = shapes["recurrent"]
                conv_shape, conv_dtype = shapes["conv"]
                self.layer_states.append(
                    SsmLayerState(
                        recurrent=torch.zeros((sizes.num_slots, *rec_shape), dtype=rec_dtype or dtype, device=device),
                        conv=torch.zeros((sizes.num_slots, *conv_shape), dtype=conv_dtype or dtype, device=device),
                    )
                )
        log.info(
            "state pool: %d pages x %d tokens (%d tokens of KV), %d GDN state slots",
            sizes.num_blocks,
            sizes.block_size,
            sizes.num_tokens,
            sizes.num_slots,
        )
