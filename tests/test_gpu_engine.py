"""The engine on a CUDA device (skipped on CPU): Triton kernels against the CPU float32 path, and
CUDA-graph decode against eager decode."""

from __future__ import annotations

import pytest
import torch
from tiny_models import FAMILIES, VOCAB_SIZE

from deltaserve import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the H200 runs these)"),
]


# Several engines share the GPU within one test process: fixed small pools, not 90% of memory each.
POOL = dict(num_kv_blocks=512)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(21)
    return [torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist() for n in (1, 5, 17, 64, 65, 130, 300, 9)]


@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_graphs_give_the_eager_tokens(tiny_checkpoints, family):
    path = str(tiny_checkpoints[family][0])
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    eager = LLM(path, device="cuda", dtype="bfloat16", enforce_eager=True, max_num_seqs=16, **POOL)
    graphs = LLM(path, device="cuda", dtype="bfloat16", max_num_seqs=16, **POOL)
    assert eager.engine.executor.runner.graphs is None
    assert graphs.engine.executor.runner.graphs is not None
    a = [o.outputs[0].token_ids for o in eager.generate(prompts(), params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in graphs.generate(prompts(), params, use_tqdm=False)]
    assert a == b


@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_float32_matches_cpu_prompt_logprobs(tiny_checkpoints, family):
    """Prompt logprobs through the Triton kernels (float32) against the CPU reference path."""
    path = str(tiny_checkpoints[family][0])
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    cpu = LLM(path, device="cpu").generate(prompts(), params, use_tqdm=False)
    gpu = LLM(path, device="cuda", dtype="float32", max_num_batched_tokens=97, **POOL).generate(
        prompts(), params, use_tqdm=False
    )
    worst = 0.0
    for c, g in zip(cpu, gpu, strict=True):
        for a, b in zip(c.prompt_logprobs[1:], g.prompt_logprobs[1:], strict=True):
            worst = max(worst, abs(a.logprob - b.logprob))
    assert worst < 2e-2, worst  # tf32 matmuls in the kernels


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_greedy_picks_a_float32_top_token(tiny_checkpoints, family):
    """bf16 on the GPU may break a near-tie differently from float32 on the CPU, but never picks a
    token the float32 model ranks far below its best (random tiny weights give near-flat logits)."""
    path = str(tiny_checkpoints[family][0])
    gpu_params = SamplingParams(temperature=0, max_tokens=1)
    gpu = [o.outputs[0].token_ids[0] for o in LLM(path, device="cuda", **POOL).generate(prompts(), gpu_params,
                                                                                        use_tqdm=False)]
    cpu_params = SamplingParams(temperature=0, max_tokens=1, logprobs=20)
    cpu = [o.outputs[0].logprobs[0] for o in LLM(path, device="cpu").generate(prompts(), cpu_params, use_tqdm=False)]
    for token, ref in zip(gpu, cpu, strict=True):
        assert token in ref.top_ids, (token, ref.top_ids)
        gap = ref.top_logprobs[0] - ref.top_logprobs[ref.top_ids.index(token)]
        assert gap < 0.05, (token, ref.top_ids[:3], gap)
