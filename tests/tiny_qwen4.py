"""Tiny random Qwen4-Exp checkpoints made by transformers (text `qwen4_exp_text` and composite
`qwen4_exp`), with QSA, PLE and hyper-connections all on.

Sizes are odd on purpose: a compress ratio that does not divide the page size (3 against the tests'
pages of 4 and the engine's 16), a budget of 4 blocks (prompts past 15 tokens select), 3 streams,
PLE on both GDN layers with its tables saved in 12 shards, 4 indexer heads of 12 dims over a rotary
part of 8. Head counts divide by 2 (TP = 2).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tiny_models import VOCAB_SIZE, tiny_tokenizer

EOS = 2

QWEN4_TEXT = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=48,
    num_hidden_layers=4,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=6,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    linear_conv_kernel_dim=4,
    num_experts=6,
    num_experts_per_tok=3,
    moe_intermediate_size=20,
    shared_expert_intermediate_size=24,
    max_position_embeddings=1024,
    initializer_range=0.2,
    # the real checkpoint's spelling, which every transformers release accepts and renames (to a name
    # that changed between releases: test_qwen4_config reads each)
    layer_types=["linear_attention", "full_attention"] * 2,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    hc_count=3,
    hc_lowrank=10,
    ple_layer_ids=[1, 3],
    ple_embed_dim=24,
    ple_conv_kernel_size=3,
    ngram_size=3,
    heads_per_ngram=2,
    ngram_vocab_size_base=50,
    make_ngram_vocab_size_divisible_by=8,
    split_ngram_parts=12,
    indexer_n_heads=4,
    indexer_kv_heads=1,
    indexer_head_dim=12,
    indexer_budget=12,
    indexer_compress_ratio=3,
    eos_token_id=EOS,
    bos_token_id=1,
)

VISION = dict(
    depth=1,
    hidden_size=16,
    intermediate_size=32,
    num_heads=2,
    out_hidden_size=48,
    patch_size=4,
    num_position_embeddings=16,
)


def text_config(**overrides):
    from transformers import Qwen4ExpTextConfig

    return Qwen4ExpTextConfig(**{**QWEN4_TEXT, **overrides})


def composite_config(**overrides):
    from transformers import Qwen4ExpConfig

    text = text_config(**overrides).to_dict()
    return Qwen4ExpConfig(text_config=text, vision_config=dict(VISION), eos_token_id=EOS)


def randomize(model) -> None:
    """Move what transformers initialises to exact constants away from them, so that a mis-applied
    (1 + w) or a dropped term shows up: every norm weight, and PLE's zero-initialised conv."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.normal_(0.0, 0.3)
            elif name.endswith("ple.conv1d.weight"):
                p.normal_(0.0, 0.5)


def hf_model(composite: bool = False, seed: int = 0, **overrides):
    """A float32 transformers model with its random init, randomized further (see randomize)."""
    from transformers import AutoModelForCausalLM, Qwen4ExpForConditionalGeneration

    torch.manual_seed(seed)
    if composite:
        model = Qwen4ExpForConditionalGeneration(composite_config(**overrides)).float()
    else:
        model = AutoModelForCausalLM.from_config(text_config(**overrides), dtype=torch.float32)
    randomize(model)
    return model.eval()


def save_tiny_qwen4(path: Path, composite: bool = False, seed: int = 0, **overrides):
    """save_pretrained a tiny Qwen4-Exp (with a tokenizer) into `path`; returns the transformers model."""
    model = hf_model(composite, seed, **overrides)
    model.save_pretrained(path)
    (Path(path) / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS, "bos_token_id": 1}))
    tiny_tokenizer().save(str(Path(path) / "tokenizer.json"))
    return model


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """transformers' uncached forward: the reference."""
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()


def hf_greedy(hf, ids: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens by uncached forwards (one whole-sequence forward a token), stopping at EOS."""
    ids, out = list(ids), []
    for _ in range(max_tokens):
        token = int(hf_logits(hf, ids)[-1].argmax())
        out.append(token)
        if token == EOS:
            break
        ids.append(token)
    return out
