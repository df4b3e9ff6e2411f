"""The engine serving Qwen4-Exp (QSA, hyper-connections, PLE) against transformers' greedy by uncached
forwards: batches of prompts longer than the budget of QSA's selection, odd token budgets (chunk
boundaries anywhere), preemption, async scheduling on and off, and prefix caching (KV + indexer pages
shared, GDN + PLE state snapshots) changing nothing."""

from __future__ import annotations

import pytest
import torch
from tiny_models import VOCAB_SIZE
from tiny_qwen4 import EOS, hf_greedy, save_tiny_qwen4

from deltaserve import LLM, SamplingParams

LENGTHS = [1, 7, 16, 23, 38]
MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    out = [torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist() for n in LENGTHS]
    out[3][10] = EOS  # an EOS inside a prompt cuts PLE's n-grams
    return out


@pytest.fixture(scope="module")
def qwen4(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen4_engine")
    hf = save_tiny_qwen4(path)
    return str(path), [hf_greedy(hf, p, MAX_TOKENS) for p in prompts()]


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_batch_matches_uncached_greedy(qwen4, async_scheduling):
    path, refs = qwen4
    llm = LLM(path, max_num_seqs=8, async_scheduling=async_scheduling)
    assert llm.engine.async_scheduling == async_scheduling
    assert tokens(llm.generate(prompts(), GREEDY, use_tqdm=False)) == refs
    alone = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts()[-2:]]
    assert tokens(alone) == refs[-2:]


@pytest.mark.parametrize("budget", [1, 5, 13, 64])
def test_token_budget_does_not_change_tokens(qwen4, budget):
    path, refs = qwen4
    llm = LLM(path, max_num_seqs=8, max_num_batched_tokens=budget)
    assert tokens(llm.generate(prompts(), GREEDY, use_tqdm=False)) == refs


@pytest.mark.parametrize("caching", [True, False])
def test_preemption_keeps_tokens(qwen4, caching):
    """Preempted requests run again (from scratch, or with caching on from what the cache kept): their
    PLE state and indexer pages are rebuilt or restored with the rest."""
    path, refs = qwen4
    # 4 pages of 16 tokens: far less than the prompts need together, enough for the longest alone
    llm = LLM(
        path, max_num_seqs=8, block_size=16, max_num_batched_tokens=20, num_kv_blocks=4, enable_prefix_caching=caching
    )
    out = llm.generate(prompts(), GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.stats.num_preemptions > 0
    assert tokens(out) == refs
    assert llm.engine.blocks.num_free == llm.engine.blocks.capacity
    assert llm.engine.slots.num_free == llm.engine.slots.capacity


def ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist()


def same_outputs(got, want) -> None:
    """Identical greedy tokens and logprobs within 1e-5 (float64 runs)."""
    assert tokens(got) == tokens(want)
    for a, b in zip(got, want, strict=True):
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert x.top_ids == y.top_ids and abs(x.logprob - y.logprob) <= 1e-5


@pytest.fixture(scope="module")
def cached_engines(qwen4):
    path, _ = qwen4
    kw = dict(max_num_seqs=8, max_num_batched_tokens=40, max_model_len=300, dtype="float64", block_size=16)
    on = LLM(path, prefix_snapshot_interval=32, **kw)
    off = LLM(path, enable_prefix_caching=False, **kw)
    assert on.engine.prefix_cache is not None
    return on, off


@pytest.mark.parametrize("prefix_len", [5, 16, 17, 34, 50, 97])
def test_prefix_cache_hits_change_nothing(cached_engines, prefix_len):
    """Later requests skip a shared prefix (KV and indexer pages by hash, GDN and PLE state from a
    snapshot, captured inside a chunk where the prefix ends mid-chunk) and produce what they produce
    without the cache."""
    on, off = cached_engines
    on.reset_prefix_cache()
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=2)
    prefix = ids(prefix_len, seed=prefix_len)
    batch = [prefix + ids(n, seed=100 * prefix_len + n) for n in (7, 4, 9, 2)]
    got = [on.generate([p], params, use_tqdm=False)[0] for p in batch]
    same_outputs(got, off.generate(batch, params, use_tqdm=False))
    assert got[2].num_cached_tokens == prefix_len and got[3].num_cached_tokens == prefix_len
