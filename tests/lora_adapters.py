"""LoRA adapters for the tests, made by PEFT itself on the tiny transformers checkpoints (the oracle:
PEFT's merged model), and hand-written PEFT-format files for what PEFT cannot write on transformers 5
(per-expert expert adapters) or for bad input."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

TARGET_SETS = ("attention", "gdn", "experts", "all")
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]  # the dense MLP's and the shared expert's
EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]  # transformers 5's fused 3-D experts


def gdn_modules(family: str) -> list[str]:
    if family == "qwen3_next":
        return ["in_proj_qkvz", "in_proj_ba", "out_proj"]
    return ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]


def targets(family: str, which: str) -> tuple[list[str], list[str]]:
    """(target_modules, target_parameters) of a target set; "experts" on the dense family is its MLP."""
    moe = family != "qwen3_5"
    if which == "attention":
        return ATTENTION, []
    if which == "gdn":
        return gdn_modules(family), []
    if which == "experts":
        return ([], EXPERTS) if moe else (MLP, [])
    assert which == "all"
    if not moe:
        return ATTENTION + gdn_modules(family) + MLP, []
    modules = ATTENTION + gdn_modules(family) + MLP + ["shared_expert_gate"]
    if family == "qwen3_5_moe":  # MLP names the shared expert; the experts and the router as parameters
        return modules, [*EXPERTS, "mlp.gate.weight"]
    # PEFT turns qwen3_next's gate_proj / up_proj / down_proj targets into the fused experts' parameters
    # (gate_up at rank 2r), so the shared expert and the dense MLP are targeted as parameters
    shared = [f"shared_expert.{m}.weight" for m in MLP]
    return modules, ["mlp.gate.weight", *shared, *[f"mlp.{m}.weight" for m in MLP]]


def peft_adapter(hf_model, family: str, which: str, path: Path, *, seed: int, rank: int = 8, alpha: float = 16.0):
    """Save a PEFT adapter with random A and B on `which` into `path`; returns PEFT's merged model."""
    from peft import LoraConfig, get_peft_model

    modules, params = targets(family, which)
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=modules, target_parameters=params or None, init_lora_weights=False
    )
    model = get_peft_model(copy.deepcopy(hf_model), config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:  # large enough to move the greedy tokens
                p.copy_(torch.randn(p.shape, generator=g) * 0.5 * p.shape[-1] ** -0.5)
            if "experts.base_layer.lora_B" in name and which == "all" and family == "qwen3_next":
                _block_diagonal_(p, hf_model.config.num_experts)
    model.save_pretrained(path)
    return model.merge_and_unload().eval()


def _block_diagonal_(b: torch.Tensor, experts: int) -> None:
    """Zero the off-diagonal blocks of a rank-2r fused gate_up B [2I, 2r * E]: what PEFT writes when it
    converts a per-expert gate_proj + up_proj adapter (trained on transformers 4) to the fused layout."""
    rows, rank = b.shape[0] // 2, b.shape[1] // (2 * experts)
    view = b.view(2 * rows, 2 * rank, experts)
    view[:rows, rank:] = 0
    view[rows:, :rank] = 0


def write_adapter(path: Path, tensors: dict[str, torch.Tensor], **config) -> Path:
    """A PEFT-format adapter folder from tensors named as PEFT names them (without the prefix)."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "bias": "none", "target_modules": [], **config}
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    named = {f"base_model.model.{k}": v.contiguous() for k, v in tensors.items()}
    save_file(named, str(path / "adapter_model.safetensors"))
    return path


def greedy(hf_model, prompt: list[int], steps: int) -> list[int]:
    """Greedy tokens by uncached forwards (the reference DESIGN.md names)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            logits = hf_model(torch.tensor([ids]), use_cache=False).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]
