"""The worker's pooled state: KV pages for every attention layer and GDN state slots for every GDN
layer, sized from a memory budget. Layers see views of it (`LayerState`); only the driver's
allocators decide which pages and slots a request owns.

Each kind is one tensor across its layers ([layers, pages, ...] for K and V, [layers, slots, ...]
for the recurrent state and the conv window), so that copying a page or a slot for every layer at
once (prefix-cache snapshots and hits) is one indexed copy. GDN slots come in three ranges:
[0, num_slots - 1) running requests, num_slots - 1 scratch for padded rows, then `num_snapshots`
prefix-cache snapshots.

A layer may keep more per page or per slot than K/V or the GDN state (Qwen4-Exp: the QSA indexer's
key caches per page, PLE's state per slot): any other name in its `state_shapes` gets a pool of its
own, across the layers that have it, copied with the pages or slots; the layer's `make_state(base,
extra)` builds its LayerState from the default view and its views of those pools."""

from __future__ import annotations

import logging

import torch

from deltaserve.layers.base import AttnLayerState, LayerState, SsmLayerState
from deltaserve.layers.kernels.gdn import state as gdn_state
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
    kv_dtype: torch.dtype | None = None,
) -> PoolSizes:
    """Slots for max_num_seqs sequences (fewer if the budget cannot hold them with some pages),
    pages with the rest (or exactly num_blocks_override). One extra slot and page stay reserved as
    scratch for padded rows.

    Prefix-cache snapshot slots: `num_snapshots` exactly, or None for as many as `snapshot_fraction`
    of the budget holds (at most 4 per running sequence); the pages get what is left. Too small a
    budget gives fewer (or no) snapshots, never a refusal to start."""
    per_block = max(1, bytes_per_block(model, block_size, kv_dtype or dtype))
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


_PAGE_STATE, _SLOT_STATE = ("k_cache", "v_cache"), ("recurrent", "conv")


def _bytes_view(pool: torch.Tensor) -> torch.Tensor:
    """A one-byte pool (float8 KV pages) as uint8, whose index_copy_ every device has; else itself."""
    return pool.view(torch.uint8) if pool.element_size() == 1 and pool.is_floating_point() else pool


