"""LoRA on a CUDA device (skipped on CPU): the compiled segmented kernels against the reference at
the Qwen3.5-35B-A3B shapes in bf16, and through the engine (float32, IEEE dots) decode CUDA graphs
give the eager tokens and PEFT's merged model's greedy tokens, adapters and base rows mixed."""

from __future__ import annotations

import copy

import pytest
import torch
from test_model_vs_transformers import prompt

from deltaserve import LLM, LoRARequest, SamplingParams
from deltaserve.layers.kernels import lora as lora_kernels
from deltaserve.layers.kernels.lora import naive
from deltaserve.layers.kernels.moe import naive as moe_naive
from deltaserve.layers.kernels.moe import triton_moe as tm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the H200 runs these)"),
]

POOL = dict(num_kv_blocks=512)


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("tokens", [1, 64, 2048])
def test_add_lora_real_shapes_bf16(tokens):
    """Attention's q | k | v of the 35B shape (three slices), 8 slots of rank 16, a third of the rows
    without an adapter."""
    g = torch.Generator(device="cuda").manual_seed(tokens)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    h, bounds, slots, rank = 2048, (0, 8192, 8704, 9216), 8, 16
    x = torch.randn(tokens, h, generator=g, device="cuda").to(torch.bfloat16)
    a = (torch.randn(slots, 3 * rank, h, generator=g, device="cuda") * h**-0.5).to(**bf)
    b = (torch.randn(slots, bounds[-1], rank, generator=g, device="cuda") * 0.1).to(**bf)
    # row 0 has an adapter (a lone row too); every twelfth row from the ninth has none
    token_slots = ((torch.arange(tokens, device="cuda") + 4) % (slots + 4) - 4).clamp(min=-1).to(torch.int32)
    y = torch.randn(tokens, bounds[-1], generator=g, device="cuda").to(torch.bfloat16)
    ref = naive.add_lora(
        y=y.float().clone(), x=x.float(), a=a.float(), b=b.float(), bounds=bounds, token_slots=token_slots
    )
    rows = lora_kernels.lora_rows(keys=token_slots, num_keys=slots)
    out = lora_kernels.add_lora(y=y.clone(), x=x, a=a, b=b, bounds=bounds, rows=rows)
    assert rel(out - y, ref - y.float()) < 2e-2
    base = token_slots < 0
    assert torch.equal(out[base], y[base])


@pytest.mark.parametrize("tokens", [1, 64, 512])  # 512: the shrinks' grouped (prefill) form
def test_expert_deltas_real_shapes_bf16(tokens):
    g = torch.Generator(device="cuda").manual_seed(7)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    h, inter, experts, top_k, slots, rank = 2048, 512, 256, 8, 8, 16
    x = torch.randn(tokens, h, generator=g, device="cuda").to(torch.bfloat16)
    w13 = (torch.randn(experts, 2 * inter, h, generator=g, device="cuda") * h**-0.5).to(**bf)
    w2 = (torch.randn(experts, h, inter, generator=g, device="cuda") * inter**-0.5).to(**bf)
    weights, ids = moe_naive.route_topk_softmax(
        router_logits=torch.randn(tokens, experts, generator=g, device="cuda"), top_k=top_k, renormalize=True
    )
    lora = lora_kernels.ExpertLoraWeights(
        a13=(torch.randn(slots, experts, 2 * rank, h, generator=g, device="cuda") * h**-0.5).to(**bf),
        b13=(torch.randn(slots, experts, 2 * inter, rank, generator=g, device="cuda") * 0.1).to(**bf),
        a2=(torch.randn(slots, experts, rank, inter, generator=g, device="cuda") * inter**-0.5).to(**bf),
        b2=(torch.randn(slots, experts, h, rank, generator=g, device="cuda") * 0.1).to(**bf),
    )
    token_slots = (torch.arange(tokens, device="cuda") % (slots + 1) - 1).to(torch.int32)
    args = dict(hidden=x, w13=w13, w2=w2, topk_weights=weights, topk_ids=ids)
    deltas = lora_kernels.ExpertDeltas(hidden=x, token_slots=token_slots, weights=lora, expert_offset=0)
    out = tm.fused_moe(**args, deltas=deltas)
    ref_deltas = lora_kernels.ExpertDeltas(
        hidden=x.float(), token_slots=token_slots, weights=lora_kernels.ExpertLoraWeights(*(t.float() for t in lora)),
        expert_offset=0, triton=False,
    )  # fmt: skip
    ref = moe_naive.fused_moe(
        hidden=x.float(), w13=w13.float(), w2=w2.float(), topk_weights=weights, topk_ids=ids, deltas=ref_deltas
    )
    assert rel(out, ref) < 2e-2


