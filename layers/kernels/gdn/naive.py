"""Plain-torch gated delta rule: the reference every GDN kernel is tested against, and the CPU path.

Layouts are token-major and varlen: the tokens of all sequences in a pass are concatenated, and
`cu_seqlens` ([N + 1], int) marks where each sequence starts. Recurrent states live in a pool
(`state_pool [S, Hv, K, V]`, float32) and each sequence names its slot in `state_slots [N]`.
Value head `h` reads key/query head `h // (Hv // Hk)`.

The recurrence runs in float64 (inputs and states are read and written in their own dtypes): the
CPU path then gives the same result whether a state was reached chunk by chunk or captured mid-chunk
and resumed (prefix caching), far below float32 resolution.

Per head, with S the [K, V] state, q scaled by `scale` and q, k l2-normalised when asked:
    S_t = exp(g_t) * S_{t-1} + k_t u_t^T,   u_t = beta_t * (v_t - exp(g_t) * S_{t-1}^T k_t)
    o_t = S_t^T q_t
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..conv1d import naive as conv_naive
from ..norm import naive as norm_naive
from ..precision import acc_dtype
from .state import StateCaptures, VerifyTable, plan_captures

ACC = torch.float64  # the recurrence's accumulation dtype (see the module docstring)


def gdn_gating(
    *,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDN decay and write strength from the raw projections (the layer's torch ops, unchanged).

    a, b: [..., Hv], any float dtype and strides; A_log, dt_bias: [Hv]. Returns (g, beta):
    [..., Hv] float32, g = -exp(A_log) * softplus(a + dt_bias) (log decay, <= 0; F.softplus with
    beta 1, threshold 20), beta = sigmoid(b).
    """
    acc = acc_dtype(a, b)
    beta = torch.sigmoid(b.to(acc))
    g = -torch.exp(A_log.to(acc)) * F.softplus(a.to(acc) + dt_bias.to(acc))
    return g, beta


def raw_gate_form(g, beta, a, b, A_log, dt_bias) -> bool:
    """Whether a recurrent call gives raw gates (a, b, A_log, dt_bias) rather than g and beta;
    ValueError unless exactly one of the two forms is complete."""
    given = [t is not None for t in (g, beta)], [t is not None for t in (a, b, A_log, dt_bias)]
    if all(given[0]) and not any(given[1]):
        return False
    if all(given[1]) and not any(given[0]):
        return True
    raise ValueError("give either g and beta, or a, b, A_log and dt_bias (raw gates)")


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the convention fla and transformers use)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm):
    """ACC copies with q, k expanded to the value heads: [T, Hv, K] and friends."""
    num_k_heads, num_v_heads = q.shape[1], v.shape[1]
    q, k, v, g, beta = (t.to(ACC) for t in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    if num_v_heads != num_k_heads:
        group = num_v_heads // num_k_heads
        q = q.repeat_interleave(group, dim=1)
        k = k.repeat_interleave(group, dim=1)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return q * scale, k, v, g, beta


def _initial_state(state_pool, slot, has_initial_state, n, shape):
    if bool(has_initial_state[n]):
        return state_pool[slot].to(ACC).clone()
    return torch.zeros(shape, dtype=ACC, device=state_pool.device)


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
    chunk_size: int = 64,
    chunk_states_out: list | None = None,
    captures: StateCaptures | None = None,
) -> torch.Tensor:
    """Chunked gated delta rule over varlen sequences; updates their pool slots in place.

    q, k: [T, Hk, K]; v: [T, Hv, V]; g (log decay, <= 0), beta: [T, Hv]; cu_seqlens: [N + 1];
    state_pool: [S, Hv, K, V] float32; state_slots: [N]; has_initial_state: [N] bool (False: start
    from zeros, ignore the slot's old contents). Returns o: [T, Hv, V] in v's dtype.
    chunk_states_out, when a list, receives for each sequence a [num_chunks, Hv, K, V] tensor: the
    state after each chunk of `chunk_size` tokens counted from the sequence's first token here.
    captures: also write the states they name into their slots (state.py: the state at the chunk
    boundary at or before each offset, then the remaining tokens replayed one by one).
    """
    qf, kf, vf, gf, bf = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    out = torch.empty(v.shape, dtype=ACC, device=v.device)
    bounds = cu_seqlens.tolist()
    num_v_heads, key_dim, value_dim = vf.shape[1], qf.shape[-1], vf.shape[-1]
    plan = None
    if captures is not None and captures.items:
        if list(captures.seq_lens) != [e - s for s, e in zip(bounds[:-1], bounds[1:], strict=True)]:
            raise ValueError("captures: seq_lens differ from cu_seqlens")
        plan = plan_captures(captures, chunk_size)
        initial = dict(plan.initial_stores)
    chunk_index = 0
    for n in range(len(bounds) - 1):
        start, end = bounds[n], bounds[n + 1]
        slot = int(state_slots[n])
        state = _initial_state(state_pool, slot, has_initial_state, n, (num_v_heads, key_dim, value_dim))
        if plan is not None and n in initial:
            state_pool[initial[n]] = state.to(state_pool.dtype)
        per_chunk = []
        for c0 in range(start, end, chunk_size):
            c1 = min(c0 + chunk_size, end)
            o_chunk, state = _chunk_step(qf[c0:c1], kf[c0:c1], vf[c0:c1], gf[c0:c1], bf[c0:c1], state)
            out[c0:c1] = o_chunk
            per_chunk.append(state.clone())
            if plan is not None and chunk_index in plan.chunk_stores:
                state_pool[plan.chunk_stores[chunk_index]] = state.to(state_pool.dtype)
            chunk_index += 1
        if end > start:
            state_pool[slot] = state.to(state_pool.dtype)
        if chunk_states_out is not None:
            chunk_states_out.append(
                torch.stack(per_chunk) if per_chunk else state.new_zeros((0, num_v_heads, key_dim, value_dim))
            )
    if plan is not None:
        for src, dst in plan.copies:
            state_pool[dst] = state_pool[src]
        for n, first, count, dst in plan.replays:
            rows = slice(bounds[n] + first, bounds[n] + first + count)
            state = state_pool[dst].to(ACC)
            for t in range(rows.start, rows.stop):
                state, _ = _recurrent_step(state, kf[t], vf[t], gf[t], bf[t])
            state_pool[dst] = state.to(state_pool.dtype)
    return out.to(v.dtype)


