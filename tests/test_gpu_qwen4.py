"""Qwen4-Exp on a CUDA device (skipped on CPU): the GPU path (QSA Triton kernels, PLE and the
hyper-connection mixers in torch on the device, CUDA-graph decode) against the CPU float32 path."""

from __future__ import annotations

import pytest
import torch
from logprob_checks import prompt_logprob_gaps
from test_gpu_engine import POOL
from tiny_models import VOCAB_SIZE
from tiny_qwen4 import EOS, save_tiny_qwen4

from deltaserve import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the H200 runs these)"),
]


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(21)
    out = [torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist() for n in (1, 5, 17, 64, 65, 130, 300, 9)]
    out[5][40] = EOS
    return out


@pytest.fixture(scope="module")
def qwen4_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("qwen4_gpu")
    # 16 indexer heads: block scores (sums of relus) are then almost never exactly equal at the top-k
    # cut, where the CPU path breaks ties as torch.topk does and the Triton kernel by lowest index
    save_tiny_qwen4(path, indexer_n_heads=16)
    return str(path)


def test_cuda_graphs_give_the_eager_tokens(qwen4_path, monkeypatch):
    """Decode graphs (static block tables as wide as the longest context: the QSA path always scores
    and selects) give the tokens of eager decode, float32 with IEEE dots."""
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    eager = LLM(qwen4_path, device="cuda", dtype="float32", enforce_eager=True, max_num_seqs=16, **POOL)
    graphs = LLM(qwen4_path, device="cuda", dtype="float32", max_num_seqs=16, **POOL)
    assert graphs.engine.executor.runner.graphs is not None
    a = [o.outputs[0].token_ids for o in eager.generate(prompts(), params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in graphs.generate(prompts(), params, use_tqdm=False)]
    assert a == b


@pytest.mark.parametrize("budget", [97, 2048])
def test_cuda_float32_matches_cpu_prompt_logprobs(qwen4_path, monkeypatch, budget):
    """Prompt logprobs of the whole GPU path against the CPU reference, both float32 (IEEE dots),
    with prefill chunks of 97 tokens (chunk ends inside compressed blocks) and whole prompts."""
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    cpu = LLM(qwen4_path, device="cpu").generate(prompts(), params, use_tqdm=False)
    gpu = LLM(qwen4_path, device="cuda", dtype="float32", max_num_batched_tokens=budget, **POOL).generate(
        prompts(), params, use_tqdm=False
    )
    assert max(prompt_logprob_gaps(cpu, gpu)) < 1e-3


def test_fp8_pages_match_the_cpu_path(qwen4_path, monkeypatch):
    """kv_cache_dtype fp8: the GPU path's prompt logprobs (its KV stores rounding to e4m3, QSA's sparse
    kernel widening the pages) against the CPU path's over the same e4m3 pages, both float32, and CUDA
    graphs giving eager decode's tokens."""
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    cpu = LLM(qwen4_path, device="cpu", kv_cache_dtype="fp8").generate(prompts(), params, use_tqdm=False)
    gpu = LLM(qwen4_path, device="cuda", dtype="float32", kv_cache_dtype="fp8", max_num_batched_tokens=97, **POOL)
    errors = prompt_logprob_gaps(cpu, gpu.generate(prompts(), params, use_tqdm=False))
    assert errors[len(errors) // 2] < 1e-4 and errors[-1] < 5e-3  # an element may round to its other neighbour
    decode = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    eager = LLM(qwen4_path, device="cuda", dtype="float32", kv_cache_dtype="fp8", enforce_eager=True, **POOL)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts(), decode, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in gpu.generate(prompts(), decode, use_tqdm=False)] == want


def test_bf16_prompt_logprobs_track_float32(qwen4_path):
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    cpu = LLM(qwen4_path, device="cpu").generate(prompts(), params, use_tqdm=False)
    gpu = LLM(qwen4_path, device="cuda", **POOL).generate(prompts(), params, use_tqdm=False)
    errors = prompt_logprob_gaps(cpu, gpu)
    median = errors[len(errors) // 2]
    print(f"qwen4_exp: bf16 vs float32 prompt logprobs: median {median:.4f}, max {errors[-1]:.4f}")
    assert median < 0.05
