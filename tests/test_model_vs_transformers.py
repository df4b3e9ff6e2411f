"""The layer stack against transformers on tiny random checkpoints (CPU, float32): whole prompts,
chunked prompts, several sequences in one pass, and token-by-token decode over shared pools."""

from __future__ import annotations

import pytest
import torch
from passes import Sequences
from tiny_models import FAMILIES, VOCAB_SIZE

from deltaserve.layers.loader import load_model

TOL = 1e-4  # max abs error relative to the largest reference logit


def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    scale = ref.abs().max().item()
    err = (ours - ref).abs().max().item()
    assert err <= TOL * scale, f"max abs error {err:.3g} exceeds {TOL} x logit scale {scale:.3g}"


def prompt(n: int, seed: int, vocab: int = VOCAB_SIZE) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


@pytest.fixture(scope="module", params=FAMILIES)
def family_models(request, tiny_checkpoints):
    path, hf = tiny_checkpoints[request.param]
    return load_model(path), hf


def test_whole_prompt_logits(family_models):
    model, hf = family_models
    seqs = Sequences(model)
    ids = prompt(37, seed=1)
    seqs.add("a")
    (ours,) = seqs.run([("a", ids)])
    assert_close(ours, hf_logits(hf, ids))


@pytest.mark.parametrize("chunks", [[1, 63, 10], [64, 5], [7, 7, 7, 7, 7, 5, 30], [70, 1, 1, 1]])
def test_chunked_prompt(family_models, chunks):
    model, hf = family_models
    seqs = Sequences(model)
    ids = prompt(sum(chunks), seed=2)
    seqs.add("a")
    got, start = [], 0
    for size in chunks:
        (part,) = seqs.run([("a", ids[start : start + size])])
        got.append(part)
        start += size
    assert_close(torch.cat(got), hf_logits(hf, ids))


def test_varlen_batch_one_pass(family_models):
    """Several sequences of different lengths in one pass (cu_seqlens), two already part-cached."""
    model, hf = family_models
    seqs = Sequences(model)
    prompts = {"a": prompt(13, 3), "b": prompt(70, 4), "c": prompt(1, 5), "d": prompt(33, 6)}
    for s in prompts:
        seqs.add(s)
    seqs.run([("a", prompts["a"][:5]), ("d", prompts["d"][:20])])
    out = seqs.run([("b", prompts["b"]), ("a", prompts["a"][5:]), ("c", prompts["c"]), ("d", prompts["d"][20:])])
    assert_close(out[0], hf_logits(hf, prompts["b"]))
    assert_close(out[1], hf_logits(hf, prompts["a"])[5:])
    assert_close(out[2], hf_logits(hf, prompts["c"]))
    assert_close(out[3], hf_logits(hf, prompts["d"])[20:])


def test_decode_after_prefill_in_shared_pools(family_models):
    """Prefill, then decode token by token with other sequences in the same passes."""
    model, hf = family_models
    seqs = Sequences(model)
    full = {"a": prompt(30, 7), "b": prompt(45, 8), "c": prompt(26, 9)}
    prefill_len = {"a": 17, "b": 40, "c": 9}
    for s in full:
        seqs.add(s)
    got = {s: [] for s in full}
    first = seqs.run([(s, full[s][: prefill_len[s]]) for s in full])
    for s, logits in zip(full, first, strict=True):
        got[s].append(logits)
    pos = dict(prefill_len)
    while any(pos[s] < len(full[s]) for s in full):
        rows = [(s, [full[s][pos[s]]]) for s in full if pos[s] < len(full[s])]
        for (s, _), logits in zip(rows, seqs.run(rows), strict=True):
            got[s].append(logits)
            pos[s] += 1
    for s in full:
        assert_close(torch.cat(got[s]), hf_logits(hf, full[s]))
