"""The engine on a CUDA device (skipped on CPU): Triton kernels against the CPU float32 path, and
CUDA-graph decode against eager decode."""

from __future__ import annotations

import pytest
import torch
from logprob_checks import prompt_logprob_gaps
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
def test_cuda_graphs_give_the_eager_tokens(tiny_checkpoints, family, monkeypatch):
    """Float32 with IEEE dots: graphs pad the batch, so GEMMs see other row counts (other kernels);
    in bf16 that rounding alone flips near-ties of these random tiny models within ~15 tokens."""
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    path = str(tiny_checkpoints[family][0])
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    eager = LLM(path, device="cuda", dtype="float32", enforce_eager=True, max_num_seqs=16, **POOL)
    graphs = LLM(path, device="cuda", dtype="float32", max_num_seqs=16, **POOL)
    assert eager.engine.executor.runner.graphs is None
    assert graphs.engine.executor.runner.graphs is not None
    a = [o.outputs[0].token_ids for o in eager.generate(prompts(), params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in graphs.generate(prompts(), params, use_tqdm=False)]
    assert a == b


def test_first_requests_compile_nothing(tiny_checkpoints):
    """A server's first greedy requests, plain (bf16 logits) and with a repetition penalty (float32
    logits), compile no Triton kernel after start-up, also with the pool sizes given (no profiling
    pass): the warm-up ran each. The argmax kernel's in-process cache is emptied first, as in a
    fresh worker (other engines in this process ran it already)."""
    from deltaserve.layers.kernels.argmax.triton_argmax import _row_argmax_kernel

    _row_argmax_kernel.device_caches.clear()
    llm = LLM(str(tiny_checkpoints["qwen3_5_moe"][0]), device="cuda", **POOL)
    late = llm.engine.executor.runner.late_compiles
    for penalty in (1.0, 1.3):
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, repetition_penalty=penalty)
        outputs = llm.generate(prompts()[:3], params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 4 for o in outputs)
    assert [r for r, _ in late.events] == []


@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_float32_matches_cpu_prompt_logprobs(tiny_checkpoints, family, monkeypatch):
    """Prompt logprobs of the whole GPU path (Triton kernels, chunked prefill, pools) against the CPU
    reference, both float32. Triton runs float32 dots in TF32 unless told otherwise: TF32's 10-bit
    mantissa moves these large-logit tiny models' logprobs by up to ~0.5, so ask for IEEE float32."""
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    path = str(tiny_checkpoints[family][0])
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    cpu = LLM(path, device="cpu").generate(prompts(), params, use_tqdm=False)
    gpu = LLM(path, device="cuda", dtype="float32", max_num_batched_tokens=97, **POOL).generate(
        prompts(), params, use_tqdm=False
    )
    assert max(prompt_logprob_gaps(cpu, gpu)) < 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_prompt_logprobs_track_float32(tiny_checkpoints, family):
    """bf16 weights and activations on the GPU against float32 on the CPU: per-position differences
    are bf16 noise (a wrong kernel or misplaced row shows up as errors of order one on average)."""
    path = str(tiny_checkpoints[family][0])
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    cpu = LLM(path, device="cpu").generate(prompts(), params, use_tqdm=False)
    gpu = LLM(path, device="cuda", **POOL).generate(prompts(), params, use_tqdm=False)
    errors = prompt_logprob_gaps(cpu, gpu)
    median = errors[len(errors) // 2]
    print(f"{family}: bf16 vs float32 prompt logprobs: median {median:.4f}, max {errors[-1]:.4f}")
    # bf16 flips some MoE routing choices (errors up to ~2.4 at those positions): the median is the test
    assert median < 0.05


def test_time_passes_records_device_busy_and_idle(tiny_checkpoints):
    """LLM(time_passes=True): every applied pass after the first carries its GPU busy time and the
    idle gap before it (CUDA events around the pass; the first has no previous pass and is not
    kept); off by default."""
    path = str(tiny_checkpoints["qwen3_5_moe"][0])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    timed = LLM(path, device="cuda", time_passes=True, **POOL)
    timed.generate(prompts()[:2], params, use_tqdm=False)
    times = list(timed.engine.pass_device_times)
    # 8 tokens: one prefill pass and 7 decode passes, the first of them without a gap to measure
    assert len(times) >= 7 and all(busy > 0 for busy, _ in times)
    assert all(idle >= 0 for _, idle in times)
    plain = LLM(path, device="cuda", **POOL)
    plain.generate(prompts()[:1], params, use_tqdm=False)
    assert not plain.engine.pass_device_times
