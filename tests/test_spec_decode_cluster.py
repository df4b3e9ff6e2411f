"""Speculative decoding under tensor and expert parallelism on a local Ray cluster (its own file:
the suite runs the files that start nothing on two workers, scripts/test)."""

from __future__ import annotations

import dataclasses

import pytest
from test_spec_decode import EXTRA, MAX_TOKENS, engine, expected, token_ids, workload
from tiny_models import VOCAB_SIZE, save_tiny

from deltaserve.bench.spec_drafts import ReferenceDrafter


@pytest.mark.ray
@pytest.mark.parametrize("family, expert_parallel", [("qwen3_5", False), ("qwen3_5_moe", True)])
def test_tp2_and_ep2(ray_session, tmp_path_factory, family, expert_parallel):
    """Each rank verifies, writes its GDN shards on accept and runs its shard of the head (its
    attention heads, or its experts): the tokens of one rank without speculation."""
    from tiny_models import TP2_OVERRIDES

    path = tmp_path_factory.mktemp(f"spec_tp_{family}")
    save_tiny(family, path, **TP2_OVERRIDES[family])
    prompts, params = workload()
    longer = [dataclasses.replace(p, max_tokens=MAX_TOKENS + EXTRA) for p in params]
    ref = token_ids(engine(path, None).generate(prompts, longer, use_tqdm=False))
    reference = {tuple(p): out for p, out in zip(prompts, ref, strict=True)}
    llm = engine(path, 3, tensor_parallel_size=2, enable_expert_parallel=expert_parallel)
    try:
        llm.engine.scheduler.drafter = ReferenceDrafter(reference, 0.7, VOCAB_SIZE)
        assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == expected(reference)
        assert llm.engine.speculative_stats()["num_accepted_tokens"] > 0
        llm.engine.scheduler.drafter = None  # the head's own drafts, sharded
        assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == expected(reference)
    finally:
        llm.shutdown()
