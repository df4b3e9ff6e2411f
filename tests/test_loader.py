"""Checkpoint layouts the loader reads (single, sharded, composite, fused experts, mtp.*), the
random load format, and the errors a bad checkpoint or config raises."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from passes import Sequences
from safetensors.torch import load_file, save_file
from tiny_models import hf_config

from deltaserve.layers.config import ConfigError, ModelConfig
from deltaserve.layers.loader import CheckpointError, build_model, fill_random, load_model, load_safetensors


def logits_of(model, ids):
    seqs = Sequences(model)
    seqs.add("s")
    return seqs.run([("s", ids)])[0]


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids])).logits[0]


IDS = [5, 17, 99, 3, 42, 8, 150, 77, 23, 64, 11]


def rewrite(src, dst, edit):
    """Copy a single-file checkpoint with its tensors passed through edit(dict) -> dict."""
    shutil.copytree(src, dst)
    tensors = edit(load_file(str(src / "model.safetensors")))
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_every_parameter_is_written(tiny_checkpoints):
    """Poison every parameter with NaN, load, and find none left: no silently random weights."""
    for path, _ in tiny_checkpoints.values():
        model = build_model(ModelConfig.from_pretrained(path))
        for p in model.parameters():
            p.data.fill_(float("nan"))
        load_safetensors(model, model.checkpoint_tensors(), path, dtype=torch.float32, device="cpu")
        bad = [n for n, p in model.named_parameters() if torch.isnan(p).any()]
        assert bad == []


def test_sharded_checkpoint_with_index(tmp_path, tiny_checkpoints):
    _, hf = tiny_checkpoints["qwen3_5_moe"]
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    ours = logits_of(load_model(tmp_path), IDS)
    ref = hf_logits(hf, IDS)
    assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_composite_checkpoint_text_part(tmp_path):
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    text = hf_config("qwen3_5_moe")
    cfg = Qwen3_5MoeConfig(
        text_config=text.to_dict(),
        vision_config=dict(
            depth=1,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            out_hidden_size=48,
            patch_size=4,
            num_position_embeddings=16,
        ),
    )
    torch.manual_seed(0)
    hf = Qwen3_5MoeForConditionalGeneration(cfg).eval()
    hf.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3_5_moe"
    model = load_model(tmp_path)
    assert model.config.family == "qwen3_5_moe"
    ours, ref = logits_of(model, IDS), hf_logits(hf, IDS)
    assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_fused_expert_layout(tmp_path, tiny_checkpoints):
    """experts.gate_up_proj [E, 2I, H] / experts.down_proj [E, H, I] instead of per-expert tensors."""
    src, hf = tiny_checkpoints["qwen3_5_moe"]

    def fuse(t):
        out = {}
        layers = {k.split(".mlp.experts.")[0] for k in t if ".mlp.experts." in k}
        for prefix in layers:
            n = len({k for k in t if k.startswith(prefix + ".mlp.experts.") and k.endswith("gate_proj.weight")})
            e = [f"{prefix}.mlp.experts.{i}." for i in range(n)]
            out[f"{prefix}.mlp.experts.gate_up_proj"] = torch.stack(
                [torch.cat([t[x + "gate_proj.weight"], t[x + "up_proj.weight"]]) for x in e]
            )
            out[f"{prefix}.mlp.experts.down_proj"] = torch.stack([t[x + "down_proj.weight"] for x in e])
        out.update({k: v for k, v in t.items() if ".mlp.experts." not in k})
        return out

    path = rewrite(src, tmp_path / "fused", fuse)
    ours, ref = logits_of(load_model(path), IDS), hf_logits(hf, IDS)
    assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_mtp_head_loads_its_shard(tiny_checkpoints):
    """With the MTP head, mtp.* load through checkpoint_tensors like any layer: fc and norms whole, the
    decoder layer's attention rows of this rank (here TP = 1: all of them)."""
    from safetensors.torch import load_file

    src, _ = tiny_checkpoints["qwen3_5"]
    saved = load_file(str(src / "model.safetensors"))
    model = load_model(src, mtp=True)
    assert torch.equal(model.mtp.fc, saved["mtp.fc.weight"])
    assert torch.equal(model.mtp.norm.weight, saved["mtp.norm.weight"])
    q_rows = saved["mtp.layers.0.self_attn.q_proj.weight"].shape[0]
    assert torch.equal(model.mtp.layer.mixer.qkv_proj[:q_rows], saved["mtp.layers.0.self_attn.q_proj.weight"])


