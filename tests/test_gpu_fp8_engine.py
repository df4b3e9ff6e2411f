"""The engine with block-FP8 weights on a CUDA device (skipped on CPU): the FP8 kernels through the
whole model against the CPU path (which dequantizes, and quantizes activations where the GPU
does: to float32 rounding where no pass does, within the quantization's last-bits noise where
prefill passes do), CUDA-graph decode against eager, and no compile after start-up."""

from __future__ import annotations

import pytest
import torch
from fp8_checkpoints import PREFILL_MEDIAN_GAP, engine_prompts, make_fp8
from logprob_checks import prompt_logprob_gaps
from tiny_models import save_tiny

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


def gpu_and_cpu(fp8_dir: str, budget: int, **settings) -> list[float]:
    """Prompt-logprob gaps of the GPU (float32 activations, IEEE dots) against the CPU path, the same
    passes on both sides: which rows quantize their activations is decided per pass."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    same = dict(max_num_batched_tokens=budget, max_num_seqs=16, **settings)
    prompts = engine_prompts()
    cpu = LLM(fp8_dir, device="cpu", **same).generate(prompts, params, use_tqdm=False)
    gpu = LLM(fp8_dir, device="cuda", dtype="float32", **same, **POOL).generate(prompts, params, use_tqdm=False)
    gaps = prompt_logprob_gaps(cpu, gpu)
    median = gaps[len(gaps) // 2]
    print(f"FP8 GPU vs CPU prompt logprobs, {budget}-token passes: median {median:.2e}, max {gaps[-1]:.2e}")
    return gaps


def test_fp8_unquantized_passes_match_cpu(fp8_dir, monkeypatch):
    """Passes of up to 16 rows (32 routed pairs): every FP8 projection and the MoE's pairs path take
    x as it is, weights dequantized in registers; float32 throughout, so the CPU path's logprobs to
    float32 rounding (test_gpu_engine's bound for bf16 weights)."""
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    assert max(gpu_and_cpu(fp8_dir, 16)) < 1e-3


def test_fp8_prefill_passes_within_quantization_noise_of_cpu(fp8_dir, monkeypatch):
    """Passes of up to 97 rows: the W8A8 GEMMs and the sorted MoE quantize activations per 1 x 128
    group, and activations near a float8 midpoint round either way on the two sides, so the gap is
    the quantization's last-bits noise (PREFILL_MEDIAN_GAP: the CPU measures its own in
    test_fp8_model), not float32 rounding; a wrong scale, group or rounding mode exceeds it. The
    kernels themselves are held to float32 rounding in test_kernels_fp8."""
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    gaps = gpu_and_cpu(fp8_dir, 97)
    assert gaps[len(gaps) // 2] < PREFILL_MEDIAN_GAP


def test_fp8_unquantized_activations_match_cpu_at_prefill_sizes(fp8_dir, monkeypatch):
    """fp8_activations="unquantized": passes of up to 97 rows take every activation as it is (the
    dense projections on the dequantized weight, the sorted MoE and the shared expert in W8A16), so
    the CPU path's logprobs to float32 rounding, as decode-sized passes."""
    from deltaserve.layers.kernels.options import KernelOptions

    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    assert max(gpu_and_cpu(fp8_dir, 97, kernels=KernelOptions(fp8_activations="unquantized"))) < 1e-3


def test_fp8_cuda_graphs_give_the_eager_tokens(fp8_dir, monkeypatch):
    """Decode batches of 1..8 (the FP8 GEMVs, routing in the up GEMV) and their padded graph
    replays: the same greedy tokens, float32 activations with IEEE dots."""
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    eager = LLM(fp8_dir, device="cuda", dtype="float32", enforce_eager=True, max_num_seqs=16, **POOL)
    graphs = LLM(fp8_dir, device="cuda", dtype="float32", max_num_seqs=16, **POOL)
    a = [o.outputs[0].token_ids for o in eager.generate(engine_prompts(), params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in graphs.generate(engine_prompts(), params, use_tqdm=False)]
    assert a == b


def test_fp8_bf16_first_requests_compile_nothing(fp8_dir):
    """bf16 activations (the serving dtype): the warm-up compiled every FP8 kernel the first
    requests take (decode GEMVs, the activation quantizer, the W8A8 GEMM, the sorted MoE)."""
    llm = LLM(fp8_dir, device="cuda", **POOL)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outputs = llm.generate(engine_prompts(), params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outputs)
    assert [r for r, _ in llm.engine.executor.runner.late_compiles.events] == []


def test_real_shape_layers_against_the_dequantized_twin(report):
    """The FP8 model at Qwen3.5-35B-A3B's widths (its first 4 layers: 3 GDN, 1 attention, each with
    256 experts and the shared expert; random weights, bf16) against its dequantized twin, layer by
    layer with every layer fed the bf16 model's stream (bench.fp8_accuracy's local errors). Passes of
    8 tokens (no activation quantized: the FP8 GEMVs against the bf16 kernels on the same weights,
    rounded to bf16): each layer within a few bf16 roundings (~1% measured), and the free-running
    logits closer to the twin's than the twin's are to the bf16 model's (on random weights a layer's
    error compounds through the next: an H100 read 0.955 / 0.948 for prefill / decode, against the
    weights' own rounding's 0.820 / 0.797). One 64-token prefill pass (the W8A8 GEMMs and the sorted
    MoE quantize activations per 1 x 128 group): an error of the weight rounding's size, while a wrong
    scale, group or row moves a layer by tens of percent."""
    from deltaserve.bench.fp8_accuracy import format_report, measure, truncated

    config = truncated("qwen3_5_35b_a3b", 4)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, config.vocab_size - 10, (72,), generator=g).tolist()
    run = dict(ids=ids, decode=8, seed=0, log=lambda _: None)
    exact, quantized = measure(config, chunk=8, **run), measure(config, **run)
    for name, r in (("passes of 8 tokens", exact), ("one prefill pass", quantized)):
        report(f"FP8 at the model's widths, 4 layers, {name}:")
        for line in format_report(r):
            report("  " + line)
    for part in ("prefill", "decode"):
        assert max(exact["layers"][part]["local"]["twin~fp8"]) < 0.03, part
        corr = exact[part]["twin~fp8"]["logit_corr"]
        assert corr > max(0.9, exact[part]["bf16~twin"]["logit_corr"]), part
    local = quantized["layers"]["prefill"]["local"]
    assert max(local["twin~fp8"]) < min(0.25, 3 * max(local["bf16~twin"]))
    assert max(quantized["layers"]["decode"]["local"]["twin~fp8"]) < 0.25
