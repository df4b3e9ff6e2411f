"""Adapters under tensor and expert parallelism on CPU Ray actors (gloo): TP = 2 and EP = 2 shard the
adapters as they shard the weights, and each row's greedy tokens are PEFT's merged model's (base
rows in the same batch, the base model's)."""

from __future__ import annotations

import pytest
from lora_adapters import greedy, peft_adapter
from test_model_vs_transformers import prompt
from tiny_models import TP2_OVERRIDES, save_tiny

from deltaserve import LLM, LoRARequest, SamplingParams

pytestmark = pytest.mark.ray

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.mark.parametrize(
    "family, expert_parallel",
    [("qwen3_next", False), ("qwen3_5", False), ("qwen3_5_moe", False), ("qwen3_5_moe", True)],
)
def test_parallel_adapters_match_peft_merged(ray_session, tmp_path, family, expert_parallel):
    hf = save_tiny(family, tmp_path / "model", **TP2_OVERRIDES[family])
    merged = peft_adapter(hf, family, "all", tmp_path / "adapter", seed=7)
    lora = LoRARequest("all", 1, str(tmp_path / "adapter"))
    llm = LLM(
        str(tmp_path / "model"), tensor_parallel_size=2, enable_expert_parallel=expert_parallel, enable_lora=True,
        max_lora_rank=8, max_num_batched_tokens=24, dtype="float32",
    )  # fmt: skip
    try:
        rows = [prompt(14, seed=1), prompt(9, seed=2), prompt(20, seed=3)]
        outs = llm.generate(rows, GREEDY, lora_request=[lora, None, lora], use_tqdm=False)
        got = [list(o.outputs[0].token_ids) for o in outs]
        assert got == [greedy(merged, rows[0], 6), greedy(hf, rows[1], 6), greedy(merged, rows[2], 6)]
    finally:
        llm.shutdown()
