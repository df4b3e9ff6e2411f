"""The MoE router in Triton: softmax over the experts in float32 and top-k by k rounds of
argmax-and-mask in registers, one program per token (or a few); one launch instead of torch's cast /
softmax / sort / gather / renormalise kernels. `_topk_softmax` and `_pair_expert` are also the
routing the pairs path's up GEMV runs itself (pairs.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..device import DeviceInfo, device_info
from ..pdl import pdl_launch, pdl_wait


@triton.jit
def _topk_softmax(
    logits, t, t_ok, num_experts, s_lt, TOPK: tl.constexpr, TOPK_P: tl.constexpr, RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """(weights, ids) [BLOCK_T, TOPK_P] of tokens t: the top-k of softmax(logits[t]) in float32,
    descending, ties to the lower expert; padding slots hold 0. Selection runs on the logits
    (softmax is monotonic), one argmax-and-mask round per slot."""
    e = tl.arange(0, BLOCK_E)
    e_ok = e < num_experts
    x = tl.load(logits + t.to(tl.int64)[:, None] * s_lt + e[None, :], mask=t_ok[:, None] & e_ok[None, :], other=0.0)
    x = tl.where(e_ok[None, :], x.to(tl.float32), float("-inf"))
    m = tl.max(x, 1)
    denom = tl.sum(tl.exp(x - m[:, None]), 1)
    slots = tl.arange(0, TOPK_P)
    top_w = tl.zeros([BLOCK_T, TOPK_P], tl.float32)
    top_i = tl.zeros([BLOCK_T, TOPK_P], tl.int32)
    for j in tl.static_range(TOPK):
        v, i = tl.max(x, 1, return_indices=True, return_indices_tie_break_left=True)
        p = tl.exp(v - m) / denom
        top_w = tl.where(slots[None, :] == j, p[:, None], top_w)
        top_i = tl.where(slots[None, :] == j, i[:, None], top_i)
        x = tl.where(e[None, :] == i[:, None], float("-inf"), x)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, 1)[:, None]  # padding slots hold 0
    return top_w, top_i


@triton.jit
def _pair_expert(logits, t, slot, num_experts, s_lt, BLOCK_E: tl.constexpr):
    """The expert of token t's top-k slot `slot`: the argmax-and-mask rounds of _topk_softmax (the
    same float32 values and tie rule, so the same expert), only as many as the slot needs."""
    e = tl.arange(0, BLOCK_E)
    e_ok = e < num_experts
    x = tl.load(logits + t.to(tl.int64) * s_lt + e, mask=e_ok, other=0.0)
    x = tl.where(e_ok, x.to(tl.float32), float("-inf"))
    for _ in range(0, slot):
        _, i = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
        x = tl.where(e == i, float("-inf"), x)
    _, i = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
    return i


# values that change from pass to pass: one compile serves them all (kernels/__init__.py)
@triton.jit(do_not_specialize=["num_tokens"])
def _router_kernel(
    logits, weights, ids, num_tokens, num_experts, s_lt, TOPK: tl.constexpr, TOPK_P: tl.constexpr,
    RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """weights[t], ids[t] = top-k of softmax(logits[t]) in float32, descending; among equal values the
    lower expert index comes first. Selection runs on the logits (softmax is monotonic), one
    argmax-and-mask round per slot."""
    pdl_wait(USE_PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < num_tokens
    top_w, top_i = _topk_softmax(logits, t, t_ok, num_experts, s_lt, TOPK, TOPK_P, RENORMALIZE, BLOCK_T, BLOCK_E)
    slots = tl.arange(0, TOPK_P)
    dst = t.to(tl.int64)[:, None] * TOPK + slots[None, :]
    ok = t_ok[:, None] & (slots[None, :] < TOPK)
    tl.store(weights + dst, top_w, mask=ok)
    tl.store(ids + dst, top_i.to(tl.int64), mask=ok)


def route_topk_softmax(*, router_logits, top_k, renormalize, config=None, pdl=True):
    """moe.route_topk_softmax in one launch, no host sync. `config` (block_t, num_warps) overrides
    the choice made from the shapes."""
    num_tokens, num_experts = router_logits.shape
    assert 0 < top_k <= num_experts, "top_k must be in 1..num_experts"
    if router_logits.stride(-1) != 1:
        router_logits = router_logits.contiguous()
    device = router_logits.device
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int64, device=device)
    if num_tokens == 0:
        return weights, ids
    cfg = config or router_config(num_tokens, device_info(device))
    _router_kernel[(triton.cdiv(num_tokens, cfg["block_t"]),)](
        router_logits, weights, ids, num_tokens, num_experts, router_logits.stride(0), TOPK=top_k,
        TOPK_P=triton.next_power_of_2(top_k), RENORMALIZE=renormalize, BLOCK_T=cfg["block_t"],
        BLOCK_E=triton.next_power_of_2(num_experts), num_warps=cfg["num_warps"], **pdl_launch(router_logits, pdl),
    )  # fmt: skip
    return weights, ids


def router_config(num_tokens: int, info: DeviceInfo) -> dict:
    """One token a one-warp program at every size: the k rounds of argmax stay within a warp, and a
    token's weights are the same bits whatever the pass's size (registers only: right on any GPU).
    H100, `bench kernels_moe --sweep --kernel routing`: 8k tokens 11.7 us against 29.7 for 4 tokens a
    4-warp program (2 a warp: 11.6; 16 a 4-warp program: 51.6), 2k 4.2 against 9.6."""
    if info.is_interpreter:
        return dict(block_t=min(16, triton.next_power_of_2(num_tokens)), num_warps=4)
    return dict(block_t=1, num_warps=1)
