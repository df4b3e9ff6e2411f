"""Qwen4-Exp on the Ray cluster of CPU actors (gloo): TP = 2 (and EP = 2 for its MoE) gives the tokens
of TP = 1: PLE's table column-sharded with one all-reduce of its projections, the QSA indexer run
whole on every rank (the selections agree), hyper-connection mixers replicated."""

from __future__ import annotations

import pytest
import torch
from tiny_models import VOCAB_SIZE
from tiny_qwen4 import EOS, save_tiny_qwen4

from deltaserve import LLM, SamplingParams

pytestmark = pytest.mark.ray

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    out = [torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist() for n in (2, 9, 30, 44)]
    out[2][5] = EOS
    return out


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_tp2_tokens_equal_single_rank(ray_session, tmp_path, expert_parallel):
    save_tiny_qwen4(tmp_path)
    reference = tokens(LLM(str(tmp_path), max_num_batched_tokens=24))
    llm = LLM(str(tmp_path), tensor_parallel_size=2, enable_expert_parallel=expert_parallel, max_num_batched_tokens=24)
    try:
        assert llm.engine.async_scheduling
        assert tokens(llm) == reference
    finally:
        llm.shutdown()
