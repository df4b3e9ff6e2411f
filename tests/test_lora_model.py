"""Adapters on the layer stack against PEFT's merged model (CPU, float32): for each family and each
target set (attention only, GDN only, the experts only, all) the logits of a sequence on an adapter
are the merged model's within 1e-4 of the logit scale, in the same passes as a base-model sequence
whose logits stay the base model's; chunked prefill and decode steps included."""

from __future__ import annotations

import pytest
import torch
from lora_adapters import TARGET_SETS, peft_adapter, write_adapter
from passes import Sequences
from test_model_vs_transformers import assert_close, hf_logits, prompt
from tiny_models import FAMILIES

from deltaserve.layers.loader import load_model
from deltaserve.workers.config import LoraConfig
from deltaserve.workers.lora import AdapterSlots
from deltaserve.workers.plan import LoraLoad


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tiny_checkpoints):
    path, hf = tiny_checkpoints[request.param]
    model = load_model(path)
    slots = AdapterSlots(model, LoraConfig(enable_lora=True, max_loras=3, max_lora_rank=8))
    return request.param, model, slots, hf


@pytest.mark.parametrize("which", TARGET_SETS)
def test_adapter_logits_match_peft_merged(family, which, tmp_path):
    name, model, slots, hf = family
    merged = peft_adapter(hf, name, which, tmp_path / which, seed=TARGET_SETS.index(which))
    slots.place([LoraLoad(slot=2, key=100 + TARGET_SETS.index(which), name=which, path=str(tmp_path / which))])
    seqs = Sequences(model, lora=slots)
    ids, base_ids = prompt(30, seed=3), prompt(21, seed=4)
    seqs.add("lora", lora_slot=2)
    seqs.add("base")
    got, base = seqs.run([("lora", ids[:17]), ("base", base_ids)])
    rest = seqs.run([("lora", ids[17:25])])[0]
    steps = [seqs.run([("lora", [t]), ("base", [3])])[0] for t in ids[25:]]  # decode rows, mixed with base
    ref = hf_logits(merged, ids)
    assert not torch.allclose(ref, hf_logits(hf, ids), atol=1e-2), "the adapter changes the logits"
    assert_close(torch.cat([got, rest, *steps]), ref)
    assert_close(base, hf_logits(hf, base_ids))


def test_per_expert_layout(tiny_checkpoints, tmp_path):
    """Expert adapters written per expert (experts.N.{gate,up,down}_proj, separate A for gate and up)
    against transformers' model with the deltas merged into its fused experts by hand."""
    path, hf = tiny_checkpoints["qwen3_5_moe"]
    model = load_model(path)
    slots = AdapterSlots(model, LoraConfig(enable_lora=True, max_loras=1, max_lora_rank=8))
    g = torch.Generator().manual_seed(5)
    cfg = hf.config
    h, inter, rank, scale = cfg.hidden_size, cfg.moe_intermediate_size, 4, 16 / 4
    merged = __import__("copy").deepcopy(hf)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        experts = merged.model.layers[layer].mlp.experts
        for e in range(cfg.num_experts):
            for proj, (out_f, in_f) in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
                a = torch.randn(rank, in_f, generator=g) * in_f**-0.5
                b = torch.randn(out_f, rank, generator=g) * 0.5
                prefix = f"model.layers.{layer}.mlp.experts.{e}.{proj}"
                tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = a, b
                delta = scale * b @ a
                with torch.no_grad():
                    if proj == "down_proj":
                        experts.down_proj[e] += delta
                    else:
                        rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
                        experts.gate_up_proj[e, rows] += delta
    write_adapter(tmp_path / "per_expert", tensors, r=rank, lora_alpha=16)
    slots.place([LoraLoad(0, 1, "per_expert", str(tmp_path / "per_expert"))])
    seqs = Sequences(model, lora=slots)
    ids = prompt(19, seed=6)
    seqs.add("a", lora_slot=0)
    (got,) = seqs.run([("a", ids)])
    assert_close(got, hf_logits(merged, ids))
