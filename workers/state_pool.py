"""The worker's pooled state: KV pages for every attention layer and GDN state slots for every GDN
layer, sized from a memory budget. Layers see views of it (`LayerState`); only the driver's
allocators decide which pages and slots a request owns.

Each kind is one tensor across its layers ([layers, pages, ...] for K and V, [layers, slots, ...]
for the recurrent state and the conv window), so that copying a page or a slot for every layer at
once (prefix-cache snapshots and hits) is one indexed copy. GDN slots come in three ranges:
[0, num_slots - 1) running requests, num_slots - 1 scratch for padded rows, then `num_snapshots`
prefix-cache snapshots."""

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


def kv_layers(model: HybridModel) -> list:
    """The layers that keep paged KV: the stack's attention layers, then the MTP head's layer (it
    shares the request's block table)."""
    out = [layer for layer in model.layers if layer.state_kind == "attention"]
    return out + ([model.mtp.layer] if model.mtp is not None else [])


def bytes_per_block(model: HybridModel, block_size: int, dtype: torch.dtype) -> int:
    total = 0
    for layer in kv_layers(model):
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
    num_snapshots: int | None = 0,
    snapshot_fraction: float = 0.1,
) -> PoolSizes:
    """Slots for max_num_seqs sequences (fewer if the budget cannot hold them with some pages),
    pages with the rest (or exactly num_blocks_override). One extra slot and page stay reserved as
    scratch for padded rows.

    Prefix-cache snapshot slots: `num_snapshots` exactly, or None for as many as `snapshot_fraction`
    of the budget holds (at most 4 per running sequence); the pages get what is left. Too small a
    budget gives fewer (or no) snapshots, never a refusal to start."""
    per_block = max(1, bytes_per_block(model, block_size, dtype))
    per_slot = bytes_per_slot(model, dtype)
    num_slots = max_num_seqs + 1
    if num_snapshots is None:
        num_snapshots = 0
        if per_slot and num_blocks_override is not None:
            num_snapshots = max_num_seqs  # pages given exactly: the budget is not what sizes the pools
        elif per_slot:
            num_snapshots = min(4 * max_num_seqs, int(budget_bytes * snapshot_fraction) // per_slot)
    if num_blocks_override is not None:
        return PoolSizes(num_blocks_override + 1, block_size, num_slots, num_snapshots)
    if per_slot and num_slots * per_slot > budget_bytes // 2:
        num_slots = max(2, (budget_bytes // 2) // per_slot)
        num_snapshots = min(num_snapshots, num_slots)
    num_blocks = (budget_bytes - (num_slots + num_snapshots) * per_slot) // per_block
    if num_blocks < 2:
        raise ValueError(
            f"the KV/state budget ({budget_bytes / 2**20:.1f} MiB) is too small: one page needs "
            f"{per_block} bytes and one GDN state slot {per_slot} bytes"
        )
    return PoolSizes(int(num_blocks), block_size, int(num_slots), int(num_snapshots))


class StatePool:
    """Zero-initialised pools; `layer_states[i]` is layer i's view, `mtp_state` the MTP head's KV (None
    without the head)."""

    def __init__(self, model: HybridModel, sizes: PoolSizes, *, dtype: torch.dtype, device: torch.device | str):
        self.sizes = sizes
        self.layer_states: list[LayerState] = []
        attn = kv_layers(model)
        ssm = [layer for layer in model.layers if layer.state_kind != "attention"]
        self.k_pages = self.v_pages = self.recurrent = self.conv = None
        if attn:
            shapes = attn[0].state_shapes(sizes.block_size)
            self.k_pages = torch.zeros((len(attn), sizes.num_blocks, *shapes["k_cache"][0]), dtype=dtype, device=device)
            self.v_pages = torch.zeros((len(attn), sizes.num_blocks, *shapes["v_cache"][0]), dtype=dtype, device=device)
        if ssm:
            shapes = ssm[0].state_shapes()
            (rec_shape, rec_dtype), (conv_shape, conv_dtype) = shapes["recurrent"], shapes["conv"]
            if dtype == torch.float64:  # a CPU reference run keeps every state at its own precision
                rec_dtype = conv_dtype = torch.float64
            slots = sizes.total_slots
            self.recurrent = torch.zeros((len(ssm), slots, *rec_shape), dtype=rec_dtype or dtype, device=device)
            self.conv = torch.zeros((len(ssm), slots, *conv_shape), dtype=conv_dtype or dtype, device=device)
        i_attn = i_ssm = 0
        for layer in model.layers:
            if layer.state_kind == "attention":
                self.layer_states.append(AttnLayerState(k_cache=self.k_pages[i_attn], v_cache=self.v_pages[i_attn]))
                i_attn += 1
            else:
                self.layer_states.append(SsmLayerState(recurrent=self.recurrent[i_ssm], conv=self.conv[i_ssm]))
                i_ssm += 1
        self.mtp_state = None
        if model.mtp is not None:
            self.mtp_state = AttnLayerState(k_cache=self.k_pages[i_attn], v_cache=self.v_pages[i_attn])
        log.info(
            "state pool: %d pages x %d tokens (%d tokens of KV), %d GDN state slots, %d prefix-cache snapshots "
            "(%.1f MiB)",
            sizes.num_blocks,
            sizes.block_size,
            sizes.num_tokens,
            sizes.num_slots,
            sizes.num_snapshots,
            sizes.num_snapshots * self.bytes_per_slot() / 2**20,
        )

    def bytes_per_slot(self) -> int:
        if self.recurrent is None:
            return 0
        return (self.recurrent[:, 0].numel() * self.recurrent.element_size()) + (
            self.conv[:, 0].numel() * self.conv.element_size()
        )

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """GDN state (recurrent and conv, every layer) of slots src[i] -> dst[i]: snapshot saves and
        restores. src, dst: [M] int64 on the pool's device; a dst must not also be a src."""
        if self.recurrent is not None and src.numel():
            self.recurrent.index_copy_(1, dst, self.recurrent.index_select(1, src))
            self.conv.index_copy_(1, dst, self.conv.index_select(1, src))

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """KV pages (every attention layer) src[i] -> dst[i]: the partly filled page of a snapshot's
        prefix, copied for a request that resumes from it."""
        if self.k_pages is not None and src.numel():
            self.k_pages.index_copy_(1, dst, self.k_pages.index_select(1, src))
            self.v_pages.index_copy_(1, dst, self.v_pages.index_select(1, src))

    def enable_verify(self, model: HybridModel, rows: int, length: int) -> None:
        """Give every GDN layer its speculative-decoding verify buffers (write-on-accept)."""
        for layer, state in zip(model.layers, self.layer_states, strict=True):
            if isinstance(state, SsmLayerState):
                dtype, device = state.conv.dtype, state.conv.device
                for name, value in layer.mixer.verify_buffers(rows, length, device, dtype).items():
                    setattr(state, name, value)