def _recurrent_step(state, k, v, g, beta):
    """One token of the recurrence for all heads: state [H, K, V] (or [N, H, K, V] with k [N, H, K]);
    k [H, K]; v [H, V]; g, beta [H]. Returns (new state, delta [H, V])."""
    state = state * g.exp()[..., None, None]
    predicted = (state * k[..., :, None]).sum(dim=-2)  # S^T k
    delta = beta[..., None] * (v - predicted)
    return state + k[..., :, None] * delta[..., None, :], delta


def _chunk_step(q, k, v, g, beta, state):
    """One chunk of L tokens for all heads. q, k: [L, H, K]; v: [L, H, V]; g, beta: [L, H];
    state: [H, K, V]. Returns (o [L, H, V], new state)."""
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [H, L, *]
    g, beta = g.transpose(0, 1), beta.transpose(0, 1)  # [H, L]
    length = q.shape[1]
    gamma = g.cumsum(dim=-1)  # log of the decay from the chunk start through token i
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    decay = (gamma[:, :, None] - gamma[:, None, :]).masked_fill(~causal, float("-inf")).exp()  # [H, L, L]
    # (I + A) U = beta * V - beta * exp(gamma) * K S0, with A strictly lower triangular
    a = (beta[:, :, None] * (k @ k.transpose(-1, -2)) * decay).tril(-1)
    eye = torch.eye(length, dtype=q.dtype, device=q.device)
    lhs = eye + a
    w_v = torch.linalg.solve_triangular(lhs, beta[..., None] * v, upper=False, unitriangular=True)
    w_k = torch.linalg.solve_triangular(lhs, (beta * gamma.exp())[..., None] * k, upper=False, unitriangular=True)
    u = w_v - w_k @ state  # [H, L, V]
    o = gamma.exp()[..., None] * (q @ state) + ((q @ k.transpose(-1, -2)) * decay) @ u
    tail = (gamma[:, -1:] - gamma).exp()  # decay from token j to the chunk end
    new_state = gamma[:, -1].exp()[:, None, None] * state + (k * tail[..., None]).transpose(-1, -2) @ u
    return o.transpose(0, 1), new_state


