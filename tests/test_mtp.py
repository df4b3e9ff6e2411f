"""The MTP head (layers/mtp.py) against a plain-torch forward built from the architecture: transformers
drops mtp.* weights, so the reference is its own decoder layer and RMSNorm classes (a full-attention
layer of the family, loaded with the checkpoint's mtp.layers.0 tensors) around fc, the pre-fc norms
and the final norm, fed the target's final hidden states from transformers' uncached forward.

Our head runs over the engine's pass layouts (prefill chunks, decode rows, multi-token verify rows,
batched with other sequences) with its KV in the paged pool; every position's logits must match."""

from __future__ import annotations

import pytest
import torch
from mtp_reference import Reference
from passes import Sequences
from tiny_models import FAMILIES, VOCAB_SIZE, save_tiny

from deltaserve.layers.loader import CheckpointError, load_model

TOL = 1e-4


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist()


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    scale = ref.abs().max().item()
    err = (ours - ref).abs().max().item()
    assert err <= TOL * scale, f"max abs error {err:.3g} exceeds {TOL} x logit scale {scale:.3g}"


@pytest.fixture(scope="module", params=FAMILIES)
def setup(request, tiny_checkpoints):
    path, hf = tiny_checkpoints[request.param]
    return load_model(path, mtp=True), Reference(request.param, path, hf)


def test_mtp_over_chunked_prefill(setup):
    """Chunks of one prompt, each position's next token from the prompt: the head's logits at every
    position, its KV carried across chunks in the paged pool."""
    model, ref = setup
    ids = prompt(31, seed=1)
    seqs = Sequences(model)
    seqs.add("a")
    got, start = [], 0
    for size in (1, 12, 7, 10):
        seqs.run([("a", ids[start : start + size])])
        got.append(seqs.mtp({"a": ids[start + 1 : start + size + 1]})["a"][0])
        start += size
    hidden = ref.target_hidden(ids)[:-1]
    assert_close(torch.cat(got), ref.head(ids[1:], hidden)[0])


@pytest.mark.parametrize("tokens_per_row", [1, 2, 4, 9])
def test_mtp_over_decode_and_verify_rows_batched_with_a_prefill(setup, tokens_per_row):
    """Decode rows (one token) or verify rows (k + 1 tokens a row) of two sequences, with a third
    sequence's prefill chunk in the same pass."""
    model, ref = setup
    seqs = Sequences(model)
    prompts = {"a": prompt(60, seed=2), "b": prompt(60, seed=3), "c": prompt(60, seed=4)}
    lens = {"a": 9, "b": 14}
    for seq in prompts:
        seqs.add(seq)
    seqs.run([("a", prompts["a"][:9]), ("b", prompts["b"][:14])])
    seqs.mtp({s: prompts[s][1 : lens[s] + 1] for s in ("a", "b")})
    got = {s: [] for s in prompts}
    c_done = 0
    for _ in range(3):
        rows = [(s, prompts[s][lens[s] : lens[s] + tokens_per_row]) for s in ("a", "b")]
        rows.insert(1, ("c", prompts["c"][c_done : c_done + 5]))
        seqs.run(rows, tokens_per_row=tokens_per_row)
        nxt = {s: prompts[s][lens[s] + 1 : lens[s] + tokens_per_row + 1] for s in ("a", "b")}
        nxt["c"] = prompts["c"][c_done + 1 : c_done + 6]
        out = seqs.mtp(nxt)
        for s in prompts:
            got[s].append(out[s][0])
        for s in ("a", "b"):
            lens[s] += tokens_per_row
        c_done += 5
    for s, first in (("a", 9), ("b", 14), ("c", 0)):
        n = first + len(torch.cat(got[s]))
        ids = prompts[s][: n + 1]
        logits, _ = ref.head(ids[1:], ref.target_hidden(ids)[:-1])
        assert_close(torch.cat(got[s]), logits[first:])


def test_mtp_drafts_from_its_own_hidden(setup):
    """Drafting past the first token: the row at position m reads the head's own output at m - 1 and
    the draft it predicted, and attends over the target-fed rows before it."""
    model, ref = setup
    ids = prompt(20, seed=5)
    m = 19  # target rows 0 .. m - 1; ids[m] plays the token sampled after them
    seqs = Sequences(model)
    seqs.add("a")
    seqs.run([("a", ids[:m])])
    logits, y = seqs.mtp({"a": ids[1 : m + 1]})["a"]
    chain_ids, chain_hidden = [], []
    for _ in range(3):  # three more drafts, each from the previous one
        draft = int(logits[-1].argmax())
        seqs.run([("a", [0])])  # only the pass layout matters: the head reads `hidden` below
        logits, y = seqs.mtp({"a": [draft]}, hidden={"a": y[-1:]})["a"]
        chain_ids.append(draft)
        chain_hidden.append(y)
    target = ref.target_hidden(ids[: m + 1])[:-1]
    _, ref_y = ref.head(ids[1 : m + 1], target)
    hidden = torch.cat([target, ref_y[-1:]])
    for i, draft in enumerate(chain_ids):
        ref_logits, ref_y_chain = ref.head(ids[1 : m + 1] + chain_ids[: i + 1], hidden)
        assert_close(chain_hidden[i], ref_y_chain[-1:])
        hidden = torch.cat([hidden, ref_y_chain[-1:]])
        assert int(ref_logits[-2].argmax()) == draft


def test_checkpoint_without_mtp_weights_is_an_error(tmp_path):
    save_tiny("qwen3_5", tmp_path, mtp=False)
    assert load_model(tmp_path).mtp is None
    with pytest.raises(CheckpointError, match=r"mtp\.\*"):
        load_model(tmp_path, mtp=True)


def test_config_without_mtp_head_is_an_error(tmp_path):
    save_tiny("qwen3_next", tmp_path, mtp=False, num_nextn_predict_layers=0)
    with pytest.raises(CheckpointError, match="num_nextn_predict_layers"):
        load_model(tmp_path, mtp=True)


def test_mtp_tensors_skipped_without_speculation(tiny_checkpoints, caplog):
    """Without speculation the head is not built: its tensors are neither loaded nor reported."""
    path, _ = tiny_checkpoints["qwen3_5_moe"]
    model = load_model(path)
    assert model.mtp is None
    assert not any(name.startswith("mtp") for name, _ in model.named_parameters())
    assert "ignored" not in caplog.text
