"""The engine with block-FP8 weights on a CUDA device (skipped on CPU): the FP8 kernels through the
whole model against the CPU path (which dequantizes, and quantizes activations where the GPU
does), CUDA-graph decode against eager, and no compile after start-up."""

from __future__ import annotations

import pytest
import torch
from fp8_checkpoints import make_fp8
from test_gpu_engine import prompt_logprob_errors
from tiny_models import VOCAB_SIZE, save_tiny

from deltaserve import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the H200 runs these)"),
]

POOL = dict(num_kv_blocks=512)
# test_fp8_model's Qwen-shaped tiny MoE: projections a few 128-wide blocks across
QWEN_LIKE = dict(
    hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64, num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=128, shared_expert_intermediate_size=128, initializer_range=0.02,
)  # fmt: skip


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-fp8")
    save_tiny("qwen3_5_moe", root / "src", **QWEN_LIKE)
    make_fp8(root / "src", root / "fp8", root / "twin")
    return str(root / "fp8")


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(21)
    return [torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist() for n in (1, 5, 17, 64, 65, 130, 300, 9)]


def test_fp8_prompt_logprobs_match_cpu(fp8_dir, monkeypatch):
    """Float32 activations with IEEE dots on both sides: prefill chunks of up to 97 tokens (the
    W8A8 GEMMs and the sorted MoE) and the rows around them give the CPU path's prompt logprobs;
    an activation rounded to the other float8 neighbour (their inputs differ in the last bits)
    moves a logprob by ~1e-2 at most, a wrong scale or row by order one."""
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    # the same passes on both sides: which rows quantize their activations is decided per pass
    same = dict(max_num_batched_tokens=97, max_num_seqs=16)
    cpu = LLM(fp8_dir, device="cpu", **same).generate(prompts(), params, use_tqdm=False)
    gpu = LLM(fp8_dir, device="cuda", dtype="float32", **same, **POOL).generate(prompts(), params, use_tqdm=False)
    errors = sorted(prompt_logprob_errors(cpu, gpu))
    print(f"FP8 GPU vs CPU prompt logprobs: median {errors[len(errors) // 2]:.2e}, max {errors[-1]:.2e}")
    assert errors[len(errors) // 2] < 1e-3 and errors[-1] < 5e-2


def test_fp8_cuda_graphs_give_the_eager_tokens(fp8_dir, monkeypatch):
    """Decode batches of 1..8 (the FP8 GEMVs, routing in the up GEMV) and their padded graph
    replays: the same greedy tokens, float32 activations with IEEE dots."""
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    eager = LLM(fp8_dir, device="cuda", dtype="float32", enforce_eager=True, max_num_seqs=16, **POOL)
    graphs = LLM(fp8_dir, device="cuda", dtype="float32", max_num_seqs=16, **POOL)
    a = [o.outputs[0].token_ids for o in eager.generate(prompts(), params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in graphs.generate(prompts(), params, use_tqdm=False)]
    assert a == b


def test_fp8_bf16_first_requests_compile_nothing(fp8_dir):
    """bf16 activations (the serving dtype): the warm-up compiled every FP8 kernel the first
    requests take (decode GEMVs, the activation quantizer, the W8A8 GEMM, the sorted MoE)."""
    llm = LLM(fp8_dir, device="cuda", **POOL)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outputs = llm.generate(prompts(), params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outputs)
    assert [r for r, _ in llm.engine.executor.runner.late_compiles.events] == []
