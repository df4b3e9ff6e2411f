"""Block-FP8 checkpoints (CPU, float32 activations): an FP8 tiny checkpoint laid out like Qwen's FP8
releases (tests/fp8_checkpoints.py) against its dequantized float32 twin; the scheme read from
config.json (and what it cannot serve); the loader's errors; `quantization="fp8"` on a
higher-precision checkpoint; random FP8 weights.

What the FP8 model computes: the weights exactly as dequantized; passes of up to 16 rows take x as
it is (the GPU's decode GEMVs), as do the dense projections of larger ones (fp8_gemm=dequant, the
default: cuBLAS on the dequantized weight); the MoE experts above 64 routed pairs quantize their
inputs per row and 1 x 128 group (the GPU's FP8 tensor-core path). So decode-sized passes match the
twin to float32 rounding, prefill-sized ones within the experts' activation quantization's error,
measured here on a Qwen-shaped tiny model (trained-scale init 0.02, 128-wide blocks)."""

from __future__ import annotations

import json

import pytest
import torch
from fp8_checkpoints import PREFILL_MEDIAN_GAP, engine_prompts, make_fp8
from logprob_checks import prompt_logprob_gaps
from passes import Sequences
from safetensors.torch import load_file, save_file
from tiny_models import VOCAB_SIZE, save_tiny

from deltaserve import LLM, SamplingParams
from deltaserve.layers.config import ConfigError, Fp8Scheme, ModelConfig
from deltaserve.layers.kernels import fp8 as fp8_kernels
from deltaserve.layers.kernels.linear import naive as linear_naive
from deltaserve.layers.kernels.moe import naive as moe_naive
from deltaserve.layers.kernels.options import KernelOptions
from deltaserve.layers.loader import CheckpointError, load_model
from deltaserve.layers.parallel import ParallelLayout
from deltaserve.layers.quant import layout

EXACT = 1e-4  # decode-sized passes: max abs error relative to the largest twin logit
# a Qwen3.5-MoE-shaped tiny model: projections a few 128-blocks wide, trained-scale init
QWEN_LIKE = dict(
    hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64, num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=128, shared_expert_intermediate_size=128, initializer_range=0.02,
)  # fmt: skip


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist()


def logits(model, ids: list[int], chunk: int | None = None, kernels: KernelOptions | None = None) -> torch.Tensor:
    """Logits of a prompt in one pass, or in passes of `chunk` tokens."""
    seqs = Sequences(model, kernels=kernels)
    seqs.add("a")
    chunk = chunk or len(ids)
    return torch.cat([seqs.run([("a", ids[i : i + chunk])])[0] for i in range(0, len(ids), chunk)])


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


@pytest.fixture(scope="module")
def fp8_tiny(tiny_checkpoints, tmp_path_factory) -> dict:
    """family -> (FP8 dir, twin dir) for the three tiny families (odd sizes: blocks smaller than 128
    inside fused weights, experts per tensor)."""
    out = {}
    for family, (path, _) in tiny_checkpoints.items():
        root = tmp_path_factory.mktemp(f"{family}-fp8")
        make_fp8(path, root / "fp8", root / "twin")
        out[family] = (root / "fp8", root / "twin")
    return out


@pytest.fixture(scope="module")
def qwen_like(tmp_path_factory) -> tuple:
    """(FP8 dir, twin dir, source dir) of the Qwen-shaped tiny MoE model."""
    root = tmp_path_factory.mktemp("qwen-like")
    save_tiny("qwen3_5_moe", root / "src", **QWEN_LIKE)
    make_fp8(root / "src", root / "fp8", root / "twin")
    return root / "fp8", root / "twin", root / "src"


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next", "qwen3_5"])
def test_decode_sized_passes_match_the_twin(fp8_tiny, family):
    """Every FP8 projection holds the checkpoint's float8 values and scales: passes of up to 16
    rows give the twin's logits to float32 rounding, prompt in chunks and token by token."""
    fp8_dir, twin_dir = fp8_tiny[family]
    model, twin = load_model(fp8_dir), load_model(twin_dir)
    held = {p.dtype for p in model.parameters()}
    assert fp8_kernels.FP8 in held and torch.float32 in held
    ids = prompt(40, seed=1)
    for chunk in (16, 1):
        assert rel_err(logits(model, ids, chunk), logits(twin, ids, chunk)) < EXACT


