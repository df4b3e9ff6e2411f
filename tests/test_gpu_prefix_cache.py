"""Prefix caching on a CUDA device (skipped on CPU): the Triton capture path (chunk-boundary store in the
sequential kernel + token replay by the recurrent kernel) and the snapshot copies, against the same
engine without a cache."""

from __future__ import annotations

import pytest
import torch
from tiny_models import FAMILIES, VOCAB_SIZE

from deltaserve import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the H200 runs these)"),
]

POOL = dict(num_kv_blocks=2048, max_num_seqs=16, max_model_len=1100)


def ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist()


def workload() -> list[list[int]]:
    """64 prompts in groups that share prefixes of awkward lengths (mid-chunk, mid-block, past 512)."""
    prompts = []
    for group, length in enumerate((1, 17, 63, 65, 100, 200, 511, 700)):
        prefix = ids(length, seed=group)
        prompts += [prefix + ids(3 + i, seed=100 * group + i) for i in range(8)]
    return prompts


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_ieee_hits_give_the_tokens_without_a_cache(tiny_checkpoints, family, monkeypatch):
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    path = str(tiny_checkpoints[family][0])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    on = LLM(path, device="cuda", dtype="float32", prefix_snapshot_interval=128, **POOL)
    off = LLM(path, device="cuda", dtype="float32", enable_prefix_caching=False, **POOL)
    prompts = workload()
    got = [on.generate([p], params, use_tqdm=False)[0] for p in prompts]  # one by one: later ones hit
    want = off.generate(prompts, params, use_tqdm=False)
    assert sum(o.num_cached_tokens for o in got) > 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_bf16_hits_diverge_only_at_near_ties(tiny_checkpoints):
    """bf16: a resumed run rounds differently from a fresh one (the state at the snapshot was reached
    by another path, and the GEMMs see other row counts), so greedy outputs may part where the
    reference's top two logprobs nearly tie; anywhere else a divergence is a bug."""
    path = str(tiny_checkpoints["qwen3_5_moe"][0])
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    on = LLM(path, device="cuda", prefix_snapshot_interval=128, **POOL)
    off = LLM(path, device="cuda", enable_prefix_caching=False, **POOL)
    prompts = workload()
    got = [on.generate([p], params, use_tqdm=False)[0] for p in prompts]
    want = [off.generate([p], params, use_tqdm=False)[0] for p in prompts]
    hits = sum(o.num_cached_tokens > 0 for o in got)
    diverged = []
    for a, b in zip(got, want, strict=True):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        if ta == tb:
            continue
        first = next(i for i, (x, y) in enumerate(zip(ta, tb, strict=True)) if x != y)
        top = b.outputs[0].logprobs[first].top_logprobs
        diverged.append((first, top[0] - top[1]))
    print(f"bf16: {hits} of {len(prompts)} requests hit; {len(diverged)} diverged (position, top-2 gap): {diverged}")
    assert hits >= 48
    # 0.1: a few bf16 steps at these logits (|logit| < 8: steps of 1/32 to 1/16); the H200 saw gaps of 0 to 1/16
    assert all(gap < 0.1 for _, gap in diverged), diverged
