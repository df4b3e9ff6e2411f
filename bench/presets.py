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

PRESETS = ("qwen3_5_35b_a3b",)


def preset_hf_config(name: str) -> dict:
    """The transformers config dict of a preset (the reference model of docs/PERF.md)."""
    if name != "qwen3_5_35b_a3b":
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig().to_dict()


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
