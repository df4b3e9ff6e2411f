"""Frozen model configuration, built from a Hugging Face `config.json`.

One `ModelConfig` describes the text stack of every supported family. Families differ in a few
switches (how the GDN input projection is laid out, which layers are MoE, whether top-k routing
weights are renormalised); everything else is shared.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .config_qwen4 import HyperConnectionConfig, PleConfig, QsaConfig, Qwen4ConfigError, parse_qwen4_exp

# model_type -> family. Composite (vision + text) configs carry the text part in `text_config`.
TEXT_FAMILIES = {
    "qwen3_next": "qwen3_next",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe_text": "qwen3_5_moe",
    "qwen4_exp_text": "qwen4_exp",
}
COMPOSITE_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text", "qwen4_exp": "qwen4_exp_text"}
SUPPORTED_MODEL_TYPES = tuple(TEXT_FAMILIES) + tuple(COMPOSITE_TYPES)

ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"
# qwen4_exp's names for its attention layers (all of them have a QSA indexer): transformers' config
# writes one of these (the name changed across its releases), the real checkpoint "full_attention"
INDEXED_ATTENTION = ("indexed_attention", "qwen_sparse_attention")


class ConfigError(ValueError):
    """A config.json field that deltaserve cannot serve; the message names the field."""


def _require(cfg: dict, key: str, model_type: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ConfigError(f"config field '{key}' is missing (model_type={model_type!r})")
    return cfg[key]


@dataclass(frozen=True)
class Fp8Scheme:
    """Block-FP8 weights (config.json's `quantization_config` with `quant_method: fp8`, or
    `quantization="fp8"` on a higher-precision checkpoint): e4m3 weights with one float32 factor
    per `block` (rows, columns), activations quantized at run time. `ignored`: the modules kept in
    the checkpoint's dtype (`modules_to_not_convert` / `ignored_layers`; full names, names within
    a layer such as "mlp.gate", or "re:" patterns). Whatever the list says, the model keeps the
    embedding, lm_head, the MoE router and shared-expert gate and the GDN b / a projections
    unquantized (layers/quant.py)."""

    block: tuple[int, int] = (128, 128)
    ignored: tuple[str, ...] = ()

    @classmethod
    def from_hf(cls, qc: dict) -> Fp8Scheme:
        """From a quantization_config; anything deltaserve cannot serve is a ConfigError naming the field."""
        method = qc.get("quant_method")
        if method != "fp8":
            raise ConfigError(f"config field 'quantization_config.quant_method' is {method!r}; supported: 'fp8'")
        fmt = qc.get("fmt", "e4m3")
        if fmt not in ("e4m3", "float8_e4m3fn"):
            raise ConfigError(f"config field 'quantization_config.fmt' is {fmt!r}; supported: 'e4m3'")
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise ConfigError(
                f"config field 'quantization_config.activation_scheme' is {scheme!r}; supported: 'dynamic'"
            )
        block = qc.get("weight_block_size")
        if block is None:
            raise ConfigError(
                "config field 'quantization_config.weight_block_size' is missing: only block-FP8 checkpoints "
                "(one scale per block) are supported"
            )
        if len(block) != 2 or any(not isinstance(b, int) or b < 1 or b & (b - 1) or b > 128 for b in block):
            raise ConfigError(
                f"config field 'quantization_config.weight_block_size' is {block!r}; supported: two powers of two "
                "up to 128"
            )
        ignored = qc.get("modules_to_not_convert") or qc.get("ignored_layers") or qc.get("ignore") or ()
        return cls(block=(int(block[0]), int(block[1])), ignored=tuple(str(m) for m in ignored))

    def quantizes(self, module: str) -> bool:
        """Whether the checkpoint holds `module` (a text-model module name, "model.layers.3.mlp.experts.7.up_proj")
        in FP8: not named by `ignored` (itself, a parent, a run of its parts for a name within a
        layer, or a pattern). Set lookups: lists of ~900 names checked for ~30,000 expert modules."""
        names, within, patterns = _ignore_index(self.ignored)
        parts = module.split(".")
        runs = (".".join(parts[:end]) for end in range(1, len(parts) + 1))
        if any(run in names for run in runs):
            return False
        if within and any(
            ".".join(parts[i:j]) in within for i in range(1, len(parts)) for j in range(i + 1, len(parts) + 1)
        ):
            return False
        return not any(p.fullmatch(module) for p in patterns)


@functools.cache
def _ignore_index(ignored: tuple[str, ...]) -> tuple[frozenset, frozenset, tuple]:
    """(every plain name, the names within a layer such as "mlp.gate", the compiled "re:" patterns)."""
    plain = [_text_module(e) for e in ignored if not e.startswith("re:")]
    within = frozenset(n for n in plain if not n.startswith(("model.", "lm_head", "mtp.")))
    return frozenset(plain), within, tuple(re.compile(e[3:]) for e in ignored if e.startswith("re:"))


def _text_module(name: str) -> str:
    """A checkpoint module name with the composite model's text prefix mapped as the loader maps tensors."""
    for prefix, repl in (("model.language_model.", "model."), ("language_model.", "")):
        if name.startswith(prefix):
            return repl + name[len(prefix) :]
    return name