def test_missing_mtp_tensor_is_named(tmp_path, tiny_checkpoints):
    src, _ = tiny_checkpoints["qwen3_next"]
    gone = "mtp.layers.0.mlp.experts.3.down_proj.weight"
    path = rewrite(src, tmp_path / "missing_mtp", lambda t: {k: v for k, v in t.items() if k != gone})
    load_model(path)  # without speculation the head's tensors are not needed
    with pytest.raises(CheckpointError, match=gone.replace(".", r"\.")):
        load_model(path, mtp=True)


def test_missing_tensor_is_named(tmp_path, tiny_checkpoints):
    src, _ = tiny_checkpoints["qwen3_next"]
    gone = "model.layers.1.self_attn.k_norm.weight"
    path = rewrite(src, tmp_path / "missing", lambda t: {k: v for k, v in t.items() if k != gone})
    with pytest.raises(CheckpointError, match=gone.replace(".", r"\.")):
        load_model(path)


def test_missing_expert_is_named(tmp_path, tiny_checkpoints):
    src, _ = tiny_checkpoints["qwen3_5_moe"]
    gone = "model.layers.2.mlp.experts.4.up_proj.weight"
    path = rewrite(src, tmp_path / "missing_expert", lambda t: {k: v for k, v in t.items() if k != gone})
    with pytest.raises(CheckpointError, match=gone.replace(".", r"\.")):
        load_model(path)


def test_wrong_shape_is_named(tmp_path, tiny_checkpoints):
    src, _ = tiny_checkpoints["qwen3_5"]
    name = "model.layers.0.linear_attn.in_proj_qkv.weight"
    path = rewrite(src, tmp_path / "shape", lambda t: {**t, name: t[name][:-1]})
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.") + r".*shape"):
        load_model(path)


def _write_config(tmp_path, src, **changes):
    shutil.copytree(src, tmp_path / "cfg")
    cfg = json.loads((tmp_path / "cfg" / "config.json").read_text())
    cfg.update(changes)
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(cfg))
    return tmp_path / "cfg"


def test_unknown_model_type_is_named(tmp_path, tiny_checkpoints):
    path = _write_config(tmp_path, tiny_checkpoints["qwen3_5"][0], model_type="llama")
    with pytest.raises(ConfigError, match="model_type.*'llama'"):
        load_model(path)


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope_type"),
        (
            {"layer_types": ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]},
            "layer_types",
        ),
        ({"linear_num_value_heads": 7}, "linear_num_value_heads"),
    ],
)
def test_unsupported_field_value_is_named(tmp_path, tiny_checkpoints, changes, field):
    path = _write_config(tmp_path, tiny_checkpoints["qwen3_5_moe"][0], **changes)
    with pytest.raises(ConfigError, match=field):
        load_model(path)


def test_random_load_format_needs_no_files_and_is_seeded():
    config = ModelConfig.from_hf(hf_config("qwen3_5_moe").to_dict())
    first = load_model(None, config=config, load_format="random", seed=3)
    again = load_model(None, config=config, load_format="random", seed=3)
    other = load_model(None, config=config, load_format="random", seed=4)
    for (name, a), b, c in zip(first.named_parameters(), again.parameters(), other.parameters(), strict=True):
        assert torch.equal(a, b), name
        if a.numel() > 8 and "norm" not in name and "dt_bias" not in name:
            assert not torch.equal(a, c), name


def test_random_fill_writes_every_parameter():
    config = ModelConfig.from_hf(hf_config("qwen3_next").to_dict())
    model = build_model(config)
    for p in model.parameters():
        p.data.fill_(float("nan"))
    fill_random(model.checkpoint_tensors(), seed=0, dtype=torch.float32, device="cpu")
    assert [n for n, p in model.named_parameters() if torch.isnan(p).any()] == []
    logits = logits_of(model, IDS)
    assert torch.isfinite(logits).all() and logits.std() > 0
