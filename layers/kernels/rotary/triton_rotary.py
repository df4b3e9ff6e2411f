"""Triton q/k head norm + partial rotary embedding in one launch for q and k, optionally
writing the finished k and the value into the paged KV cache in the same launch.

One program per (block of tokens, head) over q's heads then k's (then v's, when it writes the
cache; a token a program in decode, PREFILL_BLOCK_T at prefill sizes): it loads the head vectors
once (and the rotated features' two halves again, from L1), normalises in float32, rotates the first
rotary_dim features with cos / sin of the positions computed in registers over rotary_dim / 2
columns, and writes the result. This
replaces two norm launches and about twenty elementwise launches per attention layer in a decode
step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..attention.triton_attention import is_fp8_cache, to_cache
from ..pdl import pdl_launch, pdl_wait


# values that change from pass to pass: one compile serves them all (kernels/__init__.py)
@triton.jit(do_not_specialize=["POS", "SLOTS", "num_tokens"])
def _qk_norm_rope_kernel(
    Q, K, Q_OUT, K_OUT, QW, KW, POS, INV_FREQ, q_stride_t, q_stride_h, k_stride_t, k_stride_h, num_q_heads, num_k_heads,
    eps, V, K_CACHE, V_CACHE, SLOTS, v_stride_t, v_stride_h, s_kcb, s_kco, s_kch, s_vcb, s_vco, s_vch, num_tokens,
    D: tl.constexpr, ROT: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_T: tl.constexpr,
    PAGE: tl.constexpr,
    WRITE_KV: tl.constexpr, KV_FP8: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(USE_PDL)
    # int64: a row times the qkv projection's stride passes 2^31 from ~233k tokens a pass
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    h = tl.program_id(1)
    t_ok = t < num_tokens
    is_q = h < num_q_heads
    offs = tl.arange(0, BLOCK_D)
    in_dim = offs < D
    ok = t_ok[:, None] & in_dim[None, :]
    if WRITE_KV:
        slot = tl.load(SLOTS + t, mask=t_ok, other=-1).to(tl.int64)
        # a slot of -1 is padding: nothing of its row is written
        in_cache = ok & (slot >= 0)[:, None]
        page, off = slot // PAGE, slot % PAGE
        if h >= num_q_heads + num_k_heads:  # the value heads: a copy into the cache
            vh = h - num_q_heads - num_k_heads
            v = tl.load(V + t[:, None] * v_stride_t + vh * v_stride_h + offs[None, :], mask=in_cache)
            v_dst = V_CACHE + page[:, None] * s_vcb + off[:, None] * s_vco + vh * s_vch + offs[None, :]
            tl.store(v_dst, to_cache(v, KV_FP8).to(V_CACHE.dtype.element_ty), mask=in_cache)
            return
    if is_q:
        src = Q + t[:, None] * q_stride_t + h * q_stride_h
        dst = Q_OUT + (t[:, None] * num_q_heads + h) * D
        w_ptr = QW
    else:
        kh = h - num_q_heads
        src = K + t[:, None] * k_stride_t + kh * k_stride_h
        dst = K_OUT + (t[:, None] * num_k_heads + kh) * D
        w_ptr = KW
    x = tl.load(src + offs[None, :], mask=ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=in_dim, other=0.0).to(tl.float32)
    inv_rms = (1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps))[:, None]
    y = x * inv_rms * (1.0 + w)[None, :]
    # the rotated features as their two halves (reloaded from L1): the angles only over ROT / 2
    # columns, not every column of the head (precise cos / sin cost more than the row's bytes)
    half: tl.constexpr = ROT // 2
    j = tl.arange(0, BLOCK_HALF)
    j_ok = t_ok[:, None] & (j < half)[None, :]
    y1 = tl.load(src + j[None, :], mask=j_ok, other=0.0).to(tl.float32) * inv_rms
    y2 = tl.load(src + half + j[None, :], mask=j_ok, other=0.0).to(tl.float32) * inv_rms
    y1 = y1 * (1.0 + tl.load(w_ptr + j, mask=j < half, other=0.0).to(tl.float32))[None, :]
    y2 = y2 * (1.0 + tl.load(w_ptr + half + j, mask=j < half, other=0.0).to(tl.float32))[None, :]
    pos = tl.load(POS + t, mask=t_ok, other=0).to(tl.float32)
    # the host's float32 inverse frequencies: the same angles (pos * inv_freq) transformers computes
    inv_freq = tl.load(INV_FREQ + j, mask=j < half, other=0.0)
    angle = pos[:, None] * inv_freq[None, :]
    c, s = tl.cos(angle), tl.sin(angle)
    out1 = (y1 * c - y2 * s).to(dst.dtype.element_ty)
    out2 = (y2 * c + y1 * s).to(dst.dtype.element_ty)
    rest = ok & (offs >= ROT)[None, :]
    tl.store(dst + offs[None, :], y.to(dst.dtype.element_ty), mask=rest)
    tl.store(dst + j[None, :], out1, mask=j_ok)
    tl.store(dst + half + j[None, :], out2, mask=j_ok)
    if WRITE_KV and not is_q:
        k_dst = K_CACHE + page[:, None] * s_kcb + off[:, None] * s_kco + (h - num_q_heads) * s_kch
        kind = K_CACHE.dtype.element_ty
        tl.store(k_dst + offs[None, :], to_cache(y.to(dst.dtype.element_ty), KV_FP8).to(kind), mask=rest & in_cache)
        cache_j = j_ok & (slot >= 0)[:, None]
        tl.store(k_dst + j[None, :], to_cache(out1, KV_FP8).to(kind), mask=cache_j)
        tl.store(k_dst + half + j[None, :], to_cache(out2, KV_FP8).to(kind), mask=cache_j)


# tokens a program at prefill sizes: one (token, head) a program left a 8k pass 164k programs of 512
# bytes, 199 us a layer on the H200 against ~40 us for its bytes; decode keeps one token a program
PREFILL_BLOCK_T = 8
PREFILL_MIN_TOKENS = 64


_INV_FREQ: dict[tuple, torch.Tensor] = {}


def _inv_freq(rotary_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """1 / theta ** (2i / rotary_dim) in float32, computed once per (dim, theta, device)."""
    key = (rotary_dim, theta, str(device))
    if key not in _INV_FREQ:
        exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim
        _INV_FREQ[key] = 1.0 / (theta**exponent)
    return _INV_FREQ[key]


def qk_norm_rope(
    *, q, k, q_weight, k_weight, positions, eps, rotary_dim, theta, kv_cache=None, pdl=True, block_t=None
):  # fmt: skip
    """rotary.qk_norm_rope in one launch (D contiguous in q, k and the kv_cache tensors). block_t:
    tokens a program (None: PREFILL_BLOCK_T from PREFILL_MIN_TOKENS tokens, else one)."""
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
    if block_t is None:
        block_t = PREFILL_BLOCK_T if num_tokens >= PREFILL_MIN_TOKENS else 1
    assert block_t & (block_t - 1) == 0, "block_t: a power of two"
    block_d = triton.next_power_of_2(head_dim)
    warps = max(1 if head_dim <= 128 else 2, min(8, block_t * block_d // 512))
    _qk_norm_rope_kernel[(triton.cdiv(num_tokens, block_t), heads)](
        q, k, q_out, k_out, q_weight, k_weight, positions, _inv_freq(rotary_dim, theta, q.device), q.stride(0),
        q.stride(1), k.stride(0), k.stride(1), num_q_heads, num_k_heads, eps, *cache_args, num_tokens, D=head_dim,
        ROT=rotary_dim, BLOCK_D=block_d, BLOCK_HALF=triton.next_power_of_2(max(1, rotary_dim // 2)), BLOCK_T=block_t,
        PAGE=page, WRITE_KV=kv_cache is not None, KV_FP8=kv_fp8,
        num_warps=warps, **pdl_launch(q, pdl),
    )  # fmt: skip
    return q_out, k_out
