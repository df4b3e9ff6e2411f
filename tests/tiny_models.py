"""Tiny random checkpoints made by transformers itself (the correctness oracle), one per family.

Sizes are odd on purpose: head counts that are not powers of two, several KV heads, GDN value heads
a multiple of key heads, a layer stack that mixes GDN and attention, and (qwen3_next) a dense layer
among the MoE ones.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")

VOCAB_SIZE = 320
# head counts that divide by 2 (TP = 2); qwen3_5 has one KV head, replicated on both ranks
TP2_OVERRIDES = {
    "qwen3_next": dict(linear_num_key_heads=2, linear_num_value_heads=6),
    "qwen3_5": dict(linear_num_key_heads=2, linear_num_value_heads=4, num_key_value_heads=1),
    "qwen3_5_moe": dict(linear_num_key_heads=2, linear_num_value_heads=6),
}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2; EOS is 2
# the config field that declares the MTP head, as each family's released checkpoints name it
MTP_CONFIG_FIELD = {"qwen3_next": "num_nextn_predict_layers", "qwen3_5": "mtp_num_hidden_layers"}
MTP_CONFIG_FIELD["qwen3_5_moe"] = MTP_CONFIG_FIELD["qwen3_5"]

_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=48,
    num_hidden_layers=4,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=3,
    linear_num_value_heads=6,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    linear_conv_kernel_dim=4,
    max_position_embeddings=512,
    initializer_range=0.2,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    eos_token_id=2,
    bos_token_id=1,
)


def hf_config(family: str, **overrides):
    """The transformers config object of a tiny model of `family`."""
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig

    kw = dict(_COMMON)
    if family == "qwen3_next":
        kw.update(
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=20,
            shared_expert_intermediate_size=24,
            intermediate_size=40,
            mlp_only_layers=[2],
            norm_topk_prob=False,
        )
        cls = Qwen3NextConfig
    elif family == "qwen3_5":
        kw.update(intermediate_size=40, tie_word_embeddings=True)
        cls = Qwen3_5TextConfig
    elif family == "qwen3_5_moe":
        kw.update(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=20, shared_expert_intermediate_size=24)
        cls = Qwen3_5MoeTextConfig
    else:
        raise ValueError(family)
    kw[MTP_CONFIG_FIELD[family]] = 1
    kw.update(overrides)
    return cls(**kw)


def hf_model(config, seed: int = 0):
    """A float32 transformers model with its own random init (GDN A_log/dt_bias included)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # widen the norms away from exactly 1 so that a mis-applied (1 + w) shows up
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.normal_(0.0, 0.3)
    return model.eval()


_CORPUS = [
    "the quick brown fox jumps over the lazy dog. ",
    "hello world, hello there! serving engines stream tokens. ",
    "caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fcber stra\u00dfe ",
    "\u4f60\u597d\u4e16\u754c \u6570\u636e \u6a21\u578b ",
    "numbers 0123456789 and symbols #$%&*()[]{} ",
]


def tiny_tokenizer():
    """A byte-level BPE tokenizer of exactly VOCAB_SIZE ids: multi-byte characters that were not
    merged decode byte by byte, which is what incremental detokenization must handle."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 50, trainer=trainer)
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    return tok


def mtp_donor(family: str, seed: int = 0, **overrides):
    """A one-layer transformers model of `family` whose layer (full attention, the family's FFN of a
    first layer) is the MTP head's decoder layer: the tensors save_tiny writes as mtp.layers.0.*,
    and the reference's decoder layer (transformers itself drops mtp.* weights)."""
    extra = {"mlp_only_layers": []} if family == "qwen3_next" else {}
    config = hf_config(family, **{**overrides, **extra, "num_hidden_layers": 1, "layer_types": ["full_attention"]})
    return hf_model(config, seed=seed + 7919)


def mtp_tensors(family: str, seed: int = 0, **overrides) -> dict[str, torch.Tensor]:
    """The random mtp.* tensors of a tiny checkpoint, by their checkpoint names: fc, the two pre-fc
    norms, the final norm and the decoder layer (as transformers saves a layer: experts per expert)."""
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as tmp:
        mtp_donor(family, seed, **overrides).save_pretrained(tmp)
        saved = load_file(str(Path(tmp) / "model.safetensors"))
    out = {"mtp." + k[len("model.") :]: v for k, v in saved.items() if k.startswith("model.layers.0.")}
    hidden = hf_config(family, **overrides).hidden_size
    g = torch.Generator().manual_seed(seed + 104729)
    out["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=g) * 0.1
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        out[f"mtp.{name}.weight"] = torch.randn(hidden, generator=g) * 0.3
    return out


def save_tiny(family: str, path: Path, seed: int = 0, mtp: bool = True, **overrides):
    """save_pretrained a tiny model of `family` (with a tokenizer, and with `mtp` random mtp.*
    tensors beside the model's, as released checkpoints ship them) into `path`; returns the
    transformers model."""
    from safetensors.torch import load_file, save_file

    model = hf_model(hf_config(family, **overrides), seed=seed)
    model.save_pretrained(path)
    if mtp:
        weights = Path(path) / "model.safetensors"
        tensors = {**load_file(str(weights)), **mtp_tensors(family, seed, **overrides)}
        save_file(tensors, str(weights), metadata={"format": "pt"})
    (Path(path) / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "bos_token_id": 1}))
    tiny_tokenizer().save(str(Path(path) / "tokenizer.json"))
    return model
