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


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(21)
    return [torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist() for n in (1, 5, 17, 64, 65, 130, 300, 9)]


@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_graphs_give_the_eager_tokens(tiny_checkpoints, family):
    path = str(tiny_checkpoints[family][0])
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    eager = LLM(path, device="cuda", dtype="bfloat16", enforce_eager=True, max_num_seqs=16)
    graphs = LLM(path, device="cuda", dtype="bfloat16", max_num_seqs=16)
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
    gpu = LLM(path, device="cuda", dtype="float32", max_num_batched_tokens=97).generate(prompts(), params,
                                                                                      use_tqdm=False)
    worst = 0.0
    for c, g in zip(cpu, gpu, strict=True):
        for a, b in zip(c.prompt_logprobs[1:], g.prompt_logprobs[1:], strict=True):
            worst = max(worst, abs(a.logprob - b.logprob))
    assert worst < 2e-2, worst  # tf32 matmuls in the kernels


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_greedy_mostly_matches_cpu(tiny_checkpoints, family):
    path = str(tiny_checkpoints[family][0])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    cpu = [o.outputs[0].token_ids[0] for o in LLM(path, device="cpu").generate(prompts(), params, use_tqdm=False)]
    gpu = [o.outputs[0].token_ids[0] for o in LLM(path, device="cuda").generate(prompts(), params, use_tqdm=False)]
    assert sum(a == b for a, b in zip(cpu, gpu, strict=True)) >= len(cpu) - 1
