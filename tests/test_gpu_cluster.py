"""TP = 2 on two GPUs (skipped elsewhere): the Ray worker group with passes overlapped over the
shared-memory ring gives the tokens of the same group run synchronously, and of one GPU."""

from __future__ import annotations

import pytest
import torch
from tiny_models import TP2_OVERRIDES, VOCAB_SIZE, save_tiny

from deltaserve import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (nvidia-h200-x2 runs these)"),
]

POOL = dict(num_kv_blocks=512, max_num_seqs=16)


@pytest.fixture(scope="module")
def gpu_ray():
    """A Ray instance of this module's own whose workers run Triton's float32 dots in IEEE (TF32
    would move these tiny models' logits enough to flip near-ties between TP = 1 and 2)."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        ray.shutdown()
    ray.init(
        address="local",
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"TRITON_F32_DEFAULT": "ieee"}},
    )
    yield ray
    ray.shutdown()


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist() for n in (1, 7, 33, 100, 260)]


def run(llm: LLM) -> list[list[int]]:
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=20, ignore_eos=True)
    outs = llm.generate(prompts() * 2, [greedy] * len(prompts()) + [seeded] * len(prompts()), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_tp2_overlapped_passes_give_synchronous_and_single_gpu_tokens(gpu_ray, tmp_path, family, monkeypatch):
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    save_tiny(family, tmp_path, **TP2_OVERRIDES[family])
    single = run(LLM(str(tmp_path), device="cuda", dtype="float32", **POOL))
    llm = LLM(str(tmp_path), device="cuda", dtype="float32", tensor_parallel_size=2, time_passes=True, **POOL)
    try:
        engine = llm.engine
        assert engine.executor.transport == "shm" and engine.async_scheduling
        overlapped = run(llm)
        engine.set_async_scheduling(False)
        synchronous = run(llm)
        # time_passes: rank 0's CUDA events give each pass's GPU busy time and the idle gap before it
        stages = engine.executor.control_stages_s()
        assert stages["device_busy"] > 0 and stages["device_idle_before"] >= 0
    finally:
        llm.shutdown()
    assert overlapped == synchronous
    assert overlapped == single
