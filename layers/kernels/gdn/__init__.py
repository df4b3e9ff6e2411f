"""Gated delta rule: chunked (prefill) and fused recurrent (decode, k-token verify), the gating that
feeds them, and the whole one-token decode step (conv1d update, recurrent, gated norm) as one op.

Layouts are token-major and varlen: the tokens of all sequences in a pass are concatenated, and
`cu_seqlens` ([N + 1], int) marks where each sequence starts. Recurrent states live in a pool
(`state_pool [S, Hv, K, V]`, float32) and each sequence names its slot in `state_slots [N]`.
Value head h reads key/query head h // (Hv // Hk). Per head, with S the [K, V] state, q scaled by
`scale` (default K ** -0.5) and q, k l2-normalised when asked:

    S_t = exp(g_t) * S_{t-1} + k_t u_t^T,   u_t = beta_t * (v_t - exp(g_t) * S_{t-1}^T k_t)
    o_t = S_t^T q_t

Each op runs Triton kernels for CUDA tensors and the plain-torch reference (naive.py) otherwise.
"""

from __future__ import annotations

import torch

from ..norm import naive as norm_naive
from . import naive
from .fixed_captures import FixedCaptures
from .state import StateCaptures, VerifyTable


def chunk_gated_delta_rule(
    *,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_pool: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    chunk_states_out: list[torch.Tensor] | None = None,
    captures: StateCaptures | FixedCaptures | None = None,
    variant: str = "",
    norm_gate: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
) -> torch.Tensor:
    """The chunked gated delta rule over varlen sequences (prefill); updates their pool slots in place.

    Args:
        q, k: [T, Hk, K]; v: [T, Hv, V] (strided views allowed, the last dim contiguous).
        g: [T, Hv] float32 log decay (<= 0). beta: [T, Hv] float32.
        cu_seqlens: [N + 1] int. state_pool: [S, Hv, K, V] float32. state_slots: [N] int.
        has_initial_state: [N] bool (False: start from zeros, the slot's old contents unread).
        chunk_states_out: a list to receive, per sequence, the state after each 64-token chunk
            ([num_chunks, Hv, K, V] float32; reads cu_seqlens on the host).
        captures: also write the state after each capture's offset of its sequence into its slot
            (prefix-cache snapshots; state.py), without changing how the sequence is chunked;
            FixedCaptures: the same from device tensors of fixed shapes (a CUDA graph's).
        variant: CUDA: the sequential part's design (chunk.VARIANTS: "fused", "fused_pf",
            "split32", "split32_win"); empty: chunk.pick_variant's choice by the shapes.
        norm_gate, norm_weight: the GDN output norm as well (norm.gated_rms_norm of o with this gate
            [T, Hv, V], token rows strided allowed, and weight [V], eps norm_eps); CUDA: inside the
            output kernel of the split design.

    Returns:
        o: [T, Hv, V] in v's dtype (normed with norm_gate). CUDA: no host sync (unless chunk_states_out).
    """
    args = dict(
        q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=cu_seqlens, state_pool=state_pool, state_slots=state_slots,
        has_initial_state=has_initial_state, scale=scale, use_qk_l2norm=use_qk_l2norm,
        chunk_states_out=chunk_states_out, captures=captures,
    )  # fmt: skip
    if norm_gate is not None and norm_weight is None:
        raise ValueError("chunk_gated_delta_rule: norm_gate needs norm_weight")
    if q.is_cuda:
        from .chunk import chunk_gated_delta_rule as impl

        return impl(**args, variant=variant or None, norm_gate=norm_gate, norm_weight=norm_weight, norm_eps=norm_eps)
    out = naive.chunk_gated_delta_rule(**args)
    if norm_gate is None:
        return out
    return norm_naive.gated_rms_norm(x=out, gate=norm_gate, weight=norm_weight, eps=norm_eps)


