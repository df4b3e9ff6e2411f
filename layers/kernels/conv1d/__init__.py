"""Causal depthwise conv1d with a carried window: varlen prefill and single-token update.

x is token-major: [T, C], sequences delimited by cu_seqlens. Each sequence's last W - 1 inputs
before the pass live in `conv_state_pool [S, C, W - 1]` at its slot (oldest first).
"""

from __future__ import annotations

import torch

from ..gdn.fixed_captures import CHUNK, FixedCaptures
from ..gdn.state import StateCaptures, conv_windows_at
from . import naive


def causal_conv1d_varlen(
    *,
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    conv_state_pool: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    captures: StateCaptures | FixedCaptures | None = None,
    update_state: bool = True,
    save_inputs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Prefill: the causal conv of each sequence's tokens after its slot's window.

    Args:
        x: [T, C] (rows may be strided). weight: [C, W]. bias: [C] or None.
        cu_seqlens: [N + 1] int. conv_state_pool: [S, C, W - 1]. state_slots: [N].
        has_initial_state: [N] bool (False: the window is zeros, the slot is not read).
        activation: "silu" (or "swish") or None.
        captures: also write the window after each capture's offset into its slot (prefix-cache
            snapshots; gdn/state.py; FixedCaptures: from device tensors), gathered before the slots
            move on (CUDA: one launch for all of them, triton_conv1d.capture_windows).
        update_state: False leaves the slots' windows as they were (a speculative verify: its
            write-on-accept, gdn_state.conv_accept, rebuilds them from there).
        save_inputs: [T, C] (channels contiguous): also a copy of x's rows, from the same launch
            (the verify's inputs that write-on-accept reads).

    Returns:
        y: [T, C] in x's dtype (float32 math). Writes each sequence's last W - 1 inputs to its slot
        (when update_state).
    """
    if save_inputs is not None and (save_inputs.shape != x.shape or save_inputs.stride(-1) != 1):
        raise ValueError(
            f"save_inputs: expected {list(x.shape)} with contiguous channels, got {list(save_inputs.shape)}"
        )
    if captures is not None and x.is_cuda and (isinstance(captures, FixedCaptures) or captures.items):
        from .triton_conv1d import capture_windows

        fields = captures if isinstance(captures, FixedCaptures) else captures.prepared(CHUNK, x.device)
        capture_windows(
            x=x, conv_state_pool=conv_state_pool, state_slots=state_slots, has_initial_state=has_initial_state,
            **fields.window_fields(),
        )  # fmt: skip
    elif isinstance(captures, FixedCaptures):
        captures.conv_windows(x, conv_state_pool, state_slots, has_initial_state)
    elif captures is not None:
        conv_windows_at(
            x=x, conv_state_pool=conv_state_pool, state_slots=state_slots, has_initial_state=has_initial_state,
            captures=captures,
        )  # fmt: skip
    impl = naive.causal_conv1d_varlen
    if x.is_cuda:
        from .triton_conv1d import causal_conv1d_varlen as impl
    return impl(
        x=x, weight=weight, bias=bias, cu_seqlens=cu_seqlens, conv_state_pool=conv_state_pool,
        state_slots=state_slots, has_initial_state=has_initial_state, activation=activation,
        update_state=update_state, save_inputs=save_inputs,
    )  # fmt: skip


def causal_conv1d_update(
    *,
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state_pool: torch.Tensor,
    state_slots: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    pdl: bool = True,
) -> torch.Tensor:
    """Decode: one new input per sequence, its window shifted by it.

    Args:
        x: [N, C]. weight: [C, W]. bias: [C] or None. conv_state_pool: [S, C, W - 1]. state_slots: [N].
        activation: "silu" (or "swish") or None.
        pdl: CUDA: launch under programmatic dependent launch (sm_90+).

    Returns:
        y: [N, C] in x's dtype (float32 math). Shifts each slot's window in place.
    """
    if x.is_cuda:
        from .triton_conv1d import causal_conv1d_update as impl

        return impl(
            x=x, weight=weight, bias=bias, conv_state_pool=conv_state_pool, state_slots=state_slots,
            activation=activation, pdl=pdl,
        )  # fmt: skip
    return naive.causal_conv1d_update(
        x=x, weight=weight, bias=bias, conv_state_pool=conv_state_pool, state_slots=state_slots, activation=activation
    )
