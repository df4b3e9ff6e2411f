"""PassPlan (host, numpy) -> ForwardContext (device tensors), uploaded once per pass; and the two
host/device transfer helpers every pass uses without blocking the host: `upload` (host arrays to the
device: one pinned buffer, one non-blocking copy) and `HostCopy` (device results to pinned host
memory, non-blocking, with one CUDA event that is waited for only when the results are read)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from deltaserve.layers.base import AttnMetadata, BatchedAttnMetadata, ForwardContext, LoraBatch, MoeLoraRoute
from deltaserve.layers.config import ModelConfig
from deltaserve.layers.kernels.gdn.state import StateCapture, StateCaptures
from deltaserve.layers.kernels.options import KernelOptions
from deltaserve.layers.parallel import ParallelLayout
from deltaserve.workers.plan import PassPlan


def upload(arrays: Sequence[np.ndarray], device, dtype: torch.dtype = torch.int64) -> list[torch.Tensor]:
    """Host arrays -> device tensors of `dtype`, shapes kept; the results are fresh tensors that
    alias no host array. On CUDA the arrays are packed into one pinned buffer and copied with one
    non-blocking copy: no host sync (the caching host allocator keeps the buffer until the copy ran)."""
    device = torch.device(device)
    if device.type != "cuda":
        np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
        return [torch.from_numpy(np.array(a, dtype=np_dtype)) for a in arrays]
    flat = [np.asarray(a).reshape(-1) for a in arrays]
    align = max(1, 16 // torch.empty(0, dtype=dtype).element_size())  # each part 16-byte aligned (Triton)
    offsets, total = [], 0
    for f in flat:
        offsets.append(total)
        total += -(-f.size // align) * align
    staging = torch.empty(max(total, 1), dtype=dtype, pin_memory=True)
    host = staging.numpy()
    for f, offset in zip(flat, offsets, strict=True):
        host[offset : offset + f.size] = f
    dev = staging.to(device, non_blocking=True)
    return [dev[offset : offset + f.size].view(np.shape(a)) for a, f, offset in zip(arrays, flat, offsets, strict=True)]


class HostCopy:
    """Device tensors brought to the host without blocking it: on CUDA each is copied non_blocking
    into pinned memory and `record()` puts one event after the copies; `get` waits for that event
    (the pass's only wait, when its output is consumed). On CPU the tensors are used as they are."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self._items: list[torch.Tensor] = []
        self._event = None
        self._ready = not self.cuda

    def add(self, t: torch.Tensor) -> int:
        if self.cuda:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            t = host
        self._items.append(t)
        return len(self._items) - 1

    def record(self) -> None:
        if self.cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    def ready(self) -> bool:
        """Whether `get` would return without waiting (an event query on CUDA; never blocks)."""
        if not self._ready and self._event is not None and self._event.query():
            self._ready = True
        return self._ready

    def get(self, index: int) -> torch.Tensor:
        if not self._ready:
            self._event.synchronize()
            self._ready = True
        return self._items[index]


def logits_rows(plan: PassPlan) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """Token rows whose logits the pass computes, and per plan row (first, count, sampled_at):
    the span of its entries in that list and the entry of its sampled position (-1: none).
    A sampling row contributes its last token; a prompt-logprobs row contributes all its tokens; a
    verify row (speculative decoding) all its tokens, first in the list, with sampled_at -1 (the
    runner samples verify rows apart)."""
    starts = plan.query_start_loc
    if plan.num_spec_tokens:
        return _with_verify_rows(plan)
    if not plan.prompt_logprob_rows.any():  # the common case, without a Python loop over rows
        sampled = plan.sample_rows
        order = np.cumsum(sampled) - 1
        spans = [(int(o), 1, int(o)) if s else (int(o) + 1, 0, -1) for s, o in zip(sampled, order, strict=True)]
        return (starts[1:][sampled] - 1).astype(np.int64), spans
    indices: list[np.ndarray] = []
    spans = []
    count = 0
    for n in range(plan.num_rows):
        lo, hi = int(starts[n]), int(starts[n + 1])
        if plan.prompt_logprob_rows[n]:
            rows = np.arange(lo, hi)
        elif plan.sample_rows[n]:
            rows = np.array([hi - 1])
        else:
            rows = np.zeros(0, dtype=np.int64)
        sampled_at = count + len(rows) - 1 if plan.sample_rows[n] else -1
        spans.append((count, len(rows), sampled_at))
        indices.append(rows)
        count += len(rows)
    flat = np.concatenate(indices) if indices else np.zeros(0, dtype=np.int64)
    return flat.astype(np.int64), spans


def _with_verify_rows(plan: PassPlan) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """logits_rows of a plan whose decode rows are verify rows of k + 1 tokens."""
    nv, length = plan.num_decode_rows, plan.num_spec_tokens + 1
    rest = dataclasses.replace(
        plan,
        num_spec_tokens=0,
        num_decode_rows=0,
        query_start_loc=plan.query_start_loc[nv:] - plan.query_start_loc[nv],
        sample_rows=plan.sample_rows[nv:],
        prompt_logprob_rows=plan.prompt_logprob_rows[nv:],
        req_ids=plan.req_ids[nv:],
    )
    indices, spans = logits_rows(rest)
    offset = nv * length
    spans = [(n * length, length, -1) for n in range(nv)] + [
        (first + offset, count, -1 if at < 0 else at + offset) for first, count, at in spans
    ]
    return np.concatenate([np.arange(offset), indices + offset]).astype(np.int64), spans


def build_forward_context(
    plan: PassPlan,
    config: ModelConfig,
    layout: ParallelLayout,
    device: torch.device | str,
    logits_indices: np.ndarray,
    prev_tokens: torch.Tensor | None = None,
    kernels: KernelOptions | None = None,
    num_lora_slots: int = 0,
    moe_lora_route: MoeLoraRoute = MoeLoraRoute.SKIP,
) -> ForwardContext:
    """`prev_tokens`: the previous pass's sampled ids on the device; rows the plan marks in
    `input_from_prev` take their input id from it (a device-side scatter, no host round trip).
    `num_lora_slots`: the adapter slots there are; the plan's `lora_slots` become each token's slot."""
    nd = plan.num_decode_rows
    starts = plan.query_start_loc
    num_decode_tokens = int(starts[nd])
    has_prefill = plan.num_rows > nd
    arrays = [
        plan.input_ids,
        plan.positions,
        plan.slot_mapping,
        plan.block_tables,
        plan.seq_lens,
        plan.state_slots,
        logits_indices,
    ]
    if has_prefill:
        arrays += [starts[nd:] - num_decode_tokens, plan.has_initial_state[nd:]]
    from_prev = plan.input_from_prev
    scatter = prev_tokens is not None and from_prev is not None and bool((from_prev >= 0).any())
    if scatter:
        rows = np.flatnonzero(from_prev >= 0)
        arrays += [starts[rows], from_prev[rows]]
    lora_rows = plan.lora_slots if plan.lora_slots is not None and (plan.lora_slots >= 0).any() else None
    if lora_rows is not None:
        arrays.append(np.repeat(lora_rows, np.diff(starts)))
    up = upload(arrays, device)
    lora = None
    if lora_rows is not None:
        active = frozenset(int(s) for s in np.unique(lora_rows) if s >= 0)
        lora = LoraBatch(up.pop().to(torch.int32), num_lora_slots, active)
    input_ids, positions, slot_mapping, block_tables, seq_lens, state_slots, logits_idx = up[:7]
    block_tables = block_tables.to(torch.int32)
    seq_lens = seq_lens.to(torch.int32)
    if scatter:
        dst, src = up[-2], up[-1]
        input_ids.index_copy_(0, dst, prev_tokens.index_select(0, src))

    decode = None
    if nd:
        tokens_per_row = num_decode_tokens // nd
        decode = AttnMetadata(
            positions=positions[:num_decode_tokens],
            slot_mapping=slot_mapping[:num_decode_tokens],
            block_tables=block_tables[:nd],
            seq_lens=seq_lens[:nd],
            state_slots=state_slots[:nd],
            tokens_per_row=tokens_per_row,
        )
    prefill = None
    if has_prefill:
        q_lens = np.diff(starts[nd:])
        prefill = BatchedAttnMetadata(
            positions=positions[num_decode_tokens:],
            slot_mapping=slot_mapping[num_decode_tokens:],
            cu_seqlens=up[7].to(torch.int32),
            block_tables=block_tables[nd:],
            seq_lens=seq_lens[nd:],
            state_slots=state_slots[nd:],
            has_initial_state=up[8].to(torch.bool),
            max_query_len=int(q_lens.max()),
            max_seq_len=int(plan.seq_lens[nd:].max()),
        )
    return ForwardContext(
        config=config,
        layout=layout,
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        decode=decode,
        prefill=prefill,
        logits_indices=logits_idx,
        midchunk_capture=midchunk_captures(plan),
        moe_lora_route=moe_lora_route if lora is not None else MoeLoraRoute.SKIP,
        lora=lora,
        kernels=kernels or KernelOptions(),
    )


def decode_context(
    *,
    config: ModelConfig,
    layout: ParallelLayout,
    kernels: KernelOptions,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    state_slots: torch.Tensor,
    tokens_per_row: int = 1,
) -> ForwardContext:
    """A pass of decode rows only (`tokens_per_row` tokens each) over device tensors that are already
    there (CUDA-graph buffers, the MTP head's draft steps); logits for every token."""
    decode = AttnMetadata(
        positions=positions,
        slot_mapping=slot_mapping,
        block_tables=block_tables,
        seq_lens=seq_lens,
        state_slots=state_slots,
        tokens_per_row=tokens_per_row,
    )
    return ForwardContext(
        config=config,
        layout=layout,
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        decode=decode,
        prefill=None,
        logits_indices=torch.arange(input_ids.shape[0], device=input_ids.device),
        kernels=kernels,
    )


def midchunk_captures(plan: PassPlan) -> StateCaptures | None:
    """The plan's GDN captures in the prefill chunk's own coordinates (its streams and their lengths)."""
    if plan.captures is None or not len(plan.captures):
        return None
    nd = plan.num_decode_rows
    lens = tuple(int(n) for n in np.diff(plan.query_start_loc[nd:]))
    items = tuple(StateCapture(int(row) - nd, int(offset), int(slot)) for row, offset, slot in plan.captures)
    return StateCaptures(items, lens)