def fused_recurrent_gated_delta_rule(
    *,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state_pool: torch.Tensor,
    state_slots: torch.Tensor,
    g: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    a: torch.Tensor | None = None,
    b: torch.Tensor | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    intermediate_states_out: torch.Tensor | None = None,
    update_state: bool = True,
    verify_table: VerifyTable | None = None,
    lengths: torch.Tensor | None = None,
    pdl: bool = True,
) -> torch.Tensor:
    """The gated delta rule token by token, for L tokens of each of N sequences (decode: L = 1;
    verifying k speculative drafts: L = k).

    Args:
        q, k: [N, L, Hk, K]; v: [N, L, Hv, V]. state_pool: [S, Hv, K, V] float32. state_slots: [N].
        g, beta: [N, L, Hv]; or, instead, the raw gates a, b ([N, L, Hv], any float dtype and
            strides, e.g. column views of in_proj's output) with A_log, dt_bias ([Hv]): then g and
            beta are gdn_gating's, computed in the kernel.
        intermediate_states_out: [N, L, Hv, K, V], receives the state after each token.
        update_state: write the state after the last token to the slot.
        verify_table: receives each token's step for write-on-accept (state.VerifyTable of N rows of L).
        lengths: [N] int, each at most L: sequence n runs only its first lengths[n] tokens (the
            state as after them; o past them unspecified). None: all L.
        pdl: CUDA: launch under programmatic dependent launch (sm_90+).

    Returns:
        o: [N, L, Hv, V] in v's dtype. CUDA: no host sync.
    """
    naive.raw_gate_form(g, beta, a, b, A_log, dt_bias)  # exactly one complete form, else ValueError
    gates = dict(g=g, beta=beta, a=a, b=b, A_log=A_log, dt_bias=dt_bias)
    if q.is_cuda:
        from .recurrent import fused_recurrent_gated_delta_rule as impl

        return impl(
            q=q, k=k, v=v, state_pool=state_pool, state_slots=state_slots, scale=scale, use_qk_l2norm=use_qk_l2norm,
            intermediate_states_out=intermediate_states_out, update_state=update_state, verify_table=verify_table,
            lengths=lengths, pdl=pdl, **gates,
        )  # fmt: skip
    return naive.fused_recurrent_gated_delta_rule(
        q=q, k=k, v=v, state_pool=state_pool, state_slots=state_slots, scale=scale, use_qk_l2norm=use_qk_l2norm,
        intermediate_states_out=intermediate_states_out, update_state=update_state, verify_table=verify_table,
        lengths=lengths, **gates,
    )  # fmt: skip


def gdn_gating(
    *, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDN decay and write strength from the raw projections.

    Args:
        a, b: [..., Hv], any float dtype and strides. A_log, dt_bias: [Hv].

    Returns:
        (g, beta): [..., Hv] float32, contiguous; g = -exp(A_log) * softplus(a + dt_bias) (log
        decay, <= 0; F.softplus with beta 1, threshold 20), beta = sigmoid(b). CUDA: one launch.
    """
    impl = naive.gdn_gating
    if a.is_cuda:
        from .gating import gdn_gating as impl
    return impl(a=a, b=b, A_log=A_log, dt_bias=dt_bias)


def fused_gdn_decode(
    *,
    mixed_qkv: torch.Tensor,
    z: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_state_pool: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state_pool: torch.Tensor,
    state_slots: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    scale: float | None = None,
    pdl: bool = True,
) -> torch.Tensor:
    """One GDN decode step (one new token per sequence) from the in_proj columns to the normed
    heads: conv1d update (SiLU) -> recurrent gated delta rule (raw gates, q/k l2norm) -> gated
    RMSNorm, each rounding its output to the activations' dtype as the three ops do on their own.

    Args:
        mixed_qkv: [N, 2 * Hk * K + Hv * V], the conv channels [q | k | v]. z: [N, Hv, V] the
            output gate. a, b: [N, Hv] raw gates (all four may be strided column views of in_proj's
            output). conv_weight: [C, W]. conv_state_pool: [S, C, W - 1]. A_log, dt_bias: [Hv].
            state_pool: [S, Hv, K, V] float32. state_slots: [N] (distinct, but for discarded rows:
            CUDA-graph padding rows share a scratch slot). norm_weight: [V]. Hk is what the channel
            count leaves.
        pdl: CUDA: launch under programmatic dependent launch (sm_90+).

    Returns:
        [N, Hv, V] in mixed_qkv's dtype; the slots' conv windows and states updated in place.
        CUDA: one launch (launches on one device must not overlap: they share ticket counters).
    """
    args = dict(
        mixed_qkv=mixed_qkv, z=z, a=a, b=b, conv_weight=conv_weight, conv_state_pool=conv_state_pool, A_log=A_log,
        dt_bias=dt_bias, state_pool=state_pool, state_slots=state_slots, norm_weight=norm_weight, eps=eps, scale=scale,
    )  # fmt: skip
    if mixed_qkv.is_cuda:
        from .decode import fused_gdn_decode as impl

        return impl(**args, pdl=pdl)
    return naive.fused_gdn_decode(**args)