def test_what_stays_unquantized(fp8_tiny):
    """The router and shared-expert gate rows (in_proj's tail), the GDN b / a rows, the embedding
    and lm_head, norms and conv keep the model's dtype; the rest of each projection is FP8."""
    model = load_model(fp8_tiny["qwen3_5_moe"][0])
    layer = model.layers[0]
    gdn, moe = layer.mixer, layer.mlp
    assert layout(gdn.in_proj).tail.shape[0] == 2 * gdn.num_value_heads
    assert layout(moe.in_proj).rows == 2 * moe.shared_expert.inter
    assert moe.router.dtype == torch.float32 and moe.router.shape == (moe.num_experts, model.config.hidden_size)
    for name in ("embed_tokens", "lm_head"):
        assert getattr(model, name).dtype == torch.float32
    for module in (gdn, moe, model.layers[1].mixer):
        for name, p in module.named_parameters(recurse=False):
            quantized = name in ("in_proj", "out_proj", "qkv_proj", "o_proj", "w13", "w2")
            assert (p.dtype == fp8_kernels.FP8) == quantized, name


def test_prefill_passes_within_activation_quantization(qwen_like):
    """Prefill passes (> 64 routed pairs) quantize the experts' inputs per 1 x 128 group: against the
    twin, mean KL of the next-token distribution and top-1 agreement over 200 positions (measured
    at commit time: KL 3.2e-4, top-1 0.90; 6e-4 / 0.9 while the dense projections quantized theirs
    too (fp8_gemm=triton); bf16-rounded inputs alone give KL ~1e-5)."""
    fp8_dir, twin_dir, _ = qwen_like
    model, twin = load_model(fp8_dir), load_model(twin_dir)
    kls, agree = [], []
    for seed in range(5):
        ids = prompt(40, seed=10 + seed)
        ours, ref = logits(model, ids), logits(twin, ids)
        kl = torch.nn.functional.kl_div(ours.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none")
        kls.append(kl.sum(-1))
        agree.append(ours.argmax(-1) == ref.argmax(-1))
    kl, top1 = torch.cat(kls).mean().item(), torch.cat(agree).float().mean().item()
    print(f"FP8 prefill against the twin: mean KL {kl:.1e}, top-1 {top1:.3f}")
    assert kl < 5e-3 and top1 >= 0.8, (kl, top1)


def test_prefill_logprobs_last_bits_noise(qwen_like, monkeypatch):
    """The bound test_gpu_fp8_engine holds the GPU's prefill passes to: the CPU path against itself
    with relative 1e-5 noise at every activation quantizer's input (what two correct float32
    implementations differ by before the quantizer, and more) stays under PREFILL_MEDIAN_GAP with a
    margin, while being far from float32 rounding: W8A8 prefill is not reproducible to 1e-3."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    same = dict(max_num_batched_tokens=97, max_num_seqs=16, enable_prefix_caching=False)

    def run() -> list:
        llm = LLM(str(qwen_like[0]), **same)
        try:
            return llm.generate(engine_prompts(), params, use_tqdm=False)
        finally:
            llm.shutdown()

    base = run()
    g = torch.Generator().manual_seed(1)
    exact = fp8_kernels.naive.quantize_act

    def noisy(*, x: torch.Tensor, group: int):
        return exact(x=x * (1 + 1e-5 * torch.randn(x.shape, generator=g)).to(x.dtype), group=group)

    monkeypatch.setattr(linear_naive, "quantize_act", noisy)
    monkeypatch.setattr(moe_naive, "quantize_act", noisy)
    gaps = prompt_logprob_gaps(base, run())
    median = gaps[len(gaps) // 2]
    print(f"CPU FP8 prefill vs itself with 1e-5 noise before quantizing: median {median:.2e}, max {gaps[-1]:.2e}")
    assert 1e-3 < median < PREFILL_MEDIAN_GAP / 1.5


def test_greedy_tokens_against_the_twin(qwen_like):
    """The engine's greedy tokens with the FP8 checkpoint against the twin's, 12 prompts of 6 new
    tokens. Every pass up to 16 rows (a 16-token budget: chunked prefill): all equal. Prompts in one
    pass, whose prefill quantizes the experts' activations: the first token equal on most prompts
    (measured at commit time: 11/12 first tokens, 7/12 whole continuations; 10/12 and 4/12 while the
    dense projections quantized theirs too: a random model's top two logits are often near-ties)."""
    fp8_dir, twin_dir, _ = qwen_like
    prompts = [prompt(24 + 3 * i, seed=100 + i) for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def run(path, budget: int) -> list[list[int]]:
        llm = LLM(str(path), max_num_batched_tokens=budget, max_num_seqs=4, enable_prefix_caching=False)
        try:
            return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
        finally:
            llm.shutdown()

    assert run(fp8_dir, 16) == run(twin_dir, 16)
    ours, ref = run(fp8_dir, 64), run(twin_dir, 64)
    first = sum(a[0] == b[0] for a, b in zip(ours, ref, strict=True))
    whole = sum(a == b for a, b in zip(ours, ref, strict=True))
    print(f"quantized prefill: first tokens equal to the twin's {first}/12, whole continuations {whole}/12")
    assert first >= 8


UNQUANTIZED = KernelOptions(fp8_activations="unquantized")


@pytest.mark.parametrize("chunk", [None, 97, 40, 10])
def test_unquantized_activations_give_the_twin_at_every_pass_size(qwen_like, chunk):
    """fp8_activations="unquantized": no path quantizes an activation, so the FP8 model gives its
    dequantized twin's logits to float32 rounding in passes of every size: 200 rows (the dense
    projections on the dequantized weight), 97 and 40 (the default's W8A8 dense GEMM and sorted MoE),
    10 (the GEMVs and the pairs path)."""
    fp8_dir, twin_dir, _ = qwen_like
    ids = prompt(200, seed=5)
    want = logits(load_model(twin_dir), ids)
    assert rel_err(logits(load_model(fp8_dir), ids, chunk, UNQUANTIZED), want) < EXACT


def test_unquantized_activations_speculation_and_batching_change_no_token(qwen_like):
    """Under the default a decode row's activations are quantized when its pass is prefill-sized, so
    a request's tokens follow what shares its passes: four requests decoded together with MTP drafts
    (verify rows beside prompt chunks in 24-token passes) part from the same run without drafts on 2
    of the 4 (measured at commit time, within 12 tokens). Under "unquantized" they give the tokens of
    each request run alone, with drafts or without."""
    fp8_dir = str(qwen_like[0])
    prompts = [prompt(n, seed=30 + n) for n in (3, 20, 9, 40)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    batched = dict(max_num_seqs=4, max_num_batched_tokens=24, enable_prefix_caching=False, kernels=UNQUANTIZED)
    spec = {"method": "mtp", "num_speculative_tokens": 2}

    def run(**settings) -> list[list[int]]:
        llm = LLM(fp8_dir, **settings)
        try:
            return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.shutdown()

    alone = run(**{**batched, "max_num_seqs": 1, "max_num_batched_tokens": 64})
    assert run(**batched) == alone
    assert run(**batched, speculative_config=spec) == alone


def test_quantization_fp8_round_trips(qwen_like):
    """quantization="fp8" on the higher-precision checkpoint holds exactly the FP8 checkpoint's
    values and scales (the same 128 x 128 scheme), so the two give the same logits."""
    fp8_dir, _, src = qwen_like
    from_fp8, quantized = load_model(fp8_dir), load_model(src, quantization="fp8")
    params = dict(from_fp8.named_parameters())
    for name, p in quantized.named_parameters():
        assert p.dtype == params[name].dtype, name
        if p.dtype == fp8_kernels.FP8:
            assert torch.equal(p.view(torch.uint8), params[name].view(torch.uint8)), name
        else:
            assert torch.equal(p, params[name]), name
    ids = prompt(30, seed=3)
    assert torch.equal(logits(quantized, ids), logits(from_fp8, ids))


def test_random_fp8_weights(qwen_like):
    """load_format="random" with quantization="fp8": the seeded random weights quantized, so the
    model follows the random float32 model (decode-sized passes within the weights' FP8 rounding)."""
    _, _, src = qwen_like
    config = ModelConfig.from_pretrained(src)
    fp8 = load_model(None, config=config, load_format="random", quantization="fp8", seed=3)
    full = load_model(None, config=config, load_format="random", seed=3)
    assert fp8.layers[0].mlp.w13.dtype == fp8_kernels.FP8
    w = full.layers[0].mlp.w13[1]
    q = fp8.layers[0].mlp.w13
    deq = fp8_kernels.dequantize_weight(q[1], layout(q).scale[1])
    assert ((deq - w).abs() <= w.abs().amax() / 16).all()  # e4m3: 3 mantissa bits per block's range
    ids = prompt(12, seed=4)
    ours, ref = logits(fp8, ids), logits(full, ids)
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.75


def test_ignored_module_stays_unquantized(qwen_like, tmp_path):
    """A projection the checkpoint leaves in its dtype (modules_to_not_convert) keeps it: with layer
    1's q_proj unquantized, that layer's fused q | k | v weight is not FP8 (its k and v
    dequantized), layer 3's is; the logits still match the twin."""
    _, _, src = qwen_like
    make_fp8(src, tmp_path / "fp8", tmp_path / "twin", ignored=("model.layers.1.self_attn.q_proj",))
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert "model.layers.1.self_attn.q_proj" in config["quantization_config"]["modules_to_not_convert"]
    model, twin = load_model(tmp_path / "fp8"), load_model(tmp_path / "twin")
    assert model.layers[1].mixer.qkv_proj.dtype == torch.float32
    assert model.layers[3].mixer.qkv_proj.dtype == fp8_kernels.FP8
    ids = prompt(16, seed=5)
    assert rel_err(logits(model, ids), logits(twin, ids)) < EXACT


def _rewrite(src, dst, edit) -> None:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))


def test_wrong_scale_shape_names_the_tensor(fp8_tiny, tmp_path):
    fp8_dir, _ = fp8_tiny["qwen3_5_moe"]
    name = "model.layers.0.linear_attn.in_proj_qkv.weight_scale_inv"

    def edit(t):
        t[name] = torch.ones(t[name].shape[0] + 1, t[name].shape[1])

    _rewrite(fp8_dir, tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=f"'{name}' has shape"):
        load_model(tmp_path / "bad")


def test_missing_scale_names_the_tensor(fp8_tiny, tmp_path):
    fp8_dir, _ = fp8_tiny["qwen3_5_moe"]
    name = "model.layers.2.mlp.experts.3.down_proj.weight"
    _rewrite(fp8_dir, tmp_path / "bad", lambda t: t.pop(name + "_scale_inv"))
    with pytest.raises(CheckpointError, match=f"'{name}' is float8 without"):
        load_model(tmp_path / "bad")


def test_quantization_config_fields():
    """Qwen's FP8 config is read (composite configs hold it at the top level); what deltaserve
    cannot serve is a ConfigError naming the field."""
    qwen = {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head", "model.language_model.layers.0.linear_attn.in_proj_a", "mlp.gate"],
    }  # fmt: skip
    scheme = Fp8Scheme.from_hf(qwen)
    assert scheme.block == (128, 128)
    assert not scheme.quantizes("model.layers.0.linear_attn.in_proj_a")
    assert not scheme.quantizes("model.layers.7.mlp.gate")
    assert scheme.quantizes("model.layers.7.mlp.gate_proj") and scheme.quantizes("model.layers.1.linear_attn.in_proj_a")
    pattern = Fp8Scheme(ignored=("re:.*experts\\.\\d+\\.down_proj",))
    assert not pattern.quantizes("model.layers.0.mlp.experts.3.down_proj")
    for field, value in (
        ("quant_method", "awq"), ("activation_scheme", "static"), ("weight_block_size", None),
        ("weight_block_size", [96, 128]), ("fmt", "e5m2"),
    ):  # fmt: skip
        with pytest.raises(ConfigError, match=f"quantization_config.{field}"):
            edited = {k: v for k, v in qwen.items() if k != field}
            Fp8Scheme.from_hf(edited if value is None else {**edited, field: value})


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_tensor_parallel_shards(qwen_like, expert_parallel):
    """Rank 1 of 2: every FP8 weight's values times its scales are exactly the twin's shard of that
    weight (experts split to 64 rows a rank: local scale blocks inside the checkpoint's 128-row
    ones; or whole experts a rank), and its tail the twin's last rows."""
    fp8_dir, twin_dir, _ = qwen_like
    layout_ = ParallelLayout(tp_rank=1, tp_size=2, expert_parallel=expert_parallel)
    model, twin = load_model(fp8_dir, layout=layout_), load_model(twin_dir, layout=layout_)
    twin_params = dict(twin.named_parameters())
    checked = 0
    for name, p in model.named_parameters():
        lay = layout(p)
        if lay is None:
            continue
        ref = twin_params[name]
        assert torch.equal(fp8_kernels.dequantize_weight(p, lay.scale), ref[..., : lay.rows, :]), name
        if lay.tail is not None:
            assert torch.equal(lay.tail, ref[..., lay.rows :, :]), name
        checked += 1
    assert checked == 4 * 6  # a layer: in_proj or qkv, out_proj or o_proj, w13, w2, the MoE in_proj, shared w2


def test_fp8_accuracy_bench_harness(qwen_like):
    """bench.fp8_accuracy on the CPU (float32): bf16 (here float32), FP8 and the dequantized twin
    over one prefill then one token a pass. With the prefill in passes of 16 rows no activation is
    quantized and the CPU path dequantizes, so FP8 and the twin agree to float32 rounding in the
    logits and in every layer, run free or fed the reference's stream (the hooks replace each
    layer's input and record its output); in one prefill pass the activation quantization shows,
    as in test_prefill_passes_within_activation_quantization, and each layer's local error stays
    near the weight rounding's (a few percent)."""
    from deltaserve.bench.fp8_accuracy import format_report, measure

    config = ModelConfig.from_pretrained(qwen_like[2])
    ids = prompt(40, seed=6)
    run = dict(ids=ids, decode=6, seed=1, device="cpu", dtype=torch.float32, log=lambda _: None)
    exact, quantized = measure(config, chunk=16, **run), measure(config, **run)
    assert exact["models"]["twin"]["converted"] == 4 * 6  # as test_tensor_parallel_shards counts
    assert exact["models"]["fp8"]["weight_bytes"] < exact["models"]["bf16"]["weight_bytes"] / 3
    for part in ("prefill", "decode"):
        same = exact[part]["twin~fp8"]
        assert same["top1_agreement"] == 1.0 and abs(same["mean_kl"]) < 1e-6 and same["logit_corr"] > 1 - 1e-6
        for kind, errs in exact["layers"][part].items():
            assert max(errs["twin~fp8"]) < 1e-5, (part, kind)
            assert min(errs["bf16~twin"] if kind == "local" else errs["bf16~twin"][:1]) > 1e-3
        fp8, twin = exact[part]["bf16~fp8"], exact[part]["bf16~twin"]
        assert fp8["top1_agreement"] == twin["top1_agreement"]
        assert fp8["mean_kl"] == pytest.approx(twin["mean_kl"], 1e-3)
        assert exact[part]["unrelated"]["top1_agreement"] < 0.5
    prefill = quantized["layers"]["prefill"]
    assert 1e-3 < max(prefill["local"]["twin~fp8"]) < 3 * max(prefill["local"]["bf16~twin"]) < 0.3
    assert quantized["prefill"]["twin~fp8"]["mean_kl"] < 5e-3
    lines = format_report(quantized)
    assert any(line.startswith("per-layer relative error") for line in lines) and len(lines) > 12


def test_dequantized_twin_in_place(fp8_tiny):
    """bench.fp8_accuracy's twin: an FP8 model dequantized in place holds exactly the twin
    checkpoint's parameters (blocks smaller than 128 inside fused weights, tails), and nothing FP8."""
    from deltaserve.bench.fp8_accuracy import dequantize_in_place

    for family, (fp8_dir, twin_dir) in fp8_tiny.items():
        model, twin = load_model(fp8_dir), load_model(twin_dir)
        assert dequantize_in_place(model, torch.float32) > 0
        ours, ref = dict(model.named_parameters()), dict(twin.named_parameters())
        assert ours.keys() == ref.keys(), family
        for name, p in ours.items():
            assert layout(p) is None and torch.equal(p, ref[name]), (family, name)


def test_real_shape_fp8_layout():
    """Qwen3.5-35B-A3B's shapes under the FP8 scheme (built on the meta device: no memory): per layer
    the GDN in_proj (q | k | v | z FP8, its 64 b / a rows a bf16 tail) or the attention q_gate | k | v,
    out_proj / o_proj, the 256 experts' w13 and w2, the MoE in_proj's shared gate_up (router, shared
    gate and padding: a 264-row bf16 tail) and the shared expert's down projection are FP8 in 128 x 128
    blocks; the 248,320-row embedding and lm_head, norms and conv stay bf16; 35.7 GB in all."""
    from deltaserve.bench.presets import preset_config
    from deltaserve.layers.loader import build_model
    from deltaserve.layers.quant import apply_scheme

    config = preset_config("qwen3_5_35b_a3b")
    model = build_model(config, dtype=torch.bfloat16, device="meta")
    apply_scheme(model.fp8_projections(), Fp8Scheme(), "meta", torch.bfloat16)
    fp8 = {}
    for name, p in model.named_parameters():
        lay = layout(p)
        if lay is None:
            assert p.dtype in (torch.bfloat16, torch.float32), name  # float32: the block scales
            continue
        tail = None if lay.tail is None else tuple(lay.tail.shape)
        fp8[name] = (tuple(p.shape), lay.block, tuple(lay.scale.shape), tail)
    assert model.lm_head.dtype == model.embed_tokens.dtype == torch.bfloat16
    assert model.lm_head.shape == (248320, 2048)
    gdn, attn = config.gdn_layer_ids[0], config.attention_layer_ids[0]
    block = (128, 128)
    assert fp8[f"layers.{gdn}.mixer.in_proj"] == ((12288, 2048), block, (96, 16), (64, 2048))
    assert fp8[f"layers.{gdn}.mixer.out_proj"] == ((2048, 4096), block, (16, 32), None)
    assert fp8[f"layers.{attn}.mixer.qkv_proj"] == ((9216, 2048), block, (72, 16), None)
    assert fp8[f"layers.{attn}.mixer.o_proj"] == ((2048, 4096), block, (16, 32), None)
    for i in (gdn, attn):
        assert fp8[f"layers.{i}.mlp.w13"] == ((256, 1024, 2048), block, (256, 8, 16), None)
        assert fp8[f"layers.{i}.mlp.w2"] == ((256, 2048, 512), block, (256, 16, 4), None)
        assert fp8[f"layers.{i}.mlp.in_proj"] == ((1024, 2048), block, (8, 16), (264, 2048))
        assert fp8[f"layers.{i}.mlp.shared_expert.w2"] == ((2048, 512), block, (16, 4), None)
    assert len(fp8) == 6 * config.num_layers
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert 35.5e9 < total < 36e9


def test_fp8_accuracy_truncated_preset():
    """--layers N: the preset with its first N layers (their types kept); --set: its fields."""
    from deltaserve.bench.fp8_accuracy import truncated
    from deltaserve.bench.presets import preset_config

    full, short = preset_config("qwen3_5_35b_a3b"), truncated("qwen3_5_35b_a3b", 6, {"num_experts": 16})
    assert short.num_layers == 6 and short.layer_types == full.layer_types[:6]
    assert short.hidden_size == full.hidden_size and (full.num_experts, short.num_experts) == (256, 16)


def test_fp8_accuracy_cli_on_cpu(tmp_path, capsys):
    """The bench's command on the CPU reference path: a narrow 4-layer model of the preset's family,
    the report printed and written; a malformed --set is an error naming the option."""
    from deltaserve.bench.fp8_accuracy import main

    narrow = {
        "hidden_size": 128, "num_attention_heads": 2, "head_dim": 64, "linear_num_key_heads": 2,
        "linear_num_value_heads": 2, "linear_key_head_dim": 64, "linear_value_head_dim": 64, "num_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128,
        "vocab_size": 512,
    }  # fmt: skip
    sets = [arg for k, v in narrow.items() for arg in ("--set", f"{k}={v}")]
    out = tmp_path / "acc.json"
    argv = ["--device", "cpu", "--layers", "4", "--tokens", "24", "--decode", "4", "--json", str(out), *sets]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["num_layers"] == 4 and report["overrides"]["hidden_size"] == 128
    assert report["prefill"]["twin~fp8"]["positions"] == 20 and len(report["layers"]["decode"]["free"]["bf16~fp8"]) == 4
    assert "summary (prefill / decode)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--device", "cpu", "--set", "hidden_size"])
    assert "--set takes FIELD=VALUE" in capsys.readouterr().err
