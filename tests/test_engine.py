"""The engine against transformers' generate: greedy tokens for batches of prompts of different
lengths, whatever the token budget (chunk boundaries), and under preemption."""

from __future__ import annotations

import pytest
import torch
from tiny_models import FAMILIES, VOCAB_SIZE

from deltaserve import LLM, SamplingParams

LENGTHS = [1, 3, 7, 12, 20, 33, 50, 65]
MAX_TOKENS = 12


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist() for n in LENGTHS]


def hf_greedy(hf, ids: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=2, pad_token_id=0
        )[0, len(ids) :].tolist()
    return out[: out.index(2) + 1] if 2 in out else out


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tiny_checkpoints):
    path, hf = tiny_checkpoints[request.param]
    refs = [hf_greedy(hf, p) for p in prompts()]
    return path, refs


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_batch_matches_transformers_and_single_runs(family):
    path, refs = family
    llm = LLM(str(path), max_num_seqs=8)
    batched = llm.generate(prompts(), GREEDY, use_tqdm=False)
    assert tokens(batched) == refs
    for out, ref in zip(batched, refs, strict=True):
        assert out.finished and out.outputs[0].finish_reason == ("stop" if ref[-1] == 2 else "length")
    alone = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts()]
    assert tokens(alone) == refs


@pytest.mark.parametrize("budget", [1, 5, 16, 63, 64, 100])
def test_token_budget_does_not_change_tokens(family, budget):
    path, refs = family
    llm = LLM(str(path), max_num_seqs=8, max_num_batched_tokens=budget)
    assert tokens(llm.generate(prompts(), GREEDY, use_tqdm=False)) == refs


def test_preemption_keeps_tokens(family):
    path, refs = family
    # 6 KV pages of 16 tokens: far less than 8 prompts need together, enough for the longest alone
    llm = LLM(str(path), max_num_seqs=8, block_size=16, max_num_batched_tokens=32, num_kv_blocks=6)
    assert llm.engine.blocks.capacity * 16 >= max(LENGTHS) + MAX_TOKENS
    out = llm.generate(prompts(), GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.stats.num_preemptions > 0
    assert tokens(out) == refs
    assert llm.engine.blocks.num_free == llm.engine.blocks.capacity
    assert llm.engine.slots.num_free == llm.engine.slots.capacity
