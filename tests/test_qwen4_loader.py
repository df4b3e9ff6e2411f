"""Qwen4-Exp checkpoints: every parameter is written, the PLE n-gram tables load from the shards
save_pretrained writes (concatenated in shard order, as transformers' loader does) or whole, a
missing shard is named, the hash constants are the checkpoint's own, and the random load format
keeps them as computed."""

from __future__ import annotations

import shutil

import pytest
import torch
from passes import Sequences
from safetensors.torch import load_file, save_file
from tiny_qwen4 import hf_logits, save_tiny_qwen4

from deltaserve.layers.config import ModelConfig
from deltaserve.layers.loader import CheckpointError, build_model, load_model, load_safetensors
from deltaserve.layers.ple import chunk_rows, head_vocab_sizes, is_prime, layer_multipliers

IDS = [5, 17, 99, 3, 42, 8, 150, 77, 23, 64, 11, 2, 9, 31, 200, 14, 6, 80, 19]
TABLE = "model.layers.0.ple.ple_embedding.ngram_embedding"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen4_loader")
    return path, save_tiny_qwen4(path)


def rewrite(src, dst, edit):
    shutil.copytree(src, dst)
    save_file(edit(load_file(str(src / "model.safetensors"))), str(dst / "model.safetensors"))
    return dst


def logits_of(model, ids):
    seqs = Sequences(model)
    seqs.add("s")
    return seqs.run([("s", ids)])[0]


def test_every_parameter_is_written(checkpoint):
    path, _ = checkpoint
    model = build_model(ModelConfig.from_pretrained(path))
    for p in model.parameters():
        p.data.fill_(float("nan"))
    load_safetensors(model, model.checkpoint_tensors(), path, dtype=torch.float32, device="cpu")
    assert [n for n, p in model.named_parameters() if torch.isnan(p).any()] == []


def test_tables_load_from_shards_in_shard_order(checkpoint):
    """save_pretrained wrote 12 shards a table (names sort shard_0, shard_1, shard_10, ...): the loaded
    table is transformers' own, row for row."""
    path, hf = checkpoint
    names = load_file(str(path / "model.safetensors")).keys()
    assert f"{TABLE}.shard_11.weight" in names and f"{TABLE}.weight" not in names
    model = load_model(path)
    for ours, theirs in ((model.layers[0].ple, hf.model.layers[0].ple), (model.layers[2].ple, hf.model.layers[2].ple)):
        assert torch.equal(ours.table, theirs.ple_embedding.ngram_embedding.weight)


def test_whole_table_loads_too(checkpoint, tmp_path):
    path, hf = checkpoint

    def merge(tensors):
        for layer in (0, 2):
            prefix = f"model.layers.{layer}.ple.ple_embedding.ngram_embedding"
            shards = sorted(
                (k for k in tensors if k.startswith(f"{prefix}.shard_")), key=lambda k: int(k.split("_")[-1][:-7])
            )
            tensors[f"{prefix}.weight"] = torch.cat([tensors.pop(k) for k in shards])
        return tensors

    merged = rewrite(path, tmp_path / "merged", merge)
    ours, ref = logits_of(load_model(merged), IDS), hf_logits(hf, IDS)
    assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_missing_shard_is_named(checkpoint, tmp_path):
    path, _ = checkpoint
    bad = rewrite(path, tmp_path / "bad", lambda t: {k: v for k, v in t.items() if k != f"{TABLE}.shard_3.weight"})
    with pytest.raises(CheckpointError, match=f"{TABLE}.weight"):
        load_model(bad)


def test_hash_constants_match_transformers_and_the_checkpoint_wins(checkpoint, tmp_path):
    path, hf = checkpoint
    model = load_model(path)
    for i in (0, 2):
        ours, theirs = model.layers[i].ple, hf.model.layers[i].ple.ple_embedding
        assert torch.equal(ours.multipliers, theirs.layer_multipliers)
        assert torch.equal(ours.head_sizes, theirs.ngram_heads_vocab_sizes)
        assert torch.equal(ours.head_offsets, theirs.ngram_heads_offsets)
    name = "model.layers.0.ple.ple_embedding.layer_multipliers"
    edited = rewrite(path, tmp_path / "edited", lambda t: {**t, name: t[name] + 2})
    assert torch.equal(
        load_model(edited).layers[0].ple.multipliers, hf.model.layers[0].ple.ple_embedding.layer_multipliers + 2
    )


def test_random_format_keeps_the_computed_constants(checkpoint):
    path, hf = checkpoint
    model = load_model(None, config=ModelConfig.from_pretrained(path), load_format="random")
    assert torch.equal(model.layers[2].ple.head_sizes, hf.model.layers[2].ple.ple_embedding.ngram_heads_vocab_sizes)
    assert not any(torch.isnan(p).any() for p in model.parameters())


def test_prime_tables_and_shards():
    assert [p for p in range(2, 60) if is_prime(p)] == [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59]
    assert is_prime(20_000_003) and not is_prime(20_000_001)  # 20000001 = 3 x 6666667
    assert chunk_rows(384, 12) == [32] * 12 and chunk_rows(10, 4) == [3, 3, 3, 1] and chunk_rows(5, 12) == [1] * 5
    from transformers.models.qwen4_exp.modeling_qwen4_exp import _build_layer_multipliers, _find_nth_prime_after

    cfg = ModelConfig.from_hf({**_text(), "ngram_vocab_size_base": 1000}).ple
    assert head_vocab_sizes(cfg, 1) == [_find_nth_prime_after(999, n) for n in range(5, 9)]  # 4 heads a layer
    assert layer_multipliers(320, 3, 5, 99) == _build_layer_multipliers(320, 3, 5, 99).tolist()


def _text() -> dict:
    from tiny_qwen4 import text_config

    return text_config().to_dict()
