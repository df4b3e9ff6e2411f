"""Prefix caching under tensor and expert parallelism on a local Ray cluster (its own file: the
suite runs the files that start nothing on two workers, scripts/test)."""

from __future__ import annotations

import pytest
from test_prefix_cache import ids

from deltaserve import LLM, SamplingParams


@pytest.mark.ray
@pytest.mark.parametrize("family, expert_parallel", [("qwen3_5", False), ("qwen3_5_moe", True)])
def test_tp2_and_ep2_hits_give_single_rank_tokens(ray_session, tmp_path_factory, family, expert_parallel):
    """Each rank snapshots and restores its own shard; the driver's index names the slots."""
    from tiny_models import TP2_OVERRIDES, save_tiny

    path = str(tmp_path_factory.mktemp(f"prefix_tp_{family}"))
    save_tiny(family, path, **TP2_OVERRIDES[family])
    prefix = ids(37, seed=41)
    prompts = [prefix + ids(n, seed=n) for n in (5, 3, 8, 2)]
    params = SamplingParams(temperature=0, max_tokens=6)
    reference = LLM(path, enable_prefix_caching=False).generate(prompts, params, use_tqdm=False)
    llm = LLM(path, tensor_parallel_size=2, enable_expert_parallel=expert_parallel, max_num_batched_tokens=40)
    try:
        got = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in reference]
        assert got[2].num_cached_tokens == 37 and got[3].num_cached_tokens == 37
    finally:
        llm.shutdown()