class StatePool:
    """Zero-initialised pools; `layer_states[i]` is layer i's view, `mtp_state` the MTP head's KV (None
    without the head)."""

    def __init__(
        self,
        model: HybridModel,
        sizes: PoolSizes,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        kv_dtype: torch.dtype | None = None,
    ):
        """kv_dtype: the KV pages' dtype (default: `dtype`; float8_e4m3fn for an FP8 KV cache)."""
        self.sizes = sizes
        self.layer_states: list[LayerState] = []
        attn = kv_layers(model)
        ssm = [layer for layer in model.layers if layer.state_kind != "attention"]
        self.k_pages = self.v_pages = self.recurrent = self.conv = None
        # the layers' other per-page / per-slot state: name -> [layers that have it, pages or slots, ...]
        self.extra_pages = self._extra_pools(attn, _PAGE_STATE, sizes.num_blocks, sizes.block_size, dtype, device)
        self.extra_slots = self._extra_pools(ssm, _SLOT_STATE, sizes.total_slots, None, dtype, device)
        if attn:
            shapes = attn[0].state_shapes(sizes.block_size)
            kv = kv_dtype or dtype
            self.k_pages = torch.zeros((len(attn), sizes.num_blocks, *shapes["k_cache"][0]), dtype=kv, device=device)
            self.v_pages = torch.zeros((len(attn), sizes.num_blocks, *shapes["v_cache"][0]), dtype=kv, device=device)
        if ssm:
            shapes = ssm[0].state_shapes()
            (rec_shape, rec_dtype), (conv_shape, conv_dtype) = shapes["recurrent"], shapes["conv"]
            if dtype == torch.float64:  # a CPU reference run keeps every state at its own precision
                rec_dtype = conv_dtype = torch.float64
            slots = sizes.total_slots
            self.recurrent = torch.zeros((len(ssm), slots, *rec_shape), dtype=rec_dtype or dtype, device=device)
            self.conv = torch.zeros((len(ssm), slots, *conv_shape), dtype=conv_dtype or dtype, device=device)
        i_attn = i_ssm = 0
        seen: dict[str, int] = {}
        for layer in model.layers:
            if layer.state_kind == "attention":
                state = AttnLayerState(k_cache=self.k_pages[i_attn], v_cache=self.v_pages[i_attn])
                names, pools = layer.state_shapes(sizes.block_size), self.extra_pages
                i_attn += 1
            else:
                state = SsmLayerState(recurrent=self.recurrent[i_ssm], conv=self.conv[i_ssm])
                names, pools = layer.state_shapes(), self.extra_slots
                i_ssm += 1
            extra = {}
            for name in names:
                if name in pools:
                    extra[name] = pools[name][seen.get(name, 0)]
                    seen[name] = seen.get(name, 0) + 1
            if hasattr(layer, "make_state"):
                state = layer.make_state(state, extra)
            self.layer_states.append(state)
        self.mtp_state = None
        self.verify_stack: gdn_state.VerifyStack | None = None  # speculative decoding's (enable_verify)
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

    @staticmethod
    def _extra_pools(layers, standard, count, block_size, dtype, device) -> dict[str, torch.Tensor]:
        shapes: dict[str, list] = {}
        for layer in layers:
            entries = layer.state_shapes(block_size) if block_size is not None else layer.state_shapes()
            for name, (shape, dt) in entries.items():
                if name not in standard:
                    shapes.setdefault(name, []).append((shape, dt))
        pools = {}
        for name, entries in shapes.items():
            shape, dt = entries[0]
            if dt is None or (dtype == torch.float64 and dt.is_floating_point):
                dt = dtype  # a float64 reference run keeps every float state at its own precision
            pools[name] = torch.zeros((len(entries), count, *shape), dtype=dt, device=device)
        return pools

    def bytes_per_slot(self) -> int:
        if self.recurrent is None:
            return 0
        pools = [self.recurrent, self.conv, *self.extra_slots.values()]
        return sum(p[:, 0].numel() * p.element_size() for p in pools)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Per-slot state (GDN recurrent and conv, and the layers' other per-slot state, every layer) of
        slots src[i] -> dst[i]: snapshot saves and restores. src, dst: [M] int64 on the pool's device;
        a dst must not also be a src."""
        if self.recurrent is not None and src.numel():
            for pool in (self.recurrent, self.conv, *self.extra_slots.values()):
                pool.index_copy_(1, dst, pool.index_select(1, src))

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """KV pages (and the layers' other per-page state, every attention layer) src[i] -> dst[i]: the
        partly filled page of a snapshot's prefix, copied for a request that resumes from it."""
        if self.k_pages is not None and src.numel():
            for pool in (self.k_pages, self.v_pages, *self.extra_pages.values()):
                raw = _bytes_view(pool)
                raw.index_copy_(1, dst, raw.index_select(1, src))

    def enable_verify(self, model: HybridModel, rows: int, length: int) -> None:
        """Give every GDN layer its speculative-decoding verify buffers (write-on-accept): views of
        one `verify_stack` over the pools (the whole model's write-on-accept in two launches) when
        the GDN mixers hold all the per-slot state; else each layer's own."""
        ssm = [(layer, state) for layer, state in zip(model.layers, self.layer_states, strict=True)
               if isinstance(state, SsmLayerState)]  # fmt: skip
        stacked = bool(ssm) and not any(hasattr(layer, "verify_buffers") for layer, _ in ssm)
        self.verify_stack = gdn_state.VerifyStack.empty(self.recurrent, self.conv, rows, length) if stacked else None
        for i, (layer, state) in enumerate(ssm):
            if self.verify_stack is not None:
                buffers = self.verify_stack.layer(i)
            elif hasattr(layer, "verify_buffers"):  # a layer with more per-slot state than its GDN mixer's
                buffers = layer.verify_buffers(state, rows, length)
            else:
                buffers = layer.mixer.verify_buffers(rows, length, state.conv.device, state.conv.dtype)
            for name, value in buffers.items():
                setattr(state, name, value)
