"""L2 prefetch of the next kernels' weights (layers/kernels/prefetch.py): the share arithmetic
covers each range exactly once (run by the interpreter), the launch arguments, and on the GPU the
PTX carries the prefetch while the decode kernels that issue it give the same bits as without."""

import pytest
import torch
import triton
import triton.language as tl

from deltaserve.layers.kernels.prefetch import (
    GRANULE,
    prefetch_args,
    prefetch_mode,
    prefetch_ranges,
    prefix_bytes,
    thread_chunks,
)


@triton.jit
def _chunks_kernel(first_out, count_out, granules, THREADS: tl.constexpr):
    part = tl.program_id(0)
    first, count, per_thread, end = thread_chunks(granules, part, tl.num_programs(0), THREADS)
    t = tl.arange(0, THREADS)
    tl.store(first_out + part * THREADS + t, first)
    tl.store(count_out + part * THREADS + t, count)


@pytest.mark.parametrize(
    "granules,parts,threads", [(1, 1, 32), (5, 3, 32), (1000, 7, 64), (1037, 128, 128), (3, 8, 32)]
)
def test_shares_cover_the_range_once(granules, parts, threads):
    first = torch.full((parts, threads), -1, dtype=torch.int64)
    count = torch.full((parts, threads), -1, dtype=torch.int64)
    _chunks_kernel[(parts,)](first, count, granules, THREADS=threads)
    covered = torch.zeros(granules, dtype=torch.int64)
    for f, c in zip(first.flatten().tolist(), count.flatten().tolist(), strict=True):
        if c > 0:
            covered[f : f + c] += 1
    assert covered.tolist() == [1] * granules


def test_launch_arguments_on_cpu_and_their_errors(monkeypatch):
    x = torch.zeros(4)
    w = torch.zeros(1000, dtype=torch.int8)
    args = prefetch_args([w], x, num_warps=4)
    assert args["PREFETCH"] == 0  # the interpreter has no inline PTX
    assert args["pf_a_granules"] == 1000 // GRANULE and args["pf_b_granules"] == 0
    assert args["PF_THREADS"] == 128
    assert prefetch_args([], x, num_warps=2)["PREFETCH"] == 0
    with pytest.raises(AssertionError, match="at most two"):
        prefetch_args([w, w, w], x, num_warps=4)
    with pytest.raises(AssertionError, match="contiguous"):
        prefetch_args([torch.zeros(8, 8).t()], x, num_warps=4)
    monkeypatch.setenv("DELTASERVE_L2_PREFETCH", "sometimes")
    with pytest.raises(ValueError, match="DELTASERVE_L2_PREFETCH"):
        prefetch_mode(x)


def test_prefix_bytes_takes_whole_leading_rows():
    w = torch.zeros(100, 64, dtype=torch.bfloat16)  # 128 bytes a row
    assert prefix_bytes(w, 1000).shape == (7, 64)
    assert prefix_bytes(w, 10**9).shape == (100, 64)
    assert prefix_bytes(w, 0).numel() == 0
    assert prefix_bytes(w, 1000).data_ptr() == w.data_ptr()


@triton.jit
def _prefetch_kernel(out, pf_a, pf_a_granules, pf_b, pf_b_granules, PREFETCH: tl.constexpr, PF_THREADS: tl.constexpr):
    part, parts = tl.program_id(0), tl.num_programs(0)
    prefetch_ranges(pf_a, pf_a_granules, pf_b, pf_b_granules, part, parts, PREFETCH, PF_THREADS)
    tl.store(out + tl.program_id(0), tl.program_id(0))


@pytest.mark.gpu
@pytest.mark.parametrize("mode,instruction", [("bulk", "cp.async.bulk.prefetch.L2"), ("lines", "prefetch.global.L2")])
def test_gpu_prefetch_compiles_to_its_instruction_and_runs(monkeypatch, mode, instruction):
    monkeypatch.setenv("DELTASERVE_L2_PREFETCH", mode)
    weights = [torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16), torch.randn(1288, 2048, device="cuda")]
    out = torch.full((64,), -1, dtype=torch.int32, device="cuda")
    handle = _prefetch_kernel[(64,)](out, **prefetch_args(weights, out, num_warps=4), num_warps=4)
    torch.cuda.synchronize()
    assert instruction in handle.asm["ptx"]
    assert out.tolist() == list(range(64))


