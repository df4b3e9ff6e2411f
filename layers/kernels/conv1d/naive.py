"""Plain-torch causal depthwise conv1d with a carried window: the reference and the CPU path.

x is token-major and varlen ([T, C], sequences delimited by cu_seqlens). Each sequence's last
W - 1 inputs before this pass live in `conv_state_pool [S, C, W - 1]` at its slot (oldest first).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..precision import acc_dtype


def is_silu(activation: str | None) -> bool:
    """True for "silu" / "swish", False for None; anything else is an error naming the argument."""
    if activation is None:
        return False
    if activation in ("silu", "swish"):
        return True
    raise ValueError(f"activation {activation!r} is not supported (silu or None)")


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    return F.silu(y) if is_silu(activation) else y


def causal_conv1d_varlen(
    *, x, weight, bias, cu_seqlens, conv_state_pool, state_slots, has_initial_state, activation="silu",
    update_state=True, save_inputs=None,
):  # fmt: skip
    """The reference of conv1d.causal_conv1d_varlen."""
    if save_inputs is not None:
        save_inputs.copy_(x)
    width = weight.shape[1]
    y = torch.empty_like(x)
    bounds = cu_seqlens.tolist()
    for n in range(len(bounds) - 1):
        start, end = bounds[n], bounds[n + 1]
        if end == start:
            continue
        slot = int(state_slots[n])
        if bool(has_initial_state[n]):
            window = conv_state_pool[slot].to(x.dtype)
        else:
            window = x.new_zeros((x.shape[1], width - 1))
        seq = torch.cat([window, x[start:end].t()], dim=1)  # [C, W - 1 + L]
        out = F.conv1d(
            seq.to(acc_dtype(x)).unsqueeze(0),
            weight.to(acc_dtype(x)).unsqueeze(1),
            None if bias is None else bias.to(acc_dtype(x)),
            groups=x.shape[1],
        )[0]
        y[start:end] = _activate(out, activation).t().to(x.dtype)
        if update_state:
            conv_state_pool[slot] = seq[:, -(width - 1) :].to(conv_state_pool.dtype)
    return y


def causal_conv1d_update(*, x, weight, bias, conv_state_pool, state_slots, activation="silu"):
    """The reference of conv1d.causal_conv1d_update."""
    slots = state_slots.long()
    acc = acc_dtype(x)
    window = conv_state_pool[slots].to(acc)  # [N, C, W - 1]
    seq = torch.cat([window, x.to(acc).unsqueeze(-1)], dim=-1)  # [N, C, W]
    out = (seq * weight.to(acc).unsqueeze(0)).sum(dim=-1)
    if bias is not None:
        out = out + bias.to(acc)
    conv_state_pool[slots] = seq[:, :, 1:].to(conv_state_pool.dtype)
    return _activate(out, activation).to(x.dtype)
