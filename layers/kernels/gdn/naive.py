"""Plain-torch gated delta rule: the reference every GDN kernel is tested against, and the CPU path
(layouts and the recurrence: gdn/__init__.py).

The recurrence accumulates in float64 when its inputs are float64 (else float32): a float64 CPU run
then gives the same result whether a state was reached chunk by chunk or captured mid-chunk and
resumed (prefix caching), far below float32 resolution."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..conv1d import naive as conv_naive
from ..norm import naive as norm_naive
from ..precision import acc_dtype
from .fixed_captures import FixedCaptures
from .state import StateCaptures, VerifyTable, plan_captures


def gdn_gating(*, a, b, A_log, dt_bias):
    """The reference of gdn.gdn_gating (the layer's torch ops)."""
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
    """Accumulation-dtype copies with q, k expanded to the value heads: [T, Hv, K] and friends."""
    num_k_heads, num_v_heads = q.shape[1], v.shape[1]
    acc = acc_dtype(q, k, v)
    q, k, v, g, beta = (t.to(acc) for t in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    if num_v_heads != num_k_heads:
        group = num_v_heads // num_k_heads
        q = q.repeat_interleave(group, dim=1)
        k = k.repeat_interleave(group, dim=1)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return q * scale, k, v, g, beta


def _initial_state(state_pool, slot, has_initial_state, n, shape, acc):
    if bool(has_initial_state[n]):
        return state_pool[slot].to(acc).clone()
    return torch.zeros(shape, dtype=acc, device=state_pool.device)


def chunk_gated_delta_rule(
    *, q, k, v, g, beta, cu_seqlens, state_pool, state_slots, has_initial_state, scale=None, use_qk_l2norm=True,
    chunk_size=64, chunk_states_out=None, captures: StateCaptures | FixedCaptures | None = None,
):  # fmt: skip
    """The reference of gdn.chunk_gated_delta_rule, in chunks of `chunk_size` tokens. Captures as the
    kernel serves them (state.plan_captures): the state at the chunk boundary at or before each offset,
    then the remaining tokens replayed one by one."""
    qf, kf, vf, gf, bf = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    acc = qf.dtype
    out = torch.empty(v.shape, dtype=acc, device=v.device)
    bounds = cu_seqlens.tolist()
    num_v_heads, key_dim, value_dim = vf.shape[1], qf.shape[-1], vf.shape[-1]
    plan = fixed = None
    stores: dict[int, int] = {}  # chunk index -> the slot its state goes to
    if isinstance(captures, FixedCaptures):
        fixed = captures
        fixed.store_initial(state_pool, state_slots, has_initial_state, copy_state_slots)
        stores = {i: s for i, s in enumerate(fixed.chunk_slots.tolist()) if s >= 0}
    elif captures is not None and captures.items:
        if list(captures.seq_lens) != [e - s for s, e in zip(bounds[:-1], bounds[1:], strict=True)]:
            raise ValueError("captures: seq_lens differ from cu_seqlens")
        plan = plan_captures(captures, chunk_size)
        initial = dict(plan.initial_stores)
        stores = plan.chunk_stores
    chunk_index = 0
    for n in range(len(bounds) - 1):
        start, end = bounds[n], bounds[n + 1]
        slot = int(state_slots[n])
        state = _initial_state(state_pool, slot, has_initial_state, n, (num_v_heads, key_dim, value_dim), acc)
        if plan is not None and n in initial:
            state_pool[initial[n]] = state.to(state_pool.dtype)
        per_chunk = []
        for c0 in range(start, end, chunk_size):
            c1 = min(c0 + chunk_size, end)
            o_chunk, state = _chunk_step(qf[c0:c1], kf[c0:c1], vf[c0:c1], gf[c0:c1], bf[c0:c1], state)
            out[c0:c1] = o_chunk
            per_chunk.append(state.clone())
            if chunk_index in stores:
                state_pool[stores[chunk_index]] = state.to(state_pool.dtype)
            chunk_index += 1
        if end > start:
            state_pool[slot] = state.to(state_pool.dtype)
        if chunk_states_out is not None:
            chunk_states_out.append(
                torch.stack(per_chunk) if per_chunk else state.new_zeros((0, num_v_heads, key_dim, value_dim))
            )
    if fixed is not None:
        fixed.finish(
            q, k, v, g, beta, state_pool, scale, use_qk_l2norm, fused_recurrent_gated_delta_rule, copy_state_slots
        )
    if plan is not None:
        for src, dst in plan.copies:
            state_pool[dst] = state_pool[src]
        for n, first, count, dst in plan.replays:
            state = state_pool[dst].to(acc)
            for t in range(bounds[n] + first, bounds[n] + first + count):
                state, _ = _recurrent_step(state, kf[t], vf[t], gf[t], bf[t])
            state_pool[dst] = state.to(state_pool.dtype)
    return out.to(v.dtype)


def copy_state_slots(
    *,
    pool: torch.Tensor,
    dst: torch.Tensor,
    used: torch.Tensor,
    src: torch.Tensor,
    slots: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
) -> None:
    """For each entry c with used[c] != 0: pool[dst[c]] = pool[src[c]]; with `slots` (and `keep`),
    src holds sequence indices: pool[slots[src[c]]] where keep[src[c]], zeros where not. Unused
    entries leave the pool as it is; no entry's destination is another's source. (Reads the
    entries on the host: the reference and the CPU path.)"""
    for c in used.nonzero().flatten().tolist():
        s = int(src[c])
        if slots is None:
            pool[int(dst[c])] = pool[s]
        else:
            pool[int(dst[c])] = pool[int(slots[s])] if bool(keep[s]) else 0


def _recurrent_step(state, k, v, g, beta):
    """One token of the recurrence for all heads: state [..., H, K, V]; k [..., H, K]; v [..., H, V];
    g, beta [..., H]. Returns (new state, delta [..., H, V])."""
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
    *, q, k, v, state_pool, state_slots, g=None, beta=None, a=None, b=None, A_log=None, dt_bias=None, scale=None,
    use_qk_l2norm=True, intermediate_states_out=None, update_state=True, verify_table: VerifyTable | None = None,
    lengths=None,
):  # fmt: skip
    """The reference of gdn.fused_recurrent_gated_delta_rule (steps past a sequence's length leave its
    state as it was)."""
    if raw_gate_form(g, beta, a, b, A_log, dt_bias):
        g, beta = gdn_gating(a=a, b=b, A_log=A_log, dt_bias=dt_bias)
    n_seqs, length = q.shape[:2]
    flat = [t.reshape(n_seqs * length, *t.shape[2:]) for t in (q, k, v, g, beta)]
    qf, kf, vf, gf, bf = (t.reshape(n_seqs, length, *t.shape[1:]) for t in _prepare(*flat, scale, use_qk_l2norm))
    out = torch.empty(vf.shape, dtype=qf.dtype, device=v.device)
    slots = state_slots.long()
    state = state_pool[slots].to(qf.dtype)  # [N, Hv, K, V]
    live = None if lengths is None else lengths.to(device=v.device).long()
    for t in range(length):
        new, delta = _recurrent_step(state, kf[:, t], vf[:, t], gf[:, t], bf[:, t])
        state = new if live is None else torch.where((t < live).view(-1, 1, 1, 1), new, state)
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
    *, mixed_qkv, z, a, b, conv_weight, conv_state_pool, A_log, dt_bias, state_pool, state_slots, norm_weight, eps,
    scale=None,
):  # fmt: skip
    """The reference of gdn.fused_gdn_decode: the three unfused references one after another."""
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
        q=q.reshape(num_seqs, 1, num_k_heads, key_dim), k=k.reshape(num_seqs, 1, num_k_heads, key_dim),
        v=v.reshape(num_seqs, 1, num_v_heads, value_dim), a=a.unsqueeze(1), b=b.unsqueeze(1), A_log=A_log,
        dt_bias=dt_bias, state_pool=state_pool, state_slots=state_slots, scale=scale, use_qk_l2norm=True,
    )  # fmt: skip
    return norm_naive.gated_rms_norm(x=core[:, 0], gate=z, weight=norm_weight, eps=eps)
