"""The prefill kernel choices (KernelOptions: prefill_attention, moe_sorted_block_m,
fp8_activations, gdn_chunk_variant) that `bench offline --variants` A/Bs on the GPU: each reaches its op, and the
SDPA prefill attention gives the paged kernel's logits where it applies (one sequence's chunk: the
whole prompt, or a chunk after cached tokens over its keys copied out of the pages) and stays out
where it does not (several sequences)."""

from __future__ import annotations

import pytest
import torch
from passes import Sequences

from deltaserve.layers.kernels import attention as attn_kernels
from deltaserve.layers.kernels import gdn as gdn_kernels
from deltaserve.layers.kernels import moe as moe_kernels
from deltaserve.layers.kernels.attention import naive as attn_naive
from deltaserve.layers.kernels.device import H200, DeviceInfo
from deltaserve.layers.kernels.moe.tiles import sorted_config
from deltaserve.layers.kernels.options import KernelOptions
from deltaserve.layers.loader import load_model

SDPA = KernelOptions(prefill_attention="sdpa")


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def moe_model(tiny_checkpoints):
    return load_model(tiny_checkpoints["qwen3_5_moe"][0])


def test_sdpa_prefill_attention_matches_paged(moe_model, monkeypatch):
    """A whole prompt in one pass takes SDPA over its own keys, its next chunk (37 tokens cached
    before it) SDPA over all 48 keys out of the pages (counted), and both give the paged kernel's
    logits; a two-sequence pass does not take it."""
    taken = []
    real = attn_naive.causal_sdpa
    monkeypatch.setattr(
        attn_naive, "causal_sdpa", lambda **kw: taken.append((kw["q"].shape[0], kw["k"].shape[0])) or real(**kw)
    )
    ids = _prompt(48, 1)
    logits = {}
    for name, opts in (("paged", KernelOptions(prefill_attention="paged")), ("sdpa", SDPA)):
        seqs = Sequences(moe_model, kernels=opts)
        for seq in "abc":
            seqs.add(seq)
        whole = seqs.run([("a", ids[:37])])[0]
        after = seqs.run([("a", ids[37:])])[0]
        both = seqs.run([("b", ids[:5]), ("c", ids[:20])])
        logits[name] = (whole, after, *both)
    assert taken == [(37, 37), (37, 37), (11, 48), (11, 48)]  # two attention layers a pass
    for got, want in zip(logits["sdpa"], logits["paged"], strict=True):
        assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def test_auto_prefill_attention_takes_sdpa_for_long_chunks(moe_model, monkeypatch):
    """The default ("auto"): SDPA for a one-sequence chunk of SDPA_MIN_QUERIES queries or more over at
    most SDPA_MAX_KEYS keys (here 20 and 50), the paged kernel otherwise."""
    from deltaserve.layers import attention as attention_layer

    monkeypatch.setattr(attention_layer, "SDPA_MIN_QUERIES", 20)
    monkeypatch.setattr(attention_layer, "SDPA_MAX_KEYS", 50)
    taken = []
    real = attn_naive.causal_sdpa
    monkeypatch.setattr(
        attn_naive, "causal_sdpa", lambda **kw: taken.append((kw["q"].shape[0], kw["k"].shape[0])) or real(**kw)
    )
    assert KernelOptions().prefill_attention == "auto"
    seqs = Sequences(moe_model)
    for seq in "ab":
        seqs.add(seq)
    ids = _prompt(60, 3)
    seqs.run([("a", ids[:19])])  # too few queries
    seqs.run([("a", ids[19:40])])  # 21 queries over 40 keys
    seqs.run([("a", ids[40:])])  # 20 queries over 60 keys: too many keys
    seqs.run([("b", ids[:30])])
    assert taken == [(21, 40), (21, 40), (30, 30), (30, 30)]