@pytest.mark.parametrize("tokens", [1, 64])
def test_moe_block_adapters_with_shared_expert_and_norm_bf16(tokens):
    """The MoE block's last kernel with every adapter at the 35B shape in bf16: the experts' deltas in
    the GEMVs (1 token) or the grouped GEMMs (64), the shared expert's down adapter (its shrink folded
    into the experts' down shrink launch) under its gate, and the next norm, against float32."""
    g = torch.Generator(device="cuda").manual_seed(11)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)

    h, inter, shared_inter, experts, top_k, slots, rank = 2048, 512, 512, 256, 8, 8, 16
    x, w13, w2 = rand(tokens, h), rand(experts, 2 * inter, h, scale=h**-0.5), rand(experts, h, inter, scale=inter**-0.5)
    logits = torch.randn(tokens, experts, generator=g, device="cuda")
    lora = lora_kernels.ExpertLoraWeights(
        a13=rand(slots, experts, 2 * rank, h, scale=h**-0.5), b13=rand(slots, experts, 2 * inter, rank, scale=0.1),
        a2=rand(slots, experts, rank, inter, scale=inter**-0.5), b2=rand(slots, experts, h, rank, scale=0.1),
    )  # fmt: skip
    gate_up, gate = rand(tokens, 2 * shared_inter + 8)[:, : 2 * shared_inter], rand(tokens, 1)
    shared_w2 = rand(h, shared_inter, scale=shared_inter**-0.5)
    a_s, b_s = rand(slots, rank, shared_inter, scale=shared_inter**-0.5), rand(slots, h, rank, scale=0.1)
    add_norm = moe_naive.AddNorm(rand(tokens, h), rand(h, scale=0.1), 1e-6)
    token_slots = (torch.arange(tokens, device="cuda") % (slots + 1) - 1).to(torch.int32)
    deltas = lora_kernels.ExpertDeltas(hidden=x, token_slots=token_slots, weights=lora, expert_offset=0)
    v = deltas.fold_shrink(x=gate_up, a=a_s, keys=token_slots, glu=True)
    shared = moe_naive.SharedExpert(gate_up, shared_w2, gate, lora=moe_naive.PairLowRank(token_slots, v, b_s))
    out = tm.routed_moe(
        hidden=x, w13=w13, w2=w2, router_logits=logits, top_k=top_k, renormalize=True, shared=shared,
        add_norm=add_norm, deltas=deltas,
    )  # fmt: skip
    f = lambda t: t.float()  # noqa: E731
    ref_deltas = lora_kernels.ExpertDeltas(
        hidden=f(x), token_slots=token_slots, weights=lora_kernels.ExpertLoraWeights(*map(f, lora)), expert_offset=0,
        triton=False,
    )  # fmt: skip
    v_ref = naive.shrink(x=f(gate_up), a=f(a_s), keys=token_slots, glu=True)
    ref_shared = moe_naive.SharedExpert(
        f(gate_up), f(shared_w2), f(gate), lora=moe_naive.PairLowRank(token_slots, v_ref, f(b_s))
    )
    ref = moe_naive.routed_moe(
        hidden=f(x), w13=f(w13), w2=f(w2), router_logits=logits, top_k=top_k, renormalize=True, shared=ref_shared,
        add_norm=moe_naive.AddNorm(f(add_norm.residual), f(add_norm.weight), 1e-6), deltas=ref_deltas,
    )  # fmt: skip
    for got, want in zip(out, ref, strict=True):
        assert not got.isnan().any()
        assert rel(got, want) < 2e-2


def test_lora_graphs_give_eager_and_peft_tokens(tiny_checkpoints, tmp_path, monkeypatch):
    from lora_adapters import greedy, peft_adapter  # PEFT: only this test needs it on the GPU machine

    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    path, hf = tiny_checkpoints["qwen3_5_moe"]
    merged = peft_adapter(hf, "qwen3_5_moe", "all", tmp_path / "all", seed=2)
    lora = LoRARequest("all", 1, str(tmp_path / "all"))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    rows = [prompt(n, seed=n) for n in (3, 17, 40, 9)]
    loras = [lora, None, lora, None]
    settings = dict(device="cuda", dtype="float32", enable_lora=True, max_lora_rank=8, max_num_seqs=8, **POOL)
    eager = LLM(str(path), enforce_eager=True, **settings)
    graphs = LLM(str(path), **settings)
    assert graphs.engine.executor.runner.graphs is not None
    a = [o.outputs[0].token_ids for o in eager.generate(rows, params, lora_request=loras, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in graphs.generate(rows, params, lora_request=loras, use_tqdm=False)]
    assert a == b
    # the references on the GPU too: the GPU machine has fla, which transformers' CPU forward would call
    hf_gpu, merged_gpu = copy.deepcopy(hf).to("cuda"), merged.to("cuda")
    assert a == [greedy(merged_gpu if lo else hf_gpu, ids, 12) for ids, lo in zip(rows, loras, strict=True)]
