"""Qwen4-Exp configs: what `ModelConfig.from_hf` reads from the text and composite configs, and every
value it cannot serve refused with an error naming the field (transformers' own consistency checks
among them: those cases are refused by transformers too)."""

from __future__ import annotations

import pytest
from tiny_qwen4 import QWEN4_TEXT, composite_config, text_config

from deltaserve.layers.config import ConfigError, ModelConfig


def text_dict(**changes) -> dict:
    cfg = text_config().to_dict()
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    return cfg


def test_text_config_fields():
    c = ModelConfig.from_hf(text_dict())
    assert c.family == "qwen4_exp" and c.model_type == "qwen4_exp_text"
    assert c.layer_types == ("linear_attention", "full_attention") * 2
    assert c.mlp_types == ("moe",) * 4 and c.gdn_projection == "split"
    assert c.rotary_dim == 8  # head_dim 16 x partial_rotary_factor 0.5
    assert (c.qsa.num_heads, c.qsa.head_dim, c.qsa.budget, c.qsa.compress_ratio, c.qsa.top_blocks) == (4, 12, 12, 3, 4)
    assert (c.hyper.count, c.hyper.lowrank) == (3, 10)
    ple = c.ple
    assert ple.layer_ids == (0, 2) and ple.num_heads == 4 and ple.head_dim == 6
    assert (ple.context_len, ple.conv_state_len, ple.eos_token_id, ple.split_parts) == (2, 6, 2, 12)


def test_composite_config_reads_the_text_part():
    c = ModelConfig.from_hf(composite_config().to_dict())
    assert c.family == "qwen4_exp" and c.model_type == "qwen4_exp_text"
    assert c.qsa == ModelConfig.from_hf(text_dict()).qsa and c.ple.layer_ids == (0, 2)


def test_defaults_read_as_transformers_reads_them():
    """Without partial_rotary_factor the rotary part is the whole head (transformers' Qwen4-Exp reads
    a missing factor as 1.0, not Qwen3.5's 0.25); without ple_layer_ids there is no PLE."""
    cfg = text_dict(ple_layer_ids=None, indexer_head_dim=16)
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    c = ModelConfig.from_hf(cfg)
    assert c.rotary_dim == 16 and c.ple is None


# (changes, field named, transformers refuses it too)
BAD = [
    (dict(indexer_kv_heads=2), "indexer_kv_heads", True),
    (dict(indexer_budget=13), "indexer_budget", True),
    (dict(indexer_head_dim=None), "indexer_head_dim", True),
    (dict(indexer_compress_ratio=0), "indexer_compress_ratio", True),
    (dict(indexer_head_dim=6), "indexer_head_dim", True),  # smaller than the rotary part (8)
    (dict(hc_count=1), "hc_count", True),
    (dict(ple_layer_ids=[2]), "ple_layer_ids", True),  # an attention layer
    (dict(ple_layer_ids=[5]), "ple_layer_ids", True),  # past the last layer
    (dict(ple_embed_dim=25), "ple_embed_dim", True),
    (dict(eos_token_id=None), "eos_token_id", True),
    (dict(num_experts_per_tok=7), "num_experts_per_tok", True),
    (dict(moe_intermediate_size=0), "moe_intermediate_size", True),
    (dict(layer_types=["linear_attention", "sliding_attention"] * 2), "layer_types", True),
    (dict(output_gate_type="sigmoid"), "output_gate_type", False),  # transformers has it; not served yet
    (dict(hidden_act="gelu"), "hidden_act", True),
]


@pytest.mark.parametrize("changes, field, transformers_refuses", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_bad_value_names_the_field(changes, field, transformers_refuses):
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_hf(text_dict(**changes))
    with pytest.raises(ConfigError, match=field):  # the same inside a composite config
        ModelConfig.from_hf({"model_type": "qwen4_exp", "text_config": text_dict(**changes)})
    if transformers_refuses:
        from transformers import Qwen4ExpTextConfig

        kw = {k: v for k, v in {**QWEN4_TEXT, **changes}.items() if v is not None}
        with pytest.raises(Exception):  # noqa: B017 - transformers raises ValueError or a strict-dataclass error
            Qwen4ExpTextConfig(**kw)


def test_missing_qsa_config_is_named():
    """An attention layer needs an indexer: no QSA fields at all is refused (transformers cannot build it)."""
    from deltaserve.layers.config_qwen4 import QSA_FIELDS

    with pytest.raises(ConfigError, match="indexer_n_heads"):
        ModelConfig.from_hf(text_dict(**dict.fromkeys(QSA_FIELDS)))


def test_tp_layout_checks_the_ple_tables():
    """Each rank holds a column slice of every PLE table row: a head dim TP does not divide fails
    before any weight is read, naming it."""
    from deltaserve.layers.parallel import ParallelConfigError, ParallelLayout, validate_layout

    config = ModelConfig.from_hf(text_dict())  # 4 n-gram heads of 6 dims
    validate_layout(config, ParallelLayout(tp_rank=0, tp_size=2))
    with pytest.raises(ParallelConfigError, match="ple_embed_dim"):
        validate_layout(ModelConfig.from_hf(text_dict(ple_embed_dim=20)), ParallelLayout(tp_rank=0, tp_size=2))


@pytest.mark.parametrize("name", ["indexed_attention", "qwen_sparse_attention", "full_attention"])
def test_attention_layer_names_of_every_writer(name):
    """transformers' releases name the QSA layers differently (the checkpoint says full_attention):
    every name reads as an attention layer with its indexer."""
    cfg = text_dict(layer_types=["linear_attention", name] * 2)
    c = ModelConfig.from_hf(cfg)
    assert c.layer_types == ("linear_attention", "full_attention") * 2 and c.qsa is not None


def test_bench_preset_reads():
    """The Qwen4-Exp benchmark shape builds (the 24-layer preset of docs/PERF.md)."""
    from deltaserve.bench.presets import preset_config

    c = preset_config("qwen4_exp_24l")
    assert c.family == "qwen4_exp" and c.num_layers == 24 and c.layer_types.count("full_attention") == 6