def _decode_kernels(prefetch):
    """The four kernels that issue prefetches, on fresh copies of their state, with `prefetch`."""
    from deltaserve.layers.kernels import attention as attn_kernels
    from deltaserve.layers.kernels import conv1d as conv_kernels
    from deltaserve.layers.kernels import gdn as gdn_kernels
    from deltaserve.layers.kernels import moe as moe_kernels

    g = torch.Generator(device="cuda").manual_seed(0)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    n, hk, hv, k, v, w = 3, 2, 4, 32, 32, 4
    channels = 2 * hk * k + hv * v
    slots = torch.tensor([2, 0, 5], device="cuda", dtype=torch.int32)
    gdn = gdn_kernels.fused_gdn_decode(
        mixed_qkv=torch.randn(n, channels, generator=g, **bf),
        z=torch.randn(n, hv, v, generator=g, **bf),
        a=torch.randn(n, hv, generator=g, **bf),
        b=torch.randn(n, hv, generator=g, **bf),
        conv_weight=torch.randn(channels, w, generator=g, **bf),
        conv_state_pool=torch.randn(6, channels, w - 1, generator=g, **bf),
        A_log=torch.randn(hv, generator=g, device="cuda"),
        dt_bias=torch.randn(hv, generator=g, device="cuda"),
        state_pool=torch.randn(6, hv, k, v, generator=g, device="cuda"),
        state_slots=slots,
        norm_weight=torch.randn(v, generator=g, **bf),
        eps=1e-6,
        prefetch=prefetch,
    )
    conv = conv_kernels.causal_conv1d_update(
        x=torch.randn(n, channels, generator=g, **bf),
        weight=torch.randn(channels, w, generator=g, **bf),
        bias=None,
        conv_state_pool=torch.randn(6, channels, w - 1, generator=g, **bf),
        state_slots=slots,
        prefetch=prefetch,
    )
    page, heads, kv_heads, d = 16, 4, 2, 64
    attn = attn_kernels.paged_decode_attention(
        q=torch.randn(n, heads, d, generator=g, **bf),
        k_cache=torch.randn(12, page, kv_heads, d, generator=g, **bf),
        v_cache=torch.randn(12, page, kv_heads, d, generator=g, **bf),
        seq_lens=torch.tensor([5, 40, 17], device="cuda", dtype=torch.int32),
        block_tables=torch.arange(12, device="cuda", dtype=torch.int32).view(3, 4),
        scale=d**-0.5,
        output_gate=torch.randn(n, heads, d, generator=g, **bf),
        prefetch=prefetch,
    )
    hidden, experts, inter, top_k = 256, 16, 64, 4
    logits = torch.randn(n, experts, generator=g, device="cuda")
    weights, ids = moe_kernels.route_topk_softmax(router_logits=logits, top_k=top_k, renormalize=True)
    moe = moe_kernels.fused_moe(
        hidden=torch.randn(n, hidden, generator=g, **bf),
        w13=torch.randn(experts, 2 * inter, hidden, generator=g, **bf) * hidden**-0.5,
        w2=torch.randn(experts, hidden, inter, generator=g, **bf) * inter**-0.5,
        topk_weights=weights,
        topk_ids=ids,
        path="pairs",
        prefetch=prefetch,
    )
    return [gdn, conv, attn, moe]


@pytest.mark.gpu
def test_gpu_decode_kernels_give_the_same_bits_with_prefetch(monkeypatch):
    weights = (torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16), torch.randn(1288, 2048, device="cuda"))
    monkeypatch.setenv("DELTASERVE_L2_PREFETCH", "0")
    reference = _decode_kernels(())
    for mode in ("bulk", "lines"):
        monkeypatch.setenv("DELTASERVE_L2_PREFETCH", mode)
        outs = _decode_kernels(weights)
        torch.cuda.synchronize()
        for ref, out in zip(reference, outs, strict=True):
            assert not out.isnan().any()
            assert torch.equal(ref, out), mode
