"""The token bitmask in plain torch: the reference of bitmask.apply_token_bitmask, and the CPU path."""

from __future__ import annotations

import torch


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[M, W] int32 bitmask -> [M, vocab] bool (True: allowed), bit t % 32 of word t // 32 for token t."""
    as_bytes = bitmask.contiguous().view(torch.uint8)  # little-endian: byte b of word w holds tokens 32w + 8b ..
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmask.device)
    bits = (as_bytes.unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab].bool()


def apply_token_bitmask(*, logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    banned = ~allowed_tokens(bitmask, logits.shape[1])
    if rows is None:
        logits.masked_fill_(banned, float("-inf"))
        return
    picked = logits.index_select(0, rows).masked_fill_(banned, float("-inf"))
    logits.index_copy_(0, rows, picked)