@dataclass(frozen=True)
class ModelConfig:
    family: str  # "qwen3_next" | "qwen3_5" | "qwen3_5_moe" | "qwen4_exp"
    model_type: str  # the text model_type as written in the checkpoint
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # gated full attention
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    attention_bias: bool
    # gated delta net
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    conv_kernel_size: int
    # "fused_qkvz": qwen3_next's in_proj_qkvz / in_proj_ba grouped per key head;
    # "split": qwen3_5's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a.
    gdn_projection: str
    # feed-forward: per layer, "moe" or "dense"
    mlp_types: tuple[str, ...]
    intermediate_size: int  # dense MLP width (0 when no layer is dense)
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # the checkpoint's multi-token-prediction head (mtp.*): its decoder layer count and FFN kind
    num_mtp_layers: int = 0
    mtp_mlp_type: str = "dense"
    # block-FP8 weights (the checkpoint's quantization_config, or quantization="fp8" at load)
    quantization: Fp8Scheme | None = None
    # qwen4_exp: QSA sparse attention on every attention layer, hyper-connection residual streams,
    # per-layer n-gram embeddings (config_qwen4.py); None for the other families
    qsa: QsaConfig | None = None
    hyper: HyperConnectionConfig | None = None
    ple: PleConfig | None = None
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def gdn_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def gdn_conv_dim(self) -> int:
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    @property
    def attention_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == ATTENTION)

    @property
    def gdn_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def is_moe(self) -> bool:
        return "moe" in self.mlp_types

    def mtp_layer_config(self) -> ModelConfig:
        """The config of the MTP head's decoder layer: one full-attention layer with the family's
        FFN kind (the head's index 0 decides it, as for the stack's first layer)."""
        return replace(self, num_layers=1, layer_types=(ATTENTION,), mlp_types=(self.mtp_mlp_type,))

    # ---- construction --------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in {model_dir}")
        cfg = json.loads(path.read_text())
        gen_path = Path(model_dir) / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        return cls.from_hf(cfg, generation_config=gen)

    @classmethod
    def from_hf(cls, cfg: dict, generation_config: dict | None = None) -> ModelConfig:
        model_type = cfg.get("model_type")
        quant = cfg.get("quantization_config")  # a composite config holds it at the top level
        if model_type in COMPOSITE_TYPES:
            text = dict(cfg.get("text_config") or {})
            if not text:
                raise ConfigError(f"config field 'text_config' is missing (model_type={model_type!r})")
            text.setdefault("model_type", COMPOSITE_TYPES[model_type])
            # the composite config holds tie_word_embeddings and the token ids at the top level
            for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id"):
                if key in cfg and key not in text:
                    text[key] = cfg[key]
            cfg = text
            model_type = cfg["model_type"]
            quant = quant or cfg.get("quantization_config")
        if model_type not in TEXT_FAMILIES:
            raise ConfigError(
                f"config field 'model_type' is {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        family = TEXT_FAMILIES[model_type]
        req = lambda key: _require(cfg, key, model_type)  # noqa: E731

        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"config field 'hidden_act' is {act!r}; only 'silu' is supported")

        num_layers = int(req("num_hidden_layers"))
        layer_types = cfg.get("layer_types")
        if layer_types is None:
            interval = int(cfg.get("full_attention_interval", 4))
            layer_types = [LINEAR_ATTENTION if (i + 1) % interval else ATTENTION for i in range(num_layers)]
        if family == "qwen4_exp" and isinstance(layer_types, list | tuple):
            layer_types = [ATTENTION if t in INDEXED_ATTENTION else t for t in layer_types]
        layer_types = tuple(layer_types)
        if len(layer_types) != num_layers:
            raise ConfigError(
                f"config field 'layer_types' has {len(layer_types)} entries for num_hidden_layers={num_layers}"
            )
        for t in layer_types:
            if t not in (ATTENTION, LINEAR_ATTENTION):
                raise ConfigError(f"config field 'layer_types' holds {t!r}; supported: {ATTENTION}, {LINEAR_ATTENTION}")

        rope = cfg.get("rope_parameters") or {}
        if cfg.get("rope_scaling"):
            raise ConfigError("config field 'rope_scaling' is set; only unscaled rotary embeddings are supported")
        rope_type = rope.get("rope_type", "default")
        if rope_type != "default":
            raise ConfigError(f"config field 'rope_parameters.rope_type' is {rope_type!r}; only 'default' is supported")
        rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        # Qwen4-Exp's config does not default the factor to 0.25 as Qwen3.5's does: its rotary
        # embedding reads a missing one as 1.0
        default_partial = 1.0 if family == "qwen4_exp" else 0.25
        partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", default_partial)))
        head_dim = int(cfg.get("head_dim") or req("hidden_size") // req("num_attention_heads"))
        rotary_dim = int(head_dim * partial)
        if rotary_dim % 2:
            raise ConfigError(f"config field 'partial_rotary_factor' gives an odd rotary dim {rotary_dim}")

        num_experts = int(cfg.get("num_experts") or 0)
        if family == "qwen3_5":
            mlp_types = ("dense",) * num_layers
            num_experts = 0
            mtp_mlp = "dense"
        elif family in ("qwen3_5_moe", "qwen4_exp"):
            mlp_types = ("moe",) * num_layers
            mtp_mlp = "moe"
            if num_experts <= 0:
                raise ConfigError(f"config field 'num_experts' is {num_experts}; it must be > 0")
        else:  # qwen3_next
            step = int(cfg.get("decoder_sparse_step", 1))
            mlp_only = set(cfg.get("mlp_only_layers") or [])
            mlp_types = tuple(
                "moe" if (i not in mlp_only and num_experts > 0 and (i + 1) % step == 0) else "dense"
                for i in range(num_layers)
            )
            mtp_mlp = mlp_types[0] if num_layers else "dense"
        num_mtp = int(cfg.get("mtp_num_hidden_layers", cfg.get("num_nextn_predict_layers", 0)) or 0)
        ffn_kinds = set(mlp_types) | ({mtp_mlp} if num_mtp else set())
        if "moe" in mlp_types:
            top_k = int(req("num_experts_per_tok"))
            if not 0 < top_k <= num_experts:
                raise ConfigError(f"config field 'num_experts_per_tok' is {top_k}; it must be in 1..{num_experts}")
        else:
            top_k = 0
        # qwen3_5_moe always renormalises the top-k weights (its config has no such field)
        norm_topk = bool(cfg.get("norm_topk_prob", True)) if family in ("qwen3_next", "qwen4_exp") else True

        n_k = int(req("linear_num_key_heads"))
        n_v = int(req("linear_num_value_heads"))
        if n_v % n_k:
            raise ConfigError(
                f"config field 'linear_num_value_heads' ({n_v}) must be a multiple of linear_num_key_heads ({n_k})"
            )
        n_q = int(req("num_attention_heads"))
        n_kv = int(req("num_key_value_heads"))
        if n_q % n_kv:
            raise ConfigError(
                f"config field 'num_attention_heads' ({n_q}) must be a multiple of num_key_value_heads ({n_kv})"
            )

        qsa = hyper = ple = None
        if family == "qwen4_exp":
            for key in ("moe_intermediate_size", "shared_expert_intermediate_size"):
                if not isinstance(cfg.get(key, 0), int) or int(cfg.get(key) or 0) <= 0:
                    raise ConfigError(f"config field '{key}' must be > 0")
            try:
                qsa, hyper, ple = parse_qwen4_exp(cfg, layer_types, int(req("hidden_size")), rotary_dim)
            except Qwen4ConfigError as e:
                raise ConfigError(str(e)) from None

        gen = generation_config or {}
        eos = gen.get("eos_token_id", cfg.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))

        return cls(
            family=family,
            model_type=model_type,
            vocab_size=int(req("vocab_size")),
            hidden_size=int(req("hidden_size")),
            num_layers=num_layers,
            layer_types=layer_types,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            num_attention_heads=n_q,
            num_kv_heads=n_kv,
            head_dim=head_dim,
            rotary_dim=rotary_dim,
            rope_theta=rope_theta,
            attention_bias=bool(cfg.get("attention_bias", False)),
            linear_num_key_heads=n_k,
            linear_num_value_heads=n_v,
            linear_key_head_dim=int(req("linear_key_head_dim")),
            linear_value_head_dim=int(req("linear_value_head_dim")),
            conv_kernel_size=int(cfg.get("linear_conv_kernel_dim", 4)),
            gdn_projection="fused_qkvz" if family == "qwen3_next" else "split",
            mlp_types=mlp_types,
            intermediate_size=int(cfg.get("intermediate_size") or 0) if "dense" in ffn_kinds else 0,
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0) if "moe" in mlp_types else 0,
            shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0)
            if "moe" in mlp_types
            else 0,
            norm_topk_prob=norm_topk,
            eos_token_ids=eos_ids,
            bos_token_id=gen.get("bos_token_id", cfg.get("bos_token_id")),
            num_mtp_layers=num_mtp,
            mtp_mlp_type=mtp_mlp,
            quantization=Fp8Scheme.from_hf(quant) if quant else None,
            qsa=qsa,
            hyper=hyper,
            ple=ple,
            raw=cfg,
        )
