"""Triton q/k head norm + partial rotary embedding in one launch for q and k, optionally
writing the finished k and the value into the paged KV cache in the same launch.

One program per (token, head) over q's heads then k's (then v's, when it writes the cache): it
loads the head vector once (plus the rotation partners, from L1), normalises in float32, rotates
the first rotary_dim features with cos/sin computed from the position in registers, and writes
the result. This replaces two norm
launches and about twenty elementwise launches per attention layer in a decode step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..attention.triton_attention import is_fp8_cache, to_cache
from ..pdl import pdl_launch, pdl_wait


# values that change from pass to pass: one compile serves them all (kernels/__init__.py)
@triton.jit(do_not_specialize=["POS", "SLOTS"])
def _qk_norm_rope_kernel(
    Q, K, Q_OUT, K_OUT, QW, KW, POS, INV_FREQ, q_stride_t, q_stride_h, k_stride_t, k_stride_h, num_q_heads, num_k_heads,
    eps, V, K_CACHE, V_CACHE, SLOTS, v_stride_t, v_stride_h, s_kcb, s_kco, s_kch, s_vcb, s_vco, s_vch, D: tl.constexpr,
    ROT: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, WRITE_KV: tl.constexpr, KV_FP8: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(USE_PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    is_q = h < num_q_heads
    offs = tl.arange(0, BLOCK_D)
    in_dim = offs < D
    if WRITE_KV:
        slot = tl.load(SLOTS + t).to(tl.int64)
        # a slot of -1 is padding: an empty feature range masks every lane
        in_cache = offs < tl.where(slot >= 0, D, 0)
        page, off = slot // PAGE, slot % PAGE
        if h >= num_q_heads + num_k_heads:  # the value heads: a copy into the cache
            vh = h - num_q_heads - num_k_heads
            v = tl.load(V + t * v_stride_t + vh * v_stride_h + offs, mask=in_cache)
            v_dst = V_CACHE + page * s_vcb + off * s_vco + vh * s_vch + offs
            tl.store(v_dst, to_cache(v, KV_FP8).to(V_CACHE.dtype.element_ty), mask=in_cache)
            return
    half = ROT // 2
    # the rotation partner of feature i: i + half in the first half, i - half in the second
    partner = tl.where(offs < half, offs + half, tl.where(offs < ROT, offs - half, offs))
    if is_q:
        src = Q + t * q_stride_t + h * q_stride_h
        dst = Q_OUT + (t * num_q_heads + h) * D
        w_ptr = QW
    else:
        kh = h - num_q_heads
        src = K + t * k_stride_t + kh * k_stride_h
        dst = K_OUT + (t * num_k_heads + kh) * D
        w_ptr = KW
    x = tl.load(src + offs, mask=in_dim, other=0.0).to(tl.float32)
    xp = tl.load(src + partner, mask=in_dim, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=in_dim, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + partner, mask=in_dim, other=0.0).to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    y = x * inv_rms * (1.0 + w)
    yp = xp * inv_rms * (1.0 + wp)
    pos = tl.load(POS + t).to(tl.float32)
    i = tl.where(offs < half, offs, offs - half)
    # the host's float32 inverse frequencies: the same angles (pos * inv_freq) transformers computes
    inv_freq = tl.load(INV_FREQ + i, mask=offs < ROT, other=0.0)
    angle = pos * inv_freq
    c, s = tl.cos(angle), tl.sin(angle)
    rotated = tl.where(offs < half, y * c - yp * s, y * c + yp * s)
    out = tl.where(offs < ROT, rotated, y).to(dst.dtype.element_ty)
    tl.store(dst + offs, out, mask=in_dim)
    if WRITE_KV and not is_q:
        k_dst = K_CACHE + page * s_kcb + off * s_kco + (h - num_q_heads) * s_kch + offs
        tl.store(k_dst, to_cache(out, KV_FP8).to(K_CACHE.dtype.element_ty), mask=in_cache)


_INV_FREQ: dict[tuple, torch.Tensor] = {}


def _inv_freq(rotary_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """1 / theta ** (2i / rotary_dim) in float32, computed once per (dim, theta, device)."""
    key = (rotary_dim, theta, str(device))
    if key not in _INV_FREQ:
        exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim
        _INV_FREQ[key] = 1.0 / (theta**exponent)
    return _INV_FREQ[key]


def qk_norm_rope(*, q, k, q_weight, k_weight, positions, eps, rotary_dim, theta, kv_cache=None, pdl=True):
    """rotary.qk_norm_rope in one launch (D contiguous in q, k and the kv_cache tensors)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    assert q.stride(2) == 1 and k.stride(2) == 1, "head dim must be contiguous"
    assert rotary_dim % 2 == 0 and rotary_dim <= head_dim
    q_out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((num_tokens, num_k_heads, head_dim), dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    if kv_cache is not None:
        value, k_cache, v_cache, slots = kv_cache
        assert value.stride(2) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "contiguous head dim"
        cache_args = (value, k_cache, v_cache, slots, value.stride(0), value.stride(1))
        cache_args += (*k_cache.stride()[:3], *v_cache.stride()[:3])
        page = k_cache.shape[1]
    else:
        cache_args, page = (q, q, q, positions, 0, 0, 0, 0, 0, 0, 0, 0), 1
    kv_fp8 = kv_cache is not None and is_fp8_cache(kv_cache.k_cache)
    heads = num_q_heads + num_k_heads * (2 if kv_cache is not None else 1)
    _qk_norm_rope_kernel[(num_tokens, heads)](
        q, k, q_out, k_out, q_weight, k_weight, positions, _inv_freq(rotary_dim, theta, q.device), q.stride(0),
        q.stride(1), k.stride(0), k.stride(1), num_q_heads, num_k_heads, eps, *cache_args, D=head_dim, ROT=rotary_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), PAGE=page, WRITE_KV=kv_cache is not None, KV_FP8=kv_fp8,
        num_warps=1 if head_dim <= 128 else 2, **pdl_launch(q, pdl),
    )  # fmt: skip
    return q_out, k_out
