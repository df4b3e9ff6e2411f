"""The decode kernel with the q/k norm + partial rotary embedding folded in (DecodeRope): against
the rope op followed by the plain decode (the reference), the attention output and the cache after
the call (the new token's K and V written at its slot, every other position untouched, a slot of
-1 writing nothing), for one or several spans, partial and full rotation, both paths; interpreted
on CPU without CUDA, compiled with it; the layer's decode-only pass takes it (and its knob turns it off)."""

import pytest
import torch
from test_kernels_attention import decode_batch, rel_err, tol

from deltaserve.layers.kernels import rotary as rotary_kernels
from deltaserve.layers.kernels.attention import DecodeRope, naive
from deltaserve.layers.kernels.attention import triton_attention as ta

pytestmark = pytest.mark.usefixtures("nan_fill")


def rope_inputs(batch, *, rotary_dim, seed=11, padding_row=None):
    """Raw q / k / v projections as strided views of one [N, q | k | v] row, norm weights, the
    positions (seq_len - 1) and the slots the block tables give (padding_row: slot -1)."""
    n, hq, d = batch["q"].shape
    hkv = batch["k_cache"].shape[2]
    block_size = batch["k_cache"].shape[1]
    g = torch.Generator().manual_seed(seed)
    device = batch["q"].device
    proj = torch.randn(n, (hq + 2 * hkv) * d, generator=g).to(device)
    q = proj[:, : hq * d].view(n, hq, d)
    k = proj[:, hq * d : (hq + hkv) * d].view(n, hkv, d)
    v = proj[:, (hq + hkv) * d :].view(n, hkv, d)
    positions = (batch["seq_lens"] - 1).long()
    pages = batch["block_tables"].long().gather(1, (positions // block_size)[:, None])[:, 0]
    slots = pages * block_size + positions % block_size
    if padding_row is not None:
        slots[padding_row] = -1
    rope = DecodeRope(
        k=k,
        v=v,
        q_weight=(0.1 * torch.randn(d, generator=g)).to(device),
        k_weight=(0.1 * torch.randn(d, generator=g)).to(device),
        positions=positions,
        slot_mapping=slots,
        eps=1e-6,
        rotary_dim=rotary_dim,
        theta=10000.0,
    )
    return q, rope


def reference(batch, q, rope, scale):
    """The rope op writing the cache, then the plain decode over it."""
    k_cache, v_cache = batch["k_cache"].clone(), batch["v_cache"].clone()
    q_roped, _ = rotary_kernels.naive.qk_norm_rope(
        q=q, k=rope.k, q_weight=rope.q_weight, k_weight=rope.k_weight, positions=rope.positions, eps=rope.eps,
        rotary_dim=rope.rotary_dim, theta=rope.theta,
        kv_cache=rotary_kernels.KvCacheWrite(rope.v, k_cache, v_cache, rope.slot_mapping),
    )  # fmt: skip
    args = {**batch, "q": q_roped, "k_cache": k_cache, "v_cache": v_cache}
    return naive.paged_decode_attention(**args, scale=scale), k_cache, v_cache


@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.parametrize("rotary_dim", [6, 24])
@pytest.mark.parametrize("path", ["reduce", "fused"])
def test_folded_rope_is_rope_then_decode(device, num_splits, rotary_dim, path):
    batch = decode_batch([0, 5, 17, 40], hq=8, hkv=2, d=24, block_size=4, seed=num_splits, device=device)
    q, rope = rope_inputs(batch, rotary_dim=rotary_dim)
    want, want_k, want_v = reference(batch, q, rope, scale=0.2)
    cfg = dict(block_n=16, num_splits=num_splits, num_warps=4, num_stages=1)
    got = ta.paged_decode_attention(**{**batch, "q": q}, scale=0.2, config=cfg, path=path, rope=rope)
    assert rel_err(got, want) < tol(device)
    # the new tokens' K and V at their slots (one rounding on the GPU's sum order); the rest untouched
    assert torch.allclose(batch["k_cache"], want_k, atol=1e-5, rtol=1e-5)
    assert torch.equal(batch["v_cache"], want_v)


def test_padding_slot_writes_nothing(device):
    batch = decode_batch([3, 9], hq=4, hkv=2, d=16, block_size=4, seed=2, device=device)
    q, rope = rope_inputs(batch, rotary_dim=8, padding_row=0)
    before_k = batch["k_cache"].clone()
    want, want_k, _ = reference(batch, q, rope, scale=0.3)
    got = ta.paged_decode_attention(**{**batch, "q": q}, scale=0.3, rope=rope)
    assert torch.allclose(batch["k_cache"], want_k, atol=1e-5, rtol=1e-5)
    # row 0's new position (seq_len - 1) keeps what the cache held
    page = batch["block_tables"][0, 3 // 4].item()
    assert torch.equal(batch["k_cache"][page, 3], before_k[page, 3])
    assert rel_err(got[1], want[1]) < tol(device)


def test_naive_op_takes_rope(device):
    """The op's plain-torch form with rope is the rope op then the decode, cache writes included."""
    batch = decode_batch([2, 6], hq=4, hkv=2, d=16, block_size=4, seed=4, device=device)
    q, rope = rope_inputs(batch, rotary_dim=16)
    want, want_k, want_v = reference(batch, q, rope, scale=0.3)
    got = naive.paged_decode_attention(**{**batch, "q": q}, scale=0.3, rope=rope)
    assert torch.equal(got, want) and torch.equal(batch["k_cache"], want_k) and torch.equal(batch["v_cache"], want_v)


@pytest.mark.gpu
def test_gpu_folded_rope_bf16_model_shape():
    """bf16 at the model's attention shape (16 q heads, 2 kv heads, D 256, rotary 64), 512 tokens:
    the fold against the rope kernel then the decode kernel (both compiled)."""
    torch.manual_seed(0)
    batch = decode_batch([511, 90, 1000], hq=16, hkv=2, d=256, block_size=16, seed=1, device="cuda")
    batch = {key: (t.bfloat16() if t.is_floating_point() else t) for key, t in batch.items()}
    q, rope = rope_inputs(batch, rotary_dim=64)
    q = q.bfloat16()
    rope = rope._replace(k=rope.k.bfloat16(), v=rope.v.bfloat16(), q_weight=rope.q_weight.bfloat16(),
                         k_weight=rope.k_weight.bfloat16())  # fmt: skip
    k_cache, v_cache = batch["k_cache"].clone(), batch["v_cache"].clone()
    q_roped, _ = rotary_kernels.qk_norm_rope(
        q=q, k=rope.k, q_weight=rope.q_weight, k_weight=rope.k_weight, positions=rope.positions, eps=rope.eps,
        rotary_dim=rope.rotary_dim, theta=rope.theta,
        kv_cache=rotary_kernels.KvCacheWrite(rope.v, k_cache, v_cache, rope.slot_mapping),
    )  # fmt: skip
    want = ta.paged_decode_attention(**{**batch, "q": q_roped, "k_cache": k_cache, "v_cache": v_cache}, scale=0.0625)
    got = ta.paged_decode_attention(**{**batch, "q": q}, scale=0.0625, rope=rope)
    assert rel_err(got, want) < 1e-2
    assert (batch["k_cache"].float() - k_cache.float()).abs().max() <= 2 * 2**-8 * k_cache.float().abs().max()
    assert torch.equal(batch["v_cache"], v_cache)