def test_causal_sdpa_is_causal_grouped_attention():
    """causal_sdpa against the paged reference over the same keys written to pages."""
    g = torch.Generator().manual_seed(0)
    t, hq, hkv, d, page = 21, 6, 2, 16, 4
    q, k, v = (torch.randn(t, h, d, generator=g) for h in (hq, hkv, hkv))
    pages = -(-t // page)
    k_cache = torch.zeros(pages, page, hkv, d)
    v_cache = torch.zeros(pages, page, hkv, d)
    k_cache.view(-1, hkv, d)[:t], v_cache.view(-1, hkv, d)[:t] = k, v
    ref = attn_naive.paged_attention(
        q=q, k_cache=k_cache, v_cache=v_cache, cu_seqlens_q=torch.tensor([0, t]), seq_lens=torch.tensor([t]),
        block_tables=torch.arange(pages)[None], scale=d**-0.5,
    )  # fmt: skip
    out = attn_naive.causal_sdpa(q=q, k=k, v=v, scale=d**-0.5)
    assert (out - ref).abs().max().item() < 1e-5
    # the last 9 queries over all 21 keys (12 cached before them), the keys copied out of shuffled pages
    order = torch.randperm(pages, generator=g)
    k_shuf, v_shuf = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    k_shuf[order], v_shuf[order] = k_cache, v_cache
    kk, vv = attn_naive.sequence_kv(k_cache=k_shuf, v_cache=v_shuf, block_table=order.int(), length=t)
    assert torch.equal(kk, k) and torch.equal(vv, v)
    tail = attn_naive.causal_sdpa(q=q[12:], k=kk, v=vv, scale=d**-0.5)
    assert (tail - ref[12:]).abs().max().item() < 1e-5


def test_prefill_options_reach_their_ops(moe_model, monkeypatch):
    seen = {}
    for module, name, key in (
        (moe_kernels, "routed_moe", "sorted_block_m"),
        (moe_kernels, "routed_moe", "fp8_quantize_acts"),
        (moe_kernels, "routed_moe", "prefill_gemm"),
        (moe_kernels, "routed_moe", "sorted_persistent"),
        (gdn_kernels, "chunk_gated_delta_rule", "variant"),
        (attn_kernels, "paged_attention", "own_kv"),
    ):
        real = getattr(module, name)

        def spy(*args, _real=real, _key=key, **kwargs):
            seen.setdefault(_key, []).append(kwargs.get(_key))
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    opts = KernelOptions(
        prefill_attention="sdpa", moe_sorted_block_m=64, gdn_chunk_variant="split32", fp8_activations="unquantized",
        moe_prefill_gemm="torch", moe_sorted_persistent="flat",
    )  # fmt: skip
    seqs = Sequences(moe_model, kernels=opts)
    seqs.add("a")
    seqs.run([("a", _prompt(9, 2))])
    assert set(seen["sorted_block_m"]) == {64} and set(seen["variant"]) == {"split32"}
    assert set(seen["fp8_quantize_acts"]) == {False} and set(seen["prefill_gemm"]) == {"torch"}
    assert set(seen["sorted_persistent"]) == {"flat"}
    assert all(kv is not None for kv in seen["own_kv"])


def test_auto_fp8_activations_quantize_where_the_tiles_take_wgmma(moe_model, monkeypatch):
    """fp8_activations="auto": the MoE block quantizes its experts' activations only above
    FP8_ACT_QUANT_MIN_ROWS routed rows an expert, exactly where the H200's FP8 sorted tiles turn to 64
    rows and up (wgmma on e4m3); "quantized" / "unquantized" decide alone."""
    from deltaserve.layers.kernels.moe.naive import FP8_ACT_QUANT_MIN_ROWS

    info = DeviceInfo(H200, 132, 227 * 1024, (9, 0))
    for rows in (FP8_ACT_QUANT_MIN_ROWS, FP8_ACT_QUANT_MIN_ROWS + 1):
        wgmma = sorted_config(rows * 256, 256, 2, info, fp8=True)["block_m"] >= 64
        assert wgmma == moe_kernels.quantizes_fp8_acts("auto", rows * 256, 256) == (rows > FP8_ACT_QUANT_MIN_ROWS)
    assert moe_kernels.quantizes_fp8_acts("quantized", 8, 256) and not moe_kernels.quantizes_fp8_acts(
        "unquantized", 1 << 20, 256
    )
    seen = []
    real = moe_kernels.routed_moe

    def spy(*args, **kwargs):
        seen.append(kwargs["fp8_quantize_acts"])
        return real(*args, **kwargs)

    monkeypatch.setattr(moe_kernels, "routed_moe", spy)
    experts, top_k = moe_model.config.num_experts, moe_model.config.num_experts_per_tok
    few = FP8_ACT_QUANT_MIN_ROWS * experts // top_k  # tokens: exactly the cut's rows an expert
    for tokens, quantized in ((few, False), (few + experts, True)):
        seen.clear()
        seqs = Sequences(moe_model, kernels=KernelOptions(fp8_activations="auto"))
        seqs.add("a")
        seqs.run([("a", _prompt(tokens, 4))])
        assert seen and set(seen) == {quantized}, (tokens, seen)


def test_sorted_block_m_picks_the_tile_entry():
    info = DeviceInfo(H200, 132, 227 * 1024, (9, 0))
    assert sorted_config(16384, 256, 2, info)["block_m"] == 128  # 64 rows per expert (a 2k prefill)
    assert sorted_config(4096, 256, 2, info)["block_m"] == 32  # 16 rows
    assert sorted_config(16384, 256, 2, info, block_m=64)["block_m"] == 64
    for quantized in (True, False):  # FP8 weights: twice the K step, stages within the shared memory
        fp8 = sorted_config(16384, 256, 2, info, fp8=True, quantized_acts=quantized)
        assert fp8["up"]["block_k"] == 128 and fp8["down"]["block_k"] == 128
        for name, operands in (("up", 2), ("down", 1)):
            t, a_elem = fp8[name], 1 if quantized else 2
            stage = t["block_k"] * (a_elem * fp8["block_m"] + operands * t["block_n"])
            fixed = 0 if quantized else 2 * t["block_k"] * operands * t["block_n"]
            assert t["num_stages"] * stage + fixed <= info.smem_per_block, (quantized, name, t)
    with pytest.raises(ValueError, match="sorted_block_m"):
        sorted_config(16384, 256, 2, info, block_m=48)


def test_fp8_sorted_tiles_come_from_their_own_sweep():
    """W8A8 experts take SORTED_TILES_FP8's entries (one 128-column scale group a K step) from its
    smallest block_m up, the bf16 entries (converted) below; W8A16 keeps the converted bf16 tiles."""
    info = DeviceInfo(H200, 132, 227 * 1024, (9, 0))
    fp8_2k = sorted_config(16384, 256, 2, info, fp8=True)  # 64 rows per expert
    fp8_8k = sorted_config(65536, 256, 2, info, fp8=True)  # 256
    assert fp8_2k["block_m"] == 64 and fp8_2k["up"]["block_n"] == 64 and fp8_2k["down"]["num_warps"] == 8
    assert fp8_8k["block_m"] == 128 and fp8_8k["up"]["block_n"] == 128 and not fp8_8k["w_tma"]
    assert sorted_config(2048, 256, 2, info, fp8=True)["block_m"] == 16  # 8 rows: the bf16 entry
    assert sorted_config(16384, 256, 2, info, fp8=True, quantized_acts=False)["block_m"] == 128  # bf16's table
    assert sorted_config(16384, 256, 2, info, fp8=True, block_m=64)["up"]["block_k"] == 128


def test_option_values_are_checked():
    env = {"DELTASERVE_PREFILL_ATTENTION": "sdpa", "DELTASERVE_MOE_SORTED_BLOCK_M": "64"}
    assert KernelOptions.from_env(env) == KernelOptions(prefill_attention="sdpa", moe_sorted_block_m=64)
    assert KernelOptions().with_settings({"gdn_chunk_variant": "fused_pf"}).gdn_chunk_variant == "fused_pf"
    assert KernelOptions.from_env({"DELTASERVE_SDPA_BACKEND": "cudnn"}).sdpa_backend == "cudnn"
    bad = (
        {"prefill_attention": "flash"},
        {"moe_sorted_block_m": "48"},
        {"gdn_chunk_variant": "x"},
        {"sdpa_backend": "fa3"},
        {"moe_sorted_persistent": "yes"},
        {"fp8_activations": "w8a8"},
    )
    for settings in bad:
        with pytest.raises(ValueError, match=next(iter(settings))):
            KernelOptions().with_settings(settings)


@pytest.mark.gpu
def test_gpu_sdpa_prefill_matches_the_paged_kernel():
    """The model's attention shape (16 q heads, 2 kv heads, head dim 256, bf16, pages of 16), one
    2,048-token sequence: SDPA over its own keys against the paged kernel over the same keys in pages;
    its last 300 queries with the rest cached, SDPA over the keys copied out of shuffled pages."""
    g = torch.Generator(device="cuda").manual_seed(0)
    t, hq, hkv, d, page = 2048, 16, 2, 256, 16
    q, k, v = (torch.randn(t, h, d, device="cuda", generator=g).bfloat16() for h in (hq, hkv, hkv))
    pages = t // page
    k_cache = k.view(pages, page, hkv, d).contiguous()
    v_cache = v.view(pages, page, hkv, d).contiguous()
    args = dict(
        q=q, k_cache=k_cache, v_cache=v_cache, cu_seqlens_q=torch.tensor([0, t], device="cuda", dtype=torch.int32),
        seq_lens=torch.tensor([t], device="cuda", dtype=torch.int32),
        block_tables=torch.arange(pages, device="cuda", dtype=torch.int32)[None], scale=d**-0.5,
    )  # fmt: skip
    paged = attn_kernels.paged_attention(**args)
    sdpa = attn_kernels.paged_attention(**args, own_kv=(k, v))
    assert (sdpa.float() - paged.float()).abs().max().item() < 2e-2
    cudnn = attn_kernels.paged_attention(**args, own_kv=(k, v), sdpa_backend="cudnn")  # flash where it declines
    assert (cudnn.float() - paged.float()).abs().max().item() < 2e-2
    # its last 300 queries after 1,748 cached tokens, over the keys copied out of shuffled pages
    order = torch.randperm(pages, device="cuda", generator=g)
    k_shuf, v_shuf = torch.empty_like(k_cache), torch.empty_like(v_cache)
    k_shuf[order], v_shuf[order] = k_cache, v_cache
    tail = dict(
        args, q=q[-300:], k_cache=k_shuf, v_cache=v_shuf, block_tables=order.int()[None],
        cu_seqlens_q=torch.tensor([0, 300], device="cuda", dtype=torch.int32),
    )  # fmt: skip
    own = attn_kernels.sequence_kv(k_cache=k_shuf, v_cache=v_shuf, block_table=order.int(), length=t)
    sdpa_tail = attn_kernels.paged_attention(**tail, own_kv=own)
    assert (sdpa_tail.float() - attn_kernels.paged_attention(**tail).float()).abs().max().item() < 2e-2
    assert (sdpa_tail.float() - paged[-300:].float()).abs().max().item() < 2e-2
