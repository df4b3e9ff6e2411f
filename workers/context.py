"""PassPlan (host, numpy) -> ForwardContext (device tensors), uploaded once per pass."""

from __future__ import annotations

import numpy as np
import torch

from deltaserve.cluster.plan import PassPlan
from deltaserve.layers.base import AttnMetadata, BatchedAttnMetadata, ForwardContext
from deltaserve.layers.config import ModelConfig
from deltaserve.layers.parallel import ParallelLayout


def logits_rows(plan: PassPlan) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """Token rows whose logits the pass computes, and per plan row (first, count, sampled_at):
    the span of its entries in that list and the entry of its sampled position (-1: none).
    A sampling row contributes its last token; a prompt-logprobs row contributes all its tokens."""
    starts = plan.query_start_loc
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


def build_forward_context(
    plan: PassPlan,
    config: ModelConfig,
    layout: ParallelLayout,
    device: torch.device | str,
    logits_indices: np.ndarray,
) -> ForwardContext:
    def up(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        # arrays decoded from the wire are read-only views of the message: copy those
        return torch.from_numpy(np.require(a, requirements=["C", "W"])).to(device=device, dtype=dtype)

    nd = plan.num_decode_rows
    starts = plan.query_start_loc
    num_decode_tokens = int(starts[nd])
    input_ids = up(plan.input_ids, torch.long)
    positions = up(plan.positions, torch.long)
    slot_mapping = up(plan.slot_mapping, torch.long)
    block_tables = up(plan.block_tables, torch.int32)
    seq_lens = up(plan.seq_lens, torch.int32)
    state_slots = up(plan.state_slots, torch.long)

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
    if plan.num_rows > nd:
        q_lens = np.diff(starts[nd:])
        prefill = BatchedAttnMetadata(
            positions=positions[num_decode_tokens:],
            slot_mapping=slot_mapping[num_decode_tokens:],
            cu_seqlens=up(starts[nd:] - num_decode_tokens, torch.int32),
            block_tables=block_tables[nd:],
            seq_lens=seq_lens[nd:],
            state_slots=state_slots[nd:],
            has_initial_state=up(plan.has_initial_state[nd:], torch.bool),
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
        logits_indices=up(logits_indices, torch.long),
    )
