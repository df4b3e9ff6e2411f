"""Paged attention cases (16 q heads, 2 kv heads, head dim 256, pages of 16, bf16): decode at
batch 1 / 64 / 256 x 4096 context, prefill of 8192 new tokens, and the KV write.

    python -m deltaserve.bench.kernels --only attention
    python -m deltaserve.bench.kernels_attention --sweep   # decode tile / split sweep at batch 64
    python -m deltaserve.bench.kernels_attention --sweep-prefill   # prefill tile sweep at 8192 tokens
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from deltaserve.bench.kernel_cases import Case
from deltaserve.layers.kernels.attention import naive
from deltaserve.layers.kernels.attention import triton_attention as ta

HQ, HKV, D, PAGE = 16, 2, 256, 16
SCALE = D**-0.5
DTYPE = torch.bfloat16


def _pool(num_seqs: int, seq_len: int, extra_pages: int = 0, seed: int = 0):
    """KV pools holding num_seqs sequences of seq_len tokens in scrambled pages, and their tables."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages_per_seq = -(-seq_len // PAGE)
    num_blocks = num_seqs * pages_per_seq + extra_pages
    k_cache = torch.randn(num_blocks, PAGE, HKV, D, device="cuda", dtype=DTYPE, generator=g)
    v_cache = torch.randn(num_blocks, PAGE, HKV, D, device="cuda", dtype=DTYPE, generator=g)
    perm = torch.randperm(num_blocks, device="cuda", generator=g)[: num_seqs * pages_per_seq]
    block_tables = perm.view(num_seqs, pages_per_seq).to(torch.int32)
    return k_cache, v_cache, block_tables


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[N, Hkv, seq_len, D] contiguous copy of each sequence's keys or values."""
    n = block_tables.shape[0]
    return cache[block_tables.long()].reshape(n, -1, HKV, D)[:, :seq_len].transpose(1, 2).contiguous()


def _max_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out.float() - ref.float()).abs().max().item()


