"""Model shapes for benchmarks with random weights.

    python -m deltaserve.bench.presets qwen3_5_35b_a3b /tmp/qwen35-shape   # writes config.json

The directory then serves with `deltaserve serve --model DIR --load-format random` (token-id
prompts only: it has no tokenizer).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from deltaserve.layers.config import ModelConfig

PRESETS = ("qwen3_5_35b_a3b", "qwen4_exp_24l")

# Qwen4-Exp: transformers' Qwen4ExpTextConfig defaults (hidden 2048, 512 experts top-10 of width 512
# and a shared expert, 4 hyper-connection streams of rank 320, vocabulary 248,320) at 24 layers
# instead of 40 (18 GDN + 6 QSA attention): the 40 layers hold 67 B parameters, 135 GB in bf16, more
# than one H200 holds with room for KV and state. The defaults set no QSA (an attention layer cannot be
# built without it), no PLE and no EOS, and the default PLE table (16 heads x 20 M rows x 128 per layer,
# 82 GB) does not fit: QSA as below (16 indexer heads of 128, budget 2048 tokens in blocks of 16), the
# rotary part of Qwen3.5 (a quarter of the head), PLE on the first two GDN layers with tables of 1 M
# rows a head (4 GB a layer), and the Qwen3.5 vocabulary's <|endoftext|> as EOS. 45.0 B parameters,
# 90 GB in bf16.
QWEN4_EXP_24L = dict(
    num_hidden_layers=24,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    indexer_n_heads=16,
    indexer_kv_heads=1,
    indexer_head_dim=128,
    indexer_budget=2048,
    indexer_compress_ratio=16,
    ple_layer_ids=[1, 2],
    ngram_vocab_size_base=1_000_000,
    eos_token_id=248044,
)


def preset_hf_config(name: str) -> dict:
    """The transformers config dict of a preset (the reference model of docs/PERF.md)."""
    if name == "qwen3_5_35b_a3b":
        from transformers import Qwen3_5MoeTextConfig

        return Qwen3_5MoeTextConfig().to_dict()
    if name == "qwen4_exp_24l":
        from transformers import Qwen4ExpTextConfig

        return Qwen4ExpTextConfig(**QWEN4_EXP_24L).to_dict()
    raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")


def preset_config(name: str) -> ModelConfig:
    return ModelConfig.from_hf(preset_hf_config(name))


def write_preset_dir(name: str, out: str | Path) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(preset_hf_config(name), indent=1, default=str))
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    print(write_preset_dir(sys.argv[1], sys.argv[2]))