def fused_recurrent_gated_delta_rule(
    *,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    state_pool: torch.Tensor,
    state_slots: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    intermediate_states_out: torch.Tensor | None = None,
    update_state: bool = True,
    verify_table: VerifyTable | None = None,
    a: torch.Tensor | None = None,
    b: torch.Tensor | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Token-by-token gated delta rule for L tokens of each of N sequences.

    q, k: [N, L, Hk, K]; v: [N, L, Hv, V]; g, beta: [N, L, Hv]; state_pool: [S, Hv, K, V] float32;
    state_slots: [N]. Decode is L = 1; verifying k speculative drafts is L = k. Returns
    o: [N, L, Hv, V] in v's dtype. intermediate_states_out ([N, L, Hv, K, V]), when given, receives
    the state after each token; update_state writes the state after the last token to the slot.
    verify_table, when given, receives each token's step (state.py) for write-on-accept.
    Raw gates: instead of g and beta, a and b ([N, L, Hv], any float dtype and strides) with A_log
    and dt_bias ([Hv]); g and beta are then gdn_gating's.
    """
    if raw_gate_form(g, beta, a, b, A_log, dt_bias):
        g, beta = gdn_gating(a=a, b=b, A_log=A_log, dt_bias=dt_bias)
    n_seqs, length = q.shape[:2]
    flat = [t.reshape(n_seqs * length, *t.shape[2:]) for t in (q, k, v, g, beta)]
    qf, kf, vf, gf, bf = (t.reshape(n_seqs, length, *t.shape[1:]) for t in _prepare(*flat, scale, use_qk_l2norm))
    out = torch.empty(vf.shape, dtype=ACC, device=v.device)
    slots = state_slots.long()
    state = state_pool[slots].to(ACC)  # [N, Hv, K, V]
    for t in range(length):
        state, delta = _recurrent_step(state, kf[:, t], vf[:, t], gf[:, t], bf[:, t])
        out[:, t] = (state * qf[:, t, :, :, None]).sum(dim=-2)
        if verify_table is not None:
            verify_table.k[:, t] = kf[:, t]
            verify_table.delta[:, t] = delta
            verify_table.g[:, t] = gf[:, t]
        if intermediate_states_out is not None:
            intermediate_states_out[:, t] = state.to(intermediate_states_out.dtype)
    if update_state:
        state_pool[slots] = state.to(state_pool.dtype)
    return out.to(v.dtype)


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
) -> torch.Tensor:
    """One GDN decode step (one new token per sequence) from the in_proj columns to the normed
    heads: the three unfused ops one after another, conv1d update (SiLU) -> recurrent gated delta
    rule (raw gates, q/k l2norm) -> gated RMSNorm, each rounding its output to the activations'
    dtype as it does on its own.

    mixed_qkv: [N, 2 * Hk * K + Hv * V], the conv channels [q | k | v]; z: [N, Hv, V]; a, b:
    [N, Hv] raw gates (any strides); conv_weight: [C, W]; conv_state_pool: [S, C, W - 1]; A_log,
    dt_bias: [Hv]; state_pool: [S, Hv, K, V] float32; state_slots: [N]; norm_weight: [V]. Hk is
    what the channel count leaves. Returns [N, Hv, V] in mixed_qkv's dtype; updates the slots' conv
    windows and states in place.
    """
    num_seqs, channels = mixed_qkv.shape
    num_v_heads, key_dim, value_dim = state_pool.shape[1:]
    key_channels = (channels - num_v_heads * value_dim) // 2
    num_k_heads = key_channels // key_dim
    conv_out = conv_naive.causal_conv1d_update(
        x=mixed_qkv,
        weight=conv_weight,
        bias=None,
        conv_state_pool=conv_state_pool,
        state_slots=state_slots,
        activation="silu",
    )
    q, k, v = conv_out.split([key_channels, key_channels, num_v_heads * value_dim], dim=1)
    core = fused_recurrent_gated_delta_rule(
        q=q.reshape(num_seqs, 1, num_k_heads, key_dim),
        k=k.reshape(num_seqs, 1, num_k_heads, key_dim),
        v=v.reshape(num_seqs, 1, num_v_heads, value_dim),
        a=a.unsqueeze(1),
        b=b.unsqueeze(1),
        A_log=A_log,
        dt_bias=dt_bias,
        state_pool=state_pool,
        state_slots=state_slots,
        scale=scale,
        use_qk_l2norm=True,
    )
    return norm_naive.gated_rms_norm(x=core[:, 0], gate=z, weight=norm_weight, eps=eps)
