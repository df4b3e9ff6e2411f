"""Which row (sequence) of a pass each token belongs to: what the per-sequence state of Qwen4-Exp's
layers (PLE's token context and conv window, the QSA indexer's paged keys) is looked up by. Built
once per pass from the ForwardContext with device ops only (no host sync: decode passes are
captured in CUDA graphs)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import ForwardContext


@dataclass
class PassRows:
    """Rows in pass order: the decode rows, then the prefill streams.

    token_rows [T]: each token's row; starts / ends [R]: each row's first token and one past its last
    (pass coordinates); slots [R]: state slots; has_init [R]: the row continues a cached sequence;
    num_decode_rows / num_decode_tokens: host ints."""

    token_rows: torch.Tensor
    starts: torch.Tensor
    ends: torch.Tensor
    slots: torch.Tensor
    has_init: torch.Tensor
    num_decode_rows: int
    num_decode_tokens: int

    @property
    def num_rows(self) -> int:
        return int(self.starts.shape[0])


def pass_rows(ctx: ForwardContext) -> PassRows:
    device = ctx.input_ids.device
    parts: dict[str, list[torch.Tensor]] = {"rows": [], "starts": [], "ends": [], "slots": [], "init": []}
    num_decode_rows = num_decode_tokens = 0
    if ctx.decode is not None:
        d = ctx.decode
        num_decode_rows, num_decode_tokens = d.num_seqs, d.num_tokens
        starts = torch.arange(num_decode_rows, device=device) * d.tokens_per_row
        parts["rows"].append(torch.arange(num_decode_tokens, device=device) // d.tokens_per_row)
        parts["starts"].append(starts)
        parts["ends"].append(starts + d.tokens_per_row)
        parts["slots"].append(d.state_slots.long())
        parts["init"].append(torch.ones(num_decode_rows, dtype=torch.bool, device=device))
    if ctx.prefill is not None:
        p = ctx.prefill
        cu = p.cu_seqlens.long()
        local = torch.arange(p.num_tokens, device=device)
        parts["rows"].append(num_decode_rows + torch.searchsorted(cu[1:], local, right=True))
        parts["starts"].append(cu[:-1] + num_decode_tokens)
        parts["ends"].append(cu[1:] + num_decode_tokens)
        parts["slots"].append(p.state_slots.long())
        parts["init"].append(p.has_initial_state.bool())
    cat = {k: v[0] if len(v) == 1 else torch.cat(v) for k, v in parts.items()}
    return PassRows(
        token_rows=cat["rows"],
        starts=cat["starts"],
        ends=cat["ends"],
        slots=cat["slots"],
        has_init=cat["init"],
        num_decode_rows=num_decode_rows,
        num_decode_tokens=num_decode_tokens,
    )