def _decode_case(batch: int, ctx: int) -> Case:
    k_cache, v_cache, block_tables = _pool(batch, ctx, seed=batch)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HQ, D, device="cuda", dtype=DTYPE)
    args = dict(q=q, k_cache=k_cache, v_cache=v_cache, seq_lens=seq_lens, block_tables=block_tables, scale=SCALE)
    k_seq, v_seq = _gather(k_cache, block_tables, ctx), _gather(v_cache, block_tables, ctx)
    # the q heads of one kv head act as that head's query rows: plain multi-query SDPA, no repeat
    q_rows = q.view(batch, HKV, HQ // HKV, D)

    def reference():
        return F.scaled_dot_product_attention(q_rows, k_seq, v_seq, scale=SCALE)

    def check():
        return _max_err(ta.paged_decode_attention(**args), naive.paged_decode_attention(**args))

    kv_bytes = 2 * batch * ctx * HKV * D * 2
    return Case(
        op="attn_decode",
        shape=f"B={batch} ctx={ctx} Hq={HQ} Hkv={HKV} D={D}",
        ours=lambda: ta.paged_decode_attention(**args),
        reference=reference,
        reference_label="sdpa(contiguous KV)",
        check=check,
        tolerance=2e-2,
        bytes_moved=kv_bytes + 2 * q.numel() * 2 + block_tables.numel() * 4,
        flops=4 * batch * HQ * ctx * D,
        target=">=70% of copy BW at B=64" if batch == 64 else "",
    )


def _prefill_case(num_tokens: int) -> Case:
    k_cache, v_cache, block_tables = _pool(1, num_tokens, seed=7)
    q = torch.randn(num_tokens, HQ, D, device="cuda", dtype=DTYPE)
    args = dict(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        cu_seqlens_q=torch.tensor([0, num_tokens], dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device="cuda"),
        block_tables=block_tables,
        scale=SCALE,
    )
    k_seq, v_seq = _gather(k_cache, block_tables, num_tokens), _gather(v_cache, block_tables, num_tokens)
    q_seq = q.transpose(0, 1).unsqueeze(0).contiguous()

    def reference():
        return F.scaled_dot_product_attention(q_seq, k_seq, v_seq, is_causal=True, scale=SCALE, enable_gqa=True)

    def check():
        return _max_err(ta.paged_attention(**args), naive.paged_attention(**args))

    return Case(
        op="attn_prefill",
        shape=f"T={num_tokens} cached=0 Hq={HQ} Hkv={HKV} D={D}",
        ours=lambda: ta.paged_attention(**args),
        reference=reference,
        reference_label="sdpa causal(contiguous)",
        check=check,
        tolerance=2e-2,
        bytes_moved=2 * q.numel() * 2 + 2 * num_tokens * HKV * D * 2,
        flops=2 * HQ * num_tokens * num_tokens * D,
    )


def _write_case(num_tokens: int) -> Case:
    k_cache, v_cache, _ = _pool(1, num_tokens * 2, seed=3)
    key = torch.randn(num_tokens, HKV, D, device="cuda", dtype=DTYPE)
    value = torch.randn_like(key)
    slots = torch.randperm(k_cache.shape[0] * PAGE, device="cuda")[:num_tokens]
    args = dict(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots)

    def check():
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        naive.write_kv_cache(key=key, value=value, k_cache=k_ref, v_cache=v_ref, slot_mapping=slots)
        ta.write_kv_cache(**args)
        return max(_max_err(k_cache, k_ref), _max_err(v_cache, v_ref))

    return Case(
        op="attn_write_kv",
        shape=f"T={num_tokens} Hkv={HKV} D={D}",
        ours=lambda: ta.write_kv_cache(**args),
        reference=lambda: naive.write_kv_cache(**args),
        reference_label="torch index_put",
        check=check,
        tolerance=0.0,
        bytes_moved=2 * 2 * key.numel() * 2,
    )


def cases() -> list[Case]:
    return [
        _decode_case(1, 4096),
        _decode_case(64, 4096),
        _decode_case(256, 4096),
        _prefill_case(8192),
        _write_case(8192),
    ]


def sweep(batch: int = 64, ctx: int = 4096) -> None:
    """Decode configs at one shape: time, share of copy bandwidth, error; the default marked."""
    import triton.testing

    from deltaserve.bench.kernels import measure_copy_bandwidth

    bandwidth = measure_copy_bandwidth()
    k_cache, v_cache, block_tables = _pool(batch, ctx, seed=batch)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HQ, D, device="cuda", dtype=DTYPE)
    args = dict(q=q, k_cache=k_cache, v_cache=v_cache, seq_lens=seq_lens, block_tables=block_tables, scale=SCALE)
    ref = naive.paged_decode_attention(**args)
    default = ta._decode_config(
        num_seqs=batch, num_kv_heads=HKV, max_context=block_tables.shape[1] * PAGE, head_dim=D, device=q.device
    )
    print(f"B={batch} ctx={ctx}  default {default}")
    for block_n, splits, warps, stages in itertools.product([16, 32], [1, 2, 3, 4, 5, 8, 16], [4, 8], [3, 5]):
        cfg = dict(block_n=block_n, num_splits=splits, num_warps=warps, num_stages=stages)
        try:
            err = _max_err(ta.paged_decode_attention(**args, config=cfg), ref)
            ms = triton.testing.do_bench(
                lambda cfg=cfg: ta.paged_decode_attention(**args, config=cfg), warmup=10, rep=50, return_mode="median"
            )
        except Exception as e:  # a config that does not compile or fit is reported, not fatal
            print(f"{cfg} failed: {type(e).__name__}: {str(e)[:80]}")
            continue
        frac = 2 * k_cache[0].numel() * block_tables.numel() * 2 / bandwidth / (ms * 1e-3)
        mark = "  <- default" if cfg == default else ""
        print(f"{cfg}  {ms * 1e3:8.1f} us  {100 * frac:5.1f}% of copy BW  err {err:.1e}{mark}")


def sweep_prefill(num_tokens: int = 8192) -> None:
    """Prefill tile configs at one sequence of num_tokens new tokens: time, TFLOP/s, error."""
    import triton.testing

    k_cache, v_cache, block_tables = _pool(1, num_tokens, seed=7)
    q = torch.randn(num_tokens, HQ, D, device="cuda", dtype=DTYPE)
    args = dict(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        cu_seqlens_q=torch.tensor([0, num_tokens], dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device="cuda"),
        block_tables=block_tables,
        scale=SCALE,
    )
    ref = naive.paged_attention(**args)
    flops = 2 * HQ * num_tokens * num_tokens * D
    print(f"T={num_tokens}  default {ta._prefill_config(D, HQ // HKV, True)}")
    for block_m, block_n, warps, stages in itertools.product([64, 128], [32, 64], [4, 8], [2, 3]):
        cfg = dict(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages)
        try:
            err = _max_err(ta.paged_attention(**args, config=cfg), ref)
            ms = triton.testing.do_bench(
                lambda cfg=cfg: ta.paged_attention(**args, config=cfg), warmup=5, rep=30, return_mode="median"
            )
        except Exception as e:  # a config that does not compile or fit is reported, not fatal
            print(f"{cfg} failed: {type(e).__name__}: {str(e)[:80]}")
            continue
        print(f"{cfg}  {ms:8.3f} ms  {flops / ms / 1e9:6.0f} TFLOP/s  err {err:.1e}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--sweep-prefill", action="store_true")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--ctx", type=int, default=4096)
    a = parser.parse_args()
    if a.sweep:
        sweep(a.batch, a.ctx)
    if a.sweep_prefill:
        sweep_prefill()
