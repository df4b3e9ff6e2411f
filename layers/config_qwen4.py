"""The Qwen4-Exp (`qwen4_exp_text`) parts of a model config: QSA sparse attention on the attention
layers, hyper-connection residual streams and per-layer n-gram embeddings (PLE).

`parse_qwen4_exp` reads them from a config.json dict and applies transformers' own consistency
checks (`Qwen4ExpTextConfig.validate_architecture`) plus what deltaserve needs; every refusal is a
`Qwen4ConfigError` whose message names the field (config.py turns it into its ConfigError).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

QSA_FIELDS = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")


class Qwen4ConfigError(ValueError):
    """A Qwen4-Exp field deltaserve cannot serve; the message names the field."""


@dataclass(frozen=True)
class QsaConfig:
    """The QSA token indexer of every attention layer: `num_heads` query heads and one key head of
    `head_dim`; keys are averaged over `compress_ratio` consecutive tokens into one block key, and each
    query attends to the `budget // compress_ratio` best-scoring complete blocks plus its incomplete tail."""

    num_heads: int
    head_dim: int
    budget: int
    compress_ratio: int

    @property
    def top_blocks(self) -> int:
        return self.budget // self.compress_ratio


@dataclass(frozen=True)
class HyperConnectionConfig:
    """`count` residual streams of hidden_size each, mixed into one block input by a rank-`lowrank` mixer."""

    count: int
    lowrank: int


@dataclass(frozen=True)
class PleConfig:
    """Per-layer n-gram embeddings on `layer_ids` (0-indexed GDN layers): for every n-gram order
    2..ngram_size, `heads_per_ngram` hashed lookups into prime-sized tables, then a depthwise conv of
    `conv_kernel_size` taps dilated by ngram_size."""

    layer_ids: tuple[int, ...]
    embed_dim: int
    conv_kernel_size: int
    ngram_size: int
    heads_per_ngram: int
    vocab_size_base: int
    vocab_divisor: int
    seed: int
    split_parts: int
    eos_token_id: int

    @property
    def num_heads(self) -> int:
        """Hashed heads of one PLE layer, over every n-gram order."""
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def context_len(self) -> int:
        """Earlier tokens an n-gram reads: the per-sequence token context."""
        return self.ngram_size - 1

    @property
    def conv_state_len(self) -> int:
        """Earlier conv inputs the dilated conv reads: the per-sequence conv window."""
        return (self.conv_kernel_size - 1) * self.ngram_size


def _positive_int(cfg: dict, name: str, default: Any = None) -> int:
    value = cfg.get(name, default)
    if value is None:
        raise Qwen4ConfigError(f"config field '{name}' is missing")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise Qwen4ConfigError(f"config field '{name}' must be a positive integer, got {str(value)[:40]}")
    return value


def parse_qsa(cfg: dict, layer_types: tuple[str, ...], rotary_dim: int) -> QsaConfig | None:
    """The QSA config, None when no layer attends (transformers builds an indexer in every attention
    layer, so its fields are required as soon as one exists)."""
    present = [name for name in QSA_FIELDS if cfg.get(name) is not None]
    if "full_attention" not in layer_types:
        return None
    missing = [name for name in QSA_FIELDS if name not in present]
    if missing:
        raise Qwen4ConfigError(f"config field '{missing[0]}' is missing (QSA needs {', '.join(QSA_FIELDS)})")
    values = {name: _positive_int(cfg, name) for name in QSA_FIELDS}
    if values["indexer_kv_heads"] != 1:
        raise Qwen4ConfigError(
            f"config field 'indexer_kv_heads' is {values['indexer_kv_heads']}; Qwen4-Exp QSA requires one key head"
        )
    if values["indexer_budget"] % values["indexer_compress_ratio"]:
        raise Qwen4ConfigError(
            f"config field 'indexer_budget' ({values['indexer_budget']}) must be divisible by "
            f"indexer_compress_ratio ({values['indexer_compress_ratio']})"
        )
    if rotary_dim > values["indexer_head_dim"]:
        raise Qwen4ConfigError(
            f"config field 'indexer_head_dim' ({values['indexer_head_dim']}) must hold the attention's rotary "
            f"dims ({rotary_dim})"
        )
    return QsaConfig(
        num_heads=values["indexer_n_heads"],
        head_dim=values["indexer_head_dim"],
        budget=values["indexer_budget"],
        compress_ratio=values["indexer_compress_ratio"],
    )


def parse_ple(cfg: dict, layer_types: tuple[str, ...], hidden_size: int) -> PleConfig | None:
    ids = cfg.get("ple_layer_ids") or []
    if not isinstance(ids, list | tuple) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise Qwen4ConfigError("config field 'ple_layer_ids' must be a list of one-indexed layer ids")
    ids = sorted(set(ids))
    if not ids:
        return None
    num_layers = len(layer_types)
    bad = [i for i in ids if not 1 <= i <= num_layers]
    if bad:
        raise Qwen4ConfigError(f"config field 'ple_layer_ids' holds {bad[0]}; ids are one-indexed in [1, {num_layers}]")
    not_linear = [i for i in ids if layer_types[i - 1] != "linear_attention"]
    if not_linear:
        raise Qwen4ConfigError(
            f"config field 'ple_layer_ids' names layer {not_linear[0]}, which is not a linear_attention layer"
        )
    ngram_size = _positive_int(cfg, "ngram_size", 3)
    heads_per_ngram = _positive_int(cfg, "heads_per_ngram", 8)
    if ngram_size < 2:
        raise Qwen4ConfigError(f"config field 'ngram_size' is {ngram_size}; PLE needs n-grams of 2 tokens or more")
    embed_dim = _positive_int(cfg, "ple_embed_dim", hidden_size)
    num_heads = (ngram_size - 1) * heads_per_ngram
    if embed_dim % num_heads:
        raise Qwen4ConfigError(
            f"config field 'ple_embed_dim' ({embed_dim}) must be divisible by the n-gram heads "
            f"((ngram_size - 1) * heads_per_ngram = {num_heads})"
        )
    eos = cfg.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if eos is None:
        raise Qwen4ConfigError("config field 'eos_token_id' must be set when PLE layers are enabled")
    seed = cfg.get("seed", 1234)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise Qwen4ConfigError(f"config field 'seed' must be a non-negative integer, got {str(seed)[:40]}")
    return PleConfig(
        layer_ids=tuple(i - 1 for i in ids),
        embed_dim=embed_dim,
        conv_kernel_size=_positive_int(cfg, "ple_conv_kernel_size", 4),
        ngram_size=ngram_size,
        heads_per_ngram=heads_per_ngram,
        vocab_size_base=_positive_int(cfg, "ngram_vocab_size_base", 20_000_000),
        vocab_divisor=_positive_int(cfg, "make_ngram_vocab_size_divisible_by", 128),
        seed=seed,
        split_parts=_positive_int(cfg, "split_ngram_parts", 512),
        eos_token_id=int(eos),
    )


def parse_qwen4_exp(
    cfg: dict, layer_types: tuple[str, ...], hidden_size: int, rotary_dim: int
) -> tuple[QsaConfig | None, HyperConnectionConfig, PleConfig | None]:
    """(QSA, hyper-connections, PLE) of a qwen4_exp_text config; layer_types already mapped to
    "full_attention" / "linear_attention"."""
    gate = cfg.get("output_gate_type") or cfg.get("hidden_act", "silu")
    if gate != "silu":
        raise Qwen4ConfigError(f"config field 'output_gate_type' is {str(gate)[:40]!r}; only 'silu' is supported")
    count = cfg.get("hc_count", 4)
    if isinstance(count, bool) or not isinstance(count, int) or count <= 1:
        raise Qwen4ConfigError(f"config field 'hc_count' must be an integer > 1, got {str(count)[:40]}")
    hyper = HyperConnectionConfig(count=count, lowrank=_positive_int(cfg, "hc_lowrank", 320))
    return parse_qsa(cfg, layer_types, rotary_dim), hyper, parse_ple(cfg, layer_types, hidden_size)
